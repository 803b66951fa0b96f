"""Generate a learnable synthetic node-classification graph for GraphBolt.

    python scripts/make_synthetic_dataset.py datasets/synthetic
    python scripts/make_synthetic_dataset.py datasets/big --num-nodes 200000 \\
        --avg-degree 20 --feat-dim 100 --force
    python node_classification.py --dataset datasets/synthetic

The graph (how it is planted, and its link task) is gbrun.data.synthetic's;
the builtin dataset names `synthetic` and `synthetic-links` are the same
bytes, made on first use into gbrun's cache (docs/own-data.md).
With --hetero: users (labelled) buy items (edge types user:buys:item and
item:bought-by:user), mostly of their own class; a user's own features are
weak (noise 2.0, not 0.5) and the items' clear, so a relational model must
read the items it bought to do well.
With --hetero --link-negatives K: the link task is on user:buys:item (for
docs/customising.md's edit for a relation of several node types): 5% of
the distinct purchases are validation and 5% test pairs, taken out of both
user:buys:item and its reverse item:bought-by:user, each with K random
items as negatives. Users buy items of their own class, which the items'
features and the users' neighbourhoods carry: a model learns who buys
what.
The same arguments always produce the same bytes.
"""

import dataclasses
import sys

import numpy as np

from gbrun.data import inputs, links, ondisk, synthetic, typed_links
from gbrun.data.synthetic import (
    DEFAULTS, HOMOPHILY, LABEL_NOISE, NOISE_SCALE, make_classes_and_labels, make_edges,
    make_features,
)
from gbrun.cli import ArgumentParser, int_at_least, positive_float

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
    """(the graph's edges, a links.LinkTask on user:buys:item): 5% and 5%
    of the distinct purchases as validation and test pairs (links.split,
    as the graph of one node type is split), taken out of both relations
    (a user's purchase, and the item's bought-by edge back); the purchases
    left are the train pairs; `num_negatives` random items per evaluation
    pair."""
    _, task = links.split(edges[HETERO_RELATION], max(num_nodes.values()),
                          synthetic.LINK_SPLIT, num_negatives, rng,
                          destinations=num_nodes["item"])
    graph = typed_links.without_pairs(edges, task.evaluated(), HETERO_RELATION,
                                      HETERO_REVERSE, num_nodes)
    return graph, dataclasses.replace(task, train=graph[HETERO_RELATION])


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
    parser.add_argument("--num-nodes", type=int_at_least(1), default=DEFAULTS["num_nodes"])
    parser.add_argument("--avg-degree", type=positive_float, default=DEFAULTS["avg_degree"],
                        help="average in-degree")
    parser.add_argument("--feat-dim", type=int_at_least(1), default=DEFAULTS["feat_dim"])
    parser.add_argument("--num-classes", type=int_at_least(2), default=DEFAULTS["num_classes"])
    parser.add_argument("--split", type=inputs.split_argument, default=DEFAULTS["split"],
                        help="train,val,test fractions")
    parser.add_argument("--seed", type=int_at_least(0), default=DEFAULTS["seed"])
    parser.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    parser.add_argument("--hetero", action="store_true",
                        help="two node types: --num-nodes users (labelled) and half as many items, "
                        "edge types user:buys:item and its reverse item:bought-by:user")
    parser.add_argument("--link-negatives", type=int_at_least(1), metavar="K",
                        help="also write a link-prediction task: 5%% of the graph's pairs are validation "
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
    try:
        summary = synthetic.write(
            args.out_dir, args.num_nodes, args.avg_degree, args.feat_dim, args.num_classes,
            args.split, args.seed, args.link_negatives, force=args.force)
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
    if summary["link_sizes"]:
        pairs = summary["link_sizes"]
        print(f"link task: train/val/test {pairs['train']}/{pairs['validation']}/"
              f"{pairs['test']} pairs, {args.link_negatives} negatives per evaluation pair")


if __name__ == "__main__":
    main()
