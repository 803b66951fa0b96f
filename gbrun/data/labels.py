"""What a node's label is, and the one check of an array of labels: the
example's dataset checks (gbrun.data.datasets) and the dataset writer
(gbrun.data.inputs) both ask it, so that what the converter writes is what
the example trains on. numpy only (a torch tensor is read as an array), in
blocks, so that it checks labels of millions of nodes in little memory.

    "class"      one integer class in [0, num_classes) per node
    "multi-hot"  num_classes entries of 0 or 1 per node (several labels)
    "value"      num_classes finite floats per node (regression; one value
                 may be a 1-D array)
"""
import numpy as np

KINDS = ("class", "multi-hot", "value")
# Blocks of this many elements bound the temporary memory of a check.
BLOCK_ELEMENTS = 1 << 22


def kind_of(labels, kind=None):
    """`kind` as given, or where None guessed from the array: "class" for a
    1-D array, "multi-hot" for a 2-D one ("value" is never guessed)."""
    if kind is None:
        return "multi-hot" if np.ndim(labels) == 2 else "class"
    if kind not in KINDS:
        raise ValueError(
            f"label kind {kind!r}: expected one of {', '.join(KINDS)}")
    return kind


def expected(kind, num_classes):
    """What labels of `kind` are, in words."""
    return {
        "class": f"one integer class in [0, {num_classes}) per node",
        "multi-hot": f"{num_classes} entries of 0 or 1 per node (multi-hot)",
        "value": f"{num_classes} float value(s) per node (num_classes)",
    }[kind]


def width(labels):
    """Values per node: 1 for a 1-D array, else its columns."""
    labels = np.asarray(labels)
    return 1 if labels.ndim == 1 else labels.shape[1]


def shape_problem(labels, kind, num_classes=None, classes="num_classes"):
    """What is wrong with the shape or dtype of `labels` as labels of
    `kind` (one line), or None. `num_classes` (None: any) is checked
    against the columns of multi-hot rows and the width of values;
    `classes`: what the message calls it."""
    labels = np.asarray(labels)
    for_classes = "" if num_classes is None else f" for {classes} {num_classes}"
    if kind == "class":
        if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
            return ("expected a 1-D integer array (one class per node) or a "
                    "2-D multi-hot array of 0/1, got dtype "
                    f"{labels.dtype} shape {labels.shape}")
    elif kind == "multi-hot":
        if labels.ndim != 2:
            return ("a multi-hot array has a row of 0/1 per node, got shape "
                    f"{labels.shape}")
        if labels.shape[1] < 1 or (num_classes is not None
                                   and labels.shape[1] != num_classes):
            return ("a multi-hot array has one column per class; got "
                    f"{labels.shape[1]} columns{for_classes}")
    elif kind == "value":
        if labels.ndim not in (1, 2) or not np.issubdtype(labels.dtype,
                                                          np.floating):
            return ("values to regress are a 1-D or 2-D float array, got "
                    f"dtype {labels.dtype} shape {labels.shape}")
        if width(labels) < 1 or (num_classes is not None
                                 and width(labels) != num_classes):
            return f"{width(labels)} values per node{for_classes}"
    else:
        kind_of(labels, kind)  # raises, naming the kinds
    return None


def value_problem(labels, kind, num_classes=None):
    """What is wrong with the values of `labels` (whose shape_problem is
    None) as labels of `kind`, naming the first bad one (one line), or
    None: a class below 0 or at least `num_classes` (where given), a
    multi-hot entry other than 0 or 1, a value that is not finite."""
    labels = np.asarray(labels)
    if labels.size == 0:
        return None
    if kind == "class":
        if labels.min() < 0:
            node = _first(labels < 0)
            return f"negative label {labels[node]} (node {node})"
        if num_classes is not None and labels.max() >= num_classes:
            node = _first(labels >= num_classes)
            return (f"label {labels[node]} >= num_classes {num_classes} "
                    f"(node {node})")
        return None
    rows = labels.reshape(labels.shape[0], -1)
    if kind == "multi-hot":
        bad, what = lambda block: (block != 0) & (block != 1), (
            "a multi-hot array holds 0 or 1, got")
    else:
        bad, what = lambda block: ~np.isfinite(block), "non-finite value"
    step = max(1, BLOCK_ELEMENTS // rows.shape[1])
    for start in range(0, rows.shape[0], step):
        block = rows[start:start + step]
        found = bad(block)
        if found.any():
            row, col = np.argwhere(found)[0]
            return (f"{what} {block[row, col]} at row {start + row}, "
                    f"column {col}")
    return None


def classes_of(labels, kind):
    """The number of classes that `labels` (checked) show: the largest
    class + 1, a multi-hot array's columns, the values' width."""
    if kind == "class":
        return int(np.asarray(labels).max()) + 1
    return int(width(labels))


def _first(mask):
    """Index of the first True in a boolean array."""
    return int(np.flatnonzero(mask)[0])
