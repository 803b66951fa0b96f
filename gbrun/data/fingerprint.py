"""What a dataset directory holds, identified by content, cheaply.

A dataset's fingerprint is the SHA-256 of each file its metadata.yaml names
(and of metadata.yaml itself), with its size, by path within the dataset:
the same bytes at another path are the same dataset, and a file rewritten
in place (another --seed of make_synthetic_dataset.py) is another. Reading
every byte at each launch is what made GraphBolt's own check slow (7 s of a
7.4 s load at products size), so a file's digest is kept in gbrun's cache
(gbrun.cache), keyed by what the kernel changes whenever the file's bytes
change: device, inode, size, modification and status-change times (ctime,
which no user call can set back). A file is read again only after such a
change, or at a new path.

A digest is kept only for a file last changed more than RACY_S seconds
before it was read (git's "racy clean" rule): a write in the same clock
tick as the change before it leaves the times as they were, so a file
changed that recently is read again at each launch until it is quiet.
What this can still miss: a write through a shared memory map
(np.load(..., mmap_mode="r+")) into a page that process had already
written and the kernel had not yet written back, which updates no time at
all; such a map open across a launch is an edit gbrun cannot see (close it,
or touch the file, before training).
"""
import hashlib
import os
import time

from .. import cache
from .metadata import METADATA_FILE, checked_files


# Seconds a file must have been quiet before its digest is kept.
RACY_S = 2.0


def file_digest(path):
    """The SHA-256 of the file at `path` (hex), from the cache where the
    file has not changed since it was read (see the module docstring)."""
    started = time.time()
    status = os.stat(path)
    key = (f"{status.st_dev}:{status.st_ino}:{status.st_size}:"
           f"{status.st_mtime_ns}:{status.st_ctime_ns}")
    entry = os.path.join(cache.cache_dir("digests"),
                         hashlib.sha256(key.encode()).hexdigest())
    try:
        with open(entry) as f:
            return f.read().strip()
    except OSError:
        pass
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if started - max(status.st_mtime, status.st_ctime) <= RACY_S:
        return digest  # changed too recently to trust its times later
    # Whole or not at all: written under a name of its own, then renamed.
    temporary = f"{entry}.{os.getpid()}"
    with open(temporary, "w") as f:
        f.write(digest)
    os.replace(temporary, entry)
    return digest


def fingerprint(directory, metadata):
    """{path within the dataset: "size:sha256"} of metadata.yaml and every
    file `metadata` (its parsed metadata.yaml) names, each checked as data
    (gbrun.data.metadata)."""
    files = sorted(set(checked_files(directory, metadata)) | {METADATA_FILE})
    found = {}
    for relative in files:
        path = os.path.join(directory, relative)
        found[relative] = f"{os.path.getsize(path)}:{file_digest(path)}"
    return found


def key(files):
    """One hex name for a fingerprint (for the preprocessed copy's
    directory)."""
    text = "\n".join(f"{path} {value}" for path, value in sorted(files.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:32]
