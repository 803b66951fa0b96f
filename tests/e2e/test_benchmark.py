"""benchmarks/benchmark.py measures what the README quotes. No timing is
asserted here: the figures live in the README and docs/performance.md,
produced by benchmarks/benchmark.py."""
import json
import os
import subprocess
import sys

import pytest

from helpers import BENCHMARKS, REPO, run_in_process

import benchmark


@pytest.mark.slow
def test_benchmark_measures_bare_loop_and_script(small_dataset, tmp_path):
    out = tmp_path / "perf.json"
    done = subprocess.run(
        [sys.executable, os.path.join(BENCHMARKS, "benchmark.py"),
         "--dataset", small_dataset, "--ranks", "2", "--threads", "1",
         "--batches", "3", "--batch-size", "64", "--fanout", "5,5,5",
         "--interval", "0.1", "--stages", "5,5,5", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    runs = {run["name"]: run for run in json.loads(out.read_text())["runs"]}
    assert sorted(runs) == ["bare 1t", "bare 1t+tuned", "script 2r x 1t"]
    for name, run in runs.items():
        assert run["exit_code"] == 0, name
        assert run["seeds_per_s"] > 0, name
        assert run["batches_per_rank"] == 3, name
        assert 0 <= run["wait_per_batch"] <= run["s_per_batch"], name
        assert 0 < run["startup_s"] < 120, name
        assert run["rank_uss_peak_mib"] > 0, name
        # The tree's CPU time inside the training window, from its own
        # samples: some, and no more than the machine's cores could give.
        window = run["s_per_batch"] * run["batches_per_rank"]
        cpu = run["user_s"] + run["sys_s"]
        assert 0 < cpu <= 1.2 * window * os.cpu_count() + 0.2, (name, run)
    # The script's runs have a launcher (mp.spawn) besides their ranks.
    assert runs["script 2r x 1t"]["launcher_uss_peak_mib"] > 0
    assert runs["bare 1t"]["launcher_uss_peak_mib"] is None
    assert "vs_bare" in runs["script 2r x 1t"]
    # The table is printed, one row per run.
    for name in runs:
        assert name in done.stdout
    # One rank's stages: each took time; a batch of 64 seeds with fanout
    # 5,5,5 has more input nodes than seeds, and at most all 3,000 nodes.
    (stages,) = json.loads(out.read_text())["stages"]
    assert stages["fanout"] == [5, 5, 5] and stages["exit_code"] == 0
    assert stages["precision"] == "fp32"
    assert 64 < stages["input_nodes"] <= 3000
    for stage in ("sample_s", "fetch_graphbolt_s", "fetch_s", "compute_s"):
        assert stages[stage] > 0, stage
    assert "fetch gb" in done.stdout


@pytest.mark.parametrize(
    "extra,message",
    [
        ([], "has no metadata.yaml"),
        # These two import the example's model (torch, DGL): seconds, once.
        pytest.param(["--fanout", "5,5"], "--fanout '5,5' needs 3 values",
                     marks=pytest.mark.slow),
        pytest.param(["--stages", "5,5"], "--fanout '5,5' needs 3 values",
                     marks=pytest.mark.slow),
        (["--no-runs"], "--no-runs needs --stages"),
        (["--ranks", "0"], "--ranks: 0 is too small (at least 1)"),
        (["--env", "X"], "--env: 'X': expected NAME=VALUE"),
    ],
)
def test_benchmark_refuses_bad_input(small_dataset, tmp_path, monkeypatch,
                                     capsys, extra, message):
    # In this process: the refusals come before any run is started.
    dataset = str(tmp_path) if not extra else small_dataset
    code, err = run_in_process(monkeypatch, capsys, benchmark.main,
                               ["benchmark.py", "--dataset", dataset, *extra])
    assert code == 2
    assert len(err) == 1 and message in err[0], err


# Writes a warm-up and a timed epoch record to metrics.jsonl (argv[1]) as
# the example does: 1 s asleep before the warm-up one, 1 s of CPU time
# computing before the timed one (not of wall time: under load it takes
# longer, never less), asleep 1 s after both.
TWO_EPOCHS = """
import json, sys, time
for epoch in range(2):
    if epoch == 0:
        time.sleep(1)
    start = time.process_time()
    while epoch == 1 and time.process_time() - start < 1:
        sum(range(10000))
    with open(sys.argv[1] + "/metrics.jsonl", "a") as f:
        f.write(json.dumps({"epoch": epoch, "epoch_time": 1.0,
                            "train_time": 1.0, "seeds_per_second": 10.0,
                            "data_wait": 0.0}) + "\\n")
time.sleep(1)
"""


@pytest.mark.slow
def test_benchmark_reads_memory_in_every_epoch_but_the_timed_one(tmp_path):
    # Reading PSS/USS costs the kernel ~0.1 s per look at a 2-rank job, time
    # the ranks would lose: only CPU times are read in the timed epoch.
    epochs, samples, _, code, _ = benchmark.measure(
        [sys.executable, "-c", TWO_EPOCHS, str(tmp_path)], None, 0.05, 60,
        ("rank", None), str(tmp_path)
    )
    assert code == 0 and len(epochs) == 2
    warm, timed = epochs[0]["arrived"], epochs[1]["arrived"]
    # A sample decides before it is stamped, and a record is stamped when
    # the sampler reads it: so no margins are needed on these two sides.
    assert all(s["procs"] for s in samples if s["t"] < warm)
    skipped = [s for s in samples if s["procs"] is None]
    assert skipped and all(warm < s["t"] for s in skipped)
    # Once the timed record is in, memory is read again (the child sleeps
    # on for a second; 0.1 s covers a sampling interval and more).
    assert all(s["t"] < timed + 0.1 for s in skipped)
    assert any(s["procs"] for s in samples if s["t"] > timed)
    # CPU times are still read while memory is not: the busy epoch's
    # computing shows in them, however little of it the load lets through
    # between two samples (no figure: any growth is the fact checked).
    cpu = [s["user"] + s["system"] for s in skipped]
    assert cpu == sorted(cpu) and cpu[-1] > cpu[0], skipped


def _epoch(arrived, time, train_time, seeds_per_s, data_wait):
    return dict(arrived=arrived, epoch_time=time, train_time=train_time,
                seeds_per_second=seeds_per_s, data_wait=data_wait)


def _sample(t, user, pss_mib=None, roles=()):
    procs = None if pss_mib is None else [
        {"pid": i, "role": role, "pss": pss_mib * 2**20 // len(roles),
         "uss": (i + 1) * 2**20}
        for i, role in enumerate(roles)
    ]
    return {"t": t, "user": user, "system": user / 10, "procs": procs}


def test_benchmark_summary_is_what_the_records_and_samples_say():
    # Launched at 0. Warm-up epoch: training 2-4 s (line at 5 s, Time 3).
    # Timed epoch: training 6-8 s (line at 9 s), 2 ranks x 64 seeds x 4
    # batches in 2 s, 0.5 s of it waiting for data. CPU grows 1.5 s per s.
    epochs = [_epoch(5, 3, 2, 256, 0.4), _epoch(9, 3, 2, 256, 0.5)]
    roles = ("launcher", "rank", "rank")
    samples = [_sample(t, 1.5 * t, pss, roles if pss else ())
               for t, pss in [(1, 100), (3, 300), (4.5, 200), (7, None),
                              (9.5, 400)]]
    result = benchmark.summarize(epochs, samples, 0, 2, 64)
    assert result["batches_per_rank"] == 4
    assert result["s_per_batch"] == pytest.approx(0.5)
    assert result["wait_per_batch"] == pytest.approx(0.125)
    assert result["compute_per_batch"] == pytest.approx(0.375)
    assert result["startup_s"] == pytest.approx(2)
    # Interpolated between the samples at 4.5 and 7 s and at 7 and 9.5 s.
    assert result["user_s"] == pytest.approx(3.0)
    assert result["sys_s"] == pytest.approx(0.3)
    # Peak of the whole run; and of the warm-up training window alone.
    assert result["tree_pss_peak_mib"] == pytest.approx(400, abs=1)
    assert result["tree_pss_train_mib"] == pytest.approx(300, abs=1)
    assert result["launcher_uss_peak_mib"] == 1
    assert result["rank_uss_peak_mib"] == 3
    assert result["worker_uss_peak_mib"] is None


def test_benchmark_ratios_compare_like_with_like():
    def run(name, seeds, threads=1, ranks=None, workers=0, precision="fp32",
            dropout="fused"):
        return dict(name=name, seeds_per_s=seeds, threads=threads,
                    ranks=ranks, workers=workers, precision=precision,
                    dropout=dropout)

    runs = [
        run("bare 1t", 100), run("bare 1t+tuned", 400),
        run("bare 2t", 150, threads=2),
        run("script 1r x 1t", 80, ranks=1),
        run("script 2r x 1t", 120, ranks=2),
        run("script 2r x 1t w1", 200, ranks=2, workers=1),
        run("script 1r x 1t w1", 50, ranks=1, workers=1),
        run("script 2r x 2t", 300, threads=2, ranks=2),
        run("script 2r x 1t bf16", 60, ranks=2, precision="bf16"),
        run("script 1r x 1t torch-dropout", 40, ranks=1, dropout="torch"),
        run("script 2r x 1t torch-dropout", 96, ranks=2, dropout="torch"),
    ]
    benchmark.add_ratios(runs)
    by_name = {r["name"]: r for r in runs}
    two = by_name["script 2r x 1t"]
    # Against the plain bare loop with as many threads, not the tuned one.
    assert two["vs_bare"] == pytest.approx(1.2)
    assert by_name["script 2r x 2t"]["vs_bare"] == pytest.approx(2.0)
    # Against one rank with the same threads and workers.
    assert two["vs_one_rank"] == pytest.approx(1.5)
    assert by_name["script 2r x 1t w1"]["vs_one_rank"] == pytest.approx(4.0)
    assert "vs_one_rank" not in by_name["script 2r x 2t"]  # no 1r x 2t run
    # On the same cores: 2 ranks x 1 thread against one bare process with 2
    # threads; 1 rank x 1 thread against bare 1t; no bare 4t for 2r x 2t.
    assert two["vs_bare_cores"] == pytest.approx(0.8)
    assert by_name["script 1r x 1t"]["vs_bare_cores"] == pytest.approx(0.8)
    assert "vs_bare_cores" not in by_name["script 2r x 2t"]
    # bf16 against the same run in fp32; no bare bf16 run to compare with.
    assert by_name["script 2r x 1t bf16"]["vs_fp32"] == pytest.approx(0.5)
    assert "vs_bare" not in by_name["script 2r x 1t bf16"]
    assert "vs_bare" not in by_name["bare 1t"]
    # Fused dropout against the same run with torch's; one rank with the
    # same dropout.
    assert two["vs_torch_dropout"] == pytest.approx(1.25)
    assert "vs_torch_dropout" not in by_name["script 2r x 2t"]
    torch_two = by_name["script 2r x 1t torch-dropout"]
    assert torch_two["vs_one_rank"] == pytest.approx(2.4)
    assert "vs_torch_dropout" not in torch_two


# ------------------------------------------------------- the link task
def test_link_arms_train_the_same_pairs(tmp_path, monkeypatch):
    # --task link: upstream's loop (one process, torch's default threads)
    # steps ranks x --batches batches of the example's size, fanout and
    # negatives, so that both arms train as many pairs per epoch.
    (tmp_path / "metadata.yaml").write_text("")
    # The example's layers, without importing torch for them here.
    monkeypatch.setattr(benchmark, "model_layers", lambda example, task: 3)
    args = benchmark.parse_args(["--dataset", str(tmp_path), "--task", "link",
                                 "--batches", "3", "--neg-ratio", "2"])
    upstream, script = benchmark.plan_runs(args, str(tmp_path / "logs"))

    def option(run, name):
        return run.command[run.command.index(name) + 1]

    assert upstream.threads is None and upstream.ranks is None
    assert upstream.command[1].endswith("bare_link_loop.py")
    assert script.command[1].endswith("link_prediction.py")
    assert option(script, "--gpu") == "0,1"
    assert option(upstream, "--batches") == "6"
    assert option(script, "--max-batches") == "3"
    for name, value in [("--batch-size", "512"), ("--fanout", "10,10,10"),
                        ("--neg-ratio", "2"), ("--dataset", str(tmp_path))]:
        assert option(upstream, name) == option(script, name) == value, name


def test_link_table_pairs_each_round_with_upstreams():
    # x upstream is the median of each round's ratio to upstream's run in
    # the same round (here 2.0, 1.0, 1.25: 1.25), not the ratio of the
    # medians (1,200 / 800 = 1.5); a failed round counts in neither.
    runs = [benchmark.Run("upstream loop 1p", [], threads=None),
            benchmark.Run("script 2r x 1t", [], ranks=2)]

    def rounds(*figures):
        return [{"exit_code": 0, "seeds_per_s": pairs, "val_mrr": mrr,
                 "load_before": 1.0, "startup_s": 5.0}
                if pairs else {"exit_code": 1} for pairs, mrr in figures]

    repeats = [rounds((500, 0.30), (1200, 0.32), (800, 0.31), (900, 0.2)),
               rounds((1000, 0.29), (1200, 0.30), (1000, 0.31), (None, 0))]
    upstream, script = benchmark.link_rows(runs, repeats)
    assert script["vs_upstream_all"] == [2.0, 1.0, 1.25]
    assert script["vs_upstream"] == 1.25
    assert script["median_seeds_per_s"] == 1000
    assert (script["worst_seeds_per_s"], script["seeds_per_s"]) == (1000, 1200)
    assert script["val_mrr_range"] == "0.2900-0.3100"
    assert upstream["median_seeds_per_s"] == 850
    assert upstream["median_val_mrr"] == pytest.approx(0.305)
    assert "vs_upstream" not in upstream


def test_upstream_link_loop_trains_and_scores(synthetic, tmp_path):
    # Both epochs train --batches steps of --batch-size positive pairs; the
    # last one is scored by the example's MRR (100 nodes, 10 negatives:
    # chance is about 0.29, a score is in (0, 1]).
    import bare_link_loop

    dataset = synthetic("links-tiny", "--num-nodes", 100, "--avg-degree",
                        4, "--feat-dim", 8, "--link-negatives", 10)
    bare_link_loop.main(["--dataset", dataset, "--log-dir", str(tmp_path),
                         "--batches", "2", "--batch-size", "16",
                         "--fanout", "2,2,2"])
    records = [json.loads(line) for line in
               (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [0, 1]
    assert all(r["pairs"] == 32 and r["seeds_per_second"] > 0
               for r in records)
    assert "val_mrr" not in records[0] and 0 < records[1]["val_mrr"] <= 1
    assert records[1]["epoch_time"] >= records[1]["train_time"]
