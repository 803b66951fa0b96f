"""Write a node-classification graph in GraphBolt's OnDiskDataset format.

This module is the only place that writes the format; `convert_to_ondisk.py`
and `make_synthetic_dataset.py` are thin command lines around it.

    write_ondisk_dataset(out_dir, edges, features, labels, train, val, test)
    write_hetero_dataset(... a graph of several node types ...)
    `- _write               one body for both graphs (_OneType, _SeveralTypes)
       |- check_out_dir     out_dir new, or one gbrun wrote (gbrun.data.outdir)
       |- graph.check       every check, before anything touches the disk
       |                    (gbrun.data.inputs)
       |- graph.leaks       a link task's answers reaching the model, refused
       |- graph.warnings    isolated nodes, classes missing from the train set
       `- write_atomically  temp dir next to out_dir, then rename into place

Layout written (all node ids int64, features float32, class labels int64,
multi-hot labels and values float32; a split's files are named by its
prefix in gbrun.data.splits):

    out_dir/metadata.yaml
    out_dir/edges.npy                 shape (2, E): row 0 = src, row 1 = dst
    out_dir/node_feat.npy             shape (N, F), node feature "feat"
    out_dir/node_feat_<k>.npy         shape (N, F_k), the k-th extra feature
    out_dir/node_label.npy            shape (N,), multi-hot (N, C) or
                                      values (N, D): node feature "label"
    out_dir/{train,valid,test}_seed_nodes.npy and _labels.npy
    out_dir/{train,valid,test}_node_pairs.npy   with a link task (E, 2)
    out_dir/{valid,test}_negative_dsts.npy      and (E, K) (gbrun.data.links)
    out_dir/gbrun-written.json        {file: "size:sha256"} of each file
                                      above: what --force may replace

A graph of several node types has edges_<k>.npy per edge type and
node_feat_<k>.npy per node type with features instead.

Load it with gbrun.data.datasets.load_dataset(out_dir) (GraphBolt's own
`gb.OnDiskDataset(out_dir).load()` would add a `preprocessed/` folder
inside out_dir, which --force then refuses to remove).

Every problem with the inputs raises gbrun.data.inputs.DatasetError with
one line that names the input, the problem and an example bad value.
"""

import os
import sys

import numpy as np
import yaml

from . import links, typed_links
from .inputs import (
    BLOCK_ELEMENTS, DatasetError, check_labels, check_splits, check_types,
    display_names, edge_warnings, find_warnings, label_kind, validate_inputs,
)
from .outdir import check_out_dir, write_atomically
from .splits import TABLE, TRAIN

# GraphBolt's preprocessing rewrites paths with .replace("pt", "npy"), so no
# file name here may contain "pt".
EDGES_FILE = "edges.npy"
FEAT_FILE = "node_feat.npy"
LABEL_FILE = "node_label.npy"


# ---------------------------------------------------------------- files

def _blocks(array):
    """Yield C-order blocks of a 1-D or 2-D array without a full copy."""
    if array.ndim == 1 or array.shape[0] <= 16:
        # Few long rows, like (2, E) edges: cut each row into slices.
        for row in array.reshape(-1, array.shape[-1]) if array.ndim == 2 else [array]:
            for start in range(0, row.shape[0], BLOCK_ELEMENTS):
                yield row[start : start + BLOCK_ELEMENTS]
    else:
        rows = max(1, BLOCK_ELEMENTS // array.shape[1])
        for start in range(0, array.shape[0], rows):
            yield array[start : start + rows]


def save_npy(path, array, dtype):
    """np.save(path, array.astype(dtype)) in blocks, to keep memory flat.

    Casting, transposed views and memory-mapped inputs are handled one block
    at a time instead of materialising a converted copy of the whole array.
    """
    array = np.asanyarray(array)
    header = {
        "descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
        "fortran_order": False,
        "shape": array.shape,
    }
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, header)
        for block in _blocks(array):
            np.ascontiguousarray(block, dtype=dtype).tofile(f)


def extra_feature_file(index):
    """The file of the index-th extra feature (never a name with "pt")."""
    return f"node_feat_{index}.npy"


def label_dtype(labels, kind=None):
    """int64 classes, or float32 multi-hot rows (a multi-label loss's input)
    and values."""
    return np.int64 if label_kind(labels, kind) == "class" else np.float32


def _numpy_item(item_name, path):
    return {"name": item_name, "format": "numpy", "in_memory": True, "path": path}


def _seed_files(split):
    """The files of a split's seed nodes and their labels (a Split of
    gbrun.data.splits)."""
    return f"{split.prefix}_seed_nodes.npy", f"{split.prefix}_labels.npy"


def _node_task(num_classes, item_set):
    """The node task's entry in metadata.yaml: each split's item set, as
    item_set(seeds file, labels file) lists it."""
    task = {"name": "node_classification", "num_classes": num_classes}
    for split in TABLE:
        task[split.attribute] = [item_set(*_seed_files(split))]
    return task


def _link_files(task):
    """(split, item name, file name, int array) of each file of a link task
    (gbrun.data.links.LinkTask): "node_pairs" (E, 2) and "negative_dsts"
    (E, K), the item names dgl 2.1's MiniBatch takes (2.2-2.4 turn them
    into seeds, labels and indexes)."""
    for split in TABLE:
        pairs, negatives = links.SETS[split.name]
        yield (split, "node_pairs", f"{split.prefix}_node_pairs.npy",
               np.asarray(getattr(task, pairs)).T)
        if negatives:
            yield (split, "negative_dsts", f"{split.prefix}_negative_dsts.npy",
                   getattr(task, negatives))


def _link_metadata(task, relation=None):
    """A link task's entry in metadata.yaml (after the node task); on a
    graph of several node types, its pairs are of the edge type
    `relation` (each set's "type")."""
    entry = {"name": links.TASK_NAME, "num_negatives": int(np.shape(task.valid_negatives)[1]),
             "directed": bool(task.directed)}
    typed = {} if relation is None else {"type": relation}
    for split, item, path, _ in _link_files(task):
        entry.setdefault(split.attribute, [{**typed, "data": []}])[0]["data"].append(
            _numpy_item(item, path))
    return entry


def _refuse_leaks(found):
    """Prints every leak (each case's count and an example), then refuses
    in one line if any is refused."""
    for leak in found:
        print(f"{leak.kind}: {leak.text}", file=sys.stderr)
    refused = sum(leak.refused for leak in found)
    if refused:
        raise DatasetError(
            f"the link task gives a model its answers in {refused} way"
            f"{'s' if refused > 1 else ''} (the 'leak:' line{'s' if refused > 1 else ''} "
            "above); nothing was written")


# ------------------------------------------------------------ the writers


def write_ondisk_dataset(
    out_dir,
    edges,
    features,
    labels,
    train_idx,
    val_idx,
    test_idx,
    num_classes=None,
    name=None,
    force=False,
    input_names=None,
    extra_features=None,
    kind=None,
    inputs=(),
    edges_as_given=None,
    link_task=None,
    keep_leaked_edges=False,
):
    """Validate the arrays and write them as a GraphBolt OnDiskDataset.

    edges: int (2, E), row 0 source ids, row 1 destination ids.
    features: float (N, F); N defines the number of nodes.
    labels: int (N,), num_classes defaulting to labels.max() + 1; or
        multi-hot (N, C) of 0/1 (C classes, several per node); or, with
        kind "value", float (N,) or (N, D) targets to regress (written as
        (N, D) float32, with num_classes D).
    train_idx, val_idx, test_idx: int node ids, disjoint, train non-empty.
    input_names: optional {"edges": "my_edges.csv", ...} used in messages
        (keys: edges, features, labels, train, validation, test, and
        "feature NAME" for an extra feature).
    extra_features: optional {name: float (N, F_k)}, more node features.
    force: replace out_dir if it is a dataset written here (check_out_dir).
    inputs: paths the caller read the arrays from, which --force must
        not delete.
    edges_as_given: for edges a user gave, (self-loops dropped, edges
        deduplicated): warn of self-loops and repeated edges the options
        would remove (inputs.edge_warnings); None: no such warnings.
    link_task: a gbrun.data.links.LinkTask, written as a second task
        ("link_prediction"), refused where its answers reach the model
        (links.leaks: each case printed first, then one DatasetError);
        keep_leaked_edges: a graph that holds evaluation pairs is written
        with a warning instead.
    Returns a summary dict. Raises DatasetError; never leaves out_dir half
    written, and never touches the disk when validation fails.
    """
    graph = _OneType(edges, features, extra_features, display_names(input_names),
                     edges_as_given)
    return _write(out_dir, graph, labels, (train_idx, val_idx, test_idx), num_classes,
                  name, force, kind, inputs, link_task, keep_leaked_edges)


def write_hetero_dataset(out_dir, num_nodes, edges, labels, train_idx,
                         val_idx, test_idx, target, features=None,
                         num_classes=None, name=None, force=False, kind=None,
                         inputs=(), link_task=None, relation=None,
                         reverse=None, link_names=None, keep_leaked_edges=False):
    """Validate and write a graph of several node and edge types.

    num_nodes: {node type: count}. edges: {"src:relation:dst": int (2, E)},
        ids within each end's type. features: {node type: float (N_t, F_t)},
        the node feature "feat" of each type that has one (types without
        are left to the model, e.g. a learned embedding).
    labels, num_classes, kind and the split ids are as write_ondisk_dataset
        takes them, on the node type `target` (ids within that type).
    link_task: a gbrun.data.links.LinkTask on the edge type `relation`
        (ids within each end's type), written as a second task whose pairs
        are of that type; `reverse`, the edge type holding the relation's
        edges the other way round (typed_links.NO_REVERSE: none does), is
        written beside it ("reverse_relation"), for the trainer to take a
        batch's pairs out of both; refused where its answers leak, as
        write_ondisk_dataset refuses (gbrun.data.typed_links.leaks, through
        either relation). `link_names`: how messages name its inputs.
    Returns a summary dict, as write_ondisk_dataset does. Raises
    DatasetError with one line naming the bad input; writes nothing then,
    and never leaves out_dir half written.
    """
    graph = _SeveralTypes(num_nodes, edges, features, target, relation, reverse, link_names)
    return _write(out_dir, graph, labels, (train_idx, val_idx, test_idx), num_classes,
                  name, force, kind, inputs, link_task, keep_leaked_edges)


def _write(out_dir, graph, labels, split_ids, num_classes, name, force, kind, inputs,
           link_task, keep_leaked_edges):
    """The body of both writers, for a graph of one node type or several
    (`graph`, _OneType or _SeveralTypes: its checks, files and metadata):
    the splits, the labels and their files, the link task, the summary."""
    labels = np.asanyarray(labels)
    splits = {split.name: ids for split, ids in zip(TABLE, split_ids)}
    check_out_dir(out_dir, force, inputs)  # fail before the slow checks
    kind, num_classes = graph.check(labels, splits, num_classes, kind)
    if link_task is not None:
        _refuse_leaks(graph.leaks(link_task, keep_leaked_edges))
    if kind == "value":
        labels = labels.reshape(labels.shape[0], -1)
    warnings = graph.warnings(labels, splits[TRAIN.name], num_classes, kind)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    metadata = graph.metadata(name or os.path.basename(os.path.abspath(out_dir)), num_classes)
    if link_task is not None:
        metadata["tasks"].append(graph.link_metadata(link_task))

    def write(directory):
        for *_, path, array in (_link_files(link_task) if link_task else ()):
            save_npy(os.path.join(directory, path), array, np.int64)
        graph.write(directory)
        save_npy(os.path.join(directory, LABEL_FILE), labels, label_dtype(labels, kind))
        for split in TABLE:
            ids = np.asarray(splits[split.name], dtype=np.int64)
            seeds_file, labels_file = _seed_files(split)
            save_npy(os.path.join(directory, seeds_file), ids, np.int64)
            save_npy(os.path.join(directory, labels_file), labels[ids], label_dtype(labels, kind))
        # metadata.yaml last: a directory with it is a complete dataset.
        with open(os.path.join(directory, "metadata.yaml"), "w") as f:
            yaml.safe_dump(metadata, f, sort_keys=False)

    write_atomically(out_dir, force, write, inputs)
    return {
        "out_dir": out_dir,
        **graph.summary(),
        "num_classes": num_classes,
        "multi_hot": kind == "multi-hot",
        "label_kind": kind,
        "split_sizes": {split: int(len(ids)) for split, ids in splits.items()},
        "link_sizes": None if link_task is None else links.sizes(link_task),
        "warnings": warnings,
    }


# ------------------------------------------------------------ the graphs


class _OneType:
    """A graph of one node type, as write_ondisk_dataset takes it."""

    def __init__(self, edges, features, extra_features, names, edges_as_given):
        self.edges, self.features = np.asanyarray(edges), np.asanyarray(features)
        self.extra = {k: np.asanyarray(v) for k, v in (extra_features or {}).items()}
        self.names, self.edges_as_given = names, edges_as_given

    def check(self, labels, splits, num_classes, kind):
        """(the labels' kind, the number of classes); raises DatasetError."""
        kind = label_kind(labels, kind)
        return kind, validate_inputs(self.edges, self.features, labels, splits, num_classes,
                                     self.names, self.extra, kind)

    def leaks(self, task, keep_graph):
        num_nodes = self.features.shape[0]
        links.check(task, num_nodes, self.names)
        return links.leaks(task, self.edges, num_nodes, self.names, keep_graph)

    def warnings(self, labels, train_idx, num_classes, kind):
        warnings = find_warnings(self.edges, labels, train_idx, self.features.shape[0],
                                 num_classes, kind)
        if self.edges_as_given is not None:
            warnings += edge_warnings(self.edges, *self.edges_as_given)
        return warnings

    def metadata(self, name, num_classes):
        """metadata.yaml's content, with the node task."""

        def node_feature(feat_name, path):
            return {"domain": "node", "name": feat_name, "format": "numpy", "in_memory": True,
                    "path": path}

        task = _node_task(num_classes, lambda seeds, labels: {"data": [
            # "seed_nodes" is the item name dgl 2.1's MiniBatch expects.
            _numpy_item("seed_nodes", seeds), _numpy_item("labels", labels)]})
        return {
            "dataset_name": name,
            "graph": {
                "nodes": [{"num": int(self.features.shape[0])}],
                "edges": [{"format": "numpy", "path": EDGES_FILE}],
            },
            "feature_data": [node_feature("feat", FEAT_FILE), node_feature("label", LABEL_FILE)]
            + [node_feature(extra, extra_feature_file(k)) for k, extra in enumerate(self.extra)],
            "tasks": [task],
        }

    def link_metadata(self, task):
        return _link_metadata(task)

    def write(self, directory):
        """The graph's files: its edges and features."""
        save_npy(os.path.join(directory, EDGES_FILE), self.edges, np.int64)
        save_npy(os.path.join(directory, FEAT_FILE), self.features, np.float32)
        for k, extra in enumerate(self.extra.values()):
            save_npy(os.path.join(directory, extra_feature_file(k)), extra, np.float32)

    def summary(self):
        return {"num_nodes": int(self.features.shape[0]),
                "num_edges": int(self.edges.shape[1]),
                "feat_dim": int(self.features.shape[1]),
                "extra_features": {k: int(v.shape[1]) for k, v in self.extra.items()}}


class _SeveralTypes:
    """A graph of several node and edge types, as write_hetero_dataset
    takes it: labels and splits on the node type `target`, a link task on
    the edge type `relation` (its reverse relation `reverse`)."""

    def __init__(self, num_nodes, edges, features, target, relation, reverse, link_names):
        self.num_nodes, self.target = num_nodes, target
        self.edges = {etype: np.asanyarray(pairs) for etype, pairs in edges.items()}
        self.features = {ntype: np.asanyarray(rows) for ntype, rows in (features or {}).items()}
        self.relation, self.reverse, self.link_names = relation, reverse, link_names
        # File names: no "pt" anywhere (GraphBolt's preprocessing rewrites it).
        self.edge_files = {etype: f"edges_{k}.npy" for k, etype in enumerate(self.edges)}
        self.feature_files = {ntype: f"node_feat_{k}.npy" for k, ntype in enumerate(self.features)}

    def check(self, labels, splits, num_classes, kind):
        """(the labels' kind, the number of classes); raises DatasetError."""
        check_types(self.num_nodes, self.edges, self.features, self.target)
        kind = label_kind(labels, kind)
        target = self.target
        names = display_names({"labels": f"labels of {target}",
                               "features": f"node type {target}",
                               **{split: f"{split} ids of {target}" for split in splits}})
        num_classes = check_labels(labels, self.num_nodes[target], num_classes, names, kind)
        check_splits(splits, self.num_nodes[target], names)
        return kind, num_classes

    def leaks(self, task, keep_graph):
        typed_links.check(task, self.relation, self.reverse, self.num_nodes, list(self.edges),
                          self.link_names)
        return typed_links.leaks(task, self.relation, self.reverse, self.edges, self.num_nodes,
                                 self.link_names, keep_graph)

    def warnings(self, labels, train_idx, num_classes, kind):
        return []

    def metadata(self, name, num_classes):
        """metadata.yaml's content, with the node task."""

        def numpy_entry(**entry):
            return {**entry, "format": "numpy", "in_memory": True}

        task = _node_task(num_classes, lambda seeds, labels: {"type": self.target, "data": [
            numpy_entry(name="seed_nodes", path=seeds),
            numpy_entry(name="labels", path=labels)]})
        features = [numpy_entry(domain="node", type=ntype, name="feat", path=path)
                    for ntype, path in self.feature_files.items()]
        features.append(numpy_entry(domain="node", type=self.target, name="label",
                                    path=LABEL_FILE))
        return {
            "dataset_name": name,
            "graph": {
                "nodes": [{"type": ntype, "num": int(count)}
                          for ntype, count in self.num_nodes.items()],
                "edges": [{"type": etype, "format": "numpy", "path": path}
                          for etype, path in self.edge_files.items()],
            },
            "feature_data": features,
            "tasks": [task],
        }

    def link_metadata(self, task):
        return {**_link_metadata(task, self.relation), "reverse_relation":
                None if self.reverse == typed_links.NO_REVERSE else self.reverse}

    def write(self, directory):
        """The graph's files: each edge type's edges, each node type's
        features."""
        for etype, path in self.edge_files.items():
            save_npy(os.path.join(directory, path), self.edges[etype], np.int64)
        for ntype, path in self.feature_files.items():
            save_npy(os.path.join(directory, path), self.features[ntype], np.float32)

    def summary(self):
        return {"num_nodes": {ntype: int(count) for ntype, count in self.num_nodes.items()},
                "num_edges": {etype: int(pairs.shape[1]) for etype, pairs in self.edges.items()},
                "features": {ntype: int(rows.shape[1]) for ntype, rows in self.features.items()},
                "target": self.target}
