"""Tests of gbrun/data/links.py: a link-prediction task written beside the
node task by scripts/convert_to_ondisk.py and make_synthetic_dataset.py
(their main() in this process, as tests/dataset_inputs.py runs
them), loaded back with GraphBolt; bad inputs refused in one line, nothing
written; the evaluation pairs a graph holds warned of or taken out."""
import re

import numpy as np
import pytest

import convert_to_ondisk
import make_synthetic_dataset
from gbrun.data import datasets, links

NUM_NODES = 50


def write_inputs(directory, seed=0):
    """Edges, features, labels and a link task's files in `directory`;
    the validation and test pairs are edges of the graph (a leak)."""
    rng = np.random.default_rng(seed)
    edges = np.unique(rng.integers(0, NUM_NODES, (2, 400)), axis=1)
    arrays = {
        "edges": edges, "feat": rng.random((NUM_NODES, 3), dtype=np.float32),
        "labels": rng.integers(0, 3, NUM_NODES),
        "valid": edges[:, :10], "valid_neg": rng.integers(0, NUM_NODES, (10, 4)),
        "test": edges[:, 10:25], "test_neg": rng.integers(0, NUM_NODES, (15, 4)),
        # Train pairs that hold the test pairs, not the validation pairs.
        "train_but_valid": edges[:, 10:],
    }
    for name, array in arrays.items():
        np.save(directory / f"{name}.npy", array)
    return arrays


def link_args(directory, **replace):
    """The converter's arguments for write_inputs' files; `replace` maps an
    option to another file's name (or None: the option left out)."""
    files = {"--edges": "edges", "--features": "feat", "--labels": "labels",
             "--link-valid": "valid", "--link-valid-negatives": "valid_neg",
             "--link-test": "test", "--link-test-negatives": "test_neg", **replace}
    values = {"--link-split", "--link-negatives"}  # not files
    return [arg for option, name in files.items() if name is not None
            for arg in (option, name if option in values else str(directory / f"{name}.npy"))]


def convert(out, args, capsys):
    try:
        code = convert_to_ondisk.main([str(out), *args])
    except SystemExit as exited:  # refused by the argument parser
        code = exited.code
    return code, *capsys.readouterr()


def rows(itemset, index):
    return np.array([np.asarray(item[index]) for item in itemset])


def pair_set(pairs):
    return set(zip(*np.asarray(pairs).tolist()))


def test_a_link_task_round_trips_and_leaves_the_graph(tmp_path, capsys):
    arrays = write_inputs(tmp_path)
    out = tmp_path / "out"
    code, stdout, stderr = convert(out, [*link_args(tmp_path), "--drop-leaked-edges"], capsys)
    assert code == 0, stderr
    assert "link task: train/val/test " in stdout
    assert f"python link_prediction.py --dataset {out} (its link task)" in stdout
    dataset = datasets.load_dataset(str(out))
    task = dataset.tasks[1]
    assert task.metadata["name"] == "link_prediction"
    assert task.metadata["num_negatives"] == 4
    evaluated = pair_set(arrays["valid"]) | pair_set(arrays["test"])
    # The graph holds every edge but the evaluation pairs, either way
    # round; its edges are the train pairs.
    kept = {(u, v) for u, v in pair_set(arrays["edges"])
            if (u, v) not in evaluated and (v, u) not in evaluated}
    indptr, indices = (dataset.graph.csc_indptr.numpy(), dataset.graph.indices.numpy())
    dst = np.repeat(np.arange(NUM_NODES), np.diff(indptr))
    assert pair_set([indices, dst]) == kept
    assert task.train_set.names == ("node_pairs",)
    assert set(map(tuple, rows(task.train_set, ...).tolist())) == kept
    for itemset, split in ((task.validation_set, "valid"), (task.test_set, "test")):
        assert itemset.names == ("node_pairs", "negative_dsts")
        np.testing.assert_array_equal(rows(itemset, 0), arrays[split].T)
        np.testing.assert_array_equal(rows(itemset, 1), arrays[f"{split}_neg"])
    # The node task is the first, as the example reads it.
    assert dataset.tasks[0].metadata["name"] == "node_classification"


def test_a_graph_that_holds_evaluation_pairs_is_refused_or_kept_as_asked(tmp_path, capsys):
    arrays = write_inputs(tmp_path)
    evaluated = np.concatenate([arrays["valid"], arrays["test"]], axis=1)
    np.save(tmp_path / "train.npy", links.without_pairs(arrays["edges"], evaluated, NUM_NODES))
    args = link_args(tmp_path, **{"--link-train": "train"})
    code, _, stderr = convert(tmp_path / "out", args, capsys)
    assert code == 2 and not (tmp_path / "out").exists()
    assert stderr.startswith(
        "leak: the graph holds 10 validation and 15 test pairs (either way round), e.g. "
        f"validation pair 0 ({arrays['valid'][0, 0]} -> {arrays['valid'][1, 0]}, in "
        f"{tmp_path / 'valid.npy'}): evaluation embeds every node over full neighbourhoods, "
        "so it reads the answer; --drop-leaked-edges takes them out of the graph, "
        "--keep-leaked-edges keeps them"), stderr
    code, _, stderr = convert(tmp_path / "out", [*args, "--keep-leaked-edges"], capsys)
    assert code == 0, stderr
    assert ("warning: the graph holds 10 validation and 15 test pairs (either way round)"
            in stderr)


def bad(name, array):
    def write(directory):
        np.save(directory / f"{name}.npy", array)
    return write


@pytest.mark.parametrize("make_bad, replace, message", [
    (bad("valid", np.array([[0, 1], [2, NUM_NODES]])), {},
     f"valid.npy: node id {NUM_NODES} out of range [0, {NUM_NODES})"),
    (bad("valid_neg", np.zeros((9, 4), dtype=np.int64)), {},
     "valid_neg.npy: expected shape (10, K), a row of K > 0 negative destinations for "
     "each pair of"),
    (bad("test_neg", np.zeros((15, 4), dtype=np.float32)), {},
     "test_neg.npy: expected integer node ids, got dtype float32"),
    (bad("test_neg", np.full((15, 4), -1)), {},
     "test_neg.npy: node id -1 out of range"),
    (bad("test_neg", np.zeros((15, 3), dtype=np.int64)), {},
     "valid_neg.npy and /"),
    (bad("test_neg", np.zeros((15, 3), dtype=np.int64)), {},
     "test_neg.npy: 4 and 3 negatives per pair; give both the same number"),
    (None, {"--link-test": None}, "--link-valid needs --link-test (a link task's four "
     "evaluation inputs)"),
    (None, {"--link-valid": None, "--link-valid-negatives": None, "--link-test": None,
            "--link-test-negatives": None, "--link-split": "0.1,0.1"},
     "--link-split needs --link-negatives K"),
    (None, {"--link-negatives": "3"}, "--link-negatives needs --link-split V,T"),
    (None, {"--link-split": "0.1,0.1", "--link-negatives": "3"},
     "--link-valid: --link-split makes the link task's pairs; give one or the other"),
    (None, {"--link-split": "0.5,0.5"}, "--link-split: expected two fractions V,T above 0 "
     "with V + T < 1"),
])
def test_bad_link_inputs_are_one_line_and_write_nothing(tmp_path, capsys, monkeypatch,
                                                        make_bad, replace, message):
    monkeypatch.setattr("sys.argv", ["convert_to_ondisk.py"])
    write_inputs(tmp_path)
    if make_bad:
        make_bad(tmp_path)
    parent = tmp_path / "datasets"
    parent.mkdir()
    args = link_args(tmp_path, **replace)
    if not replace and make_bad:
        args.append("--drop-leaked-edges")
    code, stdout, stderr = convert(parent / "out", args, capsys)
    assert code == 2, stdout + stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("convert_to_ondisk.py: error: "), stderr
    assert message in lines[0], lines[0]
    assert list(parent.iterdir()) == []


def test_force_replaces_a_dataset_with_a_link_task(tmp_path, capsys):
    write_inputs(tmp_path)
    args = [*link_args(tmp_path), "--drop-leaked-edges"]
    assert convert(tmp_path / "out", args, capsys)[0] == 0
    code, _, stderr = convert(tmp_path / "out", [*args, "--force"], capsys)
    assert code == 0, stderr


def test_the_synthetic_link_task_is_held_out_and_planted(tmp_path, capsys):
    """--link-negatives: evaluation pairs out of the graph (either way),
    K negatives each, the same bytes for the same seed, and pairs that
    mostly join two nodes of one label (a signal to learn)."""
    outs = [tmp_path / name for name in ("a", "b")]
    for out in outs:
        make_synthetic_dataset.main([str(out), "--num-nodes", "2000", "--feat-dim", "4",
                                     "--link-negatives", "7"])
    assert "link task: train/val/test " in capsys.readouterr().out
    for name in ("edges", "valid_node_pairs", "test_negative_dsts"):
        assert (outs[0] / f"{name}.npy").read_bytes() == (outs[1] / f"{name}.npy").read_bytes()
    edges = np.load(outs[0] / "edges.npy")
    labels = np.load(outs[0] / "node_label.npy")
    np.testing.assert_array_equal(np.load(outs[0] / "train_node_pairs.npy").T, edges)
    for split in ("valid", "test"):
        pairs = np.load(outs[0] / f"{split}_node_pairs.npy").T
        assert 0.04 * edges.shape[1] < pairs.shape[1] < 0.07 * edges.shape[1]
        graph = pair_set(edges)
        assert not any((u, v) in graph or (v, u) in graph for u, v in pair_set(pairs))
        assert np.load(outs[0] / f"{split}_negative_dsts.npy").shape == (pairs.shape[1], 7)
        # 80% of edges join one class (labels: 10% noise); chance is 0.1.
        assert (labels[pairs[0]] == labels[pairs[1]]).mean() > 0.6


def undirected_inputs(directory):
    """A graph stored both ways (as an undirected one is), features and
    labels; 8 validation and 8 test pairs, each an edge (u < v) of it, with
    3 negatives each. Returns the arrays saved."""
    rng = np.random.default_rng(1)
    one_way = np.unique(rng.integers(0, NUM_NODES, (2, 300)), axis=1)
    one_way = np.unique(np.sort(one_way[:, one_way[0] != one_way[1]], axis=0), axis=1)
    arrays = {"edges": np.concatenate([one_way, one_way[::-1]], axis=1),
              "feat": rng.random((NUM_NODES, 3), dtype=np.float32),
              "labels": rng.integers(0, 3, NUM_NODES),
              "valid": one_way[:, :8], "valid_neg": rng.integers(0, NUM_NODES, (8, 3)),
              "test": one_way[:, 8:16], "test_neg": rng.integers(0, NUM_NODES, (8, 3))}
    evaluated = one_way[:, :16]
    # What a user who removes "the edge" of each held-out pair has: the
    # graph without one direction of them; its edges, the train pairs.
    arrays["one_way_out"] = links.without_pairs(arrays["edges"], evaluated, NUM_NODES,
                                                either_way=False)
    arrays["train_with_pair"] = np.concatenate([arrays["one_way_out"], evaluated[:, :1]], axis=1)
    arrays["clean_graph"] = links.without_pairs(arrays["edges"], evaluated, NUM_NODES)
    arrays["test_repeats"] = np.concatenate([one_way[:, 8:15], one_way[::-1, :1]], axis=1)
    for name, array in arrays.items():
        np.save(directory / f"{name}.npy", array)
    return arrays


def leak_lines(stderr):
    """The leak and warning lines, file names without their directory."""
    return [re.sub(r"/\S*/", "", line) for line in stderr.splitlines()
            if line.startswith(("leak:", "warning:"))]


@pytest.mark.parametrize("replace, extra, expected", [
    # Each case alone: (options, the leak line's start).
    ({"--edges": "clean_graph", "--link-train": "one_way_out"}, [],
     ["leak: one_way_out.npy holds the reverse of 8 validation and 8 test pairs, e.g. "
      "validation pair 0"]),
    ({"--edges": "clean_graph", "--link-train": "train_with_pair"}, [],
     ["leak: train_with_pair.npy holds 1 validation and 0 test pairs, e.g. validation pair "
      "0", "leak: train_with_pair.npy holds the reverse of 7 validation and 8 test pairs"]),
    ({"--edges": "clean_graph", "--link-test": "test_repeats"}, [],
     ["leak: 0 validation and 1 test pairs repeat an earlier one (either way round), e.g. "
      "test pair 7"]),
    ({}, [], ["leak: the graph holds 8 validation and 8 test pairs (either way round)"]),
    # Every case at once: each named, in one pass.
    ({"--link-train": "train_with_pair", "--link-test": "test_repeats"}, [],
     ["leak: the graph holds 8 validation and 8 test pairs (either way round)",
      "leak: train_with_pair.npy holds 1 validation and 1 test pairs",
      "leak: train_with_pair.npy holds the reverse of 7 validation and 7 test pairs",
      "leak: 0 validation and 1 test pairs repeat an earlier one"]),
    # Directed: a pair's reverse is another fact, said and kept; a repeat
    # is one only the same way round.
    ({"--edges": "one_way_out", "--link-train": "one_way_out"},
     ["--directed"], ["warning: one_way_out.npy holds the reverse of 8 validation and 8 test "
                      "pairs, e.g. validation pair 0"]),
])
def test_every_leak_is_named_before_one_refusal(tmp_path, capsys, replace, extra, expected):
    undirected_inputs(tmp_path)
    out = tmp_path / "out"
    code, _, stderr = convert(out, [*link_args(tmp_path, **replace), *extra], capsys)
    found = leak_lines(stderr)
    assert len(found) == len(expected), stderr
    for line, start in zip(found, expected):
        assert line.startswith(start), (line, start)
    refused = sum(start.startswith("leak:") for start in expected)
    if refused:
        assert code == 2 and not out.exists()
        assert stderr.strip().splitlines()[-1] == (
            f"convert_to_ondisk.py: error: the link task gives a model its answers in "
            f"{refused} way{'s' if refused > 1 else ''} (the 'leak:' line"
            f"{'s' if refused > 1 else ''} above); nothing was written")
    else:
        assert code == 0, stderr
        assert datasets.load_dataset(str(out)).tasks[1].metadata["directed"] is True


def test_drop_leaked_edges_takes_every_evaluation_pair_out_both_ways(tmp_path, capsys):
    arrays = undirected_inputs(tmp_path)
    out = tmp_path / "out"
    code, stdout, stderr = convert(out, [*link_args(tmp_path, **{"--link-train": "train_with_pair"}),
                                         "--drop-leaked-edges"], capsys)
    assert code == 0, stderr
    assert ("--drop-leaked-edges took 32 edges out of the graph and 17 out of the train "
            "pairs") in stdout
    evaluated = pair_set(arrays["valid"]) | pair_set(arrays["test"])
    evaluated |= {(v, u) for u, v in evaluated}
    graph = pair_set(np.load(out / "edges.npy"))
    train = pair_set(np.load(out / "train_node_pairs.npy").T)
    assert graph and train and not (graph | train) & evaluated
    assert datasets.load_dataset(str(out)).tasks[1].metadata["directed"] is False


def test_default_train_pairs_hold_no_evaluation_pair_either_way(tmp_path, capsys):
    """Kept in the graph as asked, never a train pair: unless --directed,
    where only the pair itself is left out."""
    arrays = undirected_inputs(tmp_path)
    evaluated = pair_set(arrays["valid"]) | pair_set(arrays["test"])
    for directed in ([], ["--directed"]):
        out = tmp_path / f"out{len(directed)}"
        code, _, stderr = convert(out, [*link_args(tmp_path), "--keep-leaked-edges",
                                        *directed], capsys)
        assert code == 0, stderr
        train = pair_set(np.load(out / "train_node_pairs.npy").T)
        assert not train & evaluated
        reversed_pairs = {(v, u) for u, v in evaluated}
        assert bool(train & reversed_pairs) == bool(directed)
        assert pair_set(np.load(out / "edges.npy")) == pair_set(arrays["edges"])


def test_negatives_that_are_edges_are_noted_and_kept(tmp_path, capsys):
    arrays = undirected_inputs(tmp_path)
    negatives = arrays["valid_neg"].copy()
    negatives[0, 0] = arrays["edges"][1, 100]  # (the pair's source, a neighbour)
    negatives[0, 1] = arrays["valid"][1, 0]  # the pair itself
    arrays["valid"][0, 0] = arrays["edges"][0, 100]
    np.save(tmp_path / "valid.npy", arrays["valid"])
    np.save(tmp_path / "valid_neg.npy", negatives)
    code, _, stderr = convert(tmp_path / "out", [*link_args(tmp_path), "--drop-leaked-edges"],
                              capsys)
    assert code == 0, stderr
    notes = [line for line in stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and notes[0].endswith(
        "negatives are edges of the graph or evaluation pairs: kept, as OGB's random "
        "negatives are"), stderr
    counted = int(notes[0].split()[1])
    evaluated = pair_set(arrays["valid"]) | pair_set(arrays["test"])
    known = pair_set(np.load(tmp_path / "out" / "edges.npy")) | evaluated
    known |= {(v, u) for u, v in known}
    expected = sum((int(u), int(w)) in known
                   for pairs, negs in ((arrays["valid"], negatives),
                                       (arrays["test"], arrays["test_neg"]))
                   for u, row in zip(pairs[0], negs) for w in row)
    assert counted == expected >= 2
    np.testing.assert_array_equal(np.load(tmp_path / "out" / "valid_negative_dsts.npy"),
                                  negatives)


@pytest.mark.parametrize("directed", [False, True])
def test_link_split_holds_out_distinct_pairs_with_negatives(tmp_path, capsys, directed):
    arrays = undirected_inputs(tmp_path)
    options = ["--link-split", "0.1,0.2", "--link-negatives", "5", *(["--directed"] * directed)]
    base = link_args(tmp_path, **{key: None for key in (
        "--link-valid", "--link-valid-negatives", "--link-test", "--link-test-negatives")})
    outs = [tmp_path / name for name in ("a", "b")]
    for out in outs:
        code, _, stderr = convert(out, [*base, *options], capsys)
        assert code == 0, stderr
        # The graph holds both ways of a pair: directed, the other way
        # is another fact, said.
        assert [line.split(" holds ")[1].split(",")[0] for line in leak_lines(stderr)] == (
            ["the reverse of 34 validation and 68 test pairs"] if directed else []), stderr
    for name in ("edges", "valid_node_pairs", "test_negative_dsts"):
        assert (outs[0] / f"{name}.npy").read_bytes() == (outs[1] / f"{name}.npy").read_bytes()
    valid, test = (np.load(outs[0] / f"{split}_node_pairs.npy").T for split in ("valid", "test"))
    # Distinct pairs of the graph: u < v undirected (the graph holds both
    # ways), either order directed.
    edges = pair_set(arrays["edges"])
    distinct = len(edges) if directed else len(edges) // 2
    assert (valid.shape[1], test.shape[1]) == (int(distinct * 0.1), int(distinct * 0.2))
    held = pair_set(valid) | pair_set(test)
    assert len(held) == valid.shape[1] + test.shape[1] and held <= edges
    if not directed:
        assert all(u < v for u, v in held)
        held |= {(v, u) for u, v in held}
    graph = pair_set(np.load(outs[0] / "edges.npy"))
    assert graph == edges - held
    assert pair_set(np.load(outs[0] / "train_node_pairs.npy").T) == graph
    assert np.load(outs[0] / "test_negative_dsts.npy").shape == (test.shape[1], 5)


def test_the_synthetic_link_task_leaks_nothing(tmp_path):
    """make_synthetic_dataset.py --link-negatives (defaults, seed 0) passes
    every check: no pair repeated either way round, none in the graph or
    the train pairs either way."""
    out = tmp_path / "out"
    make_synthetic_dataset.main([str(out), "--num-nodes", "3000", "--feat-dim", "2",
                                 "--link-negatives", "5"])
    task = links.LinkTask(
        np.load(out / "train_node_pairs.npy").T, np.load(out / "valid_node_pairs.npy").T,
        np.load(out / "valid_negative_dsts.npy"), np.load(out / "test_node_pairs.npy").T,
        np.load(out / "test_negative_dsts.npy"))
    found = links.leaks(task, np.load(out / "edges.npy"), 3000)
    assert [leak.kind for leak in found] == ["note"], found
