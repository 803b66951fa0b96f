"""gbrun/data/builtin.py: the datasets that come with the example are
make_synthetic_dataset.py's bytes, made once (also by two jobs at once),
refused where what the cache holds is not what gbrun made, and named by
content; a directory of the same name in the working directory wins."""
import os
import subprocess
import sys
import time

import pytest

import make_synthetic_dataset
from gbrun.cli import UsageError
from gbrun.data import builtin, datasets


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache of this test's own (none of the session's builtins)."""
    path = tmp_path / "cache"
    monkeypatch.setenv("GBRUN_CACHE", str(path))
    return path


def files(directory):
    return {name: (directory / name).read_bytes() for name in sorted(os.listdir(directory))}


# What the README and docs/own-data.md say each is.
SCRIPT_ARGS = {"synthetic": [],  # the quick start's, the script's defaults
               "synthetic-links": ["--num-nodes", "2000", "--avg-degree", "5",
                                   "--feat-dim", "32", "--link-negatives", "50"]}


@pytest.mark.parametrize("name", [pytest.param("synthetic", marks=pytest.mark.slow),
                                  "synthetic-links"])
def test_a_builtin_is_the_generators_bytes_made_once(tmp_path, cache, name):
    assert set(SCRIPT_ARGS) == set(builtin.MADE)
    made, was_made = builtin.directory(name)
    assert was_made
    script = tmp_path / "script"
    make_synthetic_dataset.main([str(script), *SCRIPT_ARGS[name]])
    assert builtin.options(name).split() == SCRIPT_ARGS[name]
    assert files(script) == files(type(script)(made))
    before = {entry: os.stat(os.path.join(made, entry)) for entry in os.listdir(made)}
    again, was_made = builtin.directory(name)
    assert (again, was_made) == (made, False)
    assert {entry: os.stat(os.path.join(made, entry)) for entry in os.listdir(made)} == before


@pytest.mark.slow
def test_two_jobs_at_once_make_it_once(cache):
    """Both wait while the lock is held, then one makes it; the other reads
    it."""
    cache.mkdir(mode=0o700)
    probe = ("import gbrun.data.builtin as b; "
             "print(b.directory('synthetic-links')[1])")
    root = builtin.cache.cache_dir("builtin")
    with builtin._locked(os.path.join(root, "synthetic-links.lock")):
        jobs = [subprocess.Popen([sys.executable, "-c", probe], stdout=subprocess.PIPE,
                                 text=True, env={**os.environ}) for _ in range(2)]
        time.sleep(1)  # (only makes a race likelier where the lock is gone)
    made = sorted(job.communicate(timeout=120)[0].strip() for job in jobs)
    assert [job.returncode for job in jobs] == [0, 0]
    assert made == ["False", "True"]


def test_what_gbrun_did_not_make_is_refused_in_one_line(cache):
    made, _ = builtin.directory("synthetic-links")
    home = os.path.dirname(made)
    with open(os.path.join(made, "node_feat.npy"), "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\0\0\0\1")
    with pytest.raises(UsageError) as refused:
        datasets.load_dataset("synthetic-links")
    assert str(refused.value) == (
        f"dataset 'synthetic-links': {home}: the builtin dataset 'synthetic-links' changed "
        f"since gbrun made it (node_feat.npy); remove {home} to have it made again")
    # A directory planted where it goes, with no record of gbrun's.
    os.remove(os.path.join(home, builtin.RECORD))
    with pytest.raises(UsageError) as refused:
        datasets.load_dataset("synthetic-links")
    assert str(refused.value).startswith(
        f"dataset 'synthetic-links': {home} is not the builtin dataset 'synthetic-links' as "
        "gbrun made it (FileNotFoundError")
    assert "\n" not in str(refused.value)


def test_a_directory_of_that_name_here_wins_and_identity_is_content(
        tmp_path, cache, monkeypatch, capsys):
    made, _ = builtin.directory("synthetic-links")
    identity = datasets.dataset_identity("synthetic-links")
    assert identity["files"] == datasets.dataset_identity(made)["files"]
    assert identity["path"] == "synthetic-links"
    assert "node_feat.npy" in identity["files"]
    monkeypatch.chdir(tmp_path)
    make_synthetic_dataset.main(["synthetic-links", "--num-nodes", "300", "--feat-dim", "3"])
    capsys.readouterr()
    dataset = datasets.load_dataset("synthetic-links")
    assert dataset.graph.total_num_nodes == 300
    said = capsys.readouterr().out
    assert (f"--dataset synthetic-links: the directory {tmp_path / 'synthetic-links'}, not "
            "the builtin dataset of that name") in said
    assert datasets.dataset_identity("synthetic-links")["files"] != identity["files"]
