"""
The route past one machine's partitioning: a GraphBolt OnDiskDataset
written as the chunked input of DGL's distributed partitioning pipeline,
and what the trainer reads beside the partitions that pipeline writes.

partition_graph.py holds the whole graph in memory (about 200 bytes an
edge while it partitions); DGL's pipeline (its tools/ at v2.1.0, not part
of the wheel) splits the work across machines instead. `write` reads the
dataset's .npy files a slice at a time and writes them one chunk at a
time, so its memory is a chunk's, never the graph's; `finish` runs after the
pipeline (docs/distributed.md#partitioning-at-scale):

    python distributed/chunk_dataset.py write --dataset D --out C \
        --num-chunks 4
    # DGL's tools (v2.1.0): assign nodes, then write the partitions
    python dgl/tools/partition_algo/random_partition.py --in_dir C \
        --out_dir C/assignment --num_partitions 2
    python dgl/tools/dispatch_data.py --in-dir C --partitions-dir \
        C/assignment --out-dir P --ip-config ip_config.txt --save-orig-nids
    python distributed/chunk_dataset.py finish --chunked C --partitions P
    # Train: --part-config P/metadata.json

`write` checks the dataset as the example does (its FEATURE_KEYS,
LABEL_KEY and LABELS, of --example) and writes C/metadata.json (DGL's
format), the edges as space-separated text chunks (src dst, as DGL's
chunk_graph.py writes them), the features, labels (-1, or zero rows, for
nodes outside the splits) and split masks as .npy chunks, and, for
`finish`, the checked item sets and dataset_info.json. `finish` writes
into P what partition_graph.py writes beside its partitions: orig_nids.pt
(entry i: the dataset id of node i of the partitioned graph, from the
pipeline's per-partition orig_nids.dgl), item_sets.pt (the splits in
those ids) and dataset_info.json.
"""
import json
import os

import gbrun.cli
import gbrun.data.datasets
import gbrun.data.splits
import gbrun.dgl_engine.files

# numpy, torch and yaml are imported where they are used: a bad argument is
# refused before they load.

NTYPE, ETYPE = "_N", "_N:_E:_N"  # a homogeneous graph's types, as DGL names them
# The item sets in the dataset's node ids, kept beside the chunks until
# `finish` renumbers them as the partitions do
# (gbrun.dgl_engine.files.ITEM_SETS_FILE).
DATASET_ID_ITEM_SETS_FILE = "item_sets_dataset_ids.pt"


def read_metadata(dataset):
    """The dataset's metadata.yaml, every file it names checked as data
    inside the dataset (gbrun.data.metadata), as the example checks it."""
    from gbrun.data.metadata import MetadataError, checked_files
    from gbrun.data.metadata import read_metadata as read

    if not os.path.isfile(os.path.join(dataset, "metadata.yaml")):
        raise gbrun.cli.UsageError(f"--dataset {dataset}: no metadata.yaml")
    try:
        metadata = read(dataset)
        checked_files(dataset, metadata)
    except MetadataError as error:
        raise gbrun.cli.UsageError(f"--dataset {dataset}: {error}") from None
    return metadata


def mapped(dataset, entry, what):
    """The .npy file of a metadata.yaml entry, memory-mapped (for node-sized
    arrays; the edges and features are read with NpyRows); another format
    is refused."""
    import numpy as np

    return np.load(npy_path(dataset, entry, what), mmap_mode="r")


def npy_path(dataset, entry, what):
    if entry.get("format") != "numpy":
        raise gbrun.cli.UsageError(
            f"--dataset {dataset}: {what} stored as "
            f"{entry.get('format')!r}; chunking reads .npy files (format: "
            "numpy) a slice at a time instead of loading them")
    return os.path.join(dataset, entry["path"])


class NpyRows:
    """Slices of a C-ordered .npy file read with plain reads: a memory map
    would count every page it touched in the process's memory, up to the
    whole file. rows(start, end) of an (N, ...) array; columns(start, end)
    of a (2, E) one (the edges)."""

    def __init__(self, path):
        import numpy as np

        self.path = path
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read_header = (np.lib.format.read_array_header_1_0
                           if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            self.shape, fortran, self.dtype = read_header(f)
            self.offset = f.tell()
        if fortran:
            raise gbrun.cli.UsageError(
                f"{path}: stored in Fortran order; save it C-ordered "
                "(numpy.ascontiguousarray)")
        self.ndim = len(self.shape)
        self.row = int(np.prod(self.shape[1:], dtype=np.int64))

    def _read(self, first, count):
        import numpy as np

        with open(self.path, "rb") as f:
            f.seek(self.offset + first * self.dtype.itemsize)
            return np.fromfile(f, self.dtype, count)

    def rows(self, start, end):
        return self._read(start * self.row, (end - start) * self.row
                          ).reshape(end - start, *self.shape[1:])

    def columns(self, start, end):
        import numpy as np

        return np.stack([self._read(i * self.shape[1] + start, end - start)
                         for i in range(self.shape[0])])


def node_feature(dataset, metadata, name, rows=False):
    """The node feature `name` (memory-mapped, or `rows`: its NpyRows), or
    None."""
    for entry in metadata.get("feature_data", []):
        if entry.get("domain") == "node" and entry.get("name") == name:
            what = f"node feature '{name}'"
            return (NpyRows(npy_path(dataset, entry, what)) if rows
                    else mapped(dataset, entry, what))
    return None


def checked_splits(dataset, metadata, label_key, labels):
    """(seeds, labels) of train, validation and test, checked as the
    example checks them (gbrun.data.datasets.checked_labels). Small beside the
    graph: one entry per labelled node."""
    import numpy as np
    import torch

    task = metadata["tasks"][0]
    if "num_classes" not in task:
        raise gbrun.cli.UsageError(
            f"dataset '{dataset}': its task has no num_classes in "
            "metadata.yaml")
    num_classes = int(task["num_classes"])
    splits = []
    for split in gbrun.data.splits.ATTRIBUTES:
        data = {d["name"]: d for d in (task.get(split) or [{}])[0].get(
            "data", [])}
        if "seed_nodes" not in data:
            raise gbrun.cli.UsageError(
                f"dataset '{dataset}' has an empty {split}")
        seeds = np.asarray(mapped(dataset, data["seed_nodes"],
                                  f"the {split}'s seed_nodes"))
        if "labels" in data:
            values = np.array(mapped(dataset, data["labels"],
                                       f"the {split}'s labels"))
            where = f"dataset '{dataset}': the {split}'s labels"
        else:
            feature = node_feature(dataset, metadata, label_key)
            if feature is None:
                raise gbrun.cli.UsageError(
                    f"dataset '{dataset}': the {split} has no labels and "
                    f"there is no node feature named '{label_key}'")
            values = np.array(feature[np.sort(seeds)])[
                np.argsort(np.argsort(seeds))]
            where = (f"dataset '{dataset}': node feature '{label_key}' "
                     f"(the {split}'s labels)")
        values = gbrun.data.datasets.checked_labels(
            torch.from_numpy(values), num_classes, labels, where)
        splits.append((torch.from_numpy(seeds.astype(np.int64)), values))
    return splits, num_classes


def chunk_sizes(total, num_chunks):
    return [total // num_chunks + (i < total % num_chunks)
            for i in range(num_chunks)]


def write_rows(array, sizes, path_format, out):
    """`array`'s rows in chunks of `sizes`, each to a .npy file; returns
    the paths (relative to `out`). One chunk in memory at a time."""
    import numpy as np

    paths, start = [], 0
    for index, size in enumerate(sizes):
        path = path_format % index
        os.makedirs(os.path.dirname(os.path.join(out, path)), exist_ok=True)
        np.save(os.path.join(out, path),
                np.ascontiguousarray(array(start, start + size)))
        paths.append(path)
        start += size
    return paths


def write_edges(edges, sizes, out):
    """The (2, E) edge array as DGL's chunked edge files: one "src dst"
    line per edge, a file per chunk, written in slices of a million."""
    import numpy as np

    os.makedirs(os.path.join(out, "edge_index"), exist_ok=True)
    paths, start = [], 0
    for index, size in enumerate(sizes):
        path = os.path.join("edge_index", f"{ETYPE}{index}.txt")
        with open(os.path.join(out, path), "w") as f:
            for begin in range(start, start + size, 1 << 20):
                end = min(begin + (1 << 20), start + size)
                np.savetxt(f, edges.columns(begin, end).T, fmt="%d")
        paths.append(path)
        start += size
    return paths


def write(args):
    import numpy as np
    import torch

    example = gbrun.cli.load_example(
        args.example, ("FEATURE_KEYS", "LABEL_KEY", "LABELS"))
    if isinstance(example.FEATURE_KEYS, dict):
        raise gbrun.cli.UsageError(
            f"{example.__file__}: FEATURE_KEYS per node type (a graph of "
            "several node types): chunk_dataset.py writes graphs of one "
            "node type; partition this one with partition_graph.py")
    metadata = read_metadata(args.dataset)
    graph = metadata.get("graph", {})
    if len(graph.get("nodes", [])) != 1 or len(graph.get("edges", [])) != 1:
        raise gbrun.data.datasets.heterogeneous(
            args.dataset, [str(n.get("type")) for n in graph.get("nodes", [])],
            [str(e.get("type")) for e in graph.get("edges", [])])
    num_nodes = int(graph["nodes"][0]["num"])
    edges = NpyRows(npy_path(args.dataset, graph["edges"][0],
                             "the graph's edges"))
    if edges.ndim != 2 or edges.shape[0] != 2:
        raise gbrun.cli.UsageError(
            f"--dataset {args.dataset}: edges of shape {list(edges.shape)}, "
            "expected (2, num_edges)")
    features = {}
    for key in example.FEATURE_KEYS:
        features[key] = node_feature(args.dataset, metadata, key, rows=True)
        if features[key] is None or features[key].shape[0] != num_nodes \
                or features[key].ndim != 2:
            raise gbrun.cli.UsageError(
                f"--dataset {args.dataset}: no node feature '{key}' of one "
                f"row per node ({num_nodes})")
    if args.num_chunks > min(num_nodes, edges.shape[1]):
        raise gbrun.cli.UsageError(
            f"--num-chunks {args.num_chunks}: more than the graph's "
            f"{num_nodes} nodes or {edges.shape[1]} edges (a chunk would be "
            "empty)")
    splits, num_classes = checked_splits(
        args.dataset, metadata, example.LABEL_KEY, example.LABELS)
    node_sizes = chunk_sizes(num_nodes, args.num_chunks)
    edge_sizes = chunk_sizes(edges.shape[1], args.num_chunks)
    out = args.out
    os.makedirs(out, exist_ok=True)
    node_data = {}
    for key, feature in features.items():
        node_data[key] = write_rows(feature.rows, node_sizes,
                                    f"node_data/{key}-%d.npy", out)
    # Labels and masks, a chunk at a time from the splits' sorted seeds.
    label_shape, label_dtype = splits[0][1].shape[1:], splits[0][1].numpy().dtype
    seeds = torch.cat([s for s, _ in splits]).numpy()
    values = torch.cat([v for _, v in splits]).numpy()
    order = np.argsort(seeds, kind="stable")
    seeds, values = seeds[order], values[order]
    split_of = np.repeat(np.arange(3), [len(s) for s, _ in splits])[order]

    def rows(start, end):
        low, high = np.searchsorted(seeds, [start, end])
        return low, high

    def labels(start, end):
        low, high = rows(start, end)
        chunk = np.full((end - start, *label_shape),
                        -1 if not label_shape else 0, dtype=label_dtype)
        chunk[seeds[low:high] - start] = values[low:high]
        return chunk

    node_data[example.LABEL_KEY] = write_rows(
        labels, node_sizes, f"node_data/{example.LABEL_KEY}-%d.npy", out)
    for index, mask in enumerate(gbrun.data.splits.MASKS):
        def split_mask(start, end, index=index):
            low, high = rows(start, end)
            chunk = np.zeros(end - start, dtype=bool)
            chunk[seeds[low:high][split_of[low:high] == index] - start] = True
            return chunk

        node_data[mask] = write_rows(split_mask, node_sizes,
                                     f"node_data/{mask}-%d.npy", out)
    graph_name = args.graph_name or os.path.basename(
        os.path.normpath(args.dataset))
    chunked = {
        "graph_name": graph_name,
        "node_type": [NTYPE],
        "num_nodes_per_type": [num_nodes],
        "num_nodes_per_chunk": [node_sizes],
        "edge_type": [ETYPE],
        "num_edges_per_chunk": [edge_sizes],
        "edges": {ETYPE: {"format": {"name": "csv", "delimiter": " "},
                          "data": write_edges(edges, edge_sizes, out)}},
        "node_data": {NTYPE: {key: {"format": {"name": "numpy"},
                                    "data": paths}
                              for key, paths in node_data.items()}},
        "edge_data": {},
    }
    with open(os.path.join(out, "metadata.json"), "w") as f:
        json.dump(chunked, f, indent=2)
    torch.save(splits, os.path.join(out, DATASET_ID_ITEM_SETS_FILE))
    info = gbrun.dgl_engine.files.dataset_info(
        graph_name, num_classes,
        {key: feature.shape[1] for key, feature in features.items()},
        example, len(splits[0][0]))
    gbrun.dgl_engine.files.write_dataset_info(out, info)
    print(f"Graph {graph_name}: {num_nodes} nodes, {edges.shape[1]} edges in "
          f"{args.num_chunks} chunks -> {os.path.abspath(out)}/metadata.json")


def finish(args):
    import dgl
    import torch

    config_path = os.path.join(args.partitions, "metadata.json")
    for path in (config_path, os.path.join(args.chunked, DATASET_ID_ITEM_SETS_FILE)):
        if not os.path.isfile(path):
            raise gbrun.cli.UsageError(f"{path} does not exist")
    with open(config_path) as f:
        config = json.load(f)
    orig_nids = []
    for part_id in range(config["num_parts"]):
        path = os.path.join(args.partitions, f"part{part_id}", "orig_nids.dgl")
        if not os.path.isfile(path):
            raise gbrun.cli.UsageError(
                f"{path} does not exist: run DGL's pipeline with "
                "--save-orig-nids")
        orig_nids.append(dgl.data.utils.load_tensors(path)[NTYPE])
    # Each partition owns a contiguous range of the new ids, in order.
    orig_nids = torch.cat(orig_nids).long()
    torch.save(orig_nids, os.path.join(args.partitions,
                                       gbrun.dgl_engine.files.ORIG_NIDS_FILE))
    splits = torch.load(os.path.join(args.chunked, DATASET_ID_ITEM_SETS_FILE),
                        weights_only=True)
    gbrun.dgl_engine.files.save_item_sets(args.partitions, splits, orig_nids)
    with open(os.path.join(args.chunked,
                           gbrun.dgl_engine.files.DATASET_INFO_FILE)) as f:
        info = json.load(f)
    info["graph_name"] = config["graph_name"]
    gbrun.dgl_engine.files.write_dataset_info(args.partitions, info)
    print(f"Partition config: {os.path.abspath(config_path)}")


def parse_args(argv=None):
    parser = gbrun.cli.ArgumentParser(
        description="Chunk an OnDiskDataset for DGL's distributed "
        "partitioning pipeline (write), and complete its partitions for the "
        "trainer (finish).")
    steps = parser.add_subparsers(dest="step", required=True)
    w = steps.add_parser("write", help="the dataset as DGL's chunked input")
    w.add_argument("--dataset", required=True,
                   help="OnDiskDataset directory (metadata.yaml, .npy files)")
    w.add_argument("--out", required=True, help="the chunked input directory")
    w.add_argument("--num-chunks", type=gbrun.cli.int_at_least(1),
                   required=True, help="chunks of nodes and of edges (a "
                   "multiple of the machines that run the pipeline)")
    w.add_argument("--example", type=gbrun.cli.python_file,
                   default=gbrun.cli.SHIPPED_EXAMPLE, help="the example whose "
                   "FEATURE_KEYS, LABEL_KEY and LABELS are written")
    w.add_argument("--graph-name", default=None,
                   help="Default: the dataset directory's name.")
    f = steps.add_parser("finish", help="orig_nids.pt, item_sets.pt and "
                         "dataset_info.json beside the pipeline's partitions")
    f.add_argument("--chunked", required=True,
                   help="the directory `write` wrote")
    f.add_argument("--partitions", required=True,
                   help="the pipeline's output directory (metadata.json)")
    for sub in (w, f):
        sub.error = parser.error  # one line, exit 2
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        (write if args.step == "write" else finish)(args)
    except gbrun.cli.UsageError as error:
        gbrun.cli.fail(error)


if __name__ == "__main__":
    main()
