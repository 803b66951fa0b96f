"""Reading a dataset, the one place every script reads one: a
GraphBolt OnDiskDataset directory, read as data only
(gbrun.data.metadata), never written to, and preprocessed once per
content into gbrun's cache (gbrun.data.staging); a dataset that comes
with the example, made on first use (gbrun.data.builtin); or a builtin
GraphBolt dataset, downloaded. gbrun.data.datasets hands these to the
example."""
import os

from .. import cache
from ..cache import CacheError, passed_over
from ..cli import UsageError
from ..graphbolt import gb
from . import builtin, fingerprint, staging
from .metadata import METADATA_FILE, MetadataError, read_metadata

# GraphBolt's builtin datasets, downloaded; and those that come with the
# example, made on first use (gbrun.data.builtin).
BUILTIN_DATASETS = ["cora", "ogbn-arxiv", "ogbn-products", "ogbn-papers100M"]
COMES_WITH = tuple(builtin.MADE)


def load_dataset(name_or_dir, data_root="datasets"):
    """The one place that reads datasets (the scripts use it too): an
    OnDiskDataset directory, read as data only (gbrun.data.metadata), never
    written to, and preprocessed once per content into gbrun's cache
    (gbrun.data.staging); a dataset that comes with the example
    (gbrun.data.builtin: `synthetic`, `synthetic-links`), made on first use
    into that cache and then read as a directory; or else a builtin
    GraphBolt dataset, downloaded from DGL under `data_root` on first use
    and loaded as GraphBolt ships it."""
    directory = dataset_directory(name_or_dir, announce=True)
    if directory is not None:
        dataset = load_directory(directory, name_or_dir)
    elif name_or_dir in BUILTIN_DATASETS:
        dataset = load_directory(downloaded(name_or_dir, data_root),
                                 name_or_dir)
    else:
        raise UsageError(
            f"--dataset '{name_or_dir}' is neither a builtin dataset "
            f"({', '.join([*COMES_WITH, *BUILTIN_DATASETS])}) nor a directory"
        )
    if not dataset.tasks:
        raise UsageError(f"dataset '{name_or_dir}' defines no task")
    return dataset


def downloaded(name, data_root):
    """The directory of GraphBolt's builtin dataset `name` under
    `data_root`, downloaded from DGL first where it is missing. It is then
    read as any directory is (load_directory): by its metadata.yaml and
    the raw files it names, never by a `preprocessed/` found there (an
    archive's, or one planted by whoever can write `data_root`), whose
    pickles would run code."""
    directory = os.path.join(data_root, name)
    if not os.path.lexists(directory):
        try:
            # Downloads and extracts; the dataset it returns is not loaded.
            gb.BuiltinDataset(name, root=data_root)
        except Exception as error:
            raise UsageError(
                f"could not fetch dataset '{name}' into '{data_root}' "
                f"({type(error).__name__}: {error}); offline, --dataset "
                "synthetic trains on a graph that comes with the example"
            ) from None
    return directory


def dataset_directory(name_or_dir, announce=False):
    """The directory --dataset `name_or_dir` names: itself where it is one
    (also where a builtin has that name: a directory of the working
    directory wins, as for any path), or the builtin's, made in gbrun's
    cache now if missing (gbrun.data.builtin); None for GraphBolt's
    builtins. `announce`: say which where it could be either, and where a
    builtin was made."""
    if os.path.isdir(name_or_dir):
        if announce and name_or_dir in builtin.MADE:
            print(f"--dataset {name_or_dir}: the directory "
                  f"{os.path.abspath(name_or_dir)}, not the builtin dataset of "
                  "that name (pass it from another directory for that one)",
                  flush=True)
        return name_or_dir
    if name_or_dir not in builtin.MADE:
        return None
    try:
        directory, made = builtin.directory(name_or_dir)
    except CacheError as error:
        raise UsageError(f"dataset '{name_or_dir}': {error}") from None
    if made and announce:
        same = " ".join(["make_synthetic_dataset.py DIR", builtin.options(name_or_dir)])
        print(f"Made the builtin dataset '{name_or_dir}' in {directory} (once; "
              f"{same.strip()} writes the same bytes).", flush=True)
    return directory


def load_directory(directory, name):
    """The OnDiskDataset in `directory` (--dataset `name`), staged into
    gbrun's cache and loaded."""
    if not os.path.isfile(os.path.join(directory, METADATA_FILE)):
        where = "" if directory == name else f" ({directory})"
        other = (f" (for the builtin dataset '{name}', run from another "
                 "directory)" if name in BUILTIN_DATASETS and not where else "")
        raise UsageError(
            f"--dataset '{name}'{where} is a directory without metadata.yaml, "
            f"so it is not a GraphBolt OnDiskDataset{other}"
        )
    try:
        metadata = read_metadata(directory)
        files = fingerprint.fingerprint(directory, metadata)
        path, made = staging.staged(directory, metadata, files)
    except (MetadataError, CacheError) as error:
        raise UsageError(f"dataset '{name}': {error}") from None
    if made:
        print(f"Preprocessed dataset '{name}' into {path} (once "
              "for these bytes; the dataset itself is only read).",
              flush=True)
        for reason in passed_over("datasets"):
            print(f"The preferred cache was passed over: {reason}.",
                  flush=True)
    # Loaded from the directory that was checked (a descriptor of it: a
    # cache path swapped meanwhile is not followed to another's pickles).
    try:
        descriptor = cache.open_dir(path)
    except CacheError as error:
        raise UsageError(f"dataset '{name}': {error}") from None
    try:
        return staging.open_graphbolt(f"/proc/self/fd/{descriptor}",
                                      preprocessed=True).load()
    finally:
        os.close(descriptor)
