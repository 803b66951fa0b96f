"""Generate a learnable synthetic node-classification graph for GraphBolt.

    python scripts/make_synthetic_dataset.py datasets/synthetic
    python scripts/make_synthetic_dataset.py datasets/big --num-nodes 200000 \\
        --avg-degree 20 --feat-dim 100 --force
    python node_classification.py --dataset datasets/synthetic

How it is made, so that a GraphSAGE model has something to learn:
- classes: uniform random class per node;
- labels: the class, except for 10% of nodes whose label is redrawn at random,
  so no model can pass about 91% accuracy (the task is never trivially 1.0);
- features: the node's class centroid (random normal) plus strong noise, so
  a node's own features are only a partial hint (a linear model gets about
  0.57) but the mean over many same-class neighbours is a strong one; rows
  have unit length on average, so a fresh model's first loss is near
  ln(num_classes);
- edges: each node has on average --avg-degree in-edges; 80% of edges join
  two nodes of the same class (homophily), the rest join random nodes.
Features and edges follow the class, the stored label is the noisy one.
With --hetero: users (labelled) buy items (edge types user:buys:item and
item:bought-by:user), mostly of their own class; a user's own features are
weak (noise 2.0, not 0.5) and the items' clear, so a relational model must
read the items it bought to do well.
With --link-negatives K: a link-prediction task beside the node task (for
link_prediction.py): 5% of the edges are validation and 5% test pairs,
taken out of the graph (a model must not sample the edges it is scored
on), each with K uniform random negative destinations; the graph's other
edges are the train pairs. As 80% of edges join two nodes of one class,
and features carry the class, a model learns which pairs are edges.
With --hetero --link-negatives K: the link task is on user:buys:item (for
docs/customising.md's edit for a relation of several node types): 5% of
the purchases are validation and 5% test pairs, taken out of both
user:buys:item and its reverse item:bought-by:user, each with K random
items as negatives. Users buy items of their own class, which the items'
features and the users' neighbourhoods carry: a model learns who buys
what.
The same arguments always produce the same bytes.
"""

import sys

import numpy as np

from gbrun.data import inputs, links, ondisk, typed_links
from gbrun.cli import ArgumentParser, int_at_least, positive_float

# Fraction of edges whose two ends share a class.
HOMOPHILY = 0.8
# Fraction of nodes whose label is redrawn at random: caps the best possible
# accuracy at 1 - 0.1 * (1 - 1/num_classes), about 0.91 with 10 classes.
LABEL_NOISE = 0.1
# Feature noise std in units of the centroid spread. Measured with 10
# classes: own features alone give a linear model about 0.57 accuracy; the
# 3-layer GraphSAGE of node_classification.py, averaging neighbours, starts
# at a loss near ln(10) = 2.3 and reaches about 0.90 test accuracy in its 10
# default epochs on the default 20,000 nodes (two CPU ranks, under a minute).
NOISE_SCALE = 0.5


def make_classes_and_labels(rng, num_nodes, num_classes, label_noise):
    """(true class, stored label) per node; label_noise of labels are random."""
    classes = rng.integers(0, num_classes, size=num_nodes, dtype=np.int64)
    labels = classes.copy()
    redraw = np.flatnonzero(rng.random(num_nodes) < label_noise)
    labels[redraw] = rng.integers(0, num_classes, size=redraw.size, dtype=np.int64)
    return classes, labels


def make_features(rng, classes, num_classes, feat_dim, noise_scale):
    """Class centroid + isotropic noise, rows scaled to unit length."""
    centroids = rng.standard_normal((num_classes, feat_dim), dtype=np.float32)
    # Centroids are ~sqrt(2 * feat_dim) apart; scaling the noise by
    # sqrt(feat_dim) keeps the difficulty the same for any --feat-dim.
    noise_std = noise_scale * np.sqrt(feat_dim)
    features = rng.standard_normal((classes.shape[0], feat_dim), dtype=np.float32)
    features *= noise_std
    rows = max(1, inputs.BLOCK_ELEMENTS // feat_dim)
    for start in range(0, classes.shape[0], rows):  # blocks: no N x F temporary
        features[start : start + rows] += centroids[classes[start : start + rows]]
    # Unit-length rows on average, so a fresh model's logits start near zero
    # (first loss near ln(num_classes)) for any --feat-dim.
    features /= np.float32(np.sqrt(feat_dim * (1.0 + noise_std**2)))
    return features


def make_edges(rng, classes, num_classes, num_edges, homophily, dst_classes=None):
    """Random sources; destinations in the source's class with p=homophily,
    among the nodes of `dst_classes` (another node type's classes; default
    the same nodes). A class without any such node keeps random ones."""
    dst_classes = classes if dst_classes is None else dst_classes
    src = rng.integers(0, classes.shape[0], size=num_edges, dtype=np.int64)
    dst = rng.integers(0, dst_classes.shape[0], size=num_edges, dtype=np.int64)
    same_class = np.flatnonzero(rng.random(num_edges) < homophily)
    # Nodes sorted by class: class c owns the slice by_class[start[c]:start[c]+count[c]],
    # so a random partner of the same class is one random offset into that slice.
    by_class = np.argsort(dst_classes, kind="stable")
    count = np.bincount(dst_classes, minlength=num_classes)
    start = np.cumsum(count) - count
    cls = classes[src[same_class]]
    offset = (rng.random(same_class.size) * count[cls]).astype(np.int64)
    has = count[cls] > 0
    dst[same_class[has]] = by_class[(start[cls] + offset)[has]]
    return src, dst


def make_dataset(
    num_nodes, avg_degree, feat_dim, num_classes, seed,
    noise_scale=NOISE_SCALE, homophily=HOMOPHILY, label_noise=LABEL_NOISE,
):
    """Return (edges, features, labels) as numpy arrays."""
    rng = np.random.default_rng(seed)
    classes, labels = make_classes_and_labels(rng, num_nodes, num_classes, label_noise)
    features = make_features(rng, classes, num_classes, feat_dim, noise_scale)
    num_edges = int(round(num_nodes * avg_degree))
    src, dst = make_edges(rng, classes, num_classes, num_edges, homophily)
    return inputs.drop_self_loops(np.stack([src, dst])), features, labels


# --link-negatives: the fractions of edges that are train (they stay the
# graph), validation and test pairs.
LINK_SPLIT = (0.9, 0.05, 0.05)


def make_link_task(rng, edges, num_nodes, num_negatives):
    """(the graph's edges, a links.LinkTask): validation and test pairs
    drawn from `edges` and taken out of the graph, every copy either way
    round; the graph's edges are the train pairs; `num_negatives` uniform
    random destinations per evaluation pair."""
    order = rng.permutation(edges.shape[1])
    cuts = np.cumsum([int(edges.shape[1] * f) for f in LINK_SPLIT[1:]])
    valid, test = (edges[:, np.sort(part)] for part in np.split(order[:cuts[-1]], cuts[:1]))
    graph = links.without_pairs(edges, np.concatenate([valid, test], axis=1), num_nodes)
    negatives = [rng.integers(0, num_nodes, (pairs.shape[1], num_negatives), dtype=np.int64)
                 for pairs in (valid, test)]
    return graph, links.LinkTask(graph, valid, negatives[0], test, negatives[1])


# --hetero: users (the target, with labels) and half as many items. A
# user's own features are weaker than on the homogeneous graph (its
# bought items carry the signal), so a model must read the items.
HETERO_USER_NOISE = 2.0


def make_hetero_dataset(num_users, avg_degree, feat_dim, num_classes, seed,
                        homophily=HOMOPHILY, label_noise=LABEL_NOISE):
    """Users and items, each with a class; a user buys about `avg_degree`
    items, of its own class with p=homophily. Returns (num_nodes, edges,
    features, user labels) as ondisk.write_hetero_dataset takes them."""
    rng = np.random.default_rng(seed)
    num_items = max(num_classes, num_users // 2)
    classes, labels = make_classes_and_labels(rng, num_users, num_classes, label_noise)
    item_classes = rng.integers(0, num_classes, size=num_items, dtype=np.int64)
    # Items' features are as clear as the homogeneous graph's nodes'; the
    # items' feature width differs, so a model must size each type's input.
    item_features = make_features(rng, item_classes, num_classes,
                                  max(1, feat_dim // 2), NOISE_SCALE)
    user_features = make_features(rng, classes, num_classes, feat_dim,
                                  HETERO_USER_NOISE)
    num_edges = int(round(num_users * avg_degree))
    buyers, bought = make_edges(rng, classes, num_classes, num_edges, homophily,
                                dst_classes=item_classes)
    buys = np.stack([buyers, bought])
    return ({"user": num_users, "item": num_items},
            {"user:buys:item": buys, "item:bought-by:user": buys[::-1].copy()},
            {"user": user_features, "item": item_features}, labels)


# --hetero --link-negatives: the relation whose links are predicted, and
# its reverse relation (the same purchases, from the items).
HETERO_RELATION, HETERO_REVERSE = "user:buys:item", "item:bought-by:user"


def make_hetero_link_task(rng, edges, num_nodes, num_negatives):
    """(the graph's edges, a links.LinkTask on user:buys:item): validation
    and test purchases drawn as make_link_task draws them, taken out of
    both relations (a user's purchase, and the item's bought-by edge back);
    the purchases left are the train pairs; `num_negatives` random items
    per evaluation pair."""
    buys = edges[HETERO_RELATION]
    order = rng.permutation(buys.shape[1])
    cuts = np.cumsum([int(buys.shape[1] * f) for f in LINK_SPLIT[1:]])
    valid, test = (buys[:, np.sort(part)] for part in np.split(order[:cuts[-1]], cuts[:1]))
    graph = typed_links.without_pairs(edges, np.concatenate([valid, test], axis=1),
                                      HETERO_RELATION, HETERO_REVERSE, num_nodes)
    negatives = [rng.integers(0, num_nodes["item"], (pairs.shape[1], num_negatives),
                              dtype=np.int64) for pairs in (valid, test)]
    return graph, links.LinkTask(graph[HETERO_RELATION], valid, negatives[0], test,
                                 negatives[1])


def write_hetero(parser, args):
    num_nodes, edges, features, labels = make_hetero_dataset(
        args.num_nodes, args.avg_degree, args.feat_dim, args.num_classes, args.seed)
    train, val, test = inputs.split_nodes(args.num_nodes, args.split, seed=args.seed + 1)
    link_task = None
    if args.link_negatives:
        edges, link_task = make_hetero_link_task(np.random.default_rng(args.seed + 2), edges,
                                                 num_nodes, args.link_negatives)
    try:
        summary = ondisk.write_hetero_dataset(
            args.out_dir, num_nodes, edges, labels, train, val, test, "user",
            features=features, num_classes=args.num_classes, name="synthetic-hetero",
            force=args.force, link_task=link_task, relation=HETERO_RELATION,
            reverse=HETERO_REVERSE)
    except inputs.DatasetError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        sys.exit(2)
    sizes = summary["split_sizes"]
    print(f"wrote {args.out_dir}: {num_nodes['user']} users, {num_nodes['item']} items, "
          f"{edges['user:buys:item'].shape[1]} edges each way, {args.num_classes} classes "
          f"on user, train/val/test {sizes['train']}/{sizes['validation']}/{sizes['test']}")
    if link_task is not None:
        pairs = summary["link_sizes"]
        print(f"link task on {HETERO_RELATION} (reverse {HETERO_REVERSE}): train/val/test "
              f"{pairs['train']}/{pairs['validation']}/{pairs['test']} pairs, "
              f"{args.link_negatives} negative items per evaluation pair")


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", help="dataset directory to create")
    parser.add_argument("--num-nodes", type=int_at_least(1), default=20000)
    parser.add_argument("--avg-degree", type=positive_float, default=10, help="average in-degree")
    parser.add_argument("--feat-dim", type=int_at_least(1), default=100)
    parser.add_argument("--num-classes", type=int_at_least(2), default=10)
    parser.add_argument("--split", type=inputs.split_argument, default=(0.6, 0.2, 0.2), help="train,val,test fractions")
    parser.add_argument("--seed", type=int_at_least(0), default=0)
    parser.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    parser.add_argument("--hetero", action="store_true",
                        help="two node types: --num-nodes users (labelled) and half as many items, "
                        "edge types user:buys:item and its reverse item:bought-by:user")
    parser.add_argument("--link-negatives", type=int_at_least(1), metavar="K",
                        help="also write a link-prediction task: 5%% of the edges are validation "
                        "and 5%% test pairs (out of the graph), each with K random negatives; "
                        "with --hetero, on user:buys:item (out of it and its reverse)")
    args = parser.parse_args(argv)
    if int(args.num_nodes * args.split[0]) < 1:
        parser.error(f"--split: the train set of {args.num_nodes} nodes would be empty")
    return parser, args


def main(argv=None):
    parser, args = parse_args(argv)
    if args.hetero:
        return write_hetero(parser, args)
    edges, features, labels = make_dataset(
        args.num_nodes, args.avg_degree, args.feat_dim, args.num_classes, args.seed
    )
    # The split seed differs from the generator seed only to keep streams apart.
    train, val, test = inputs.split_nodes(args.num_nodes, args.split, seed=args.seed + 1)
    link_task = None
    if args.link_negatives:
        edges, link_task = make_link_task(np.random.default_rng(args.seed + 2), edges,
                                          args.num_nodes, args.link_negatives)
    try:
        summary = ondisk.write_ondisk_dataset(
            args.out_dir, edges, features, labels, train, val, test,
            num_classes=args.num_classes, name="synthetic", force=args.force,
            link_task=link_task,
        )
    except inputs.DatasetError as err:
        # Bad data, not bad usage: one line and exit 2, as convert_to_ondisk.py.
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        sys.exit(2)
    sizes = summary["split_sizes"]
    print(
        f"wrote {args.out_dir}: {summary['num_nodes']} nodes, {summary['num_edges']} edges, "
        f"{summary['feat_dim']} features, {summary['num_classes']} classes, "
        f"train/val/test {sizes['train']}/{sizes['validation']}/{sizes['test']}"
    )
    if link_task is not None:
        pairs = summary["link_sizes"]
        print(f"link task: train/val/test {pairs['train']}/{pairs['validation']}/"
              f"{pairs['test']} pairs, {args.link_negatives} negatives per evaluation pair")


if __name__ == "__main__":
    main()
