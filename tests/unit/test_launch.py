"""gbrun/launch.py: what a killed launch left behind is removed by the
next one; torchrun ranks outwait a first load longer than the process
group's timeout."""
import dataclasses
import datetime
import os
import subprocess
import sys
import time
import types

import pytest
import torch
import torch.distributed as dist

import gbrun.sources
from gbrun import launch, planning
import node_classification as nc
from helpers import cpu_plan


def test_a_later_launch_removes_the_rendezvous_a_killed_one_left(tmp_path):
    """Named after a launcher that no longer runs: removed. A running
    launcher's, another user's and a symlink: left alone."""
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    left = tmp_path / f"{launch.RENDEZVOUS}{ended.pid}-abc"
    left.mkdir()
    (left / "store").write_text("")
    running = tmp_path / f"{launch.RENDEZVOUS}{os.getpid()}-abc"
    running.mkdir()
    others = tmp_path / f"{launch.RENDEZVOUS}{ended.pid}-other"
    others.mkdir()
    os.chown(others, 12345, 12345)
    link = tmp_path / f"{launch.RENDEZVOUS}{ended.pid}-link"
    link.symlink_to(running)
    launch.reclaim_rendezvous(str(tmp_path))
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(
        [running.name, others.name, link.name])


def _slow_first_load(rank, out_dir):
    """A torchrun rank whose process group gives up after 3 s, while rank 0
    takes 6 s to load the dataset (a first download, say)."""
    import time

    import torch.multiprocessing as mp

    # Both ranks arrive before the group is made: its timeout also bounds
    # the rendezvous, and one rank may finish its imports seconds after
    # the other on a loaded machine (seen once: "Wait timeout").
    open(os.path.join(out_dir, f"arrived-{rank}"), "w").close()
    while not all(os.path.exists(os.path.join(out_dir, f"arrived-{r}"))
                  for r in range(2)):
        time.sleep(0.05)

    mp.set_sharing_strategy("file_system")
    env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"}
    args = nc.parse_args([])
    plan = planning.plan_run(args, args.gpu, args.num_workers, env, planning.Machine(False, False, 0, 2))
    plan = dataclasses.replace(
        plan, load_timeout=datetime.timedelta(seconds=60))
    dist.init_process_group(
        "gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank,
        world_size=2, timeout=datetime.timedelta(seconds=3))
    try:
        def load_job(args, world_size):
            time.sleep(6)
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
    # with the process group's (NCCL's 10 minutes; 3 s here).
    context = mp.spawn(_slow_first_load, args=(str(tmp_path),), nprocs=2,
                       join=False)
    deadline = time.monotonic() + 120
    try:
        while not context.join(timeout=max(1, deadline - time.monotonic())):
            assert time.monotonic() < deadline, "the ranks did not finish"
    finally:
        for process in context.processes:
            process.kill()
