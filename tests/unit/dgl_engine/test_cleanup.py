"""gbrun.dgl_engine.cleanup: what a failing process of DGL's engine unlinks
from /dev/shm."""
import mmap
import os
import uuid

from gbrun.dgl_engine.cleanup import unlink_job_memory


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
