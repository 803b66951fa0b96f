"""Datasets: what the example reads, and what the dataset scripts write, in
one place so that they agree.

    datasets  what the example calls: loading (from loading), the feature
              store's keys, and the checks that refuse what the example
              cannot train on, in one line
    loading   reading a dataset (every script): a directory, a builtin
              made on first use, or GraphBolt's, downloaded; its identity
    splits    the split table: each split's name, GraphBolt attribute,
              file prefix and partition mask, defined once
    labels    what a node's label is (class, multi-hot, value) and the one
              check of an array of labels, for both sides
    inputs    the dataset writer's input checks and transforms (random
              splits, self-loops, reverse edges)
    links     a link-prediction task beside the node task: its checks,
              every way its answers leak, and the split of an edge list
    ondisk    the OnDiskDataset writer scripts/convert_to_ondisk.py and
              scripts/make_synthetic_dataset.py share (one body for a graph
              of one node type or several)
    outdir    where it writes: --force replaces only what gbrun wrote; a
              temp dir renamed into place
    synthetic the planted synthetic graph (and its link task)
    builtin   the datasets that come with the example (`synthetic`,
              `synthetic-links`), made once into the cache on first use
    metadata  a dataset's metadata.yaml read as data: the files it names,
              numpy or CSV, inside the dataset
    fingerprint  a dataset identified by content (cached SHA-256 per file)
    staging   GraphBolt's preprocessing of a dataset, once per content, in
              the cache, never in the dataset
Importing gbrun.data.inputs, labels, links, ondisk, outdir, splits,
synthetic or builtin loads no torch.
"""
