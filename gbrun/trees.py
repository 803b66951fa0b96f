"""Nested data: dicts, lists and tuples of tensors and plain values, as a
state_dict, a checkpoint or a resume key is. One walk (walk, as
accelerate's recursively_apply) and what the run's state asks of it, each
a few lines: tensors to the CPU, plain data, a check that only such data is
held, the bytes to write, equality, and the first difference."""
import itertools

import torch

# What a checkpoint holds besides tensors (it loads with weights_only=True).
PLAIN = (bool, int, float, str, type(None))
ABSENT = object()  # where one of the trees walked together has no entry


def containers(*values):
    """Walked into by default: where every value is a dict, or every value
    a list or tuple."""
    return (all(isinstance(v, dict) for v in values)
            or all(isinstance(v, (list, tuple)) for v in values))


def walk(leaf, *trees, into=containers, absent=ABSENT, sequence=None):
    """leaf(path, *values) at each place of `trees`, walked together, and
    the results in their shape: dicts as dicts, lists and tuples as they
    are (or as `sequence`). A place is walked into where `into(*values)`,
    else it is a leaf; a dict's keys come in the first tree's order, then
    the others' (an entry a tree lacks is `absent`), a sequence's positions
    up to the longest. `path` holds the keys down to a place, a sequence's
    position as a one-item list ([2]), as it is written."""
    def visit(path, values):
        if not into(*values):
            return leaf(path, *values)
        if isinstance(values[0], dict):
            keys = dict.fromkeys(key for value in values for key in value)
            return {key: visit(path + (key,),
                               [value.get(key, absent) for value in values])
                    for key in keys}
        rows = itertools.zip_longest(*values, fillvalue=absent)
        return (sequence or type(values[0]))(
            visit(path + ([i],), row) for i, row in enumerate(rows))

    return visit((), trees)


def leaves(*trees, **options):
    """(path, *values) at each leaf of `trees` walked together (walk), in
    order."""
    found = []
    walk(lambda *leaf: found.append(leaf), *trees, **options)
    return found


def cpu_values(tree):
    """`tree` with every tensor detached and on the CPU."""
    return walk(lambda path, value: value.detach().cpu() if isinstance(
        value, torch.Tensor) else value, tree)


def plain(tree):
    """`tree` as numbers, strings, lists and dicts (tensors as lists), with
    None in place of anything else."""
    def leaf(path, value):
        if isinstance(value, torch.Tensor):
            return value.tolist()
        return value if isinstance(value, PLAIN) else None

    return walk(leaf, tree, sequence=list)


def check_plain(tree, where):
    """Refuses what a checkpoint cannot hold (`where`: what `tree` is
    called): it loads with weights_only=True, so tensors and plain data
    only."""
    for path, value in leaves(tree):
        if not isinstance(value, PLAIN + (torch.Tensor,)):
            named = where + "".join(str(key) if isinstance(key, list)
                                    else f"[{key!r}]" for key in path)
            raise TypeError(
                f"{named} is a {type(value).__name__}: a checkpoint holds "
                "tensors and plain data only (numbers, strings, lists, "
                "dicts); keep a model's state_dict(), not the model")


def payload_bytes(tree):
    """The bytes of the tensors (and arrays) in `tree`: about what saving it
    writes."""
    return sum(getattr(value, "nbytes", 0) or (
        value.numel() * value.element_size()
        if isinstance(value, torch.Tensor) else 0)
        for _, value in leaves(tree))


def same(a, b):
    """True if two trees are equal: the same keys and lengths, and tensors
    of the same shape, dtype and values."""
    def equal(x, y):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
                    and x.shape == y.shape and x.dtype == y.dtype
                    and bool(torch.equal(x, y)))
        return x == y

    return all(equal(x, y) for _, x, y in leaves(a, b))


def difference(saved, value):
    """The first place where two configurations differ, on one line: `where:
    saved then, value now` (of a model's repr, the first line that
    differs). Dicts are compared key by key (a missing key as None), lists
    of dicts (an optimizer's param_groups) group by group."""
    def into(now, then):
        return (isinstance(now, dict) and isinstance(then, dict)) or (
            isinstance(now, list) and isinstance(then, list)
            and len(now) == len(then)
            and all(isinstance(v, dict) for v in now + then))

    for path, now, then in leaves(value, saved, into=into, absent=None):
        if now != then:
            return _said(path, then, now)
    return _said((), saved, value)


def _said(path, saved, value):
    where = ""
    for key in path:
        where += str(key) if isinstance(key, list) else (
            f".{key}" if where else str(key))
    if isinstance(saved, str) and isinstance(value, str):
        # A model's repr: the first line that differs.
        for then, now in zip(saved.splitlines(), value.splitlines()):
            if then != now:
                saved, value = then.strip(), now.strip()
                break
    text = f"{where}: " * bool(where) + f"{saved!r} then, {value!r} now"
    return text if len(text) <= 160 else text[:157] + "..."
