"""Write a node-classification graph in GraphBolt's OnDiskDataset format.

This module is the only place that writes the format; `convert_to_ondisk.py`
and `make_synthetic_dataset.py` are thin command lines around it.

    write_ondisk_dataset(out_dir, edges, features, labels, train, val, test)
    |- validate_inputs      every check, before anything touches the disk
    |                       (gbrun.data.inputs)
    |- find_warnings        isolated nodes, classes missing from the train set
    `- _write_atomically    temp dir next to out_dir, then rename into place
    write_hetero_dataset    the same for a graph of several node types

Layout written (all node ids int64, features float32, class labels int64,
multi-hot labels and values float32):

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

Load it with gbrun.data.datasets.load_dataset(out_dir) (GraphBolt's own
`gb.OnDiskDataset(out_dir).load()` would add a `preprocessed/` folder
inside out_dir, which --force then refuses to remove).

Every problem with the inputs raises gbrun.data.inputs.DatasetError with
one line that names the input, the problem and an example bad value.
"""

import hashlib
import json
import os
import re
import secrets
import shutil
import sys

import numpy as np
import yaml

from . import links, typed_links
from .inputs import (
    BLOCK_ELEMENTS, DatasetError, check_labels, check_splits, check_types,
    display_names, edge_warnings, find_warnings, label_kind, validate_inputs,
)

# GraphBolt's preprocessing rewrites paths with .replace("pt", "npy"), so no
# file name here may contain "pt".
EDGES_FILE = "edges.npy"
FEAT_FILE = "node_feat.npy"
LABEL_FILE = "node_label.npy"
SPLIT_PREFIXES = {"train": "train", "validation": "valid", "test": "test"}


# ---------------------------------------------------------------- writing


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


def _metadata(name, num_nodes, num_classes, has_splits, extra_names=()):
    """The metadata.yaml content for a homogeneous node-classification graph."""

    def node_feature(feat_name, path):
        return {"domain": "node", "name": feat_name, "format": "numpy", "in_memory": True, "path": path}

    task = {"name": "node_classification", "num_classes": num_classes}
    for split in has_splits:
        prefix = SPLIT_PREFIXES[split]
        task[f"{split}_set"] = [
            {
                "data": [
                    # "seed_nodes" is the item name dgl 2.1's MiniBatch expects.
                    _numpy_item("seed_nodes", f"{prefix}_seed_nodes.npy"),
                    _numpy_item("labels", f"{prefix}_labels.npy"),
                ]
            }
        ]
    return {
        "dataset_name": name,
        "graph": {
            "nodes": [{"num": int(num_nodes)}],
            "edges": [{"format": "numpy", "path": EDGES_FILE}],
        },
        "feature_data": [node_feature("feat", FEAT_FILE), node_feature("label", LABEL_FILE)]
        + [node_feature(extra, extra_feature_file(k)) for k, extra in enumerate(extra_names)],
        "tasks": [task],
    }


def _link_files(task):
    """(set, item name, file name, int array) of each file of a link task
    (gbrun.data.links.LinkTask): "node_pairs" (E, 2) and "negative_dsts"
    (E, K), the item names dgl 2.1's MiniBatch takes (2.2-2.4 turn them
    into seeds, labels and indexes)."""
    for split, (pairs, negatives) in links.SETS.items():
        prefix = SPLIT_PREFIXES[split]
        yield split, "node_pairs", f"{prefix}_node_pairs.npy", np.asarray(getattr(task, pairs)).T
        if negatives:
            yield split, "negative_dsts", f"{prefix}_negative_dsts.npy", getattr(task, negatives)


def _link_metadata(task, relation=None):
    """A link task's entry in metadata.yaml (after the node task); on a
    graph of several node types, its pairs are of the edge type
    `relation` (each set's "type")."""
    entry = {"name": links.TASK_NAME, "num_negatives": int(np.shape(task.valid_negatives)[1]),
             "directed": bool(task.directed)}
    typed = {} if relation is None else {"type": relation}
    for split, item, path, _ in _link_files(task):
        entry.setdefault(f"{split}_set", [{**typed, "data": []}])[0]["data"].append(
            _numpy_item(item, path))
    return entry


def _write_files(directory, edges, features, labels, splits, metadata,
                 extra_features, kind, link_task=None):
    """Write every file of the dataset into an existing empty directory."""
    for *_, path, array in (_link_files(link_task) if link_task else ()):
        save_npy(os.path.join(directory, path), array, np.int64)
    save_npy(os.path.join(directory, EDGES_FILE), edges, np.int64)
    save_npy(os.path.join(directory, FEAT_FILE), features, np.float32)
    save_npy(os.path.join(directory, LABEL_FILE), labels, label_dtype(labels, kind))
    for k, extra in enumerate(extra_features.values()):
        save_npy(os.path.join(directory, extra_feature_file(k)), extra, np.float32)
    for split, ids in splits.items():
        prefix = SPLIT_PREFIXES[split]
        ids = np.asarray(ids, dtype=np.int64)
        save_npy(os.path.join(directory, f"{prefix}_seed_nodes.npy"), ids, np.int64)
        save_npy(os.path.join(directory, f"{prefix}_labels.npy"), np.asarray(labels)[ids],
                 label_dtype(labels, kind))
    # metadata.yaml last: a directory with it is a complete dataset.
    with open(os.path.join(directory, "metadata.yaml"), "w") as f:
        yaml.safe_dump(metadata, f, sort_keys=False)


# Beside a dataset this module wrote: {file: "size:sha256"} of every file
# it wrote there. --force replaces a directory only if it holds just those
# files with those bytes.
MANIFEST = "gbrun-written.json"


def check_out_dir(out_dir, force, inputs=()):
    """Refuses (DatasetError) to write `out_dir` where it exists, unless
    `force` and it is a dataset this module wrote, unchanged (its MANIFEST
    names every file it holds, with their sizes and hashes; nothing else
    there), none of them `inputs` (paths the caller reads), and neither
    the home directory, a mount point of any kind, nor the current
    directory or one above it."""
    if not os.path.lexists(out_dir):
        return
    if not force:
        raise DatasetError(f"{out_dir}: already exists; use --force to replace it")
    target = os.path.realpath(out_dir)
    here = os.path.realpath(os.getcwd())
    if here == target or here.startswith(target.rstrip(os.sep) + os.sep):
        raise DatasetError(f"{out_dir}: refusing to replace the current directory or one above it")
    refuse = None
    if target == os.path.realpath(os.path.expanduser("~")):
        refuse = "it is the home directory"
    elif os.path.islink(out_dir) or not os.path.isdir(out_dir):
        refuse = "it is not a directory"
    elif _is_mount_point(target):
        refuse = "it is a mount point"
    else:
        refuse = _not_as_written(target)
        inside = [path for path in inputs if os.path.realpath(path).startswith(target + os.sep)]
        if refuse is None and inside:
            refuse = f"it holds this command's input {inside[0]}"
    if refuse:
        raise DatasetError(f"{out_dir}: --force replaces only a dataset this project wrote, "
                           f"and {refuse}; nothing was removed")


def _is_mount_point(path):
    """Whether `path` is a mount point: of another file system (st_dev), or
    a bind mount of the same one (listed in the mount table)."""
    if os.path.ismount(path):
        return True
    try:
        with open("/proc/self/mountinfo") as table:
            points = {line.split()[4] for line in table}
    except OSError:
        return False
    # The table escapes spaces and the like as octal (\040).
    return any(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), point) == path
               for point in points)


def _not_as_written(target):
    """Why `target` is not a dataset this module wrote, unchanged since
    (None where it is)."""
    try:
        with open(os.path.join(target, MANIFEST)) as f:
            written = json.load(f)
    except FileNotFoundError:
        return (f"it holds no {MANIFEST}, the record of what gbrun wrote there"
                " (remove it yourself if it is yours to remove)")
    except (OSError, ValueError) as error:
        return f"its {MANIFEST} cannot be read ({error})"
    others = sorted(set(os.listdir(target)) - set(written) - {MANIFEST})
    if others:
        shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
        return f"it holds files this script does not write ({shown})"
    for name, recorded in sorted(written.items()):
        path = os.path.join(target, name)
        if not os.path.isfile(path) or os.path.islink(path):
            return f"{name} is not the regular file gbrun wrote"
        if _size_and_digest(path) != recorded:
            return f"{name} changed since gbrun wrote it"
    return None


def _size_and_digest(path):
    with open(path, "rb") as f:
        return f"{os.fstat(f.fileno()).st_size}:{hashlib.file_digest(f, 'sha256').hexdigest()}"


def _write_manifest(directory):
    """Records every file in `directory` (what a writer just wrote)."""
    written = {name: _size_and_digest(os.path.join(directory, name))
               for name in sorted(os.listdir(directory))}
    with open(os.path.join(directory, MANIFEST), "x") as f:
        json.dump(written, f, indent=1, sort_keys=True)


def _make_sibling_dir(parent, prefix):
    """Create a fresh uniquely named directory; unlike mkdtemp it honours umask."""
    while True:
        path = os.path.join(parent, prefix + secrets.token_hex(4))
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue


def _write_atomically(out_dir, force, write, inputs=()):
    """Call write(tmp_dir), then move tmp_dir to out_dir in one rename.

    The temp dir sits next to out_dir (same file system, so rename is
    atomic). An old out_dir is renamed away first and deleted only after the
    new one is in place; on any failure (KeyboardInterrupt included) the old
    one is put back.
    """
    out_dir = os.path.abspath(out_dir)
    parent, base = os.path.split(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp_dir = _make_sibling_dir(parent, f".{base}.tmp-")
    old_dir = None
    try:
        write(tmp_dir)
        _write_manifest(tmp_dir)
        check_out_dir(out_dir, force, inputs)  # again: it may have appeared meanwhile
        if os.path.lexists(out_dir):
            old_dir = _make_sibling_dir(parent, f".{base}.old-")
            os.rename(out_dir, os.path.join(old_dir, base))
        try:
            os.rename(tmp_dir, out_dir)
        except OSError as err:
            raise DatasetError(f"{out_dir}: cannot move the new dataset into place: {err}") from None
    finally:
        # Not in place (rename failed or interrupted): put the old one back.
        # If that fails too, old_dir is kept rather than deleted.
        if old_dir is not None and not os.path.lexists(out_dir):
            moved = os.path.join(old_dir, base)
            if os.path.lexists(moved):
                os.rename(moved, out_dir)
        shutil.rmtree(tmp_dir, ignore_errors=True)
        if old_dir is not None:
            shutil.rmtree(old_dir, ignore_errors=True)


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
    names = display_names(input_names)
    edges, features, labels = (np.asanyarray(a) for a in (edges, features, labels))
    extra_features = {k: np.asanyarray(v) for k, v in (extra_features or {}).items()}
    splits = {"train": train_idx, "validation": val_idx, "test": test_idx}
    check_out_dir(out_dir, force, inputs)  # fail before the slow checks
    kind = label_kind(labels, kind)
    num_classes = validate_inputs(edges, features, labels, splits, num_classes, names,
                                  extra_features, kind)
    if kind == "value":
        labels = labels.reshape(labels.shape[0], -1)
    num_nodes = features.shape[0]
    if link_task is not None:
        links.check(link_task, num_nodes, names)
        _refuse_leaks(links.leaks(link_task, edges, num_nodes, names, keep_leaked_edges))
    warnings = find_warnings(edges, labels, train_idx, num_nodes, num_classes, kind)
    if edges_as_given is not None:
        warnings += edge_warnings(edges, *edges_as_given)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    name = name or os.path.basename(os.path.abspath(out_dir))
    metadata = _metadata(name, num_nodes, num_classes, splits, list(extra_features))
    if link_task is not None:
        metadata["tasks"].append(_link_metadata(link_task))
    _write_atomically(
        out_dir, force,
        lambda tmp: _write_files(tmp, edges, features, labels, splits, metadata,
                                 extra_features, kind, link_task), inputs=inputs,
    )
    return {
        "out_dir": out_dir,
        "num_nodes": int(num_nodes),
        "num_edges": int(edges.shape[1]),
        "feat_dim": int(features.shape[1]),
        "num_classes": num_classes,
        "multi_hot": kind == "multi-hot",
        "label_kind": kind,
        "extra_features": {k: int(v.shape[1]) for k, v in extra_features.items()},
        "split_sizes": {split: int(len(ids)) for split, ids in splits.items()},
        "link_sizes": None if link_task is None else links.sizes(link_task),
        "warnings": warnings,
    }


# ------------------------------------------------- several node and edge types


def _hetero_metadata(name, num_nodes, edge_files, feature_files, target,
                     num_classes, has_splits):
    def numpy_entry(**entry):
        return {**entry, "format": "numpy", "in_memory": True}

    task = {"name": "node_classification", "num_classes": num_classes}
    for split in has_splits:
        prefix = SPLIT_PREFIXES[split]
        task[f"{split}_set"] = [{"type": target, "data": [
            numpy_entry(name="seed_nodes", path=f"{prefix}_seed_nodes.npy"),
            numpy_entry(name="labels", path=f"{prefix}_labels.npy"),
        ]}]
    features = [numpy_entry(domain="node", type=ntype, name="feat", path=path)
                for ntype, path in feature_files.items()]
    features.append(numpy_entry(domain="node", type=target, name="label",
                                path=LABEL_FILE))
    return {
        "dataset_name": name,
        "graph": {
            "nodes": [{"type": ntype, "num": int(count)}
                      for ntype, count in num_nodes.items()],
            "edges": [{"type": etype, "format": "numpy", "path": path}
                      for etype, path in edge_files.items()],
        },
        "feature_data": features,
        "tasks": [task],
    }


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
    Raises DatasetError with one line naming the bad input; writes nothing
    then, and never leaves out_dir half written.
    """
    edges = {etype: np.asanyarray(pairs) for etype, pairs in edges.items()}
    features = {ntype: np.asanyarray(rows) for ntype, rows in (features or {}).items()}
    labels = np.asanyarray(labels)
    splits = {"train": train_idx, "validation": val_idx, "test": test_idx}
    check_out_dir(out_dir, force, inputs)
    check_types(num_nodes, edges, features, target)
    kind = label_kind(labels, kind)
    names = display_names({"labels": f"labels of {target}",
                           "features": f"node type {target}",
                           **{split: f"{split} ids of {target}" for split in splits}})
    num_classes = check_labels(labels, num_nodes[target], num_classes, names, kind)
    check_splits(splits, num_nodes[target], names)
    if link_task is not None:
        typed_links.check(link_task, relation, reverse, num_nodes, list(edges), link_names)
        _refuse_leaks(typed_links.leaks(link_task, relation, reverse, edges, num_nodes,
                                        link_names, keep_leaked_edges))
    if kind == "value":
        labels = labels.reshape(labels.shape[0], -1)
    # File names: no "pt" anywhere (GraphBolt's preprocessing rewrites it).
    edge_files = {etype: f"edges_{k}.npy" for k, etype in enumerate(edges)}
    feature_files = {ntype: f"node_feat_{k}.npy" for k, ntype in enumerate(features)}
    name = name or os.path.basename(os.path.abspath(out_dir))
    metadata = _hetero_metadata(name, num_nodes, edge_files, feature_files,
                                target, num_classes, splits)
    if link_task is not None:
        metadata["tasks"].append({**_link_metadata(link_task, relation), "reverse_relation":
                                  None if reverse == typed_links.NO_REVERSE else reverse})

    def write(directory):
        for *_, path, array in (_link_files(link_task) if link_task else ()):
            save_npy(os.path.join(directory, path), array, np.int64)
        for etype, path in edge_files.items():
            save_npy(os.path.join(directory, path), edges[etype], np.int64)
        for ntype, path in feature_files.items():
            save_npy(os.path.join(directory, path), features[ntype], np.float32)
        save_npy(os.path.join(directory, LABEL_FILE), labels, label_dtype(labels, kind))
        for split, ids in splits.items():
            prefix = SPLIT_PREFIXES[split]
            ids = np.asarray(ids, dtype=np.int64)
            save_npy(os.path.join(directory, f"{prefix}_seed_nodes.npy"), ids, np.int64)
            save_npy(os.path.join(directory, f"{prefix}_labels.npy"), labels[ids],
                     label_dtype(labels, kind))
        with open(os.path.join(directory, "metadata.yaml"), "w") as f:
            yaml.safe_dump(metadata, f, sort_keys=False)

    _write_atomically(out_dir, force, write, inputs)
    return {
        "out_dir": out_dir,
        "num_nodes": {ntype: int(count) for ntype, count in num_nodes.items()},
        "num_edges": {etype: int(pairs.shape[1]) for etype, pairs in edges.items()},
        "features": {ntype: int(rows.shape[1]) for ntype, rows in features.items()},
        "target": target,
        "num_classes": num_classes,
        "label_kind": kind,
        "split_sizes": {split: int(len(ids)) for split, ids in splits.items()},
        "link_sizes": None if link_task is None else links.sizes(link_task),
    }
