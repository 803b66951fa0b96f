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
engine they are a DistTensor on the graph servers (gbrun.sources.LayerOutputs
says what each provides).
On a graph of several node types, all of this is per node type (ids within
the type), and the file holds the type the last layer outputs. Memory on
one machine: two (N, width) float32 tensors per rank (per node type).

The example makes an EveryNode on every rank; it hands a layer's outputs
to LayerShares, which exchanges them between the ranks, and rank 0's
predictions to write_predictions, which writes the file.
"""
import os

import numpy as np
import torch
import torch.distributed as dist

from . import outputs, sources
from .batches import Batches
from .checkpoint import save_atomically

# What --predict writes for each kind of label (LABELS), checked before the
# file is written: the class ids, or float scores / values.
PREDICTIONS = {
    "class": ("int64 class ids, one per node", lambda p: p.dim() == 1
              and not p.is_floating_point()),
    "multi-hot": ("float32 scores, a row per node", lambda p: p.dim() == 2
                  and p.is_floating_point()),
    "value": ("float32 values, one or a row per node",
              lambda p: p.dim() in (1, 2) and p.is_floating_point()),
    "embedding": ("float32 embeddings, a row per node",
                  lambda p: p.dim() == 2 and p.is_floating_point()),
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
    every method but `save` and `inputs` is called on every rank.

    A graph of several node types: the outputs and inputs are {node type:
    tensor} (ids within each type), a layer's outputs are exchanged per
    type, and the last layer must output one node type (the file's)."""

    def __init__(self, job, graph, progress, name="predict"):
        self.rank, self.device = progress.rank, progress.device
        self.name = name  # the progress bar's, for each layer
        self.seed, self.upcast = progress.start.seed, progress.upcast
        # This rank's share of every node, and where each type's outputs
        # are kept (gbrun.sources.LayerOutputs): on every rank, or on DGL's
        # graph servers.
        self.item_set, self.types = sources.of(job.dataset).every_node(
            graph, self.device)
        self.shares = LayerShares(self.types, self.device)

    def batches(self, dataloader, layer_idx):
        """`dataloader`'s pass over this rank's nodes for layer `layer_idx`,
        every batch (--max-batches does not apply), shown on rank 0."""
        return Batches(dataloader, self.rank, f"{self.name}, layer {layer_idx}",
                       self.seed, upcast=self.upcast, device=self.device,
                       pass_id=(0, layer_idx))

    def inputs(self, data):
        """The previous layer's outputs of `data`'s input nodes."""
        if all(shared.previous is None for shared in self.types.values()):
            raise RuntimeError(
                "every_node.inputs(data) before a layer was exchanged: "
                "the first layer reads the node features (node_features)")
        nodes = data.input_nodes
        if not isinstance(nodes, dict):
            return self.types[None].read(nodes).to(self.device)
        # The types the previous layer computed (the model's next layer
        # reads no other).
        return {ntype: self.types[ntype].read(ids).to(self.device)
                for ntype, ids in nodes.items()
                if self.types[ntype].previous is not None}

    def add(self, data, outputs):
        """This rank's outputs of `data`'s seed nodes for the current layer
        (a tensor, or {node type: tensor} for several node types)."""
        self.shares.add(seed_ids(data), outputs)

    def exchange(self):
        """Every rank, after a layer: the layer's outputs of every node
        become the next layer's inputs."""
        self.shares.exchange()

    def last_layer(self, node_type=None):
        """The outputs of the last layer exchanged: one node type's (that
        of `node_type`, where the layer output several)."""
        computed = [ntype for ntype, shared in self.types.items()
                    if shared.previous is not None]
        output = ", ".join(map(str, computed)) or "(none)"
        if node_type is not None:
            if node_type not in computed:
                raise RuntimeError(
                    f"outputs of node type '{node_type}' asked for, but the "
                    f"model's last layer output node types {output}")
            return self.types[node_type]
        if len(computed) != 1:
            raise RuntimeError(
                "--predict writes one node type's predictions, but the "
                f"model's last layer output node types {output}")
        return self.types[computed[0]]

    def read(self, nodes, node_type=None):
        """The last layer's outputs of `nodes` (graph ids; of `node_type`,
        where it output several), on any rank: every node's embedding,
        once each rank computed its share."""
        return self.last_layer(node_type).read(nodes).to(self.device)

    @property
    def outputs(self):
        """The last layer's outputs of every node, on rank 0 (an empty
        tensor elsewhere: rank 0 writes the file)."""
        return self.outputs_of()

    def outputs_of(self, node_type=None):
        """`outputs`, of `node_type` where the last layer output several."""
        return self.last_layer(node_type).outputs(self.rank == 0)

    def save(self, predictions, path, labels, node_type=None):
        """On rank 0: `predictions` (a row per node, in the graph's node ids;
        of `node_type`, where the last layer output several) written to
        `path` (.npy) in the dataset's node ids, once checked against
        `labels` (the example's LABELS). A no-op elsewhere."""
        if self.rank != 0:
            return
        write_predictions(predictions, self.last_layer(node_type), path,
                          labels)


class LayerShares:
    """The ranks' shares of a layer's outputs: this rank's (`add`), and
    their exchange after the layer (`exchange`, on every rank), which makes
    every node's outputs the next layer's inputs in `types` ({node type:
    gbrun.sources.LayerOutputs}; None, the type of a graph of one)."""

    def __init__(self, types, device):
        self.types, self.device = types, device
        # This rank's (seed ids, outputs) of the current layer, per type.
        self.rows = {}
        self.checked = set()  # every node once (a type's first layer shows it)

    def add(self, seeds, outputs):
        """This rank's outputs of the current layer for nodes `seeds` (a
        tensor of ids, or {node type: ids} for several node types)."""
        if not isinstance(outputs, dict):
            seeds, outputs = {None: seeds}, {None: outputs}
        for ntype, values in outputs.items():
            # A batch without seeds of a type the model outputs has none.
            ids = seeds.get(ntype, torch.zeros(0, dtype=torch.int64))
            if len(ids) != len(values):
                raise RuntimeError(
                    f"--predict: {len(values)} outputs for {len(ids)} seed "
                    f"nodes{of_type(ntype)}: the model's outputs must be its "
                    "seed nodes' (one row each)")
            self.rows.setdefault(ntype, []).append(
                (ids.cpu(), values.detach().float().cpu()))

    def exchange(self):
        """Every rank, after a layer: every rank's rows of the layer are
        every node's outputs in `types`; this rank's rows start anew."""
        # The types and widths of the layer's outputs: a rank without nodes
        # (or without a type's) learns them from the others.
        widths = [None] * dist.get_world_size()
        dist.all_gather_object(widths, {
            ntype: rows[0][1].shape[1] for ntype, rows in self.rows.items()})
        computed = {}
        for rank_widths in widths:
            for ntype, width in rank_widths.items():
                computed[ntype] = max(computed.get(ntype, 0), width)
        unknown = [str(ntype) for ntype in computed if ntype not in self.types]
        if unknown:
            raise RuntimeError(
                f"--predict: outputs for node types {', '.join(unknown)}, but "
                f"the graph's are {', '.join(map(str, self.types))}")
        for ntype, shared in self.types.items():
            if ntype not in computed:
                shared.previous = None  # not an input of the next layer
                continue
            rows, width = self.rows.get(ntype, []), computed[ntype]
            ids = torch.cat([i for i, _ in rows]) if rows else (
                torch.zeros(0, dtype=torch.int64))
            values = torch.cat([v for _, v in rows]) if rows else (
                torch.zeros(0, width))
            if ntype not in self.checked:
                self.check_once(ntype, ids)
            shared.exchange(ids, values, width)
        self.rows = {}

    def check_once(self, ntype, ids):
        """Refuses, after a type's first layer, shares that do not cover
        every node exactly once across the ranks (the exchange would sum a
        node written twice, and leave one written by nobody at zero)."""
        num_nodes = self.types[ntype].num_nodes
        times = torch.bincount(ids, minlength=num_nodes)
        times = times.clamp(max=2).to(torch.uint8).to(self.device)
        dist.all_reduce(times)
        missing = int((times == 0).sum())
        repeated = int((times > 1).sum())
        if missing or repeated:
            raise RuntimeError(
                f"--predict: of {num_nodes} nodes{of_type(ntype)}, the ranks "
                f"predicted {missing} none and {repeated} more than once: "
                "the all-nodes loader must hand every rank its own share "
                "(create_dataloader's DistributedItemSampler, is_train "
                "False)")
        self.checked.add(ntype)


def write_predictions(predictions, shared, path, labels):
    """`predictions` of every node of `shared` (the LayerOutputs of their
    type), in the graph's node ids, written to `path` (.npy) in the
    dataset's node ids once checked against `labels` (the example's
    LABELS)."""
    what, fits = PREDICTIONS[labels]
    if not fits(predictions) or len(predictions) != shared.num_nodes:
        raise RuntimeError(
            f"--predict: LABELS is '{labels}', so the predictions are "
            f"{what} ({shared.num_nodes} nodes); to_prediction() "
            f"returned a {predictions.dtype} tensor of shape "
            f"{tuple(predictions.shape)}")
    predictions = predictions.cpu()
    if predictions.is_floating_point():
        predictions = predictions.float()
    else:
        predictions = predictions.long()
    ordered = torch.empty_like(predictions)
    ordered[shared.dataset_ids()] = predictions
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    outputs.check_replaceable(path, "--predict")
    # Written whole or not at all, then recorded as --predict's.
    save_atomically(ordered.numpy(), path,
                    save=lambda array, f: np.save(f, array))
    outputs.write_record(path)
    what = "Embeddings" if labels == "embedding" else "Predictions"
    print(f"{what} of {len(ordered)} nodes written to {path}", flush=True)


def of_type(ntype):
    return "" if ntype is None else f" of type '{ntype}'"
