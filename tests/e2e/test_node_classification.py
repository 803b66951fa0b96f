"""node_classification.py run as users run it, on CPU ranks with gloo."""
import json
import os
import signal
import sys
import time
from types import SimpleNamespace

import psutil
import pytest

import gbrun.checkpoint
import gbrun.launch

from helpers import (
    cpu_plan,
    LEARNS_IN_3_EPOCHS,
    REPO,
    SCRIPT,
    epoch_lines,
    finish,
    gone,
    kill_session,
    read_until,
    reported_test_accuracy,
    run_example,
    run_gloo_group,
    spawned_ranks,
    start,
)

CHANCE = 0.1  # the synthetic datasets here have 10 classes
FAST = ["--batch-size", 64, "--fanout", "5,5,5"]
# tiny_eval_run's arguments, seeds 0-5: 0.9167 0.9167 0.9167 0.9000 0.9167
# 0.9333 on the 60 test nodes (0.9167-0.9333 without the worker processes).
TINY_EVAL_LEARNS = 0.85
CPU = ["--mode", "cpu-cpu"]  # CPU ranks on any machine, GPUs or not


def check_upstream_output(result, epochs):
    assert result.returncode == 0, result.stderr[-3000:]
    lines = epoch_lines(result.stdout)
    assert [int(line[0]) for line in lines] == list(range(epochs))
    for _, loss, acc, seconds, _ in lines:
        assert float(loss) >= 0 and 0 <= float(acc) <= 1 and float(seconds) > 0
    return reported_test_accuracy(result.stdout)


@pytest.mark.slow
def test_two_cpu_ranks_learn_and_print_upstream_lines(reference_run):
    # `auto` on a machine without CUDA (GPUs, if any, hidden).
    result, _ = reference_run
    accuracy = check_upstream_output(result, epochs=3)
    assert "CUDA is not available: using --mode cpu-cpu" in result.stdout
    assert "Training with 2 CPU processes." in result.stdout
    assert accuracy > LEARNS_IN_3_EPOCHS, result.stdout


def _load_in_turn(rank, dataset):
    """One torchrun rank of a 3-rank node in load_job_in_turn; returns the
    shared-memory files its graph and features live in."""
    import pickle

    import torch.multiprocessing as mp

    import gbrun.data.datasets
    import gbrun.launch as launch
    from gbrun import planning
    import node_classification as nc

    mp.set_sharing_strategy("file_system")  # as launch() does in every rank
    env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "3"}
    args = nc.parse_args(["--dataset", dataset, "--batch-size", "64"])
    plan = planning.plan_run(args, args.gpu, args.num_workers, env, planning.Machine(False, False, 0, 2, False))
    if rank == 2:
        # Receivers unpickle one after another: rank 2 only once rank 1 has
        # built its graph and dropped what the pickle carried for it alone.
        slow = type("SlowPickle", (), {"loads": staticmethod(
            lambda data: time.sleep(2) or pickle.loads(data))})
        launch.pickle = slow
    job = launch.load_job_in_turn(rank, plan, nc.load_job, args)
    tensors = (job.dataset.graph.csc_indptr, job.dataset.graph.indices,
               job.dataset.feature.read(*gbrun.data.datasets.node_key(nc.FEATURE_KEYS[0])))
    # Asking a private tensor for its file would move it to a new one.
    return [t.untyped_storage()._share_filename_cpu_()[1] for t in tensors]


@pytest.mark.slow
def test_torchrun_ranks_of_a_node_share_one_copy_of_the_data(
        small_dataset, tmp_path):
    # torchrun's first rank of a node hands the others the dataset through
    # shared memory. One pickle shared by all of them let the first receiver
    # release what the others still had to open (seen as "unable to open
    # shared memory object" in rank 1, in most two-rank runs).
    files = run_gloo_group(_load_in_turn, 3, tmp_path, small_dataset)
    # One copy per node: every rank maps the same files.
    assert files == [files[0]] * 3, files


# node_classification.py whose ranks first report the shared-memory files of
# their graph and features, then train; the parent reports its own at the end.
REPORT_FILES = """
import os
import sys

import gbrun.data.datasets
import node_classification as nc

train = nc.run  # the example's, in the parent and in each rank


def report(who, job):
    tensors = (job.dataset.graph.csc_indptr, job.dataset.graph.indices,
               job.dataset.feature.read(*gbrun.data.datasets.node_key(nc.FEATURE_KEYS[0])))
    files = [t.untyped_storage()._share_filename_cpu_()[1] for t in tensors]
    # One write, so that the ranks' lines do not interleave.
    sys.stdout.write(f"{who}: {files}\\n")
    sys.stdout.flush()


def listeners():
    # Every listening inet socket of the job (the launcher and all its
    # descendants), once the ranks have met: they evaluate after training.
    import multiprocessing

    import psutil

    job = psutil.Process(multiprocessing.parent_process().pid)
    sockets = []
    for process in [job, *job.children(recursive=True)]:
        sockets += [c.laddr.ip for c in process.net_connections("inet")
                    if c.status == psutil.CONN_LISTEN]
    return sorted(set(sockets))


def run(rank, plan, args, job):
    report(f"rank {rank}", job)
    evaluate = nc.evaluate

    def reporting_evaluate(*args, **kwargs):
        import psutil

        # The training loader's worker (persistent) runs by now.
        workers = [" ".join(p.cmdline()) for p in psutil.Process().children()]
        sys.stdout.write(f"listening on {listeners()}\\n"
                         f"workers of rank {rank}: {workers}\\n")
        sys.stdout.flush()
        nc.evaluate = evaluate
        return evaluate(*args, **kwargs)

    nc.evaluate = reporting_evaluate
    return train(rank, plan, args, job)


if __name__ == "__main__":
    jobs, load_job = [], nc.load_job
    nc.load_job = lambda *args: jobs.append(load_job(*args)) or jobs[0]
    nc.run = run
    nc.main(sys.argv[1:])
    report("parent", jobs[0])
"""


@pytest.fixture(scope="module")
def tiny_eval_run(synthetic, tmp_path_factory):
    """One run for three tests: two CPU ranks, seeded, all neighbors (so
    evaluation depends on the model alone), one sampling worker process per
    rank, on a dataset whose 60 validation and 60 test nodes are fewer than
    one batch per rank; through REPORT_FILES. Returns the CompletedProcess,
    the output directory (model.pt, metrics.jsonl) and the dataset."""
    dataset = synthetic(
        "tiny_eval", "--num-nodes", 3000, "--feat-dim", 32,
        "--split", "0.6,0.02,0.02",
    )
    out = tmp_path_factory.mktemp("tiny_eval")
    script = out / "report_files.py"
    script.write_text(REPORT_FILES)
    path = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    result = run_example(
        ["--gpu=0,1", "--mode", "cpu-cpu", "--dataset", dataset, "--epochs", 3,
         "--batch-size", 64, "--fanout", "-1,-1,-1", "--seed", 1,
         "--num-workers", 1, "--checkpoint-dir", out, "--log-dir", out],
        env={"PYTHONPATH": path}, script=script,
    )
    return result, out, dataset


@pytest.mark.slow
def test_validation_and_test_sets_smaller_than_one_batch_per_rank(
        tiny_eval_run):
    # Rank 1 receives no evaluation items at all (upstream crashes in
    # torch.cat here), so a mean of the ranks' accuracies would be half the
    # exact one.
    result, out, dataset = tiny_eval_run
    accuracy = check_upstream_output(result, epochs=3)
    assert accuracy > TINY_EVAL_LEARNS, result.stdout
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    reported = [records[2]["val_accuracy"], records[3]["test_accuracy"]]

    import dgl.graphbolt as gb
    import torch

    import node_classification as nc

    args = nc.parse_args(["--dataset", dataset, "--fanout", "-1,-1,-1"])
    job = nc.load_job(args, cpu_plan(args, 1))
    model = nc.create_model(job.in_size, job.num_classes)
    model.load_state_dict(torch.load(out / "model.pt", weights_only=True))
    model.eval()

    def exact_accuracy(item_set):
        datapipe = gb.ItemSampler(item_set, batch_size=1000)
        datapipe = datapipe.sample_neighbor(job.dataset.graph, job.fanout)
        datapipe = datapipe.fetch_feature(job.dataset.feature,
                                          node_feature_keys=nc.FEATURE_KEYS)
        correct = total = 0
        with torch.no_grad():
            for data in gb.DataLoader(datapipe):
                predicted = model(data.blocks,
                                  nc.node_features(data))
                correct += int((predicted.argmax(1) == data.labels).sum())
                total += len(data.labels)
        assert total == 60
        return correct / total

    # The last epoch's validation saw the final model too.
    exact = [exact_accuracy(job.item_sets[1]), exact_accuracy(job.item_sets[2])]
    assert reported == pytest.approx(exact, abs=1e-6)


@pytest.mark.slow
def test_spawned_ranks_map_the_parents_copy_of_the_data(tiny_eval_run):
    # The parent loads the dataset once; mp.spawn hands the ranks its
    # tensors through /dev/shm, not copies.
    result, _, _ = tiny_eval_run
    assert result.returncode == 0, result.stderr[-3000:]
    files = dict(line.split(": ", 1) for line in result.stdout.splitlines()
                 if line.startswith(("rank ", "parent: ")))
    assert set(files) == {"rank 0", "rank 1", "parent"}, result.stdout
    assert files["parent"].count("/torch_") == 3, files
    assert files["rank 0"] == files["rank 1"] == files["parent"], files


@pytest.mark.slow
def test_spawned_ranks_listen_on_loopback_alone(tiny_eval_run):
    # They meet through a file store in a private directory, and gloo
    # connects them over lo: nothing a job runs is reachable from another
    # machine (a tcp:// store on 0.0.0.0 was).
    result, _, _ = tiny_eval_run
    seen = [line for line in result.stdout.splitlines()
            if line.startswith("listening on ")]
    assert len(seen) == 2, result.stdout
    for line in seen:
        addresses = eval(line.removeprefix("listening on "))
        assert addresses and set(addresses) <= {"127.0.0.1", "::1"}, line


@pytest.mark.slow
def test_one_worker_process_per_rank_trains(tiny_eval_run):
    result, _, _ = tiny_eval_run
    check_upstream_output(result, epochs=3)
    assert "--num-workers > 0" in result.stdout  # the seed's notice
    # Each rank's worker is its own child, spawned: a worker forked by the
    # fork server the ranks come from would outlive a killed rank.
    workers = [line for line in result.stdout.splitlines()
               if line.startswith("workers of rank ")]
    assert len(workers) == 2, result.stdout
    for line in workers:
        commands = eval(line.split(": ", 1)[1])
        assert len(commands) == 1 and "spawn_main" in commands[0], line


@pytest.mark.parametrize("rank", ["0", "1"])
def test_under_torchrun_only_rank_0_reports_a_bad_argument(
        rank, monkeypatch, capsys):
    # Every torchrun process parses the same arguments before the ranks
    # meet; each exits 2, one line in all.
    import node_classification as nc

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(sys, "argv", ["node_classification.py"])
    with pytest.raises(SystemExit) as exited:
        nc.parse_args(["--fanout", "5,0"])
    assert exited.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == (["node_classification.py: error: argument --fanout: "
                      "'5,0': each fanout is positive, or -1 for all "
                      "neighbors"]
                     if rank == "0" else []), lines


@pytest.mark.slow
def test_torchrun_reports_a_bad_dataset_once(tmp_path):
    # Rank 0 tries to load it; the others wait for its verdict.
    job = start([sys.executable, "-m", "torch.distributed.run",
                 "--standalone", "--nproc-per-node=2", SCRIPT, *CPU,
                 "--dataset", str(tmp_path / "nowhere")])
    try:
        result = finish(job, 120)
    finally:
        kill_session(job)
    # Every rank exits 2; torchrun itself then exits 1 (docs/running.md).
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines()
              if line.startswith("node_classification.py: error: ")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert "nowhere" in errors[0]
    assert "rank 1 failed" not in result.stderr
    assert "rank 0 failed" not in result.stderr
    # torchrun itself then reports that its workers exited with 2.
    assert "exitcode  : 2" in result.stderr or "exit code 2" in (
        result.stderr), result.stderr[-3000:]


RAISES_IN_RANK_1 = """
import sys

import torch.distributed as dist

import node_classification as nc

features, run = nc.node_features, nc.run


def node_features(data):
    if dist.get_rank() == 1:
        raise IndexError("index 99 is out of bounds for dimension 0")
    return features(data)


def raising_run(rank, plan, args, job):
    nc.node_features = node_features  # in each rank
    return run(rank, plan, args, job)


if __name__ == "__main__":
    nc.run = raising_run
    nc.main(sys.argv[1:])
"""


@pytest.mark.slow
def test_an_exception_in_one_rank_fails_the_job(small_dataset, tmp_path):
    # Rank 1 raises while training (a bad index of its own), so rank 0 is
    # left waiting in DDP and has to be stopped.
    script = tmp_path / "raises_in_rank_1.py"
    script.write_text(RAISES_IN_RANK_1)
    start = time.time()
    result = run_example(
        ["--gpu=0,1", "--dataset", small_dataset, "--epochs", 3, *FAST, *CPU],
        timeout=90, script=script, env={"PYTHONPATH": os.pathsep.join(
            filter(None, [REPO, os.environ.get("PYTHONPATH")]))},
    )
    # The launcher's sys.exit("error: training failed; ...").
    assert result.returncode == 1, result.stderr[-3000:]
    assert time.time() - start < 60
    # The cause is shown under the rank that raised it, whatever the
    # launcher reports first.
    cause = result.stderr.index("rank 1 failed:")
    assert "out of bounds" in result.stderr[cause:].split("rank 0 failed")[0]
    assert "error: training failed" in result.stderr


# A killed rank fails the job promptly, taking the other rank with it:
# test_resume.py's test_a_stopped_and_killed_run_resumes_exactly kills one
# (and resumes from the checkpoint it left).


@pytest.mark.slow
def test_a_killed_launcher_takes_its_ranks_and_their_memory_with_it(
        small_dataset, tmp_path):
    # kill -9 of the launcher (an OOM kill, a closed terminal's SIGKILL):
    # nothing of the job may keep training, hold memory or write.
    ckpt = tmp_path / "ckpt"
    job = start([sys.executable, SCRIPT, "--gpu=0,1", "--dataset",
                 small_dataset, "--epochs", "200", "--checkpoint-dir", ckpt,
                 *FAST, *CPU])
    try:
        read_until(job, r"(?m)^Epoch 00000", 120)
        ranks = spawned_ranks(job.pid)
        assert len(ranks) == 2
        # They forked from a fork server that imported the example's
        # modules and torch._dynamo first (gbrun.fork_server.preload).
        server = " ".join(psutil.Process(ranks[0]).parent().cmdline())
        for module in ("'dgl.graphbolt'", "'torchmetrics'", "'gbrun.launch'",
                       "'torch._dynamo'", "'gbrun.preloaded']"):
            assert module in server, server
        # Each rank shows its rank and the launch command in ps, and its
        # environment stays readable (tools find jobs by it).
        for rank, pid in enumerate(ranks):
            title = " ".join(psutil.Process(pid).cmdline())
            assert title.startswith(f"[rank {rank}] "), title
            assert "node_classification.py" in title, title
            assert "OMP_NUM_THREADS" in psutil.Process(pid).environ()
        job_pids = {job.pid, *ranks}
        os.kill(job.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        while not all(gone(pid) for pid in ranks):
            assert time.monotonic() - killed_at < 10, "ranks outlived it"
            time.sleep(0.1)
        saved = {p.name: p.read_bytes() for p in ckpt.iterdir()}
        # torch's shared-memory manager unlinks their segments once they
        # are gone (torch_<pid>_...): none is left 10 s after the kill.
        while any(int(name.split("_")[1]) in job_pids
                  for name in os.listdir("/dev/shm")
                  if name.startswith("torch_")):
            assert time.monotonic() - killed_at < 10, os.listdir("/dev/shm")
            time.sleep(0.2)
        time.sleep(1)
        assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == saved
        # The kernel released the directory's lock with the launcher: a
        # --resume may take it.
        gbrun.checkpoint.DirectoryLock(str(ckpt)).close()
    finally:
        kill_session(job)


def _fails_or_hangs(rank, ready):
    if rank == 1:
        # Once rank 0 takes SIGTERM as a stop request (a loaded machine may
        # start it late: then SIGTERM would still end it).
        deadline = time.monotonic() + 120
        while not os.path.exists(ready) and time.monotonic() < deadline:
            time.sleep(0.05)
        raise RuntimeError("rank 1 fails")
    # As a rank does (StopSignal): SIGTERM is a stop request, not the end;
    # then hung, as a rank can be in gloo's teardown after its peer died.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    open(ready, "w").close()
    time.sleep(600)


@pytest.mark.slow
def test_a_failed_rank_ends_one_that_takes_sigterm_as_a_stop_request(tmp_path):
    import threading

    import torch.multiprocessing as mp

    import gbrun.launch as launch

    context = mp.spawn(_fails_or_hangs, args=(str(tmp_path / "ready"),),
                       nprocs=2, join=False)
    raised = []

    def join():
        try:
            launch.join_ranks(context, grace_s=1)
        except mp.ProcessRaisedException as error:
            raised.append(str(error))

    try:
        joiner = threading.Thread(target=join, daemon=True)
        joiner.start()
        # mp.spawn's join alone would wait for rank 0 for ever.
        joiner.join(timeout=30)
        assert not joiner.is_alive(), "join_ranks left a hung rank running"
        assert [p.exitcode for p in context.processes] == [-signal.SIGKILL, 1]
        # The cause reported is the failed rank's, not the killed one's.
        assert len(raised) == 1 and "rank 1 fails" in raised[0]
    finally:
        for process in context.processes:
            process.kill()

@pytest.mark.parametrize("codes, signum", [
    ([143, 143], signal.SIGTERM),
    ([130, 130], signal.SIGINT),
    # Still exiting when the grace ran out: ended by the launcher (SIGTERM,
    # a second signal for a rank that had one; SIGKILL after that).
    ([-signal.SIGTERM, 143], signal.SIGTERM),
    ([143, -signal.SIGKILL], signal.SIGTERM),
    # No stop: a failure, or two stops that disagree, or none at all.
    ([1, 143], 0),
    ([0, 143], 0),
    ([130, 143], 0),
    ([-signal.SIGKILL, -signal.SIGTERM], 0),
])
def test_ranks_that_stopped_on_their_own_signal(codes, signum):
    import gbrun.launch as launch

    processes = [SimpleNamespace(exitcode=code, join=lambda: None)
                 for code in codes]
    assert launch.stopped_by_their_own(processes) == signum


def _stops_at_once_or_slowly(rank):
    if rank == 0:
        sys.exit(128 + signal.SIGTERM)
    # As a rank that took SIGTERM as its stop request (StopSignal) and is
    # still tearing down: another SIGTERM ends it by the signal.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(600)


@pytest.mark.slow
def test_a_rank_still_exiting_after_the_grace_is_a_stop_not_a_failure():
    """Seen in a loaded test run: the other rank's teardown took longer than
    the grace, join() sent it SIGTERM, and the job said "training failed"
    (exit 1) although every rank had agreed and the checkpoint was saved."""
    import torch.multiprocessing as mp

    import gbrun.launch as launch

    context = mp.spawn(_stops_at_once_or_slowly, nprocs=2, join=False)
    try:
        with pytest.raises(mp.ProcessExitedException):
            launch.join_ranks(context, grace_s=1)
        assert launch.stopped_by_their_own(context.processes) == signal.SIGTERM
        assert [p.exitcode for p in context.processes] == [143,
                                                           -signal.SIGTERM]
    finally:
        for process in context.processes:
            process.kill()


def _loader_on_rank_0_alone(rank):
    import torch

    from gbrun import launch
    from gbrun.graphbolt import gb

    if rank == 0:
        # A user's edit after the test: rank 0 alone iterates a GraphBolt
        # DataLoader. torch's DataLoader makes a process group with every
        # rank each time it is iterated: rank 0 waits for rank 1.
        loader = gb.DataLoader(gb.ItemSampler(gb.ItemSet(10), batch_size=5))
        return sum(len(items) for items in loader)
    # Rank 1 has finished run(): gbrun.launch.run_rank's end.
    plan = SimpleNamespace(finish_timeout=3,
                           device=lambda rank: torch.device("cpu"))
    launch.wait_for_every_rank(rank, plan)


@pytest.mark.slow
def test_a_loader_on_rank_0_alone_fails_within_seconds(tmp_path, capfd):
    began = time.time()
    with pytest.raises(Exception, match="process 1 terminated with exit code 1"):
        run_gloo_group(_loader_on_rank_0_alone, 2, tmp_path, timeout=60)
    assert time.time() - began < 30
    err = capfd.readouterr().err
    assert err.count("rank 1 failed: it finished run() and waited 3 s "
                     "(--finish-timeout) for the other ranks") == 1, err
