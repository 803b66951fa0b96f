"""gbrun/stop.py: the ranks agree on a stop through a flag each step
all-reduces and reads one step late, so a GPU rank's host never waits for
the step it has just queued: that read is the only one a training step
makes. The stop's collectives (and the example's weighted reduce) keep
their tensors on the rank's device (`meta` stands in for CUDA)."""
import dataclasses
import signal
import sys
import types

import pytest
import torch
import torch.distributed as dist

import gbrun.batches
import gbrun.checkpoint
import gbrun.progress
import gbrun.stop
from gbrun import planning
import node_classification as nc
from helpers import cpu_plan, run_gloo_group

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
        get_rank=lambda: 1,
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


def test_the_engines_batch_count_is_agreed_on_the_trainers_device(
        monkeypatch, tmp_path):
    # DGL's distributed engine: the trainers agree on their number of
    # training batches (a MIN) where a GPU trainer's NCCL group can.
    from gbrun.dgl_engine import partitions

    seen = same_device_collectives(monkeypatch, partitions)
    monkeypatch.setattr(torch.Tensor, "item", lambda tensor: 3)
    config = tmp_path / "graph.json"
    config.write_text('{"node_map": {"_N": [[0, 10]]}}')
    data = partitions.Partitions("graph", str(config))
    loader = data.dataloader(torch.arange(10), True, 2, [5], ["feat"],
                             "label", META)
    assert loader.num_batches == 3 and [t.device for t in seen] == [META]


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
def test_the_stop_flag_is_read_one_step_late_on_every_rank(two_ranks):
    # Each check reads the previous check's all-reduce, so a GPU rank's host
    # never waits for the step it has just queued; every rank still stops at
    # the same step.
    expected = ([False, False, False, True, True], int(signal.SIGTERM))
    assert [flags for flags, _ in two_ranks] == [expected, expected]


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


def _flags_then_host_reads(rank, dataset_dir):
    """Both pieces on one rank of one group (most of a group's time is its
    processes' start-up); the stop flags first, as _host_reads_per_step
    leaves torch's reads counted."""
    return _stop_flags(rank, 5), _host_reads_per_step(rank, dataset_dir)


@pytest.fixture(scope="module")
def two_ranks(small_dataset, tmp_path_factory):
    """_flags_then_host_reads' results on each rank of a 2-rank group."""
    return run_gloo_group(_flags_then_host_reads, 2,
                          tmp_path_factory.mktemp("two_ranks"), small_dataset)


@pytest.mark.slow
def test_a_training_step_reads_the_host_once_for_the_stop_flag_before(
        two_ranks):
    # On a GPU each read of a value waits for the GPU: the only one a step
    # makes is the stop flag of the step before, so the host queues a step
    # while the GPU runs the previous one.
    expected = [(step, "gbrun.stop.read") for step in range(2, 6)]
    assert [reads for _, reads in two_ranks] == [expected, expected]
