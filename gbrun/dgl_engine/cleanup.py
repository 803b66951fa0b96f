"""What a process of DGL's distributed engine leaves behind when it fails,
cleaned up: its sampler processes (they die with their trainer) and the
job's POSIX shared memory in /dev/shm (DGL unlinks it only in destructors
that a failing process skips); and a clean end without the interpreter's
last collections (skip_last_collection)."""
import gc
import multiprocessing.util
import os
import re
import shutil
import sys

import psutil

from ..launch import die_with_parent

def samplers_die_with_trainer():
    """Makes this trainer's DGL sampler processes, if it has any
    (DGL_NUM_SAMPLER > 0), die with it (gbrun.launch.die_with_parent, a
    task sent to them all) instead of waiting for its tasks for ever."""
    from dgl.distributed.dist_context import get_sampler_pool

    pool, _ = get_sampler_pool()
    if pool is not None:
        pool.submit_task_to_all_workers(die_with_parent, os.getpid())


def fail_fast(graph_name, flush=True):
    """A trainer's end on any error, once its traceback is printed: its
    machine's shared memory of the job (graph `graph_name`) unlinked, then
    exit status 1 at once. A clean exit would wait for ever in DGL's exit
    hook (a barrier with the other trainers) and in gloo's teardown; the
    other trainers fail at their next collective, and the servers and
    samplers leave once their trainers have gone (gbrun.dgl_engine.watch)."""
    if flush:  # (not from another thread: the main one may hold the lock)
        sys.stdout.flush()
        sys.stderr.flush()
    try:
        unlink_job_memory(graph_name)
        # The temporary files that exit handlers, skipped here, remove.
        shutil.rmtree(multiprocessing.util.get_temp_dir(), ignore_errors=True)
    finally:
        os._exit(1)


def skip_last_collection(graph_name=None):
    """For a clean end: the interpreter's last garbage collections, which
    would walk every object torch and DGL made (about 1 CPU-s a process),
    find nothing to collect (gc.freeze), as in a one-machine rank, which
    ends with os._exit. An object in a reference cycle is then never freed:
    a graph server's shared memory of the job (graph `graph_name`), which
    DGL unlinks only in destructors, is unlinked here by name first."""
    if graph_name is not None:
        unlink_job_memory(graph_name)
    gc.freeze()


# DGL's shared memory names that do not start with the graph's name (read in
# v2.1.0: kvstore.py's features and DistTensors, GraphBolt's shared graph).
DGL_SEGMENT = re.compile(r"-kvdata-$|^dgl\.graphbolt\.")


def partition_book_paths(graph_name):
    """The partition book's metadata, which each graph server writes to
    shared memory and its trainers read once at start-up, then no longer
    map (dgl v2.1.0, graph_partition_book.py, _move_metadata_to_shared_mem).
    A server that DGL itself aborts (its sender thread, replying to a
    sampler just killed: `send error: Broken pipe`) unlinks nothing, so the
    failing trainers unlink these by name too."""
    return [f"/dev/shm/{graph_name}_node_meta",
            f"/dev/shm/{graph_name}_node_node_map",
            f"/dev/shm/{graph_name}_edge_edge_map"]


def unlink_job_memory(graph_name):
    """Unlinks the POSIX shared memory (/dev/shm) of the job that this
    process maps or holds open: the partition's graph, its partition book,
    its features and DistTensors, named after `graph_name` or as DGL names
    them, and its partition book's metadata (partition_book_paths). DGL
    unlinks them only in destructors or in its own SIGTERM handler
    (dgl v2.1.0, src/runtime/shared_mem.cc and src/rpc/rpc.cc), which an
    os._exit or a killed process skips: each failed job would hold a
    partition's worth of memory until the machine reboots. Unlinking only
    removes the names; processes that map them go on until they exit.
    Returns the names unlinked."""
    try:
        me = psutil.Process()
        names = {m.path for m in me.memory_maps(grouped=True)}
        names |= {f.path for f in me.open_files()}
    except psutil.Error:
        return []
    names |= set(partition_book_paths(graph_name))
    unlinked = []
    for path in sorted(names):
        name = path[len("/dev/shm/"):]
        if not path.startswith("/dev/shm/") or path.endswith(" (deleted)"):
            continue
        if name.startswith(graph_name) or DGL_SEGMENT.search(name):
            try:
                os.unlink(path)
                unlinked.append(name)
            except OSError:
                continue  # another process of the job was first
    return unlinked
