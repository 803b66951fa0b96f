"""One dataset directory, however its path is spelled, is preprocessed once.

GraphBolt (dgl 2.1.0) decides whether to preprocess a dataset again by
hashing its files under their paths as given, so `data/x`, `../data/x`, an
absolute path or a symlink each made it rebuild `preprocessed/`.
gbrun.data.datasets.load_dataset hands it the real path instead.
"""
import os

import numpy as np

import gbrun.data.datasets
from gbrun.data import inputs, ondisk


def preprocessed_files(dataset):
    """(mtime_ns, inode) of every file under dataset/preprocessed."""
    found = {}
    for root, _, files in os.walk(os.path.join(dataset, "preprocessed")):
        for name in files:
            path = os.path.join(root, name)
            status = os.stat(path)
            found[os.path.relpath(path, dataset)] = (status.st_mtime_ns, status.st_ino)
    return found


def test_one_dataset_under_four_spellings_is_preprocessed_once(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    num_nodes = 200
    dataset = tmp_path / "data" / "x"
    ondisk.write_ondisk_dataset(
        str(dataset), rng.integers(0, num_nodes, (2, 1000)),
        rng.random((num_nodes, 4), dtype=np.float32),
        rng.integers(0, 2, num_nodes), *inputs.split_nodes(num_nodes, (0.6, 0.2, 0.2), 0),
    )
    (tmp_path / "sub").mkdir()
    os.symlink(dataset, tmp_path / "link")

    monkeypatch.chdir(tmp_path)
    gbrun.data.datasets.load_dataset("data/x")
    first = preprocessed_files(dataset)
    assert any(name.endswith("metadata.yaml") for name in first), first

    spellings = [("sub", "../data/x"), ("sub", str(dataset)), (".", "link"),
                 (".", "./data//x/")]
    for cwd, spelling in spellings:
        monkeypatch.chdir(tmp_path / cwd)
        loaded = gbrun.data.datasets.load_dataset(spelling)
        assert len(loaded.tasks[0].train_set) == 120
        assert preprocessed_files(dataset) == first, (
            f"loading {spelling!r} from {cwd}/ rewrote preprocessed/"
        )
