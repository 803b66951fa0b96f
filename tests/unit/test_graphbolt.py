"""The GraphBolt private attributes gbrun reads (gbrun/graphbolt.py), on the
installed DGL: if a release renames them, these fail, loudly, instead of a
run that silently shuffles unseeded or draws a wrong progress bar. The
counts on a real 4-rank DistributedItemSampler are checked in
unit/test_metrics.py. Also: a cpu-cuda rank's loader starts no CUDA work
in the loader's thread (CPU storage asks for no overlapped fetch)."""
import types

import numpy as np
import pytest
import torch

import gbrun.graphbolt
import node_classification as nc
from gbrun.batches import derived_seed
from gbrun.graphbolt import (
    batches_per_rank, exclude_seed_edges, gb, scored_pairs, seed_item_sampler,
)
from helpers import run_gloo_group


def order(sampler):
    return torch.cat([batch.seed_nodes if hasattr(batch, "seed_nodes")
                      and batch.seed_nodes is not None else batch.seeds
                      for batch in sampler]).tolist()


@pytest.mark.parametrize("drop_last", [False, True])
def test_batches_per_rank_counts_what_the_sampler_hands_out(drop_last):
    for items in (15, 16, 3):
        sampler = gb.ItemSampler(gb.ItemSet(torch.arange(items),
                                            names="seed_nodes"),
                                 batch_size=4, drop_last=drop_last)
        assert batches_per_rank(sampler) == len(list(sampler)), items


def test_a_seeded_epoch_shuffles_alike_and_another_epoch_not():
    def shuffled(epoch, rank=0):
        sampler = gb.ItemSampler(gb.ItemSet(torch.arange(50),
                                            names="seed_nodes"),
                                 batch_size=8, shuffle=True)
        seed_item_sampler(sampler, derived_seed(7, rank, epoch),
                          derived_seed(7, epoch))
        return order(sampler)

    assert shuffled(0) == shuffled(0) != shuffled(1)
    assert sorted(shuffled(1)) == list(range(50))


def test_a_release_without_the_attributes_is_refused_by_name():
    with pytest.raises(AttributeError, match="neither _rng .dgl 2.1-2.2. "
                       "nor _seed and _epoch"):
        seed_item_sampler(types.SimpleNamespace(), 1, 2)


def test_the_releases_shapes_are_told_apart():
    # dgl 2.3-2.4's shape: one permutation from _seed + _epoch, alike on
    # every rank (the rank is not part of the seed there).
    later = types.SimpleNamespace(_seed=1, _epoch=5)
    seed_item_sampler(later, derived_seed(7, 3, 2), derived_seed(7, 2))
    other_rank = types.SimpleNamespace(_seed=1, _epoch=5)
    seed_item_sampler(other_rank, derived_seed(7, 0, 2),
                      derived_seed(7, 2))
    assert later._epoch == 0 and later._seed == other_rank._seed
    assert 0 <= later._seed < 2**31 - 1
    earlier = types.SimpleNamespace(_rng=None)
    seed_item_sampler(earlier, derived_seed(7, 3, 2), derived_seed(7, 2))
    assert isinstance(earlier._rng, np.random.Generator)


def test_a_link_batch_reads_as_each_release_shapes_it():
    # dgl 2.1: node_pairs_with_labels of a batch of node pairs (this
    # install's own MiniBatch), compacted_seeds None.
    pairs = torch.tensor([[0, 1], [2, 3]])
    negatives = torch.tensor([[3], [0]])
    batch = gb.MiniBatch(node_pairs=(pairs[:, 0], pairs[:, 1]),
                         negative_dsts=negatives,
                         compacted_node_pairs=(pairs[:, 0], pairs[:, 1]),
                         compacted_negative_dsts=negatives)
    sources, destinations, labels = scored_pairs(batch)
    assert sources.tolist() == [0, 2, 0, 2]
    assert destinations.tolist() == [1, 3, 3, 0]
    assert labels.tolist() == [1.0, 1.0, 0.0, 0.0]
    # dgl 2.2-2.4: the positives then the negatives as (pairs, 2) seeds,
    # labels 1 and 0 (uniform_negative_sampler.py at v2.2.1 and v2.4.0).
    later = types.SimpleNamespace(
        compacted_seeds=torch.tensor([[0, 1], [2, 3], [0, 3], [2, 0]]),
        labels=torch.tensor([1.0, 1.0, 0.0, 0.0]))
    assert [t.tolist() for t in scored_pairs(later)] == [
        sources.tolist(), destinations.tolist(), labels.tolist()]


def sampled_link_batches(count):
    """`count` training batches of link_prediction.py's pipeline up to its
    exclusion: 64 pairs of a random 300-node graph that holds every edge's
    reverse (so that both directions are sampled), a negative each,
    fanout 10,10,10."""
    generator = torch.Generator().manual_seed(0)
    src = torch.randint(0, 300, (900,), generator=generator)
    dst = torch.randint(0, 300, (900,), generator=generator)
    src, dst = torch.cat([src, dst]), torch.cat([dst, src])
    order = torch.argsort(dst * 300 + src)
    indptr = torch.searchsorted(dst[order], torch.arange(301))
    # int32 ids, as OnDiskDataset stores a graph of this size.
    graph = gb.fused_csc_sampling_graph(indptr.int(), src[order].int())
    pairs = gb.ItemSet(torch.stack([src[:300], dst[:300]], 1).int(),
                       names="node_pairs")
    datapipe = gb.ItemSampler(pairs, batch_size=64, shuffle=True)
    datapipe = datapipe.sample_uniform_negative(graph, 1)
    datapipe = datapipe.sample_neighbor(graph, [10, 10, 10])
    torch.manual_seed(0)
    return [batch for batch, _ in zip(datapipe, range(count))]


@pytest.mark.parametrize("reverses", [True, False])
def test_exclude_seed_edges_gives_graphbolts_subgraphs(reverses):
    # The same subgraphs as gb.exclude_seed_edges(include_reverse_edges=
    # reverses: False for a directed task), tensor for tensor and dtype for
    # dtype, on batches where both directions of the pairs were sampled
    # (and so are dropped).
    import copy

    dropped = 0
    for batch in sampled_link_batches(3):
        if getattr(batch, "node_pairs", None) is None:
            pytest.skip("dgl 2.2+: GraphBolt's own runs (seeds, not "
                        "node_pairs)")
        theirs = gb.exclude_seed_edges(copy.copy(batch),
                                       include_reverse_edges=reverses)
        ours = exclude_seed_edges(copy.copy(batch), include_reverse_edges=reverses)
        for before, mine, expected in zip(batch.sampled_subgraphs,
                                          ours.sampled_subgraphs,
                                          theirs.sampled_subgraphs):
            assert type(mine) is type(expected)
            for name in ("indptr", "indices"):
                got = getattr(mine.sampled_csc, name)
                want = getattr(expected.sampled_csc, name)
                assert got.dtype == want.dtype and torch.equal(got, want)
            assert mine.original_row_node_ids is before.original_row_node_ids
            assert (mine.original_column_node_ids
                    is before.original_column_node_ids)
            assert mine.original_edge_ids is expected.original_edge_ids
            dropped += (before.sampled_csc.indices.numel()
                        - mine.sampled_csc.indices.numel())
    assert dropped > 100  # pairs and reverses were there to drop


def _loader_cuda_calls(rank, dataset_dir):
    """CUDA calls made while building each GPU mode's loader, torch
    claiming a GPU (the CUDA entry points are recorders)."""
    import threading

    import dgl.graphbolt as gb

    calls = []

    def recorder(name):
        def record(*args, **kwargs):
            calls.append((name, threading.current_thread().name))
            raise RuntimeError(f"torch.cuda.{name} called")
        return record

    torch.cuda.is_available = lambda: True
    for name in ("Stream", "current_stream", "Event", "set_device",
                 "stream"):
        setattr(torch.cuda, name, recorder(name))
    dataset = gb.OnDiskDataset(dataset_dir).load()
    args = nc.parse_args(["--batch-size", "64", "--fanout", "5,5,5"])
    options = {}
    for storage in ("cpu", "pinned", "cuda"):
        device = torch.device("cuda:1")
        options[storage] = gbrun.graphbolt.graphbolt_options(device, storage)
    nc.create_dataloader(dataset.graph, dataset.feature,
                         dataset.tasks[0].train_set, torch.device("cuda:1"),
                         "cpu", True, args, [5, 5, 5])
    return calls, options


@pytest.mark.slow
def test_cpu_cuda_ranks_start_no_cuda_work_in_the_loader(
        small_dataset, tmp_path):
    # dgl 2.1.0 overlaps the feature fetch on a CUDA stream in the loader's
    # prefetch thread, whose device is never set: GPU 0 in every rank. With
    # CPU storage nothing is gained, so cpu-cuda ranks do not ask for it.
    [(calls, options)] = run_gloo_group(
        _loader_cuda_calls, 1, tmp_path, small_dataset)
    assert calls == []
    overlap = {storage: options[storage]["DataLoader"]["overlap_feature_fetch"]
               for storage in options}
    assert overlap == {"cpu": False, "pinned": True, "cuda": True}
