"""Bad input, as node_classification.py meets it: every bad argument and
dataset is refused in one line naming the bad value, exit status 2, before
any rank is spawned."""
import os
import shutil

import numpy as np
import pytest
import yaml

from helpers import with_plan

CPU = ["--mode", "cpu-cpu"]  # CPU ranks on any machine, GPUs or not


def rewrite_metadata(dataset, tmp_path, edit):
    copy = str(tmp_path / "edited")
    shutil.copytree(dataset, copy, ignore=shutil.ignore_patterns(
        "preprocessed"))
    path = os.path.join(copy, "metadata.yaml")
    with open(path) as f:
        metadata = yaml.safe_load(f)
    edit(metadata)
    with open(path, "w") as f:
        yaml.safe_dump(metadata, f)
    return copy


def drop_num_classes(metadata):
    del metadata["tasks"][0]["num_classes"]


def drop_tasks(metadata):
    del metadata["tasks"]


def drop_test_set(metadata):
    del metadata["tasks"][0]["test_set"]


def rename_feat(metadata):
    for feature in metadata["feature_data"]:
        if feature["name"] == "feat":
            feature["name"] = "features"


@pytest.mark.parametrize(
    "args,message",
    [
        (["--fanout", "10,10"],
         "--fanout 10,10: 2 values, but the model has 3 layers"),
        (["--fanout", "-1,5,5,5"],
         "--fanout -1,5,5,5: 4 values, but the model has 3 layers"),
        # One-machine ranks meet through a file, not a port.
        (["--master-port", "29500"],
         "unrecognized arguments: --master-port 29500"),
        (["--fanout", "10,0,5"], "each fanout is positive"),
        (["--batch-size", "0"], "--batch-size: 0 is too small"),
        (["--epochs", "0"], "--epochs: 0 is too small"),
        (["--num-workers", "-1"], "--num-workers: -1 is too small"),
        (["--lr", "-0.1"], "--lr: -0.1 must be positive"),
        (["--gpu", "0,x"], "--gpu '0,x'"),
        (["--mode", "gpu"], "invalid choice: 'gpu'"),
        (["--mode", "cuda-cuda"], "--mode cuda-cuda needs CUDA"),
        (["--gpu=0,1", "--mode", "pinned-cuda"], "--mode pinned-cuda needs CUDA"),
        (["--gpu-cache-size", "1024"], "--gpu-cache-size 1024 needs a CUDA"),
        (["--batch-size", "901", "--gpu=0,1"],
         "use --batch-size 900 or less"),
        (["--threads", "0"], "--threads: 0 is too small (at least 1)"),
        (["--max-batches", "0"], "--max-batches: 0 is too small"),
        (["--threads", "x"], "--threads: 'x' is not an integer"),
        (["--seed", "-1"], "--seed: -1 is too small (at least 0)"),
        (["--predict", "out.csv"],
         "--predict out.csv: the file's name ends in .npy"),
        (["--epochs", "1.5"], "--epochs: '1.5' is not an integer"),
        (["--gpu-cache-size", "-1"], "--gpu-cache-size: -1 is too small"),
        (["--lr", "x"], "--lr: 'x' is not a number"),
        (["--fanout", "5,x,5"], "'5,x,5' is not a comma-separated list"),
        (["--precision", "fp16"], "invalid choice: 'fp16'"),
    ],
)
def test_bad_arguments(small_dataset, capsys, no_cuda, nothing_spawned, args,
                       message):
    import node_classification

    with pytest.raises(SystemExit) as exit_info:
        node_classification.main(["--dataset", small_dataset, *args])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert message in error
    assert len(error.splitlines()) == 1


@pytest.mark.parametrize("mode", ["pinned-cuda", "cuda-cuda"])
def test_workers_where_sampling_runs_on_the_gpu_spawn_nothing(
        small_dataset, capsys, monkeypatch, nothing_spawned, mode):
    # A machine whose torch and DGL both have CUDA, so that the mode itself
    # is not what is refused.
    import gbrun.planning
    import node_classification

    monkeypatch.setattr(gbrun.planning, "detect_machine",
                        lambda precision: gbrun.planning.Machine(True, True, 2, 2))
    with pytest.raises(SystemExit) as exit_info:
        node_classification.main(["--dataset", small_dataset, "--gpu=0,1",
                                  "--batch-size", "64", "--num-workers", "1",
                                  "--mode", mode])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error.endswith(f"--num-workers 1: with --mode {mode} sampling runs "
                          "on the GPU, which worker processes cannot do; use "
                          "--num-workers 0"), error
    assert len(error.splitlines()) == 1


def test_a_fanout_starting_with_minus_one_is_a_value():
    # argparse takes "-1,5,5" for an option unless told otherwise ("expected
    # one argument").
    import node_classification

    for argv in (["--fanout", "-1,5,5"], ["--fanout=-1,5,5"]):
        assert node_classification.parse_args(argv).fanout == [-1, 5, 5]
    assert node_classification.parse_args(["--fanout", "-1"]).fanout == [-1]


@pytest.mark.parametrize(
    "edit,message",
    [
        (drop_num_classes, "has no num_classes in metadata.yaml"),
        (drop_tasks, "defines no task"),
        (drop_test_set, "has an empty test_set"),
        (rename_feat, "has no node feature named 'feat' (it has: features"),
    ],
)
def test_bad_datasets(small_dataset, tmp_path, capsys, nothing_spawned,
                      edit, message):
    import node_classification

    dataset = rewrite_metadata(small_dataset, tmp_path, edit)
    with pytest.raises(SystemExit) as exit_info:
        node_classification.main(["--dataset", dataset])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def drop_item_set_labels(metadata):
    for split in ("train_set", "validation_set", "test_set"):
        data = metadata["tasks"][0][split][0]["data"]
        data[:] = [d for d in data if d["name"] == "seed_nodes"]


def test_labels_that_are_not_one_class_per_node_are_refused(
        small_dataset, multi_label_dataset, tmp_path, capsys,
        nothing_spawned):
    # Multi-hot labels, in the item sets or only as the node feature, and
    # class labels out of range or stored as floats: never a silent
    # reinterpretation (a flattened multi-hot array gave 0.695 "accuracy").
    import node_classification

    def fewer_classes(metadata):
        metadata["tasks"][0]["num_classes"] = 5

    def float_labels(metadata):
        data = metadata["tasks"][0]["train_set"][0]["data"]
        path = [d for d in data if d["name"] == "labels"][0]["path"]
        np.save(os.path.join(float_copy, path),
                np.load(os.path.join(small_dataset, path)).astype(np.float32))

    float_copy = str(tmp_path / "edited")
    takes = "but the example takes one integer class in [0, {}) per node"
    cases = [
        (multi_label_dataset, None, "the train_set's labels have shape "
         f"[1800, 5] and dtype float32, {takes.format(5)}"),
        (multi_label_dataset, drop_item_set_labels, "node feature 'label' "
         "(the train_set's labels) have shape [1800, 5] and dtype float32"),
        (small_dataset, fewer_classes, "the train_set's labels have shape "
         f"[1800] and dtype int64 with values in [0, 9], {takes.format(5)}"),
        (small_dataset, float_labels, "the train_set's labels have shape "
         f"[1800] and dtype float32, {takes.format(10)}"),
    ]
    for dataset, edit, message in cases:
        if edit is not None:
            shutil.rmtree(float_copy, ignore_errors=True)
            dataset = rewrite_metadata(dataset, tmp_path, edit)
        with pytest.raises(SystemExit) as exit_info:
            node_classification.main(["--dataset", dataset, "--gpu=0,1"])
        error = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2, error
        assert len(error.splitlines()) == 1 and message in error, error


def test_the_item_sets_are_the_tasks_own(small_dataset):
    # Train, validation and test items are the task's splits, each its own
    # (a test set built from the validation split trains and reports fine).
    import torch

    import gbrun.data.datasets
    import node_classification as nc

    job = nc.load_job(*with_plan(nc.parse_args(["--dataset", small_dataset])))
    task = gbrun.data.datasets.load_dataset(small_dataset).tasks[0]
    for item_set, split in zip(job.item_sets, (task.train_set,
                                               task.validation_set,
                                               task.test_set)):
        seeds, labels = item_set[:]
        expected_seeds, expected_labels = split[:]
        assert torch.equal(seeds, expected_seeds)
        assert torch.equal(labels, expected_labels.long())


def test_a_train_set_smaller_than_the_ranks_is_refused(
        synthetic, capsys, nothing_spawned):
    import node_classification

    # 40 nodes, 2.5% for training: one train node for two ranks.
    dataset = synthetic("one_train_node", "--num-nodes", 40, "--split",
                        "0.025,0.5,0.475")
    with pytest.raises(SystemExit) as exit_info:
        node_classification.main(["--dataset", dataset, "--gpu=0,1",
                                  "--mode", "cpu-cpu", "--batch-size", "1"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error.endswith("the train set has 1 items, fewer than the 2 ranks")
    assert len(error.splitlines()) == 1


def test_dataset_paths_that_are_not_datasets(tmp_path, capsys,
                                              nothing_spawned):
    import node_classification

    for dataset, message in [
        (str(tmp_path), "is a directory without metadata.yaml"),
        (str(tmp_path / "nowhere"), "is neither a builtin dataset"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            node_classification.main(["--dataset", dataset])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_builtin_download_failure_says_how_to_run_offline(
    tmp_path, capsys, monkeypatch, nothing_spawned
):
    import node_classification

    # A failing download, whatever the network: DGL's BuiltinDataset raises
    # what urllib raises without a route.
    def unreachable(name, root):
        raise ConnectionError(f"cannot reach the server for {name}")

    monkeypatch.setattr(node_classification.gb, "BuiltinDataset", unreachable)
    with pytest.raises(SystemExit) as exit_info:
        node_classification.main(
            ["--dataset", "cora", "--data-root", str(tmp_path)]
        )
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "could not fetch dataset 'cora'" in error
    assert "offline, --dataset synthetic trains on a graph that comes with the example" in error


def two_types(small_dataset, tmp_path):
    """The small dataset's nodes as users, with a second node type (items,
    a feature "feat" of their own) and two edge types between them: the
    user features are named "feat", as the example's key."""
    def edit(metadata):
        nodes = metadata["graph"]["nodes"][0]
        nodes["type"] = "user"
        metadata["graph"]["nodes"].append({"type": "item", "num": 50})
        edges = metadata["graph"]["edges"][0]
        edges["type"] = "user:buys:item"
        metadata["graph"]["edges"].append(
            {"type": "item:bought-by:user", "format": "numpy",
             "path": "reverse.npy"})
        for feature in metadata["feature_data"]:
            feature["type"] = "user"
        metadata["feature_data"].append(
            {"domain": "node", "type": "item", "name": "feat",
             "format": "numpy", "in_memory": True, "path": "item_feat.npy"})
        for split in ("train_set", "validation_set", "test_set"):
            metadata["tasks"][0][split][0]["type"] = "user"

    dataset = rewrite_metadata(small_dataset, tmp_path, edit)
    edges = np.load(os.path.join(dataset, "edges.npy"))
    # user -> item: the destination ids within the 50 items.
    np.save(os.path.join(dataset, "edges.npy"),
            np.stack([edges[0], edges[1] % 50]))
    np.save(os.path.join(dataset, "reverse.npy"),
            np.stack([edges[1] % 50, edges[0]]))
    np.save(os.path.join(dataset, "item_feat.npy"),
            np.zeros((50, 4), dtype=np.float32))
    return dataset


def test_a_heterogeneous_dataset_is_refused_naming_its_types(
        small_dataset, tmp_path, capsys, nothing_spawned):
    """Before: "has no node feature named 'feat' (it has: feat, feat,
    label)". Every script that reads a dataset refuses it the same way."""
    import importlib.util

    import node_classification
    from helpers import BENCHMARKS, DISTRIBUTED

    dataset = two_types(small_dataset, tmp_path)
    expected = (f"dataset '{dataset}' is heterogeneous (node types: item, "
                "user; edge types: item:bought-by:user, user:buys:item), "
                "but the example trains a graph of one node type and one "
                "edge type: docs/customising.md#several-node-and-edge-types "
                "shows the edit for several")

    def load(path):
        spec = importlib.util.spec_from_file_location(
            os.path.basename(path)[:-3], path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    for main, argv in (
            (node_classification.main, ["--dataset", dataset]),
            (load(os.path.join(DISTRIBUTED, "partition_graph.py")).main,
             ["--dataset", dataset, "--num-parts", "2", "--out",
              str(tmp_path / "parts")]),
            (load(os.path.join(DISTRIBUTED, "chunk_dataset.py")).main,
             ["write", "--dataset", dataset, "--out", str(tmp_path / "c"),
              "--num-chunks", "2"]),
            (load(os.path.join(BENCHMARKS, "stage_split.py")).main,
             ["--dataset", dataset])):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        error = capsys.readouterr().err.strip().splitlines()
        assert error[-1].endswith(expected), error
        assert not [line for line in error if "error" in line.lower()][:-1]


@pytest.mark.parametrize("verbose", [False, True])
def test_a_one_line_error_shows_its_traceback_only_when_asked(
        monkeypatch, capsys, verbose):
    """A failure the machine causes (a full disk) is one line; with
    GBRUN_TRACEBACK=1 the traceback it was made from comes first, with the
    cause the one line hid."""
    from gbrun.cli import UsageError, fail

    monkeypatch.setenv("GBRUN_TRACEBACK", "1" if verbose else "")
    with pytest.raises(SystemExit) as exited:
        try:
            try:
                raise OSError(28, "No space left on device")
            except OSError:
                raise UsageError("could not write x: No space left") from None
        except UsageError as error:
            fail(error)
    assert exited.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1].endswith("error: could not write x: No space left")
    assert (len(lines) > 1) == verbose
    assert ("OSError: [Errno 28] No space left on device" in lines) == verbose
