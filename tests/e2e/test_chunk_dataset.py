"""distributed/chunk_dataset.py: `write` turns an OnDiskDataset into the
chunked input of DGL's distributed partitioning pipeline, whose chunks put
together are the dataset (edges, features, labels, masks); `finish` turns
the pipeline's per-partition orig_nids.dgl into what the trainer reads
(orig_nids.pt, item_sets.pt in the partitions' ids, dataset_info.json).
DGL's pipeline itself (its tools/, not in the wheel) was run by hand on
this output (docs/distributed.md#partitioning-at-scale)."""
import importlib.util
import json
import os

import numpy as np
import pytest
import torch
import yaml

from helpers import DISTRIBUTED, edited_copy

spec = importlib.util.spec_from_file_location(
    "chunk_dataset", os.path.join(DISTRIBUTED, "chunk_dataset.py"))
chunk_dataset = importlib.util.module_from_spec(spec)
spec.loader.exec_module(chunk_dataset)


def read(dataset, name):
    return np.load(os.path.join(dataset, name))


@pytest.fixture(scope="module")
def chunked(small_dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("chunked") / "c"
    chunk_dataset.main(["write", "--dataset", small_dataset, "--out",
                        str(out), "--num-chunks", "3"])
    with open(out / "metadata.json") as f:
        return out, json.load(f)


def test_the_chunks_put_together_are_the_dataset(small_dataset, chunked):
    out, metadata = chunked
    num_nodes = 3000
    assert metadata["num_nodes_per_type"] == [num_nodes]
    assert sum(metadata["num_nodes_per_chunk"][0]) == num_nodes
    edges = read(small_dataset, "edges.npy")
    assert metadata["num_edges_per_chunk"] == [
        chunk_dataset.chunk_sizes(edges.shape[1], 3)]
    # The edges, as DGL's pipeline reads them: "src dst" per line.
    written = np.concatenate([
        np.loadtxt(out / path, dtype=np.int64, ndmin=2)
        for path in metadata["edges"]["_N:_E:_N"]["data"]])
    assert np.array_equal(written.T, edges)

    def node_data(key):
        entry = metadata["node_data"]["_N"][key]
        assert entry["format"] == {"name": "numpy"}
        return np.concatenate([np.load(out / path) for path in entry["data"]])

    assert np.array_equal(node_data("feat"), read(small_dataset,
                                                  "node_feat.npy"))
    labels = node_data("label")
    outside = np.ones(num_nodes, dtype=bool)
    for split, mask in (("train", "train_mask"), ("valid", "val_mask"),
                        ("test", "test_mask")):
        seeds = read(small_dataset, f"{split}_seed_nodes.npy")
        assert np.array_equal(np.flatnonzero(node_data(mask)), np.sort(seeds))
        assert np.array_equal(labels[seeds],
                              read(small_dataset, f"{split}_labels.npy"))
        outside[seeds] = False
    assert (labels[outside] == -1).all()
    with open(out / "dataset_info.json") as f:
        info = json.load(f)
    assert info["features"] == {"feat": 32} and info["num_classes"] == 10
    assert info["labels"] == "class" and info["num_train"] == len(
        read(small_dataset, "train_seed_nodes.npy"))


def test_finish_maps_the_pipelines_ids(small_dataset, chunked, tmp_path):
    """The pipeline's output, as DGL's v2.1.0 pipeline writes it (read in
    tools/distpartitioning/utils.py, write_dgl_objects): metadata.json, and
    per partition orig_nids.dgl, {"_N": the dataset ids of its nodes}."""
    import dgl

    out, _ = chunked
    orig_nids = torch.randperm(3000, generator=torch.Generator().manual_seed(0))
    parts = tmp_path / "parts"
    for part_id, ids in enumerate((orig_nids[:1400], orig_nids[1400:])):
        (parts / f"part{part_id}").mkdir(parents=True)
        dgl.data.utils.save_tensors(
            str(parts / f"part{part_id}" / "orig_nids.dgl"), {"_N": ids})
    (parts / "metadata.json").write_text(json.dumps(
        {"graph_name": "small", "num_parts": 2}))
    chunk_dataset.main(["finish", "--chunked", str(out), "--partitions",
                        str(parts)])
    assert torch.equal(torch.load(parts / "orig_nids.pt"), orig_nids)
    item_sets = torch.load(parts / "item_sets.pt")
    for name, split in (("train_set", "train"), ("validation_set", "valid"),
                        ("test_set", "test")):
        seeds, labels = item_sets[name]
        assert np.array_equal(orig_nids[seeds].numpy(),
                              read(small_dataset, f"{split}_seed_nodes.npy"))
        assert np.array_equal(labels.numpy(),
                              read(small_dataset, f"{split}_labels.npy"))
    with open(parts / "dataset_info.json") as f:
        assert json.load(f)["graph_name"] == "small"


def test_labels_from_a_node_feature_and_multi_hot(multi_label_dataset,
                                                  tmp_path):
    """The multi-label edit's keys: multi-hot rows (zeros outside the
    splits), read from the node feature where the item sets hold none."""
    dataset = tmp_path / "seeds_only"
    import shutil

    shutil.copytree(multi_label_dataset, dataset,
                    ignore=shutil.ignore_patterns("preprocessed"))
    with open(dataset / "metadata.yaml") as f:
        metadata = yaml.safe_load(f)
    for split in ("train_set", "validation_set", "test_set"):
        data = metadata["tasks"][0][split][0]["data"]
        data[:] = [d for d in data if d["name"] == "seed_nodes"]
    with open(dataset / "metadata.yaml", "w") as f:
        yaml.safe_dump(metadata, f)
    copy = edited_copy(tmp_path, "multi_label", "two_features")
    chunk_dataset.main(["write", "--dataset", str(dataset), "--out",
                        str(tmp_path / "c"), "--num-chunks", "2",
                        "--example", copy])
    with open(tmp_path / "c" / "metadata.json") as f:
        node_data = json.load(f)["node_data"]["_N"]
    assert set(node_data) == {"feat", "degree", "label", "train_mask",
                              "val_mask", "test_mask"}
    labels = np.concatenate([np.load(tmp_path / "c" / path)
                             for path in node_data["label"]["data"]])
    label_feature = next(e for e in metadata["feature_data"]
                         if e["name"] == "label")
    expected = np.load(dataset / label_feature["path"]).astype(np.float32)
    seeds = np.concatenate([
        np.load(dataset / next(d for d in metadata["tasks"][0][s][0]["data"]
                               if d["name"] == "seed_nodes")["path"])
        for s in ("train_set", "validation_set", "test_set")])
    assert labels.dtype == np.float32 and labels.shape == expected.shape
    assert np.array_equal(labels[seeds], expected[seeds])
    outside = np.setdiff1d(np.arange(len(labels)), seeds)
    assert (labels[outside] == 0).all()


def test_what_it_cannot_chunk_is_refused_in_one_line(small_dataset, tmp_path,
                                                     capsys):
    def refusal(*argv):
        with pytest.raises(SystemExit) as exited:
            chunk_dataset.main(list(argv))
        error = capsys.readouterr().err.strip()
        assert exited.value.code == 2 and len(error.splitlines()) == 1, error
        return error

    assert "no metadata.yaml" in refusal(
        "write", "--dataset", str(tmp_path), "--out", str(tmp_path / "c"),
        "--num-chunks", "2")
    assert "--num-chunks" in refusal(
        "write", "--dataset", small_dataset, "--out", str(tmp_path / "c"),
        "--num-chunks", "0")
    assert "--num-chunks 3001: more than the graph's 3000 nodes" in refusal(
        "write", "--dataset", small_dataset, "--out", str(tmp_path / "c"),
        "--num-chunks", "3001")
    # Edges in a format it cannot map.
    import shutil

    copy = tmp_path / "csv"
    shutil.copytree(small_dataset, copy,
                    ignore=shutil.ignore_patterns("preprocessed"))
    with open(copy / "metadata.yaml") as f:
        metadata = yaml.safe_load(f)
    metadata["graph"]["edges"][0]["format"] = "csv"
    with open(copy / "metadata.yaml", "w") as f:
        yaml.safe_dump(metadata, f)
    assert "the graph's edges stored as 'csv'" in refusal(
        "write", "--dataset", str(copy), "--out", str(tmp_path / "c"),
        "--num-chunks", "2")
    assert "metadata.json does not exist" in refusal(
        "finish", "--chunked", str(tmp_path), "--partitions", str(tmp_path))
