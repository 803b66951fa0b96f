"""The GPU paths' decisions, checked without a GPU (DGL 2.1.0 and torch
2.2.1 read for each): collectives keep tensors on the rank's device, saved
files load without CUDA, torchrun ranks outwait a slow first load, cpu-cuda
ranks start no CUDA work in the loader's thread, the stop flag is read one
step late, a refused pin is one line, and scripts/check_gpu.py skips cleanly
where DGL has no CUDA."""
import dataclasses
import datetime
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import types

import pytest
import torch
import torch.distributed as dist

import gbrun.cli
import gbrun.data.datasets
import gbrun.graphbolt
import gbrun.placement
import gbrun.checkpoint
import gbrun.progress
import gbrun.sources
import gbrun.batches
import gbrun.launch as launch
from gbrun import planning
import gbrun.stop
import node_classification as nc
from helpers import (
    cpu_plan,
    FAKE_CUDA, NO_GPU, REPO, SCRIPTS, reported_test_accuracy, run_gloo_group,
)

META = torch.device("meta")  # a device other than the CPU, without a GPU


def same_device_collectives(monkeypatch, module):
    """Replaces `module.dist`'s collectives with ones that refuse tensors on
    another device than their input, as NCCL does; returns the inputs."""
    seen = []

    def check(tensor, *others):
        for other in others:
            assert other.device == tensor.device, (
                f"{other.device} output for a {tensor.device} input")
        seen.append(tensor)

    fake = types.SimpleNamespace(
        all_gather=lambda outputs, tensor, **kw: check(tensor, *outputs),
        all_reduce=lambda tensor, **kw: check(tensor),
        reduce=lambda tensor, dst=0, **kw: check(tensor),
        get_world_size=lambda: 2,
        ReduceOp=dist.ReduceOp,
    )
    monkeypatch.setattr(module, "dist", fake)
    return seen


def test_collectives_keep_every_tensor_on_the_ranks_device(monkeypatch):
    # save_stop: the loss sums are gathered where they were summed, and
    # whether rank 0 saved is agreed on (a meta tensor holds no value to
    # read: read as 0, saved).
    gathered = same_device_collectives(monkeypatch, gbrun.progress)
    monkeypatch.setattr(torch.Tensor, "item", lambda tensor: 0)
    monkeypatch.setattr(gbrun.progress, "barrier", lambda device: None)
    progress = object.__new__(gbrun.progress.Progress)
    progress.rank, progress.world_size, progress.device = 1, 2, META
    progress.stop = types.SimpleNamespace(signum=signal.SIGTERM)
    progress.start = gbrun.checkpoint.Start(None, 0, 2, None, None, None, {})
    batches = types.SimpleNamespace(
        loss_sum=torch.tensor(2.5, device=META), num_items=192, epoch=1,
        step=3, check_added=lambda: None)
    with pytest.raises(gbrun.stop.Stopped) as stopped:
        progress.save_stop(batches)
    assert stopped.value.signum == signal.SIGTERM
    # The stop flag, and the example's weighted reduce.
    flags = same_device_collectives(monkeypatch, gbrun.stop)
    gbrun.stop._Flag(0, META)
    reduced = same_device_collectives(monkeypatch, nc)
    nc.weighted_reduce(torch.tensor(3.0, device=META), 4)
    seen = gathered + flags + reduced
    assert [len(gathered), len(flags), len(reduced)] == [2, 1, 2]
    assert {t.device for t in seen} == {META}


def docs_prediction_snippet(dataset, model_dir):
    """docs/running.md's load-and-predict snippet, on `dataset` and the
    model.pt and model.json in `model_dir`."""
    doc = open(os.path.join(REPO, "docs", "running.md")).read()
    blocks = [block.split("```")[0] for block in doc.split("```python\n")[1:]]
    (snippet,) = [block for block in blocks if "load_model" in block]
    assert 'load_dataset("synthetic")' in snippet and '"runs/a"' in snippet, snippet
    return snippet.replace('load_dataset("synthetic")', f"load_dataset({str(dataset)!r})"
                           ).replace('"runs/a"', repr(str(model_dir)))


@pytest.mark.slow
def test_files_saved_by_gpu_ranks_load_without_cuda(
        reference_run, small_dataset, tmp_path, monkeypatch):
    # Files whose tensors are tagged cuda:0, as torch.save writes them from
    # a GPU rank, loaded the ways the project loads files, with no GPU.
    trained, out = reference_run
    model = torch.load(out / "ckpt" / gbrun.checkpoint.MODEL_FILE, weights_only=True)
    checkpoint = torch.load(out / "ckpt" / gbrun.checkpoint.CHECKPOINT_FILE,
                            weights_only=True)
    monkeypatch.setattr(torch.serialization, "location_tag",
                        lambda storage: "cuda:0")
    (tmp_path / "ckpt").mkdir()
    model_file = str(tmp_path / "ckpt" / gbrun.checkpoint.MODEL_FILE)
    gbrun.checkpoint.save_atomically(model, model_file)
    gbrun.checkpoint.save_atomically(
        checkpoint, str(tmp_path / "ckpt" / gbrun.checkpoint.CHECKPOINT_FILE))
    monkeypatch.undo()

    def python(code, *argv):
        return subprocess.run(
            [sys.executable, "-c", code, *argv], capture_output=True,
            text=True, timeout=120, cwd=REPO, env={**os.environ, **NO_GPU})

    # The tag is honoured: without map_location the file does not load.
    plain = python("import sys, torch; "
                   "torch.load(sys.argv[1], weights_only=True)", model_file)
    assert "CUDA" in plain.stderr and plain.returncode == 1, plain.stderr
    # The docs' snippet loads it and predicts as well as the trained model
    # scored (chance is 0.1).
    shutil.copy(out / "ckpt" / gbrun.checkpoint.MODEL_CONFIG_FILE,
                tmp_path / "ckpt")
    predicted = python(docs_prediction_snippet(small_dataset, tmp_path / "ckpt"))
    assert predicted.returncode == 0, predicted.stderr[-2000:]
    found = re.search(r"predicted (\d+) nodes; test accuracy (\d\.\d+)",
                      predicted.stdout)
    assert found and int(found[1]) == 3000, predicted.stdout
    assert abs(float(found[2]) - reported_test_accuracy(trained.stdout)) < 0.1
    # scripts/check_gpu.py's check loads it on the CPU too.
    import check_gpu

    checked = python(check_gpu.LOAD_ON_CPU, model_file)
    assert checked.returncode == 0, checked.stderr[-2000:]
    # --resume loads such a checkpoint on the CPU.
    loaded = gbrun.checkpoint.load_checkpoint(str(tmp_path / "ckpt"),
                                              checkpoint["config"])
    assert loaded["epoch"] == checkpoint["epoch"]


def _slow_first_load(rank, out_dir):
    """A torchrun rank whose process group gives up after 1 s, while rank 0
    takes 3 s to load the dataset (a first download, say)."""
    import time

    import torch.multiprocessing as mp

    mp.set_sharing_strategy("file_system")
    env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"}
    args = nc.parse_args([])
    plan = planning.plan_run(args, args.gpu, args.num_workers, env, planning.Machine(False, False, 0, 2))
    plan = dataclasses.replace(
        plan, load_timeout=datetime.timedelta(seconds=60))
    dist.init_process_group(
        "gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank,
        world_size=2, timeout=datetime.timedelta(seconds=1))
    try:
        def load_job(args, world_size):
            time.sleep(3)
            return types.SimpleNamespace(dataset=None,
                                         feature=torch.arange(4.0))

        # A job without a dataset, whose /dev/shm needs could be checked.
        gbrun.sources.GraphBoltSource.check_shared_memory = lambda self: None
        job = launch.load_job_in_turn(rank, plan, load_job, args)
        return job.feature.tolist()
    finally:
        launch.destroy_process_group()


@pytest.mark.slow
def test_torchrun_ranks_outwait_a_slow_first_load(tmp_path):
    import torch.multiprocessing as mp

    # The wait for rank 0's load runs over gloo with plan.load_timeout, not
    # with the process group's (NCCL's 10 minutes; 1 s here).
    context = mp.spawn(_slow_first_load, args=(str(tmp_path),), nprocs=2,
                       join=False)
    deadline = time.monotonic() + 120
    try:
        while not context.join(timeout=max(1, deadline - time.monotonic())):
            assert time.monotonic() < deadline, "the ranks did not finish"
    finally:
        for process in context.processes:
            process.kill()


def _loader_cuda_calls(rank, dataset_dir):
    """CUDA calls made while building each GPU mode's loader, torch
    claiming a GPU (the CUDA entry points are recorders)."""
    import threading

    import dgl.graphbolt as gb

    calls = []

    def recorder(name):
        def record(*args, **kwargs):
            calls.append((name, threading.current_thread().name))
            raise RuntimeError(f"torch.cuda.{name} called")
        return record

    torch.cuda.is_available = lambda: True
    for name in ("Stream", "current_stream", "Event", "set_device",
                 "stream"):
        setattr(torch.cuda, name, recorder(name))
    dataset = gb.OnDiskDataset(dataset_dir).load()
    args = nc.parse_args(["--batch-size", "64", "--fanout", "5,5,5"])
    options = {}
    for storage in ("cpu", "pinned", "cuda"):
        device = torch.device("cuda:1")
        options[storage] = gbrun.graphbolt.graphbolt_options(device, storage)
    nc.create_dataloader(dataset.graph, dataset.feature,
                         dataset.tasks[0].train_set, torch.device("cuda:1"),
                         "cpu", True, args, [5, 5, 5])
    return calls, options


@pytest.mark.slow
def test_cpu_cuda_ranks_start_no_cuda_work_in_the_loader(
        small_dataset, tmp_path):
    # dgl 2.1.0 overlaps the feature fetch on a CUDA stream in the loader's
    # prefetch thread, whose device is never set: GPU 0 in every rank. With
    # CPU storage nothing is gained, so cpu-cuda ranks do not ask for it.
    [(calls, options)] = run_gloo_group(
        _loader_cuda_calls, 1, tmp_path, small_dataset)
    assert calls == []
    overlap = {storage: options[storage]["DataLoader"]["overlap_feature_fetch"]
               for storage in options}
    assert overlap == {"cpu": False, "pinned": True, "cuda": True}


def _stop_flags(rank, checks):
    stop = gbrun.stop.StopSignal(torch.device("cpu"), None)
    agreed = []
    for check in range(1, checks + 1):
        if rank == 0 and check == 3:
            stop.received = signal.SIGTERM  # arrives before check 3
        agreed.append(stop.agreed())
    stop.settle()
    return agreed, stop.signum


@pytest.mark.slow
def test_the_stop_flag_is_read_one_step_late_on_every_rank(tmp_path):
    # Each check reads the previous check's all-reduce, so a GPU rank's host
    # never waits for the step it has just queued; every rank still stops at
    # the same step.
    results = run_gloo_group(_stop_flags, 2, tmp_path, 5)
    expected = ([False, False, False, True, True], int(signal.SIGTERM))
    assert results == [expected, expected]


def _host_reads_per_step(rank, dataset_dir):
    """Runs the example's run() as rank `rank` of 2 (5 training steps) and
    records every read of a tensor's value to the host (what waits for a
    GPU) that the example's or the package's code makes inside a training
    step, as (step, function)."""
    import sys

    import gbrun.batches

    # Torch's dropout, as on a GPU: the CPU ranks' kernel reads its seed
    # from a CPU tensor, which waits for nothing.
    args = nc.parse_args(["--dataset", dataset_dir, "--gpu=0,1", "--epochs",
                          "1", "--batch-size", "64", "--fanout", "5,5,5",
                          "--max-batches", "5", "--seed", "1",
                          "--no-fused-dropout"])
    plan = planning.plan_run(args, args.gpu, args.num_workers, {}, planning.Machine(False, False, 0, 2))
    job = nc.load_job(args, cpu_plan(args, 2))
    reads, inside = [], [None]  # the training pass whose step runs now
    batches_iter = gbrun.batches.Batches.__iter__

    def tracked(self):
        for data in batches_iter(self):
            inside[0] = self if self.epoch is not None else None
            yield data
            inside[0] = None

    def counted(owner, name):
        original = getattr(owner, name)

        def call(*args, **kwargs):
            module = sys._getframe(1).f_globals.get("__name__", "")
            if inside[0] is not None and (
                    module == "node_classification"
                    or module.startswith("gbrun")):
                reads.append((inside[0].step,
                              f"{module}.{sys._getframe(1).f_code.co_name}"))
            return original(*args, **kwargs)
        setattr(owner, name, call)

    gbrun.batches.Batches.__iter__ = tracked
    for name in ("item", "tolist", "__bool__", "__int__", "__float__",
                 "cpu", "numpy"):
        counted(torch.Tensor, name)
    counted(torch.cuda, "synchronize")
    counted(torch.cuda.Event, "synchronize")
    nc.dist.init_process_group = lambda **kwargs: None  # the group exists
    stop = gbrun.stop.install(torch.device("cpu"), None)
    nc.run(rank, dataclasses.replace(plan, stop=stop), args, job)
    return reads


@pytest.mark.slow
def test_a_training_step_reads_the_host_once_for_the_stop_flag_before(
        small_dataset, tmp_path):
    # On a GPU each read of a value waits for the GPU: the only one a step
    # makes is the stop flag of the step before, so the host queues a step
    # while the GPU runs the previous one.
    results = run_gloo_group(_host_reads_per_step, 2, tmp_path, small_dataset)
    expected = [(step, "gbrun.stop.read") for step in range(2, 6)]
    assert results == [expected, expected]


def test_a_refused_pin_is_one_line(small_dataset, monkeypatch):
    dataset = gbrun.data.datasets.load_dataset(small_dataset)

    def refused():
        raise AssertionError  # what dgl 2.1.0 raises: a bare assert

    monkeypatch.setattr(dataset.graph, "pin_memory_", refused)
    with pytest.raises(gbrun.cli.UsageError) as refusal:
        gbrun.placement.place_graph(dataset, "pinned", torch.device("cuda:0"), 0,
                            "feat")
    message = str(refusal.value)
    assert "pinning the graph and features in host memory failed" in message
    assert "--mode cpu-cuda" in message and "\n" not in message


@pytest.mark.slow
@pytest.mark.parametrize("machine", ["no CUDA", "CUDA torch, CPU-only DGL"])
def test_check_gpu_skips_cleanly_where_dgl_has_no_cuda(machine):
    if machine != "no CUDA" and planning.dgl_has_cuda():
        pytest.skip("DGL here is a CUDA build: the checks would run")
    env = dict(NO_GPU)
    if machine != "no CUDA":
        env = {"PYTHONPATH": os.pathsep.join(
            filter(None, [FAKE_CUDA, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, os.path.join(SCRIPTS, "check_gpu.py")],
        capture_output=True, text=True, timeout=120, cwd=REPO,
        env={**os.environ, **env})
    assert done.returncode == 0, done.stderr[-2000:]
    reason = ("torch sees no CUDA device" if machine == "no CUDA"
              else "this DGL is a CPU-only build")
    assert done.stdout.startswith(f"skipped: {reason}"), done.stdout
