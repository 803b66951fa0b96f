"""Datasets and batches: loading and checking a GraphBolt dataset, placing
it where --mode says, the options that differ between GraphBolt releases
(told apart by signature, never by version strings), and the mini-batches a
rank trains on, seeded so that a run repeats and resumes exactly."""
import inspect
import itertools
import os
import random
import time

import numpy as np
import torch
import tqdm
from torch.utils.data.graph import traverse_dps
from torch.utils.data.graph_settings import get_all_graph_pipes

from .cli import UsageError
from .graphbolt import batches_per_rank, gb, seed_item_sampler

BUILTIN_DATASETS = ["cora", "ogbn-arxiv", "ogbn-products", "ogbn-papers100M"]
SPLITS = ("train_set", "validation_set", "test_set")


def node_key(name):
    """The feature store's key of node feature `name` (homogeneous graph)."""
    return ("node", None, name)


def load_dataset(name_or_dir, data_root="datasets"):
    """The one place that reads datasets (the scripts use it too): a builtin
    GraphBolt dataset (downloaded under `data_root` on first use) or an
    OnDiskDataset directory, by its real path: GraphBolt preprocesses a
    directory again whenever it is spelled differently."""
    if name_or_dir in BUILTIN_DATASETS:
        try:
            dataset = gb.BuiltinDataset(name_or_dir, root=data_root).load()
        except Exception as error:
            raise UsageError(
                f"could not fetch dataset '{name_or_dir}' into "
                f"'{data_root}' ({type(error).__name__}: {error}); offline, "
                "make one with scripts/make_synthetic_dataset.py DIR and pass "
                "--dataset DIR"
            ) from None
    elif os.path.isdir(name_or_dir):
        if not os.path.isfile(os.path.join(name_or_dir, "metadata.yaml")):
            raise UsageError(
                f"--dataset '{name_or_dir}' is a directory without "
                "metadata.yaml, so it is not a GraphBolt OnDiskDataset"
            )
        dataset = gb.OnDiskDataset(os.path.realpath(name_or_dir)).load()
    else:
        raise UsageError(
            f"--dataset '{name_or_dir}' is neither a builtin dataset "
            f"({', '.join(BUILTIN_DATASETS)}) nor a directory"
        )
    if not dataset.tasks:
        raise UsageError(f"dataset '{name_or_dir}' defines no task")
    return dataset


def dataset_identity(name_or_dir):
    """How a checkpoint names its dataset: a builtin's name or a real path."""
    if name_or_dir in BUILTIN_DATASETS:
        return name_or_dir
    return os.path.realpath(name_or_dir)


LABEL_KINDS = ("class", "multi-hot")


def check_dataset(dataset, name, feature_keys, label_key, labels="class"):
    """Refuses a dataset the example cannot train on, naming what is
    missing or wrong. Returns the task's item sets (train, validation, test),
    each with checked labels: the task's own, or else the node feature
    `label_key` of each seed. `labels` says what a label is: "class", one
    integer in [0, num_classes) per node (int64 for cross-entropy), or
    "multi-hot", num_classes entries of 0 or 1 per node (float32, for
    multi-label losses)."""
    task = dataset.tasks[0]
    if "num_classes" not in task.metadata:
        raise UsageError(
            f"dataset '{name}': task '{task.metadata.get('name', 0)}' has no "
            "num_classes in metadata.yaml"
        )
    num_classes = int(task.metadata["num_classes"])
    keys = dataset.feature.keys()
    names = ", ".join(str(k[2]) for k in keys) or "none"
    for feature_key in feature_keys:
        if node_key(feature_key) not in keys:
            raise UsageError(
                f"dataset '{name}' has no node feature named '{feature_key}' "
                f"(it has: {names})"
            )
        row = list(dataset.feature.size(*node_key(feature_key)))
        if len(row) != 1:
            raise UsageError(
                f"dataset '{name}': node feature '{feature_key}' has rows of "
                f"shape {row}; the model reads one vector per node"
            )
    item_sets = []
    for split in SPLITS:
        item_set = getattr(task, split)
        if item_set is None or len(item_set) == 0:
            raise UsageError(f"dataset '{name}' has an empty {split}")
        seeds = item_set[0 : len(item_set)]
        if "labels" in (item_set.names or ()):
            seeds, values = seeds
            where = f"dataset '{name}': the {split}'s labels"
        elif node_key(label_key) in keys:
            values = dataset.feature.read(*node_key(label_key), seeds)
            where = (f"dataset '{name}': node feature '{label_key}' (the "
                     f"{split}'s labels)")
        else:
            raise UsageError(
                f"dataset '{name}': the {split} has no labels and there "
                f"is no node feature named '{label_key}' (it has: {names})"
            )
        values = checked_labels(values, num_classes, labels, where)
        item_sets.append(
            gb.ItemSet((torch.as_tensor(seeds), values),
                       names=("seed_nodes", "labels"))
        )
    return tuple(item_sets)


def checked_labels(values, num_classes, kind, where):
    """The labels as the loss takes them, or one line saying what they are
    instead (shape, dtype, range): never a silent reinterpretation."""
    values = torch.as_tensor(values)
    shape, dtype = list(values.shape), str(values.dtype).replace("torch.", "")
    if kind == "class":
        if values.dim() == 2 and values.size(1) == 1:
            values = values[:, 0]  # one column: one class per node
        expected = f"one integer class in [0, {num_classes}) per node"
        fits = values.dim() == 1 and values.dtype in INTEGER_DTYPES
        converted = values.long()
    elif kind == "multi-hot":
        expected = f"{num_classes} entries of 0 or 1 per node (multi-hot)"
        fits = values.dim() == 2 and values.size(1) == num_classes
        converted = values.float()
    else:
        raise ValueError(f"labels must be one of {LABEL_KINDS}, not {kind!r}")
    if fits and values.numel():
        low, high = values.min().item(), values.max().item()
        fits = (0 <= low and high < num_classes if kind == "class"
                else bool(((values == 0) | (values == 1)).all()))
        if not fits:
            dtype += f" with values in [{low}, {high}]"
    if not fits:
        raise UsageError(
            f"{where} have shape {shape} and dtype {dtype}, but the example "
            f"takes {expected} (LABELS = '{kind}' in the example; "
            "docs/customising.md shows a multi-label edit)"
        )
    return converted


INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32,
                  torch.int64)


def feature_size(dataset, feature_keys):
    """The model's input width: the features `feature_keys`, side by side."""
    return sum(dataset.feature.size(*node_key(key))[0] for key in feature_keys)


def check_train_split(num_train_items, batch_size, world_size):
    """The training sampler drops partial and uneven batches, so each rank
    needs one full batch: num_train_items >= batch_size * world_size."""
    if num_train_items < batch_size * world_size:
        largest = num_train_items // world_size
        raise UsageError(
            f"--batch-size {batch_size}: the train set has {num_train_items} "
            f"items, too few for one full batch on each of {world_size} "
            f"ranks; use --batch-size {largest} or less"
            if largest > 0
            else f"the train set has {num_train_items} items, fewer than the "
            f"{world_size} ranks"
        )


def store_in_bf16(dataset, feature_keys):
    """--precision bf16: the features the model reads, converted once where
    the data is loaded; the ranks share this copy and the fp32 one is
    released."""
    for key in map(node_key, feature_keys):
        dataset.feature.update(
            *key, dataset.feature.read(*key).to(torch.bfloat16))


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


def place_dataset(dataset, storage, device, gpu_cache_size, feature_keys):
    """Puts the graph and features where --mode says; with pinned features,
    optionally fronts those the model reads (`feature_keys`) with GPU caches
    of `gpu_cache_size` bytes in all (see gpu_cached_store)."""
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
    keys = [node_key(key) for key in feature_keys]
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


def item_sampler_of(dataloader):
    """The DistributedItemSampler at the root of a GraphBolt DataLoader."""
    for pipe in get_all_graph_pipes(traverse_dps(dataloader.dataset)):
        if isinstance(pipe, gb.ItemSampler):
            return pipe
    raise ValueError("the data loader has no GraphBolt ItemSampler")


class Batches:
    """A data loader's mini-batches for one pass, at most `limit` of them,
    with a progress bar on rank 0; counts the steps and the host time spent
    waiting for data (`step`: batches handed out so far, skipped ones
    included). A training pass (`epoch` given) under a seed derives its
    shuffling and sampling from (seed, rank, epoch) and each step's dropout
    from (seed, rank, epoch, step), after skipping the `skip` batches a
    stopped run already trained: a run repeats, and resumes at any step.
    This class reads a GraphBolt DataLoader (see source); the distributed
    trainer's DistBatches reads a DistGraph."""

    def __init__(self, dataloader, rank, name, seed=None, epoch=None, skip=0,
                 limit=None):
        self.dataloader = dataloader
        self.rank, self.name = rank, name
        self.seed, self.epoch = seed, epoch
        self.step, self.limit = skip, limit
        self.data_wait = 0.0

    def source(self):
        """(this pass's batches from batch `step` on, at most `limit` in
        all; rank 0's number of them, for the progress bar). Under a seed,
        every pass samples serially (see sample_serially)."""
        item_sampler = item_sampler_of(self.dataloader)
        seeded = self.seed is not None
        if seeded and self.epoch is not None:
            seed_epoch(self.seed, self.rank, self.epoch, item_sampler)
        batches = sample_serially(self.dataloader) if seeded else self.dataloader
        batches = itertools.islice(batches, self.step, self.limit)
        return batches, rank0_batches(item_sampler, self.limit)

    def __iter__(self):
        batches, total = self.source()
        if self.rank == 0:
            batches = tqdm.tqdm(
                batches, desc=self.name, total=total, initial=self.step
            )
        batches = iter(batches)
        training = self.seed is not None and self.epoch is not None
        while True:
            start = time.time()
            data = next(batches, None)
            # Host time waiting for the loader: sampling and feature
            # fetching that no prefetch thread hid.
            self.data_wait += time.time() - start
            if data is None:
                return
            if training:
                torch.manual_seed(
                    derived_seed(self.seed, self.rank, self.epoch, self.step)
                )
            # Counted before the step runs: a loop that breaks after it
            # (a stop) has trained `step` batches.
            self.step += 1
            yield data


def rank0_batches(item_sampler, limit):
    """How many batches rank 0 gets (the progress bar's total): training
    drops partial and uneven batches, evaluation drops nothing."""
    total = batches_per_rank(item_sampler)
    return min(total, limit or total)


def sample_serially(batches):
    """Yields the loader's batches, sampling each with one thread. With more,
    dgl 2.1.0's sampling is not repeatable: only the calling thread's random
    engine is seeded, and unique_and_compact numbers ids in whichever order
    the threads insert them. Training keeps all threads. Costs about 15%
    with 1 rank x 2 threads on a 200k-node graph; nothing with 1 thread."""
    threads = torch.get_num_threads()
    iterator = iter(batches)
    while True:
        torch.set_num_threads(1)
        try:
            batch = next(iterator, None)
        finally:
            torch.set_num_threads(threads)
        if batch is None:
            return
        yield batch


def seed_epoch(seed, rank, epoch, item_sampler):
    """Derives this rank's randomness for one epoch (shuffling, neighbor
    sampling) from (seed, rank, epoch), like PyTorch's
    DistributedSampler.set_epoch: the same seed repeats a run, and a resumed
    run (which samples the batches it skips) continues it exactly."""
    epoch_seed = derived_seed(seed, rank, epoch)
    random.seed(epoch_seed)
    np.random.seed(epoch_seed)
    torch.manual_seed(epoch_seed)
    gb.seed(epoch_seed)
    # GraphBolt's item sampler takes no seed for an epoch.
    seed_item_sampler(item_sampler, seed, rank, epoch, derived_seed)


def derived_seed(*entropy):
    return int(np.random.SeedSequence(list(entropy)).generate_state(1)[0])


def synchronized_time(device):
    """time.time() once the GPU has finished its queued work: CUDA runs
    asynchronously, so without this a timing measures only the launches."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.time()
