"""
Partition a GraphBolt OnDiskDataset for training on DGL's distributed engine.

DGL's distributed engine (DistGraph) does not read an OnDiskDataset: every
machine loads one partition written by `dgl.distributed.partition_graph`. This
script converts the dataset the single-machine example trains on into those
partitions, so `dist_node_classification.py` trains the same model on the same
data across machines.

Run it once, on one machine, before training:

    # A dataset directory (one that holds metadata.yaml), 2 machines:
    python scripts/partition_graph.py --dataset datasets/synthetic \
        --num-parts 2 --out partitions/synthetic --balance-train --balance-edges

    # A GraphBolt builtin dataset (downloaded into --root first):
    python scripts/partition_graph.py --dataset ogbn-products --num-parts 4 \
        --out partitions/ogbn-products --balance-train --balance-edges

    # Also write GraphBolt partitions (train with --use-graphbolt):
    python scripts/partition_graph.py ... --use-graphbolt

The output directory holds `<graph-name>.json` (the partition config to pass
as --part-config), one `partN/` directory per machine, `dataset_info.json`
(number of classes and feature size, which the partitions do not record) and
`orig_nids.pt` (partitioning renumbers nodes: entry i is the dataset id of
node i of the partitioned graph).

Call tree:
main
├── parse_args / validate_args
├── load_dataset               node_classification.py's (directory or builtin name)
├── dataset_to_dgl_graph       CSC graph + feat + label + train/val/test masks
│   └── task_set_columns       seed ids and labels of one train/val/test set
├── read_num_classes
├── partition                  dgl.distributed.partition_graph (HIGHLIGHT)
└── write_dataset_info         dataset_info.json beside the partition config
"""
import argparse
import json
import os

import dgl
import torch

from gbrun import UsageError, fail, load_dataset

# Node data the trainer reads from the DistGraph; the names are its contract.
NODE_DATA = ("feat", "label", "train_mask", "val_mask", "test_mask")
DATASET_INFO_FILE = "dataset_info.json"
# orig_nids[i] is the dataset id of node i in the partitioned graph.
ORIG_NIDS_FILE = "orig_nids.pt"


def task_set_columns(item_set, set_name):
    """Return (seed node ids, labels) of one node-classification set."""
    if item_set is None or item_set.names != ("seed_nodes", "labels"):
        names = None if item_set is None else item_set.names
        fail(
            f"{set_name} must hold (seed_nodes, labels) for node "
            f"classification, got {names}"
        )
    seed_nodes, labels = item_set[:]
    return seed_nodes.long(), labels.long()


def dataset_to_dgl_graph(dataset):
    """Build a homogeneous DGLGraph carrying every array the trainer needs."""
    graph = dataset.graph
    if graph.node_type_offset is not None:
        fail("heterogeneous graphs are not supported by this example")
    num_nodes = graph.total_num_nodes
    indptr = graph.csc_indptr.long()
    # CSC: indptr runs over destination nodes, indices are the source nodes.
    dst = torch.repeat_interleave(torch.arange(num_nodes), indptr.diff())
    g = dgl.graph((graph.indices.long(), dst), num_nodes=num_nodes)

    if not dataset.tasks:
        fail("the dataset has no task; a node classification task is needed")
    try:
        g.ndata["feat"] = dataset.feature.read("node", None, "feat")
    except KeyError:
        fail("the dataset has no node feature named feat")
    # Nodes outside every set keep label -1: the trainer never reads them.
    g.ndata["label"] = torch.full((num_nodes,), -1, dtype=torch.int64)
    task = dataset.tasks[0]
    sets = {
        "train_mask": task.train_set,
        "val_mask": task.validation_set,
        "test_mask": task.test_set,
    }
    for mask_name, item_set in sets.items():
        seed_nodes, labels = task_set_columns(item_set, mask_name[:-5] + " set")
        mask = torch.zeros(num_nodes, dtype=torch.bool)
        mask[seed_nodes] = True
        g.ndata[mask_name] = mask
        g.ndata["label"][seed_nodes] = labels
    return g


def read_num_classes(dataset):
    num_classes = dataset.tasks[0].metadata.get("num_classes")
    if num_classes is None:
        fail("the dataset's task has no num_classes in metadata.yaml")
    return int(num_classes)


def partition(g, graph_name, num_parts, out_dir, options):
    """Write the partitions; return the partition config path and, for each
    node id of the partitioned graph, the dataset node id it came from."""
    ############################################################################
    # (HIGHLIGHT) METIS assigns each node to one machine. Balancing on the
    # train mask gives every machine about the same number of training seeds,
    # so no trainer waits long for the others at each gradient all-reduce.
    # One halo hop keeps every in-edge of a machine's nodes (and the ids of
    # their sources) in its partition, so sampling around its own seeds needs
    # no network traffic.
    ############################################################################
    orig_nids, _ = dgl.distributed.partition_graph(
        g,
        graph_name,
        num_parts,
        out_dir,
        num_hops=1,
        part_method=options["part_method"],
        balance_ntypes=g.ndata["train_mask"] if options["balance_train"] else None,
        balance_edges=options["balance_edges"],
        use_graphbolt=options["use_graphbolt"],
        # Partitioning renumbers the nodes so each machine owns a contiguous
        # range; keep the mapping to translate results back to dataset ids.
        return_mapping=True,
    )
    return os.path.join(out_dir, graph_name + ".json"), orig_nids


def write_dataset_info(out_dir, graph_name, num_classes, feat_dim, use_graphbolt):
    """Record what the partition config does not: classes and feature size."""
    info = {
        "graph_name": graph_name,
        "num_classes": num_classes,
        "feat_dim": feat_dim,
        "node_data": list(NODE_DATA),
        "use_graphbolt": use_graphbolt,
    }
    path = os.path.join(out_dir, DATASET_INFO_FILE)
    with open(path, "w") as f:
        json.dump(info, f, indent=2)
    return path


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Partition a GraphBolt OnDiskDataset for DGL distributed "
        "training (one partition per machine)."
    )
    parser.add_argument(
        "--dataset",
        required=True,
        help="OnDiskDataset directory (with metadata.yaml) or a GraphBolt "
        "builtin dataset name such as ogbn-products.",
    )
    parser.add_argument(
        "--root",
        default="datasets",
        help="Download directory for builtin datasets. Default: datasets",
    )
    parser.add_argument(
        "--num-parts", type=int, required=True, help="Number of machines."
    )
    parser.add_argument(
        "--out", required=True, help="Output directory for the partitions."
    )
    parser.add_argument(
        "--graph-name",
        default=None,
        help="Name stored in the partition config. Default: the dataset name.",
    )
    parser.add_argument(
        "--part-method",
        choices=["metis", "random"],
        default="metis",
        help="How nodes are assigned to partitions. Default: metis",
    )
    parser.add_argument(
        "--balance-train",
        action="store_true",
        help="Balance the number of training nodes across partitions.",
    )
    parser.add_argument(
        "--balance-edges",
        action="store_true",
        help="Balance the number of edges across partitions.",
    )
    parser.add_argument(
        "--use-graphbolt",
        action="store_true",
        help="Also write each partition as a GraphBolt FusedCSCSamplingGraph "
        "(needed to train with --use-graphbolt).",
    )
    return parser.parse_args(argv)


def validate_args(args):
    """Fail with one line before any heavy work."""
    if args.num_parts < 1:
        fail(f"--num-parts must be at least 1, got {args.num_parts}")
    if os.path.isfile(args.out):
        fail(f"--out {args.out} is a file, expected a directory")


def main():
    args = parse_args()
    validate_args(args)
    try:
        dataset = load_dataset(args.dataset, args.root)
    except UsageError as error:
        fail(error)
    graph_name = args.graph_name or os.path.basename(
        os.path.normpath(args.dataset)
    )
    g = dataset_to_dgl_graph(dataset)
    num_classes = read_num_classes(dataset)
    print(
        f"Graph {graph_name}: {g.num_nodes()} nodes, {g.num_edges()} edges, "
        f"{int(g.ndata['train_mask'].sum())} train / "
        f"{int(g.ndata['val_mask'].sum())} val / "
        f"{int(g.ndata['test_mask'].sum())} test nodes, {num_classes} classes."
    )
    options = {
        "part_method": args.part_method,
        "balance_train": args.balance_train,
        "balance_edges": args.balance_edges,
        "use_graphbolt": args.use_graphbolt,
    }
    part_config, orig_nids = partition(
        g, graph_name, args.num_parts, args.out, options
    )
    torch.save(orig_nids, os.path.join(args.out, ORIG_NIDS_FILE))
    info_path = write_dataset_info(
        args.out,
        graph_name,
        num_classes,
        g.ndata["feat"].shape[1],
        args.use_graphbolt,
    )
    with open(part_config) as f:
        config = json.load(f)
    for part_id in range(args.num_parts):
        part = config[f"part-{part_id}"]
        part_dir = os.path.dirname(os.path.join(args.out, part["part_graph"]))
        print(f"Partition {part_id} -> {os.path.abspath(part_dir)}")
    print(f"Partition config: {os.path.abspath(part_config)}")
    print(f"Dataset info: {os.path.abspath(info_path)}")


if __name__ == "__main__":
    main()
