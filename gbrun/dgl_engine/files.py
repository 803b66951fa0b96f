"""The files beside DGL's partitions that partition_graph.py (and
chunk_dataset.py) write and the distributed trainer reads: what the
partition config does not record (dataset_info.json), the dataset's item
sets in the partitions' node ids, and each node's dataset id
(orig_nids.pt)."""
import json
import os

import torch

from ..cli import UsageError
from ..graphbolt import gb
from ..data.splits import ATTRIBUTES

# The dataset's item sets in the partitioned graph's node ids (written by
# partition_graph.py): the trainer's Job holds them, as on one machine.
ITEM_SETS_FILE = "item_sets.pt"
# orig_nids[i] is the dataset id of node i in the partitioned graph.
ORIG_NIDS_FILE = "orig_nids.pt"
# What the partition config does not record, beside it (dataset_info).
DATASET_INFO_FILE = "dataset_info.json"


def dataset_info(graph_name, num_classes, features, example, num_train,
                 use_graphbolt=False, node_types=None):
    """What the trainer reads beside the partition config and the config
    does not record: the example's feature widths (`features`, {key:
    width}, or {node type: {key: width}}), label key and kind, the number of
    classes and of training nodes; for a graph of several node types
    (`node_types`), its target type and edge types."""
    def widths(features):
        return {key: widths(width) if isinstance(width, dict) else int(width)
                for key, width in features.items()}

    return {
        "graph_name": graph_name,
        "num_classes": int(num_classes),
        "features": widths(features),
        "label_key": example.LABEL_KEY,
        "labels": example.LABELS,
        "num_train": int(num_train),
        "use_graphbolt": use_graphbolt,
        **(node_types or {}),
    }


def write_dataset_info(directory, info):
    """dataset_info.json in `directory`; returns its path."""
    path = os.path.join(directory, DATASET_INFO_FILE)
    with open(path, "w") as f:
        json.dump(info, f, indent=2)
    return path


def save_item_sets(out_dir, splits, orig_nids):
    """`splits`: (seed node ids, labels) of train, validation and test, in
    dataset ids ({target type: (seeds, labels)} on a graph of several node
    types, whose `orig_nids` are per type); saved with the seeds renumbered
    as the partitions number them (`orig_nids[new id]` is a node's dataset
    id)."""
    def renumbered(seeds, orig_nids):
        new_ids = torch.empty_like(orig_nids)
        new_ids[orig_nids] = torch.arange(len(orig_nids), dtype=orig_nids.dtype)
        return new_ids[torch.as_tensor(seeds)]

    saved = {}
    for name, split in zip(ATTRIBUTES, splits):
        if isinstance(split, dict):
            saved[name] = {ntype: (renumbered(seeds, orig_nids[ntype]), labels)
                           for ntype, (seeds, labels) in split.items()}
        else:
            seeds, labels = split
            saved[name] = (renumbered(seeds, orig_nids), labels)
    torch.save(saved, os.path.join(out_dir, ITEM_SETS_FILE))


def load_item_sets(part_dir):
    """The item sets save_item_sets wrote, as the example's Job holds them
    on one machine: GraphBolt ItemSets of (seed_nodes, labels), in an
    ItemSetDict by node type on a graph of several."""
    path = os.path.join(part_dir, ITEM_SETS_FILE)
    if not os.path.isfile(path):
        raise UsageError(
            f"{part_dir} has no {ITEM_SETS_FILE}: partitions written by an "
            "older partition_graph.py; run it again")
    splits = torch.load(path, weights_only=True)

    def item_set(items):
        return gb.ItemSet(items, names=("seed_nodes", "labels"))

    return tuple(
        gb.ItemSetDict({ntype: item_set(items)
                        for ntype, items in splits[name].items()})
        if isinstance(splits[name], dict) else item_set(splits[name])
        for name in ATTRIBUTES)
