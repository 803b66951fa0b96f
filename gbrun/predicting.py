"""Every node's prediction (--predict): layer-wise inference over full
neighbourhoods, as DGL's examples do it (`layerwise_infer`), shared by the
ranks, and the file rank 0 writes in the dataset's own node ids.

Each layer runs over every node before the next one starts: a rank
computes its share of the nodes' outputs of one layer from the previous
layer's outputs of their (full) neighbourhoods, and the ranks exchange
their shares. No node's computation is repeated in its neighbours'
batches, and the result depends neither on sampling nor on the number of
ranks or machines. On one machine the outputs of a layer are an (N, width)
tensor on every rank, summed over the ranks from zeros (each node is
written by exactly one rank, so the sum is exact); on DGL's distributed
engine they are a DistTensor on the graph servers (see gbrun.distributed).
Memory on one machine: two (N, width) float32 tensors per rank.
"""
import os

import numpy as np
import torch
import torch.distributed as dist

from .batches import Batches
from .checkpoint import save_atomically

# What --predict writes for each kind of label (LABELS), checked before the
# file is written: the class ids, or float scores / values.
KINDS = {
    "class": ("int64 class ids, one per node", lambda p: p.dim() == 1
              and not p.is_floating_point()),
    "multi-hot": ("float32 scores, a row per node", lambda p: p.dim() == 2
                  and p.is_floating_point()),
    "value": ("float32 values, one or a row per node",
              lambda p: p.dim() in (1, 2) and p.is_floating_point()),
}


def seed_ids(data):
    """A mini-batch's seed (output) node ids: `seed_nodes` on dgl 2.1,
    `seeds` from 2.2 on (public MiniBatch attributes)."""
    seeds = getattr(data, "seed_nodes", None)
    return data.seeds if seeds is None else seeds


class EveryNode:
    """One rank's part of predicting every node: its share of the nodes
    (`item_set`, for the example's create_dataloader), the passes of each
    layer over them (`batches`), the previous layer's outputs of a batch's
    input nodes (`inputs`), this rank's outputs (`add`), the exchange after
    each layer (`exchange`) and the file (`save`). Make it on every rank;
    every method but `save` and `inputs` is called on every rank."""

    def __init__(self, job, graph, progress):
        self.rank, self.device = progress.rank, progress.device
        self.seed, self.upcast = progress.start.seed, progress.upcast
        if hasattr(job.dataset, "every_node"):
            # DGL's distributed engine: the partitions' share and storage.
            self.shared = job.dataset.every_node()
        else:
            self.shared = LocalOutputs(job.dataset, graph, self.device)
        self.item_set = self.shared.item_set
        self.rows = []  # this rank's (seed ids, outputs) of the current layer
        self.checked = False  # every node once (the first layer shows it)

    def batches(self, dataloader, layer_idx):
        """`dataloader`'s pass over this rank's nodes for layer `layer_idx`,
        every batch (--max-batches does not apply), shown on rank 0."""
        return Batches(dataloader, self.rank, f"predict, layer {layer_idx}",
                       self.seed, upcast=self.upcast, device=self.device,
                       pass_id=(0, layer_idx))

    def inputs(self, data):
        """The previous layer's outputs of `data`'s input nodes."""
        if self.shared.previous is None:
            raise RuntimeError(
                "every_node.inputs(data) before a layer was exchanged: "
                "the first layer reads the node features (node_features)")
        return self.shared.read(data.input_nodes).to(self.device)

    def add(self, data, outputs):
        """This rank's outputs of `data`'s seed nodes for the current layer."""
        self.rows.append((seed_ids(data).cpu(), outputs.detach().float().cpu()))

    def exchange(self):
        """Every rank, after a layer: the layer's outputs of every node
        become the next layer's inputs."""
        ids = torch.cat([i for i, _ in self.rows]) if self.rows else (
            torch.zeros(0, dtype=torch.int64))
        # A rank without nodes learns the width from the others (on the
        # rank's device: NCCL reduces GPU tensors only).
        width = torch.tensor(self.rows[0][1].shape[1] if self.rows else 0,
                             device=self.device)
        dist.all_reduce(width, op=dist.ReduceOp.MAX)
        width = int(width)
        values = torch.cat([v for _, v in self.rows]) if self.rows else (
            torch.zeros(0, width))
        self.rows = []
        if not self.checked:
            self.check_once(ids)
        self.shared.exchange(ids, values, width)

    def check_once(self, ids):
        """Refuses, after the first layer, shares that do not cover every
        node exactly once across the ranks (the exchange would sum a node
        written twice, and leave one written by nobody at zero)."""
        times = torch.bincount(ids, minlength=self.shared.num_nodes)
        times = times.clamp(max=2).to(torch.uint8).to(self.device)
        dist.all_reduce(times)
        missing = int((times == 0).sum())
        repeated = int((times > 1).sum())
        if missing or repeated:
            raise RuntimeError(
                f"--predict: of {self.shared.num_nodes} nodes, the ranks "
                f"predicted {missing} none and {repeated} more than once: "
                "the all-nodes loader must hand every rank its own share "
                "(create_dataloader's DistributedItemSampler, is_train "
                "False)")
        self.checked = True

    @property
    def outputs(self):
        """The last layer's outputs of every node, on rank 0 (an empty
        tensor elsewhere: rank 0 writes the file)."""
        return self.shared.outputs(self.rank == 0)

    def save(self, predictions, path, labels):
        """On rank 0: `predictions` (a row per node, in the graph's node ids)
        written to `path` (.npy) in the dataset's node ids, once checked
        against `labels` (the example's LABELS). A no-op elsewhere."""
        if self.rank != 0:
            return
        what, fits = KINDS[labels]
        if not fits(predictions) or len(predictions) != self.shared.num_nodes:
            raise RuntimeError(
                f"--predict: LABELS is '{labels}', so the predictions are "
                f"{what} ({self.shared.num_nodes} nodes); to_prediction() "
                f"returned a {predictions.dtype} tensor of shape "
                f"{tuple(predictions.shape)}")
        predictions = predictions.cpu()
        if predictions.is_floating_point():
            predictions = predictions.float()
        else:
            predictions = predictions.long()
        ordered = torch.empty_like(predictions)
        ordered[self.shared.dataset_ids()] = predictions
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        # Written whole or not at all.
        save_atomically(ordered.numpy(), path,
                        save=lambda array, f: np.save(f, array))
        print(f"Predictions of {len(ordered)} nodes written to {path}",
              flush=True)


class LocalOutputs:
    """A layer's outputs of every node on one machine: an (N, width) tensor
    on every rank, each node's row written by the one rank that computed
    it and summed over the ranks (exact: the others add zeros)."""

    def __init__(self, dataset, graph, device):
        self.num_nodes, self.device = graph.total_num_nodes, device
        # The dataset's own item set of every node (its names and dtype are
        # the release's and the graph's).
        self.item_set = dataset.all_nodes_set
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
        """Row i of the outputs is node i of the dataset."""
        return torch.arange(self.num_nodes)

