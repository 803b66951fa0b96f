"""gbrun.dgl_engine.cleanup: what a failing process of DGL's engine unlinks
from /dev/shm, and a clean end that skips the last collections."""
import gc
import mmap
import os
import uuid
import weakref

from gbrun.dgl_engine.cleanup import skip_last_collection, unlink_job_memory


def shm(name, size=4096):
    path = f"/dev/shm/{name}"
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def test_a_failing_process_unlinks_what_it_maps_and_the_partition_book():
    graph = f"gbruntest{uuid.uuid4().hex[:8]}"
    mapped = shm(f"{graph}_node_feat")
    # The partition book's metadata, written by a graph server that DGL may
    # abort before it unlinks anything: nobody maps it any more.
    book = [shm(f"{graph}_node_meta"), shm(f"{graph}_node_node_map"),
            shm(f"{graph}_edge_edge_map")]
    other = shm(f"{graph}x_node_meta")  # another graph's, not mapped
    try:
        with open(mapped, "r+b") as f, mmap.mmap(f.fileno(), 0):
            unlinked = unlink_job_memory(graph)
        assert sorted(unlinked) == sorted(
            os.path.basename(p) for p in [mapped, *book])
        assert not any(os.path.exists(p) for p in [mapped, *book])
        assert os.path.exists(other)
        # Already gone (another process of the job was first): no error.
        assert unlink_job_memory(graph) == []
    finally:
        for path in [mapped, *book, other]:
            if os.path.exists(path):
                os.unlink(path)


class Cyclic:
    def __init__(self):
        self.me = self


def test_a_clean_end_freezes_every_object_a_servers_memory_unlinked_first():
    graph = f"gbruntest{uuid.uuid4().hex[:8]}"
    mapped = shm(f"{graph}_node_feat")
    cycle = Cyclic()
    alive = weakref.ref(cycle)
    try:
        with open(mapped, "r+b") as f, mmap.mmap(f.fileno(), 0):
            skip_last_collection()  # a trainer's: nothing unlinked
            assert os.path.exists(mapped)
            skip_last_collection(graph)  # a graph server's
            assert not os.path.exists(mapped)
        # The cycle is frozen: no collection frees it any more.
        del cycle
        gc.collect()
        assert alive() is not None
    finally:
        gc.unfreeze()
        if os.path.exists(mapped):
            os.unlink(mapped)
    gc.collect()
    assert alive() is None
