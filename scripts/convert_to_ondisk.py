"""Convert your own graph (numpy / CSV files) into a GraphBolt OnDiskDataset.

    python scripts/convert_to_ondisk.py datasets/mygraph \\
        --edges edges.csv --features feat.npy --labels labels.npy
    python scripts/convert_to_ondisk.py datasets/mygraph --edges edges.npy \\
        --features feat.npy --labels labels.npy \\
        --train-idx train.npy --val-idx val.npy --test-idx test.npy \\
        --add-reverse-edges --drop-self-loops --force
    python scripts/convert_to_ondisk.py datasets/mygraph --edges edges.npy \\
        --features feat.npy --feature degree=degree.npy --labels tags.npy
    python node_classification.py --dataset datasets/mygraph

Inputs:
  --edges      .npy of shape (2, E) or (E, 2) (a (2, 2) array is read as
               (2, E)), or a two-column CSV "src,dst" (comma, tab or space
               separated) with an optional header line. Node ids start at 0.
  --features   .npy float array (N, F); N is the number of nodes: the node
               feature "feat".
  --feature NAME=FILE   another node feature NAME, a .npy float array
               (N, F_k); repeatable.
  --labels     .npy integer array (N,), classes 0 .. C-1; or a multi-hot
               (N, C) array of 0/1, several classes per node; or, with
               --label-kind value, a float array (N,) or (N, D) of values
               to regress (node regression, docs/customising.md).
  --train-idx --val-idx --test-idx   .npy node id arrays (all three), or
  --split      random train,val,test fractions (default 0.6,0.2,0.2).

A link-prediction task beside the node task (the pairs as --edges; the
negatives .npy integer arrays (E, K), a row of K destinations per pair):
  --link-split V,T --link-negatives K   a split made here: fractions V and
               T of the graph's distinct pairs are the validation and test
               pairs (out of the graph, both ways), K random negatives each
               (--seed); or your own split, all four of
  --link-valid --link-valid-negatives --link-test --link-test-negatives
               the pairs a model is scored on and their negatives;
  --link-train the pairs it learns from (default: the graph's edges but
               the evaluation pairs, either way round).
A pair is undirected ((u, v) and (v, u) are one fact) unless --directed.
Every way the evaluation pairs reach a model is printed, then refused in one
line (docs/own-data.md#what-leaks): a graph or train pairs that hold them
or their reverse (--drop-leaked-edges takes them out of both;
--keep-leaked-edges keeps the graph's), and a pair in both sets.

Several node and edge types (users and items, papers and authors) instead
of --edges and --features:
  --node-type NAME=COUNT       a node type and its number of nodes; repeatable.
  --edge-type SRC:REL:DST=FILE the edges of one edge type (as --edges, ids
               within each end's type); repeatable.
  --type-features TYPE=FILE    the node feature "feat" of one type (a .npy
               float array, one row per node of it); repeatable, optional.
  --target TYPE                the node type that --labels and the splits
               are on (ids within it).
  --link-relation SRC:REL:DST  with the --link-... inputs: a link task on
               this edge type (pairs as its edges; negatives of DST);
  --link-reverse-relation DST:REL2:SRC  the edge type holding its edges
               the other way round: the graph's leaks are looked for, and
               --drop-leaked-edges drops them, in both (needed where the
               graph has an edge type from DST to SRC; 'none' if none of
               them holds the relation's edges the other way round).

    python scripts/convert_to_ondisk.py datasets/shop \
        --node-type user=1000 --node-type item=500 \
        --edge-type user:buys:item=buys.npy \
        --edge-type item:bought-by:user=bought_by.npy \
        --type-features user=user_feat.npy --type-features item=item_feat.npy \
        --target user --labels user_labels.npy

Exit status: 0 on success, 2 on any error (bad arguments or bad data). Data
errors print one line "convert_to_ondisk.py: error: <message>" to stderr
and create nothing.
"""

import argparse
import sys

import numpy as np

from gbrun.data import inputs, links, ondisk, outdir, typed_links
from gbrun.data.labels import KINDS as LABEL_KINDS
from gbrun.cli import ArgumentParser, int_at_least

NPY_MAGIC = b"\x93NUMPY"
ERROR_EXIT = 2  # the same status argparse uses for usage errors


# ------------------------------------------------------------------ reading


def load_npy(path):
    """Load a .npy file, memory-mapped so big inputs are not copied."""
    try:
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError:
            array = np.load(path, allow_pickle=False)  # e.g. empty arrays cannot be mapped
    except FileNotFoundError:
        raise inputs.DatasetError(f"{path}: no such file") from None
    except (OSError, ValueError, EOFError) as err:
        raise inputs.DatasetError(f"{path}: cannot read as a .npy array: {_one_line(err)}") from None
    if not isinstance(array, np.ndarray):
        raise inputs.DatasetError(f"{path}: expected a single .npy array, not an .npz archive")
    return array


def _one_line(err):
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def _is_npy(path):
    try:
        with open(path, "rb") as f:
            return f.read(len(NPY_MAGIC)) == NPY_MAGIC
    except FileNotFoundError:
        raise inputs.DatasetError(f"{path}: no such file") from None
    except OSError as err:
        raise inputs.DatasetError(f"{path}: cannot read: {_one_line(err)}") from None


def _is_number(text):
    try:
        float(text)
        return True
    except ValueError:
        return False


def _csv_layout(path):
    """(separator, has_header) from the first line of an edge CSV."""
    try:
        with open(path) as f:
            first = f.readline().strip()
    except UnicodeDecodeError:
        raise inputs.DatasetError(f"{path}: neither a .npy file nor a text CSV") from None
    if not first:
        raise inputs.DatasetError(f"{path}: empty first line, expected src,dst lines")
    sep = "," if "," in first else ("\t" if "\t" in first else r"\s+")
    fields = first.split(",") if sep == "," else first.split()
    # A header is a first line that is not numbers, like "src,dst".
    has_header = not all(_is_number(field.strip()) for field in fields)
    return sep, has_header


def _int64_cells(col):
    """Boolean array: True where a CSV cell (str) is an integer that fits in int64."""
    text = col.str.strip()
    ok = np.array(text.str.fullmatch(r"-?\d+"), dtype=bool)
    for i in np.flatnonzero(ok & (text.str.len() >= 19).to_numpy()):  # rare: may overflow
        ok[i] = -(2**63) <= int(text.iloc[i]) < 2**63
    return ok


def _first_bad_csv_line(pd, path, sep, skip):
    """Slow path, only after a failure: describe the first non-integer row."""
    # Blank lines are kept (and then ignored) so that row i is line i + 1 + skip.
    frame = pd.read_csv(
        path, sep=sep, header=None, skiprows=skip, dtype=str, keep_default_na=False,
        skip_blank_lines=False,
    ).fillna("")
    if frame.shape[1] != 2:
        return f"expected 2 columns (src, dst), got {frame.shape[1]}"
    blank = (frame == "").all(axis=1).to_numpy()
    is_int = _int64_cells(frame[0]) & _int64_cells(frame[1])
    bad = np.flatnonzero(~is_int & ~blank)
    if bad.size == 0:
        return "expected two integer node ids per line"
    row = int(bad[0])
    shown = (sep if sep != r"\s+" else " ").join(frame.iloc[row])
    return f"line {row + 1 + skip}: expected two integer node ids, got {shown!r}"


def load_edges_csv(path):
    """Read a two-column integer CSV into a (2, E) int64 array."""
    import pandas as pd  # only CSV input needs it

    sep, has_header = _csv_layout(path)
    skip = int(has_header)
    try:
        frame = pd.read_csv(path, sep=sep, header=None, skiprows=skip, dtype=np.int64)
    except pd.errors.EmptyDataError:
        raise inputs.DatasetError(f"{path}: no edges") from None
    except pd.errors.ParserError as err:
        raise inputs.DatasetError(f"{path}: cannot parse as CSV: {_one_line(err)}") from None
    except UnicodeDecodeError as err:
        raise inputs.DatasetError(f"{path}: not a text file: {_one_line(err)}") from None
    except (ValueError, TypeError, OverflowError):
        raise inputs.DatasetError(f"{path}: {_first_bad_csv_line(pd, path, sep, skip)}") from None
    if frame.shape[1] != 2:
        raise inputs.DatasetError(f"{path}: expected 2 columns (src, dst), got {frame.shape[1]}")
    if any(dtype != np.int64 for dtype in frame.dtypes):  # e.g. uint64 for ids >= 2**63
        raise inputs.DatasetError(f"{path}: {_first_bad_csv_line(pd, path, sep, skip)}")
    return frame.to_numpy().T


def load_edges(path):
    """Edges from .npy ((2, E) or (E, 2)) or CSV, as a (2, E) array."""
    if not _is_npy(path):
        return load_edges_csv(path)
    edges = load_npy(path)
    if edges.ndim == 2 and edges.shape[0] == 2:
        return edges
    if edges.ndim == 2 and edges.shape[1] == 2:
        return edges.T  # a view; the writer transposes block by block
    raise inputs.DatasetError(f"{path}: expected edges of shape (2, E) or (E, 2), got {edges.shape}")


# ------------------------------------------------------------ the command


def named_file(text):
    """argparse type of --feature: NAME=FILE."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=FILE, got {text!r}")
    return name, path


def parse_args(argv=None):
    parser = ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="Exit status: 0 on success, 2 on any error.",
    )
    parser.add_argument("out_dir", help="dataset directory to create")
    parser.add_argument("--edges", help="edges .npy (2,E)/(E,2) or two-column CSV")
    parser.add_argument("--features", help="node features .npy, float (N, F)")
    parser.add_argument("--feature", action="append", default=[], type=named_file, metavar="NAME=FILE",
                        help="another node feature NAME from a .npy float (N, F_k); repeatable")
    parser.add_argument("--labels", required=True,
                        help="node labels .npy, int (N,), or multi-hot (N, C) of 0/1")
    parser.add_argument("--train-idx", help="train node ids .npy")
    parser.add_argument("--val-idx", help="validation node ids .npy")
    parser.add_argument("--test-idx", help="test node ids .npy")
    parser.add_argument("--split", type=inputs.split_argument, help="random train,val,test fractions (default 0.6,0.2,0.2)")
    parser.add_argument("--label-kind", choices=LABEL_KINDS,
                        help="what --labels holds (default: class for (N,), multi-hot for (N, C))")
    parser.add_argument("--num-classes", type=int_at_least(1), help="number of classes (default: max label + 1)")
    parser.add_argument("--add-reverse-edges", action="store_true", help="make every edge go both ways")
    parser.add_argument("--drop-self-loops", action="store_true", help="remove src == dst edges")
    parser.add_argument("--seed", type=int_at_least(0), default=0, help="seed of the random --split")
    parser.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    link = parser.add_argument_group("a link-prediction task")
    link.add_argument("--link-split", type=link_fractions, metavar="V,T",
                      help="hold out these fractions of the graph's pairs as validation and "
                      "test pairs")
    link.add_argument("--link-negatives", type=int_at_least(1), metavar="K",
                      help="with --link-split: random negatives per evaluation pair")
    for option, (_, what) in LINK_OPTIONS.items():
        link.add_argument(option, metavar="FILE", help=what)
    link.add_argument("--directed", action="store_true",
                      help="(u, v) and (v, u) are two facts: only a pair itself is its answer")
    leaked = link.add_mutually_exclusive_group()
    leaked.add_argument("--drop-leaked-edges", action="store_true",
                        help="take the evaluation pairs out of the graph and the train pairs")
    leaked.add_argument("--keep-leaked-edges", action="store_true",
                        help="keep evaluation pairs the graph holds, with a warning")
    link.add_argument("--link-relation", metavar="SRC:REL:DST",
                      help="with --node-type: the edge type of the link task's pairs")
    link.add_argument("--link-reverse-relation", metavar="DST:REL:SRC",
                      help="with --link-relation: the edge type holding its edges the other "
                      "way round, which leaks and --drop-leaked-edges also look in ('none': "
                      "no edge type does)")
    hetero = parser.add_argument_group("several node and edge types")
    hetero.add_argument("--node-type", action="append", default=[], type=named_count,
                        metavar="NAME=COUNT", help="a node type and its node count; repeatable")
    hetero.add_argument("--edge-type", action="append", default=[], type=named_file,
                        metavar="SRC:REL:DST=FILE", help="one edge type's edges; repeatable")
    hetero.add_argument("--type-features", action="append", default=[], type=named_file,
                        metavar="TYPE=FILE", help="one node type's feature \"feat\"; repeatable")
    hetero.add_argument("--target", help="the node type of --labels and the splits")
    args = parser.parse_args(argv)
    check_link_args(parser, args)
    if args.node_type:
        check_hetero_args(parser, args)
    else:
        for option in ("edge_type", "type_features", "target"):
            if getattr(args, option):
                parser.error(f"--{option.replace('_', '-')} needs --node-type (several node types)")
        for option in ("edges", "features"):
            if getattr(args, option) is None:
                parser.error(f"the following arguments are required: --{option}")
    idx_files = [args.train_idx, args.val_idx, args.test_idx]
    if any(idx_files) and not all(idx_files):
        parser.error("give all three of --train-idx, --val-idx, --test-idx, or none (then --split is used)")
    if all(idx_files) and args.split is not None:
        parser.error("give either the three index files or --split, not both")
    if not any(idx_files) and args.split is None:
        args.split = (0.6, 0.2, 0.2)
    names = [name for name, _ in args.feature]
    if len(set(names)) != len(names):
        parser.error(f"--feature: the name {max(names, key=names.count)!r} is given twice")
    return args


# The link task's options: the input each reads (as messages name it) and
# its help.
LINK_OPTIONS = {
    "--link-train": ("link train", "train pairs (as --edges; default: every edge of the graph)"),
    "--link-valid": ("link validation", "validation pairs (as --edges)"),
    "--link-valid-negatives": ("link validation negatives", "validation negatives .npy, int (E, K)"),
    "--link-test": ("link test", "test pairs (as --edges)"),
    "--link-test-negatives": ("link test negatives", "test negatives .npy, int (E, K)"),
}


def link_dest(option):
    return option[2:].replace("-", "_")


def link_fractions(text):
    """argparse type of --link-split: V,T, two fractions summing below 1."""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        values = []
    if len(values) != 2 or not all(0 < v < 1 for v in values) or sum(values) >= 1:
        raise argparse.ArgumentTypeError(
            f"expected two fractions V,T above 0 with V + T < 1, like 0.05,0.05, got {text!r}")
    return tuple(values)


def check_link_args(parser, args):
    """A link task's options: --link-split with --link-negatives, or the
    four evaluation inputs; the rest only with one of them. With
    --node-type, the four inputs and --link-relation, the pairs' edge
    type."""
    files = [option for option in LINK_OPTIONS if getattr(args, link_dest(option))]
    modifiers = [option for option in ("--directed", "--drop-leaked-edges", "--keep-leaked-edges")
                 if getattr(args, link_dest(option))]
    given = (["--link-split"] if args.link_split else []) + files + modifiers
    typed = [f"--{name.replace('_', '-')}" for name in ("link_relation", "link_reverse_relation")
             if getattr(args, name)]
    if typed and not (args.node_type and given):
        parser.error(f"{typed[0]} names the edge type of a link task (--link-valid ...) on a "
                     "graph of several node types (--node-type)")
    if args.link_negatives and not args.link_split:
        parser.error("--link-negatives needs --link-split V,T (the split it draws negatives for)")
    if not given:
        return
    if args.node_type and args.link_split:
        parser.error("--link-split is for a graph of one node type; with --node-type give the "
                     "four evaluation inputs and --link-relation")
    if args.node_type and not args.link_relation:
        parser.error(f"{given[0]} with --node-type needs --link-relation SRC:REL:DST, the "
                     "edge type of the pairs")
    if args.link_split:
        if files:
            parser.error(f"{files[0]}: --link-split makes the link task's pairs; give one or the other")
        if not args.link_negatives:
            parser.error("--link-split needs --link-negatives K (negatives per evaluation pair)")
        return
    missing = [option for option in list(LINK_OPTIONS)[1:] if not getattr(args, link_dest(option))]
    if missing:
        parser.error(f"{given[0]} needs {', '.join(missing)} (a link task's four evaluation "
                     "inputs), or --link-split V,T --link-negatives K")


def load_link_task(args, edges, num_nodes, names):
    """(the graph's edges, a links.LinkTask or None without the options,
    what --drop-leaked-edges took out or None): split here, or read; with
    --drop-leaked-edges the graph and the train pairs lose the evaluation
    pairs (the writer checks what is left)."""
    if args.link_split:
        inputs.check_edges(edges, num_nodes, names)
        return (*links.split(edges, num_nodes, args.link_split, args.link_negatives,
                             np.random.default_rng(args.seed), args.directed), None)
    if not args.link_valid:
        return edges, None, None
    valid, test = load_edges(args.link_valid), load_edges(args.link_test)
    # Taking pairs out needs valid ids; the writer checks everything again.
    for split, pairs in (("validation", valid), ("test", test)):
        inputs.check_edges(pairs, num_nodes, {"edges": names[f"link {split}"],
                                              "features": names["features"]})
    task = links.LinkTask(edges, valid, load_npy(args.link_valid_negatives), test,
                          load_npy(args.link_test_negatives), args.directed)
    if args.link_train:
        task.train = load_edges(args.link_train)
    else:  # never an evaluation pair (or, undirected, its reverse)
        task.train = links.without_pairs(edges, task.evaluated(), num_nodes,
                                         either_way=not args.directed)
    if not args.drop_leaked_edges:
        return edges, task, None
    inputs.check_edges(task.train, num_nodes, {"edges": names["link train"],
                                               "features": names["features"]})
    return links.drop_leaked(edges, task, num_nodes)


def named_count(text):
    """argparse type of --node-type: NAME=COUNT."""
    name, sep, count = text.partition("=")
    if not sep or not name or not count.isdigit() or int(count) < 1:
        raise argparse.ArgumentTypeError(f"expected NAME=COUNT (a positive count), got {text!r}")
    return name, int(count)


def check_hetero_args(parser, args):
    """With --node-type: the heterogeneous options, and none of the
    homogeneous graph's."""
    for option in ("edges", "features", "feature"):
        if getattr(args, option):
            parser.error(f"--{option} is for a graph of one node type; with --node-type give "
                         "--edge-type and --type-features")
    for option in ("add_reverse_edges", "drop_self_loops"):
        if getattr(args, option):
            parser.error(f"--{option.replace('_', '-')} is for a graph of one node type; give "
                         "each edge type's reverse as an --edge-type of its own")
    if not args.edge_type:
        parser.error("--node-type needs at least one --edge-type SRC:REL:DST=FILE")
    if not args.target:
        parser.error("--node-type needs --target, the node type of --labels")
    for option, pairs in (("--node-type", args.node_type), ("--edge-type", args.edge_type),
                          ("--type-features", args.type_features)):
        names = [name for name, _ in pairs]
        if len(set(names)) != len(names):
            parser.error(f"{option}: {max(names, key=names.count)!r} is given twice")


def load_splits(args, num_nodes):
    """(train, val, test) node ids: from the index files or a random split."""
    if args.split is None:
        return tuple(load_npy(path) for path in (args.train_idx, args.val_idx, args.test_idx))
    return inputs.split_nodes(num_nodes, args.split, seed=args.seed)


def convert_hetero(args):
    """Several node and edge types: read, and write with the checks of
    ondisk.write_hetero_dataset."""
    outdir.check_out_dir(args.out_dir, args.force, input_paths(args))
    num_nodes = dict(args.node_type)
    if args.target not in num_nodes:
        raise inputs.DatasetError(
            f"--target {args.target}: not one of the node types: {', '.join(sorted(num_nodes))}")
    edges = {etype: load_edges(path) for etype, path in args.edge_type}
    features = {ntype: load_npy(path) for ntype, path in args.type_features}
    train, val, test = load_splits(args, num_nodes[args.target])
    link_task = dropped = None
    if args.link_valid:
        edges, link_task, dropped = load_typed_link_task(args, edges, num_nodes)
    summary = ondisk.write_hetero_dataset(
        args.out_dir, num_nodes, edges, load_npy(args.labels), train, val, test,
        args.target, features=features, num_classes=args.num_classes,
        force=args.force, kind=args.label_kind, inputs=input_paths(args),
        link_task=link_task, relation=args.link_relation,
        reverse=args.link_reverse_relation, link_names=link_names(args),
        keep_leaked_edges=args.keep_leaked_edges)
    return {**summary, "dropped": dropped}


def link_names(args):
    """How messages name a link task's inputs: their files."""
    names = {key: getattr(args, link_dest(option)) for option, (key, _) in LINK_OPTIONS.items()}
    if not args.link_train:
        names["link train"] = f"the edges of {args.link_relation} (the train pairs)"
    return {key: name for key, name in names.items() if name}


def load_typed_link_task(args, edges, num_nodes):
    """(the graph's edges, a links.LinkTask of --link-relation, what
    --drop-leaked-edges took out or None), as load_link_task reads one: the
    train pairs default to the relation's edges but the evaluation pairs,
    and --drop-leaked-edges takes the evaluation pairs out of the relation,
    the train pairs and, the other way round, --link-reverse-relation."""
    relation, reverse = args.link_relation, args.link_reverse_relation
    inputs.check_types(num_nodes, edges, {}, args.target)
    typed_links.check_relations(relation, reverse, list(edges))
    valid, test = load_edges(args.link_valid), load_edges(args.link_test)
    # Taking pairs out needs valid ids; the writer checks everything again.
    src, dst = typed_links.ends(relation)
    size = max(num_nodes[src], num_nodes[dst])
    for path, pairs in ((args.link_valid, valid), (args.link_test, test)):
        inputs.check_edges(pairs, size, {"edges": path, "features": f"node types {src} and {dst}"})
    task = links.LinkTask(edges[relation], valid, load_npy(args.link_valid_negatives), test,
                          load_npy(args.link_test_negatives), args.directed)
    if args.link_train:
        task.train = load_edges(args.link_train)
    else:  # never an evaluation pair (or, of one node type, its reverse)
        task.train = links.without_pairs(edges[relation], task.evaluated(), size,
                                         src == dst and not args.directed)
    if not args.drop_leaked_edges:
        return edges, task, None
    inputs.check_edges(task.train, size, {"edges": args.link_train or relation,
                                          "features": f"node types {src} and {dst}"})
    return typed_links.drop_leaked(edges, task, relation, reverse, num_nodes)


def input_paths(args):
    """Every file this command reads, which --force must not delete."""
    given = [args.edges, args.features, args.labels, args.train_idx,
             args.val_idx, args.test_idx]
    given += [getattr(args, link_dest(option)) for option in LINK_OPTIONS]
    given += [path for _, path in args.feature + args.edge_type
              + args.type_features]
    return [path for path in given if path]


def convert(args):
    """Read, transform and write; returns the writer's summary."""
    if args.node_type:
        return convert_hetero(args)
    names = {"edges": args.edges, "features": args.features, "labels": args.labels}
    names.update({f"feature {name}": path for name, path in args.feature})
    names.update({key: getattr(args, link_dest(option))
                  for option, (key, _) in LINK_OPTIONS.items()})
    if args.link_split:
        names.update({key: f"--link-split's {key[5:]}" for key, _ in LINK_OPTIONS.values()})
    if not args.link_train:
        names["link train"] = f"{args.edges} (the graph's edges, the train pairs)"
    if args.split is None:
        names.update(train=args.train_idx, validation=args.val_idx, test=args.test_idx)
    else:
        names.update(train="--split (train)", validation="--split (val)", test="--split (test)")
    names = inputs.display_names(names)
    outdir.check_out_dir(args.out_dir, args.force, input_paths(args))  # before reading big files
    features = load_npy(args.features)
    extra_features = {name: load_npy(path) for name, path in args.feature}
    labels = load_npy(args.labels)
    edges = load_edges(args.edges)
    if args.add_reverse_edges or args.drop_self_loops:
        # The transforms need valid ids; the writer checks everything again.
        inputs.check_features(features, names)
        inputs.check_edges(edges, features.shape[0], names)
        if args.drop_self_loops:
            edges = inputs.drop_self_loops(edges)
        if args.add_reverse_edges:
            edges = inputs.add_reverse_edges(edges)
    edges, link_task, dropped = load_link_task(
        args, edges, features.shape[0] if features.ndim else 0, names)
    train, val, test = load_splits(args, features.shape[0] if features.ndim else 0)
    summary = ondisk.write_ondisk_dataset(
        args.out_dir, edges, features, labels, train, val, test,
        num_classes=args.num_classes, force=args.force, input_names=names,
        extra_features=extra_features, kind=args.label_kind,
        inputs=input_paths(args), edges_as_given=(args.drop_self_loops,
                                                  args.add_reverse_edges),
        link_task=link_task, keep_leaked_edges=args.keep_leaked_edges,
    )
    return {**summary, "dropped": dropped}


def main(argv=None):
    args = parse_args(argv)
    try:
        summary = convert(args)
    except inputs.DatasetError as err:
        print(f"convert_to_ondisk.py: error: {err}", file=sys.stderr)
        return ERROR_EXIT
    sizes = summary["split_sizes"]
    classes = {"class": "classes", "multi-hot": "classes (multi-hot)",
               "value": "values per node"}[summary["label_kind"]]
    splits = f"train/val/test {sizes['train']}/{sizes['validation']}/{sizes['test']}"
    if args.node_type:
        nodes = ", ".join(f"{count} {ntype}" for ntype, count in summary["num_nodes"].items())
        edges = ", ".join(f"{count} {etype}" for etype, count in summary["num_edges"].items())
        print(f"wrote {args.out_dir}: nodes {nodes}; edges {edges}; {summary['num_classes']} "
              f"{classes} on {summary['target']}, {splits}")
        section = "several-node-and-edge-types"
        if summary["link_sizes"]:
            pairs = summary["link_sizes"]
            print(f"link task on {args.link_relation}: train/val/test {pairs['train']}/"
                  f"{pairs['validation']}/{pairs['test']} pairs")
            print_dropped(summary["dropped"])
            section = "link-prediction-on-a-relation-of-several-node-types"
        print(f"train with docs/customising.md's edit for several node types "
              f"(#{section}): --dataset {args.out_dir}")
        return 0
    extra = "".join(f", {name} {width}" for name, width in summary["extra_features"].items())
    print(
        f"wrote {args.out_dir}: {summary['num_nodes']} nodes, {summary['num_edges']} edges, "
        f"{summary['feat_dim']} features{extra}, {summary['num_classes']} {classes}, {splits}"
    )
    train = f"python node_classification.py --dataset {args.out_dir}"
    if summary["link_sizes"]:
        pairs = summary["link_sizes"]
        print(f"link task: train/val/test {pairs['train']}/{pairs['validation']}/"
              f"{pairs['test']} pairs")
        print_dropped(summary["dropped"])
        train += (f" (its node task), or python link_prediction.py --dataset "
                  f"{args.out_dir} (its link task)")
    print(f"train with: {train}")
    return 0


def print_dropped(dropped):
    if dropped:
        print("--drop-leaked-edges took {} edges out of the graph and {} out of the "
              "train pairs".format(*dropped))


if __name__ == "__main__":
    sys.exit(main())
