"""A rank's settings for speed (docs/performance.md): malloc that keeps
batch-sized memory, what oneDNN keeps of bf16 products, less busy polling
in GraphBolt's prefetch thread, and the model's dropout and bf16 products
as CPU ranks run them. tune_rank does them all, in the order they need."""
import ctypes
import os
import platform
import sys

# oneDNN keeps the primitive of each matrix-product shape it has run (1024 by
# default), buffers included; bf16 products on the CPU go through it.
ONEDNN_CACHE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
# Its capacity where a model's products recur (gbrun.split_products): the
# example's model used 34 primitives in training and evaluation.
RECURRING_PRODUCTS = 64
_cache_is_ours = False  # keep_freed_memory set it, not the environment


def tune_rank(model, plan):
    """This rank, once its data is loaded, and its `model`, in place, as
    `plan` says: glibc's malloc keeps freed memory and oneDNN keeps no
    product of a past shape (keep_freed_memory), GraphBolt's prefetch
    thread polls less (poll_less), and on CPU ranks the model's nn.Dropout
    (and ReLU then dropout) runs in one pass and, in bf16, its nn.Linear's
    products in shapes that recur. The model's parameters, repr and
    state_dict stay the same. Returns `model`."""
    keep_freed_memory()
    poll_less()
    return tune_model(model, plan)


def tune_model(model, plan):
    """`model`, in place, as CPU ranks run it where `plan` says so
    (plan.fused_dropout, plan.split_products): its nn.Dropout (and ReLU then
    dropout) in one pass, and in bf16 its nn.Linear's products in shapes
    that recur. Returns `model`."""
    # Here, not at the top: the rest of this module loads without torch.
    from . import dropout, products

    if plan.fused_dropout:
        dropout.fuse_dropout(model)
    if plan.split_products:
        products.split_products(model)
    return model


def keep_freed_memory():
    """Make glibc's malloc keep freed memory for the next mini-batch, and
    oneDNN keep nothing for shapes that do not come back. Call it before the
    first bf16 step (oneDNN reads its setting then); a value of your own
    in the environment stays.

    Sampled blocks give every batch new product shapes, so oneDNN's cache
    never served a bf16 step again, but held each batch's primitives: a
    bf16 rank grew to 7.1 GB in two epochs at 200k nodes (2.4 GB without
    the cache), and faulting that memory in took 3x the system time.
    gbrun.split_products makes a model's products recur, and turns the
    cache back on (cache_recurring_products).

    By default glibc returns large blocks to the kernel as soon as they are
    freed, and a thread other than the main one gets blocks over 64 MB
    straight from the kernel. Each batch's feature and activation tensors
    (tens to hundreds of MB) are then mapped, zero-filled page by page and
    unmapped again: on CPU ranks the kernel took nearly as much CPU time as
    the training (docs/performance.md). The cost: a rank keeps its peak
    batch memory between batches. Other C libraries have no mallopt."""
    global _cache_is_ours
    if ONEDNN_CACHE not in os.environ:
        os.environ[ONEDNN_CACHE] = "0"
        _cache_is_ours = True
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


def cache_recurring_products():
    """Let oneDNN keep RECURRING_PRODUCTS primitives, where products recur:
    unless the environment set the capacity before keep_freed_memory.
    Like it, this acts only before the first bf16 product."""
    if _cache_is_ours:
        os.environ[ONEDNN_CACHE] = str(RECURRING_PRODUCTS)


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
