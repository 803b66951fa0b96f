"""Generate a learnable synthetic node-classification graph for GraphBolt.

    python scripts/make_synthetic_dataset.py datasets/synthetic
    python scripts/make_synthetic_dataset.py datasets/big --num-nodes 200000 \\
        --avg-degree 20 --feat-dim 100 --force
    python node_classification.py --dataset datasets/synthetic

How it is made, so that a GraphSAGE model has something to learn:
- labels: uniform random class per node;
- features: the node's class centroid (random normal) plus much stronger
  noise, so one node's own features are a weak hint (a plain MLP does
  poorly) but the mean over many same-class neighbours is a strong one;
- edges: each node has on average --avg-degree in-edges; 80% of edges join
  two nodes of the same class (homophily), the rest join random nodes.
The same arguments always produce the same bytes.
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ondisk  # noqa: E402  (needs the path above when run as a script)

# Fraction of edges whose two ends share a class.
HOMOPHILY = 0.8
# Noise std relative to the distance between class centroids: chosen so that
# own features alone give about 1/3 accuracy with 10 classes while a 3-layer
# GraphSAGE reaches well above 0.7, without hitting 1.0.
NOISE_SCALE = 1.0


def make_labels(rng, num_nodes, num_classes):
    return rng.integers(0, num_classes, size=num_nodes, dtype=np.int64)


def make_features(rng, labels, num_classes, feat_dim, noise_scale):
    """Class centroid + isotropic noise, scaled to roughly unit variance."""
    centroids = rng.standard_normal((num_classes, feat_dim), dtype=np.float32)
    # Centroids are ~sqrt(2 * feat_dim) apart; scaling the noise by
    # sqrt(feat_dim) keeps the difficulty the same for any --feat-dim.
    noise_std = noise_scale * np.sqrt(feat_dim)
    features = rng.standard_normal((labels.shape[0], feat_dim), dtype=np.float32)
    features *= noise_std
    rows = max(1, ondisk.BLOCK_ELEMENTS // feat_dim)
    for start in range(0, labels.shape[0], rows):  # blocks: no N x F temporary
        features[start : start + rows] += centroids[labels[start : start + rows]]
    features /= np.float32(np.sqrt(1.0 + noise_std**2))
    return features


def make_edges(rng, labels, num_classes, num_edges, homophily):
    """Random sources; destinations in the source's class with p=homophily."""
    num_nodes = labels.shape[0]
    src = rng.integers(0, num_nodes, size=num_edges, dtype=np.int64)
    dst = rng.integers(0, num_nodes, size=num_edges, dtype=np.int64)
    same_class = np.flatnonzero(rng.random(num_edges) < homophily)
    # Nodes sorted by class: class c owns the slice by_class[start[c]:start[c]+count[c]],
    # so a random partner of the same class is one random offset into that slice.
    by_class = np.argsort(labels, kind="stable")
    count = np.bincount(labels, minlength=num_classes)
    start = np.cumsum(count) - count
    cls = labels[src[same_class]]
    offset = (rng.random(same_class.size) * count[cls]).astype(np.int64)
    dst[same_class] = by_class[start[cls] + offset]
    return ondisk.drop_self_loops(np.stack([src, dst]))


def make_dataset(
    num_nodes, avg_degree, feat_dim, num_classes, seed, noise_scale=NOISE_SCALE, homophily=HOMOPHILY
):
    """Return (edges, features, labels) as numpy arrays."""
    rng = np.random.default_rng(seed)
    labels = make_labels(rng, num_nodes, num_classes)
    features = make_features(rng, labels, num_classes, feat_dim, noise_scale)
    num_edges = int(round(num_nodes * avg_degree))
    edges = make_edges(rng, labels, num_classes, num_edges, homophily)
    return edges, features, labels


def positive(kind):
    """argparse type: a number > 0 of the given kind (int or float)."""

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def fractions(text):
    """argparse type for --split."""
    try:
        return ondisk.parse_fractions(text)
    except ondisk.DatasetError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", help="dataset directory to create")
    parser.add_argument("--num-nodes", type=positive(int), default=10000)
    parser.add_argument("--avg-degree", type=positive(float), default=10, help="average in-degree")
    parser.add_argument("--feat-dim", type=positive(int), default=100)
    parser.add_argument("--num-classes", type=positive(int), default=10)
    parser.add_argument("--split", type=fractions, default=(0.6, 0.2, 0.2), help="train,val,test fractions")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    args = parser.parse_args(argv)
    if args.num_classes < 2:
        parser.error("--num-classes: need at least 2 classes")
    if int(args.num_nodes * args.split[0]) < 1:
        parser.error(f"--split: the train set of {args.num_nodes} nodes would be empty")
    return parser, args


def main(argv=None):
    parser, args = parse_args(argv)
    edges, features, labels = make_dataset(
        args.num_nodes, args.avg_degree, args.feat_dim, args.num_classes, args.seed
    )
    # The split seed differs from the generator seed only to keep streams apart.
    train, val, test = ondisk.split_nodes(args.num_nodes, args.split, seed=args.seed + 1)
    try:
        summary = ondisk.write_ondisk_dataset(
            args.out_dir, edges, features, labels, train, val, test,
            num_classes=args.num_classes, name="synthetic", force=args.force,
        )
    except ondisk.DatasetError as err:
        parser.error(str(err))
    sizes = summary["split_sizes"]
    print(
        f"wrote {args.out_dir}: {summary['num_nodes']} nodes, {summary['num_edges']} edges, "
        f"{summary['feat_dim']} features, {summary['num_classes']} classes, "
        f"train/val/test {sizes['train']}/{sizes['validation']}/{sizes['test']}"
    )


if __name__ == "__main__":
    main()
