"""DGL's partitions as the example's data source (gbrun.sources): the
DistGraph and each trainer's share of the splits, and --predict's layer
outputs in DistTensors on the graph servers."""
import json
import os

import dgl
import torch
import torch.distributed as dist

from ..cli import UsageError
from ..data.splits import MASKS
from ..sources import DataSource, LayerOutputs, ServedGraph
from .files import ORIG_NIDS_FILE
from .loader import NO_HOOKS, DistLoader, num_items
from .watch import Heartbeat

# Rows of every node's predictions read back from the servers at a time.
READ_ROWS = 1 << 20


class Partitions(DataSource, ServedGraph):
    """DGL partitions served by the graph servers, where the example has a
    GraphBolt dataset (the distributed trainer puts it in the Job): the
    data source of the example's own run(), create_dataloader() and loop,
    and the graph its loader samples (gbrun.sources says what each
    provides). `dtype`: the features' type in batches (bf16 under
    --precision bf16). `heartbeat`: beaten by every batch handed out and
    every chunk of predictions read back (its TrainerWatch reads it).
    `node_types`: of a graph of several node types, dataset_info's "target"
    (the type with labels and splits) and "edge_types". `hooks`: the
    trainer's debugging options (a gbrun.dgl_engine.loader.DebugHooks),
    which its loaders apply."""

    def __init__(self, graph_name, part_config, dtype=None, node_types=None,
                 hooks=NO_HOOKS):
        self.graph_name, self.part_config = graph_name, part_config
        self.heartbeat = Heartbeat()
        self.dtype, self.hooks = dtype, hooks
        self.target = (node_types or {}).get("target")
        # What the example's model reads of a graph of several node types
        # (edge_types(), num_nodes()), before the DistGraph exists.
        self.types = [tuple(etype) for etype in
                      (node_types or {}).get("edge_types", [])]
        with open(part_config) as f:
            node_map = json.load(f)["node_map"]
        self.counts = {ntype: sum(end - start for start, end in ranges)
                       for ntype, ranges in node_map.items()}
        self.g = None

    def edge_types(self):
        return self.types

    def check_shared_memory(self):
        pass  # the graph and features stay on the graph servers

    def num_nodes(self):
        return self.counts

    def place(self, item_sets, storage, device, gpu_cache_size, feature_keys):
        """(this, the DistGraph, this trainer's share of each split): the
        graph and features stay on the graph servers (storage "cpu"), and
        the Job's `item_sets` are the whole splits."""
        self.g = dgl.distributed.DistGraph(self.graph_name,
                                           part_config=self.part_config)
        ########################################################################
        # (HIGHLIGHT) node_split gives each trainer a disjoint share of a
        # mask's nodes, mostly of its own machine's partition.
        # force_even=True makes the shares differ by at most one node and
        # cover every node exactly once, which keeps validation and test
        # metrics exact. rank= the trainer's torch rank: by default DGL
        # splits by the order in which trainers connected, and a resumed run
        # would give a trainer another share.
        ########################################################################
        book = self.g.get_partition_book()
        # On a graph of several node types: the target type's, by their ids
        # within the type, as {target: ids} (the item sets' shape there).
        data = self.g.nodes[self.target].data if self.target else self.g.ndata
        splits = tuple(
            self.typed(dgl.distributed.node_split(
                data[mask], book, ntype=self.target or "_N",
                rank=dist.get_rank(), force_even=True))
            for mask in MASKS)
        return self, self.g, splits

    def typed(self, nids):
        return {self.target: nids} if self.target else nids

    def every_node(self, graph, device):
        """(item set, {node type: DistOutputs}): the outputs on the graph
        servers, the type None for a graph of one."""
        if not self.target:
            shared = DistOutputs(self.g, self.part_config, self.heartbeat)
            return shared.item_set, {None: shared}
        types = {ntype: DistOutputs(self.g, self.part_config, self.heartbeat,
                                    ntype)
                 for ntype in self.g.ntypes}
        return {ntype: shared.item_set for ntype, shared in types.items()}, (
            types)

    def dataloader(self, nids, is_train, batch_size, fanout, feature_keys,
                   label_key, device):
        """The example's create_dataloader() on this data source: a
        DistLoader of this trainer's nodes `nids`. Training, as GraphBolt's
        drop_last and drop_uneven_inputs: every trainer trains as many full
        batches as the one with the fewest (a collective: every trainer
        makes its training loader at the same point)."""
        num_batches = None
        if is_train:
            # On the trainer's device: a GPU trainer's group is NCCL alone.
            count = torch.tensor(num_items(nids) // batch_size, device=device)
            dist.all_reduce(count, op=dist.ReduceOp.MIN)
            num_batches = count.item()
        return DistLoader(
            self.g, nids, fanout, batch_size, feature_keys, label_key, device,
            self.heartbeat, num_batches, self.dtype, self.target,
            self.hooks.of_loader(is_train, dist.get_rank()))


class DistOutputs(LayerOutputs):
    """gbrun.predicting's layer outputs of every node on DGL's distributed
    engine: this trainer's share of its own machine's nodes (`item_set`),
    and each layer's outputs in a DistTensor on the graph servers, as DGL's
    distributed example infers (one tensor a layer, persistent: DGL deletes
    a tensor with a collective that __del__ would run at any time), read
    back in the dataset's node ids through the partitioner's orig_nids."""

    def __init__(self, g, part_config, heartbeat, ntype=None):
        self.g, self.ntype = g, ntype  # ntype: of a graph of several
        self.heartbeat = heartbeat
        self.num_nodes = g.num_nodes(ntype)
        self.part_dir = os.path.dirname(part_config)
        # node_split takes a mask: every node, once (DGL's example passes
        # np.arange(N), a mask that leaves out node 0). Not force_even, as
        # DGL's example splits: that share holds nodes of other machines,
        # and DGL sends a write to another machine's server without waiting
        # for it, nor does its barrier, so the next layer could read such
        # rows before they land (as zeros). The machine's own nodes are
        # written into its shared memory before the trainer's barrier.
        self.item_set = dgl.distributed.node_split(
            torch.ones(self.num_nodes, dtype=torch.bool),
            g.get_partition_book(), ntype=ntype or "_N", rank=dist.get_rank(),
            force_even=False)
        self.previous, self.layers = None, 0

    def read(self, nodes):
        return self.previous[nodes]

    def exchange(self, ids, values, width):
        name = f"gbrun_predict_layer{self.layers}"
        outputs = dgl.distributed.DistTensor(
            (self.num_nodes, width), torch.float32,
            f"{name}_{self.ntype}" if self.ntype else name,
            # A node type's tensor, indexed by its ids within the type.
            part_policy=self.g.get_node_partition_policy(self.ntype)
            if self.ntype else None, persistent=True)
        if len(ids):
            outputs[ids] = values
        self.g.barrier()  # every trainer's rows are on the servers
        self.previous, self.layers = outputs, self.layers + 1

    def outputs(self, here):
        if not here:
            return torch.zeros(0, self.previous.shape[1])
        chunks = []
        for start in range(0, self.num_nodes, READ_ROWS):
            end = min(start + READ_ROWS, self.num_nodes)
            chunks.append(self.previous[torch.arange(start, end)])
            self.heartbeat.beat()  # progress, for TrainerWatch
        return torch.cat(chunks)

    def dataset_ids(self):
        path = os.path.join(self.part_dir, ORIG_NIDS_FILE)
        if not os.path.isfile(path):
            raise UsageError(f"{self.part_dir} has no {ORIG_NIDS_FILE}: "
                             "partition again with partition_graph.py")
        orig_nids = torch.load(path, weights_only=True)
        return orig_nids[self.ntype] if self.ntype else orig_nids
