"""A link-prediction task beside a graph's node task: the node pairs a
model learns from and those it is scored on, each against its own negative
destinations (LinkTask); checked (check, one line naming the input, as
gbrun.data.inputs does), and the evaluation pairs a graph holds found
(leak_warning) or taken out of it (without_pairs). gbrun.data.ondisk
writes it."""
import dataclasses

import numpy as np

from .inputs import DatasetError, check_edges, check_id_range

TASK_NAME = "link_prediction"
# Each set: (its LinkTask field, its negatives' field).
SETS = {"train": ("train", None),
        "validation": ("valid", "valid_negatives"),
        "test": ("test", "test_negatives")}
# How messages name the inputs where the caller gives no file names.
NAMES = {"link train": "link_train", "link validation": "link_valid",
         "link validation negatives": "link_valid_negatives",
         "link test": "link_test", "link test negatives": "link_test_negatives",
         "features": "features"}


@dataclasses.dataclass
class LinkTask:
    """`train`: the (2, E) node pairs a model learns from (row 0 sources,
    row 1 destinations, as edges); `valid` and `test`: the pairs it is
    scored on, each pair against its own row of `valid_negatives` /
    `test_negatives`, (E, K) destination ids that make negatives with the
    pair's source."""

    train: np.ndarray
    valid: np.ndarray
    valid_negatives: np.ndarray
    test: np.ndarray
    test_negatives: np.ndarray


def _keys(pairs, num_nodes):
    return np.asarray(pairs[0], dtype=np.int64) * num_nodes + pairs[1]


def pairs_held(pairs, edges, num_nodes, either_way=True):
    """Per pair of `pairs` (2, P): whether `edges` (2, E) holds it, or,
    `either_way`, its reverse (a graph with reverse edges holds both)."""
    keys = np.unique(_keys(edges, num_nodes))
    held = np.isin(_keys(pairs, num_nodes), keys)
    if either_way:
        held |= np.isin(_keys(pairs[::-1], num_nodes), keys)
    return held


def without_pairs(edges, pairs, num_nodes):
    """`edges` without every edge that joins a pair of `pairs`, either way
    round: the graph a model may sample when it is scored on `pairs`."""
    return edges[:, ~pairs_held(edges, pairs, num_nodes)]


def check(task, num_nodes, names=None):
    """Pairs are checked as edges are; each evaluation set's negatives are
    integer ids in range, one row per pair, as many per pair in both sets
    (so that their MRRs compare); no evaluation pair is also a train pair
    (a model scored on what it trained on). Raises DatasetError."""
    names = {**NAMES, **(names or {})}
    sets = {split: getattr(task, field) for split, (field, _) in SETS.items()}
    for split, pairs in sets.items():
        check_edges(pairs, num_nodes, {"edges": names[f"link {split}"],
                                       "features": names["features"]})
    widths = {}
    for split in ("validation", "test"):
        where = names[f"link {split} negatives"]
        negatives = np.asanyarray(getattr(task, SETS[split][1]))
        pairs = sets[split].shape[1]
        if negatives.ndim != 2 or negatives.shape[0] != pairs or negatives.shape[1] == 0:
            raise DatasetError(
                f"{where}: expected shape ({pairs}, K), a row of K > 0 negative destinations "
                f"for each pair of {names[f'link {split}']}, got {negatives.shape}")
        if not np.issubdtype(negatives.dtype, np.integer):
            raise DatasetError(f"{where}: expected integer node ids, got dtype {negatives.dtype}")
        check_id_range(negatives.ravel(), num_nodes, where, "entry", names["features"])
        widths[where] = negatives.shape[1]
    if len(set(widths.values())) > 1:
        (first, k1), (second, k2) = widths.items()
        raise DatasetError(f"{first} and {second}: {k1} and {k2} negatives per pair; "
                           "give both the same number, so that their MRRs compare")
    # Both sets against the train pairs in one pass (they may be every edge).
    evaluated = np.concatenate([sets["validation"], sets["test"]], axis=1)
    trained = np.split(pairs_held(evaluated, sets["train"], num_nodes, either_way=False),
                       [sets["validation"].shape[1]])
    for split, found in zip(("validation", "test"), trained):
        if found.any():
            i = int(np.flatnonzero(found)[0])
            raise DatasetError(
                f"{names[f'link {split}']}: the pair {sets[split][0][i]} -> "
                f"{sets[split][1][i]} (pair {i}) is also in {names['link train']}: "
                f"{int(found.sum())} {split} pairs would be scored after training on them")


def leak_warning(task, edges, num_nodes):
    """A warning where the graph holds validation or test pairs (either way
    round): a model that samples them reads the answer. None otherwise."""
    pairs = np.concatenate([task.valid, task.test], axis=1)
    held = int(pairs_held(pairs, edges, num_nodes).sum())
    if not held:
        return None
    return (f"the graph holds {held} of the {pairs.shape[1]} validation and test "
            "pairs (either way round), so a model that samples them reads the answer; "
            "--drop-leaked-edges writes the graph without them")


def sizes(task):
    """{set: its number of pairs}."""
    return {split: int(np.shape(getattr(task, field))[1])
            for split, (field, _) in SETS.items()}
