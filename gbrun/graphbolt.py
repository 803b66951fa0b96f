"""dgl.graphbolt, imported once (`gb`). Where it cannot be imported, importing
this module ends the process with one line and exit status 2 (gbrun.cli's
refusal; every entry point imports it first for that): dgl 2.4+ refuses to
import GraphBolt's CPU build next to a CUDA torch, and dgl 2.1-2.3 have no
GraphBolt library for a torch they were not built for.

Also the options that differ between GraphBolt releases, told apart by
signature (never by version strings), and the one place that reads
GraphBolt's private attributes: an item sampler's shuffling state, its
items and its batch count, which no public API gives (see
seed_item_sampler, share_one_permutation and batches_per_rank, with the
releases read). tests/unit/test_graphbolt.py fails loudly when a release
lacks them.
"""
import dataclasses
import inspect

from .cli import fail

# PyPI's torch 2.2.1 is a CUDA 12.1 build, PyPI's dgl a CPU-only one. DGL's
# CUDA build of the same release comes from DGL's own wheel index.
INSTALL_CUDA_DGL = (
    "pip install dgl==2.1.0+cu121 "
    "-f https://data.dgl.ai/wheels/torch-2.2/cu121/repo.html"
)

def cannot_load(error):
    """One line saying why dgl.graphbolt cannot load, and what to do."""
    if isinstance(error, ModuleNotFoundError) and error.name in ("dgl", "torch"):
        return (f"{error.name} is not installed "
                "(pip install -r requirements.txt)")
    if isinstance(error, FileNotFoundError):
        # dgl 2.1-2.3 ship one GraphBolt library per torch release.
        import torch

        return (f"{error} (this DGL has no GraphBolt library for torch "
                f"{torch.__version__}: pip install -r requirements.txt "
                "installs the versions that match)")
    return (f"{error} (for GPUs: {INSTALL_CUDA_DGL}; for CPU ranks: "
            "CUDA_VISIBLE_DEVICES= python ...)")


def import_graphbolt():
    """dgl.graphbolt, or the process's end in one line (exit status 2)."""
    try:
        import dgl.graphbolt
    except (ImportError, FileNotFoundError) as error:
        fail(cannot_load(error))
    return dgl.graphbolt


gb = import_graphbolt()

import numpy as np  # noqa: E402 (once GraphBolt, and so torch, loaded)
import torch  # noqa: E402


def seed_item_sampler(item_sampler, own_seed, shared_seed):
    """Makes one epoch's shuffling of `item_sampler` follow the run's seed,
    where GraphBolt takes none per epoch (gbrun.batches.Batches gives this
    rank's seed of the epoch and the one every rank shares):
    - dgl 2.1-2.2 (read in item_sampler.py at v2.1.0 and v2.2.1): each rank
      shuffles its own share with the sampler's `_rng`, an unseeded
      np.random.Generator: replaced by one seeded from `own_seed`;
    - dgl 2.3-2.4 (v2.3.0, v2.4.0): one permutation of all items from
      torch.Generator().manual_seed(_seed + _epoch), which every rank must
      draw alike: `_seed` from `shared_seed`, `_epoch` 0.
    Raises where a release has neither (it must be read again)."""
    if hasattr(item_sampler, "_rng"):
        item_sampler._rng = np.random.default_rng(own_seed)
    elif hasattr(item_sampler, "_seed") and hasattr(item_sampler, "_epoch"):
        item_sampler._seed = shared_seed % (2**31 - 1)
        item_sampler._epoch = 0
    else:
        raise AttributeError(
            "this GraphBolt's ItemSampler has neither _rng (dgl 2.1-2.2) nor "
            "_seed and _epoch (dgl 2.3-2.4): update gbrun/graphbolt.py's "
            "seed_item_sampler for it"
        )


class PermutedItems:
    """An item set seen through one permutation (`order`, positions in it):
    what dgl 2.1-2.2's ItemShufflerAndBatcher slices (len, and [a:b] giving
    a tensor, a tuple of them, or for an ItemSetDict {type: those}, as the
    item set's own slices do). The items are read once, by the public
    slice of all of them."""

    def __init__(self, item_set):
        self.items = item_set[0:len(item_set)]
        self.order = torch.arange(len(item_set))
        if isinstance(self.items, dict):
            sizes = [len(items if torch.is_tensor(items) else items[0])
                     for items in self.items.values()]
            self.offsets = torch.tensor([0, *sizes]).cumsum(0)

    def __len__(self):
        return len(self.order)

    def __getitem__(self, positions):
        positions = self.order[positions]
        if not isinstance(self.items, dict):
            return _take(self.items, positions)
        # Grouped by type, in the item set's order of types: the batcher's
        # offsets over the slice are those of its dict's values.
        kinds = torch.searchsorted(self.offsets, positions, right=True) - 1
        return {key: _take(items, positions[kinds == j] - self.offsets[j])
                for j, (key, items) in enumerate(self.items.items())
                if (kinds == j).any()}


def _take(items, positions):
    if torch.is_tensor(items):
        return items[positions]
    return tuple(item[positions] for item in items)


def share_one_permutation(item_sampler, seed):
    """Makes a shuffling DistributedItemSampler's ranks share out one
    permutation of all the items in this pass, drawn alike on every rank
    from `seed` (an int), as one process shuffles all of them:
    - dgl 2.1-2.2 (item_sampler.py at v2.1.0 and v2.2.1) give each rank the
      same contiguous slice of the items every epoch and shuffle only
      inside it, so a train set stored in id (or class) order gives each
      rank a fixed part of it: 2 ranks trained worse than 1 on such a
      graph. Here the slices are cut from a permutation (`_item_set` seen
      through PermutedItems), the same on every rank.
    - dgl 2.3-2.4 (v2.3.0, v2.4.0) already permute all items every epoch
      before slicing (dmlc/dgl#7408), with a seed rank 0 broadcasts:
      nothing to do.
    A sampler that does not shuffle, has one rank (whose share is all the
    items, shuffled), or cannot be indexed is left alone."""
    if not (hasattr(item_sampler, "_rng") and item_sampler._shuffle
            and item_sampler._distributed and item_sampler._world_size > 1
            and item_sampler._use_indexing):
        return
    items = item_sampler._item_set
    if not isinstance(items, PermutedItems):
        items = item_sampler._item_set = PermutedItems(items)
    items.order = torch.randperm(
        len(items), generator=torch.Generator().manual_seed(seed))


def batches_per_rank(item_sampler):
    """How many batches this rank's `item_sampler` hands out in a pass (the
    progress bar's total), as GraphBolt's own calculate_range shares the
    items out: its arguments are the sampler's _item_set, _world_size,
    _rank, _batch_size, _drop_last and _drop_uneven_inputs (the same names
    and module at dgl 2.1.0 and 2.4.0)."""
    from dgl.graphbolt.internal.item_sampler_utils import calculate_range

    size = item_sampler._batch_size
    _, _, count = calculate_range(
        item_sampler._world_size is not None, len(item_sampler._item_set),
        item_sampler._world_size or 1, item_sampler._rank or 0, 1, 0, size,
        item_sampler._drop_last, item_sampler._drop_uneven_inputs)
    return -(-count // size)


def scored_pairs(data, relation=None):
    """A link-prediction batch's scored pairs and their labels, in the
    batch's compacted node ids (rows of the model's outputs): (sources,
    destinations, labels: 1.0 for a positive pair, 0.0 for a negative).
    dgl 2.1 (minibatch.py at v2.1.0) names them node_pairs_with_labels;
    2.2-2.4 (v2.2.1, v2.4.0) give compacted_seeds, (pairs, 2), with labels
    (public MiniBatch attributes; on 2.1 compacted_seeds is None for items
    named node_pairs). On a graph of several node types each is {edge
    type: ...}: `relation`'s pairs, ids within its ends' types."""
    compacted = getattr(data, "compacted_seeds", None)
    if compacted is None:
        pairs, labels = data.node_pairs_with_labels
    else:
        pairs, labels = compacted, data.labels
    if relation is not None:
        pairs, labels = pairs[relation], labels[relation]
    sources, destinations = pairs if compacted is None else pairs.T
    return sources, destinations, labels.float()


def exclude_seed_edges(minibatch, include_reverse_edges=True):
    """gb.exclude_seed_edges(minibatch, include_reverse_edges): the batch's
    positive pairs (and their reverses) taken out of its sampled
    subgraphs; the same subgraphs, faster. GraphBolt 2.1
    (sampled_subgraph.py at v2.1.0) looks every sampled edge up among the
    pairs (sorted, then a binary search per edge). Only an edge into an
    endpoint of a pair can be one, and a layer's columns hold few of them:
    here only their edges are looked up (a few percent of all). Other
    batches (a heterogeneous graph's; dgl 2.2+'s, whose pairs are `seeds`)
    go to GraphBolt's own."""
    pairs = getattr(minibatch, "node_pairs", None)
    subgraphs = minibatch.sampled_subgraphs
    if not (isinstance(pairs, tuple)
            and all(_plain_homogeneous(s) for s in subgraphs)):
        return gb.exclude_seed_edges(minibatch,
                                     include_reverse_edges=include_reverse_edges)
    u, v = (ends.long() for ends in pairs)
    # An edge (src, dst) as one int64, as GraphBolt keys it (ids < 2**31);
    # sorted, for a binary search.
    excluded = torch.cat([u << 32 | v, *([v << 32 | u] if include_reverse_edges
                                         else [])]).unique()
    endpoints = torch.cat([u, v]).unique()
    minibatch.sampled_subgraphs = [
        _without_edges(subgraph, excluded, endpoints) for subgraph in subgraphs
    ]
    return minibatch


SUBGRAPH_FIELDS = ("sampled_csc", "original_column_node_ids",
                   "original_row_node_ids", "original_edge_ids")


def _plain_homogeneous(subgraph):
    """A homogeneous SampledSubgraphImpl with exactly the four fields that
    GraphBolt's exclude_edges slices or keeps (dgl 2.1-2.3)."""
    return (dataclasses.is_dataclass(subgraph)
            and tuple(f.name for f in dataclasses.fields(subgraph))
            == SUBGRAPH_FIELDS
            and isinstance(subgraph.sampled_csc, gb.CSCFormatBase))


def _without_edges(subgraph, excluded, endpoints):
    """`subgraph` without its edges whose (src, dst) key is in `excluded`,
    as GraphBolt's exclude_edges slices it (an int64 indptr)."""
    csc = subgraph.sampled_csc
    indptr = csc.indptr.long()
    columns = subgraph.original_column_node_ids
    if columns is None:
        columns = torch.arange(indptr.numel() - 1)
    # The edges into columns that are endpoints: each such column's range.
    is_end = torch.zeros(int(max(columns.max(), endpoints[-1])) + 1,
                         dtype=torch.bool)
    is_end[endpoints] = True
    ends = is_end[columns].nonzero().squeeze(1)
    starts = indptr[ends]
    counts = indptr[ends + 1] - starts
    first = counts.cumsum(0) - counts  # each range's place in `edges`
    edges = (torch.arange(int(counts.sum()))
             + torch.repeat_interleave(starts - first, counts))
    sources = csc.indices[edges]
    if subgraph.original_row_node_ids is not None:
        sources = subgraph.original_row_node_ids[sources]
    keys = (sources.long() << 32
            | torch.repeat_interleave(columns[ends].long(), counts))
    found = torch.searchsorted(excluded, keys).clamp_(max=len(excluded) - 1)
    hits = excluded[found] == keys
    keep = torch.ones(csc.indices.numel(), dtype=torch.bool)
    keep[edges[hits]] = False
    # Each column's start, less the edges dropped before it.
    dropped = torch.zeros(indptr.numel(), dtype=torch.int64)
    dropped[1:].index_add_(0, torch.repeat_interleave(ends, counts)[hits],
                           torch.ones(int(hits.sum()), dtype=torch.int64))
    edge_ids = subgraph.original_edge_ids
    return dataclasses.replace(
        subgraph,
        sampled_csc=gb.CSCFormatBase(indptr=indptr - dropped.cumsum(0),
                                     indices=csc.indices[keep]),
        original_edge_ids=None if edge_ids is None else edge_ids[keep],
    )


def _accepts(callable_, name):
    """True if `callable_` takes a parameter `name`: how GraphBolt releases
    are told apart here (never by parsing version strings)."""
    return name in inspect.signature(callable_).parameters


def graphbolt_options(device, storage):
    """Keyword arguments for each pipeline stage on this GraphBolt release.
    - copy_to: dgl 2.1.0 copies seed_nodes only when asked to; newer
      releases copy everything and have no `extra_attrs`.
    - sample_neighbor: dgl 2.4 overlaps graph fetching (pinned graphs) and
      samples asynchronously on the GPU; older releases have no such knobs.
    - fetch_feature / DataLoader: GraphBolt overlaps feature fetching on a
      CUDA stream whenever torch has CUDA, even for a CPU rank (where a
      CPU-only DGL then crashes). Only ranks whose features the GPU reads
      (pinned or GPU storage) ask for it: with CPU storage (cpu-cuda) the
      fetch runs in the loader's prefetch thread, whose CUDA device was
      never set, so its stream and events would open a context on GPU 0 in
      every rank (dgl 2.1.0, dataloader.py), and the overlap hides nothing
      there. dgl 2.4 has the knob on fetch_feature, 2.1-2.3 on the
      DataLoader."""
    overlap = device.type == "cuda" and storage != "cpu"
    options = {
        "copy_to": {}, "sample_neighbor": {}, "fetch_feature": {},
        "DataLoader": {},
    }
    if _accepts(gb.CopyTo.__init__, "extra_attrs"):
        options["copy_to"]["extra_attrs"] = ["seed_nodes"]
    if _accepts(gb.NeighborSampler.__init__, "overlap_fetch"):
        options["sample_neighbor"]["overlap_fetch"] = storage == "pinned"
    if _accepts(gb.NeighborSampler.__init__, "asynchronous"):
        options["sample_neighbor"]["asynchronous"] = storage != "cpu"
    if _accepts(gb.FeatureFetcher.__init__, "overlap_fetch"):
        options["fetch_feature"]["overlap_fetch"] = overlap
    if _accepts(gb.DataLoader.__init__, "overlap_feature_fetch"):
        options["DataLoader"]["overlap_feature_fetch"] = overlap
    return options


def make_gpu_cache(feature, cache_bytes):
    """A GPU cache of `cache_bytes` bytes in front of `feature`, for each
    GraphBolt API shape, told apart by signature: dgl 2.4+ has a function
    taking bytes; 2.2.1-2.3 a class taking bytes; 2.1-2.2.0 the same class
    taking rows (there `gb.gpu_cached_feature` is the module holding it)."""
    if inspect.isfunction(getattr(gb, "gpu_cached_feature", None)):
        return gb.gpu_cached_feature(feature, cache_bytes)
    if _accepts(gb.GPUCachedFeature.__init__, "max_cache_size_in_bytes"):
        return gb.GPUCachedFeature(feature, cache_bytes)
    row = feature.read(torch.tensor([0]))
    row_bytes = row.element_size() * row.numel()
    return gb.GPUCachedFeature(feature, max(1, cache_bytes // row_bytes))
