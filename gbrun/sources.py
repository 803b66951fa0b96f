"""The two kinds of data a run trains from, and what each provides.

A Job's dataset (gbrun.launch.Job) is either a GraphBolt dataset on one
machine (as GraphBolt loads it; of() adapts it as a GraphBoltSource) or
DGL's partitions, served by graph servers
(gbrun.dgl_engine.partitions.Partitions, which the distributed trainer puts
there). gbrun asks the interface, never the kind:

    DataSource      what a rank trains from
      place()         the graph, features and item sets a rank trains on
      every_node()    --predict's share of every node, and where each
                      layer's outputs are kept
      check_shared_memory()  the ranks' one copy fits in /dev/shm
      edge_types()    (source type, relation, destination type) per type
      num_nodes()     {node type: number of nodes}
    ServedGraph     a graph that its own loader samples (DGL's engine):
      dataloader()    what the example's create_dataloader() hands it
    BatchSource     a loader that hands out each pass itself (gbrun.batches
                    reads a GraphBolt DataLoader, or asks this)
    LayerOutputs    where --predict keeps a layer's outputs of every node:
                    on every rank (LocalOutputs, here), or on the graph
                    servers (gbrun.dgl_engine.partitions.DistOutputs)
"""
import abc
import os

import torch
import torch.distributed as dist

from .cli import UsageError
from .graphbolt import gb
from .placement import place_graph

class DataSource(abc.ABC):
    @abc.abstractmethod
    def place(self, item_sets, storage, device, gpu_cache_size, feature_keys):
        """(graph, features, (train, validation, test) item sets) this rank
        trains on: `item_sets` (the Job's) where the whole graph is here,
        with the graph and features where --mode puts them (`storage`,
        `device`; a GPU cache of `gpu_cache_size` bytes in front of the
        features the model reads, `feature_keys`), or this rank's share."""

    @abc.abstractmethod
    def every_node(self, graph, device):
        """(item set of this rank's share of every node, {node type, None
        for a graph of one: the storage of a layer's outputs}), for
        gbrun.predicting. `graph`: what place() returned."""

    @abc.abstractmethod
    def check_shared_memory(self):
        """Refuses (UsageError) a dataset whose one copy, shared by the
        ranks of this machine, does not fit in its shared memory."""

    @abc.abstractmethod
    def edge_types(self):
        """[(source type, relation, destination type)], a graph of several
        node types' edge types, as DGL's heterogeneous modules take them."""

    @abc.abstractmethod
    def num_nodes(self):
        """{node type: number of nodes} of a graph of several node types."""


class ServedGraph(abc.ABC):
    """The graph of a data source whose own loader samples it (DGL's
    distributed engine): the example's create_dataloader() hands it the
    work instead of building GraphBolt's pipeline."""

    @abc.abstractmethod
    def dataloader(self, nids, is_train, batch_size, fanout, feature_keys,
                   label_key, device):
        """A loader of this rank's nodes `nids` (a BatchSource)."""


class BatchSource(abc.ABC):
    """A loader that hands out each pass's batches itself (gbrun.batches
    asks it; a GraphBolt DataLoader is read there)."""

    @abc.abstractmethod
    def source(self, batches):
        """(the batches of the pass `batches` describes, a gbrun.batches
        Batches, from its step on; how many there are in all)."""


class LayerOutputs(abc.ABC):
    """A layer's outputs of every node (of one node type) for --predict:
    `num_nodes`, and `previous`, the last layer exchanged (None before the
    first, or where the layer computed none of this type)."""

    num_nodes = 0
    previous = None

    @abc.abstractmethod
    def read(self, nodes):
        """The previous layer's outputs of `nodes`."""

    @abc.abstractmethod
    def exchange(self, ids, values, width):
        """Every rank, after a layer: this rank's outputs `values` of nodes
        `ids` (rows of `width`) become part of every node's."""

    @abc.abstractmethod
    def outputs(self, here):
        """Every node's outputs of the last layer where `here`, else none."""

    @abc.abstractmethod
    def dataset_ids(self):
        """The dataset's node id of each row of outputs()."""


def of(dataset):
    """`dataset` as a DataSource: itself, or a GraphBolt dataset adapted."""
    return dataset if isinstance(dataset, DataSource) else (
        GraphBoltSource(dataset))


def place(job, storage, device, gpu_cache_size, feature_keys):
    """(graph, features, item sets) a rank trains on, from a Job (see
    DataSource.place): on one machine the graph and features where --mode
    puts them; on DGL's distributed engine its DistGraph and this trainer's
    node_split of each split."""
    return of(job.dataset).place(job.item_sets, storage, device,
                                 gpu_cache_size, feature_keys)


def edge_types(dataset):
    """The edge types of a Job's dataset (see DataSource.edge_types), for a
    model of several node types (docs/customising.md)."""
    return of(dataset).edge_types()


def num_nodes(dataset):
    """{node type: number of nodes} of a Job's dataset, for a model of
    several node types (docs/customising.md)."""
    return of(dataset).num_nodes()


class GraphBoltSource(DataSource):
    """A GraphBolt dataset, whole on this machine (one copy shared by its
    ranks)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def place(self, item_sets, storage, device, gpu_cache_size, feature_keys):
        graph, features = place_graph(self.dataset, storage, device,
                                      gpu_cache_size, feature_keys)
        return graph, features, item_sets

    def every_node(self, graph, device):
        # The dataset's own item set of every node (its names and dtype are
        # the release's and the graph's; per node type for several).
        item_set, counts = self.dataset.all_nodes_set, graph.num_nodes
        if isinstance(counts, dict):
            item_set = of_ids(item_set, counts, graph.indices.dtype)
        else:
            counts = {None: counts}
        return item_set, {ntype: LocalOutputs(count, device)
                          for ntype, count in counts.items()}

    def edge_types(self):
        return [tuple(etype.split(":"))
                for etype in self.dataset.graph.edge_type_to_id]

    def num_nodes(self):
        return self.dataset.graph.num_nodes

    def check_shared_memory(self, path="/dev/shm"):
        """Refuses a dataset that does not fit in `path`, where the ranks'
        one copy of it goes: writing past its end kills the process with
        SIGBUS (a bare 'Bus error'), as in Docker, whose /dev/shm is 64 MB
        by default."""
        graph, feature = self.dataset.graph, self.dataset.feature
        tensors = [graph.csc_indptr, graph.indices, graph.node_type_offset,
                   graph.type_per_edge]
        tensors += list((graph.edge_attributes or {}).values())
        tensors += [feature.read(*key) for key in feature.keys()]
        needed = sum(
            t.untyped_storage().nbytes() for t in tensors
            if t is not None and not t.untyped_storage().is_shared()
        )
        try:
            stat = os.statvfs(path)
        except OSError:
            return  # no such file system: torch will say what it lacks
        free = stat.f_bavail * stat.f_frsize
        if needed > free:
            raise UsageError(
                f"the graph and features need {needed / 2**20:,.1f} MB of "
                f"shared memory, but {path} has {free / 2**20:,.1f} MB free "
                "(in Docker: docker run --shm-size=... or --ipc=host)"
            )


def of_ids(item_set, counts, dtype):
    """An ItemSetDict of every node of each type, as tensors of ids: dgl
    2.1's DistributedItemSampler cannot index one of counts (the dataset's
    all_nodes_set), and then hands every rank all of it, silently."""
    return gb.ItemSetDict({
        ntype: gb.ItemSet(torch.arange(count, dtype=dtype),
                          names=item_set.names)
        for ntype, count in counts.items()})


class LocalOutputs(LayerOutputs):
    """A layer's outputs of every node (of one type) on one machine: an
    (N, width) tensor on every rank, each node's row written by the one rank
    that computed it and summed over the ranks (exact: the others add
    zeros)."""

    def __init__(self, num_nodes, device):
        self.num_nodes, self.device = num_nodes, device
        self.previous = None

    def read(self, nodes):
        return self.previous[nodes.cpu()]

    def exchange(self, ids, values, width):
        full = torch.zeros(self.num_nodes, width)
        full[ids] = values
        if self.device.type == "cuda":
            # NCCL reduces GPU tensors only.
            gpu = full.to(self.device)
            dist.all_reduce(gpu)
            full = gpu.cpu()
        else:
            dist.all_reduce(full)
        self.previous = full

    def outputs(self, here):
        return self.previous if here else self.previous[:0]

    def dataset_ids(self):
        """Row i of the outputs is node i of the dataset (of its type: a
        graph of several types numbers each type's nodes from 0)."""
        return torch.arange(self.num_nodes)
