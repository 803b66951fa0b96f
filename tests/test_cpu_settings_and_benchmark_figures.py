"""The example's CPU settings (keep_freed_memory, poll_less) do what their
docstrings say (batch-sized blocks kept in every thread, no bf16 product
of a past shape kept by oneDNN), and benchmarks/benchmark.py measures what
the README quotes. No timing is asserted here: the figures live in the README and
docs/performance.md, produced by benchmarks/benchmark.py."""
import json
import os
import platform
import subprocess
import sys

import pytest
import torch

from helpers import BENCHMARKS, REPO, run_gloo_group

import benchmark
import gbrun.cpu.info
import gbrun.cpu.memory
import node_classification as nc

# What each fresh interpreter below starts with: gbrun/cpu/memory.py loaded
# from its path (without gbrun's imports), applied if argv[2] is "tuned".
TUNED_INTERPRETER = """
import importlib.util, sys

spec = importlib.util.spec_from_file_location("memory", sys.argv[1])
memory = importlib.util.module_from_spec(spec)
spec.loader.exec_module(memory)
if sys.argv[2] == "tuned":
    memory.keep_freed_memory()
"""


def run_tuned(script, mode, *args, env=None):
    """What `script` prints, run after TUNED_INTERPRETER in a fresh
    interpreter (`mode`: "tuned" or "default"; `env`: variables to set, or
    to unset with None)."""
    env = {k: v for k, v in {**os.environ, **(env or {})}.items()
           if v is not None}
    done = subprocess.run(
        [sys.executable, "-c", TUNED_INTERPRETER + script,
         gbrun.cpu.memory.__file__, mode, *args],
        capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout


# Allocate and free 256 MB in the main thread or in another thread (as
# GraphBolt's prefetch thread does), and print how many MiB of free memory
# glibc's heaps hold afterwards (mallinfo2's fordblks: what malloc keeps
# for the next block, not what the kernel happens to have resident). One
# thread per process: in one process the second thread could reuse the
# block the first one kept, which looks like nothing kept. The block comes
# from glibc's posix_memalign, as torch's CPU tensors do; without torch and
# DGL to import, a process takes 0.05 s instead of 2 s.
KEPT_AFTER_FREE = """
import ctypes, threading

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
        "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p),
                                ctypes.c_size_t, ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def kept_after_free():
    before = libc.mallinfo2().fordblks
    block, size = ctypes.c_void_p(), 256 << 20
    assert libc.posix_memalign(ctypes.byref(block), 64, size) == 0
    libc.free(block)
    return (libc.mallinfo2().fordblks - before) >> 20

kept = []
if sys.argv[3] == "main":
    kept.append(kept_after_free())
else:
    worker = threading.Thread(target=lambda: kept.append(kept_after_free()))
    worker.start()
    worker.join()
print(kept[0])
"""


def kept_after_free(mode):
    """MiB kept after free: (in the main thread, in another thread)."""
    return tuple(int(run_tuned(KEPT_AFTER_FREE, mode, thread))
                 for thread in ("main", "thread"))


@pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="keep_freed_memory is glibc-only"
)
def test_keep_freed_memory_keeps_batch_sized_blocks_in_every_thread():
    # glibc as it comes gives a 256 MB block back to the kernel on free, in
    # the main thread and in any other: the next batch maps it anew.
    assert kept_after_free("default") == (0, 0)
    # With the setting both threads keep it for the next batch (the whole
    # block, but for the last MiB that glibc's top chunk rounds away).
    main_mib, thread_mib = kept_after_free("tuned")
    assert main_mib >= 255 and thread_mib >= 255, (main_mib, thread_mib)


# bf16 products under autocast of the row counts in argv[3] (as sampled
# batches give them), with oneDNN telling each primitive it creates
# (ONEDNN_VERBOSE=2: "create:cache_miss" when it builds one, "cache_hit"
# when its cache held it). argv[4] "split": the model's products split
# (gbrun.cpu.products), as CPU ranks in bf16 run them. Either way gbrun
# then sets oneDNN's cache as tune_model does.
PRODUCTS_OF_SHAPES = """
import os
import torch
import gbrun.cpu.products

model = torch.nn.Sequential(torch.nn.Linear(64, 128))
split = sys.argv[4] == "split" and gbrun.cpu.products.split_products(model) > 0
memory.keep_onednn_primitives(recurring=split)
print("capacity", os.environ[memory.ONEDNN_CACHE])
for rows in map(int, sys.argv[3].split(",")):
    with torch.autocast("cpu", torch.bfloat16):
        y = model(torch.randn(rows, 64))
    y.float().sum().backward()
"""


def onednn_creations(rows, split, env):
    """(what oneDNN's cache holds, primitives built, primitives found in
    its cache) over steps of `rows` rows each."""
    out = run_tuned(PRODUCTS_OF_SHAPES, "default",
                    ",".join(map(str, rows)), "split" if split else "whole",
                    env={"ONEDNN_VERBOSE": "2", **env})
    capacity = out.split("capacity ", 1)[1].split()[0]
    return (capacity, out.count("create:cache_miss"),
            out.count("create:cache_hit"))


@pytest.mark.skipif(not gbrun.cpu.info.has_bf16(),
                    reason="no bf16 arithmetic: the example runs no bf16 "
                    "products here")
@pytest.mark.slow
def test_bf16_products_of_past_shapes_are_not_kept_unless_they_recur():
    # What oneDNN does with its cache is read from oneDNN itself (its
    # verbose lines), not from memory figures: a process's resident memory
    # depends on the allocator and on what ran before.
    unset = {gbrun.cpu.memory.ONEDNN_CACHE: None}
    same_shape, new_shapes = [2000] * 4, [20100 + 7 * i for i in range(40)]
    # Products that do not recur: oneDNN keeps none, so a shape seen
    # before is built again.
    capacity, built, found = onednn_creations(same_shape, False, unset)
    assert (capacity, found) == ("0", 0) and built > 0
    # ... unless the environment asks for a cache of its own, which stays.
    capacity, built, found = onednn_creations(
        same_shape, False, {gbrun.cpu.memory.ONEDNN_CACHE: "1024"})
    assert capacity == "1024" and found > 0
    # Each new row count is a new product: nothing in a cache serves it.
    capacity, built, found = onednn_creations(
        new_shapes, False, {gbrun.cpu.memory.ONEDNN_CACHE: "1024"})
    assert built >= len(new_shapes)
    # Split, the products recur: oneDNN keeps up to 64 primitives, builds
    # a few and finds the rest in its cache, whatever the row count.
    capacity, built, found = onednn_creations(new_shapes, True, unset)
    assert capacity == str(gbrun.cpu.memory.RECURRING_PRODUCTS)
    assert built <= 16 and found >= len(new_shapes), (built, found)


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
    gbrun.cpu.memory.poll_less()
    assert prefetcher.PRODUCER_SLEEP_INTERVAL == 0.001
    assert prefetcher.CONSUMER_SLEEP_INTERVAL == 0.001
    # It never shortens a longer interval.
    prefetcher.PRODUCER_SLEEP_INTERVAL = 0.01
    gbrun.cpu.memory.poll_less()
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
            torch.device(device), storage, True, args, [5, 5, 5],
        )

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


@pytest.mark.slow
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
        # These two import the example's model (torch, DGL): seconds each.
        pytest.param(["--fanout", "5,5"], "--fanout '5,5' needs 3 values",
                     marks=pytest.mark.slow),
        pytest.param(["--stages", "5,5"], "--fanout '5,5' needs 3 values",
                     marks=pytest.mark.slow),
        (["--no-runs"], "--no-runs needs --stages"),
        (["--ranks", "0"], "--ranks: 0 is too small (at least 1)"),
        (["--env", "X"], "--env: 'X': expected NAME=VALUE"),
    ],
)
def test_benchmark_refuses_bad_input(small_dataset, tmp_path, extra, message):
    dataset = str(tmp_path) if not extra else small_dataset
    done = subprocess.run(
        [sys.executable, os.path.join(BENCHMARKS, "benchmark.py"),
         "--dataset", dataset, *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


# Writes a warm-up and a timed epoch record to metrics.jsonl (argv[1]) as
# the example does: 1 s asleep before each, busy on the CPU for the timed
# one, asleep 1 s after both.
TWO_EPOCHS = """
import json, sys, time
for epoch in range(2):
    start = time.time()
    while time.time() - start < 1:
        if epoch == 0:
            time.sleep(0.01)
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
    # CPU times are still read while memory is not: the busy epoch shows.
    assert skipped[-1]["user"] - skipped[0]["user"] > 0.2, skipped


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
