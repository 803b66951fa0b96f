"""Tests of scripts/make_synthetic_dataset.py: seeded runs repeat their
bytes, --force replaces only what it wrote, bad arguments are one line,
and --hetero plants its signal in the items. Its main() runs in this
process (tests/dataset_inputs.py)."""

import os

import numpy as np

import pytest

from dataset_inputs import SYNTHETIC, load, run


def test_synthetic_is_deterministic_per_seed(tmp_path):
    args = ["--num-nodes", "600", "--feat-dim", "8", "--avg-degree", "5"]
    for name, seed in [("a", 0), ("b", 0), ("c", 1)]:
        result = run(SYNTHETIC, tmp_path / name, *args, "--seed", seed, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
    assert "600 nodes" in result.stdout and "train/val/test 360/120/120" in result.stdout
    files = sorted(os.listdir(tmp_path / "a"))
    assert "edges.npy" in files and "metadata.yaml" in files
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    for name in ["edges.npy", "node_feat.npy", "node_label.npy"]:
        assert (tmp_path / "a" / name).read_bytes() != (tmp_path / "c" / name).read_bytes(), name


def test_synthetic_existing_dir_refused_then_replaced_with_force(tmp_path):
    args = ["--num-nodes", "200", "--feat-dim", "4", "--avg-degree", "3"]
    out = tmp_path / "out"
    out.mkdir()
    (out / "metadata.yaml").write_text("old")
    refused = run(SYNTHETIC, out, *args, "--force")  # not the script's
    assert refused.returncode == 2 and "nothing was removed" in refused.stderr
    refused = run(SYNTHETIC, out, *args)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("make_synthetic_dataset.py: error: "), refused.stderr
    assert f"{out}: already exists" in lines[0] and "--force" in lines[0], lines[0]
    assert sorted(os.listdir(out)) == ["metadata.yaml"]
    assert (out / "metadata.yaml").read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["out"]

    (out / "metadata.yaml").unlink()
    out.rmdir()
    assert run(SYNTHETIC, out, *args, "--seed", "1").returncode == 0
    replaced = run(SYNTHETIC, out, *args, "--force")
    assert replaced.returncode == 0, replaced.stderr
    assert "200 nodes" in replaced.stdout
    import yaml

    metadata = yaml.safe_load((out / "metadata.yaml").read_text())
    assert metadata["graph"]["nodes"][0]["num"] == 200
    assert np.load(out / "node_feat.npy").shape == (200, 4)
    assert sorted(os.listdir(tmp_path)) == ["out"]


@pytest.mark.parametrize("args, message", [
    (["--num-nodes", "0"], "--num-nodes: 0 is too small (at least 1)"),
    (["--split", "0.9,0.2,0"], "sum to"),
    (["--num-classes", "1"], "--num-classes: 1 is too small (at least 2)"),
])
def test_synthetic_bad_arguments(tmp_path, args, message):
    result = run(SYNTHETIC, tmp_path / "out", *args)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def nearest_mean_accuracy(x, labels, train, test):
    """Test accuracy of the nearest class mean of `x` (means of the train
    rows): how much of the class a feature carries by itself."""
    means = np.stack([x[train][labels[train] == c].mean(0)
                      for c in range(labels.max() + 1)])
    nearest = np.argmin(((x[test][:, None] - means[None]) ** 2).sum(-1), 1)
    return float((nearest == labels[test]).mean())


def test_the_heterogeneous_generator_plants_its_signal_in_the_items(tmp_path):
    """--hetero: users (labelled) and items; a user's own features tell
    little of its class, the mean of the items it bought much more, so a
    model that learns well has read the items."""
    args = ["--hetero", "--num-nodes", 3000, "--feat-dim", 16,
            "--num-classes", 5]
    result = run(SYNTHETIC, tmp_path / "a", *args)
    assert result.returncode == 0, result.stderr
    assert run(SYNTHETIC, tmp_path / "b", *args).returncode == 0
    for name in os.listdir(tmp_path / "a"):  # the same bytes again
        assert (tmp_path / "a" / name).read_bytes() == (
            tmp_path / "b" / name).read_bytes(), name
    dataset = load(tmp_path / "a")
    users = dataset.feature.read("node", "user", "feat").numpy()
    items = dataset.feature.read("node", "item", "feat").numpy()
    assert users.shape == (3000, 16) and items.shape == (1500, 8)
    labels = dataset.feature.read("node", "user", "label").numpy().reshape(-1)
    train = dataset.tasks[0].train_set[0:1800]["user"][0].numpy()
    test = dataset.tasks[0].test_set[0:600]["user"][0].numpy()
    buys = np.load(tmp_path / "a" / "edges_0.npy")
    bought = np.zeros((3000, 8))
    np.add.at(bought, buys[0], items[buys[1]])
    bought /= np.maximum(np.bincount(buys[0], minlength=3000), 1)[:, None]
    # Measured: 0.303 from the users' own features, 0.883 from their items
    # (chance 0.2).
    assert nearest_mean_accuracy(users, labels, train, test) < 0.4
    assert nearest_mean_accuracy(bought, labels, train, test) > 0.8
