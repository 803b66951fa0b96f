"""The dataset writer's inputs (gbrun.data.ondisk writes them): every check
of what a user hands the converter, before anything touches the disk, each
failing with one line (DatasetError) that names the input, the problem and
an example bad value; the labels as gbrun.data.labels checks them for the
example too (a link task's in gbrun.data.links). Also the transforms the
converter offers: random splits, self-loops dropped, reverse edges added.
Only vectorised numpy is used, so 2M nodes / 20M edges check in seconds."""
import argparse

import numpy as np

from . import labels as label_checks
from .labels import BLOCK_ELEMENTS
from .labels import kind_of as labels_kind_of
from .splits import TABLE, TRAIN, VALIDATION


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


def check_id_range(ids, num_nodes, where, what, nodes_from):
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
        check_id_range(row, num_nodes, where, "edge", names["features"])


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


def label_kind(labels, kind=None):
    """What the labels are: `kind` as given, or "class" for a 1-D array and
    "multi-hot" for a 2-D one ("value" is never guessed)."""
    try:
        return labels_kind_of(labels, kind)
    except ValueError as error:
        raise DatasetError(str(error)) from None


def check_labels(labels, num_nodes, num_classes, names, kind=None):
    """Labels are N integers in [0, num_classes), a multi-hot (N, C) array
    of 0s and 1s (several labels per node), or (kind "value") N finite
    floats or rows of D (a regression target), as gbrun.data.labels checks
    them; returns C (D for values): `num_classes`, or read off the labels."""
    where = names["labels"]
    labels = np.asanyarray(labels)
    kind = label_kind(labels, kind)
    if num_classes is not None and (isinstance(num_classes, bool) or int(num_classes) != num_classes
                                    or num_classes < 1):
        raise DatasetError(f"num_classes: expected a positive integer, got {num_classes!r}")
    problem = label_checks.shape_problem(labels, kind, num_classes, classes="--num-classes")
    if problem is None and labels.shape[0] != num_nodes:
        noun = "labels" if kind == "class" else "label rows"
        problem = f"{labels.shape[0]} {noun} but {num_nodes} nodes (rows of {names['features']})"
    problem = problem or label_checks.value_problem(labels, kind, num_classes)
    if problem:
        raise DatasetError(f"{where}: {problem}")
    return int(num_classes) if num_classes is not None else label_checks.classes_of(labels, kind)


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
    """Split ids: 1-D integers, in range, no repeats, disjoint, none empty
    (the example trains on the train set, and validates and tests on the
    others: it refuses a dataset with an empty one)."""
    owner = np.zeros(num_nodes, dtype=np.int8)  # 0 = unused, k = k-th split
    for k, (split, ids) in enumerate(splits.items(), start=1):
        where = names[split]
        ids = np.asanyarray(ids)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise DatasetError(
                f"{where}: expected a 1-D integer array of node ids, got dtype {ids.dtype} shape {ids.shape}"
            )
        if split == TRAIN.name and ids.size == 0:
            raise DatasetError(f"{where}: the train set is empty")
        if ids.size == 0:
            raise DatasetError(
                f"{where}: the {split} set is empty, and the example "
                f"{'validates' if split == VALIDATION.name else 'tests'} on it "
                "(give it nodes, e.g. --split 0.6,0.2,0.2)")
        check_id_range(ids, num_nodes, where, "position", names["features"])
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
    names = {"edges": "edges", "features": "features", "labels": "labels",
             **{split.name: split.argument for split in TABLE}}
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


def edge_warnings(edges, dropped_self_loops=False, deduplicated=False):
    """One-line warnings about the edges as given: self-loops and edges
    given twice, each with its count and the converter's option that
    removes it (unless that option was used)."""
    warnings = []
    src, dst = np.asarray(edges[0]), np.asarray(edges[1])
    loops = np.flatnonzero(src == dst)
    if loops.size and not dropped_self_loops:
        warnings.append(
            f"{loops.size} self-loops (an edge from a node to itself), e.g. node "
            f"{src[loops[0]]}; --drop-self-loops removes them")
    if src.size and not deduplicated:
        span = int(max(src.max(), dst.max())) + 1
        keys = np.sort(src.astype(np.int64) * span + dst) if span < 3_000_000_000 else None
        repeated = 0 if keys is None else int((keys[1:] == keys[:-1]).sum())
        if repeated:
            first = keys[1:][keys[1:] == keys[:-1]][0]
            warnings.append(
                f"{repeated} edges given more than once, e.g. {first // span} -> "
                f"{first % span}; --add-reverse-edges keeps each directed edge once "
                "(and adds its reverse)")
    return warnings


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
            check_id_range(row, num_nodes[ntype], where, "edge", f"node type {ntype}")
    for ntype, rows in features.items():
        if ntype not in num_nodes:
            raise DatasetError(f"features of node type {ntype!r}: not one of the node types: {known}")
        check_features(rows, {"features": f"features of {ntype}"})
        if rows.shape[0] != num_nodes[ntype]:
            raise DatasetError(
                f"features of {ntype}: {rows.shape[0]} rows but node type {ntype} has "
                f"{num_nodes[ntype]} nodes")
