"""
Run a distributed DGL training job on one host by simulating K machines.

DGL's distributed engine normally runs on K machines started over ssh by
DGL's tools/launch.py. To try the same code path on a laptop or in CI, this
launcher gives each simulated machine what DGL expects from a real one:

- its own network namespace and IP address, joined to the others through a
  bridge (DGL finds "which machine am I" by matching ip_config addresses
  against the host's interfaces, so all K machines must not share one);
- its own /dev/shm (a private tmpfs in a mount namespace), because servers
  hand their partition to the trainers of their machine through shared memory
  under fixed names, which would collide between machines on one host.

It then starts the servers and trainers of every machine with the same
environment variables tools/launch.py sets, streams trainer 0's output
unchanged to stdout (everything else, prefixed, to stderr), and stops the job
as soon as any process fails. Every namespace and process it created is
removed at the end, on failure, on Ctrl-C and on timeout. Needs root and
iproute2 (ip, unshare, nsenter). Nothing leaves the namespaces: the bridge
has no route to any other network.

    python scripts/launch_local.py --part-config partitions/synthetic/synthetic.json \
        --num-machines 2 --trainers-per-machine 1 -- --epochs 10 --batch-size 1024

Arguments after `--` go to the training script; the launcher adds
--ip-config and --part-config itself.

Call tree:
main
├── parse_args / validate_args / check_prerequisites
├── plan_job                  addresses, ports, namespace names, environments
└── run_job                   (always cleans up in finally)
    ├── create_network        netns per machine + bridge in a hub netns
    ├── start_machine_holder  mount namespace with private /dev/shm per machine
    ├── start_process         servers, then trainers, via nsenter
    ├── wait_for_job          first failure or the timeout stops everything
    └── cleanup               kill process groups, delete namespaces
"""
import argparse
import json
import os
import queue
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

DEFAULT_SCRIPT = os.path.join(os.path.dirname(__file__), "dist_node_classification.py")
# Interface name of each machine's link inside its own namespace.
MACHINE_IFNAME = "eth0"
# After the trainers finish, servers need a moment to receive the shutdown.
SERVER_EXIT_GRACE_S = 30


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Simulate a multi-machine DGL distributed job on one host "
        "(root + iproute2). Trainer arguments follow '--'.",
    )
    parser.add_argument(
        "--part-config", required=True,
        help="Partition config from partition_graph.py (one partition per machine).",
    )
    parser.add_argument(
        "--num-machines", type=int, required=True,
        help="Simulated machines; must equal the number of partitions.",
    )
    parser.add_argument(
        "--trainers-per-machine", type=int, default=1,
        help="Trainer processes per machine. Default: 1",
    )
    parser.add_argument(
        "--servers-per-machine", type=int, default=1,
        help="Graph server processes per machine (1 main + backups). Default: 1",
    )
    parser.add_argument(
        "--script", default=DEFAULT_SCRIPT,
        help="Training script run by servers and trainers. "
        "Default: dist_node_classification.py beside this launcher.",
    )
    parser.add_argument(
        "--omp-threads", type=int, default=None,
        help="OMP threads per trainer. Default: host cores / all trainers, at least 1.",
    )
    parser.add_argument(
        "--timeout", type=float, default=1800,
        help="Stop the whole job after this many seconds. Default: 1800",
    )
    parser.add_argument(
        "trainer_args", nargs=argparse.REMAINDER,
        help="'--' followed by the training script's arguments.",
    )
    args = parser.parse_args(argv)
    if args.trainer_args[:1] == ["--"]:
        args.trainer_args = args.trainer_args[1:]
    return args


def read_num_samplers(trainer_args):
    """DGL needs the sampler count in the environment of every process."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--num-workers", type=int, default=0)
    known, _ = parser.parse_known_args(trainer_args)
    return known.num_workers


def validate_args(args):
    """One clear line for each bad value, before anything is created."""
    for name in ("num_machines", "trainers_per_machine", "servers_per_machine"):
        if getattr(args, name) < 1:
            sys.exit(f"error: --{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.timeout <= 0:
        sys.exit(f"error: --timeout must be positive, got {args.timeout}")
    if args.omp_threads is not None and args.omp_threads < 1:
        sys.exit(f"error: --omp-threads must be at least 1, got {args.omp_threads}")
    if not os.path.isfile(args.script):
        sys.exit(f"error: --script {args.script} does not exist")
    for flag in ("--ip-config", "--part-config"):
        if any(a == flag or a.startswith(flag + "=") for a in args.trainer_args):
            sys.exit(f"error: do not pass {flag} after '--'; the launcher sets it")
    if read_num_samplers(args.trainer_args) < 0:
        sys.exit("error: --num-workers must not be negative")
    try:
        with open(args.part_config) as f:
            config = json.load(f)
    except FileNotFoundError:
        sys.exit(f"error: --part-config {args.part_config} does not exist")
    except (json.JSONDecodeError, UnicodeDecodeError):
        sys.exit(f"error: --part-config {args.part_config} is not a DGL partition config")
    num_parts = config.get("num_parts") if isinstance(config, dict) else None
    if num_parts is None:
        sys.exit(f"error: --part-config {args.part_config} is not a DGL partition config")
    if num_parts != args.num_machines:
        sys.exit(
            f"error: --part-config {args.part_config} has {num_parts} partitions "
            f"but --num-machines is {args.num_machines}"
        )


def check_prerequisites():
    """Namespaces need root and iproute2/util-linux; say so in one line."""
    if os.geteuid() != 0:
        sys.exit("error: launch_local.py needs root to create network and mount namespaces")
    missing = [tool for tool in ("ip", "unshare", "nsenter") if shutil.which(tool) is None]
    if missing:
        sys.exit(f"error: launch_local.py needs {', '.join(missing)} (iproute2, util-linux) on PATH")


def plan_job(args, run_id, work_dir):
    """Decide every name, address, port and environment of the job."""
    rng = random.Random(run_id)
    # Unique per run so two jobs never share a name; the namespaces are
    # private, so the subnet cannot clash with the host's networks.
    subnet = f"10.{rng.randrange(64, 256)}.{rng.randrange(0, 256)}"
    server_port = rng.randrange(20000, 40000)
    num_machines = args.num_machines
    num_trainers = num_machines * args.trainers_per_machine
    num_samplers = read_num_samplers(args.trainer_args)
    omp_threads = args.omp_threads or max(1, (os.cpu_count() or 1) // num_trainers)
    machines = [
        {"id": m, "netns": f"dglsim{run_id}m{m}", "ip": f"{subnet}.{m + 1}"}
        for m in range(num_machines)
    ]
    ip_config = os.path.join(work_dir, "ip_config.txt")
    with open(ip_config, "w") as f:
        f.writelines(f"{m['ip']} {server_port}\n" for m in machines)
    part_config = os.path.abspath(args.part_config)
    # The variables DGL's tools/launch.py sets for servers and clients.
    common_env = {
        "DGL_NUM_SAMPLER": str(num_samplers),
        "DGL_NUM_CLIENT": str(num_trainers * (1 + num_samplers)),
        "DGL_CONF_PATH": part_config,
        "DGL_IP_CONFIG": ip_config,
        "DGL_NUM_SERVER": str(args.servers_per_machine),
        "DGL_GRAPH_FORMAT": "csc",
    }
    command = [sys.executable, os.path.abspath(args.script), *args.trainer_args,
               "--ip-config", ip_config, "--part-config", part_config]
    processes = []
    for machine in machines:
        for s in range(args.servers_per_machine):
            server_id = machine["id"] * args.servers_per_machine + s
            env = dict(common_env, DGL_ROLE="server", OMP_NUM_THREADS="1",
                       DGL_SERVER_ID=str(server_id))
            processes.append({"name": f"machine {machine['id']} server {s}",
                              "machine": machine, "role": "server", "env": env,
                              "port": server_port + s})
    master_port = server_port + args.servers_per_machine + rng.randrange(1, 1000)
    for machine in machines:
        for t in range(args.trainers_per_machine):
            rank = machine["id"] * args.trainers_per_machine + t
            env = dict(
                common_env,
                DGL_DIST_MODE="distributed", DGL_ROLE="client", DGL_GROUP_ID="0",
                OMP_NUM_THREADS=str(omp_threads),
                # torch.distributed rendezvous, as torchrun would set it.
                MASTER_ADDR=machines[0]["ip"], MASTER_PORT=str(master_port),
                RANK=str(rank), WORLD_SIZE=str(num_trainers),
                LOCAL_RANK=str(t), LOCAL_WORLD_SIZE=str(args.trainers_per_machine),
                # gloo must use the machine's own link, not loopback.
                GLOO_SOCKET_IFNAME=MACHINE_IFNAME,
            )
            processes.append({"name": f"machine {machine['id']} trainer {t} (rank {rank})",
                              "machine": machine, "role": "trainer", "rank": rank, "env": env})
    return {"machines": machines, "hub": f"dglsim{run_id}hub", "processes": processes,
            "command": command, "timeout": args.timeout}


def ip(*arguments):
    """Run one iproute2 command; raise with its own message on failure."""
    result = subprocess.run(["ip", *arguments], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(arguments)}: {result.stderr.strip()}")


def create_network(plan, created_netns):
    """One netns per machine, each linked by a veth pair to a bridge in a hub netns."""
    hub = plan["hub"]
    # Recorded before creation, so an interrupt in between still cleans up.
    created_netns.append(hub)
    ip("netns", "add", hub)
    ip("-n", hub, "link", "add", "br0", "type", "bridge")
    ip("-n", hub, "link", "set", "br0", "up")
    for machine in plan["machines"]:
        ns, port = machine["netns"], f"m{machine['id']}"
        created_netns.append(ns)
        ip("netns", "add", ns)
        ip("-n", ns, "link", "add", MACHINE_IFNAME, "type", "veth", "peer", "name", port, "netns", hub)
        ip("-n", hub, "link", "set", port, "master", "br0", "up")
        ip("-n", ns, "addr", "add", f"{machine['ip']}/24", "dev", MACHINE_IFNAME)
        ip("-n", ns, "link", "set", MACHINE_IFNAME, "up")
        ip("-n", ns, "link", "set", "lo", "up")


def _die_with_parent():
    """Children get SIGKILL if the launcher itself is killed (no orphans)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def start_machine_holder(machine):
    """A process whose mount namespace (private /dev/shm) the machine's processes join."""
    script = "mount -t tmpfs tmpfs /dev/shm && echo ready && exec sleep infinity"
    return subprocess.Popen(
        ["ip", "netns", "exec", machine["netns"],
         "unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, preexec_fn=_die_with_parent,
    )


def wait_until_ready(holder, machine, timeout):
    ready, _, _ = select.select([holder.stdout], [], [], timeout)
    if not ready or holder.stdout.readline().strip() != "ready":
        holder.kill()
        raise RuntimeError(f"could not create the mount namespace of machine "
                           f"{machine['id']}: {holder.stderr.read().strip()}")


def forward_output(proc, name, passthrough):
    """Trainer 0 prints the job's result lines unchanged; others are prefixed."""
    for line in proc.stdout:
        if passthrough:
            sys.stdout.write(line)
            sys.stdout.flush()
        else:
            sys.stderr.write(f"[{name}] {line}")


def start_process(spec, holder_pid, command):
    env = dict(os.environ, **spec["env"])
    proc = subprocess.Popen(
        ["nsenter", "--target", str(holder_pid), "--mount", "--net",
         f"--wd={os.getcwd()}", "--", *command],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        # Own process group: cleanup also reaches sampler processes it spawns.
        start_new_session=True, preexec_fn=_die_with_parent,
    )
    passthrough = spec.get("rank") == 0
    thread = threading.Thread(target=forward_output, args=(proc, spec["name"], passthrough), daemon=True)
    thread.start()
    return {"spec": spec, "proc": proc, "thread": thread}


def is_listening(pid, port):
    """True once a TCP socket listens on port in pid's network namespace.

    Read from /proc rather than probed: a test connection would reach DGL's
    server as a bogus client.
    """
    try:
        with open(f"/proc/{pid}/net/tcp") as f:
            rows = [line.split() for line in f.readlines()[1:]]
    except OSError:
        return False
    listen_state = "0A"
    return any(row[3] == listen_state and int(row[1].split(":")[1], 16) == port
               for row in rows)


def wait_until_servers_listen(servers, deadline):
    """Start trainers only then: DGL's clients sleep 3 s between connect tries."""
    while not all(is_listening(item["proc"].pid, item["spec"]["port"]) for item in servers):
        if time.monotonic() > deadline or any(item["proc"].poll() is not None for item in servers):
            return  # wait_for_job reports the reason
        time.sleep(0.1)


def watch_exit(item, exits):
    """Report the process's exit code, in the order processes exit."""
    exits.put((item, item["proc"].wait()))


def wait_for_job(running, exits, deadline):
    """Return None on success, or one line saying why the job failed."""
    trainers_left = sum(item["spec"]["role"] == "trainer" for item in running)
    processes_left = len(running)
    servers_deadline = None
    while processes_left > 0:
        limit = min(deadline, servers_deadline or deadline)
        try:
            item, code = exits.get(timeout=max(0.0, limit - time.monotonic()))
        except queue.Empty:
            if limit == servers_deadline:
                return "servers did not shut down after the trainers finished"
            return "the job did not finish within --timeout; stopping it"
        # The first failure is the cause; later ones are usually its echo.
        if code != 0:
            return f"{item['spec']['name']} exited with code {code}; stopping the job"
        processes_left -= 1
        if item["spec"]["role"] == "trainer":
            trainers_left -= 1
            if trainers_left == 0:
                # Trainer 0 shuts the servers down as it exits.
                servers_deadline = time.monotonic() + SERVER_EXIT_GRACE_S
    return None


def kill_group(proc):
    """SIGKILL the process group we created for proc, then reap it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    else:
        # The leader is gone; its children (sampler processes) may remain.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def cleanup(running, holders, created_netns, work_dir):
    for item in running:
        kill_group(item["proc"])
    for item in running:
        item["thread"].join(timeout=5)
    for holder in holders:
        kill_group(holder)
    for ns in reversed(created_netns):
        # Deleting a namespace also deletes the veth pairs and bridge inside it.
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    shutil.rmtree(work_dir, ignore_errors=True)


def run_job(args, run_id):
    work_dir = tempfile.mkdtemp(prefix=f"dglsim{run_id}-")
    running, holders, created_netns = [], [], []
    try:
        plan = plan_job(args, run_id, work_dir)
        deadline = time.monotonic() + plan["timeout"]
        create_network(plan, created_netns)
        holder_pids = {}
        for machine in plan["machines"]:
            holders.append(start_machine_holder(machine))
            wait_until_ready(holders[-1], machine, timeout=30)
            holder_pids[machine["id"]] = holders[-1].pid
        exits = queue.Queue()
        for role in ("server", "trainer"):
            for spec in (spec for spec in plan["processes"] if spec["role"] == role):
                holder_pid = holder_pids[spec["machine"]["id"]]
                running.append(start_process(spec, holder_pid, plan["command"]))
                threading.Thread(target=watch_exit, args=(running[-1], exits), daemon=True).start()
            if role == "server":
                wait_until_servers_listen(running, deadline)
        failure = wait_for_job(running, exits, deadline)
    except RuntimeError as e:
        failure = str(e)
    finally:
        # A second Ctrl-C must not cut the cleanup short.
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)
        cleanup(running, holders, created_netns, work_dir)
    return failure


def _exit_on_signal(signum, frame):
    # Raising here unwinds through run_job's finally, which cleans up.
    raise SystemExit(128 + signum)


def main():
    args = parse_args()
    validate_args(args)
    check_prerequisites()
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)
    signal.signal(signal.SIGHUP, _exit_on_signal)
    failure = run_job(args, run_id=os.getpid())
    if failure is not None:
        print(f"error: {failure}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
