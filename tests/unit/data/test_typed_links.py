"""Tests of gbrun/data/typed_links.py: a link task on one relation of a
graph of several node types, written by scripts/convert_to_ondisk.py
(--link-relation, --link-reverse-relation) and make_synthetic_dataset.py
(--hetero --link-negatives), their main() in this process; leaks looked
for in the relation and its reverse relation, bad inputs refused in one
line; and gbrun.data.datasets.check_link_task's refusals of a copy whose
RELATION or REVERSE_RELATION the dataset does not agree with."""
import shutil

import numpy as np
import pytest
import yaml

import convert_to_ondisk
import make_synthetic_dataset
from gbrun.cli import UsageError
from gbrun.data import datasets

USERS, ITEMS = 40, 30
RELATION, REVERSE = "user:buys:item", "item:bought-by:user"
FEATURE_KEYS = {"user": ["feat"], "item": ["feat"]}


def write_inputs(directory):
    """Two node types, purchases both ways, and a link task on them whose
    validation and test pairs are purchases (a leak)."""
    rng = np.random.default_rng(0)
    buys = np.unique(np.stack([rng.integers(0, USERS, 300),
                               rng.integers(0, ITEMS, 300)]), axis=1)
    arrays = {
        "buys": buys, "bought_by": buys[::-1].copy(),
        "user_feat": rng.random((USERS, 3), dtype=np.float32),
        "item_feat": rng.random((ITEMS, 2), dtype=np.float32),
        "labels": rng.integers(0, 3, USERS),
        "valid": buys[:, :10], "valid_neg": rng.integers(0, ITEMS, (10, 4)),
        "test": buys[:, 10:25], "test_neg": rng.integers(0, ITEMS, (15, 4)),
        "train": buys[:, 25:],
    }
    for name, array in arrays.items():
        np.save(directory / f"{name}.npy", array)
    return arrays


def args_of(directory, *extra, reverse=REVERSE, train="train"):
    given = [
        "--node-type", f"user={USERS}", "--node-type", f"item={ITEMS}",
        "--edge-type", f"{RELATION}={directory / 'buys.npy'}",
        "--edge-type", f"{REVERSE}={directory / 'bought_by.npy'}",
        "--type-features", f"user={directory / 'user_feat.npy'}",
        "--type-features", f"item={directory / 'item_feat.npy'}",
        "--target", "user", "--labels", str(directory / "labels.npy"),
        "--link-relation", RELATION]
    for option, name in (("--link-valid", "valid"),
                         ("--link-valid-negatives", "valid_neg"),
                         ("--link-test", "test"),
                         ("--link-test-negatives", "test_neg"),
                         ("--link-train", train)):
        if name:
            given += [option, str(directory / f"{name}.npy")]
    if reverse:
        given += ["--link-reverse-relation", reverse]
    return [*given, *map(str, extra)]


def convert(out, args, capsys):
    try:
        code = convert_to_ondisk.main([str(out), *args])
    except SystemExit as exited:  # refused by the argument parser
        code = exited.code
    return code, *capsys.readouterr()


def pair_set(pairs):
    return set(zip(*np.asarray(pairs).tolist()))


def test_a_relation_s_task_round_trips_and_its_leaks_are_found_both_ways(
        tmp_path, capsys):
    arrays = write_inputs(tmp_path)
    # The graph's purchases still hold the evaluation pairs: refused, or
    # kept with a warning where asked.
    leak = "the graph holds 10 validation and 15 test pairs, e.g. validation pair 0"
    code, out, err = convert(tmp_path / "leaky", args_of(tmp_path), capsys)
    assert code == 2 and f"leak: {leak}" in err, err
    code, out, err = convert(tmp_path / "kept", args_of(tmp_path, "--keep-leaked-edges"),
                             capsys)
    assert code == 0 and f"warning: {leak}" in err, err
    assert "#link-prediction-on-a-relation-of-several-node-types" in out
    # Taken out of user:buys:item only, the reverse still leaks them.
    np.save(tmp_path / "buys_only.npy", arrays["buys"][:, 25:])
    args = args_of(tmp_path)
    args[args.index(f"{RELATION}={tmp_path / 'buys.npy'}")] = (
        f"{RELATION}={tmp_path / 'buys_only.npy'}")
    code, _, err = convert(tmp_path / "reverse_leaks", args, capsys)
    assert code == 2 and f"leak: {leak}" in err, err

    # --drop-leaked-edges: out of both relations, nothing else; the train
    # pairs default to the relation's edges left.
    code, out, err = convert(tmp_path / "clean", args_of(
        tmp_path, "--drop-leaked-edges", train=None), capsys)
    assert code == 0 and "warning" not in err, err
    left = arrays["buys"].shape[1] - 25
    assert f"link task on user:buys:item: train/val/test {left}/10/15" in out
    metadata = yaml.safe_load(open(tmp_path / "clean" / "metadata.yaml"))
    task = metadata["tasks"][1]
    assert task["reverse_relation"] == REVERSE
    assert task["train_set"][0]["type"] == RELATION
    files = {edge["type"]: edge["path"] for edge in metadata["graph"]["edges"]}
    buys = np.load(tmp_path / "clean" / files[RELATION])
    bought_by = np.load(tmp_path / "clean" / files[REVERSE])
    assert pair_set(buys) == pair_set(arrays["buys"][:, 25:])
    assert pair_set(bought_by[::-1]) == pair_set(arrays["buys"][:, 25:])

    # GraphBolt reads it back: the relation's pairs, ids within each type.
    dataset = datasets.load_dataset(str(tmp_path / "clean"))
    train, valid, test = datasets.check_link_task(
        dataset, "clean", FEATURE_KEYS, "link_prediction", RELATION, REVERSE)
    pairs = train[0:len(train)][RELATION]
    assert pair_set(pairs.numpy().T) == pair_set(arrays["buys"][:, 25:])
    assert pair_set(valid[0].numpy().T) == pair_set(arrays["valid"])
    assert (test[1].numpy() == arrays["test_neg"]).all()

    # The copy's RELATION and REVERSE_RELATION must be the dataset's.
    for relation, reverse, message in (
            (RELATION, None, "names 'item:bought-by:user' as the reverse "
             "relation of user:buys:item, but REVERSE_RELATION is None"),
            (REVERSE, RELATION, "the train_set holds pairs of edge types "
             "user:buys:item, but RELATION is 'item:bought-by:user'"),
            ("user:sells:item", None, "the train_set holds pairs of edge "
             "types user:buys:item, but RELATION is 'user:sells:item'")):
        with pytest.raises(UsageError, match=message):
            datasets.check_link_task(dataset, "clean", FEATURE_KEYS,
                                     "link_prediction", relation, reverse)
    # A dataset written elsewhere that names no reverse relation, while it
    # has an edge type from items to users: REVERSE_RELATION must name it.
    shutil.copytree(tmp_path / "clean", tmp_path / "unnamed")
    del metadata["tasks"][1]["reverse_relation"]
    with open(tmp_path / "unnamed" / "metadata.yaml", "w") as f:
        yaml.safe_dump(metadata, f)
    unnamed = datasets.load_dataset(str(tmp_path / "unnamed"))
    with pytest.raises(UsageError, match="REVERSE_RELATION is None, but "
                       "dataset 'unnamed' has edge types from item to user "
                       r"\(item:bought-by:user\)"):
        datasets.check_link_task(unnamed, "unnamed", FEATURE_KEYS,
                                 "link_prediction", RELATION, None)
    datasets.check_link_task(unnamed, "unnamed", FEATURE_KEYS,
                             "link_prediction", RELATION, REVERSE)
    # The unchanged example points to the edit.
    with pytest.raises(UsageError, match="docs/customising.md#link-prediction"
                       "-on-a-relation-of-several-node-types shows the edit"):
        datasets.check_link_task(dataset, "clean", ["feat"], "link_prediction")


@pytest.mark.parametrize("change, message", [
    ({"reverse": None}, "link relation user:buys:item: the graph has edge types "
     "from item to user (item:bought-by:user); name the one holding its edges "
     "the other way round"),
    ({"reverse": RELATION}, "reverse relation user:buys:item: goes from user to "
     "item, but user:buys:item's reverse goes from item to user"),
    ({"valid": np.array([[0, 1], [ITEMS, 2]])}, "node id 30 out of range "
     "[0, 30) given by the 30 rows of node type item"),
    ({"valid_neg": np.full((10, 4), ITEMS)}, "valid_neg.npy: node id 30 out of "
     "range [0, 30) given by the 30 rows of node type item"),
    # The pairs trained on are the validation pairs: a leak, named before
    # the one-line refusal (with the graph's, which holds them too).
    ({"train": "valid"}, "valid.npy holds 10 validation and 0 test pairs"),
])
def test_a_bad_relation_task_is_refused_in_one_line(tmp_path, capsys, change,
                                                     message):
    write_inputs(tmp_path)
    for name, array in change.items():
        if isinstance(array, np.ndarray):
            np.save(tmp_path / f"{name}.npy", array)
    kwargs = {key: value for key, value in change.items()
              if key in ("reverse", "train")}
    code, _, err = convert(tmp_path / "out", args_of(tmp_path, **kwargs),
                           capsys)
    lines = [line for line in err.strip().splitlines()
             if not line.startswith(("leak:", "note:"))]
    assert code == 2 and len(lines) == 1, err
    assert message in err, err
    assert not (tmp_path / "out").exists()


def test_link_relation_options_need_their_graph(tmp_path, capsys):
    write_inputs(tmp_path)
    args = args_of(tmp_path)
    without_relation = args[:args.index("--link-relation")] + args[
        args.index("--link-relation") + 2:]
    code, _, err = convert(tmp_path / "out", without_relation, capsys)
    assert code == 2 and "with --node-type needs --link-relation " \
        "SRC:REL:DST, the edge type of the pairs" in err
    code, _, err = convert(tmp_path / "out", [
        "--edges", str(tmp_path / "buys.npy"), "--features",
        str(tmp_path / "user_feat.npy"), "--labels", str(tmp_path / "labels.npy"),
        "--link-relation", RELATION], capsys)
    assert code == 2 and "--link-relation names the edge type of a link " \
        "task" in err


def test_the_synthetic_relation_s_pairs_are_out_of_both_relations(tmp_path):
    out = tmp_path / "shop"
    make_synthetic_dataset.main([str(out), "--hetero", "--num-nodes", "200",
                                 "--avg-degree", "5", "--feat-dim", "4",
                                 "--link-negatives", "3"])
    metadata = yaml.safe_load(open(out / "metadata.yaml"))
    files = {edge["type"]: edge["path"] for edge in metadata["graph"]["edges"]}
    buys = pair_set(np.load(out / files[RELATION]))
    bought_by = pair_set(np.load(out / files[REVERSE])[::-1])
    assert buys == bought_by == pair_set(np.load(out / "train_node_pairs.npy").T)
    evaluated = pair_set(np.concatenate([np.load(out / "valid_node_pairs.npy"),
                                         np.load(out / "test_node_pairs.npy")]).T)
    assert len(evaluated) > 50 and not evaluated & buys
    assert np.load(out / "test_negative_dsts.npy").max() < 100  # items
    assert metadata["tasks"][1]["reverse_relation"] == REVERSE
