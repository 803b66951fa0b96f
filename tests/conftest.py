"""Shared helpers: the repository's paths, a cache of synthetic datasets made
by scripts/make_synthetic_dataset.py, and a runner for node_classification.py.
Everything runs on CPU ranks with the gloo backend."""
import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "node_classification.py")
SCRIPTS = os.path.join(REPO, "scripts")
# On PYTHONPATH, makes every process look like a GPU machine with PyPI's
# wheels: torch reports GPUs, DGL is the CPU-only build (see its docstring).
FAKE_CUDA = os.path.join(REPO, "tests", "fake_cuda")
# What hides every GPU from a process, on any machine.
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}
sys.path.insert(0, REPO)
sys.path.insert(0, SCRIPTS)

EPOCH_LINE = re.compile(
    r"^Epoch (\d{5}) \| Average Loss (\d+\.\d{4}) \| "
    r"Accuracy (\d+\.\d{4}) \| Time (\d+\.\d{4})( \|.*)?$",
    re.MULTILINE,
)
TEST_LINE = re.compile(r"^Test Accuracy (\d+\.\d{4})$", re.MULTILINE)


def make_synthetic(out_dir, *extra):
    subprocess.run(
        [sys.executable, os.path.join(SCRIPTS, "make_synthetic_dataset.py"),
         str(out_dir), *map(str, extra)],
        check=True,
        capture_output=True,
        text=True,
    )
    return str(out_dir)


@pytest.fixture(scope="session")
def synthetic(tmp_path_factory):
    """make(name, *args) -> path of a synthetic dataset, made once per name."""
    made = {}

    def make(name, *args):
        if name not in made:
            out = tmp_path_factory.mktemp("data") / name
            made[name] = make_synthetic(out, *args)
        return made[name]

    return make


@pytest.fixture(scope="session")
def small_dataset(synthetic):
    # 3,000 nodes with 10 classes: big enough to learn, small enough that a
    # two-rank run takes seconds.
    return synthetic(
        "small", "--num-nodes", 3000, "--feat-dim", 32, "--num-classes", 10
    )


# The seeded run that several tests check or compare with: two CPU ranks
# (`auto` with GPUs hidden), 3 epochs, checkpoints and metrics written.
REFERENCE = ["--gpu=0,1", "--batch-size", 64, "--fanout", "5,5,5",
             "--epochs", 3, "--seed", 1]


@pytest.fixture(scope="session")
def reference_run(small_dataset, tmp_path_factory):
    """(CompletedProcess, directory with ckpt/ and logs/) of REFERENCE on
    the small dataset, run once per session."""
    out = tmp_path_factory.mktemp("reference")
    result = run_example(
        [*REFERENCE, "--dataset", small_dataset,
         "--checkpoint-dir", out / "ckpt", "--log-dir", out / "logs"],
        env=NO_GPU,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result, out


@pytest.fixture
def no_cuda(monkeypatch):
    """This test process sees no GPU, whatever the machine has."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def start(command, env=None):
    """Starts a command in a session of its own, so that kill_session() ends
    it with every process it started (spawned ranks included)."""
    return subprocess.Popen(
        [str(part) for part in command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )


def kill_session(process):
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def finish(process, timeout):
    """Waits for a started process; on timeout kills its session and fails
    the test with the end of its output. Returns CompletedProcess (text)."""
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(process)
        out, err = process.communicate()
        pytest.fail(
            f"{process.args[:3]} did not finish in {timeout} s:\n"
            f"{out.decode()[-2000:]}\n{err.decode()[-2000:]}"
        )
    return subprocess.CompletedProcess(
        process.args, process.returncode, out.decode(), err.decode()
    )


def read_until(process, pattern, timeout, stream="stdout"):
    """Reads a started process's stdout (or stderr) until the regular
    expression `pattern` matches; returns what was read. Fails the test,
    killing the session, if the deadline passes or the stream ends first."""
    fd = getattr(process, stream).fileno()
    deadline, text = time.monotonic() + timeout, ""
    while not re.search(pattern, text):
        left = deadline - time.monotonic()
        ready = select.select([fd], [], [], max(left, 0))[0] if left > 0 else []
        chunk = os.read(fd, 65536) if ready else b""
        if not chunk:
            kill_session(process)
            pytest.fail(f"no {pattern!r} within {timeout} s:\n{text[-3000:]}")
        text += chunk.decode(errors="replace")
    return text


def run_example(args, timeout=120, env=None, script=SCRIPT):
    """Runs node_classification.py to completion within `timeout` seconds
    (else kills it with its ranks and fails); returns CompletedProcess."""
    process = start([sys.executable, script, *args], env=env)
    try:
        return finish(process, timeout)
    finally:
        kill_session(process)


def epoch_lines(stdout):
    return EPOCH_LINE.findall(stdout)


def reported_test_accuracy(stdout):
    found = TEST_LINE.findall(stdout)
    assert len(found) == 1, f"expected one 'Test Accuracy' line in:\n{stdout}"
    return float(found[0])



def _gloo_worker(rank, world_size, port, fn, args, out_dir):
    import datetime

    import torch
    import torch.distributed as dist

    # A short timeout turns any stuck rendezvous or collective into an error.
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}",
        world_size=world_size, rank=rank,
        timeout=datetime.timedelta(seconds=60),
    )
    from gbrun.launch import destroy_process_group

    try:
        torch.save(fn(rank, *args), os.path.join(out_dir, f"{rank}.pt"))
        # Rank 0 hosts the rendezvous store: nobody leaves before all are done.
        dist.barrier()
    finally:
        destroy_process_group()


def run_gloo_group(fn, world_size, tmp_path, *args):
    """Runs fn(rank, *args) in a real gloo process group of `world_size`
    CPU processes; returns the list of their return values by rank."""
    import torch
    import torch.multiprocessing as mp

    from gbrun.launch import free_port

    mp.spawn(
        _gloo_worker,
        args=(world_size, free_port(), fn, args, str(tmp_path)),
        nprocs=world_size,
        join=True,
    )
    return [torch.load(tmp_path / f"{rank}.pt") for rank in range(world_size)]
