"""Tests of gbrun/data/links.py: a link-prediction task written beside the
node task by scripts/convert_to_ondisk.py and make_synthetic_dataset.py
(their main() in this process, as tests/unit/data/test_ondisk.py runs
them), loaded back with GraphBolt; bad inputs refused in one line, nothing
written; the evaluation pairs a graph holds warned of or taken out."""
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
    return [arg for option, name in files.items() if name is not None
            for arg in (option, str(directory / f"{name}.npy"))]


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


def test_a_graph_that_holds_evaluation_pairs_is_warned_of(tmp_path, capsys):
    arrays = write_inputs(tmp_path)
    evaluated = np.concatenate([arrays["valid"], arrays["test"]], axis=1)
    np.save(tmp_path / "train.npy", links.without_pairs(arrays["edges"], evaluated, NUM_NODES))
    code, _, stderr = convert(tmp_path / "out", link_args(tmp_path, **{"--link-train": "train"}),
                              capsys)
    assert code == 0, stderr
    assert ("warning: the graph holds 25 of the 25 validation and test pairs (either way "
            "round), so a model that samples them reads the answer; --drop-leaked-edges "
            "writes the graph without them") in stderr.splitlines()


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
    # The graph's edges are the train pairs, and hold the test pairs.
    (None, {}, "valid.npy: the pair "),
    (None, {"--link-train": "edges"}, "edges.npy: 10 validation pairs would be scored "
     "after training on them"),
    (None, {"--link-train": "train_but_valid"}, "test.npy: the pair "),
    (None, {"--link-train": "train_but_valid"}, "train_but_valid.npy: 15 test pairs would "
     "be scored after training on them"),
    (None, {"--link-test": None}, "--link-valid needs --link-test (a link task's four "
     "evaluation inputs)"),
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
