"""gbrun.cpu.memory: the example's CPU settings (keep_freed_memory,
keep_onednn_primitives, poll_less) do what their docstrings say
(batch-sized blocks kept in every thread, no bf16 product of a past shape
kept by oneDNN), and CPU ranks sample without a prefetch thread."""
import os
import platform
import subprocess
import sys

import pytest
import torch

from helpers import run_gloo_group

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
    for name in names:  # as torchdata sets them, whatever ran before
        setattr(prefetcher, name, 0.0001)
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
