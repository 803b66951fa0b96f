"""The script's CPU settings (keep_freed_memory, poll_less) do what their
docstrings say, and scripts/benchmark.py measures what the README quotes.
No timing is asserted here: the figures live in the README and
docs/performance.md, produced by scripts/benchmark.py."""
import json
import os
import platform
import subprocess
import sys

import pytest
import torch

from conftest import REPO, SCRIPTS, run_gloo_group

import benchmark
import node_classification as nc

# In a fresh interpreter: allocate and free 256 MB in the main thread, then
# in another thread (as GraphBolt's prefetch thread does), and print how much
# of each the process still holds afterwards.
KEPT_AFTER_FREE = """
import sys, threading
sys.path.insert(0, sys.argv[2])
import torch
import node_classification as nc

if sys.argv[1] == "tuned":
    nc.keep_freed_memory()

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

def kept_after_free():
    before = resident()
    block = torch.ones(64 << 20)  # 256 MB, every page touched
    del block
    return (resident() - before) >> 20

kept = {"main": kept_after_free()}
worker = threading.Thread(target=lambda: kept.update(thread=kept_after_free()))
worker.start()
worker.join()
print(kept["main"], kept["thread"])
"""


def kept_after_free(mode):
    done = subprocess.run(
        [sys.executable, "-c", KEPT_AFTER_FREE, mode, REPO],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    main_mib, thread_mib = map(int, done.stdout.split())
    return main_mib, thread_mib


@pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="keep_freed_memory is glibc-only"
)
def test_keep_freed_memory_keeps_batch_sized_blocks_in_every_thread():
    # glibc as it comes gives a 256 MB block back to the kernel on free, in
    # the main thread and in any other: the next batch maps it anew.
    assert kept_after_free("default") == (pytest.approx(0, abs=32),) * 2
    # With the setting both threads keep it for the next batch.
    main_mib, thread_mib = kept_after_free("tuned")
    assert main_mib >= 200 and thread_mib >= 200, (main_mib, thread_mib)


@pytest.fixture
def prefetcher_intervals():
    """torchdata's Prefetcher module as GraphBolt uses it; its polling
    intervals are restored after the test."""
    prefetcher = sys.modules["torchdata.datapipes.iter.util.prefetcher"]
    names = ("PRODUCER_SLEEP_INTERVAL", "CONSUMER_SLEEP_INTERVAL")
    saved = {name: getattr(prefetcher, name) for name in names}
    yield prefetcher
    for name, value in saved.items():
        setattr(prefetcher, name, value)


def test_poll_less_slows_the_prefetch_polling_to_1_ms(prefetcher_intervals):
    prefetcher = prefetcher_intervals
    # The reason for poll_less: the installed torchdata polls every 0.1 ms.
    assert prefetcher.PRODUCER_SLEEP_INTERVAL < 0.001
    assert prefetcher.CONSUMER_SLEEP_INTERVAL < 0.001
    nc.poll_less()
    assert prefetcher.PRODUCER_SLEEP_INTERVAL == 0.001
    assert prefetcher.CONSUMER_SLEEP_INTERVAL == 0.001
    # It never shortens a longer interval.
    prefetcher.PRODUCER_SLEEP_INTERVAL = 0.01
    nc.poll_less()
    assert prefetcher.PRODUCER_SLEEP_INTERVAL == 0.01


def _loader_threads(rank, dataset_dir):
    """Per mode: the stages of the DataLoader create_dataloader builds (the
    CUDA ones are built, not run), and the threads one CPU batch starts."""
    import threading

    import dgl.graphbolt as gb
    import torchdata.dataloader2.graph as dp_utils

    dataset = gb.OnDiskDataset(dataset_dir).load()

    args = nc.parse_args(["--batch-size", "64", "--fanout", "5,5,5"])

    def loader(storage, device):
        return nc.create_dataloader(
            dataset.graph, dataset.feature, dataset.tasks[0].train_set,
            torch.device(device), storage, True, args, None,
        ).dataloader

    stages = {}
    for storage, device in [
        ("cpu", "cpu"), ("cpu", "cuda"), ("pinned", "cuda"), ("cuda", "cuda")
    ]:
        graph = dp_utils.traverse_dps(loader(storage, device).dataset)
        stages[f"{storage}-{device}"] = {
            type(stage).__name__ for stage in dp_utils.list_dps(graph)
        }
    before = threading.active_count()
    next(iter(loader("cpu", "cpu")))
    return stages, threading.active_count() - before


def test_cpu_ranks_sample_without_a_prefetch_thread(small_dataset, tmp_path):
    [(stages, threads_started)] = run_gloo_group(
        _loader_threads, 1, tmp_path, small_dataset
    )
    prefetcher = "PrefetcherIterDataPipe"
    # CPU ranks: sampling and fetching run in the training thread, with the
    # rank's --threads; no extra thread competes for those cores.
    assert prefetcher not in stages["cpu-cpu"]
    assert threads_started == 0
    # With a GPU the loader's CPU work overlaps with training, as upstream.
    for mode in ("cpu-cuda", "pinned-cuda", "cuda-cuda"):
        assert prefetcher in stages[mode], mode
        assert "CopyTo" in stages[mode], mode


def test_benchmark_measures_bare_loop_and_script(small_dataset, tmp_path):
    out = tmp_path / "perf.json"
    done = subprocess.run(
        [sys.executable, os.path.join(SCRIPTS, "benchmark.py"),
         "--dataset", small_dataset, "--ranks", "1,2", "--threads", "1",
         "--batches", "3", "--batch-size", "64", "--fanout", "5,5,5",
         "--interval", "0.1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    runs = {run["name"]: run for run in json.loads(out.read_text())["runs"]}
    assert sorted(runs) == [
        "bare 1t", "bare 1t+tuned", "script 1r x 1t", "script 2r x 1t"
    ]
    for name, run in runs.items():
        assert run["exit_code"] == 0, name
        assert run["seeds_per_s"] > 0, name
        assert run["batches_per_rank"] == 3, name
        assert run["wait_per_batch"] + run["compute_per_batch"] == pytest.approx(
            run["s_per_batch"]
        ), name
        assert 0 < run["startup_s"] < 120, name
        assert run["rank_uss_peak_mib"] > 0, name
    # The script's runs have a launcher (mp.spawn) besides their ranks.
    assert runs["script 2r x 1t"]["launcher_uss_peak_mib"] > 0
    assert runs["bare 1t"]["launcher_uss_peak_mib"] is None
    # The ratios the README quotes are computed from the same figures.
    two = runs["script 2r x 1t"]
    assert two["vs_one_rank"] == pytest.approx(
        two["seeds_per_s"] / runs["script 1r x 1t"]["seeds_per_s"]
    )
    assert two["vs_bare"] == pytest.approx(
        two["seeds_per_s"] / runs["bare 1t"]["seeds_per_s"]
    )
    # The table is printed, one row per run.
    for name in runs:
        assert name in done.stdout


@pytest.mark.parametrize(
    "extra,message",
    [
        ([], "has no metadata.yaml"),
        (["--fanout", "5,5"], "--fanout '5,5' needs 3 values"),
        (["--ranks", "0"], "--ranks and --threads must be at least 1"),
    ],
)
def test_benchmark_refuses_bad_input(small_dataset, tmp_path, extra, message):
    dataset = str(tmp_path) if not extra else small_dataset
    done = subprocess.run(
        [sys.executable, os.path.join(SCRIPTS, "benchmark.py"),
         "--dataset", dataset, *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


# Prints a warm-up and a timed epoch line, 1 s apart, like the script does.
TWO_EPOCHS = """
import time
for epoch in range(2):
    time.sleep(1)
    print(f"Epoch {epoch:05d} | Time 1.0 | Train Time 1.0 | Seeds/s 10.0 | "
          "Data Wait 0.0", flush=True)
time.sleep(1)
"""


def test_benchmark_reads_memory_in_every_epoch_but_the_timed_one():
    # Reading PSS/USS costs the kernel ~0.1 s per look at a 2-rank job, time
    # the ranks would lose: only CPU times are read in the timed epoch.
    epochs, samples, _, code, _ = benchmark.measure(
        [sys.executable, "-c", TWO_EPOCHS], None, 0.05, 60, ("rank", None)
    )
    assert code == 0 and len(epochs) == 2
    warm, timed = epochs[0]["arrived"], epochs[1]["arrived"]
    # Samples taken well inside each phase (the reader thread adds latency).
    before = [s for s in samples if s["t"] < warm - 0.1]
    during = [s for s in samples if warm + 0.1 < s["t"] < timed - 0.1]
    after = [s for s in samples if s["t"] > timed + 0.1]
    assert before and during and after
    assert all(s["procs"] for s in before + after)
    assert all(s["procs"] is None for s in during)
    assert all(s["user"] >= 0 for s in during)
