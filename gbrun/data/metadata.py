"""A dataset directory's metadata.yaml, read as data: every file it names is
a numpy array (or, for the graph's edges, a CSV table) inside the dataset
directory, or the dataset is refused in one line naming the entry.

GraphBolt would also load a `format: torch` entry, and its own
preprocessed graph, with torch.load (a pickle, which runs code), joins
each `path` to the directory unchecked (absolute paths, `..`), and copies
each entry X to preprocessed/X (over an entry that is preprocessed/X, or
through a link). gbrun hands GraphBolt only copies of what is checked here
(gbrun.data.staging), so a dataset from someone else cannot run code, read
files outside its directory or have anything written into it."""
import os

import numpy as np
import yaml

# The formats each kind of entry may have: numpy arrays everywhere, CSV
# tables for the graph's edges (read with pandas, as data).
FORMATS = {"edges": ("numpy", "csv"), "other": ("numpy",)}
METADATA_FILE = "metadata.yaml"


class MetadataError(ValueError):
    """A metadata.yaml entry that is not plain data inside the dataset: one
    line naming it."""


def read_metadata(directory):
    """The parsed metadata.yaml of `directory` (yaml.safe_load: no tags that
    build objects)."""
    path = os.path.join(directory, METADATA_FILE)
    try:
        with open(path) as f:
            metadata = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as error:
        reason = (str(error).splitlines() or [""])[0]
        raise MetadataError(f"{path}: cannot be read as YAML ({reason})"
                            ) from None
    if not isinstance(metadata, dict):
        raise MetadataError(f"{path}: not a YAML mapping")
    return metadata


def file_entries(metadata, where=""):
    """(where in the YAML, the entry) of every entry of `metadata` that
    names a file (has a `path`), depth first, in file order."""
    if isinstance(metadata, dict):
        if "path" in metadata:
            yield where or "(top level)", metadata
        for key, value in metadata.items():
            yield from file_entries(value, f"{where}.{key}" if where else key)
    elif isinstance(metadata, list):
        for i, value in enumerate(metadata):
            yield from file_entries(value, f"{where}[{i}]")


# GraphBolt writes its copy of a dataset there: an entry inside would be
# written over by the copy of another.
PREPROCESSED = "preprocessed"


def checked_files(directory, metadata):
    """{path relative to `directory`: where it is named} of every file
    `metadata` names, each checked: a relative path inside `directory`
    (also once symlinks are resolved) through no symlink, not under
    preprocessed/, a regular file named by one path (no two entries the
    same file), in a format that is data (FORMATS), a .npy file holding no
    Python objects."""
    root = os.path.realpath(directory)
    files, seen = {}, {}
    for where, entry in file_entries(metadata):
        path, fmt = entry.get("path"), entry.get("format", "numpy")
        name = f"metadata.yaml's {where} (path {path!r})"
        allowed = FORMATS["edges" if where.startswith("graph.edges")
                          else "other"]
        if fmt not in allowed:
            raise MetadataError(
                f"{name} has format {fmt!r}: gbrun reads {' or '.join(allowed)}"
                " files only (a 'torch' file is a pickle, which runs code "
                "when loaded); save it with numpy.save")
        if not isinstance(path, str) or not path or os.path.isabs(path):
            raise MetadataError(f"{name}: a path relative to the dataset "
                                "directory is expected")
        relative = os.path.normpath(path)
        try:
            check_file(root, relative, name, fmt, seen)
        except OSError as error:
            # A path changed between two of the checks' calls (a directory
            # swapped while it is checked): refused, never a traceback.
            raise MetadataError(
                f"{name} changed while gbrun checked it ({error.strerror}); "
                "is something rewriting the dataset?") from None
        files[relative] = where
    return files


def check_file(root, relative, name, fmt, seen):
    """checked_files' checks of one entry, the file `relative` to `root`
    that `name` names in format `fmt`; `seen`: {(device, inode): (path,
    name)} of the entries before it."""
    full = os.path.realpath(os.path.join(root, relative))
    if relative.split(os.sep)[0] == os.pardir or os.path.commonpath(
            [root, full]) != root:
        raise MetadataError(f"{name} leads outside the dataset directory")
    linked = next((part for part in _prefixes(root, relative)
                   if os.path.islink(part)), None)
    if linked is not None:
        raise MetadataError(
            f"{name} goes through the symlink {os.path.relpath(linked, root)}: "
            "gbrun follows no link inside a dataset (one could be swapped for "
            "another while it reads); put the file itself there")
    if relative.split(os.sep)[0] == PREPROCESSED:
        raise MetadataError(
            f"{name} lies under {PREPROCESSED}/, where GraphBolt writes its "
            "copy of the dataset; move it elsewhere in the dataset")
    if not os.path.isfile(full):
        raise MetadataError(f"{name}: no such file in the dataset")
    status = os.stat(full)
    first, first_name = seen.setdefault((status.st_dev, status.st_ino),
                                        (relative, name))
    if first != relative:  # another path to the same file (a link)
        raise MetadataError(f"{name} is the file {first_name} names too "
                            "(a link): name each file by one path")
    if fmt == "numpy":
        check_npy(full, name)


def _prefixes(root, relative):
    """root/a, root/a/b, ... root/relative."""
    path = root
    for part in relative.split(os.sep):
        path = os.path.join(path, part)
        yield path


def check_npy(path, name):
    """Refuses a file that is not a .npy array, or one of Python objects
    (numpy would unpickle them)."""
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                      else np.lib.format.read_array_header_2_0)(f)
    except (OSError, ValueError) as error:
        raise MetadataError(f"{name}: not a .npy array ({error})") from None
    if header[2].hasobject:
        raise MetadataError(f"{name}: a .npy array of Python objects, which "
                            "loads only by unpickling them (code); save "
                            "numbers")
