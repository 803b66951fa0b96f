"""
Partition a GraphBolt OnDiskDataset for training on DGL's distributed engine.

DGL's distributed engine (DistGraph) does not read an OnDiskDataset: every
machine loads one partition written by `dgl.distributed.partition_graph`. This
script converts the dataset the single-machine example trains on into those
partitions, so `dist_node_classification.py` trains the same model on the same
data across machines.

Run it once, on one machine, before training:

    # A dataset directory (one that holds metadata.yaml), 2 machines:
    python distributed/partition_graph.py --dataset datasets/synthetic \
        --num-parts 2 --out partitions/synthetic --balance-train --balance-edges

    # A GraphBolt builtin dataset (downloaded into --root first):
    python distributed/partition_graph.py --dataset ogbn-products --num-parts 4 \
        --out partitions/ogbn-products --balance-train --balance-edges

    # Also write GraphBolt partitions (train with --use-graphbolt):
    python distributed/partition_graph.py ... --use-graphbolt

The output directory holds `<graph-name>.json` (the partition config to pass
as --part-config), one `partN/` directory per machine, `dataset_info.json`
(what the example reads and the number of classes, which the partitions do
not record) and `orig_nids.pt` (partitioning renumbers nodes: entry i is the
dataset id of node i of the partitioned graph).

Call tree:
main
├── parse_args
├── load_dataset / check_dataset  as the example loads and checks it
├── dataset_to_dgl_graph          CSC graph + the example's labels +
│                                 train/val/test masks
├── set_features_aside            the features to files, out of memory
├── partition                     dgl.distributed.partition_graph (HIGHLIGHT)
├── add_features                  each partition's rows of the features
└── write_dataset_info            dataset_info.json beside the partition config
                                  (gbrun.dgl_engine.files)

The features are not in memory while the graph is partitioned: at products
size (2.4M nodes, 60M edges, 100 features) that lowered the peak from
13.4 to 12.2 GB with METIS, and from 14.6 to 13.3 GB with random
partitioning (docs/distributed.md#partitioning-at-scale).
"""
import gc
import json
import os
import shutil
import tempfile

import gbrun.cli
import gbrun.data.datasets
import gbrun.data.splits
import gbrun.dgl_engine.files
import gbrun.sources

# dgl, numpy and torch are imported where they are used: a bad argument is
# refused before they load (seconds).



def dataset_to_dgl_graph(dataset, item_sets, label_key):
    """A DGLGraph carrying what the trainer reads but the features: the
    labels of the split nodes (the example's checked `item_sets`) as node
    data `label_key`, and a mask per split; on a graph of several node
    types (item sets {target type: ItemSet}), a heterograph with the labels
    and masks on the target type."""
    import dgl
    import torch

    graph = dataset.graph
    num_nodes = graph.total_num_nodes
    indptr = graph.csc_indptr.long()
    # CSC: indptr runs over destination nodes, indices are the source nodes.
    dst = torch.repeat_interleave(torch.arange(num_nodes), indptr.diff())
    src = graph.indices.long()
    splits = [item_set[0:len(item_set)] for item_set in item_sets]
    if graph.node_type_offset is None:
        g, nodes = dgl.graph((src, dst), num_nodes=num_nodes), None
    else:
        g = dgl.heterograph(typed_edges(graph, src, dst),
                            num_nodes_dict=graph.num_nodes)
        [nodes] = splits[0]  # the target type, the only one with items
        splits = [split[nodes] for split in splits]
    data = g.nodes[nodes].data if nodes else g.ndata
    count = g.num_nodes(nodes)
    labels = splits[0][1]
    # Nodes outside every split keep label -1 (zeros when multi-hot): the
    # trainer never reads them.
    data[label_key] = torch.full((count, *labels.shape[1:]),
                                 -1 if labels.dim() == 1 else 0,
                                 dtype=labels.dtype)
    for mask_name, (seeds, labels) in zip(gbrun.data.splits.MASKS, splits):
        mask = torch.zeros(count, dtype=torch.bool)
        mask[seeds.long()] = True
        data[mask_name] = mask
        data[label_key][seeds.long()] = labels
    return g


def typed_edges(graph, src, dst):
    """{(source type, relation, destination type): (source ids, destination
    ids)}, each id within its type, of a GraphBolt graph of several types
    (`src`, `dst`: every edge's ends in the graph's own ids)."""
    offsets = graph.node_type_offset.long()
    type_id = graph.node_type_to_id
    edges = {}
    for etype, etype_id in graph.edge_type_to_id.items():
        src_type, relation, dst_type = etype.split(":")
        chosen = graph.type_per_edge == etype_id
        edges[(src_type, relation, dst_type)] = (
            src[chosen] - offsets[type_id[src_type]],
            dst[chosen] - offsets[type_id[dst_type]])
    return edges


def set_features_aside(dataset, feature_keys, directory):
    """Each feature the example reads (FEATURE_KEYS: names, or {node type:
    names}), written to a .npy file in `directory`: {(node type or None,
    name): path}. Once the dataset is released, the features no longer take
    memory while the graph is partitioned."""
    import numpy as np

    paths = {}
    for key in gbrun.data.datasets.node_keys(feature_keys):
        _, ntype, name = key
        paths[(ntype, name)] = os.path.join(directory, f"{len(paths)}.npy")
        np.save(paths[(ntype, name)], dataset.feature.read(*key).numpy())
    return paths


def add_features(part_config, orig_nids, feature_paths):
    """Writes each partition's rows of the features into its node data, as
    partition_graph would have: a partition's own nodes of a type are the
    next (end - start) of that type's ids, for each range of the config's
    node_map (one type, "_N": the partitioned ids start..end). One feature
    is in memory at a time, read whole (partitioning has freed its
    memory)."""
    import dgl
    import numpy as np
    import torch

    with open(part_config) as f:
        config = json.load(f)
    parts = [os.path.join(os.path.dirname(part_config),
                          config[f"part-{part_id}"]["node_feats"])
             for part_id in range(config["num_parts"])]
    for (ntype, key), path in feature_paths.items():
        feature = torch.from_numpy(np.load(path))
        ids = orig_nids if ntype is None else orig_nids[ntype]
        ntype = ntype or "_N"
        first = 0
        for part, (start, end) in zip(parts, config["node_map"][ntype]):
            node_data = dgl.data.utils.load_tensors(part)
            node_data[f"{ntype}/{key}"] = feature[ids[first:first + end - start]]
            dgl.data.utils.save_tensors(part, node_data)
            first += end - start
        del feature


def target_type(g):
    """The node type with the labels and split masks of a graph of several
    node types (dataset_to_dgl_graph put them there); None for one."""
    if len(g.ntypes) == 1:
        return None
    [target] = [ntype for ntype in g.ntypes
                if "train_mask" in g.nodes[ntype].data]
    return target


def train_mask(g):
    """The train mask, {target type: mask} on a graph of several types."""
    target = target_type(g)
    if target is None:
        return g.ndata["train_mask"]
    return {target: g.nodes[target].data["train_mask"]}


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
    import dgl

    orig_nids, _ = dgl.distributed.partition_graph(
        g,
        graph_name,
        num_parts,
        out_dir,
        num_hops=1,
        part_method=options["part_method"],
        balance_ntypes=train_mask(g) if options["balance_train"] else None,
        balance_edges=options["balance_edges"],
        use_graphbolt=options["use_graphbolt"],
        # Partitioning renumbers the nodes so each machine owns a contiguous
        # range; keep the mapping to translate results back to dataset ids.
        return_mapping=True,
    )
    return os.path.join(out_dir, graph_name + ".json"), orig_nids


def feature_widths(dataset, feature_keys):
    """{name: width} of the features the example reads ({node type: {name:
    width}} for FEATURE_KEYS per node type)."""
    def width(name, ntype=None):
        return dataset.feature.size(*gbrun.data.datasets.node_key(name, ntype))[0]

    if isinstance(feature_keys, dict):
        return {ntype: {name: width(name, ntype) for name in names}
                for ntype, names in feature_keys.items()}
    return {name: width(name) for name in feature_keys}


def node_types(g, dataset):
    """What dataset_info records of a graph of several node types: its
    target type (the one with labels) and edge types, in the dataset's
    order (the example's model is built in it); None for one."""
    target = target_type(g)
    if target is None:
        return None
    return {"target": target, "edge_types": [
        list(etype) for etype in gbrun.sources.edge_types(dataset)]}


def parse_args(argv=None):
    parser = gbrun.cli.ArgumentParser(
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
        "--example", type=gbrun.cli.python_file, default=gbrun.cli.SHIPPED_EXAMPLE,
        help="The example whose features (FEATURE_KEYS) and labels "
        "(LABEL_KEY, LABELS) the partitions hold. Default: "
        "node_classification.py of this repository.",
    )
    parser.add_argument(
        "--num-parts", type=gbrun.cli.int_at_least(1), required=True,
        help="Number of machines.",
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
    args = parser.parse_args(argv)
    if os.path.isfile(args.out):
        parser.error(f"--out {args.out} is a file, expected a directory")
    return args


def main(argv=None):
    args = parse_args(argv)
    try:
        example = gbrun.cli.load_example(
            args.example, ("FEATURE_KEYS", "LABEL_KEY", "LABELS"))
        dataset = gbrun.data.datasets.load_dataset(args.dataset, args.root)
        item_sets = gbrun.data.datasets.check_dataset(
            dataset, args.dataset, example.FEATURE_KEYS, example.LABEL_KEY,
            example.LABELS, getattr(example, "TARGET", None))
        g = dataset_to_dgl_graph(dataset, item_sets, example.LABEL_KEY)
    except gbrun.cli.UsageError as error:
        gbrun.cli.fail(error)
    graph_name = args.graph_name or os.path.basename(
        os.path.normpath(args.dataset)
    )
    info = gbrun.dgl_engine.files.dataset_info(
        graph_name, dataset.tasks[0].metadata["num_classes"],
        feature_widths(dataset, example.FEATURE_KEYS), example,
        len(item_sets[0]), args.use_graphbolt, node_types(g, dataset))
    print(
        f"Graph {graph_name}: {g.num_nodes()} nodes, {g.num_edges()} edges, "
        f"{info['num_train']} train / {len(item_sets[1])} val / "
        f"{len(item_sets[2])} test nodes, {info['num_classes']} classes."
    )
    os.makedirs(args.out, exist_ok=True)
    aside = tempfile.mkdtemp(prefix=".features-", dir=args.out)
    try:
        feature_paths = set_features_aside(dataset, example.FEATURE_KEYS,
                                           aside)
        # The splits' seeds and labels, small beside the graph: saved in
        # the partitions' node ids for the trainer.
        splits = [item_set[0:len(item_set)] for item_set in item_sets]
        del dataset, item_sets
        gc.collect()
        options = {
            "part_method": args.part_method,
            "balance_train": args.balance_train,
            "balance_edges": args.balance_edges,
            "use_graphbolt": args.use_graphbolt,
        }
        part_config, orig_nids = partition(
            g, graph_name, args.num_parts, args.out, options
        )
        del g
        gc.collect()
        add_features(part_config, orig_nids, feature_paths)
    finally:
        shutil.rmtree(aside, ignore_errors=True)
    import torch

    torch.save(orig_nids, os.path.join(
        args.out, gbrun.dgl_engine.files.ORIG_NIDS_FILE))
    gbrun.dgl_engine.files.save_item_sets(args.out, splits, orig_nids)
    info_path = gbrun.dgl_engine.files.write_dataset_info(args.out, info)
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
