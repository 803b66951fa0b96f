"""Tests of gbrun/data/ondisk.py called directly: its two writers, a graph
of one node type and one of several, share one body, so they write a
task's splits alike (named by gbrun.data.splits, as GraphBolt reads them)
and summarise alike. What each writes from a user's files is checked
through the converter (tests/unit/scripts/test_convert_to_ondisk.py);
where it writes and how it replaces, in test_outdir.py."""

import numpy as np
import yaml

from dataset_inputs import NUM_NODES, load, make_inputs, write_small_dataset
from gbrun.data import ondisk, splits


def write_both(tmp_path):
    """(one node type's directory and summary, several's), on the same
    labels and splits (the several's on node type "user")."""
    _, arrays = make_inputs(tmp_path)
    one = tmp_path / "one"
    several = tmp_path / "several"
    buys = np.stack([np.arange(NUM_NODES), np.arange(NUM_NODES) % 5])
    one_summary = write_small_dataset(one, arrays, force=False)
    several_summary = ondisk.write_hetero_dataset(
        several, {"user": NUM_NODES, "item": 5}, {"user:buys:item": buys}, arrays["labels"],
        arrays["train"], arrays["val"], arrays["test"], "user",
        features={"user": arrays["features"]})
    return (one, one_summary), (several, several_summary)


def test_both_writers_write_the_splits_alike_and_summarise_alike(tmp_path):
    (one, one_summary), (several, several_summary) = write_both(tmp_path)
    for key in ("num_classes", "multi_hot", "label_kind", "split_sizes", "link_sizes",
                "warnings"):
        assert one_summary[key] == several_summary[key], key
    assert list(one_summary["split_sizes"]) == [split.name for split in splits.TABLE]
    for split in splits.TABLE:
        for kind in ("seed_nodes", "labels"):
            name = f"{split.prefix}_{kind}.npy"
            assert (one / name).read_bytes() == (several / name).read_bytes(), name
    for directory in (one, several):
        task = yaml.safe_load((directory / "metadata.yaml").read_text())["tasks"][0]
        assert [key for key in task if key.endswith("_set")] == list(splits.ATTRIBUTES)


def test_graphbolt_reads_each_split_by_its_attribute(tmp_path):
    (one, summary), (several, _) = write_both(tmp_path)
    for directory, typed in ((one, False), (several, True)):
        task = load(directory).tasks[0]
        for split in splits.TABLE:
            item_set = getattr(task, split.attribute)
            assert len(item_set) == summary["split_sizes"][split.name]
            seeds = item_set[0:len(item_set)]
            seeds = seeds["user"][0] if typed else seeds[0]
            np.testing.assert_array_equal(
                seeds.numpy(), np.load(directory / f"{split.prefix}_seed_nodes.npy"))
