"""What a run leaves behind: seeds, checkpoints and resume, the final model,
metrics.jsonl and the plot of it."""
import json
import math
import os
import shutil
import re
import select
import signal
import subprocess
import sys
import time
from xml.etree import ElementTree

import pytest
import torch

import gbrun.batches
import gbrun.cli
import gbrun.checkpoint
import gbrun.data.datasets
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


@pytest.mark.slow
def test_killed_run_resumes_from_its_last_checkpoint(small_dataset, tmp_path):
    # One rank with one thread (two ranks, and one rank with two threads, are
    # resumed exactly in the SIGTERM tests below).
    import node_classification as nc

    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    common = ["--gpu=0", "--threads", "1", "--batch-size", "64", "--fanout",
              "5,5,5", "--epochs", "2", "--seed", "5", "--dataset",
              small_dataset]
    # The uninterrupted run side by side with the one whose rank is killed
    # while epoch 1 (the second and last) trains.
    other = start([sys.executable, SCRIPT, *common], env=NO_GPU)
    job = start([sys.executable, SCRIPT, *common, "--checkpoint-dir", ckpt,
                 "--log-dir", logs], env=NO_GPU)
    try:
        before = read_until(job, r"(?m)^Epoch 00000.*\n", 120)
        ranks = spawned_ranks(job.pid)
        assert len(ranks) == 1
        kill_rank_and_expect_failure(job, ranks[0])
        uninterrupted = finish(other, 120)
    finally:
        kill_session(job)
        kill_session(other)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-2000:]

    # The checkpoint of epoch 0 is there and loads; the model has no DDP
    # prefixes.
    checkpoint = torch.load(ckpt / gbrun.checkpoint.CHECKPOINT_FILE, weights_only=True)
    assert checkpoint["epoch"] == 1 and checkpoint["seed"] == 5
    assert checkpoint["config"]["fanout"] == [5, 5, 5]
    assert not any(k.startswith("module.") for k in checkpoint["model"])
    assert not os.path.exists(ckpt / gbrun.checkpoint.MODEL_FILE)

    # Without --seed: the checkpoint's seed continues the run.
    at = common.index("--seed")
    unseeded = common[:at] + common[at + 2:]
    resumed = run_example(
        [*unseeded, "--checkpoint-dir", ckpt, "--log-dir", logs, "--resume"],
        env=NO_GPU,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"Resuming from {ckpt} at epoch 1." in resumed.stdout
    later = epoch_lines(resumed.stdout)
    assert [int(line[0]) for line in later] == [1]
    # Digit for digit what the uninterrupted run printed.
    assert metrics_without_time(before + resumed.stdout) == (
        metrics_without_time(uninterrupted.stdout))
    assert reported_test_accuracy(resumed.stdout) == (
        reported_test_accuracy(uninterrupted.stdout))

    # The final model loads into the example's model as is.
    model = nc.create_model(32, 10)
    model.load_state_dict(torch.load(ckpt / gbrun.checkpoint.MODEL_FILE, weights_only=True))

    # metrics.jsonl: epoch 0 from the killed run, 1 and the test result
    # from the resumed one.
    records = [json.loads(line) for line in open(logs / gbrun.records.METRICS_FILE)]
    assert [r.get("epoch") for r in records] == [0, 1, None]
    assert set(records[0]) == {
        "epoch", "loss", "metric", "val_accuracy", "epoch_time",
        "train_time", "seeds_per_second", "data_wait", "ranks",
    }
    assert records[0]["metric"] == "Accuracy"
    assert records[0]["ranks"] == 1 and records[0]["seeds_per_second"] > 0
    assert abs(
        records[-1]["test_accuracy"] - reported_test_accuracy(resumed.stdout)
    ) < 1e-4

    # And the curves can be drawn, with a second run overlaid (in this
    # process; the command line runs in test_plot_metrics_names_a_missing_log).
    import plot_metrics

    svg = tmp_path / "curves.svg"
    plot_metrics.main([str(logs), str(logs), "--out", str(svg)])
    # Well-formed, with a line per run in each of the two panels.
    drawn = ElementTree.parse(svg).getroot()
    assert len(drawn.findall("{http://www.w3.org/2000/svg}polyline")) == 4


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
def test_stopped_in_validation_and_inside_an_epoch_the_run_resumes_exactly(
        small_dataset, tmp_path, reference_run):
    # The reference's two ranks: 14 steps per epoch and rank, so check 15
    # comes after epoch 0's validation.
    uninterrupted, _ = reference_run
    ckpt = tmp_path / "ckpt"
    common = [*REFERENCE, "--dataset", small_dataset, "--checkpoint-dir", ckpt]

    # A signal during validation stops at the epoch's checkpoint.
    first, checkpoint = stopped_at_check(15, common, ckpt)
    assert (checkpoint["epoch"], checkpoint["step"]) == (1, 0)
    assert stop_message(signal.SIGTERM, ckpt, 1, 0) in first.stdout.splitlines()
    # Resumed and stopped again late in epoch 1 (check 11, read at step 12):
    # the checkpoint keeps both ranks' sums so far.
    second, checkpoint = stopped_at_check(11, [*common, "--resume"], ckpt)
    assert f"Resuming from {ckpt} at epoch 1." in second.stdout
    assert (checkpoint["epoch"], checkpoint["step"]) == (1, 12)
    assert len(checkpoint["partial"]) == 2
    assert stop_message(signal.SIGTERM, ckpt, 1, 12) in (
        second.stdout.splitlines())

    last = run_example([*common, "--resume"], env=NO_GPU)
    assert last.returncode == 0, last.stderr[-2000:]
    assert f"Resuming from {ckpt} at epoch 1, step 12." in last.stdout
    assert metrics_without_time(first.stdout + second.stdout + last.stdout) == (
        metrics_without_time(uninterrupted.stdout))
    assert reported_test_accuracy(last.stdout) == (
        reported_test_accuracy(uninterrupted.stdout))
    # Seeds/s is what a run trained in its train time: in the resumed epoch
    # 2 steps x 64 seeds x 2 ranks, not the epoch's 14 steps (7 times more),
    # and 14 steps in the next epoch.
    times = {int(epoch): float(seconds) * float(rate)
             for epoch, seconds, rate in EPOCH_TIMES.findall(last.stdout)}
    assert times == pytest.approx({1: 2 * 64 * 2, 2: 14 * 64 * 2}, rel=0.05)


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
    assert metrics_without_time(resumed.stdout) == (
        metrics_without_time(uninterrupted.stdout))
    assert reported_test_accuracy(resumed.stdout) == (
        reported_test_accuracy(uninterrupted.stdout))


# The real signals of signalled_runs: (name, signal, whom, seed, when).
SIGNALLED = [
    # The launcher, which relays it to the ranks.
    ("SIGTERM to the launcher", signal.SIGTERM, "launcher", 1, "epoch 0"),
    # Ctrl-C in a terminal: every process; the ranks leave it to the
    # launcher.
    ("Ctrl-C", signal.SIGINT, "group", 2, "epoch 0"),
    # A scheduler that signals every process of the job, while the ranks
    # are still starting (importing torch): ranks take SIGTERM as a stop
    # request too, and are born with it blocked until they handle it.
    ("SIGTERM to every process at start-up", signal.SIGTERM, "group", 3,
     "start"),
    # A scheduler that signals one process: rank 1 alone hears it, and
    # every rank stops with it (the ranks agree on an all-reduced flag).
    ("SIGTERM to rank 1", signal.SIGTERM, "rank 1", 4, "epoch 0"),
]
TRIGGER = {"epoch 0": rb"(?m)^Epoch 00000 .*\n",
           "start": rb"(?m)^Training with 2 CPU processes\.\n"}


@pytest.fixture(scope="module")
def signalled_runs(small_dataset, tmp_path_factory):
    """The reference's arguments, run side by side with seeds 1, 2 and 3
    for --epochs 10 (far from done when signalled), each sent a real signal
    as SIGNALLED says, as soon as it printed the line of TRIGGER. Returns
    {name: (CompletedProcess, checkpoint dir)}."""
    out = tmp_path_factory.mktemp("signalled")
    jobs = {}
    for name, signum, _, seed, _ in SIGNALLED:
        args = [*REFERENCE, "--dataset", small_dataset, "--checkpoint-dir",
                out / str(seed)]
        args[args.index("--seed") + 1] = seed
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
        for name, signum, _, seed, _ in SIGNALLED:
            run = finish(jobs[name], 60)
            run.stdout = seen[fds[name]].decode() + run.stdout
            runs[name] = (run, out / str(seed))
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
        "from gbrun.checkpoint import save_atomically\n"
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


class _RunsCode:
    """Unpickling this calls os.system: what a hostile checkpoint holds."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_that_would_run_code_is_refused(
    small_dataset, tmp_path, capsys, nothing_spawned
):
    path = make_checkpoint(tmp_path / "hostile", small_dataset)
    checkpoint = torch.load(path, weights_only=True)
    marker = tmp_path / "code-ran"
    checkpoint["config"]["extra"] = _RunsCode(marker)
    torch.save(checkpoint, path)
    error = resume_error(capsys, small_dataset, tmp_path / "hostile")
    assert "holds objects other than tensors and plain data" in error
    assert "nothing in it ran" in error
    assert not marker.exists()
    # The same file loaded the way the refusal protects against runs it.
    torch.load(path, weights_only=False)
    assert marker.exists()


DROPPED = object()


def make_checkpoint(directory, dataset_dir, position=(), run_epochs=None,
                    **changes):
    """A checkpoint of epoch 1 (or of `position`: epoch, step, partial sums)
    with seed 9 and `changes` to the configuration (DROPPED: no such key);
    `run_epochs`: the epochs its run was asked for (not recorded: None)."""
    import node_classification as nc

    args = nc.parse_args(["--dataset", dataset_dir, "--fanout", "5,5,5"])
    job = nc.load_job(args, cpu_plan(args, 1))
    model = nc.create_model(job.in_size, job.num_classes)
    optimizer = torch.optim.Adam(model.parameters())
    epoch, step, partial = position or (1, 0, None)
    checkpoint = {
        "model": model.state_dict(), "optimizer": optimizer.state_dict(),
        "epoch": epoch, "step": step, "partial": partial, "seed": 9,
        "config": {key: value for key, value in {**job.start.key, **changes}.items()
                   if value is not DROPPED},
    }
    if run_epochs is not None:
        checkpoint["epochs"] = run_epochs
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, gbrun.checkpoint.CHECKPOINT_FILE)
    gbrun.checkpoint.save_atomically(checkpoint, path)
    return path


def resume_error(capsys, dataset, directory, *extra):
    import node_classification as nc

    with pytest.raises(SystemExit) as exit_info:
        nc.main(["--dataset", dataset, "--fanout", "5,5,5", "--epochs", "3",
                 "--checkpoint-dir", str(directory), "--resume", *extra])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    return error


def test_resume_refuses_what_it_cannot_continue(small_dataset, tmp_path, capsys,
                                                nothing_spawned):
    import node_classification as nc

    assert "there is no checkpoint" in resume_error(
        capsys, small_dataset, tmp_path / "empty")

    # Another model: the first difference, on one line.
    model = nc.create_model(7, 10)
    other = nc.resume_key(model, *nc.create_optimizer(model, nc.parse_args([])),
                          nc.parse_args([]), [5, 5, 5])
    make_checkpoint(tmp_path / "other", small_dataset, model=other["model"])
    assert ("was made with another model (repr: '(fc_neigh): Linear("
            "in_features=7, out_features=256, bias=False)' then, '(fc_neigh): "
            "Linear(in_features=32, out_features=256, bias=False)' now)"
            ) in resume_error(
        capsys, small_dataset, tmp_path / "other")

    # The dataset by content: one file of other bytes is another dataset,
    # named by that file (a copy elsewhere is the same: test_staging.py).
    identity = gbrun.data.datasets.dataset_identity(small_dataset)
    files = identity["files"]
    edges = [name for name in files if name.startswith("edges")][0]
    for change, message in [
        ({"dataset": {"path": "/data/before",
                      "files": {**files, edges: "8 bytes, sha256 0000"}}},
         "another dataset, '/data/before', not this run's "
         f"'{os.path.abspath(small_dataset)}' ({edges}: '8 bytes, sha256 "
         f"0000' then, '{files[edges]}' now); refused"),
        ({"fanout": [1, 1, 1]}, "another fanout ([1, 1, 1] then, [5, 5, 5] now)"),
    ]:
        make_checkpoint(tmp_path / "changed", small_dataset, **change)
        assert message in resume_error(
            capsys, small_dataset, tmp_path / "changed")

    os.makedirs(tmp_path / "partial")
    torch.save({"model": {}, "epoch": 1},
               tmp_path / "partial" / gbrun.checkpoint.CHECKPOINT_FILE)
    assert "(KeyError: 'no config, optimizer, seed')" in resume_error(
        capsys, small_dataset, tmp_path / "partial")

    # The precision is part of what a resume must agree on ...
    make_checkpoint(tmp_path / "bf16", small_dataset, precision="bf16")
    assert "another precision ('bf16' then, 'fp32' now)" in (
        resume_error(capsys, small_dataset, tmp_path / "bf16"))
    # ... also where the checkpoint's configuration does not have it.
    make_checkpoint(tmp_path / "older", small_dataset, precision=DROPPED)
    assert "another precision (None then, 'fp32' now)" in (
        resume_error(capsys, small_dataset, tmp_path / "older"))

    # So is the dropout that ran: torch's and the fused kernel draw other
    # masks (the kernel builds here, as tests/unit/cpu/test_dropout.py needs).
    make_checkpoint(tmp_path / "fused", small_dataset)
    assert "another dropout ('fused' then, 'torch' now)" in resume_error(
        capsys, small_dataset, tmp_path / "fused", "--no-fused-dropout")

    make_checkpoint(tmp_path / "seeded", small_dataset)
    assert "--seed 4: the checkpoint was made with --seed 9" in resume_error(
        capsys, small_dataset, tmp_path / "seeded", "--seed", "4")
    assert "has already trained 1 epochs" in resume_error(
        capsys, small_dataset, tmp_path / "seeded", "--epochs", "1")

    # Stopped inside an epoch by two ranks: the sums are per rank.
    make_checkpoint(tmp_path / "inside", small_dataset,
                    position=(1, 3, [[1.5, 64], [1.25, 64]]))
    assert ("checkpoint stopped inside epoch 1 with 2 ranks; resume it with "
            "as many, not 1") in resume_error(
        capsys, small_dataset, tmp_path / "inside", "--gpu=0")

    # Another batch size cuts the epoch into other steps: refused inside
    # an epoch (the resume would skip other items), accepted at its end.
    assert ("stopped inside epoch 1 after step 3, which this run would cut "
            "into other steps (batch_size: 1024 then, 512 now)") in (
        resume_error(capsys, small_dataset, tmp_path / "inside", "--gpu=0,1",
                     "--batch-size", "512"))
    args = nc.parse_args(["--dataset", small_dataset, "--fanout", "5,5,5",
                          "--batch-size", "512"])
    key = nc.load_job(args, cpu_plan(args, 1)).start.key
    assert gbrun.checkpoint.load_checkpoint(tmp_path / "seeded", key)[
        "epoch"] == 1

    path = make_checkpoint(tmp_path / "cut", small_dataset)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    error = resume_error(capsys, small_dataset, tmp_path / "cut")
    assert f"checkpoint '{path}' is unreadable, truncated or corrupted" in error


def test_a_finished_checkpoint_predicts_on_another_dataset_saying_so(
        small_dataset, tmp_path, capsys, nothing_spawned):
    # The same nodes, features and labels, 10% fewer edges: a graph that
    # grew or was cleaned since training. --predict may use it, and says so;
    # training on it may not.
    import numpy as np

    import node_classification as nc

    other = tmp_path / "fewer_edges"
    shutil.copytree(small_dataset, other)
    edges = np.load(other / "edges.npy")
    np.save(other / "edges.npy", edges[:, : edges.shape[1] * 9 // 10])
    # Finished: its run trained the 3 epochs it was asked for.
    finished = make_checkpoint(tmp_path / "done", small_dataset,
                               position=(3, 0, None), run_epochs=3)
    unfinished = make_checkpoint(tmp_path / "half", small_dataset,
                                 run_epochs=3)
    predict = ["--predict", str(tmp_path / "p.npy")]
    # Only predicting, nothing that only training reads is compared or
    # checked: not --epochs (default 10), --fanout, --lr, nor a batch size
    # larger than the train set (1800 nodes).
    args = nc.parse_args(["--dataset", str(other), "--batch-size", "5000",
                          "--lr", "0.5", "--checkpoint-dir",
                          str(tmp_path / "done"), "--resume", *predict])
    job = nc.load_job(args, cpu_plan(args, 1))
    assert (job.start.epochs, job.start.trains) == (3, False)
    said = capsys.readouterr().out
    assert said.count(
        f"Predicting on another dataset, '{other}' (edges.npy: ") == 1, said
    assert said.count(
        f"with the model of {tmp_path / 'done'}, trained 3 epochs on "
        f"'{os.path.abspath(small_dataset)}'; nothing trains.") == 1, said
    job.start.lock.close()
    # Training on it is refused, naming both datasets, also where --predict
    # asks for more epochs of the run than it trained.
    both = (f"another dataset, '{os.path.abspath(small_dataset)}', not "
            f"this run's '{other}' (edges.npy: ")
    assert both in resume_error(capsys, str(other), tmp_path / "done")
    assert both in resume_error(capsys, str(other), tmp_path / "half",
                                *predict)
    # A finished checkpoint without --predict trains on (here: refused, at
    # --epochs); a training resume checks the train split.
    assert "has already trained 3 epochs" in resume_error(
        capsys, small_dataset, tmp_path / "done")
    assert "use --batch-size 1800 or less" in resume_error(
        capsys, small_dataset, tmp_path / "half", "--batch-size", "5000")
    assert os.path.exists(finished) and os.path.exists(unfinished)


def test_resume_refuses_another_optimizer_or_schedule_before_spawning(
        small_dataset, tmp_path, capsys, monkeypatch, nothing_spawned):
    # A checkpoint of the example as it is: Adam, no scheduler, --lr 0.001.
    import node_classification as nc

    make_checkpoint(tmp_path / "adam", small_dataset)

    def adamw(model, args):
        return torch.optim.AdamW(model.parameters(), lr=args.lr,
                                 weight_decay=0.01), None

    def with_schedule(model, args):
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
        return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 3, 0.5)

    def adam_decay(model, args):
        return torch.optim.Adam(model.parameters(), lr=args.lr,
                                weight_decay=0.01), None

    for create_optimizer, message in [
        (adamw, "another optimizer (class: 'Adam' then, 'AdamW' now)"),
        (with_schedule, "another scheduler (None then, {'class': 'StepLR', "
                        "'step_size': 3, 'gamma': 0.5} now)"),
        (adam_decay, "another optimizer (param_groups[0].weight_decay: 0 "
                     "then, 0.01 now)"),
    ]:
        monkeypatch.setattr(nc, "create_optimizer", create_optimizer)
        assert message in resume_error(capsys, small_dataset, tmp_path / "adam")
    monkeypatch.undo()
    assert ("another optimizer (param_groups[0].lr: 0.001 then, 0.5 now)" in
            resume_error(capsys, small_dataset, tmp_path / "adam", "--lr", "0.5"))

    # A warmup from 0 scales lr to 0 whatever --lr is: the key keeps the rate
    # set, and a change of the warmup is named as the scheduler's.
    def warmup(steps):
        def create_optimizer(model, args):
            optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
            return optimizer, torch.optim.lr_scheduler.LambdaLR(
                optimizer, lambda step: min(1.0, step / steps))
        return create_optimizer

    def warmup_from(start):
        def create_optimizer(model, args):
            optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
            return optimizer, torch.optim.lr_scheduler.LambdaLR(
                optimizer, lambda step: min(1.0, start + step / 10))
        return create_optimizer

    monkeypatch.setattr(nc, "create_optimizer", warmup(5))
    make_checkpoint(tmp_path / "warmup", small_dataset)
    assert ("another optimizer (param_groups[0].lr: 0.001 then, 0.01 now)"
            in resume_error(capsys, small_dataset, tmp_path / "warmup",
                            "--lr", "0.01"))
    monkeypatch.setattr(nc, "create_optimizer", warmup_from(0.5))
    make_checkpoint(tmp_path / "from_half", small_dataset)
    monkeypatch.setattr(nc, "create_optimizer", warmup_from(0.25))
    assert ("another scheduler (start_lrs: [0.0005] then, [0.00025] now)"
            in resume_error(capsys, small_dataset, tmp_path / "from_half"))


def test_the_resume_key_tells_apart_models_whose_repr_is_the_same():
    # A parameter's shape need not show in a module's repr (an embedding
    # table held as an nn.Parameter): the key compares shapes too, so such a
    # checkpoint is refused before a rank starts instead of failing inside.
    import node_classification as nc

    class Table(torch.nn.Module):
        def __init__(self, rows):
            super().__init__()
            self.table = torch.nn.Parameter(torch.zeros(rows, 4))

    args = nc.parse_args([])
    keys = []
    for rows in (3, 5):
        model = Table(rows)
        keys.append(nc.resume_key(model, *nc.create_optimizer(model, args),
                                  args, [5]))
    assert repr(Table(3)) == repr(Table(5))
    assert gbrun.checkpoint.difference(keys[0], keys[1]) == (
        "model.shapes.table: [3, 4] then, [5, 4] now")


def test_resume_restores_optimizer_and_scheduler_as_saved():
    # A resumed run continues the schedule: the learning rate is the one the
    # scheduler had reached, not --lr (a cosine schedule resumed at --lr ran
    # its second epoch at the wrong rate).
    import node_classification as nc
    from gbrun.checkpoint import cpu_state
    from gbrun.run_state import restore

    def states(lr):
        model = nc.SAGE(4, 8, 2)
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, 4)
        return model, optimizer, scheduler

    model, optimizer, scheduler = states(0.001)
    model(*_tiny_batch()).sum().backward()
    optimizer.step()
    scheduler.step()
    saved = {"model": cpu_state(model), "optimizer": cpu_state(optimizer),
             "scheduler": cpu_state(scheduler), "epoch": 1, "step": 0}
    again, again_optimizer, again_scheduler = states(0.5)
    restore({"model": again, "optimizer": again_optimizer,
             "scheduler": again_scheduler}, saved, "ck")
    assert again_optimizer.param_groups[0]["lr"] == pytest.approx(
        0.001 * (1 + math.cos(math.pi / 4)) / 2)
    assert again_scheduler.last_epoch == 1
    step = again_optimizer.state_dict()["state"][0]["step"]
    assert float(step) == 1.0
    # A copy: stepping this optimizer leaves the checkpoint's state alone.
    assert again_optimizer.state[next(again.parameters())]["exp_avg"] is not (
        saved["optimizer"]["state"][0]["exp_avg"])
    # The example's own values come back too, on every rank, as copies.
    saved["kept"] = {"best": 0.75, "ema": {"w": torch.ones(2)}}
    kept = restore({"model": again}, saved, "ck")
    assert kept["best"] == 0.75 and kept.keys() == {"best", "ema"}
    assert torch.equal(kept["ema"]["w"], torch.ones(2))
    assert kept["ema"]["w"] is not saved["kept"]["ema"]["w"]
    # What a checkpoint cannot hold is refused when saving, naming it.
    kept["model"] = again
    with pytest.raises(TypeError, match=r"progress.kept\['model'\] is a SAGE"):
        gbrun.checkpoint.check_plain(kept, "progress.kept")
    # A run with a scheduler refuses a checkpoint without one.
    del saved["scheduler"]
    with pytest.raises(gbrun.cli.UsageError, match="has no scheduler state"):
        restore({"model": again, "optimizer": again_optimizer,
                 "scheduler": again_scheduler}, saved, "ck")


def _tiny_batch():
    import dgl

    block = dgl.to_block(dgl.graph(([0, 1], [1, 0]), num_nodes=2))
    return [block] * 3, torch.ones(2, 4)


def test_resume_needs_a_checkpoint_dir(capsys, nothing_spawned):
    import node_classification as nc

    with pytest.raises(SystemExit) as exit_info:
        nc.main(["--resume"])
    assert exit_info.value.code == 2
    assert "--resume needs --checkpoint-dir" in capsys.readouterr().err


def test_a_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    gbrun.checkpoint.save_atomically({"epoch": 1}, str(path))

    def crash(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(gbrun.checkpoint.torch, "save", crash)
    with pytest.raises(OSError):
        gbrun.checkpoint.save_atomically({"epoch": 2}, str(path))
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
