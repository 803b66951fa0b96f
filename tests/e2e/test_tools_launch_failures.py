"""A job started as DGL's tools/launch.py starts one, where no launcher kills
what is left: on 2 simulated machines (distributed/launch_local.py
--as-tools-launch), each failure (a trainer failing before it connects or
mid-epoch, a trainer that hangs, a killed graph server, a killed sampler, a
machine whose network goes down) ends the whole job by itself within
FAILURE_BOUND_S, its cause printed once, nothing left running and each
machine's /dev/shm empty; and on one machine laid out as tools/launch.py
lays it out (a graph server, a trainer under torch.distributed.run, a
sampler), a failed trainer leaves nothing running within 60 s and nothing
of DGL's in /dev/shm. Skipped without root and iproute2, except when
CI=true."""
import os
import pathlib
import re
import shutil
import signal
import subprocess
import tempfile
import time

import psutil
import pytest

from helpers import (
    DISTRIBUTED, JOB_TIMEOUT_S, TRAIN_ARGS, TRAINER_BOUND_S, edited_copy, gone,
    marked, partition_here, start_launcher, wait_for_output,
)
from helpers import SCRIPT as MAIN_SCRIPT
from helpers import finish_launcher as finish
from helpers import launcher_leftovers as leftovers


TRAINER = os.path.join(DISTRIBUTED, "dist_node_classification.py")


# --- As DGL's tools/launch.py starts a job: nothing kills what is left -------------


# Started as DGL's tools/launch.py starts a job (launch_local.py
# --as-tools-launch: it stops nothing on a failure); short bounds, so that
# each case is quick.
FAILURE_ARGS = [*TRAIN_ARGS, "--epochs", 1000,
                "--connect-timeout", TRAINER_BOUND_S,
                "--progress-timeout", TRAINER_BOUND_S]


# Each case's job on 2 machines: (graph servers, trainers, sampler processes
# per trainer) a machine. Each process costs seconds of start-up, so a case
# has only what its failure involves: samplers where one is killed or a
# waiting trainer counts its own (before connecting), a second server where
# a killed server's sibling must leave too, a second trainer where a
# failure must also end its machine's other trainer under torchrun (a
# trainer that fails, or both). (A healthy job of 2 servers and samplers a
# machine is test_distributed_options.py's.)
LAYOUT = {
    "a trainer fails before connecting": (1, 2, 1),
    "a trainer fails mid-epoch": (1, 2, 0),
    "a trainer hangs": (1, 1, 0),
    "a graph server is killed": (2, 1, 0),
    "a sampler is killed": (1, 1, 1),
    "a machine's network goes down": (1, 1, 0),
}


# How soon after the first failure every process of the job must be gone.
FAILURE_BOUND_S = 60


# A simulated machine's network interface (launch_local.py's MACHINE_IFNAME).
MACHINE_IFNAME = "eth0"


def import_fails_on_machine_1(out):
    """A copy of the example that trainers of machine 1 cannot import."""
    copy = out / "node_classification.py"
    text = open(MAIN_SCRIPT).read().replace("import argparse\n", (
        "import argparse\nimport os\n"
        "if os.environ.get('DGL_ROLE') == 'client' and "
        "os.environ.get('GROUP_RANK') == '1':\n"
        "    raise ImportError('machine 1 cannot import this copy')\n"), 1)
    copy.write_text(text)
    return ["--example", copy]


def job_process(proc, role, machine, servers_per_machine):
    """The pid of machine `machine`'s first `role` ("server", "sampler") of
    launcher `proc`'s job."""
    for pid in leftovers(proc.pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0")
                           if b"=" in item)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if role == "server" and env.get(b"DGL_ROLE") == b"server" and (
                env.get(b"DGL_SERVER_ID") == str(
                    servers_per_machine * machine).encode()):
            return pid
        if role == "sampler" and env.get(b"GROUP_RANK") == str(
                machine).encode() and b"multiprocessing.spawn" in cmdline \
                and b"resource_tracker" not in cmdline:
            return pid
    pytest.fail(f"no {role} of machine {machine} found")


@pytest.mark.slow
@pytest.mark.parametrize("case", [
    "a trainer fails before connecting", "a trainer fails mid-epoch",
    "a trainer hangs", "a graph server is killed", "a sampler is killed",
    "a machine's network goes down"])
def test_every_failure_ends_a_tools_launch_job_leaving_nothing(
        namespaces, partitions, tmp_path, case):
    """Each failure ends the whole job, every process of it by itself within
    FAILURE_BOUND_S, exit 1, its cause printed once, and no shared memory
    left on either machine (finish() checks no process is left)."""
    servers, trainers, samplers = LAYOUT[case]
    # 64 seeds a machine a batch, whatever its trainers: an epoch is the
    # same 9 steps of 128 seeds in every layout (300 training nodes a
    # trainer of 2 a machine).
    args = [*FAILURE_ARGS, "--num-workers", samplers,
            "--batch-size", 64 // trainers]
    cause = None
    if case == "a trainer fails before connecting":
        args += import_fails_on_machine_1(tmp_path)
        cause = "ImportError: machine 1 cannot import this copy"
    elif case == "a trainer fails mid-epoch":
        # Machine 1's second trainer.
        args += ["--fail-after-batches", 3, "--fail-rank", 3]
        cause = "RuntimeError: --fail-after-batches 3 on rank 3"
    elif case == "a sampler is killed":
        args += ["--example", edited_copy(tmp_path, "auroc")]
    elif case == "a trainer hangs":
        # Machine 1's trainer.
        args += ["--hang-after-batches", 3, "--fail-rank", 1]
        # Where it hangs: in the loader, under the loop of the example.
        cause = re.compile(rf"rank 1 failed: no batch for {TRAINER_BOUND_S} s "
                           r"\(--progress-timeout\), at \S+loader.py:\d+ in each <- "
                           r"\S+node_classification.py:\d+ in train")
    short = pathlib.Path(tempfile.mkdtemp(prefix="tl", dir="/tmp"))
    proc = start_launcher(partitions["part_config"], 2, args, tmp_path,
                          JOB_TIMEOUT_S,
                          ["--trainers-per-machine", trainers,
                           "--servers-per-machine", servers,
                           "--as-tools-launch"], tmp_dir=short)
    if case == "a sampler is killed":
        # The run is shared: it trains docs/customising.md's AUROC edit for
        # an epoch, its metric gathered from both trainers, before the kill
        # (in epoch 1).
        wait_for_output(tmp_path, r"^Epoch 00000 .* \| AUROC 0\.[5-9]\d{3} ",
                        proc, timeout=90)
    if cause is None:
        # Mid-epoch, as trainer 0's progress bar shows.
        wait_for_output(tmp_path, r"train \d+: .*\| [1-9]/", proc,
                        timeout=90, stream="stderr.txt")
        # (The network case needs any process of machine 1: a server.)
        role = "sampler" if "sampler" in case else "server"
        victim = job_process(proc, role, 1, servers)
        if "network" in case:
            # No connection closes: every trainer waits (gloo, DGL's RPC)
            # until its own --progress-timeout.
            subprocess.run(["nsenter", "--target", str(victim), "--net",
                            "ip", "link", "set", MACHINE_IFNAME, "down"],
                           check=True)
            cause = re.compile(rf"rank \d failed: no batch for {TRAINER_BOUND_S} s")
        else:
            owner = psutil.Process(victim).ppid()
            rank = psutil.Process(owner).environ().get("RANK")
            os.kill(victim, signal.SIGKILL)
            # A server's death is seen by every trainer connected to it; a
            # sampler's by its trainer, which names it, or fails on the
            # queue the sampler answered on (whichever comes first).
            cause = {"server": "closed its connection (it died?)",
                     "sampler": f"rank {rank} failed"}[role]
    try:
        # A killed sampler leaves multiprocessing's empty pymp-* directory.
        code, out, err = finish(proc, tmp_path, timeout=JOB_TIMEOUT_S + 30,
                                tolerated=["pymp-"])
    finally:
        shutil.rmtree(short, ignore_errors=True)
    assert code == 1, err[-3000:]
    ended = re.search(r"^error: machine \d (?:trainers|server \d) exited with "
                      r"code -?\d+; every process had ended (\d+\.\d) s later$",
                      err, re.M)
    assert ended and float(ended.group(1)) < FAILURE_BOUND_S, err[-3000:]
    # Once for each process that failed of it: the two trainers of machine
    # 1 cannot import; each trainer that sees a killed server's connection
    # close before a collective with a failed peer fails says so.
    count = (len(cause.findall(out + err)) if isinstance(cause, re.Pattern)
             else (out + err).count(cause))
    if case == "a graph server is killed":
        # A trainer or sampler whose DGL sender thread is sending to the
        # server as it dies is aborted by DGL itself ("send error: Broken
        # pipe", then "terminate called ..."), before the watch can name
        # the server: a race DGL decides (seen once in the clean-clone runs).
        # Either way the death is said, by one of the two, at least once.
        aborted = (out + err).count("send error: Broken pipe")
        assert count <= 2 * trainers and count + aborted >= 1, (
            cause, err[-3000:])
    elif case == "a machine's network goes down":
        assert 1 <= count <= 2 * trainers, (cause, err[-3000:])
    else:
        expected = 2 if case == "a trainer fails before connecting" else 1
        assert count == expected, (cause, err[-3000:])
    for machine in (0, 1):
        assert f"machine {machine}: /dev/shm holds 0 entries\n" in err, \
            err[-3000:]


@pytest.mark.slow
def test_a_failed_trainer_ends_its_job_under_tools_launch(tmp_path, dataset):
    """One machine, as DGL's tools/launch.py starts it (v2.1.0, the same in
    2.4.0): a graph server started with DGL_ROLE=server, and a trainer
    started by torch.distributed.run with DGL_ROLE=client, each with the
    environment launch.py exports, and a sampler process; here on
    127.0.0.1, with no launcher that could kill anything. The trainer fails
    after 2 batches: its server and its sampler must be gone within 60 s
    (DGL's server, waiting for a shutdown request, would run for ever), and
    so must the job's shared memory in /dev/shm (the partition's graph and
    features: DGL unlinks them only in destructors that os._exit skips)."""
    started = time.time()
    partition_here(dataset, tmp_path / "one", num_parts=1)
    from gbrun.dgl_engine.machine import start_one_machine

    marker = f"LAUNCH_TEST={os.getpid()}".encode()
    server, trainer = start_one_machine(
        [TRAINER, *map(str, TRAIN_ARGS), "--num-workers", "1",
         "--fail-after-batches", "2"],
        str(tmp_path / "one" / "synthetic.json"), 1, str(tmp_path),
        samplers=1, env={"LAUNCH_TEST": str(os.getpid())})
    try:
        assert trainer.wait(timeout=120) != 0
        failed = time.monotonic()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("the graph server outlived its failed trainer by 60 s")
        left = []
        while time.monotonic() - failed < 60:
            left = [pid for pid in marked(marker) if not gone(pid)]
            if not left:
                break
            time.sleep(0.5)
        assert left == [], f"still running 60 s after the failure: {left}"
        log = (tmp_path / "trainers.txt").read_text()
        assert "RuntimeError: --fail-after-batches 2 on rank 0" in log
        assert server.returncode == 1
        assert "every trainer of this machine has gone without shutting the graph servers " \
               "down" in (tmp_path / "server.txt").read_text()
        assert segments_since(started) == []
    finally:
        for pid in marked(marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        server.wait()
        trainer.wait()


def segments_since(started, directory="/dev/shm"):
    """The names in `directory` of DGL's shared memory (the synthetic
    graph's, features, GraphBolt's) written since `started` (a time.time()):
    those a job left (one that reused an older leftover's name wrote it)."""
    from gbrun.dgl_engine.cleanup import DGL_SEGMENT

    return sorted(
        name for name in os.listdir(directory)
        if (name.startswith("synthetic") or DGL_SEGMENT.search(name))
        and os.stat(os.path.join(directory, name)).st_mtime >= started - 1)
