"""Check node_classification.py on this machine's GPUs, one line per check.

    python scripts/check_gpu.py            # on GPU 0, or GPUs 0,1 if there are two
    python scripts/check_gpu.py --gpu=1    # elsewhere
    python -m pytest -m gpu tests          # the same checks as tests

It makes a 20,000-node synthetic dataset in a temporary directory and runs
the example briefly (2 epochs of 8 batches) in each GPU mode: pinned-cuda
with the GPU cache, cpu-cuda, cuda-cuda, bf16, and a pinned-cuda run stopped
by SIGTERM inside an epoch, resumed, whose model.pt then loads on the CPU;
then on DGL's distributed engine, one graph server and one trainer per GPU
on this machine, started as DGL's tools/launch.py starts them, whose
model.pt loads on the CPU.
A run passes if it exits as expected and tests well above chance (0.1; runs
like these reach about 0.77 on CPU ranks). Where torch or DGL has no CUDA
(PyPI's dgl is a CPU-only build, see docs/gpus.md) it says so and skips
everything, exit 0. Exit 1 if any check failed.
"""
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

from gbrun.cli import SHIPPED_EXAMPLE, ArgumentParser

SCRIPTS_DIR = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = SHIPPED_EXAMPLE
DISTRIBUTED = os.path.join(os.path.dirname(SCRIPTS_DIR), "distributed")
DIST_TRAINER = os.path.join(DISTRIBUTED, "dist_node_classification.py")
QUICK = ["--epochs", "2", "--batch-size", "256", "--max-batches", "8",
         "--seed", "0"]
LEARNED = 0.5  # a test accuracy that shows the model learned on the GPU
LOAD_ON_CPU = """
import sys, torch
state = torch.load(sys.argv[1], map_location="cpu", weights_only=True)
assert all(t.device.type == "cpu" for t in state.values())
print(len(state), "tensors")
"""


class CheckFailed(Exception):
    """A check's run did not do what it should; the message says what."""


def skip_reason():
    """Why the GPU checks cannot run here, or None."""
    import torch

    from gbrun.graphbolt import INSTALL_CUDA_DGL
    from gbrun.planning import dgl_has_cuda

    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    if not dgl_has_cuda():
        return f"this DGL is a CPU-only build (for GPUs: {INSTALL_CUDA_DGL})"
    return None


def make_dataset(workdir):
    dataset = os.path.join(workdir, "data")
    subprocess.run(
        [sys.executable, os.path.join(SCRIPTS_DIR, "make_synthetic_dataset.py"),
         dataset, "--num-nodes", "20000"], check=True, capture_output=True)
    return dataset


def example(gpus, dataset, *extra, env=None, expect=0):
    """Runs the example; returns its stdout, or raises CheckFailed."""
    done = subprocess.run(
        [sys.executable, EXAMPLE, f"--gpu={gpus}", "--dataset", dataset,
         *QUICK, *extra], capture_output=True, text=True, timeout=600,
        env={**os.environ, **(env or {})},
    )
    if done.returncode != expect:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        raise CheckFailed(f"exit {done.returncode}, not {expect}: "
                          f"{lines[-1] if lines else '(no error output)'}")
    return done.stdout


def learned(stdout):
    found = re.findall(r"^Test Accuracy (\d\.\d+)$", stdout, re.M)
    if not found or float(found[-1]) < LEARNED:
        raise CheckFailed(f"test accuracy {found or 'missing'}, expected "
                          f"at least {LEARNED}")
    return f"Test Accuracy {found[-1]}"


def stop_and_resume(gpus, dataset, workdir):
    ckpt = os.path.join(workdir, "ckpt")
    # The 12th stop check is step 3 of epoch 1 (8 steps and one check after
    # validation per epoch); the stop comes one step later.
    example(gpus, dataset, "--mode", "pinned-cuda", "--checkpoint-dir", ckpt,
            env={"TEST_SIGTERM_AT_CHECK": "12"}, expect=128 + signal.SIGTERM)
    resumed = example(gpus, dataset, "--mode", "pinned-cuda",
                      "--checkpoint-dir", ckpt, "--resume")
    if "Resuming from" not in resumed:
        raise CheckFailed("the resumed run did not resume")
    loaded = subprocess.run(
        [sys.executable, "-c", LOAD_ON_CPU, os.path.join(ckpt, "model.pt")],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    if loaded.returncode != 0:
        raise CheckFailed(f"model.pt does not load on the CPU: "
                          f"{loaded.stderr.strip().splitlines()[-1]}")
    return learned(resumed) + ", model.pt loads on the CPU"


def distributed(gpus, dataset, workdir, *extra):
    """One machine on DGL's distributed engine: a graph server and one
    trainer per GPU of `gpus` (each on the GPU of its LOCAL_RANK, NCCL)."""
    from gbrun.dgl_engine.machine import start_one_machine

    parts = os.path.join(workdir, "parts")
    subprocess.run([sys.executable, os.path.join(DISTRIBUTED,
                                                 "partition_graph.py"),
                    "--dataset", dataset, "--num-parts", "1", "--out", parts],
                   check=True, capture_output=True)
    ckpt = os.path.join(workdir, "dist_ckpt")
    server, trainers = start_one_machine(
        [DIST_TRAINER, *QUICK, "--checkpoint-dir", ckpt, *extra],
        os.path.join(parts, "data.json"), len(gpus.split(",")), workdir,
        env={"CUDA_VISIBLE_DEVICES": gpus})
    try:
        code = trainers.wait(timeout=600)
        server.wait(timeout=60)
    finally:
        for process in (server, trainers):
            process.kill()
    with open(os.path.join(workdir, "trainers.txt")) as f:
        output = f.read()
    if code != 0:
        lines = [line for line in output.splitlines() if line.strip()]
        raise CheckFailed(f"the trainers exited {code}: "
                          f"{lines[-1] if lines else '(no output)'}")
    if "cpu-cpu" in output and "cpu-cpu" not in extra:
        raise CheckFailed("the trainers trained on the CPU: "
                          + output.split("cpu-cpu", 1)[0].splitlines()[-1])
    loaded = subprocess.run(
        [sys.executable, "-c", LOAD_ON_CPU, os.path.join(ckpt, "model.pt")],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    if loaded.returncode != 0:
        raise CheckFailed("model.pt does not load on the CPU")
    return learned(output) + ", model.pt loads on the CPU"


def mode_check(*extra):
    return lambda gpus, dataset, workdir: learned(example(gpus, dataset, *extra))


CACHE_BYTES = str(16 << 20)
CHECKS = {
    "pinned-cuda with GPU cache": mode_check(
        "--mode", "pinned-cuda", "--gpu-cache-size", CACHE_BYTES),
    "cpu-cuda": mode_check("--mode", "cpu-cuda"),
    "cuda-cuda": mode_check("--mode", "cuda-cuda"),
    "bf16, pinned-cuda": mode_check(
        "--mode", "pinned-cuda", "--precision", "bf16"),
    "SIGTERM in an epoch, resume": stop_and_resume,
    "distributed, a trainer a GPU": distributed,
}


def default_gpus():
    import torch

    return "0,1" if torch.cuda.device_count() > 1 else "0"


def main(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default=None,
                        help="GPU ids to use (default: 0, or 0,1 with two)")
    args = parser.parse_args(argv)
    reason = skip_reason()
    if reason:
        print(f"skipped: {reason}")
        return 0
    gpus, failed = args.gpu or default_gpus(), 0
    with tempfile.TemporaryDirectory() as workdir:
        dataset = make_dataset(workdir)
        for name, check in CHECKS.items():
            started = time.time()
            try:
                ok, what = True, check(gpus, dataset, workdir)
            except CheckFailed as failure:
                ok, what = False, str(failure)
            print(f"{'ok  ' if ok else 'FAIL'} {name:28s} "
                  f"{time.time() - started:5.1f} s  {what}", flush=True)
            failed += not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
