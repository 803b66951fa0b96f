"""Settings of a rank's process for memory and speed (docs/performance.md):
glibc's malloc keeps batch-sized memory (keep_freed_memory), oneDNN keeps
the primitives of bf16 products only where their shapes recur
(keep_onednn_primitives), and GraphBolt's prefetch thread polls less
(poll_less). Each changes the whole process, for the rest of its life:
they are for a rank, once (gbrun.cpu.tune_rank), before its first step."""
import ctypes
import os
import platform
import sys

# oneDNN keeps the primitive of each matrix-product shape it has run (1024 by
# default), buffers included; bf16 products on the CPU go through it. It
# reads this variable once, when it first needs the capacity.
ONEDNN_CACHE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
# Its capacity where a model's products recur (gbrun.cpu.products): the
# example's model used 34 primitives in training and evaluation.
RECURRING_PRODUCTS = 64


def keep_freed_memory():
    """Make glibc's malloc keep freed memory for the next mini-batch.

    By default glibc returns large blocks to the kernel as soon as they are
    freed, and a thread other than the main one gets blocks over 64 MB
    straight from the kernel. Each batch's feature and activation tensors
    (tens to hundreds of MB) are then mapped, zero-filled page by page and
    unmapped again: on CPU ranks the kernel took nearly as much CPU time as
    the training (docs/performance.md). The cost: a rank keeps its peak
    batch memory between batches. Other C libraries have no mallopt."""
    if platform.libc_ver()[0] != "glibc":
        return
    mallopt = ctypes.CDLL(None).mallopt
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
    # Blocks under 1 GB come from the heap; older glibc caps this at 32 MB.
    if not mallopt(M_MMAP_THRESHOLD, 1 << 30):
        mallopt(M_MMAP_THRESHOLD, 32 << 20)
    # Free memory at the top of the heap goes back only beyond 1 GB.
    mallopt(M_TRIM_THRESHOLD, 1 << 30)
    # One heap for all threads, so a data loader's prefetch thread (with a
    # GPU it samples and fetches features) reuses memory like the main one.
    mallopt(M_ARENA_MAX, 1)


def keep_onednn_primitives(recurring):
    """Let oneDNN keep RECURRING_PRODUCTS primitives where the model's bf16
    products recur (`recurring`: gbrun.cpu.products split them), and none
    otherwise; a capacity of your own in the environment stays. oneDNN
    reads it once, at its first primitive: call this before the first bf16
    step (the first call in a process decides).

    Sampled blocks give every batch new product shapes, so oneDNN's cache
    never served a bf16 step again, but held each batch's primitives: a
    bf16 rank grew to 7.1 GB in two epochs at 200k nodes (2.4 GB without
    the cache), and faulting that memory in took 3x the system time."""
    os.environ.setdefault(
        ONEDNN_CACHE, str(RECURRING_PRODUCTS if recurring else 0))


def poll_less(interval=0.001):
    """Make the data loader's prefetch thread poll every 1 ms, not 0.1 ms.

    With a GPU, GraphBolt's DataLoader runs the pipeline before copy_to in
    a torchdata Prefetcher thread, which wakes every 0.1 ms while its buffer
    is full (and the training loop likewise while it is empty), taking CPU
    time and the GIL from the other thread. Measured with CPU sampling in
    that thread: 3.7 s of CPU for 2.6 s of sampling, 2.7-3.0 s at 1 ms.
    1 ms still allows 2,000 batches a second. Nothing to do where GraphBolt
    does not use torchdata's Prefetcher."""
    prefetcher = sys.modules.get("torchdata.datapipes.iter.util.prefetcher")
    for name in ("PRODUCER_SLEEP_INTERVAL", "CONSUMER_SLEEP_INTERVAL"):
        if hasattr(prefetcher, name):
            setattr(prefetcher, name, max(getattr(prefetcher, name), interval))
