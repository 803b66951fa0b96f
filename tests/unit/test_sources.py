"""CPU ranks read node features with torch.index_select (dgl 2.1.0's own CPU
read is advanced indexing, several times slower on large batches): the same
rows, so a seeded run is unchanged, and GraphBolt's read is not used."""
import pytest
import torch

import dgl.graphbolt as gb
import gbrun
import gbrun.batches
import gbrun.placement
import node_classification as nc
from helpers import cpu_plan, run_gloo_group


def _read_both_ways(rank, dataset_dir):
    """One seeded training epoch's batches, fetched through the dataset's
    own feature store and through the one CPU ranks train with; and how
    often each pass called GraphBolt's CPU index_select."""
    import dgl.graphbolt.impl.torch_based_feature_store as torch_store

    args = nc.parse_args(["--dataset", dataset_dir, "--batch-size", "64",
                          "--fanout", "5,5,5"])
    job = nc.load_job(args, cpu_plan(args, 1))
    _, placed = gbrun.placement.place_graph(job.dataset, "cpu", torch.device("cpu"),
                                    0, nc.FEATURE_KEYS)
    graphbolt_reads = [0]
    graphbolt_read = torch_store.index_select

    def counted(*args, **kwargs):
        graphbolt_reads[0] += 1
        return graphbolt_read(*args, **kwargs)

    torch_store.index_select = counted
    passes = {}
    for name, features in [("dataset", job.dataset.feature),
                           ("placed", placed)]:
        loader = nc.create_dataloader(
            job.dataset.graph, features, job.item_sets[0],
            torch.device("cpu"), "cpu", True, args, job.fanout)
        graphbolt_reads[0] = 0
        batches = gbrun.batches.Batches(loader, 0, "train", 3, epoch=0)
        passes[name] = (
            [(data.node_ids(), nc.node_features(data),
              data.labels) for data in batches],
            graphbolt_reads[0],
        )
    kinds = {type(placed._features[key]).__name__ for key in placed.keys()}
    return passes, kinds, placed.keys() == job.dataset.feature.keys()


@pytest.mark.slow
def test_cpu_ranks_fetch_the_same_rows_with_torch_index_select(
        small_dataset, tmp_path):
    [(passes, kinds, same_keys)] = run_gloo_group(
        _read_both_ways, 1, tmp_path, small_dataset)
    (stock, stock_reads), (placed, placed_reads) = (
        passes["dataset"], passes["placed"])
    assert len(stock) == len(placed) == 1800 // 64
    for (ids, x, y), (ids2, x2, y2) in zip(stock, placed):
        assert torch.equal(ids, ids2) and torch.equal(y, y2)
        assert torch.equal(x, x2) and x.dtype == x2.dtype
    # Every feature of the store is read the new way; GraphBolt's CPU read
    # ran once a batch for the dataset's store, never for the placed one.
    assert kinds == {"IndexSelectFeature"} and same_keys
    assert (stock_reads, placed_reads) == (len(stock), 0)


def test_index_select_feature_reads_as_graphbolt_does():
    table = torch.randn(50, 7).to(torch.bfloat16)
    ours = gbrun.placement.IndexSelectFeature(table, {"note": 1})
    theirs = gb.TorchBasedFeature(table)
    for dtype in (torch.int32, torch.int64):
        ids = torch.tensor([3, 3, 49, 0], dtype=dtype)
        assert torch.equal(ours.read(ids), theirs.read(ids))
    assert ours.read() is table and ours.size() == theirs.size()
    assert ours.metadata() == {"note": 1}
