"""One machine's part of a job started as DGL's tools/launch.py starts it,
with nothing watching it (scripts/check_gpu.py and the tests use it)."""
import os
import random
import socket
import subprocess
import sys


def start_one_machine(command, part_config, num_trainers, out_dir,
                      samplers=0, env=None):
    """Starts a one-machine job on this host as DGL's tools/launch.py
    starts a machine's part (v2.1.0, the same through v2.4.0): one graph
    server running `command` (a training script and its arguments) with
    DGL_ROLE=server, and `num_trainers` trainers running it under
    torch.distributed.run, each with the environment launch.py exports, on
    127.0.0.1. Nothing watches or kills them. Their output goes to
    out_dir/server.txt and out_dir/trainers.txt; returns (server, trainers),
    two Popen objects."""
    ip_config = os.path.join(out_dir, "ip_config.txt")
    with open(ip_config, "w") as f:
        f.write(f"127.0.0.1 {free_port()}\n")
    common = dict(
        os.environ, **(env or {}), DGL_NUM_SAMPLER=str(samplers),
        DGL_NUM_CLIENT=str(num_trainers * (1 + samplers)),
        DGL_CONF_PATH=part_config, DGL_IP_CONFIG=ip_config,
        DGL_NUM_SERVER="1", DGL_GRAPH_FORMAT="csc")

    def start(name, prefix, role_env):
        with open(os.path.join(out_dir, f"{name}.txt"), "w") as log:
            return subprocess.Popen(
                [sys.executable, *prefix, *command], stdout=log,
                stderr=subprocess.STDOUT, env={**common, **role_env})

    server = start("server", [], {"DGL_ROLE": "server", "DGL_SERVER_ID": "0",
                                  "OMP_NUM_THREADS": "1"})
    trainers = start("trainers", [
        "-m", "torch.distributed.run", f"--nproc_per_node={num_trainers}",
        "--nnodes=1", "--node_rank=0", "--master_addr=127.0.0.1",
        f"--master_port={free_port()}"], {
        "DGL_DIST_MODE": "distributed", "DGL_ROLE": "client",
        "DGL_GROUP_ID": "0", "OMP_NUM_THREADS": "1"})
    return server, trainers


def free_port():
    """A TCP port free now, for a graph server or rendezvous that binds it
    seconds later (two jobs never collide on a fixed port). It comes from
    below the kernel's ephemeral range, read from /proc (psutil does not
    give it): a port in that range can be handed to any outgoing connection
    on the machine before the server binds it."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768  # Linux's default
    below = range(max(1024, ephemeral_low - 12000), ephemeral_low)
    # Not the seeded generator: two runs with one --seed pick apart.
    tries = random.SystemRandom().sample(below, min(100, len(below)))
    for port in tries:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))  # let the kernel choose
        return sock.getsockname()[1]
