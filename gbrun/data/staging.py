"""A dataset directory opened for GraphBolt without writing to it.

GraphBolt preprocesses a dataset into its own directory (`preprocessed/`),
which fails on a read-only dataset, follows a `preprocessed/` that is a
symlink out of it, deletes and rebuilds it whenever the path is spelled
differently (dgl 2.1's check_dataset_change keys its hashes by path, while
another job may be reading it), and loads whatever `preprocessed/` came
with the dataset with a pickle. Here GraphBolt gets a directory of gbrun's
own instead, in the user's cache (gbrun.cache), named by the dataset's
fingerprint (gbrun.data.fingerprint): the checked metadata.yaml, and a copy
of each file it names, read through one descriptor of the dataset
directory with no symlink followed inside it, and hashed as it is copied.
A copy whose bytes are not the fingerprint's (a file changed or swapped
meanwhile) is refused, so a cache entry always holds the content it is
named by. GraphBolt preprocesses that copy once, in a directory no other
job sees, which is then renamed into place and never changed again: a
dataset with other content gets another one, never a stale one, and
nothing of the dataset's own is written, or read through a path resolved
twice. GraphBolt's own check (a hash of every byte at every launch) is
skipped.
"""
import contextlib
import hashlib
import inspect
import io
import os
import shutil
import stat
import tempfile

import yaml

from .. import cache
from . import fingerprint
from .metadata import METADATA_FILE, MetadataError, checked_files

CHUNK = 16 << 20  # bytes read, hashed and written at a time


def staged(directory, metadata, files):
    """The preprocessed copy of `directory` (its parsed `metadata` and
    fingerprint `files`) in the cache, made now if there is none:
    (its path, True where it was made now). Raises MetadataError where a
    file is not what was checked and fingerprinted."""
    root = cache.cache_dir("datasets")
    final = os.path.join(root, fingerprint.key(files))
    if os.path.isfile(os.path.join(final, "preprocessed", METADATA_FILE)):
        return final, False
    building = tempfile.mkdtemp(dir=root, prefix="building-")
    try:
        copies = copy_files(directory, [METADATA_FILE, *checked_files(
            directory, metadata)], building, files)
        with open(copies.pop(0)) as f:
            if yaml.safe_load(f) != metadata:
                raise MetadataError(f"{os.path.join(directory, METADATA_FILE)} "
                                    "changed while it was being read; run again")
        open_graphbolt(building)  # preprocesses into building/preprocessed
        for copy in copies:  # what GraphBolt loads is in preprocessed/
            os.unlink(copy)
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


def copy_files(directory, relatives, building, files):
    """Copies each file of `relatives` (paths within `directory`) into
    `building`, opened through one descriptor of `directory` with no symlink
    followed below it; refuses a copy whose size and SHA-256 are not
    `files`' (its fingerprint). Returns the copies' paths."""
    copies = []
    top = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for relative in relatives:
            copy = os.path.join(building, relative)
            os.makedirs(os.path.dirname(copy), mode=0o700, exist_ok=True)
            with open_below(top, relative) as source, open(copy, "xb") as target:
                found = copy_hashed(source, target)
            if f"{found[0]}:{found[1]}" != files[relative]:
                raise MetadataError(
                    f"{os.path.join(directory, relative)} changed while it was "
                    "being read (its bytes are not those fingerprinted a moment "
                    "before); run again once nothing writes the dataset")
            copies.append(copy)
    finally:
        os.close(top)
    return copies


def open_below(top, relative):
    """The regular file `relative` below directory descriptor `top`, opened
    component by component without following a symlink (a directory
    swapped for one after the checks is refused, not followed)."""
    parts = relative.split(os.sep)
    fd = top
    try:
        for part in parts[:-1]:
            fd, parent = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW,
                                 dir_fd=fd), fd
            if parent != top:
                os.close(parent)
        leaf = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW, dir_fd=fd)
    except OSError as error:
        raise MetadataError(f"{relative}: cannot be opened inside the dataset "
                            f"without following a link ({error.strerror})") from None
    finally:
        if fd != top:
            os.close(fd)
    if not stat.S_ISREG(os.fstat(leaf).st_mode):
        os.close(leaf)
        raise MetadataError(f"{relative}: not a regular file")
    return os.fdopen(leaf, "rb")


def copy_hashed(source, target):
    """Copies file object `source` to `target`: (bytes, SHA-256 hex)."""
    digest, size = hashlib.sha256(), 0
    while chunk := source.read(CHUNK):
        digest.update(chunk)
        target.write(chunk)
        size += len(chunk)
    return size, digest.hexdigest()


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
