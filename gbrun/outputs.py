"""Files a job writes where others may have put something first (the
checkpoint directory's lock, metrics.jsonl, the --predict file): never
through a link, and never over what the job did not write.

A symlink, a hard link to a file elsewhere (the kernel's O_NOFOLLOW does
not see those), a FIFO or another user's file at such a name is refused in
one line naming it. An existing --predict file is replaced only where the
record --predict writes beside it (FILE.json: its size and SHA-256) says
it is an earlier prediction, unchanged; a dataset's own .npy, or any other
file, is not. A file written whole (a checkpoint, model.pt, a prediction)
is written beside its name, then renamed (save_atomically): a crash leaves
the previous one intact."""
import errno
import hashlib
import json
import os
import stat
import tempfile

import torch

from .cli import UsageError
from .trees import payload_bytes

RECORD_SUFFIX = ".json"  # beside a --predict file: what it was written as


def open_own(path, flags, what):
    """A descriptor of the regular file `path` (created where missing),
    opened without following a symlink and checked to be this user's, with
    no other link to it; else UsageError naming `what` and why."""
    try:
        descriptor = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW
                             | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except OSError as error:
        raise UsageError(f"{what} {path} cannot be opened as a regular file "
                         f"({error.strerror}: a symlink, or a FIFO); remove it"
                         ) from None
    problem = _not_own(os.fstat(descriptor))
    if problem:
        os.close(descriptor)
        raise UsageError(f"{what} {path} is {problem}, not a file this job "
                         "wrote; remove it, or use another directory")
    return descriptor


def _not_own(info):
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    if info.st_nlink != 1:
        return f"a file with {info.st_nlink} links (a hard link to another)"
    if info.st_uid != os.geteuid():
        return f"another user's (uid {info.st_uid})"
    return None


def check_replaceable(path, option):
    """Refuses (UsageError) an existing `path` that is not a file `option`
    wrote (by its record beside it), unchanged since."""
    if not os.path.lexists(path):
        return
    record = path + RECORD_SUFFIX
    try:
        with open(record) as f:
            recorded = json.load(f)
        unchanged = recorded == describe(path)
    except (OSError, ValueError):
        unchanged = False
    if not unchanged:
        raise UsageError(
            f"{option} {path}: the file exists and is not one {option} wrote "
            f"(no {os.path.basename(record)} beside it naming its bytes); "
            "remove it, or name another file")


def describe(path):
    """{"size", "sha256"} of the regular file at `path`."""
    with open(path, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(f"{path}: not a regular file")
        return {"size": os.fstat(f.fileno()).st_size,
                "sha256": hashlib.file_digest(f, "sha256").hexdigest()}


def write_record(path):
    """Records beside `path` what it holds (check_replaceable reads it)."""
    temporary = f"{path}{RECORD_SUFFIX}.{os.getpid()}"
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL
                         | os.O_NOFOLLOW, 0o666)
    with os.fdopen(descriptor, "w") as f:
        json.dump(describe(path), f)
    os.replace(temporary, path + RECORD_SUFFIX)


def save_atomically(obj, path, save=None):
    """Write with `save(obj, file)` (torch.save by default), flush to disk,
    then rename: a crash while saving leaves the previous file intact."""
    # A new file of a name nobody could plant a symlink at beforehand, in
    # the directory as `path` names it: resolved from the working directory
    # as the rename's target is (on a simulated machine, /tmp may be
    # another mount than the one the working directory lies on).
    parent = os.path.dirname(path) or os.curdir
    descriptor, temporary = tempfile.mkstemp(
        dir=parent,
        prefix=f".{os.path.basename(path)}.")
    # mkstemp returns the name made absolute: keep it as `parent` spells it.
    temporary = os.path.join(parent, os.path.basename(temporary))
    os.fchmod(descriptor, 0o666 & ~umask())  # as open() would make it
    try:
        with os.fdopen(descriptor, "wb") as f:
            (save or torch.save)(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except (OSError, RuntimeError) as error:
        full = disk_full(error)
        if full is None:
            raise
        raise UsageError(
            f"could not write {path}: {full.strerror} (about "
            f"{payload_bytes(obj) / 2**20:,.1f} MB to write); the previous "
            f"{os.path.basename(path)} there, if any, is intact") from None
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    directory = os.open(parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def umask():
    """This process's umask, read where reading does not change it (Linux
    shows it in /proc/self/status); Linux's usual 022 otherwise."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def disk_full(error):
    """The OSError of a full disk (or quota) behind `error`, or None: torch's
    zip writer raises a RuntimeError of its own while handling it."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC,
                                                          errno.EDQUOT):
            return error
        error = error.__cause__ or error.__context__
    return None
