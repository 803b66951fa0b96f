"""What a run leaves behind: seeds, checkpoints and resume, the final model,
metrics.jsonl and the plot of it. (What a resume refuses, checked
in-process: test_resume_refusals.py.)"""
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from xml.etree import ElementTree

import pytest
import torch

import gbrun.batches
import gbrun.checkpoint
import gbrun.outputs
import gbrun.stop

from helpers import (
    cpu_plan,
    NO_GPU,
    REFERENCE,
    SCRIPT,
    SCRIPTS,
    epoch_lines,
    finish,
    gone,
    kill_rank_and_expect_failure,
    kill_session,
    read_until,
    reported_test_accuracy,
    run_example,
    run_gloo_group,
    spawned_ranks,
    start,
)



def metrics_without_time(stdout):
    return [line[:3] for line in epoch_lines(stdout)]


# TEST_SIGTERM_AT_CHECK=N stops a run at an exact step, with no timing
# involved: the Nth stop check of a process acts as if SIGTERM had arrived
# just before it. There is one check per training step and one after each
# epoch's validation; a step reads the previous check's flag, so a stop
# comes one step after its check. A resumed run counts from 1 again.
AT_CHECK = gbrun.stop.TEST_HOOK
EPOCH_TIMES = re.compile(
    r"^Epoch (\d{5}) \|.* \| Train Time (\d+\.\d{4}) \| Seeds/s (\d+\.\d) \|",
    re.MULTILINE)


def stop_message(signum, ckpt, epoch, step):
    where = f"epoch {epoch}" + (f" after step {step}" if step else "")
    return (f"Stopped by {signal.Signals(signum).name} in {where}: checkpoint "
            f"saved in {ckpt}; run the same command with --resume to "
            "continue.")


def check_stopped(run, ckpt):
    """The checkpoint of a run that SIGTERM stopped."""
    assert run.returncode == 128 + signal.SIGTERM, run.stderr[-2000:]
    assert "failed" not in run.stderr
    return torch.load(ckpt / gbrun.checkpoint.CHECKPOINT_FILE, weights_only=True)


def stopped_at_check(check, args, ckpt):
    """Runs the example stopped at `check`; returns its output and its
    checkpoint."""
    run = run_example(args, env={**NO_GPU, AT_CHECK: str(check)})
    return run, check_stopped(run, ckpt)


@pytest.mark.slow
def test_sigterm_stops_one_rank_with_two_threads_at_a_step_exactly(
        small_dataset, tmp_path):
    # 28 steps per epoch; exact because a seeded run samples serially
    # (test_a_seeded_epoch_samples_the_same_batches_with_two_threads).
    ckpt = tmp_path / "ckpt"
    common = ["--gpu=0", "--threads", "2", "--batch-size", "64",
              "--fanout", "5,5,5", "--epochs", "1", "--seed", "11",
              "--dataset", small_dataset]
    # One after the other: two runs of two threads each on two cores slow
    # each other down far more than they overlap.
    uninterrupted = run_example(common, env=NO_GPU)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-2000:]
    stopped, checkpoint = stopped_at_check(
        19, [*common, "--checkpoint-dir", ckpt], ckpt)
    assert (checkpoint["epoch"], checkpoint["step"]) == (0, 20)
    assert len(checkpoint["partial"]) == 1
    assert stop_message(signal.SIGTERM, ckpt, 0, 20) in (
        stopped.stdout.splitlines())

    resumed = run_example([*common, "--checkpoint-dir", ckpt, "--resume"],
                          env=NO_GPU)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"Resuming from {ckpt} at epoch 0, step 20." in resumed.stdout
    assert "unseeded" not in resumed.stdout  # a seeded resume is exact
    assert metrics_without_time(resumed.stdout) == (
        metrics_without_time(uninterrupted.stdout))
    assert reported_test_accuracy(resumed.stdout) == (
        reported_test_accuracy(uninterrupted.stdout))


# The real signals of signalled_runs: (name, signal, whom, seed, when).
START_UP = "SIGTERM to every process at start-up"
SIGNALLED = [
    # The launcher, which relays it to the ranks.
    ("SIGTERM to the launcher", signal.SIGTERM, "launcher", 1, "epoch 0"),
    # Ctrl-C in a terminal: every process; the ranks leave it to the
    # launcher.
    ("Ctrl-C", signal.SIGINT, "group", 2, "epoch 0"),
    # A scheduler that signals every process of the job, while the ranks
    # are still starting (importing torch): ranks take SIGTERM as a stop
    # request too, and are born with it blocked until they handle it. The
    # reference's run itself (seed 1, 3 epochs): it stops inside epoch 0,
    # and test_a_stopped_and_killed_run_resumes_exactly resumes it.
    (START_UP, signal.SIGTERM, "group", 1, "start"),
    # A scheduler that signals one process: rank 1 alone hears it, and
    # every rank stops with it (the ranks agree on an all-reduced flag).
    ("SIGTERM to rank 1", signal.SIGTERM, "rank 1", 4, "epoch 0"),
]
TRIGGER = {"epoch 0": rb"(?m)^Epoch 00000 .*\n",
           "start": rb"(?m)^Training with 2 CPU processes\.\n"}


@pytest.fixture(scope="module")
def signalled_runs(small_dataset, tmp_path_factory):
    """The reference's arguments, run side by side with the seeds of
    SIGNALLED, for --epochs 10 (far from done when signalled; the one
    signalled at start-up keeps the reference's 3), each sent a real signal
    as SIGNALLED says, as soon as it printed the line of TRIGGER. Returns
    {name: (CompletedProcess, checkpoint dir)}."""
    out = tmp_path_factory.mktemp("signalled")
    jobs, ckpts = {}, {}
    for number, (name, signum, _, seed, when) in enumerate(SIGNALLED):
        ckpts[name] = out / str(number)
        args = [*REFERENCE, "--dataset", small_dataset, "--checkpoint-dir",
                ckpts[name]]
        args[args.index("--seed") + 1] = seed
        if when != "start":
            args[args.index("--epochs") + 1] = 10
        jobs[name] = start([sys.executable, SCRIPT, *args], env=NO_GPU)
    try:
        fds = {name: job.stdout.fileno() for name, job in jobs.items()}
        waiting = {fd: name for name, fd in fds.items()}
        seen = dict.fromkeys(waiting, b"")
        deadline = time.monotonic() + 120
        while waiting:
            ready = select.select(list(waiting), [], [],
                                  max(deadline - time.monotonic(), 0))[0]
            assert ready, f"no trigger line within 120 s: {seen}"
            for fd in ready:
                chunk = os.read(fd, 65536)
                assert chunk, f"ended before it was signalled: {seen[fd]}"
                seen[fd] += chunk
                name = waiting[fd]
                _, signum, whom, _, when = next(
                    entry for entry in SIGNALLED if entry[0] == name)
                if re.search(TRIGGER[when], seen[fd]):
                    del waiting[fd]
                    if whom == "launcher":
                        jobs[name].send_signal(signum)
                    elif whom == "rank 1":
                        os.kill(spawned_ranks(jobs[name].pid)[1], signum)
                    else:
                        os.killpg(jobs[name].pid, signum)
        runs = {}
        for name in jobs:
            run = finish(jobs[name], 60)
            run.stdout = seen[fds[name]].decode() + run.stdout
            runs[name] = (run, ckpts[name])
    finally:
        for job in jobs.values():
            kill_session(job)
    return runs


@pytest.mark.slow
def test_the_same_seed_repeats_a_run_and_another_seed_does_not(
        signalled_runs, reference_run):
    # Nothing in an epoch depends on --epochs: the seed-1 run's first epoch
    # is the reference's, digit for digit; the seed-2 run's is not
    # (unseeded, both would differ from the reference).
    reference, _ = reference_run
    first_epoch = {name: metrics_without_time(run.stdout)[:1]
                   for name, (run, _) in signalled_runs.items()}
    seed_1, seed_2 = first_epoch["SIGTERM to the launcher"], first_epoch["Ctrl-C"]
    assert seed_1 == metrics_without_time(reference.stdout)[:1]
    assert seed_2 != seed_1 and len(seed_2) == 1


@pytest.mark.slow
def test_real_signals_stop_every_rank_at_a_checkpoint(signalled_runs):
    # The step a stop lands on depends on timing; what is checked does not.
    for name, signum, _, _, when in SIGNALLED:
        run, ckpt = signalled_runs[name]
        assert run.returncode == 128 + signum, (name, run.stderr[-2000:])
        assert "failed" not in run.stderr and "Traceback" not in run.stderr
        checkpoint = torch.load(ckpt / gbrun.checkpoint.CHECKPOINT_FILE,
                                weights_only=True)
        epoch, step = checkpoint["epoch"], checkpoint["step"]
        # After epoch 0's line; or, signalled at start-up, inside epoch 0
        # (the stop takes effect one step after the signal).
        assert epoch >= 1 if when == "epoch 0" else (epoch, step) == (0, 2)
        assert stop_message(signum, ckpt, epoch, step) in (
            run.stdout.splitlines()), (name, run.stdout)
        assert len(checkpoint["partial"] or [0, 0]) == 2


@pytest.mark.slow
def test_a_stopped_and_killed_run_resumes_exactly(
        signalled_runs, reference_run, small_dataset, tmp_path):
    # One chain of resumes of the reference's arguments, compared line by
    # line with the reference itself: the run signalled at start-up
    # (stopped inside epoch 0) is resumed and its rank 1 killed, resumed
    # and stopped in validation, then resumed to the end without --seed.
    # 14 steps per epoch and rank.
    import node_classification as nc

    uninterrupted, _ = reference_run
    started, started_ckpt = signalled_runs[START_UP]
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    shutil.copytree(started_ckpt, ckpt)  # left as test_real_signals saw it
    # Stopped inside an epoch, the checkpoint keeps both ranks' sums so far.
    checkpoint = torch.load(ckpt / gbrun.checkpoint.CHECKPOINT_FILE,
                            weights_only=True)
    assert (checkpoint["epoch"], checkpoint["step"]) == (0, 2)
    assert len(checkpoint["partial"]) == 2
    common = [*REFERENCE, "--dataset", small_dataset, "--checkpoint-dir",
              ckpt, "--log-dir", logs, "--resume"]

    # Rank 1 is killed while epoch 1 trains: the job fails within seconds
    # and takes its other rank with it.
    job = start([sys.executable, SCRIPT, *common], env=NO_GPU)
    try:
        killed = read_until(job, r"(?m)^Epoch 00000.*\n", 120)
        ranks = spawned_ranks(job.pid)
        assert len(ranks) == 2
        kill_rank_and_expect_failure(job, ranks[1])
        assert all(gone(rank) for rank in ranks)
    finally:
        kill_session(job)
    assert f"Resuming from {ckpt} at epoch 0, step 2." in killed
    # Digit for digit what the uninterrupted run printed (so far; all of it
    # below).
    reference = metrics_without_time(uninterrupted.stdout)
    assert metrics_without_time(started.stdout + killed) == reference[:1]
    # The checkpoint of epoch 0 is there and loads; the model has no DDP
    # prefixes.
    checkpoint = torch.load(ckpt / gbrun.checkpoint.CHECKPOINT_FILE,
                            weights_only=True)
    assert (checkpoint["epoch"], checkpoint["step"]) == (1, 0)
    assert checkpoint["seed"] == 1
    assert checkpoint["config"]["fanout"] == [5, 5, 5]
    assert not any(k.startswith("module.") for k in checkpoint["model"])
    assert not os.path.exists(ckpt / gbrun.checkpoint.MODEL_FILE)

    # A signal during validation stops at the epoch's checkpoint (check 15
    # of a run that trains epoch 1 from its start).
    stopped, checkpoint = stopped_at_check(15, common, ckpt)
    assert f"Resuming from {ckpt} at epoch 1." in stopped.stdout
    assert (checkpoint["epoch"], checkpoint["step"]) == (2, 0)
    assert stop_message(signal.SIGTERM, ckpt, 2, 0) in (
        stopped.stdout.splitlines())

    # Without --seed: the checkpoint's seed continues the run.
    at = common.index("--seed")
    last = run_example(common[:at] + common[at + 2:], env=NO_GPU)
    assert last.returncode == 0, last.stderr[-2000:]
    assert f"Resuming from {ckpt} at epoch 2." in last.stdout
    assert [int(line[0]) for line in epoch_lines(last.stdout)] == [2]
    assert metrics_without_time(
        started.stdout + killed + stopped.stdout + last.stdout) == reference
    assert reported_test_accuracy(last.stdout) == (
        reported_test_accuracy(uninterrupted.stdout))
    # Seeds/s is what a run trained in its train time: in the epoch resumed
    # at step 2, 12 steps x 64 seeds x 2 ranks, not the epoch's 14; and 14
    # steps in the next one.
    times = {int(epoch): float(seconds) * float(rate)
             for epoch, seconds, rate in EPOCH_TIMES.findall(
                 killed + stopped.stdout)}
    assert times == pytest.approx({0: 12 * 64 * 2, 1: 14 * 64 * 2},
                                  rel=0.05)

    # The final model loads into the example's model as is.
    model = nc.create_model(32, 10)
    model.load_state_dict(torch.load(ckpt / gbrun.checkpoint.MODEL_FILE,
                                     weights_only=True))

    # metrics.jsonl: an epoch from each resumed run, then the test result.
    records = [json.loads(line)
               for line in open(logs / gbrun.records.METRICS_FILE)]
    assert [r.get("epoch") for r in records] == [0, 1, 2, None]
    assert set(records[0]) == {
        "epoch", "loss", "metric", "val_accuracy", "epoch_time",
        "train_time", "seeds_per_second", "data_wait", "ranks",
    }
    assert records[0]["metric"] == "Accuracy"
    assert records[0]["ranks"] == 2 and records[0]["seeds_per_second"] > 0
    assert abs(
        records[-1]["test_accuracy"] - reported_test_accuracy(last.stdout)
    ) < 1e-4

    # And the curves can be drawn, with a second run overlaid (in this
    # process; the command line runs in test_plot_metrics_names_a_missing_log).
    import plot_metrics

    svg = tmp_path / "curves.svg"
    plot_metrics.main([str(logs), str(logs), "--out", str(svg)])
    # Well-formed, with a line per run in each of the two panels.
    drawn = ElementTree.parse(svg).getroot()
    assert len(drawn.findall("{http://www.w3.org/2000/svg}polyline")) == 4


_RELAY = """
import os, signal, sys, time
import torch.multiprocessing as mp
from gbrun.stop import relay_stop_signals

if __name__ == "__main__":
    spawn = mp.get_context("spawn")
    request = spawn.Value("i", 0)
    ranks = [spawn.Process(target=time.sleep, args=(600,)) for _ in range(2)]
    for rank in ranks:
        rank.start()
    print(*(rank.pid for rank in ranks), flush=True)
    relay_stop_signals(type("Context", (), {"processes": ranks}), request)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)
    # The first signal is relayed: the ranks run on.
    print(request.value, *(rank.is_alive() for rank in ranks), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
    print("still running", flush=True)
"""


@pytest.mark.slow
def test_the_launcher_relays_one_signal_and_kills_on_the_second():
    job = start([sys.executable, "-c", _RELAY])
    try:
        out = read_until(job, r"^\d+ \d+\n.+\n", 60)
        assert job.wait(timeout=60) == 128 + signal.SIGTERM
        pids = [int(pid) for pid in out.splitlines()[0].split()]
        # The launcher's own kill, not the cleanup below, ends the ranks: a
        # moment for SIGKILL to take effect, and they must be gone.
        deadline = time.monotonic() + 5
        while not all(map(gone, pids)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [pid for pid in pids if not gone(pid)] == []
    finally:
        kill_session(job)
    relayed = out.splitlines()[1]
    assert relayed == f"{int(signal.SIGTERM)} True True"
    assert "still running" not in out + finish(job, 10).stdout


@pytest.mark.slow
def test_sigkill_while_saving_leaves_a_loadable_checkpoint(tmp_path):
    path = tmp_path / "checkpoint.pt"
    saver = (
        "import sys, torch\n"
        "from gbrun.outputs import save_atomically\n"
        "save_atomically({'epoch': 0}, sys.argv[1])\n"
        "print('ready', flush=True)\n"
        "for epoch in range(1, 10**6):\n"
        "    save_atomically({'epoch': epoch,\n"
        "                        'w': torch.randn(2_000_000)}, sys.argv[1])\n"
    )
    for delay in (0.1, 0.5):
        job = start([sys.executable, "-c", saver, path])
        try:
            read_until(job, "ready", 60)
            time.sleep(delay)
            job.kill()
            job.wait()
        finally:
            kill_session(job)
        checkpoint = torch.load(path, weights_only=True)
        assert checkpoint["epoch"] >= 0
        if checkpoint["epoch"] > 0:
            assert checkpoint["w"].shape == (2_000_000,)


def test_a_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    gbrun.outputs.save_atomically({"epoch": 1}, str(path))

    def crash(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(gbrun.outputs.torch, "save", crash)
    with pytest.raises(OSError):
        gbrun.outputs.save_atomically({"epoch": 2}, str(path))
    monkeypatch.undo()
    assert torch.load(path) == {"epoch": 1}
    assert os.listdir(tmp_path) == ["checkpoint.pt"]


def test_plot_metrics_names_a_missing_log(tmp_path):
    result = subprocess.run(
        [sys.executable, os.path.join(SCRIPTS, "plot_metrics.py"),
         tmp_path / "nothing"], capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert "nothing/metrics.jsonl: no such file" in result.stderr


def _sampled_twice(rank, dataset_dir, threads):
    """Samples one seeded training epoch twice with `threads` threads, as a
    rank does, then once with another seed; returns what each pass
    sampled."""
    import node_classification as nc

    torch.set_num_threads(threads)
    args = nc.parse_args(["--dataset", dataset_dir, "--batch-size", "64",
                          "--fanout", "5,5,5"])
    job = nc.load_job(args, cpu_plan(args, 1))
    loader = nc.create_dataloader(
        job.dataset.graph, job.dataset.feature, job.item_sets[0],
        torch.device("cpu"), "cpu", True, args, job.fanout,
    )
    passes = []
    for seed in (7, 7, 8):
        # Rank 1's view, so no progress bar; epoch 0.
        batches = gbrun.batches.Batches(loader, rank + 1, "train", seed, epoch=0)
        # Input node ids, and each layer's edges in the ids the batch uses.
        passes.append([
            [data.input_nodes, *(torch.stack(b.edges()) for b in data.blocks)]
            for data in batches
        ])
    return passes


@pytest.mark.slow
def test_a_seeded_epoch_samples_the_same_batches_with_two_threads(
        small_dataset, tmp_path):
    # What makes a seeded run with --threads 2 repeatable, and a run stopped
    # inside an epoch resumable exactly: the skipped batches are sampled again.
    [(first, second, other_seed)] = run_gloo_group(
        _sampled_twice, 1, tmp_path, small_dataset, 2)
    assert len(first) == len(second) == len(other_seed) == 1800 // 64
    for a, b in zip(first, second):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    # The seed reaches the sampling itself, not only the model's start.
    assert not torch.equal(first[0][0], other_seed[0][0])
