"""Tests of gbrun/data/outdir.py, where the dataset writer writes: --force
refuses a mount point or the home directory, and a write that fails or is
interrupted at any step keeps the old dataset and leaves no temp dir (the
refusals through the converter's command line are in
tests/unit/scripts/test_convert_to_ondisk.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dataset_inputs import leftovers, make_inputs, snapshot_tree, write_small_dataset
from gbrun.data import inputs, ondisk, outdir


@pytest.mark.skipif(os.geteuid() != 0 and not os.environ.get("CI"),
                    reason="a bind mount needs root (mandatory under CI=true)")
def test_force_refuses_a_bind_mount_of_the_same_file_system(tmp_path):
    """A bind mount shares its parent's st_dev: the mount table says it is
    one. Made in a mount namespace of its own (unshare -m)."""
    _, arrays = make_inputs(tmp_path)
    source, out = tmp_path / "source", tmp_path / "out"
    write_small_dataset(source, arrays, force=False)
    out.mkdir()
    check = ("import sys; from gbrun.data import outdir, inputs\n"
             "try:\n    outdir.check_out_dir(sys.argv[1], True)\n"
             "except inputs.DatasetError as e:\n    print(e)")
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", f'mount --make-rprivate / && mount --bind "$1" "$2" && '
         f'"{sys.executable}" -c "$3" "$2"', "sh", str(source), str(out), check],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "it is a mount point; nothing was removed" in done.stdout, done.stdout
    assert os.listdir(out) == []  # the mount was the namespace's only


def test_force_refuses_the_home_directory(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    (home / "metadata.yaml").write_text("old")
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(inputs.DatasetError, match="it is the home directory"):
        outdir.check_out_dir(str(home), force=True)


def test_failed_write_leaves_old_dataset_untouched(tmp_path, monkeypatch):
    """A crash mid-write (disk full, Ctrl-C) keeps the previous out_dir."""
    _, arrays = make_inputs(tmp_path)
    out = tmp_path / "out"
    write_small_dataset(out, arrays, force=False)
    before = snapshot_tree(out)
    real_save = ondisk.save_npy

    def save_then_fail(path, array, dtype):
        real_save(path, array, dtype)
        if str(path).endswith(ondisk.FEAT_FILE):
            raise OSError("disk full")

    monkeypatch.setattr(ondisk, "save_npy", save_then_fail)
    with pytest.raises(OSError, match="disk full"):
        ondisk.write_ondisk_dataset(
            out, arrays["edges"], arrays["features"] * 2, arrays["labels"],
            arrays["train"], arrays["val"], arrays["test"], force=True,
        )
    assert snapshot_tree(out) == before
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("step, error", [
    ("final rename", KeyboardInterrupt()),
    ("final rename", OSError(28, "No space left on device")),
    ("right after moving the old dir away", KeyboardInterrupt()),
])
def test_interrupted_swap_keeps_old_dataset(tmp_path, monkeypatch, step, error):
    """write_atomically: on any failure the old out_dir is put back, no temp dirs left."""
    _, arrays = make_inputs(tmp_path)
    parent = tmp_path / "datasets"
    parent.mkdir()
    out = parent / "out"
    write_small_dataset(out, arrays, force=False)
    old = snapshot_tree(out)
    arrays = {**arrays, "features": arrays["features"] * 2}
    real_rename = os.rename
    seen = []

    def rename(src, dst):  # fails once; putting the old dir back must work
        if step == "final rename" and Path(dst) == out and not seen:
            seen.append(sorted(os.listdir(src)))  # the complete new dataset
            raise error
        real_rename(src, dst)
        if step != "final rename" and Path(src) == out and not seen:
            seen.append(sorted(os.listdir(dst)))  # the old dataset, moved away
            raise error

    monkeypatch.setattr(outdir.os, "rename", rename)
    if isinstance(error, OSError):
        raised = pytest.raises(inputs.DatasetError, match="cannot move the new dataset into place")
    else:
        raised = pytest.raises(KeyboardInterrupt)
    with raised:
        write_small_dataset(out, arrays)
    monkeypatch.undo()
    assert len(seen) == 1, "the simulated failure was not reached"
    # The complete new dataset (the very last step failed), or the old one
    # moved away: the same names either way.
    assert seen[0] == sorted(old), seen
    assert snapshot_tree(out) == old
    assert os.listdir(parent) == ["out"]  # no temp or backup dirs


def test_interrupted_final_rename_without_old_dataset(tmp_path, monkeypatch):
    """No old out_dir: an interrupted final rename leaves nothing behind."""
    _, arrays = make_inputs(tmp_path)
    out = tmp_path / "datasets" / "out"
    seen = []

    def rename(src, dst):
        seen.append(sorted(os.listdir(src)))
        raise KeyboardInterrupt

    monkeypatch.setattr(outdir.os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        write_small_dataset(out, arrays, force=False)
    monkeypatch.undo()
    assert len(seen) == 1 and "metadata.yaml" in seen[0], seen
    assert os.listdir(tmp_path / "datasets") == []
