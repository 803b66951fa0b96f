"""A dataset directory opened for GraphBolt without writing to it.

GraphBolt preprocesses a dataset into its own directory (`preprocessed/`),
which fails on a read-only dataset, follows a `preprocessed/` that is a
symlink out of it, deletes and rebuilds it whenever the path is spelled
differently (dgl 2.1's check_dataset_change keys its hashes by path, while
another job may be reading it), and loads whatever `preprocessed/` came
with the dataset with a pickle. Here GraphBolt gets a directory of gbrun's
own instead, in the user's cache (gbrun.cache), named by the dataset's
fingerprint (gbrun.data.fingerprint): the checked metadata.yaml, and a
symlink to each file it names. GraphBolt preprocesses it once, in a
directory no other job sees, which is then renamed into place and never
changed again: a dataset with other content gets another one, never a
stale one, and a dataset's own `preprocessed/` is never read or written.
GraphBolt's own check (a hash of every byte at every launch) is skipped.
"""
import contextlib
import inspect
import io
import os
import shutil
import tempfile

import yaml

from .. import cache
from . import fingerprint
from .metadata import METADATA_FILE, checked_files


def staged(directory, metadata, files):
    """The preprocessed copy of `directory` (its parsed `metadata` and
    fingerprint `files`) in the cache, made now if there is none:
    (its path, True where it was made now)."""
    root = cache.cache_dir("datasets")
    final = os.path.join(root, fingerprint.key(files))
    if os.path.isfile(os.path.join(final, "preprocessed", METADATA_FILE)):
        return final, False
    building = tempfile.mkdtemp(dir=root, prefix="building-")
    try:
        with open(os.path.join(building, METADATA_FILE), "w") as f:
            yaml.safe_dump(metadata, f, sort_keys=False)
        links = []
        for relative in checked_files(directory, metadata):
            link = os.path.join(building, relative)
            os.makedirs(os.path.dirname(link), exist_ok=True)
            os.symlink(os.path.realpath(os.path.join(directory, relative)),
                       link)
            links.append(link)
        open_graphbolt(building)  # preprocesses into building/preprocessed
        for link in links:  # what GraphBolt loads is in preprocessed/
            os.unlink(link)
        try:
            os.rename(building, final)
        except OSError:
            # Another job made it meanwhile (a rename onto a directory that
            # is not empty fails): theirs serves.
            if not os.path.isdir(final):
                raise
        return final, True
    finally:
        shutil.rmtree(building, ignore_errors=True)


def open_graphbolt(directory, preprocessed=False):
    """gb.OnDiskDataset of a directory gbrun made (not loaded), with
    GraphBolt's check of every byte skipped where this release can: the
    directory's name is its content's fingerprint. `preprocessed`: without
    GraphBolt's "The dataset is already preprocessed." (gbrun said where
    the copy it reads is)."""
    from ..graphbolt import gb

    options = {}
    if "force_preprocess" in inspect.signature(
            gb.OnDiskDataset.__init__).parameters:
        options["force_preprocess"] = False
    with contextlib.redirect_stdout(io.StringIO()) if preprocessed else (
            contextlib.nullcontext()):
        return gb.OnDiskDataset(directory, **options)
