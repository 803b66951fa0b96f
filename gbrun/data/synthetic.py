"""The synthetic datasets: a planted node-classification graph, optionally
with a link-prediction task (make_synthetic_dataset.py's command line, and
the builtin names of gbrun.data.builtin, which must be the same bytes).

How it is made, so that a GraphSAGE model has something to learn:
- classes: uniform random class per node;
- labels: the class, except for 10% of nodes whose label is redrawn at random,
  so no model can pass about 91% accuracy (the task is never trivially 1.0);
- features: the node's class centroid (random normal) plus strong noise, so
  a node's own features are only a partial hint (a linear model gets about
  0.57) but the mean over many same-class neighbours is a strong one; rows
  have unit length on average, so a fresh model's first loss is near
  ln(num_classes);
- edges: each node has on average `avg_degree` in-edges; 80% of edges join
  two nodes of the same class (homophily), the rest join random nodes. Two
  draws may give the same edge (268 repeats in the default graph, which the
  converter would warn of): kept, since every figure measured on these
  bytes (the README's, the tests' floors) depends on them.
Features and edges follow the class, the stored label is the noisy one.
With `link_negatives` K: a link-prediction task beside the node task: 5% of
the graph's distinct pairs (either way round) are validation and 5% test
pairs, taken out of the graph both ways, each with K uniform random
negative destinations; the graph's other edges are the train pairs (as
convert_to_ondisk.py --link-split 0.05,0.05 splits).
The same arguments always produce the same bytes.
"""

import numpy as np

from . import inputs, links, ondisk

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


# --link-negatives: the fractions of the graph's distinct pairs that are
# validation and test pairs (convert_to_ondisk.py --link-split's split).
LINK_SPLIT = (0.05, 0.05)


# The defaults of make_synthetic_dataset.py (the README's quick-start graph).
DEFAULTS = {"num_nodes": 20000, "avg_degree": 10, "feat_dim": 100, "num_classes": 10,
            "split": (0.6, 0.2, 0.2), "seed": 0, "link_negatives": None}


def write(out_dir, num_nodes, avg_degree, feat_dim, num_classes, split, seed,
          link_negatives=None, force=False):
    """Makes the graph (and its link task with `link_negatives`) and writes
    it to `out_dir` with gbrun.data.ondisk; returns the writer's summary.
    Raises DatasetError (out_dir exists without `force`, say)."""
    edges, features, labels = make_dataset(num_nodes, avg_degree, feat_dim, num_classes, seed)
    # The split seed differs from the generator seed only to keep streams apart.
    train, val, test = inputs.split_nodes(num_nodes, split, seed=seed + 1)
    link_task = None
    if link_negatives:
        edges, link_task = links.split(edges, num_nodes, LINK_SPLIT, link_negatives,
                                       np.random.default_rng(seed + 2))
    return ondisk.write_ondisk_dataset(
        out_dir, edges, features, labels, train, val, test,
        num_classes=num_classes, name="synthetic", force=force, link_task=link_task)
