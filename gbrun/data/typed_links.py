"""A link-prediction task on one relation (edge type) of a graph of several
node types: gbrun.data.links' checks with each end's ids checked against
its own node type, and the evaluation pairs found in (leaks) or taken
out of (without_pairs, drop_leaked) the relation and its reverse relation, the
graph's edges of the relation the other way round (item:bought-by:user
for user:buys:item), which a model samples as much as the relation
itself. gbrun.data.ondisk writes the task; the converter and the
synthetic generator call these."""
import dataclasses

import numpy as np

from . import links
from .inputs import DatasetError, check_edges, check_id_range
from .splits import TEST, VALIDATION

# The reverse relation of a relation the graph holds no edges of the other
# way round, said on purpose (where the graph has an edge type from the
# relation's destination type to its source type, one must be named).
NO_REVERSE = "none"


def ends(relation):
    """(source type, destination type) of "src:relation:dst"."""
    src, _, dst = relation.split(":")
    return src, dst


def check_relations(relation, reverse, edge_types):
    """`relation` is an edge type of the graph, and `reverse` one from its
    destination type to its source type; NO_REVERSE where none holds the
    relation's edges the other way round, None only where the graph has no
    edge type that could."""
    known = ", ".join(edge_types)
    if relation not in edge_types:
        raise DatasetError(f"link relation {relation!r}: not one of the edge types: {known}")
    backwards = [etype for etype in edge_types if ends(etype) == ends(relation)[::-1]]
    if reverse is None and backwards:
        raise DatasetError(
            f"link relation {relation}: the graph has edge types from {ends(relation)[1]} to "
            f"{ends(relation)[0]} ({', '.join(backwards)}); name the one holding its edges the "
            f"other way round as its reverse relation (convert_to_ondisk.py "
            f"--link-reverse-relation; '{NO_REVERSE}' if none does): a model would otherwise "
            "sample the pairs it predicts")
    if reverse in (None, NO_REVERSE):
        return
    if reverse not in edge_types:
        raise DatasetError(f"reverse relation {reverse!r}: not one of the edge types: {known}")
    if ends(reverse) != ends(relation)[::-1]:
        raise DatasetError(
            f"reverse relation {reverse}: goes from {ends(reverse)[0]} to {ends(reverse)[1]}, "
            f"but {relation}'s reverse goes from {ends(relation)[1]} to {ends(relation)[0]}")


def check(task, relation, reverse, num_nodes, edge_types, names=None):
    """A links.LinkTask of `relation`, ids within each end's node type
    (`num_nodes`: {node type: count}): pairs checked as edges of it, the
    negatives as destinations, then as links.check checks a graph of one
    node type (negatives per pair, no evaluation pair trained on).
    `names`: how messages name the inputs (links.NAMES' keys), where the
    caller knows their files. Raises DatasetError naming the input."""
    check_relations(relation, reverse, edge_types)
    src, dst = ends(relation)
    size = max(num_nodes[src], num_nodes[dst])
    names = {**{f"link {split}": f"link {split} pairs of {relation}" for split in links.SETS},
             **{f"link {split} negatives": f"link {split} negatives of {relation}"
                for split in (VALIDATION.name, TEST.name)},
             "features": f"node types {src} and {dst}", **(names or {})}
    for split, (pairs_field, negatives_field) in links.SETS.items():
        where = names[f"link {split}"]
        pairs = getattr(task, pairs_field)
        check_edges(pairs, size, {"edges": where, "features": names["features"]})
        for row, ntype in zip(np.asanyarray(pairs), (src, dst)):
            check_id_range(row, num_nodes[ntype], where, "pair", f"node type {ntype}")
        negatives = np.asanyarray(getattr(task, negatives_field)) if negatives_field else None
        if negatives is not None and np.issubdtype(negatives.dtype, np.integer):
            # Destinations of the relation (the shape is links.check's).
            check_id_range(negatives.ravel(), num_nodes[dst],
                           names[f"link {split} negatives"], "entry", f"node type {dst}")
    links.check(task, size, names)


def held(pairs, relation, reverse, edges, num_nodes):
    """Per pair of `pairs` (2, P) of `relation`: whether the graph holds it,
    as an edge of `relation` or, the other way round, of `reverse`; and
    either way round where both ends are of one node type (as on a graph of
    one)."""
    src, dst = ends(relation)
    size = max(num_nodes[src], num_nodes[dst])
    either_way = links.counts_either_way(two_types=src != dst)
    found = links.pairs_held(pairs, edges[relation], size, either_way)
    if reverse not in (None, NO_REVERSE):
        found |= links.pairs_held(pairs, edges[reverse][::-1], size, either_way)
    return found


def without_pairs(edges, pairs, relation, reverse, num_nodes, either_way=None):
    """`edges` ({edge type: (2, E)}) without every edge of `relation`
    joining a pair of `pairs`, nor of `reverse` joining one the other way
    round (and either way round, where `either_way`: by default where both
    ends are of one node type): the graph a model may sample when it is
    scored on `pairs`."""
    src, dst = ends(relation)
    size = max(num_nodes[src], num_nodes[dst])
    if either_way is None:
        either_way = links.counts_either_way(two_types=src != dst)
    kept = dict(edges)
    for etype, flip in ((relation, False), (reverse, True)):
        if etype not in (None, NO_REVERSE):
            own = np.asanyarray(edges[etype])
            seen = own[::-1] if flip else own
            kept[etype] = own[:, ~links.pairs_held(seen, pairs, size, either_way)]
    return kept


def leaks(task, relation, reverse, edges, num_nodes, names=None, keep_graph=False):
    """links.leaks for a task of `relation`: the graph's pairs are its
    edges and, turned round, its reverse relation's; a pair is read either
    way round only where both ends are of one node type (and the task is
    not directed)."""
    src, dst = ends(relation)
    seen = [np.asanyarray(edges[relation])]
    if reverse not in (None, NO_REVERSE):
        seen.append(np.asanyarray(edges[reverse])[::-1])
    return links.leaks(task, np.concatenate(seen, axis=1), max(num_nodes[src], num_nodes[dst]),
                       names, keep_graph, one_way=src != dst)


def drop_leaked(edges, task, relation, reverse, num_nodes):
    """(edges, task) without the evaluation pairs in the relation, its
    reverse relation (turned round) and the train pairs: what
    --drop-leaked-edges does; and how many it took of the graph and of the
    train pairs."""
    src, dst = ends(relation)
    either_way = links.counts_either_way(task.directed, two_types=src != dst)
    evaluated = task.evaluated()
    graph = without_pairs(edges, evaluated, relation, reverse, num_nodes, either_way)
    train = links.without_pairs(task.train, evaluated, max(num_nodes[src], num_nodes[dst]),
                                either_way)
    dropped = (sum(np.shape(edges[t])[1] - np.shape(graph[t])[1] for t in edges),
               task.train.shape[1] - train.shape[1])
    return graph, dataclasses.replace(task, train=train), dropped
