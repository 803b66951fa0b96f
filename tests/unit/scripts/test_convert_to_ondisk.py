"""Tests of scripts/convert_to_ondisk.py: the datasets it writes (loaded
back with gb.OnDiskDataset and compared with its inputs), one node type or
several; bad input refused in one line, exit 2, nothing written; what it
warns of; --force replacing only a dataset gbrun wrote. Its main() runs in
this process (tests/dataset_inputs.py), and once as a subprocess."""

import os
import sys
from pathlib import Path

import numpy as np
import pytest

import convert_to_ondisk
from dataset_inputs import (
    CONVERT, NUM_NODES, convert_args, leftovers, load, make_inputs, pair_set, run,
    run_script, snapshot_tree, write_small_dataset,
)


def graph_edge_set(graph):
    """{(src, dst)} of a FusedCSCSamplingGraph, from its CSC arrays."""
    indptr = graph.csc_indptr.numpy()
    dst = np.repeat(np.arange(len(indptr) - 1), np.diff(indptr))
    return set(zip(graph.indices.numpy().tolist(), dst.tolist()))


def itemset_arrays(itemset):
    """(node ids, labels) of a GraphBolt ItemSet of (seed_node, label)."""
    pairs = [(int(node), int(label)) for node, label in itemset]
    return np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])


# --------------------------------------------------------------- round trip


@pytest.mark.parametrize("flags", [[], ["--drop-self-loops"], ["--add-reverse-edges", "--drop-self-loops"]])
def test_round_trip(tmp_path, flags):
    paths, arrays = make_inputs(tmp_path)
    out = tmp_path / "out"
    result = run(CONVERT, out, *convert_args(paths), *flags)
    assert result.returncode == 0, result.stderr
    assert f"--dataset {out}" in result.stdout

    expected = pair_set(arrays["edges"])
    if "--drop-self-loops" in flags:
        expected = {(s, d) for s, d in expected if s != d}
    if "--add-reverse-edges" in flags:
        expected |= {(d, s) for s, d in expected}
    dataset = load(out)
    assert graph_edge_set(dataset.graph) == expected
    assert dataset.graph.total_num_nodes == NUM_NODES

    feat = dataset.feature.read("node", None, "feat").numpy()
    np.testing.assert_allclose(feat, arrays["features"].astype(np.float32))
    assert tuple(dataset.feature.size("node", None, "feat")) == (3,)
    label_feat = dataset.feature.read("node", None, "label").numpy().reshape(-1)
    np.testing.assert_array_equal(label_feat, arrays["labels"])

    task = dataset.tasks[0]
    assert task.metadata["num_classes"] == 4
    for itemset, name in [(task.train_set, "train"), (task.validation_set, "val"), (task.test_set, "test")]:
        assert itemset.names == ("seed_nodes", "labels") and len(itemset) == len(arrays[name])
        nodes, labels = itemset_arrays(itemset)
        np.testing.assert_array_equal(nodes, arrays[name])
        np.testing.assert_array_equal(labels, arrays["labels"][arrays[name]])


@pytest.mark.slow
def test_the_converter_runs_from_the_command_line(tmp_path):
    # make_synthetic_dataset.py's command line runs for every dataset the
    # other test files make (conftest.make_synthetic).
    paths, _ = make_inputs(tmp_path)
    out = tmp_path / "out"
    converted = run_script(CONVERT, out, *convert_args(paths))
    assert converted.returncode == 0, converted.stderr
    assert f"--dataset {out}" in converted.stdout
    assert load(out).graph.total_num_nodes == NUM_NODES
    refused = run_script(CONVERT, out, *convert_args(paths))  # no --force
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.splitlines() == [
        f"convert_to_ondisk.py: error: {out}: already exists; use --force "
        "to replace it"], refused.stderr


@pytest.mark.parametrize("layout", ["csv_header", "csv_plain", "tsv_plain", "npy_E_by_2", "npy_2_by_2"])
def test_edge_file_layouts(tmp_path, layout):
    paths, arrays = make_inputs(tmp_path)
    edges = arrays["edges"] if layout != "npy_2_by_2" else np.array([[1, 2], [3, 4]])
    if layout.startswith(("csv", "tsv")):
        edge_path = tmp_path / "edges.txt"
        header = "src,dst" if layout == "csv_header" else ""
        sep = "\t" if layout == "tsv_plain" else ","
        np.savetxt(edge_path, edges.T, fmt="%d", delimiter=sep, header=header, comments="")
    else:
        edge_path = tmp_path / "edges_layout.npy"
        np.save(edge_path, edges.T if layout == "npy_E_by_2" else edges)  # (2, 2) means (2, E)
    paths["edges"] = edge_path
    out = tmp_path / "out"
    result = run(CONVERT, out, *convert_args(paths))
    assert result.returncode == 0, result.stderr
    written = np.load(out / "edges.npy")
    assert written.dtype == np.int64
    np.testing.assert_array_equal(written, edges)


def test_random_split_covers_all_nodes_once(tmp_path):
    paths, arrays = make_inputs(tmp_path)
    out = tmp_path / "out"
    result = run(CONVERT, out, *convert_args(paths, with_idx=False), "--split", "0.5,0.25,0.25")
    assert result.returncode == 0, result.stderr
    ids = [np.load(out / f"{p}_seed_nodes.npy") for p in ("train", "valid", "test")]
    assert [len(i) for i in ids] == [20, 10, 10]
    np.testing.assert_array_equal(np.sort(np.concatenate(ids)), np.arange(NUM_NODES))
    np.testing.assert_array_equal(np.load(out / "train_labels.npy"), arrays["labels"][ids[0]])


# --------------------------------------------------------------- bad inputs


def _save(name, array):
    """Mutation: replace one input file (or add one) with this array."""
    return lambda paths, tmp: np.save(paths.setdefault(name, tmp / f"{name}.npy"), array)


def _write_bytes(name, data):
    return lambda paths, tmp: paths[name].write_bytes(data)


def _remove(name):
    return lambda paths, tmp: paths[name].unlink()


def _edge_text(file_name, text):
    """Mutation: use a text edge file (CSV, TSV) with this content instead."""

    def mutate(paths, tmp):
        paths["edges"] = tmp / file_name
        paths["edges"].write_text(text)

    return mutate


N = NUM_NODES
BAD_INPUTS = {
    # case: (mutation, extra args, (input named in message, problem words))
    "edge_id_too_large": (_save("edges", np.array([[0, 1], [2, N + 5]])), [], ("edges.npy", f"node id {N + 5} out of range")),
    "edge_id_negative": (_save("edges", np.array([[0, -1], [2, 3]])), [], ("edges.npy", "node id -1 out of range")),
    "edges_wrong_shape": (_save("edges", np.zeros((3, 5), dtype=np.int64)), [], ("edges.npy", "(2, E) or (E, 2)")),
    "edges_float": (_save("edges", np.zeros((2, 5))), [], ("edges.npy", "integer")),
    "edges_empty": (_save("edges", np.zeros((2, 0), dtype=np.int64)), [], ("edges.npy", "no edges")),
    "features_1d": (_save("features", np.zeros(N)), [], ("features.npy", "2-D")),
    "features_int": (_save("features", np.zeros((N, 3), dtype=np.int64)), [], ("features.npy", "floating")),
    "features_nan": (_save("features", np.where(np.arange(3 * N).reshape(N, 3) == 7, np.nan, 1.0)), [],
                     ("features.npy", "nan at row 2, column 1")),
    "features_inf": (_save("features", np.where(np.arange(3 * N).reshape(N, 3) == 5, np.inf, 1.0)), [],
                     ("features.npy", "inf at row 1")),
    "features_garbage": (_write_bytes("features", b"not a numpy file"), [], ("features.npy", "cannot read")),
    "labels_3d": (_save("labels", np.zeros((N, 2, 1), dtype=np.int64)), [], ("labels.npy", "1-D integer")),
    "multi_hot_not_0_or_1": (_save("labels", np.where(np.arange(2 * N).reshape(N, 2) == 9, 2, 0)), [],
                             ("labels.npy", "a multi-hot array holds 0 or 1, got 2 at row 4, column 1")),
    "multi_hot_columns": (_save("labels", np.zeros((N, 2), dtype=np.int64)), ["--num-classes", "3"],
                          ("labels.npy", "one column per class; got 2 columns for --num-classes 3")),
    "values_int": (_save("labels", np.zeros(N, dtype=np.int64)), ["--label-kind", "value"],
                   ("labels.npy", "values to regress are a 1-D or 2-D float array, got dtype int64")),
    "values_nan": (_save("labels", np.where(np.arange(N) == 3, np.nan, 0.5)), ["--label-kind", "value"],
                   ("labels.npy", "non-finite value nan at row 3, column 0")),
    "extra_feature_rows": (_save("degree", np.zeros((N - 2, 1))), ["--feature", "degree=DEGREE"],
                           ("degree.npy", f"{N - 2} rows but {N} nodes")),
    "extra_feature_nan": (_save("degree", np.full((N, 1), np.nan)), ["--feature", "degree=DEGREE"],
                          ("degree.npy", "non-finite value nan at row 0")),
    "extra_feature_named_feat": (_save("degree", np.zeros((N, 1))), ["--feature", "feat=DEGREE"],
                                 ("--feature feat=", "a name other than feat and label")),
    "labels_float": (_save("labels", np.zeros(N)), [], ("labels.npy", "1-D integer")),
    "labels_length": (_save("labels", np.zeros(N - 1, dtype=np.int64)), [], ("labels.npy", f"{N - 1} labels but {N} nodes")),
    "labels_negative": (_save("labels", np.r_[np.zeros(N - 1, dtype=np.int64), -3]), [], ("labels.npy", "negative label -3")),
    "labels_too_large": (None, ["--num-classes", "3"], ("labels.npy", "label 3 >= num_classes 3")),
    "num_classes_zero": (None, ["--num-classes", "0"], ("--num-classes", "0 is too small (at least 1)")),
    "train_out_of_range": (_save("train", np.array([0, N])), [], ("train.npy", f"node id {N} out of range")),
    "val_out_of_range": (_save("val", np.array([24, N + 1])), [], ("val.npy", f"node id {N + 1} out of range")),
    "test_out_of_range": (_save("test", np.array([N + 2, 33])), [], ("test.npy", f"node id {N + 2} out of range")),
    "val_negative": (_save("val", np.array([24, -2])), [], ("val.npy", "node id -2 out of range")),
    "train_empty": (_save("train", np.array([], dtype=np.int64)), [], ("train.npy", "empty")),
    "train_float": (_save("train", np.array([0.0, 1.0])), [], ("train.npy", "integer")),
    "val_float": (_save("val", np.array([24.0, 25.0])), [], ("val.npy", "integer array of node ids, got dtype float64")),
    "test_float": (_save("test", np.array([33.0, 34.5])), [], ("test.npy", "integer array of node ids, got dtype float64")),
    "train_duplicate": (_save("train", np.r_[0:24, 5]), [], ("train.npy", "node 5 appears 2 times in the train set")),
    "val_duplicate": (_save("val", np.array([24, 25, 24])), [], ("val.npy", "node 24 appears 2 times")),
    "test_duplicate": (_save("test", np.array([33, 34, 34])), [], ("test.npy", "node 34 appears 2 times in the test set")),
    "val_overlaps_train": (_save("val", np.array([24, 3])), [], ("val.npy", "node 3 is in both the train and the validation set")),
    "test_overlaps_train": (_save("test", np.array([33, 3])), [], ("test.npy", "node 3 is in both the train")),
    "test_overlaps_val": (_save("test", np.array([33, 25])), [], ("test.npy", "node 25 is in both the validation and the test set")),
    "missing_file": (_remove("labels"), [], ("labels.npy", "no such file")),
    "missing_edges_file": (_remove("edges"), [], ("edges.npy", "no such file")),
    "missing_val_file": (_remove("val"), [], ("val.npy", "no such file")),
    # Text edge files: the message names the file and, where a row is at
    # fault, its line (1-based, header and blank lines counted).
    "csv_row_with_one_column": (_edge_text("edges.csv", "src,dst\n0,1\n2\n3,4\n"), [],
                                ("edges.csv", "line 3: expected two integer node ids")),
    "csv_non_numeric_cell": (_edge_text("edges.csv", "src,dst\n0,1\n2,3\n4,x\n"), [],
                             ("edges.csv", "line 4: expected two integer node ids, got '4,x'")),
    "csv_line_count_includes_blank_lines": (_edge_text("edges.csv", "0,1\n\n2,3\n4,x\n"), [],
                                            ("edges.csv", "line 4: expected two integer node ids")),
    "csv_row_with_three_columns": (_edge_text("edges.csv", "src,dst\n0,1\n2,3,4\n"), [],
                                   ("edges.csv", "fields in line 3, saw 3")),
    "csv_one_column_file": (_edge_text("edges.csv", "0\n1\n2\n"), [], ("edges.csv", "expected 2 columns (src, dst), got 1")),
    "csv_empty": (_edge_text("edges.csv", ""), [], ("edges.csv", "expected src,dst lines")),
    "csv_header_only": (_edge_text("edges.csv", "src,dst\n"), [], ("edges.csv", "no edges")),
    "csv_id_beyond_int64": (_edge_text("edges.csv", "0,1\n2,99999999999999999999999\n"), [],
                            ("edges.csv", "line 2: expected two integer node ids")),
    "csv_id_just_beyond_int64": (_edge_text("edges.csv", "0,1\n2,9223372036854775808\n"), [],
                                 ("edges.csv", "line 2: expected two integer node ids")),
    "tsv_non_numeric_cell": (_edge_text("edges.tsv", "0\t1\n2\tfoo\n"), [],
                             ("edges.tsv", "line 2: expected two integer node ids, got '2\\tfoo'")),
    "edges_not_text": (_write_bytes("edges", b"\xff\xfe\x00 not a numpy file"), [],
                       ("edges.npy", "neither a .npy file nor a text CSV")),
}


def test_multi_hot_labels_and_extra_features_round_trip(tmp_path):
    # A multi-label task (several classes per node) with a second node
    # feature, as docs/customising.md's multi-label edit trains on it.
    paths, arrays = make_inputs(tmp_path)
    tags = (np.random.default_rng(1).random((NUM_NODES, 5)) < 0.3).astype(np.int64)
    degree = np.arange(2 * NUM_NODES, dtype=np.float64).reshape(NUM_NODES, 2)
    np.save(tmp_path / "tags.npy", tags)
    np.save(tmp_path / "degree.npy", degree)
    args = convert_args(paths)
    args[args.index("--labels") + 1] = tmp_path / "tags.npy"
    out = tmp_path / "out"
    result = run(CONVERT, out, *args, "--feature", f"degree={tmp_path / 'degree.npy'}")
    assert result.returncode == 0, result.stderr
    assert "3 features, degree 2, 5 classes (multi-hot)" in result.stdout

    dataset = load(out)
    assert dataset.tasks[0].metadata["num_classes"] == 5
    np.testing.assert_array_equal(dataset.feature.read("node", None, "degree").numpy(), degree)
    label = dataset.feature.read("node", None, "label")
    assert label.dtype == torch_float32() and tuple(label.shape) == (NUM_NODES, 5)
    np.testing.assert_array_equal(label.numpy(), tags)
    nodes, labels = dataset.tasks[0].validation_set[:]
    np.testing.assert_array_equal(nodes.numpy(), arrays["val"])
    np.testing.assert_array_equal(labels.numpy(), tags[arrays["val"]])


def test_values_to_regress_round_trip(tmp_path):
    # Node regression (LABELS = "value"): one float per node is written as
    # rows of one, with num_classes 1.
    paths, arrays = make_inputs(tmp_path)
    values = np.random.default_rng(2).normal(size=NUM_NODES)
    np.save(tmp_path / "values.npy", values)
    args = convert_args(paths)
    args[args.index("--labels") + 1] = tmp_path / "values.npy"
    out = tmp_path / "out"
    result = run(CONVERT, out, *args, "--label-kind", "value")
    assert result.returncode == 0, result.stderr
    assert "3 features, 1 values per node" in result.stdout, result.stdout
    dataset = load(out)
    assert dataset.tasks[0].metadata["num_classes"] == 1
    nodes, labels = dataset.tasks[0].test_set[:]
    assert labels.dtype == torch_float32() and tuple(labels.shape) == (len(nodes), 1)
    np.testing.assert_allclose(labels.numpy()[:, 0], values[arrays["test"]], rtol=1e-6)


def torch_float32():
    import torch

    return torch.float32


def test_a_feature_given_twice_is_refused(tmp_path, capsys):
    paths, _ = make_inputs(tmp_path)
    with pytest.raises(SystemExit) as exited:
        convert_to_ondisk.main([str(tmp_path / "out"), *map(str, convert_args(paths)),
                                "--feature", "a=x.npy", "--feature", "a=y.npy"])
    assert exited.value.code == 2
    assert "--feature: the name 'a' is given twice" in capsys.readouterr().err


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_fails_cleanly(tmp_path, capsys, monkeypatch, case):
    monkeypatch.setattr(sys, "argv", ["convert_to_ondisk.py"])  # its name
    mutate, extra, (input_name, problem) = BAD_INPUTS[case]
    paths, _ = make_inputs(tmp_path)
    if mutate:
        mutate(paths, tmp_path)
    parent = tmp_path / "datasets"
    parent.mkdir()
    out = parent / "out"
    extra = [arg.replace("DEGREE", str(paths.get("degree"))) for arg in extra]
    try:
        code = convert_to_ondisk.main(list(map(str, [out, *convert_args(paths), *extra])))
    except SystemExit as exited:  # refused by the argument parser
        code = exited.code
    stdout, stderr = capsys.readouterr()
    assert code == 2, stdout + stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("convert_to_ondisk.py: error: "), stderr
    assert input_name in lines[0] and problem in lines[0], lines[0]
    assert not out.exists()
    assert list(parent.iterdir()) == []  # no temp dirs either


@pytest.mark.parametrize(
    "args, message",
    [
        (["--split", "0.8,0.3,0.1"], "sum to 1.2 > 1"),
        (["--split", "0.8,-0.1,0.1"], ">= 0"),
        (["--split", "0.8,0.1"], "expected 3 fractions"),
        (["--split", "a,b,c"], "three numbers"),
        (["--split", "0,0.5,0.5"], "train set is empty"),
        # The example validates and tests on them: refused here, not there.
        (["--split", "1,0,0"], "the validation set is empty"),
        (["--split", "0.9,0.1,0"], "the test set is empty"),
        (["--train-idx", "x.npy"], "all three"),
    ],
)
def test_bad_split_arguments(tmp_path, args, message):
    paths, _ = make_inputs(tmp_path)
    out = tmp_path / "out"
    result = run(CONVERT, out, *convert_args(paths, with_idx=False), *args)
    assert result.returncode == 2
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists() and leftovers(tmp_path) == []


def test_existing_dir_refused_then_replaced_with_force(tmp_path):
    paths, arrays = make_inputs(tmp_path)
    out = tmp_path / "out"
    write_small_dataset(out, arrays, force=False)
    before = os.stat(out / "metadata.yaml").st_ino
    refused = run(CONVERT, out, *convert_args(paths))
    assert refused.returncode == 2 and "already exists" in refused.stderr
    assert os.stat(out / "metadata.yaml").st_ino == before

    replaced = run(CONVERT, out, *convert_args(paths), "--force")
    assert replaced.returncode == 0, replaced.stderr
    assert os.stat(out / "metadata.yaml").st_ino != before  # a new file
    assert leftovers(tmp_path) == []


def _written(out, arrays):
    write_small_dataset(out, arrays, force=False)


@pytest.mark.parametrize("make, reason", [
    # Not written by these scripts: nothing records what is there.
    (lambda out, arrays: (out.mkdir(), (out / "notes.txt").write_text("mine")),
     "it holds no gbrun-written.json, the record of what gbrun wrote there"),
    (lambda out, arrays: (out.mkdir(), (out / "metadata.yaml").write_text("mine"),
                          (out / "edges.npy").write_bytes(b"x")),
     "it holds no gbrun-written.json"),
    # Written by them, then a user's file or directory added, or a file
    # changed.
    (lambda out, arrays: (_written(out, arrays), (out / "notes.txt").write_text("mine")),
     "it holds files this script does not write (notes.txt)"),
    (lambda out, arrays: (_written(out, arrays), (out / "node_feat_3.npy").mkdir(),
                          (out / "node_feat_3.npy" / "mine").write_text("mine")),
     "it holds files this script does not write (node_feat_3.npy)"),
    (lambda out, arrays: (_written(out, arrays), (out / "preprocessed").mkdir(),
                          (out / "preprocessed" / "mine").write_text("mine")),
     "it holds files this script does not write (preprocessed)"),
    (lambda out, arrays: (_written(out, arrays), (out / "edges.npy").write_bytes(b"mine")),
     "edges.npy changed since gbrun wrote it"),
])
def test_force_replaces_only_a_dataset_it_wrote(tmp_path, make, reason):
    # A user's directory given by mistake keeps every file.
    paths, arrays = make_inputs(tmp_path)
    out = tmp_path / "out"
    make(out, arrays)
    before = snapshot_tree(out)
    result = run(CONVERT, out, *convert_args(paths), "--force")
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and reason in lines[0] and "nothing was removed" in lines[0], lines
    assert snapshot_tree(out) == before
    assert leftovers(tmp_path) == []


def test_force_refuses_a_dataset_holding_the_commands_input(tmp_path):
    # Its edges were read from the directory about to be replaced.
    paths, arrays = make_inputs(tmp_path)
    out = tmp_path / "out"
    write_small_dataset(out, arrays, force=False)
    edges = out / "edges.npy"
    edges.write_bytes(paths["edges"].read_bytes())
    args = convert_args(paths)
    args[args.index(paths["edges"])] = edges
    result = run(CONVERT, out, *args, "--force")
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"it holds this command's input {edges}" in result.stderr
    assert edges.exists()


def test_force_never_replaces_the_current_directory(tmp_path):
    paths, _ = make_inputs(tmp_path)
    result = run(CONVERT, ".", *convert_args(paths), "--force", cwd=tmp_path)
    assert result.returncode == 2 and "refusing to replace the current directory" in result.stderr
    assert paths["edges"].exists() and leftovers(tmp_path.parent) == []


# ---------------------------------------------------------------- warnings


def test_warnings_for_isolated_nodes_and_absent_classes(tmp_path):
    paths, arrays = make_inputs(tmp_path)
    np.save(paths["edges"], np.array([[0, 1], [1, 2]]))  # nodes 3.. isolated
    labels = arrays["labels"].copy()
    labels[arrays["val"]] = 5  # class 5 only outside the train set
    np.save(paths["labels"], labels)
    result = run(CONVERT, tmp_path / "out", *convert_args(paths))
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 2, result.stderr
    assert f"{NUM_NODES - 3} of {NUM_NODES} nodes have no edges" in warnings[0]
    assert "2 of 6 classes have no train nodes: 4, 5" in warnings[1]


def test_the_converter_warns_of_the_edges_as_given(tmp_path):
    paths, _ = make_inputs(tmp_path)
    np.save(paths["edges"], np.concatenate([np.load(paths["edges"]),
                                            [[1, 1], [2, 2]]], axis=1))
    result = run(CONVERT, tmp_path / "out", *convert_args(paths))
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines()
                if "self-loops" in line or "more than once" in line]
    assert len(warnings) == 2, result.stderr
    assert all(line.startswith("warning: ") for line in warnings), warnings
    cleaned = run(CONVERT, tmp_path / "out2", *convert_args(paths),
                  "--drop-self-loops", "--add-reverse-edges")
    assert cleaned.returncode == 0, cleaned.stderr
    assert "self-loops" not in cleaned.stderr
    assert "more than once" not in cleaned.stderr


# ------------------------------------------- several node and edge types


def hetero_inputs(directory):
    """Two node types (40 users, 15 items), two edge types, a feature per
    type, labels on users; returns {name: path} and the arrays."""
    rng = np.random.default_rng(3)
    buys = np.stack([rng.integers(0, 40, 120), rng.integers(0, 15, 120)])
    arrays = {"buys": buys, "bought_by": buys[::-1].copy(),
              "user_feat": rng.normal(size=(40, 3)),
              "item_feat": rng.normal(size=(15, 2)),
              "labels": np.r_[0:3, rng.integers(0, 3, 37)],
              "bad_buys": np.stack([np.arange(5), [0, 1, 2, 15, 4]])}
    paths = {}
    for name, array in arrays.items():
        paths[name] = Path(directory) / f"{name}.npy"
        np.save(paths[name], array)
    return paths, arrays


def hetero_args(paths):
    return ["--node-type", "user=40", "--node-type", "item=15",
            "--edge-type", f"user:buys:item={paths['buys']}",
            "--edge-type", f"item:bought-by:user={paths['bought_by']}",
            "--type-features", f"user={paths['user_feat']}",
            "--type-features", f"item={paths['item_feat']}",
            "--target", "user", "--labels", paths["labels"]]


def test_two_node_types_and_two_edge_types_round_trip(tmp_path):
    paths, arrays = hetero_inputs(tmp_path)
    out = tmp_path / "shop"
    result = run(CONVERT, out, *hetero_args(paths))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(
        f"wrote {out}: nodes 40 user, 15 item; edges 120 user:buys:item, "
        "120 item:bought-by:user; 3 classes on user, train/val/test 24/8/8")
    dataset = load(out)
    graph = dataset.graph
    assert set(graph.node_type_to_id) == {"user", "item"}
    assert set(graph.edge_type_to_id) == {"user:buys:item", "item:bought-by:user"}
    # Each edge type's edges, in each type's own ids.
    offsets = graph.node_type_offset.numpy()
    indptr, indices = graph.csc_indptr.numpy(), graph.indices.numpy()
    dst = np.repeat(np.arange(len(indptr) - 1), np.diff(indptr))
    etypes = graph.type_per_edge.numpy()
    for etype, name in (("user:buys:item", "buys"),
                        ("item:bought-by:user", "bought_by")):
        src_type, _, dst_type = etype.split(":")
        mine = etypes == graph.edge_type_to_id[etype]
        src_ids = indices[mine] - offsets[graph.node_type_to_id[src_type]]
        dst_ids = dst[mine] - offsets[graph.node_type_to_id[dst_type]]
        assert sorted(zip(src_ids.tolist(), dst_ids.tolist())) == sorted(
            zip(*arrays[name].tolist()))
    for ntype in ("user", "item"):
        np.testing.assert_allclose(
            dataset.feature.read("node", ntype, "feat").numpy(),
            arrays[f"{ntype}_feat"], rtol=1e-6)
    train = dataset.tasks[0].train_set
    seeds, labels = train[0:len(train)]["user"]
    assert len(seeds) == 24
    np.testing.assert_array_equal(labels.numpy(), arrays["labels"][seeds.numpy()])


@pytest.mark.parametrize("edit,message", [
    (lambda a, p: a.__setitem__(a.index("--edge-type") + 1,
                                f"user:buys:item={p['bad_buys']}"),
     "edges of user:buys:item: node id 15 out of range [0, 15)"),
    (lambda a, p: a.__setitem__(a.index("--edge-type") + 1,
                                f"user:buys:shop={p['buys']}"),
     "edge type user:buys:shop: its destination node type 'shop' is not one of: item, user"),
    (lambda a, p: a.__setitem__(a.index("--target") + 1, "item"),
     "labels of item: 40 labels but 15 nodes"),
    (lambda a, p: a.__setitem__(a.index("--target") + 1, "shop"),
     "--target shop: not one of the node types: item, user"),
    (lambda a, p: a.__setitem__(a.index("--type-features") + 1,
                                f"user={p['item_feat']}"),
     "features of user: 15 rows but node type user has 40 nodes"),
    (lambda a, p: a.extend(["--edges", p["buys"]]),
     "--edges is for a graph of one node type"),
    (lambda a, p: a.extend(["--add-reverse-edges"]),
     "--add-reverse-edges is for a graph of one node type"),
], ids=["id out of its type's range", "unknown node type", "split on the wrong type",
        "unknown target", "feature rows", "--edges", "reverse edges"])
def test_bad_heterogeneous_input_is_one_line(tmp_path, edit, message):
    paths, _ = hetero_inputs(tmp_path)
    args = hetero_args(paths)
    edit(args, paths)
    result = run(CONVERT, tmp_path / "out", *args)
    assert result.returncode == 2, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    assert not (tmp_path / "out").exists()
