"""Where the graph and features live (--mode): CPU memory read with
torch.index_select, pinned memory with an optional GPU cache, or the GPU."""
import torch

from .cli import UsageError
from .data.datasets import node_keys
from .graphbolt import gb, make_gpu_cache

def place_graph(dataset, storage, device, gpu_cache_size, feature_keys):
    """(graph, features) of GraphBolt's `dataset` where --mode says
    (`storage` on `device`): CPU memory (features read with index_select),
    pinned memory (optionally fronted, for the features the model reads,
    `feature_keys`, by GPU caches of `gpu_cache_size` bytes in all; see
    gpu_cached_store), or the GPU."""
    if storage == "cuda":
        return dataset.graph.to(device), dataset.feature.to(device)
    if storage == "cpu":
        return dataset.graph, index_select_store(dataset.feature)
    # Pin the graph and features (in place) to enable GPU access.
    try:
        graph = dataset.graph.pin_memory_()
        features = dataset.feature.pin_memory_()
    except AssertionError:
        # dgl 2.1.0 asserts that cudaHostRegister returned 0, with no message.
        raise UsageError(
            "--mode pinned-cuda: pinning the graph and features in host "
            "memory failed (cudaHostRegister refused them: too little "
            "lockable memory, or a /dev/shm too small for the shared copy; "
            "in Docker, --shm-size); use --mode cpu-cuda, or cuda-cuda if "
            "they fit in GPU memory"
        ) from None
    if gpu_cache_size > 0:
        features = gpu_cached_store(features, feature_keys, gpu_cache_size)
    return graph, features


def gpu_cached_store(features, feature_keys, cache_bytes):
    """A store of the features the loader fetches, each behind a GPU cache
    (public API on every GraphBolt release). The bytes are shared in
    proportion to row sizes: every cache then holds as many rows, and a
    batch reads the same nodes from each feature."""
    keys = node_keys(feature_keys)
    tensors = {key: features.read(*key) for key in keys}
    row_bytes = {key: t[0].numel() * t.element_size()
                 for key, t in tensors.items()}
    total = sum(row_bytes.values())
    return gb.BasicFeatureStore({
        key: make_gpu_cache(gb.TorchBasedFeature(tensor),
                            cache_bytes * row_bytes[key] // total)
        for key, tensor in tensors.items()
    })


class IndexSelectFeature(gb.Feature):
    """A feature in CPU memory, read with torch.index_select. dgl 2.1.0-2.3
    read CPU features by advanced indexing (`input.index({index})` in
    graphbolt/src/index_select.cc): 0.73 s against 0.14 s for the 962,000
    rows of 100 floats that one products-sized batch gathers (one thread).
    The rows read are the same, so runs are too. dgl 2.4 made its own read
    fast (#7584); this one is as fast there."""

    def __init__(self, tensor, metadata):
        super().__init__()
        self._tensor, self._metadata = tensor, metadata

    def read(self, ids=None):
        if ids is None:
            return self._tensor
        return torch.index_select(self._tensor, 0, ids)

    def size(self):
        return self._tensor.size()[1:]

    def metadata(self):
        return self._metadata


def index_select_store(features):
    """The feature store `features` (CPU tensors), every feature read with
    torch.index_select: GraphBolt's public store of custom features."""
    return gb.BasicFeatureStore({
        key: IndexSelectFeature(features.read(*key), features.metadata(*key))
        for key in features.keys()
    })
