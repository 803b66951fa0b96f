"""Write a node-classification graph in GraphBolt's OnDiskDataset format.

This module is the only place that writes the format; `convert_to_ondisk.py`
and `make_synthetic_dataset.py` are thin command lines around it.

    write_ondisk_dataset(out_dir, edges, features, labels, train, val, test)
    |- validate_inputs      every check, before anything touches the disk
    |- find_warnings        isolated nodes, classes missing from the train set
    `- _write_atomically    temp dir next to out_dir, then rename into place

Layout written (all node ids int64, features float32, class labels int64,
multi-hot labels and values float32):

    out_dir/metadata.yaml
    out_dir/edges.npy                 shape (2, E): row 0 = src, row 1 = dst
    out_dir/node_feat.npy             shape (N, F), node feature "feat"
    out_dir/node_feat_<k>.npy         shape (N, F_k), the k-th extra feature
    out_dir/node_label.npy            shape (N,), multi-hot (N, C) or
                                      values (N, D): node feature "label"
    out_dir/{train,valid,test}_seed_nodes.npy and _labels.npy

Load it with `gb.OnDiskDataset(out_dir).load()`. GraphBolt then adds a
`preprocessed/` folder inside out_dir on first load; that is expected.

Every problem with the inputs raises DatasetError with one line that names
the input, the problem and an example bad value. Only vectorised numpy is
used, so 2M nodes / 20M edges convert in seconds.
"""

import argparse
import os
import secrets
import shutil
import sys

import numpy as np
import yaml

# GraphBolt's preprocessing rewrites paths with .replace("pt", "npy"), so no
# file name here may contain "pt".
EDGES_FILE = "edges.npy"
FEAT_FILE = "node_feat.npy"
LABEL_FILE = "node_label.npy"
SPLIT_PREFIXES = {"train": "train", "validation": "valid", "test": "test"}

# Blocks of this many elements bound the temporary memory of checks and casts.
BLOCK_ELEMENTS = 1 << 22


class DatasetError(ValueError):
    """An input cannot become a valid dataset; str(err) is one line."""


# ---------------------------------------------------------------- helpers


def split_nodes(num_nodes, fractions=(0.6, 0.2, 0.2), seed=0):
    """Randomly split range(num_nodes) into sorted (train, val, test) ids.

    Fractions that sum to less than 1 leave the remaining nodes unused.
    """
    fractions = check_fractions(fractions)
    perm = np.random.default_rng(seed).permutation(num_nodes)
    # Cumulative bounds, so fractions summing to 1 use every node exactly.
    bounds = np.floor(np.cumsum(fractions) * num_nodes + 1e-9).astype(np.int64)
    bounds = np.minimum(bounds, num_nodes)
    train, val, test = np.split(perm[: bounds[2]], bounds[:2])
    return np.sort(train), np.sort(val), np.sort(test)


def check_fractions(fractions):
    """Return three split fractions as floats, or raise DatasetError."""
    values = tuple(float(f) for f in fractions)
    if len(values) != 3:
        raise DatasetError(f"split: expected 3 fractions (train,val,test), got {len(values)}")
    if any(not np.isfinite(f) or f < 0 for f in values):
        raise DatasetError(f"split: fractions must be >= 0, got {values}")
    if sum(values) > 1 + 1e-9:
        raise DatasetError(f"split: fractions sum to {sum(values):g} > 1: {values}")
    return values


def parse_fractions(text):
    """Parse "0.6,0.2,0.2" into three checked fractions."""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise DatasetError(f"split: expected three numbers like 0.6,0.2,0.2, got {text!r}") from None
    return check_fractions(values)


def split_argument(text):
    """argparse type for the --split option of the dataset scripts."""
    try:
        return parse_fractions(text)
    except DatasetError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def drop_self_loops(edges):
    """Return the (2, E) edges without src == dst edges."""
    return edges[:, edges[0] != edges[1]]


def add_reverse_edges(edges):
    """Return edges plus their reverses, each directed edge exactly once.

    Duplicates are dropped (also ones already in the input), so a graph that
    was already symmetric is not doubled. The result is sorted by (src, dst).
    """
    src = np.asarray(edges[0], dtype=np.int64)
    dst = np.asarray(edges[1], dtype=np.int64)
    if src.size == 0:
        return np.zeros((2, 0), dtype=np.int64)
    low = int(min(src.min(), dst.min()))
    span = int(max(src.max(), dst.max())) - low + 1
    if span > 3_000_000_000:  # span**2 would overflow the int64 keys below
        return np.unique(np.concatenate([edges, edges[::-1]], axis=1), axis=1)
    # Pack each pair (u, v) into one int64 key; sorting keys in place and
    # keeping the first of each run deduplicates with no other big copy.
    keys = np.empty(2 * src.size, dtype=np.int64)
    np.multiply(src - low, span, out=keys[: src.size])
    keys[: src.size] += dst - low
    np.multiply(dst - low, span, out=keys[src.size :])
    keys[src.size :] += src - low
    keys.sort()
    keys = keys[np.concatenate([[True], keys[1:] != keys[:-1]])]
    out = np.empty((2, keys.size), dtype=np.int64)
    np.floor_divide(keys, span, out=out[0])
    np.remainder(keys, span, out=out[1])
    return out + low if low else out


# ------------------------------------------------------------- validation


def _first(mask):
    """Index of the first True in a boolean array."""
    return int(np.flatnonzero(mask)[0])


def _check_id_range(ids, num_nodes, where, what, nodes_from):
    """Raise if any id is outside [0, num_nodes); `what` names one position."""
    if ids.size == 0:
        return
    low, high = ids.min(), ids.max()
    if low >= 0 and high < num_nodes:
        return
    pos = _first((ids < 0) | (ids >= num_nodes))
    raise DatasetError(
        f"{where}: node id {ids[pos]} out of range [0, {num_nodes}) given by "
        f"the {num_nodes} rows of {nodes_from} ({what} {pos})"
    )


def check_edges(edges, num_nodes, names):
    """Edges must be an integer (2, E) array of ids below num_nodes."""
    where = names["edges"]
    edges = np.asanyarray(edges)
    if edges.ndim != 2 or edges.shape[0] != 2:
        raise DatasetError(f"{where}: expected shape (2, E) (src row, dst row), got {edges.shape}")
    if not np.issubdtype(edges.dtype, np.integer):
        raise DatasetError(f"{where}: expected integer node ids, got dtype {edges.dtype}")
    if edges.shape[1] == 0:
        raise DatasetError(f"{where}: no edges")
    for row in edges:
        _check_id_range(row, num_nodes, where, "edge", names["features"])


def check_features(features, names):
    """Features must be a finite floating point (N, F) array with N > 0."""
    where = names["features"]
    features = np.asanyarray(features)
    if features.ndim != 2 or features.shape[0] == 0 or features.shape[1] == 0:
        raise DatasetError(f"{where}: expected a 2-D array (nodes, features), got shape {features.shape}")
    if not np.issubdtype(features.dtype, np.floating):
        raise DatasetError(f"{where}: expected floating point features, got dtype {features.dtype}")
    rows = max(1, BLOCK_ELEMENTS // features.shape[1])
    for start in range(0, features.shape[0], rows):
        bad = ~np.isfinite(features[start : start + rows])
        if bad.any():
            row, col = np.argwhere(bad)[0]
            value = features[start + row, col]
            raise DatasetError(f"{where}: non-finite value {value} at row {start + row}, column {col}")


LABEL_KINDS = ("class", "multi-hot", "value")


def label_kind(labels, kind=None):
    """What the labels are: `kind` as given, or "class" for a 1-D array
    and "multi-hot" for a 2-D one ("value" is never guessed)."""
    if kind is None:
        return "multi-hot" if np.ndim(labels) == 2 else "class"
    if kind not in LABEL_KINDS:
        raise DatasetError(f"label kind {kind!r}: expected one of {', '.join(LABEL_KINDS)}")
    return kind


def check_labels(labels, num_nodes, num_classes, names, kind=None):
    """Labels are N integers in [0, num_classes), a multi-hot (N, C) array
    of 0s and 1s (several labels per node), or (kind "value") N finite
    floats or rows of D (a regression target); returns C (D for values)."""
    where = names["labels"]
    labels = np.asanyarray(labels)
    kind = label_kind(labels, kind)
    if kind == "value":
        return check_values(labels, num_nodes, num_classes, names)
    if labels.ndim == 2:
        return check_multi_hot(labels, num_nodes, num_classes, names)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise DatasetError(
            f"{where}: expected a 1-D integer array (one class per node) or a "
            f"2-D multi-hot array of 0/1, got dtype {labels.dtype} shape {labels.shape}"
        )
    if labels.shape[0] != num_nodes:
        raise DatasetError(
            f"{where}: {labels.shape[0]} labels but {num_nodes} nodes (rows of {names['features']})"
        )
    if labels.min() < 0:
        pos = _first(labels < 0)
        raise DatasetError(f"{where}: negative label {labels[pos]} (node {pos})")
    if num_classes is None:
        return int(labels.max()) + 1
    if isinstance(num_classes, bool) or int(num_classes) != num_classes or num_classes < 1:
        raise DatasetError(f"num_classes: expected a positive integer, got {num_classes!r}")
    if labels.max() >= num_classes:
        pos = _first(labels >= num_classes)
        raise DatasetError(
            f"{where}: label {labels[pos]} >= num_classes {num_classes} (node {pos})"
        )
    return int(num_classes)


def check_multi_hot(labels, num_nodes, num_classes, names):
    """A multi-hot (N, C) array: one column per class, 0 or 1; returns C."""
    where = names["labels"]
    if labels.shape[0] != num_nodes:
        raise DatasetError(
            f"{where}: {labels.shape[0]} label rows but {num_nodes} nodes (rows of {names['features']})"
        )
    if labels.shape[1] < 1 or (num_classes is not None and labels.shape[1] != num_classes):
        raise DatasetError(
            f"{where}: a multi-hot array has one column per class; got {labels.shape[1]} "
            f"columns{f' for --num-classes {num_classes}' if num_classes is not None else ''}"
        )
    rows = max(1, BLOCK_ELEMENTS // labels.shape[1])
    for start in range(0, labels.shape[0], rows):
        block = labels[start : start + rows]
        bad = (block != 0) & (block != 1)
        if bad.any():
            row, col = np.argwhere(bad)[0]
            raise DatasetError(
                f"{where}: a multi-hot array holds 0 or 1, got {block[row, col]} "
                f"at row {start + row}, column {col}"
            )
    return int(labels.shape[1])


def check_values(labels, num_nodes, num_classes, names):
    """Regression targets: (N,) or (N, D) finite floats; returns D."""
    where = names["labels"]
    if labels.ndim not in (1, 2) or not np.issubdtype(labels.dtype, np.floating):
        raise DatasetError(
            f"{where}: values to regress are a 1-D or 2-D float array, got dtype "
            f"{labels.dtype} shape {labels.shape}"
        )
    if labels.shape[0] != num_nodes:
        raise DatasetError(
            f"{where}: {labels.shape[0]} label rows but {num_nodes} nodes (rows of {names['features']})"
        )
    width = 1 if labels.ndim == 1 else labels.shape[1]
    if width < 1 or (num_classes is not None and width != num_classes):
        raise DatasetError(
            f"{where}: {width} values per node"
            f"{f' for --num-classes {num_classes}' if num_classes is not None else ''}"
        )
    flat = labels.reshape(num_nodes, width)
    rows = max(1, BLOCK_ELEMENTS // width)
    for start in range(0, num_nodes, rows):
        bad = ~np.isfinite(flat[start : start + rows])
        if bad.any():
            row, col = np.argwhere(bad)[0]
            raise DatasetError(
                f"{where}: non-finite value {flat[start + row, col]} at row {start + row}, column {col}"
            )
    return int(width)


def check_extra_features(extra_features, num_nodes, names):
    """Extra node features: names other than feat and label, each (N, F_k)."""
    for name, features in extra_features.items():
        if not name or name in ("feat", "label"):
            raise DatasetError(f"--feature {name}=...: choose a name other than feat and label")
        where = names.get(f"feature {name}", name)
        check_features(features, {"features": where})
        if features.shape[0] != num_nodes:
            raise DatasetError(
                f"{where}: {features.shape[0]} rows but {num_nodes} nodes (rows of {names['features']})"
            )


def check_splits(splits, num_nodes, names):
    """Split ids: 1-D integers, in range, no repeats, disjoint, train non-empty."""
    owner = np.zeros(num_nodes, dtype=np.int8)  # 0 = unused, k = k-th split
    for k, (split, ids) in enumerate(splits.items(), start=1):
        where = names[split]
        ids = np.asanyarray(ids)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise DatasetError(
                f"{where}: expected a 1-D integer array of node ids, got dtype {ids.dtype} shape {ids.shape}"
            )
        if split == "train" and ids.size == 0:
            raise DatasetError(f"{where}: the train set is empty")
        _check_id_range(ids, num_nodes, where, "position", names["features"])
        ids = ids.astype(np.int64, copy=False)  # bincount refuses uint64
        counts = np.bincount(ids, minlength=num_nodes)
        if counts.max(initial=0) > 1:
            node = int(counts.argmax())
            raise DatasetError(f"{where}: node {node} appears {counts[node]} times in the {split} set")
        taken = owner[ids] != 0
        if taken.any():
            node = int(ids[_first(taken)])
            other = list(splits)[owner[node] - 1]
            raise DatasetError(f"{where}: node {node} is in both the {other} and the {split} set")
        owner[ids] = k


def display_names(given=None):
    """Display name per input: a file name when the caller knows it."""
    names = {
        "edges": "edges",
        "features": "features",
        "labels": "labels",
        "train": "train_idx",
        "validation": "val_idx",
        "test": "test_idx",
    }
    names.update(given or {})
    return names


def validate_inputs(edges, features, labels, splits, num_classes, names,
                    extra_features=None, kind=None):
    """Run every check; return num_classes (given, or labels.max() + 1, or a
    multi-hot array's columns)."""
    check_features(features, names)
    num_nodes = features.shape[0]
    check_edges(edges, num_nodes, names)
    num_classes = check_labels(labels, num_nodes, num_classes, names, kind)
    check_splits(splits, num_nodes, names)
    check_extra_features(extra_features or {}, num_nodes, names)
    return num_classes


# --------------------------------------------------------------- warnings


def find_warnings(edges, labels, train_idx, num_nodes, num_classes, kind=None):
    """One-line warnings about legal but suspicious inputs."""
    warnings = []
    touched = np.zeros(num_nodes, dtype=bool)
    touched[edges[0]] = True
    touched[edges[1]] = True
    isolated = np.flatnonzero(~touched)
    if isolated.size:
        warnings.append(
            f"{isolated.size} of {num_nodes} nodes have no edges (isolated), e.g. node {isolated[0]}"
        )
    if label_kind(labels, kind) == "value":
        return warnings  # no classes to miss
    train_labels = np.asarray(labels)[train_idx]
    if train_labels.ndim == 2:  # multi-hot: the train nodes with each label
        per_class = (train_labels != 0).sum(axis=0)
    else:
        per_class = np.bincount(train_labels, minlength=num_classes)
    absent = np.flatnonzero(per_class == 0)
    if absent.size:
        shown = ", ".join(str(c) for c in absent[:10]) + (", ..." if absent.size > 10 else "")
        warnings.append(f"{absent.size} of {num_classes} classes have no train nodes: {shown}")
    return warnings


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


def _metadata(name, num_nodes, num_classes, has_splits, extra_names=()):
    """The metadata.yaml content for a homogeneous node-classification graph."""

    def numpy_item(item_name, path):
        return {"name": item_name, "format": "numpy", "in_memory": True, "path": path}

    def node_feature(feat_name, path):
        return {"domain": "node", "name": feat_name, "format": "numpy", "in_memory": True, "path": path}

    task = {"name": "node_classification", "num_classes": num_classes}
    for split in has_splits:
        prefix = SPLIT_PREFIXES[split]
        task[f"{split}_set"] = [
            {
                "data": [
                    # "seed_nodes" is the item name dgl 2.1's MiniBatch expects.
                    numpy_item("seed_nodes", f"{prefix}_seed_nodes.npy"),
                    numpy_item("labels", f"{prefix}_labels.npy"),
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


def _write_files(directory, edges, features, labels, splits, metadata,
                 extra_features, kind):
    """Write every file of the dataset into an existing empty directory."""
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


def _refuse_existing(out_dir, force):
    if os.path.lexists(out_dir) and not force:
        raise DatasetError(f"{out_dir}: already exists; use --force (force=True) to replace it")
    # --force replaces the whole directory: never the one we are standing in.
    here = os.path.realpath(os.getcwd())
    target = os.path.realpath(out_dir)
    if here == target or here.startswith(target.rstrip(os.sep) + os.sep):
        raise DatasetError(f"{out_dir}: refusing to replace the current directory or one above it")


def _make_sibling_dir(parent, prefix):
    """Create a fresh uniquely named directory; unlike mkdtemp it honours umask."""
    while True:
        path = os.path.join(parent, prefix + secrets.token_hex(4))
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue


def _write_atomically(out_dir, force, write):
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
        _refuse_existing(out_dir, force)  # again: it may have appeared meanwhile
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
    Returns a summary dict. Raises DatasetError; never leaves out_dir half
    written, and never touches the disk when validation fails.
    """
    names = display_names(input_names)
    edges, features, labels = (np.asanyarray(a) for a in (edges, features, labels))
    extra_features = {k: np.asanyarray(v) for k, v in (extra_features or {}).items()}
    splits = {"train": train_idx, "validation": val_idx, "test": test_idx}
    _refuse_existing(out_dir, force)  # fail before the slow checks
    kind = label_kind(labels, kind)
    num_classes = validate_inputs(edges, features, labels, splits, num_classes, names,
                                  extra_features, kind)
    if kind == "value":
        labels = labels.reshape(labels.shape[0], -1)
    num_nodes = features.shape[0]
    warnings = find_warnings(edges, labels, train_idx, num_nodes, num_classes, kind)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    name = name or os.path.basename(os.path.abspath(out_dir))
    metadata = _metadata(name, num_nodes, num_classes, splits, list(extra_features))
    _write_atomically(
        out_dir, force,
        lambda tmp: _write_files(tmp, edges, features, labels, splits, metadata,
                                 extra_features, kind),
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
        "warnings": warnings,
    }


# ------------------------------------------------- several node and edge types


def check_types(num_nodes, edges, features, target):
    """The types of a heterogeneous graph: node types with a count each,
    edge types "src:relation:dst" between known node types, features of
    known types with one row per node, and a target type that exists."""
    if not num_nodes:
        raise DatasetError("no node types given")
    known = ", ".join(sorted(num_nodes))
    for ntype, count in num_nodes.items():
        if not ntype or ":" in ntype:
            raise DatasetError(f"node type {ntype!r}: a name without ':'")
        if isinstance(count, bool) or int(count) != count or count < 1:
            raise DatasetError(f"node type {ntype}: expected a positive node count, got {count!r}")
    if target not in num_nodes:
        raise DatasetError(f"target node type {target!r} is not one of the node types: {known}")
    if not edges:
        raise DatasetError("no edge types given")
    for etype, pairs in edges.items():
        parts = etype.split(":")
        if len(parts) != 3 or not all(parts):
            raise DatasetError(f"edge type {etype!r}: expected SRC_TYPE:RELATION:DST_TYPE")
        for end, ntype in (("source", parts[0]), ("destination", parts[2])):
            if ntype not in num_nodes:
                raise DatasetError(
                    f"edge type {etype}: its {end} node type {ntype!r} is not one of: {known}")
        where = f"edges of {etype}"
        pairs = np.asanyarray(pairs)
        if pairs.ndim != 2 or pairs.shape[0] != 2 or pairs.shape[1] == 0:
            raise DatasetError(f"{where}: expected shape (2, E) with E > 0, got {pairs.shape}")
        if not np.issubdtype(pairs.dtype, np.integer):
            raise DatasetError(f"{where}: expected integer node ids, got dtype {pairs.dtype}")
        for row, ntype in zip(pairs, (parts[0], parts[2])):
            _check_id_range(row, num_nodes[ntype], where, "edge", f"node type {ntype}")
    for ntype, rows in features.items():
        if ntype not in num_nodes:
            raise DatasetError(f"features of node type {ntype!r}: not one of the node types: {known}")
        check_features(rows, {"features": f"features of {ntype}"})
        if rows.shape[0] != num_nodes[ntype]:
            raise DatasetError(
                f"features of {ntype}: {rows.shape[0]} rows but node type {ntype} has "
                f"{num_nodes[ntype]} nodes")


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
                         num_classes=None, name=None, force=False, kind=None):
    """Validate and write a graph of several node and edge types.

    num_nodes: {node type: count}. edges: {"src:relation:dst": int (2, E)},
        ids within each end's type. features: {node type: float (N_t, F_t)},
        the node feature "feat" of each type that has one (types without
        are left to the model, e.g. a learned embedding).
    labels, num_classes, kind and the split ids are as write_ondisk_dataset
        takes them, on the node type `target` (ids within that type).
    Raises DatasetError with one line naming the bad input; writes nothing
    then, and never leaves out_dir half written.
    """
    edges = {etype: np.asanyarray(pairs) for etype, pairs in edges.items()}
    features = {ntype: np.asanyarray(rows) for ntype, rows in (features or {}).items()}
    labels = np.asanyarray(labels)
    splits = {"train": train_idx, "validation": val_idx, "test": test_idx}
    _refuse_existing(out_dir, force)
    check_types(num_nodes, edges, features, target)
    kind = label_kind(labels, kind)
    names = display_names({"labels": f"labels of {target}",
                           "features": f"node type {target}",
                           **{split: f"{split} ids of {target}" for split in splits}})
    num_classes = check_labels(labels, num_nodes[target], num_classes, names, kind)
    check_splits(splits, num_nodes[target], names)
    if kind == "value":
        labels = labels.reshape(labels.shape[0], -1)
    # File names: no "pt" anywhere (GraphBolt's preprocessing rewrites it).
    edge_files = {etype: f"edges_{k}.npy" for k, etype in enumerate(edges)}
    feature_files = {ntype: f"node_feat_{k}.npy" for k, ntype in enumerate(features)}
    name = name or os.path.basename(os.path.abspath(out_dir))
    metadata = _hetero_metadata(name, num_nodes, edge_files, feature_files,
                                target, num_classes, splits)

    def write(directory):
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

    _write_atomically(out_dir, force, write)
    return {
        "out_dir": out_dir,
        "num_nodes": {ntype: int(count) for ntype, count in num_nodes.items()},
        "num_edges": {etype: int(pairs.shape[1]) for etype, pairs in edges.items()},
        "features": {ntype: int(rows.shape[1]) for ntype, rows in features.items()},
        "target": target,
        "num_classes": num_classes,
        "label_kind": kind,
        "split_sizes": {split: int(len(ids)) for split, ids in splits.items()},
    }
