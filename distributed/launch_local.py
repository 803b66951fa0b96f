"""
Run a distributed DGL training job on one host by simulating K machines.

DGL's distributed engine normally runs on K machines started over ssh by
DGL's tools/launch.py. To try the same code path on a laptop or in CI, this
launcher gives each simulated machine what DGL expects from a real one:

- its own network namespace and IP address, joined to the others through a
  bridge in a hub namespace (DGL finds "which machine am I" by matching
  ip_config addresses against the host's interfaces, so the K machines must
  not share one);
- its own /dev/shm (a private tmpfs in a mount namespace), because servers
  hand their partition to the trainers of their machine through shared memory
  under fixed names, which would collide between machines on one host.

It then starts the servers and trainers of every machine with the same
environment variables tools/launch.py sets, streams trainer 0's output
unchanged to stdout and stderr (everything else, prefixed, to stderr), and
stops the job as soon as any process fails. SIGTERM or SIGINT (Ctrl-C) asks
every trainer to stop at one step with a checkpoint, as a scheduler's
signal would; a second one, SIGHUP, a failure or the timeout stop the job
at once. Every process it created is stopped at the end and (by SIGKILL
from the kernel) when the launcher itself is killed; the namespaces have no
names and vanish with their processes. Needs root, iproute2 and util-linux
(ip, unshare, nsenter, setpriv). Nothing leaves the namespaces: the bridge
has no route to any other network.

    python distributed/launch_local.py --part-config partitions/synthetic/synthetic.json \
        --num-machines 2 --trainers-per-machine 1 -- --epochs 10 --batch-size 1024

Arguments after `--` go to the training script; the launcher adds
--ip-config and --part-config itself. It imports no torch, so that it
starts and refuses bad input at once.

Call tree:
main
├── parse_args / validate_args / check_prerequisites
├── plan_machines             addresses, ports, environments of every process
└── run_job                   (always cleans up in finally)
    ├── start_holder          namespaces: a hub with a bridge, one per machine
    ├── link_machines         veth pairs from the machines to the bridge
    ├── start_process         servers, then trainers, via nsenter
    ├── wait_for_job          first failure or the timeout stops everything;
    │                         a stop request goes to the trainers
    └── cleanup               kill the process groups (namespaces go with them)
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

from gbrun.cli import ArgumentParser, fail, int_at_least, positive_float

DEFAULT_SCRIPT = os.path.join(os.path.dirname(__file__), "dist_node_classification.py")

# Interface name of each machine's link inside its own namespace.
MACHINE_IFNAME = "eth0"
# After the trainers finish, servers need a moment to receive the shutdown.
SERVER_EXIT_GRACE_S = 30
# Prefix for every child: the kernel SIGKILLs it if the launcher dies, even by
# SIGKILL, so no process (and so no namespace) outlives the launcher.
DIE_WITH_LAUNCHER = ["setpriv", "--pdeathsig", "KILL", "--"]


def parse_args(argv=None):
    parser = ArgumentParser(
        description="Simulate a multi-machine DGL distributed job on one host "
        "(root + iproute2). Trainer arguments follow '--'.",
    )
    parser.add_argument(
        "--part-config", required=True,
        help="Partition config from partition_graph.py (one partition per machine).",
    )
    parser.add_argument(
        "--num-machines", type=int_at_least(1), required=True,
        help="Simulated machines; must equal the number of partitions.",
    )
    parser.add_argument(
        "--trainers-per-machine", type=int_at_least(1), default=1,
        help="Trainer processes per machine; on GPUs, one per GPU, as DGL's "
        "--num_gpus. Default: 1",
    )
    parser.add_argument(
        "--servers-per-machine", type=int_at_least(1), default=1,
        help="Graph server processes per machine (1 main + backups). Default: 1",
    )
    parser.add_argument(
        "--script", default=DEFAULT_SCRIPT,
        help="Training script run by servers and trainers. "
        "Default: dist_node_classification.py beside this launcher.",
    )
    parser.add_argument(
        "--omp-threads", type=int_at_least(1), default=None,
        help="OMP threads per trainer. Default: host cores / all trainers, at least 1.",
    )
    parser.add_argument(
        "--timeout", type=positive_float, default=1800,
        help="Stop the whole job after this many seconds. Default: 1800",
    )
    parser.add_argument(
        "--as-tools-launch", action="store_true",
        help="Start each machine's part as DGL's tools/launch.py does (its"
        " trainers under one torch.distributed.run) and stop nothing on a"
        " failure: the job must end by itself (--timeout still stops it)."
        " At the end, say what each machine's /dev/shm holds. For the tests"
        " of how a job fails on a real cluster.",
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
    parser = ArgumentParser(add_help=False)
    parser.add_argument("--num-workers", type=int_at_least(0), default=0)
    known, _ = parser.parse_known_args(trainer_args)
    return known.num_workers


def validate_args(args):
    """One clear line for each bad value, before anything is created."""
    if not os.path.isfile(args.script):
        fail(f"--script {args.script} does not exist")
    for flag in ("--ip-config", "--part-config"):
        if any(a == flag or a.startswith(flag + "=") for a in args.trainer_args):
            fail(f"do not pass {flag} after '--'; the launcher sets it")
    read_num_samplers(args.trainer_args)  # refuses a bad --num-workers
    try:
        with open(args.part_config) as f:
            config = json.load(f)
    except FileNotFoundError:
        fail(f"--part-config {args.part_config} does not exist")
    except (json.JSONDecodeError, UnicodeDecodeError):
        fail(f"--part-config {args.part_config} is not a DGL partition config")
    num_parts = config.get("num_parts") if isinstance(config, dict) else None
    if num_parts is None:
        fail(f"--part-config {args.part_config} is not a DGL partition config")
    if num_parts != args.num_machines:
        fail(
            f"--part-config {args.part_config} has {num_parts} partitions "
            f"but --num-machines is {args.num_machines}"
        )


def check_prerequisites():
    """Namespaces need root and iproute2/util-linux; say so in one line."""
    if os.geteuid() != 0:
        fail("root is needed to create network and mount namespaces")
    tools = ("ip", "unshare", "nsenter", "setpriv")
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        fail(f"missing {', '.join(missing)} (iproute2, util-linux) on PATH")


def plan_machines(args, run_id, work_dir):
    """Decide every address, port and environment of the job; write ip_config."""
    rng = random.Random(run_id)
    # Varied per run for clarity in logs; the namespaces have no route out,
    # so the subnet cannot clash with the host's networks or another run.
    subnet = f"10.{rng.randrange(64, 256)}.{rng.randrange(0, 256)}"
    server_port = rng.randrange(20000, 40000)
    master_port = server_port + args.servers_per_machine + rng.randrange(1, 1000)
    machines = [{"id": m, "ip": f"{subnet}.{m + 1}"} for m in range(args.num_machines)]
    ip_config = os.path.join(work_dir, "ip_config.txt")
    with open(ip_config, "w") as f:
        f.writelines(f"{m['ip']} {server_port}\n" for m in machines)
    part_config = os.path.abspath(args.part_config)
    num_trainers = args.num_machines * args.trainers_per_machine
    num_samplers = read_num_samplers(args.trainer_args)
    # The variables DGL's tools/launch.py sets for servers and clients.
    common_env = {
        "DGL_NUM_SAMPLER": str(num_samplers),
        "DGL_NUM_CLIENT": str(num_trainers * (1 + num_samplers)),
        "DGL_CONF_PATH": part_config,
        "DGL_IP_CONFIG": ip_config,
        "DGL_NUM_SERVER": str(args.servers_per_machine),
        "DGL_GRAPH_FORMAT": "csc",
    }
    # All simulated machines share this host's cores.
    omp_threads = args.omp_threads or max(1, (os.cpu_count() or 1) // num_trainers)
    processes = server_processes(machines, args.servers_per_machine, server_port, common_env)
    if args.as_tools_launch:
        processes += torchrun_processes(
            machines, args.trainers_per_machine, master_port, omp_threads,
            common_env, work_dir)
    else:
        processes += trainer_processes(
            machines, args.trainers_per_machine, master_port, omp_threads,
            common_env)
    command = [sys.executable, os.path.abspath(args.script), *args.trainer_args,
               "--ip-config", ip_config, "--part-config", part_config]
    return {"machines": machines, "processes": processes,
            "command": command, "timeout": args.timeout,
            "supervised": not args.as_tools_launch}


def server_processes(machines, per_machine, server_port, common_env):
    processes = []
    for machine in machines:
        for s in range(per_machine):
            env = dict(common_env, DGL_ROLE="server", OMP_NUM_THREADS="1",
                       DGL_SERVER_ID=str(machine["id"] * per_machine + s))
            # DGL gives a machine's servers consecutive ports.
            processes.append({"name": f"machine {machine['id']} server {s}",
                              "machine": machine, "role": "server", "env": env,
                              "port": server_port + s})
    return processes


def client_env(common_env, omp_threads, **more):
    """A trainer's environment, as DGL's tools/launch.py exports it to its
    clients; gloo must use the machine's own link, not loopback."""
    return dict(common_env, DGL_DIST_MODE="distributed", DGL_ROLE="client",
                DGL_GROUP_ID="0", OMP_NUM_THREADS=str(omp_threads),
                GLOO_SOCKET_IFNAME=MACHINE_IFNAME, **more)


def trainer_processes(machines, per_machine, master_port, omp_threads, common_env):
    processes = []
    for machine in machines:
        for t in range(per_machine):
            rank = machine["id"] * per_machine + t
            # torch.distributed rendezvous, as torchrun would set it.
            env = client_env(
                common_env, omp_threads,
                MASTER_ADDR=machines[0]["ip"], MASTER_PORT=str(master_port),
                RANK=str(rank), WORLD_SIZE=str(len(machines) * per_machine),
                LOCAL_RANK=str(t), LOCAL_WORLD_SIZE=str(per_machine))
            processes.append({"name": f"machine {machine['id']} trainer {t} (rank {rank})",
                              "machine": machine, "role": "trainer", "rank": rank, "env": env})
    return processes


def torchrun_processes(machines, per_machine, master_port, omp_threads,
                       common_env, work_dir):
    """One torch.distributed.run a machine, starting its trainers, with the
    environment DGL's tools/launch.py gives it (v2.1.0, the same in 2.4.0);
    its agent, not this launcher, watches them. Its logs (torch elastic
    leaves a directory of them when a worker fails) go to `work_dir`."""
    processes = []
    for machine in machines:
        env = client_env(common_env, omp_threads)
        prefix = ["-m", "torch.distributed.run",
                  f"--nproc_per_node={per_machine}",
                  f"--nnodes={len(machines)}", f"--node_rank={machine['id']}",
                  f"--master_addr={machines[0]['ip']}",
                  f"--master_port={master_port}",
                  f"--log-dir={os.path.join(work_dir, 'torchelastic')}"]
        # Machine 0's output (trainer 0's among it) passes through.
        processes.append({"name": f"machine {machine['id']} trainers",
                          "machine": machine, "role": "trainer",
                          "rank": machine["id"] * per_machine, "env": env,
                          "prefix": prefix})
    return processes


def start_holder(unshare_flags, setup, env):
    """A sleeping process that owns new, unnamed namespaces.

    The namespaces disappear with it, links included, however the launcher
    ends: nothing is registered under /run/netns that could be left behind.
    """
    script = f"{setup} && echo ready && exec sleep infinity"
    return subprocess.Popen(
        [*DIE_WITH_LAUNCHER, "unshare", *unshare_flags, "sh", "-c", script],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )


def wait_until_ready(holder, what, timeout):
    ready, _, _ = select.select([holder.stdout], [], [], timeout)
    if not ready or holder.stdout.readline().strip() != "ready":
        holder.kill()
        raise RuntimeError(f"could not create the namespaces of {what}: "
                           f"{holder.stderr.read().strip()}")


def ip_in(pid, env, *arguments):
    """Run one iproute2 command in pid's network namespace."""
    command = ["nsenter", "--target", str(pid), "--net", "ip", *arguments]
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(arguments)}: {result.stderr.strip()}")


def link_machines(hub_pid, machines, machine_pids, env):
    """Join each machine to the hub's bridge with a veth pair and give it its address."""
    for machine in machines:
        pid, port = machine_pids[machine["id"]], f"m{machine['id']}"
        ip_in(hub_pid, env, "link", "add", port, "type", "veth",
              "peer", "name", MACHINE_IFNAME, "netns", str(pid))
        ip_in(hub_pid, env, "link", "set", port, "master", "br0", "up")
        ip_in(pid, env, "addr", "add", f"{machine['ip']}/24", "dev", MACHINE_IFNAME)
        ip_in(pid, env, "link", "set", MACHINE_IFNAME, "up")


# What the launcher wrote last to stderr ended a line (trainer 0's progress
# bar may end without one).
STDERR_AT_LINE_START = [True]


def forward_output(stream, to, prefix=""):
    """Copies a process's output line by line (with `prefix`) to `to`."""
    for line in stream:
        to.write(prefix + line)
        to.flush()
        if to is sys.stderr:
            STDERR_AT_LINE_START[0] = line.endswith("\n")


def start_process(spec, holder_pid, command, marked_env):
    """Trainer 0's stdout and stderr go to the launcher's unchanged (the
    job's result lines, progress bars); every other process's output goes to
    stderr, each line prefixed with its name."""
    env = dict(marked_env, **spec["env"])
    passthrough = spec.get("rank") == 0
    # A trainer is born with SIGINT and SIGTERM blocked (the mask survives
    # exec) until it handles them as a stop request (gbrun's StopSignal):
    # a stop that comes while it starts waits for it, instead of killing it.
    # (Not torchrun's agent: it handles them itself, as under launch.py.)
    blocked = {signal.SIGINT, signal.SIGTERM} if (
        spec["role"] == "trainer" and not spec.get("prefix")) else set()
    signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    if spec.get("prefix"):
        # python -m torch.distributed.run ... SCRIPT ARGS
        command = [command[0], *spec["prefix"], *command[1:]]
    try:
        proc = subprocess.Popen(
            [*DIE_WITH_LAUNCHER, "nsenter", "--target", str(holder_pid), "--mount",
             "--net", f"--wd={os.getcwd()}", "--", *command],
            env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if passthrough else subprocess.STDOUT, text=True,
            # Own process group: cleanup also reaches sampler processes it spawns.
            start_new_session=True,
        )
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)
    copies = [(proc.stdout, sys.stdout, "")] if passthrough else [
        (proc.stdout, sys.stderr, f"[{spec['name']}] ")]
    if passthrough:
        copies.append((proc.stderr, sys.stderr, ""))
    threads = [threading.Thread(target=forward_output, args=copy, daemon=True)
               for copy in copies]
    for thread in threads:
        thread.start()
    return {"spec": spec, "proc": proc, "threads": threads}


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


class StopRequest:
    """The launcher's SIGTERM and SIGINT handler. The first one is passed on
    to every trainer started (and to those started later), which stop at
    one step with a checkpoint (the job then exits 128 + its number); a
    second one, or SIGHUP, stops the whole job at once: raising here
    unwinds through run_job's finally, which cleans up."""

    def __init__(self):
        self.signum = 0
        self.trainers = []
        self.took_effect = False  # a trainer stopped on it

    def __call__(self, signum, frame):
        if self.signum or signum == signal.SIGHUP:
            raise SystemExit(128 + signum)
        self.signum = signum
        for proc in self.trainers:
            self.send(proc)

    def send(self, proc):
        if self.signum and proc.poll() is None:
            proc.send_signal(self.signum)

    def stopped(self, code):
        """True once a trainer has exited with the stop's status."""
        if self.signum and code == 128 + self.signum:
            self.took_effect = True
        return self.took_effect


def wait_for_job(running, exits, deadline, stop):
    """Return None on success or a stop, or one line saying why the job
    failed."""
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
        trainer = item["spec"]["role"] == "trainer"
        if code != 0 and not (trainer and stop.stopped(code)):
            return f"{item['spec']['name']} exited with code {code}; stopping the job"
        processes_left -= 1
        if item["spec"]["role"] == "trainer":
            trainers_left -= 1
            if trainers_left == 0:
                # Trainer 0 shuts the servers down as it exits.
                servers_deadline = time.monotonic() + SERVER_EXIT_GRACE_S
    return None


def wait_unsupervised(running, exits, deadline):
    """--as-tools-launch: every process must end by itself. Returns None,
    or one line naming the first process that failed (and when every
    process had ended, counted from that failure), or those still running
    at the deadline."""
    first, left, last_exit = None, len(running), time.monotonic()
    while left:
        try:
            item, code = exits.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            alive = [i["spec"]["name"] for i in running if i["proc"].poll() is None]
            return ("the job did not end by itself within --timeout: still "
                    f"running: {', '.join(alive)}")
        left -= 1
        last_exit = time.monotonic()
        if code != 0 and first is None:
            first = (item["spec"]["name"], code, last_exit)
    if first is None:
        return None
    name, code, failed_at = first
    return (f"{name} exited with code {code}; every process had ended "
            f"{last_exit - failed_at:.1f} s later")


def report_shared_memory(machines, machine_pids, marked_env):
    """--as-tools-launch: what each machine's /dev/shm holds once its
    processes are gone (a failed job's partition, features and graph are
    left there when nothing unlinks them). The listing carries the run's
    marker, as every process of the run does."""
    for machine in machines:
        listed = subprocess.run(
            ["nsenter", "--target", str(machine_pids[machine["id"]]),
             "--mount", "ls", "-A", "/dev/shm"], capture_output=True, text=True,
            env=marked_env)
        names = listed.stdout.split()
        print(f"machine {machine['id']}: /dev/shm holds {len(names)} "
              f"entries{': ' if names else ''}{' '.join(sorted(names))}",
              file=sys.stderr, flush=True)


def kill_group(proc):
    """SIGKILL the process group we created for proc (its sampler processes
    too, also once the leader is gone), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def cleanup(running, holders, work_dir):
    for item in running:
        kill_group(item["proc"])
    for item in running:
        for thread in item["threads"]:
            thread.join(timeout=5)
    # The namespaces, the bridge and the veth pairs go with their holders.
    for holder in holders:
        kill_group(holder)
    shutil.rmtree(work_dir, ignore_errors=True)


def run_job(args, run_id, stop):
    work_dir = tempfile.mkdtemp(prefix=f"dglsim{run_id}-")
    # Marks every process of this run, so leftovers can be found (the tests do).
    marked_env = dict(os.environ, DGLSIM_RUN=str(run_id))
    running, holders = [], []
    try:
        plan = plan_machines(args, run_id, work_dir)
        deadline = time.monotonic() + plan["timeout"]
        # The hub holds the bridge; each machine holds its own network stack
        # and a mount namespace with a private /dev/shm.
        holders.append(start_holder(
            ["--net"], "ip link add br0 type bridge && ip link set br0 up", marked_env))
        wait_until_ready(holders[-1], "the hub", timeout=30)
        hub_pid, machine_pids = holders[-1].pid, {}
        for machine in plan["machines"]:
            holders.append(start_holder(
                ["--net", "--mount", "--propagation", "private"],
                "mount -t tmpfs tmpfs /dev/shm && ip link set lo up", marked_env))
            wait_until_ready(holders[-1], f"machine {machine['id']}", timeout=30)
            machine_pids[machine["id"]] = holders[-1].pid
        link_machines(hub_pid, plan["machines"], machine_pids, marked_env)
        exits = queue.Queue()
        for role in ("server", "trainer"):
            for spec in (spec for spec in plan["processes"] if spec["role"] == role):
                holder_pid = machine_pids[spec["machine"]["id"]]
                running.append(start_process(spec, holder_pid, plan["command"], marked_env))
                threading.Thread(target=watch_exit, args=(running[-1], exits), daemon=True).start()
                if role == "trainer":
                    stop.trainers.append(running[-1]["proc"])
                    stop.send(running[-1]["proc"])  # a stop before it started
            if role == "server" and plan["supervised"]:
                wait_until_servers_listen(running, deadline)
        if plan["supervised"]:
            failure = wait_for_job(running, exits, deadline, stop)
        else:
            failure = wait_unsupervised(running, exits, deadline)
            report_shared_memory(plan["machines"], machine_pids, marked_env)
    except RuntimeError as e:
        failure = str(e)
    finally:
        # A second Ctrl-C must not cut the cleanup short.
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)
        cleanup(running, holders, work_dir)
    return failure


def main():
    args = parse_args()
    validate_args(args)
    check_prerequisites()
    stop = StopRequest()
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, stop)
    failure = run_job(args, os.getpid(), stop)
    if failure is not None:
        newline = "" if STDERR_AT_LINE_START[0] else "\n"
        print(f"{newline}error: {failure}", file=sys.stderr)
        sys.exit(1)
    if stop.took_effect:
        # Trainer 0 said where it stopped and how to resume. (Signalled
        # during the last validation or the test, the run finished: 0.)
        sys.exit(128 + stop.signum)


if __name__ == "__main__":
    main()
