"""A machine with GPUs set up from the README: PyPI's torch (CUDA 12.1 build)
sees the GPUs, PyPI's dgl is a CPU-only build. Reproduced without a GPU by
tests/fake_cuda (torch reports 2 GPUs in every process), plus the CUDA-only
decisions that no CPU run reaches: cache sizes per GraphBolt API shape and a
rank that fails before training starts; scripts/check_gpu.py skips cleanly
there and where torch sees no CUDA."""
import inspect
import os
import subprocess
import sys
import time
import types

import dgl.graphbolt as gb
import pytest
import torch

import gbrun.graphbolt
import gbrun.placement
import gbrun.launch as launch
from gbrun import planning
import node_classification as nc
from helpers import (
    FAKE_CUDA,
    NO_GPU,
    REFERENCE,
    REPO,
    SCRIPTS,
    epoch_lines,
    run_example,
    run_gloo_group,
)

FAST = ["--batch-size", 64, "--fanout", "5,5,5"]
# The fake machine has PyPI's CPU-only DGL: where DGL has CUDA it is not
# that machine, and the tests below that build it would test nothing.
cpu_only_dgl = pytest.mark.skipif(
    planning.dgl_has_cuda(), reason="DGL here is a CUDA build")


def fake_gpu_machine():
    path = os.pathsep.join(filter(None, [FAKE_CUDA, os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path}


@pytest.mark.slow
@cpu_only_dgl
def test_the_fake_is_a_cuda_torch_with_a_cpu_only_dgl():
    probe = subprocess.run(
        [sys.executable, "-c",
         "import torch; from gbrun import planning; "
         "print(torch.cuda.is_available(), torch.cuda.device_count(), "
         "planning.dgl_has_cuda())"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
        env={**os.environ, **fake_gpu_machine()},
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.split()[-3:] == ["True", "2", "False"]


@pytest.mark.slow
@cpu_only_dgl
def test_auto_trains_on_cpu_ranks_and_says_how_to_get_gpus(
        small_dataset, reference_run):
    # The reference run's arguments, one epoch: on the fake GPU machine the
    # ranks train as on one without GPUs, to the reference's first epoch
    # line digit for digit (epochs do not depend on --epochs).
    args = [*REFERENCE, "--dataset", small_dataset]
    args[args.index("--epochs") + 1] = 1
    result = run_example(args, env=fake_gpu_machine())
    assert result.returncode == 0, result.stderr[-3000:]
    notice = [line for line in result.stdout.splitlines()
              if "this DGL is a CPU-only build" in line]
    assert len(notice) == 1 and gbrun.graphbolt.INSTALL_CUDA_DGL in notice[0]
    assert "Training with 2 CPU processes." in result.stdout
    reference, _ = reference_run
    assert [line[:3] for line in epoch_lines(result.stdout)] == (
        [line[:3] for line in epoch_lines(reference.stdout)][:1])


@pytest.mark.slow
@cpu_only_dgl
def test_a_cuda_mode_is_refused_before_spawning_on_the_fake_machine(
        small_dataset):
    # The fake machine's own detection, in a process of its own, for the
    # mode auto picks with DGL's CUDA build; every CUDA mode in-process below.
    start = time.time()
    result = run_example(
        ["--gpu=0,1", "--mode", "pinned-cuda", "--dataset", small_dataset],
        env=fake_gpu_machine(), timeout=60,
    )
    assert result.returncode == 2
    error = result.stderr.strip()
    assert len(error.splitlines()) == 1, error
    assert "--mode pinned-cuda needs CUDA, but this DGL is a CPU-only build" in (
        error)
    assert gbrun.graphbolt.INSTALL_CUDA_DGL in error
    assert "Training" not in result.stdout
    assert time.time() - start < 30


@pytest.mark.parametrize("mode", ["pinned-cuda", "cpu-cuda", "cuda-cuda"])
def test_cuda_modes_are_refused_before_spawning(
        small_dataset, monkeypatch, capsys, nothing_spawned, mode):
    # What the fake machine's detection gives (see the test above): torch
    # sees 2 GPUs, DGL is a CPU-only build.
    monkeypatch.setattr(planning, "detect_machine",
                        lambda precision: planning.Machine(True, False, 2, 2))
    with pytest.raises(SystemExit) as exited:
        nc.main(["--gpu=0,1", "--mode", mode, "--dataset", small_dataset])
    assert exited.value.code == 2
    out, error = capsys.readouterr()
    assert len(error.strip().splitlines()) == 1, error
    assert f"--mode {mode} needs CUDA, but this DGL is a CPU-only build" in error
    assert gbrun.graphbolt.INSTALL_CUDA_DGL in error
    assert "Training" not in out


def _build_cpu_loader_where_torch_claims_cuda(rank, dataset_dir):
    # dgl 2.1.0's DataLoader called a CUDA-only GraphBolt op here whenever
    # torch had CUDA, even for CPU ranks.
    torch.cuda.is_available = lambda: True
    dataset = gb.OnDiskDataset(dataset_dir).load()
    args = nc.parse_args(["--batch-size", "64", "--fanout", "5,5,5"])
    loader = nc.create_dataloader(
        dataset.graph, dataset.feature, dataset.tasks[0].train_set,
        torch.device("cpu"), "cpu", True, args, [5, 5, 5],
    )
    return type(loader).__name__


@pytest.mark.slow
@cpu_only_dgl
def test_cpu_loader_builds_where_torch_has_cuda_and_dgl_does_not(
    small_dataset, tmp_path
):
    assert not hasattr(torch.ops.graphbolt, "set_max_uva_threads")
    built = run_gloo_group(
        _build_cpu_loader_where_torch_claims_cuda, 1, tmp_path, small_dataset
    )
    assert built == ["DataLoader"]


def test_a_rank_that_fails_before_training_prints_its_own_cause(capsys):
    # GPU 100 exists on no machine: set_device fails before any process
    # group or dataset (on a machine with a GPU 7, --gpu=7 started NCCL and
    # the download of ogbn-products). torch 2.2 keeps device ids in 8 bits:
    # set_device(999) wraps around to a negative id and does nothing.
    args = nc.parse_args(["--gpu=100", "--mode", "cuda-cuda"])
    plan = planning.plan_run(args, args.gpu, args.num_workers, {}, planning.Machine(True, True, 128, 2))
    with pytest.raises(Exception):
        launch.run_rank(0, nc.run, plan, args, None)
    error = capsys.readouterr().err
    assert error.startswith("rank 0 failed:\nTraceback")
    assert "set_device" in error


class _Rows:
    """dgl 2.1.0's GPUCachedFeature constructor: a size in rows."""

    def __init__(self, fallback_feature, cache_size):
        self.size = ("rows", cache_size)


class _Bytes:
    """dgl 2.2.1-2.3's GPUCachedFeature constructor: a size in bytes."""

    def __init__(self, fallback_feature, max_cache_size_in_bytes):
        self.size = ("bytes", max_cache_size_in_bytes)


def _function(fallback_features, max_cache_size_in_bytes):
    """dgl 2.4's gb.gpu_cached_feature."""
    return types.SimpleNamespace(size=("bytes", max_cache_size_in_bytes))


def test_gpu_cache_size_for_each_graphbolt_api_shape(monkeypatch):
    # The installed dgl 2.1.0 is the rows shape; the stand-in matches it.
    real = inspect.signature(gb.GPUCachedFeature.__init__).parameters
    assert list(real) == list(inspect.signature(_Rows.__init__).parameters)
    feature = gb.TorchBasedFeature(torch.zeros(10, 25))  # 100 bytes a row
    module = types.ModuleType("gpu_cached_feature")  # what 2.1-2.3 export

    for cached_feature, cls, expected in [
        (module, _Rows, ("rows", 30)),
        (module, _Bytes, ("bytes", 3000)),
        (_function, _Rows, ("bytes", 3000)),
    ]:
        monkeypatch.setattr(gb, "gpu_cached_feature", cached_feature)
        monkeypatch.setattr(gb, "GPUCachedFeature", cls)
        assert gbrun.graphbolt.make_gpu_cache(feature, 3000).size == expected
    # A cache smaller than a row still holds one row.
    monkeypatch.setattr(gb, "gpu_cached_feature", module)
    monkeypatch.setattr(gb, "GPUCachedFeature", _Rows)
    assert gbrun.graphbolt.make_gpu_cache(feature, 50).size == ("rows", 1)


def test_every_feature_the_model_reads_is_cached_and_stored_in_bf16(
        monkeypatch):
    # Two features of 32 and 3 floats a row: a cache of 3,500 bytes is
    # shared 3,200 / 300, so that both caches hold 25 rows.
    store = gb.BasicFeatureStore({
        ("node", None, "feat"): gb.TorchBasedFeature(torch.ones(10, 32)),
        ("node", None, "degree"): gb.TorchBasedFeature(torch.ones(10, 3)),
        ("node", None, "label"): gb.TorchBasedFeature(torch.zeros(10, 1)),
    })
    made = {}

    def cache(feature, cache_bytes):
        made[feature.size()[0]] = cache_bytes
        return feature

    monkeypatch.setattr(gbrun.placement, "make_gpu_cache", cache)
    cached = gbrun.placement.gpu_cached_store(store, ["feat", "degree"], 3500)
    assert made == {32: 3200, 3: 300}
    assert set(cached.keys()) == {("node", None, "feat"),
                                  ("node", None, "degree")}
    dataset = types.SimpleNamespace(feature=store)
    gbrun.data.datasets.store_in_bf16(dataset, ["feat", "degree"])
    assert [store.read("node", None, k).dtype for k in ("feat", "degree",
                                                        "label")] == [
        torch.bfloat16, torch.bfloat16, torch.float32]


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
