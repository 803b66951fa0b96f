"""Datasets as the example reads them: loading a GraphBolt dataset
(gbrun.data.loading, handed on here), the feature store's keys, and the
checks that refuse what the example cannot train on, in one line, before
any rank starts (labels as gbrun.data.labels checks them, for the dataset
writer too), and how a checkpoint names its dataset."""
import os

import torch

from ..cli import UsageError
from ..graphbolt import gb
from . import fingerprint
from . import labels as label_checks
# The example reads these here (datasets.load_dataset(...)).
from .loading import BUILTIN_DATASETS, COMES_WITH, load_dataset  # noqa: F401
from .loading import dataset_directory
from .metadata import read_metadata
from .splits import ATTRIBUTES, TRAIN


def node_key(name, node_type=None):
    """The feature store's key of node feature `name` (of `node_type`, on a
    graph of several)."""
    return ("node", node_type, name)


def node_keys(feature_keys):
    """The feature store's keys of the example's FEATURE_KEYS: a list of
    names (one node type), or {node type: [names]} (several)."""
    if isinstance(feature_keys, dict):
        return [node_key(name, ntype) for ntype, names in feature_keys.items()
                for name in names]
    return [node_key(name) for name in feature_keys]


def dataset_identity(name_or_dir):
    """How a checkpoint names its dataset: {"path": where it was read (an
    absolute path, or a builtin's name), "files": its content}, the content
    being {file in the dataset: its size and SHA-256}
    (gbrun.data.fingerprint), for a directory, a dataset that comes with
    the example (made here: by its bytes, not its name) or a file (DGL
    partitions' config), or a GraphBolt builtin's name. A resume compares
    the content (the same bytes at another path are the same dataset) and
    names the path (gbrun.run_state.check_key)."""
    directory = dataset_directory(name_or_dir)
    if directory is not None:
        files = fingerprint.fingerprint(directory, read_metadata(directory))
    elif os.path.isfile(name_or_dir):
        files = {os.path.basename(name_or_dir): "{}:{}".format(
            os.path.getsize(name_or_dir), fingerprint.file_digest(name_or_dir))}
    else:
        return {"path": name_or_dir, "files": name_or_dir}
    described = {}
    for path, value in files.items():
        size, digest = value.split(":")
        described[path] = f"{size} bytes, sha256 {digest[:12]}"
    shown = name_or_dir if directory not in (None, name_or_dir) else (
        os.path.abspath(name_or_dir))
    return {"path": shown, "files": described}


# Where a user with a heterogeneous graph reads what to do, for the node
# task and for the link task.
HETEROGENEOUS_PAGE = "docs/customising.md#several-node-and-edge-types"
LINK_HETEROGENEOUS_PAGE = (
    "docs/customising.md#link-prediction-on-a-relation-of-several-node-types")


def heterogeneous(name, node_types, edge_types, page=HETEROGENEOUS_PAGE):
    """The refusal of a graph with several node or edge types, naming
    them: the example trains one node type and one edge type."""
    return UsageError(
        f"dataset '{name}' is heterogeneous (node types: "
        f"{', '.join(sorted(node_types))}; edge types: "
        f"{', '.join(sorted(edge_types))}), but the example trains a graph "
        f"of one node type and one edge type: {page} shows the "
        "edit for several")


def check_homogeneous(dataset, name, page=HETEROGENEOUS_PAGE):
    """Refuses a heterogeneous dataset before its keys are looked up (a
    per-type feature named like the example's key would otherwise be
    reported missing)."""
    graph = dataset.graph
    node_types = getattr(graph, "node_type_to_id", None) or {}
    edge_types = getattr(graph, "edge_type_to_id", None) or {}
    if len(node_types) > 1 or len(edge_types) > 1 or (
            graph.node_type_offset is not None and (node_types or edge_types)):
        raise heterogeneous(name, node_types, edge_types, page)


def check_dataset(dataset, name, feature_keys, label_key, labels="class",
                  target=None):
    """Refuses a dataset the example cannot train on, naming what is
    missing or wrong. Returns the task's item sets (train, validation, test),
    each with checked labels: the task's own, or else the node feature
    `label_key` of each seed. `labels` says what a label is: "class", one
    integer in [0, num_classes) per node (int64 for cross-entropy), or
    "multi-hot", num_classes entries of 0 or 1 per node (float32, for
    multi-label losses), or "value", num_classes finite floats per node
    (float32 rows, for a regression loss). FEATURE_KEYS per node type
    ({type: [names]}, a graph of several): each type's features on it, and
    every split's seeds of one node type, the target (`target`, the
    example's TARGET, where given), whose item sets are returned as
    {target: ItemSet} (gb.ItemSetDict), as the loader takes them."""
    if labels not in label_checks.KINDS:
        raise UsageError(f"LABELS = {labels!r} in the example: a label is one "
                         f"of {', '.join(label_checks.KINDS)}")
    per_type = feature_keys if isinstance(feature_keys, dict) else {
        None: feature_keys}
    if None in per_type:
        check_homogeneous(dataset, name)
    else:
        check_node_types(dataset, name, per_type)
    task = dataset.tasks[0]
    if "num_classes" not in task.metadata:
        raise UsageError(
            f"dataset '{name}': task '{task.metadata.get('name', 0)}' has no "
            "num_classes in metadata.yaml"
        )
    num_classes = int(task.metadata["num_classes"])
    for ntype, feature_names in per_type.items():
        for feature_key in feature_names:
            check_feature(dataset, name, feature_key, ntype)
    item_sets = []
    for split in ATTRIBUTES:
        item_set = getattr(task, split)
        if item_set is None or len(item_set) == 0:
            raise UsageError(f"dataset '{name}' has an empty {split}")
        items, ntype = item_set[0 : len(item_set)], None
        if None not in per_type:
            items, ntype = one_node_type(items, name, split, target)
        if "labels" in (item_set.names or ()):
            seeds, values = items
            where = f"dataset '{name}': the {split}'s labels"
        elif node_key(label_key, ntype) in dataset.feature.keys():
            seeds = items[0] if isinstance(items, tuple) else items
            values = dataset.feature.read(*node_key(label_key, ntype), seeds)
            where = (f"dataset '{name}': {feature_name(label_key, ntype)} "
                     f"(the {split}'s labels)")
        else:
            raise UsageError(
                f"dataset '{name}': the {split} has no labels and there "
                f"is no {feature_name(label_key, ntype, named=True)} (it has: "
                f"{feature_names_of(dataset, ntype)})"
            )
        values = checked_labels(values, num_classes, labels, where)
        checked = gb.ItemSet((torch.as_tensor(seeds), values),
                             names=("seed_nodes", "labels"))
        item_sets.append(checked if ntype is None
                         else gb.ItemSetDict({ntype: checked}))
    return tuple(item_sets)


def check_link_task(dataset, name, feature_keys, task_name, relation=None,
                    reverse=None):
    """Refuses a dataset the link example cannot train on, naming what is
    missing or wrong. Returns the task `task_name`'s train item set (its
    node pairs, as GraphBolt samples them) and its validation and test
    sets as (pairs (E, 2), negative destinations (E, K)) tensors, each
    pair scored against its own row (the format gbrun.data.links writes).
    FEATURE_KEYS per node type (a graph of several): the pairs are of the
    edge type `relation` (the example's RELATION), the train set
    {relation: ItemSet} and the evaluation ids within each end's type, and
    `reverse` (REVERSE_RELATION) is checked (check_reverse)."""
    per_type = feature_keys if isinstance(feature_keys, dict) else {
        None: feature_keys}
    if None in per_type:
        check_homogeneous(dataset, name, LINK_HETEROGENEOUS_PAGE)
    else:
        check_node_types(dataset, name, per_type)
    tasks = {task.metadata.get("name"): task for task in dataset.tasks}
    if task_name not in tasks:
        raise UsageError(
            f"dataset '{name}' has no task named '{task_name}' (its tasks: "
            f"{', '.join(map(str, tasks))}); scripts/convert_to_ondisk.py "
            "--link-valid ... writes one (docs/own-data.md)")
    task = tasks[task_name]
    for ntype, keys in per_type.items():
        for key in keys:
            check_feature(dataset, name, key, ntype)
    item_sets = []
    for split in ATTRIBUTES:
        # The train set's pairs are sampled; each evaluation pair is scored
        # against its own row of negatives.
        names = ("node_pairs",) if split == TRAIN.attribute else (
            "node_pairs", "negative_dsts")
        item_set = getattr(task, split)
        if item_set is None or len(item_set) == 0:
            raise UsageError(f"dataset '{name}': task '{task_name}' has an "
                             f"empty {split}")
        if tuple(item_set.names or ()) != names:
            raise UsageError(
                f"dataset '{name}': the {split} of task '{task_name}' holds "
                f"{', '.join(item_set.names or ('unnamed items',))}; the link "
                f"example takes {' and '.join(names)}")
        items = item_set[0:len(item_set)]
        if None not in per_type:
            items = of_relation(items, name, split, relation)
        if split == TRAIN.attribute:
            item_sets.append(item_set)
            continue
        pairs, negatives = items
        if negatives.dim() != 2 or negatives.size(1) == 0:
            raise UsageError(
                f"dataset '{name}': the {split}'s negative_dsts have shape "
                f"{list(negatives.shape)}, not a row of negatives per pair")
        item_sets.append((pairs.long(), negatives.long()))
    if None not in per_type:
        check_reverse(dataset, name, task, relation, reverse)
    return tuple(item_sets)


def is_directed(dataset, task_name):
    """Whether the link task's pairs are directed facts (written with
    convert_to_ondisk.py --directed): then only a pair itself, not its
    reverse, is its answer."""
    for task in dataset.tasks:
        if task.metadata.get("name") == task_name:
            return bool(task.metadata.get("directed", False))
    raise KeyError(task_name)


def of_relation(items, name, split, relation):
    """A split's items on a graph of several node types, which must be
    pairs of `relation` only."""
    if not isinstance(items, dict) or set(items) != {relation}:
        types = ", ".join(items) if isinstance(items, dict) else "none"
        raise UsageError(
            f"dataset '{name}': the {split} holds pairs of edge types "
            f"{types}, but RELATION is '{relation}'")
    return items[relation]


def check_reverse(dataset, name, task, relation, reverse):
    """RELATION is an edge type of the graph, and REVERSE_RELATION the one
    that holds its edges the other way round, where the graph has one: as
    the task names it (its "reverse_relation", which convert_to_ondisk.py
    writes), or else an edge type from RELATION's destination type to its
    source type. Without it, the model would sample the pairs it is asked
    to predict, the other way round."""
    edge_types = list(getattr(dataset.graph, "edge_type_to_id", None) or {})
    if relation not in edge_types:
        raise UsageError(
            f"RELATION is '{relation}', but dataset '{name}' has edge types "
            f"{', '.join(sorted(edge_types))}")
    src, _, dst = relation.split(":")
    backwards = [etype for etype in edge_types
                 if etype.startswith(f"{dst}:") and etype.endswith(f":{src}")]
    declared = task.metadata.get("reverse_relation", reverse)
    if declared != reverse:
        raise UsageError(
            f"dataset '{name}': its task '{task.metadata.get('name')}' names "
            f"'{declared}' as the reverse relation of {relation}, but "
            f"REVERSE_RELATION is {reverse!r}: a batch's pairs must be taken "
            "out of both")
    if reverse is not None and reverse not in backwards:
        raise UsageError(
            f"REVERSE_RELATION is '{reverse}', but dataset '{name}' has no "
            f"such edge type from {dst} to {src} (it has: "
            f"{', '.join(backwards) or 'none'})")
    if reverse is None and backwards and "reverse_relation" not in (
            task.metadata):
        raise UsageError(
            f"REVERSE_RELATION is None, but dataset '{name}' has edge types "
            f"from {dst} to {src} ({', '.join(backwards)}): name the one "
            f"holding {relation}'s edges the other way round (the model "
            "would sample the pairs it predicts), or, if none does, write "
            "reverse_relation: null in the task's entry of metadata.yaml")


def feature_name(key, node_type=None, named=False):
    if node_type is not None:
        return f"feature '{key}' of node type '{node_type}'"
    return f"node feature {'named ' if named else ''}'{key}'"


def feature_names_of(dataset, node_type=None):
    return ", ".join(str(k[2]) for k in dataset.feature.keys()
                     if node_type is None or k[1] == node_type) or "none"


def check_feature(dataset, name, key, node_type=None):
    """The feature `key` (of `node_type`) exists, one vector per node."""
    if node_key(key, node_type) not in dataset.feature.keys():
        raise UsageError(
            f"dataset '{name}' has no {feature_name(key, node_type, True)} (it "
            f"has: {feature_names_of(dataset, node_type)})")
    row = list(dataset.feature.size(*node_key(key, node_type)))
    if len(row) != 1:
        raise UsageError(
            f"dataset '{name}': {feature_name(key, node_type)} has rows of "
            f"shape {row}; the model reads one vector per node")


def check_node_types(dataset, name, per_type):
    """FEATURE_KEYS per node type: the dataset has several, and these are
    all of them (the model sizes its inputs by type)."""
    node_types = sorted(getattr(dataset.graph, "node_type_to_id", None) or {})
    if len(node_types) < 2:
        raise UsageError(
            f"dataset '{name}' has one node type, but FEATURE_KEYS names node "
            f"types ({', '.join(per_type)}): use a list of feature names")
    for ntype in per_type:
        if ntype not in node_types:
            raise UsageError(
                f"FEATURE_KEYS names node type '{ntype}', but dataset '{name}' "
                f"has node types {', '.join(node_types)}")
    missing = [ntype for ntype in node_types if ntype not in per_type]
    if missing:
        raise UsageError(
            f"FEATURE_KEYS names no features for node type "
            f"{', '.join(missing)} of dataset '{name}': give each type its "
            "features, or [] and a learned embedding (docs/customising.md"
            "#a-node-type-without-features)")


def one_node_type(items, name, split, target=None):
    """(items, their node type) of a split of a graph of several node
    types, which must hold the seeds of one (`target`, where given)."""
    if not isinstance(items, dict) or len(items) != 1:
        types = ", ".join(items) if isinstance(items, dict) else "none"
        raise UsageError(
            f"dataset '{name}': the {split} holds seeds of node types "
            f"{types}; the example learns the labels of one node type")
    (found, items), = items.items()
    if target is not None and found != target:
        raise UsageError(
            f"dataset '{name}': the {split}'s seeds are of node type "
            f"'{found}', but TARGET is '{target}'")
    return items, found


def checked_labels(values, num_classes, kind, where):
    """The labels as the loss takes them (int64 classes, float32 rows), or
    one line saying what they are instead (shape, dtype, range): never a
    silent reinterpretation."""
    values = torch.as_tensor(values)
    shape, dtype = list(values.shape), str(values.dtype).replace("torch.", "")
    if kind == "class" and values.dim() == 2 and values.size(1) == 1:
        values = values[:, 0]  # one column: one class per node
    array = values.numpy()
    problem = label_checks.shape_problem(array, kind, num_classes)
    if problem is None and label_checks.value_problem(array, kind, num_classes):
        problem = dtype = (f"{dtype} with values in [{values.min().item()}, "
                           f"{values.max().item()}]")
    if problem:
        raise UsageError(
            f"{where} have shape {shape} and dtype {dtype}, but the example "
            f"takes {label_checks.expected(kind, num_classes)} (LABELS = '{kind}' "
            "in the example; docs/customising.md shows multi-label and "
            "regression edits)"
        )
    if kind == "class":
        return values.long()
    if values.dim() == 1:
        values = values[:, None]  # one value per node: a row of one
    return values.float()


def feature_size(dataset, feature_keys):
    """The model's input width: the features `feature_keys`, side by side
    ({node type: width} for FEATURE_KEYS per node type)."""
    if isinstance(feature_keys, dict):
        return {ntype: feature_size_of(dataset, names, ntype)
                for ntype, names in feature_keys.items()}
    return feature_size_of(dataset, feature_keys)


def feature_size_of(dataset, names, node_type=None):
    return sum(dataset.feature.size(*node_key(name, node_type))[0]
               for name in names)


def check_train_split(num_train_items, batch_size, world_size):
    """The training sampler drops partial and uneven batches, so each rank
    needs one full batch: num_train_items >= batch_size * world_size."""
    if num_train_items < batch_size * world_size:
        largest = num_train_items // world_size
        raise UsageError(
            f"--batch-size {batch_size}: the train set has {num_train_items} "
            f"items, too few for one full batch on each of {world_size} "
            f"ranks; use --batch-size {largest} or less"
            if largest > 0
            else f"the train set has {num_train_items} items, fewer than the "
            f"{world_size} ranks"
        )


def store_in_bf16(dataset, feature_keys):
    """--precision bf16: the features the model reads, converted once where
    the data is loaded; the ranks share this copy and the fp32 one is
    released."""
    for key in node_keys(feature_keys):
        dataset.feature.update(
            *key, dataset.feature.read(*key).to(torch.bfloat16))
