"""gbrun.data.staging, with gbrun.data.metadata, gbrun.data.fingerprint and
gbrun.cache: a dataset directory is read as data, identified by content,
preprocessed once per content into the user's cache, and never written to.

GraphBolt (dgl 2.1.0) preprocesses into the dataset's own directory, keys
its check by the path as spelled (so `data/x`, `../data/x`, an absolute
path or a symlink each rebuilt `preprocessed/`), follows a `preprocessed/`
that is a symlink, and loads `format: torch` entries with a pickle."""
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import yaml

import gbrun.cache
import gbrun.data.datasets
from gbrun.cli import UsageError
from gbrun.data import fingerprint, inputs, metadata, ondisk

NUM_NODES = 200


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache of this test's own (GBRUN_CACHE)."""
    path = tmp_path / "cache"
    monkeypatch.setenv("GBRUN_CACHE", str(path))
    return path


def write_dataset(directory, seed=0):
    rng = np.random.default_rng(seed)
    ondisk.write_ondisk_dataset(
        str(directory), rng.integers(0, NUM_NODES, (2, 1000)),
        rng.random((NUM_NODES, 4), dtype=np.float32),
        rng.integers(0, 2, NUM_NODES),
        *inputs.split_nodes(NUM_NODES, (0.6, 0.2, 0.2), seed),
    )
    return directory


def snapshot(directory):
    """Every path under `directory` with its bytes, mode and times: what a
    write of any kind would change."""
    found = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = os.path.join(root, name)
            status = os.lstat(path)
            content = (open(path, "rb").read() if os.path.isfile(path)
                       and not os.path.islink(path) else None)
            found[os.path.relpath(path, directory)] = (
                content, status.st_mode, status.st_mtime_ns, status.st_ino)
    return found


def staged_dirs(cache):
    return sorted(os.listdir(cache / "datasets"))


def test_one_dataset_under_five_spellings_is_preprocessed_once(
        tmp_path, cache, monkeypatch, capsys):
    dataset = write_dataset(tmp_path / "data" / "x")
    before = snapshot(dataset)
    (tmp_path / "sub").mkdir()
    os.symlink(dataset, tmp_path / "link")
    monkeypatch.chdir(tmp_path)
    gbrun.data.datasets.load_dataset("data/x")
    assert "Preprocessed dataset 'data/x' into " in capsys.readouterr().out
    [made] = staged_dirs(cache)
    first = snapshot(cache / "datasets")
    for cwd, spelling in [("sub", "../data/x"), ("sub", str(dataset)),
                          (".", "link"), (".", "./data//x/")]:
        monkeypatch.chdir(tmp_path / cwd)
        loaded = gbrun.data.datasets.load_dataset(spelling)
        assert len(loaded.tasks[0].train_set) == 120
        assert "Preprocessed" not in capsys.readouterr().out, spelling
        assert snapshot(cache / "datasets") == first, spelling
    # The dataset itself was only read: no preprocessed/ in it, nothing
    # changed.
    assert snapshot(dataset) == before


def test_a_copy_is_the_same_dataset_and_a_rewrite_is_another(tmp_path, cache):
    dataset = write_dataset(tmp_path / "x")
    gbrun.data.datasets.load_dataset(str(dataset))
    shutil.copytree(dataset, tmp_path / "copy")
    identity = gbrun.data.datasets.dataset_identity(str(dataset))
    copy = gbrun.data.datasets.dataset_identity(str(tmp_path / "copy"))
    # The same content; each names where it was read.
    assert copy["files"] == identity["files"]
    assert (identity["path"], copy["path"]) == (str(dataset),
                                                str(tmp_path / "copy"))
    gbrun.data.datasets.load_dataset(str(tmp_path / "copy"))
    assert len(staged_dirs(cache)) == 1
    # Rewritten in place with another seed: the same files, the same sizes,
    # other bytes.
    write_dataset(tmp_path / "y", seed=1)
    for name in os.listdir(tmp_path / "y"):
        shutil.copyfile(tmp_path / "y" / name, dataset / name)
    rewritten = gbrun.data.datasets.dataset_identity(str(dataset))["files"]
    assert rewritten != identity["files"]
    assert {k: v.split(",")[0] for k, v in rewritten.items()} == {
        k: v.split(",")[0] for k, v in identity["files"].items()}  # same sizes
    gbrun.data.datasets.load_dataset(str(dataset))
    assert len(staged_dirs(cache)) == 2


def test_a_digest_is_read_again_once_the_file_changed(tmp_path, cache, monkeypatch):
    # Same size, mtime set back: the status-change time still moves.
    monkeypatch.setattr(fingerprint, "RACY_S", -1.0)  # keep every digest
    path = tmp_path / "a.npy"
    np.save(path, np.zeros(8))
    first = fingerprint.file_digest(str(path))
    status = os.stat(path)
    np.save(path, np.ones(8))
    os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns))
    assert os.path.getsize(path) == status.st_size
    assert fingerprint.file_digest(str(path)) != first
    # Unchanged: from the cache (whose entry, planted, is what comes back).
    [entry] = [e for e in os.listdir(cache / "digests")
               if open(cache / "digests" / e).read() != first]
    (cache / "digests" / entry).write_text("planted")
    assert fingerprint.file_digest(str(path)) == "planted"


@pytest.mark.parametrize("in_memory", [True, False])
def test_a_dataset_on_a_read_only_mount_trains_data_from_the_cache(
        tmp_path, cache, in_memory):
    # What a dataset shared read-only (or owned by another user) is: loaded,
    # nothing written into it (GraphBolt alone stops there with EROFS,
    # making preprocessed/ beside the dataset). Features left on disk
    # (in_memory: false) too: read at every batch, from the staged copy.
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare for a private read-only mount")
    dataset = write_dataset(tmp_path / "x")
    if not in_memory:
        metadata = (dataset / "metadata.yaml").read_text()
        assert metadata.count("in_memory: true") > 2
        (dataset / "metadata.yaml").write_text(
            metadata.replace("in_memory: true", "in_memory: false"))
    load = ("import gbrun.data.datasets as d; "
            f"data = d.load_dataset({str(dataset)!r}); "
            "print(len(data.feature.read('node', None, 'feat'))); "
            "print(len(data.tasks[0].train_set))")
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c",
         f"mount --bind -o ro {dataset} {dataset} && "
         f"touch {dataset}/probe 2>/dev/null && echo writable; "
         f"exec {sys.executable} -c \"$0\"", load],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-2:] == [str(NUM_NODES), "120"], (
        done.stdout)
    assert "writable" not in done.stdout
    assert "preprocessed" not in os.listdir(dataset)
    assert len(staged_dirs(cache)) == 1


def test_a_preprocessed_dir_shipped_with_a_dataset_is_never_read_or_written(
        tmp_path, cache):
    # A symlink out of the dataset, and a pickle GraphBolt would load.
    dataset = write_dataset(tmp_path / "x")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "fused_csc_sampling_graph.pt").write_bytes(b"not a graph")
    os.symlink(elsewhere, dataset / "preprocessed")
    before = snapshot(elsewhere)
    loaded = gbrun.data.datasets.load_dataset(str(dataset))
    assert loaded.graph.total_num_nodes == NUM_NODES
    assert snapshot(elsewhere) == before


def edit_metadata(dataset, edit):
    path = dataset / "metadata.yaml"
    data = yaml.safe_load(path.read_text())
    edit(data)
    path.write_text(yaml.safe_dump(data))


def first_feature(data):
    return data["feature_data"][0]


@pytest.mark.parametrize("edit, message", [
    (lambda d: first_feature(d).update(format="torch"),
     "has format 'torch': gbrun reads numpy files only"),
    (lambda d: first_feature(d).update(path="/etc/passwd"),
     "a path relative to the dataset directory is expected"),
    (lambda d: first_feature(d).update(path="../outside.npy"),
     "leads outside the dataset directory"),
    (lambda d: first_feature(d).update(path="missing.npy"),
     "no such file in the dataset"),
    (lambda d: first_feature(d).update(path="objects.npy"),
     "a .npy array of Python objects"),
])
def test_metadata_naming_what_is_not_data_is_refused(
        tmp_path, cache, edit, message):
    dataset = write_dataset(tmp_path / "x")
    np.save(tmp_path / "outside.npy", np.zeros(3))
    np.save(dataset / "objects.npy", np.array([{"a": 1}], dtype=object),
            allow_pickle=True)
    edit_metadata(dataset, edit)
    with pytest.raises(UsageError) as refused:
        gbrun.data.datasets.load_dataset(str(dataset))
    line = str(refused.value)
    assert "\n" not in line and message in line, line
    assert "metadata.yaml's feature_data[0]" in line, line
    assert not (cache / "datasets").exists() or staged_dirs(cache) == []


def test_a_symlink_leading_out_of_the_dataset_is_refused(tmp_path):
    dataset = write_dataset(tmp_path / "x")
    name = yaml.safe_load((dataset / "metadata.yaml").read_text())[
        "feature_data"][0]["path"]
    os.replace(dataset / name, tmp_path / "moved.npy")
    os.symlink(tmp_path / "moved.npy", dataset / name)
    with pytest.raises(metadata.MetadataError, match="leads outside"):
        metadata.checked_files(str(dataset), metadata.read_metadata(str(dataset)))


def test_a_path_that_changes_while_it_is_checked_is_one_line(
        tmp_path, monkeypatch):
    # The swap test below met it once in a CI run: os.path.realpath saw a
    # symlink, then readlink a directory (EINVAL). Any OSError of the
    # checks is the same refusal, whichever call meets the change.
    import errno

    dataset = write_dataset(tmp_path / "x")

    def changed(path, name):
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)

    monkeypatch.setattr(metadata, "check_npy", changed)
    with pytest.raises(UsageError) as refused:
        gbrun.data.datasets.load_dataset(str(dataset))
    assert str(refused.value).endswith(
        "changed while gbrun checked it (Invalid argument); is something "
        "rewriting the dataset?")
    assert "metadata.yaml's " in str(refused.value)


@pytest.mark.parametrize("make, message", [
    (lambda root: os.symlink(root.parent / "real", root),
     "is a symlink"),
    (lambda root: (root.mkdir(), os.chmod(root, 0o777)),
     "is writable by others (mode 0777)"),
    (lambda root: (root.mkdir(), os.chown(root, 12345, -1)),
     "belongs to uid 12345, not to this user"),
])
def test_a_cache_that_is_not_this_users_alone_is_refused(
        tmp_path, make, message):
    if "uid" in message and os.geteuid() != 0:
        pytest.skip("needs root to give a directory to another user")
    (tmp_path / "real").mkdir()
    root = tmp_path / "cache"
    make(root)
    env = {"GBRUN_CACHE": str(root)}
    with pytest.raises(gbrun.cache.CacheError, match=re.escape(message)):
        gbrun.cache.cache_dir("datasets", env=env)
    assert not os.path.exists(tmp_path / "real" / "datasets")


def test_a_refused_preferred_root_is_passed_over_and_the_user_told_why(
        tmp_path, monkeypatch, capsys):
    # ~/.cache/gbrun (here $XDG_CACHE_HOME/gbrun) writable by others: not
    # used, and the dataset goes to $TMPDIR/gbrun-<uid>, which the line
    # that says where also says why.
    xdg = tmp_path / "xdg"
    (xdg / "gbrun").mkdir(parents=True)
    os.chmod(xdg / "gbrun", 0o777)
    (tmp_path / "tmp").mkdir()
    monkeypatch.delenv("GBRUN_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    dataset = write_dataset(tmp_path / "x")
    gbrun.data.datasets.load_dataset(str(dataset))
    said = capsys.readouterr().out.splitlines()
    fallback = tmp_path / "tmp" / f"gbrun-{os.getuid()}" / "datasets"
    assert [line for line in said if line.startswith("Preprocessed")][
        0].startswith(f"Preprocessed dataset '{dataset}' into {fallback}/")
    assert (f"The preferred cache was passed over: cache directory "
            f"{xdg / 'gbrun'} is writable by others (mode 0777).") in said
    assert os.listdir(xdg / "gbrun") == []
    os.chmod(xdg / "gbrun", 0o700)  # once fixed: the first root serves
    assert gbrun.cache.passed_over("datasets") == []
    # A refused level below the root is passed over as cache_dir does.
    os.symlink(tmp_path / "tmp", xdg / "gbrun" / "digests")
    assert gbrun.cache.passed_over("digests") == [
        f"cache directory {xdg / 'gbrun' / 'digests'} is a symlink"]


def test_a_relative_cache_is_refused(monkeypatch):
    with pytest.raises(gbrun.cache.CacheError, match="not an absolute path"):
        gbrun.cache.cache_dir(env={"GBRUN_CACHE": "relative/cache"})


def test_the_cache_is_made_private(tmp_path):
    path = gbrun.cache.cache_dir(
        "datasets", env={"GBRUN_CACHE": str(tmp_path / "new")})
    for made in (tmp_path / "new", path):
        assert os.stat(made).st_mode & 0o777 == 0o700


class Planted:
    """A pickle that, loaded, leaves a file: what a planted preprocessed
    graph could run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_builtin_name_never_loads_a_preprocessed_dir_found_under_data_root(
        tmp_path, cache):
    """--dataset cora with a datasets/cora/ someone else wrote (GraphBolt's
    own preprocessed/ in it, its graph a pickle that runs a command): read
    as a directory, from its raw files; nothing run, nothing downloaded."""
    import torch
    from gbrun.graphbolt import gb

    root = tmp_path / "datasets"
    planted = write_dataset(root / "cora")
    gb.OnDiskDataset(str(planted)).load()  # GraphBolt's preprocessed/, in it
    marker = tmp_path / "ran"
    torch.save(Planted(marker), planted / "preprocessed" / "fused_csc_sampling_graph.pt")
    loaded = gbrun.data.datasets.load_dataset("cora", str(root))
    assert loaded.graph.total_num_nodes == NUM_NODES
    assert not marker.exists()


def test_a_digest_of_a_file_changed_a_moment_ago_is_not_kept(tmp_path, cache, monkeypatch):
    """A write in the same clock tick as the one before leaves the times as
    they were: a file that recent is read again until it is quiet."""
    path = tmp_path / "a.npy"
    np.save(path, np.zeros(8))
    fingerprint.file_digest(str(path))
    assert not (cache / "digests").exists() or os.listdir(cache / "digests") == []
    later = time.time() + fingerprint.RACY_S + 1
    monkeypatch.setattr(fingerprint.time, "time", lambda: later)
    fingerprint.file_digest(str(path))
    assert len(os.listdir(cache / "digests")) == 1


def test_entries_under_preprocessed_or_naming_one_file_twice_are_refused(tmp_path, cache):
    """GraphBolt copies each entry X into preprocessed/X: an entry that is
    preprocessed/X would be written over, in the dataset; a link naming one
    file under two paths, alike; and a symlink inside the dataset, which
    another user could swap while it is read, is not followed."""
    dataset = write_dataset(tmp_path / "x")
    meta = yaml.safe_load((dataset / "metadata.yaml").read_text())
    name = meta["feature_data"][0]["path"]
    (dataset / "preprocessed").mkdir()
    shutil.copyfile(dataset / name, dataset / "preprocessed" / name)
    os.link(dataset / name, dataset / "alias.npy")
    os.symlink(name, dataset / "symlinked.npy")  # inside, but a link

    def second_feature(path):
        def edit(data):
            data["feature_data"].append({**data["feature_data"][0], "name": "again",
                                         "path": path})
        return edit

    for path, message in ((f"preprocessed/{name}", "lies under preprocessed/, where "
                           "GraphBolt writes its copy of the dataset"),
                          ("alias.npy", "is the file metadata.yaml's feature_data[0]"),
                          ("symlinked.npy", "goes through the symlink symlinked.npy: gbrun "
                           "follows no link inside a dataset")):
        before = snapshot(dataset)
        edit_metadata(dataset, second_feature(path))
        with pytest.raises(UsageError) as refused:
            gbrun.data.datasets.load_dataset(str(dataset))
        assert message in str(refused.value) and "\n" not in str(refused.value)
        (dataset / "metadata.yaml").write_text(yaml.safe_dump(meta, sort_keys=False))
        after = snapshot(dataset)
        assert {k: v for k, v in after.items() if k != "metadata.yaml"} == {
            k: v for k, v in before.items() if k != "metadata.yaml"}


def test_a_dataset_changed_after_its_fingerprint_leaves_no_entry_under_that_name(
        tmp_path, cache):
    """Replaced by rename between the fingerprint and the copy (what --force
    does): refused, and nothing is cached under the old content's name."""
    dataset = write_dataset(tmp_path / "x")
    meta = metadata.read_metadata(str(dataset))
    files = fingerprint.fingerprint(str(dataset), meta)
    write_dataset(tmp_path / "y", seed=1)
    for name in os.listdir(tmp_path / "y"):
        if name != "metadata.yaml":
            os.replace(tmp_path / "y" / name, dataset / name)
    from gbrun.data import staging

    with pytest.raises(metadata.MetadataError, match="changed while it was being read"):
        staging.staged(str(dataset), meta, files)
    assert staged_dirs(cache) == []


def renameat2_exchange(a, b):
    """renameat2(RENAME_EXCHANGE): swaps two paths in one step."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd, exchange = -100, 2
    return libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), exchange)


@pytest.mark.slow
def test_a_directory_swapped_for_a_symlink_while_staging_is_never_followed(tmp_path, cache):
    """Another user swaps a directory of the dataset with a symlink to a
    directory of their own, in a loop, while the dataset is staged: each
    load either reads the dataset's own bytes or is refused in one line;
    the outside file is never read, nor anything written there."""
    rng = np.random.default_rng(0)
    features = rng.random((NUM_NODES, 4), dtype=np.float32)
    dataset = write_dataset(tmp_path / "x")
    meta = yaml.safe_load((dataset / "metadata.yaml").read_text())
    (dataset / "feat").mkdir()
    np.save(dataset / "feat" / "f.npy", features)
    meta["feature_data"][0]["path"] = "feat/f.npy"
    (dataset / "metadata.yaml").write_text(yaml.safe_dump(meta, sort_keys=False))
    outside = tmp_path / "outside"
    outside.mkdir()
    np.save(outside / "f.npy", np.full((NUM_NODES, 4), 7, dtype=np.float32))
    os.symlink(outside, tmp_path / "swap")
    before = snapshot(outside)
    stop = threading.Event()

    def swap():
        while not stop.is_set():
            renameat2_exchange(dataset / "feat", tmp_path / "swap")

    swapper = threading.Thread(target=swap)
    swapper.start()
    outcomes = []
    try:
        for attempt in range(20):
            shutil.rmtree(cache, ignore_errors=True)
            try:
                loaded = gbrun.data.datasets.load_dataset(str(dataset))
            except UsageError as refused:
                assert "\n" not in str(refused)
                outcomes.append("refused")
                continue
            read = loaded.feature.read("node", None, "feat")
            assert not (read == 7).all(), f"attempt {attempt} read the outside file"
            np.testing.assert_array_equal(read.numpy(), features)
            outcomes.append("loaded")
    finally:
        stop.set()
        swapper.join()
    assert snapshot(outside) == before
    assert len(outcomes) == 20
    print("outcomes:", {kind: outcomes.count(kind) for kind in set(outcomes)})
