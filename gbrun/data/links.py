"""A link-prediction task beside a graph's node task: the node pairs a
model learns from and those it is scored on, each against its own negative
destinations (LinkTask). Checked (check, one line naming the input, as
gbrun.data.inputs does); every way its answers reach the model found in one
pass (leaks), or taken out (drop_leaked); a split of a plain edge list made
(split). gbrun.data.ondisk writes it.

A pair is undirected unless the task is `directed`: then (u, v) and (v, u)
are two facts, and only the pair itself is an answer (counts_either_way)."""
import dataclasses

import numpy as np

from .inputs import DatasetError, check_edges, check_id_range
from .splits import EVALUATED, TABLE, TEST, VALIDATION

TASK_NAME = "link_prediction"
# Each set: (its LinkTask field, named as its files are; its negatives'
# field, for the sets a model is scored on).
SETS = {split.name: (split.prefix, f"{split.prefix}_negatives" if split in EVALUATED else None)
        for split in TABLE}
# How messages name the inputs where the caller gives no file names.
NAMES = {"link train": "link_train", "link validation": "link_valid",
         "link validation negatives": "link_valid_negatives",
         "link test": "link_test", "link test negatives": "link_test_negatives",
         "features": "features"}
DROP = "--drop-leaked-edges"


@dataclasses.dataclass
class LinkTask:
    """`train`: the (2, E) node pairs a model learns from (row 0 sources,
    row 1 destinations, as edges); `valid` and `test`: the pairs it is
    scored on, each pair against its own row of `valid_negatives` /
    `test_negatives`, (E, K) destination ids that make negatives with the
    pair's source. `directed`: each direction of a pair is its own fact."""

    train: np.ndarray
    valid: np.ndarray
    valid_negatives: np.ndarray
    test: np.ndarray
    test_negatives: np.ndarray
    directed: bool = False

    def evaluated(self):
        """The validation then the test pairs, (2, V + T)."""
        return np.concatenate([self.valid, self.test], axis=1)


def counts_either_way(directed=False, two_types=False):
    """Whether a pair (u, v) also counts as (v, u), in every check and cut
    of pairs: unless the task is `directed` (each direction its own fact)
    or the pairs join `two_types` of node (none is another's reverse)."""
    return not directed and not two_types


def _keys(pairs, num_nodes, directed=True):
    """One int64 per pair; undirected, (u, v) and (v, u) share theirs."""
    u, v = (np.asarray(row, dtype=np.int64) for row in pairs)
    if not directed:
        u, v = np.minimum(u, v), np.maximum(u, v)
    return u * num_nodes + v


def pairs_held(pairs, edges, num_nodes, either_way=True):
    """Per pair of `pairs` (2, P): whether `edges` (2, E) holds it, or,
    `either_way`, its reverse (a graph with reverse edges holds both)."""
    keys = np.unique(_keys(edges, num_nodes))
    held = np.isin(_keys(pairs, num_nodes), keys)
    if either_way:
        held |= np.isin(_keys(pairs[::-1], num_nodes), keys)
    return held


def without_pairs(edges, pairs, num_nodes, either_way=True):
    """`edges` without every edge that joins a pair of `pairs` (either way
    round, unless not `either_way`): what a model may see when it is scored
    on `pairs`."""
    return edges[:, ~pairs_held(edges, pairs, num_nodes, either_way)]


def drop_leaked(edges, task, num_nodes):
    """(edges, task) without the evaluation pairs, either way round unless
    the task is directed, in the graph's edges and in the train pairs:
    what --drop-leaked-edges does. Also returns how many of each it took."""
    either_way = counts_either_way(task.directed)
    evaluated = task.evaluated()
    graph = without_pairs(edges, evaluated, num_nodes, either_way)
    train = without_pairs(task.train, evaluated, num_nodes, either_way)
    dropped = (edges.shape[1] - graph.shape[1], task.train.shape[1] - train.shape[1])
    return graph, dataclasses.replace(task, train=train), dropped


def check(task, num_nodes, names=None):
    """Pairs are checked as edges are; each evaluation set's negatives are
    integer ids in range, one row per pair, as many per pair in both sets
    (so that their MRRs compare). Raises DatasetError. What leaks is
    leaks()'s to find."""
    names = {**NAMES, **(names or {})}
    for split, (field, _) in SETS.items():
        check_edges(getattr(task, field), num_nodes,
                    {"edges": names[f"link {split}"], "features": names["features"]})
    widths = {}
    for split in (VALIDATION.name, TEST.name):
        where = names[f"link {split} negatives"]
        negatives = np.asanyarray(getattr(task, SETS[split][1]))
        pairs = np.shape(getattr(task, SETS[split][0]))[1]
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


@dataclasses.dataclass
class Leak:
    """One way a task's answers reach the model: `text` says how many
    pairs, an example and what to do; `kind` is "leak" (refused),
    "warning" (kept, as asked) or "note"."""

    kind: str
    text: str

    @property
    def refused(self):
        return self.kind == "leak"


class _Evaluated:
    """The validation and test pairs, for naming one in a message."""

    def __init__(self, task, names):
        self.pairs = task.evaluated()
        self.num_valid = task.valid.shape[1]
        self.names = names

    def name(self, i):
        split, j = (VALIDATION.name, i) if i < self.num_valid else (TEST.name, i - self.num_valid)
        u, v = self.pairs[:, i]
        return f"{split} pair {j} ({u} -> {v}, in {self.names[f'link {split}']})"

    def count(self, found, how=""):
        """'N validation and M test pairs{how}, e.g. <the first>'."""
        valid = int(found[:self.num_valid].sum())
        return (f"{valid} validation and {int(found.sum()) - valid} test pairs{how}, e.g. "
                f"{self.name(int(np.flatnonzero(found)[0]))}")


def leaks(task, edges, num_nodes, names=None, keep_graph=False, one_way=False):
    """Every way the evaluation pairs reach a model, in one pass, a Leak per
    case found (refused first):
    - the graph holds an evaluation pair (either way round): evaluation
      embeds every node over full neighbourhoods and so reads it; refused
      unless `keep_graph` (a published protocol's graph);
    - the train pairs hold an evaluation pair or its reverse (the score
      of a pair is symmetric, so the model learns the answer);
    - a pair in both the validation and the test set, or twice in one;
    - a negative that is a real edge: said, kept (as OGB's are).
    A directed task counts only the pair itself as its answer; the graph's
    and train pairs' reverses are then said, not refused. `one_way`: the
    pairs join two node types (gbrun.data.typed_links), so no pair has a
    reverse among them (the task is read as directed)."""
    names = {**NAMES, **(names or {})}
    task = dataclasses.replace(task, directed=True) if one_way else task
    found = []
    evaluated = _Evaluated(task, names)
    directed = task.directed
    reverse = "" if directed else " (either way round)"

    graph_holds = pairs_held(evaluated.pairs, edges, num_nodes,
                             either_way=counts_either_way(directed))
    if graph_holds.any():
        found.append(Leak("warning" if keep_graph else "leak", (
            f"the graph holds {evaluated.count(graph_holds, reverse)}: evaluation embeds "
            "every node over full neighbourhoods, so it reads the answer; "
            + ("kept, as --keep-leaked-edges asks" if keep_graph else
               f"{DROP} takes them out of the graph, --keep-leaked-edges keeps them "
               "(to reproduce a published protocol)"))))
    trained = pairs_held(evaluated.pairs, task.train, num_nodes, either_way=False)
    if trained.any():
        found.append(Leak("leak", (
            f"{names['link train']} holds {evaluated.count(trained)}: they would be "
            f"scored after training on them; {DROP} takes them out of the train pairs")))
    trained_reversed = pairs_held(evaluated.pairs[::-1], task.train, num_nodes,
                                  either_way=False) & ~trained
    if trained_reversed.any() and not one_way:
        what = (f"{names['link train']} holds the reverse of "
                f"{evaluated.count(trained_reversed)}")
        found.append(Leak("warning" if directed else "leak", (
            f"{what}: each direction is its own fact (--directed)" if directed else
            f"{what}: a pair's score reads both ends alike, so the model trains on the "
            f"answer; {DROP} takes them out of the train pairs, --directed keeps them where "
            "each direction is its own fact (then only a batch's own pairs leave its "
            "neighbourhoods)")))
    repeated = _repeated(evaluated.pairs, num_nodes, directed)
    if repeated.any():
        found.append(Leak("leak", (
            f"{evaluated.count(repeated, ' repeat an earlier one' + reverse)} (a pair in "
            "both sets, or twice in one): fix the split (--link-split makes one)")))
    negative_edges = _negative_edges(task, edges, num_nodes)
    if negative_edges:
        found.append(Leak("note", (
            f"{negative_edges} negatives are edges of the graph or evaluation pairs: "
            "kept, as OGB's random negatives are")))
    return sorted(found, key=lambda leak: not leak.refused)


def _repeated(pairs, num_nodes, directed):
    """Per pair: whether an earlier pair is the same (either way round,
    unless `directed`)."""
    keys = _keys(pairs, num_nodes, directed)
    _, first = np.unique(keys, return_index=True)
    repeated = np.ones(keys.shape[0], dtype=bool)
    repeated[first] = False
    return repeated


def _negative_edges(task, edges, num_nodes):
    """How many (source, negative) pairs are edges of the graph or
    evaluation pairs (either way round, unless directed)."""
    known = np.unique(np.concatenate([
        _keys(edges, num_nodes, task.directed),
        _keys(task.evaluated(), num_nodes, task.directed)]))
    count = 0
    for pairs, negatives in ((task.valid, task.valid_negatives),
                             (task.test, task.test_negatives)):
        negatives = np.asarray(negatives)
        sources = np.repeat(np.asarray(pairs[0]), negatives.shape[1])
        count += int(np.isin(_keys((sources, negatives.ravel()), num_nodes,
                                   task.directed), known).sum())
    return count


def split(edges, num_nodes, fractions, num_negatives, rng, directed=False,
          destinations=None):
    """(the graph's edges, a LinkTask) from a plain edge list: `fractions`
    (validation, test) of its distinct pairs (u, v) with u != v (either way
    round one pair, unless `directed`) held out, every copy of them taken
    out of the graph (both ways unless directed); the graph's other edges
    are the train pairs; `num_negatives` uniform random destinations per
    evaluation pair, from `rng`. `destinations`: the pairs join two node
    types (directed, and u == v no loop), this many nodes of the second."""
    edges = np.asarray(edges)
    two_types = destinations is not None
    either_way = counts_either_way(directed, two_types)
    loops = (edges[0] == edges[1]) & (not two_types)
    keys = np.unique(_keys(edges[:, ~loops], num_nodes, directed=not either_way))
    cuts = np.cumsum([int(keys.shape[0] * f) for f in fractions])
    if cuts[0] < 1 or cuts[1] - cuts[0] < 1:
        raise DatasetError(
            f"--link-split {','.join(map(str, fractions))}: of {keys.shape[0]} distinct pairs "
            "the validation or test set would be empty")
    order = rng.permutation(keys.shape[0])
    valid, test = (np.stack(divmod(keys[np.sort(part)], num_nodes))
                   for part in np.split(order[:cuts[1]], cuts[:1]))
    graph = without_pairs(edges, np.concatenate([valid, test], axis=1), num_nodes, either_way)
    negatives = [rng.integers(0, destinations or num_nodes, (pairs.shape[1], num_negatives),
                              dtype=np.int64) for pairs in (valid, test)]
    return graph, LinkTask(graph, valid, negatives[0], test, negatives[1],
                           directed and not two_types)


def sizes(task):
    """{set: its number of pairs}."""
    return {split: int(np.shape(getattr(task, field))[1])
            for split, (field, _) in SETS.items()}
