"""Where a dataset writer writes (gbrun.data.ondisk): an out_dir it may
create, or, with --force, replace only where it is a dataset gbrun wrote,
unchanged since (check_out_dir, by the MANIFEST beside its files); filled
in a temp dir beside it and renamed into place, so that it is never left
half written and a failure puts the old one back (write_atomically)."""
import hashlib
import json
import os
import re
import secrets
import shutil

from .inputs import DatasetError

# Beside a dataset gbrun wrote: {file: "size:sha256"} of every file
# it wrote there. --force replaces a directory only if it holds just those
# files with those bytes.
MANIFEST = "gbrun-written.json"


def check_out_dir(out_dir, force, inputs=()):
    """Refuses (DatasetError) to write `out_dir` where it exists, unless
    `force` and it is a dataset a gbrun writer wrote, unchanged (its MANIFEST
    names every file it holds, with their sizes and hashes; nothing else
    there), none of them `inputs` (paths the caller reads), and neither
    the home directory, a mount point of any kind, nor the current
    directory or one above it."""
    if not os.path.lexists(out_dir):
        return
    if not force:
        raise DatasetError(f"{out_dir}: already exists; use --force to replace it")
    target = os.path.realpath(out_dir)
    here = os.path.realpath(os.getcwd())
    if here == target or here.startswith(target.rstrip(os.sep) + os.sep):
        raise DatasetError(f"{out_dir}: refusing to replace the current directory or one above it")
    refuse = None
    if target == os.path.realpath(os.path.expanduser("~")):
        refuse = "it is the home directory"
    elif os.path.islink(out_dir) or not os.path.isdir(out_dir):
        refuse = "it is not a directory"
    elif _is_mount_point(target):
        refuse = "it is a mount point"
    else:
        refuse = _not_as_written(target)
        inside = [path for path in inputs if os.path.realpath(path).startswith(target + os.sep)]
        if refuse is None and inside:
            refuse = f"it holds this command's input {inside[0]}"
    if refuse:
        raise DatasetError(f"{out_dir}: --force replaces only a dataset this project wrote, "
                           f"and {refuse}; nothing was removed")


def _is_mount_point(path):
    """Whether `path` is a mount point: of another file system (st_dev), or
    a bind mount of the same one (listed in the mount table)."""
    if os.path.ismount(path):
        return True
    try:
        with open("/proc/self/mountinfo") as table:
            points = {line.split()[4] for line in table}
    except OSError:
        return False
    # The table escapes spaces and the like as octal (\040).
    return any(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), point) == path
               for point in points)


def _not_as_written(target):
    """Why `target` is not a dataset a gbrun writer wrote, unchanged since
    (None where it is)."""
    try:
        with open(os.path.join(target, MANIFEST)) as f:
            written = json.load(f)
    except FileNotFoundError:
        return (f"it holds no {MANIFEST}, the record of what gbrun wrote there"
                " (remove it yourself if it is yours to remove)")
    except (OSError, ValueError) as error:
        return f"its {MANIFEST} cannot be read ({error})"
    others = sorted(set(os.listdir(target)) - set(written) - {MANIFEST})
    if others:
        shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
        return f"it holds files this script does not write ({shown})"
    for name, recorded in sorted(written.items()):
        path = os.path.join(target, name)
        if not os.path.isfile(path) or os.path.islink(path):
            return f"{name} is not the regular file gbrun wrote"
        if _size_and_digest(path) != recorded:
            return f"{name} changed since gbrun wrote it"
    return None


def _size_and_digest(path):
    with open(path, "rb") as f:
        return f"{os.fstat(f.fileno()).st_size}:{hashlib.file_digest(f, 'sha256').hexdigest()}"


def _write_manifest(directory):
    """Records every file in `directory` (what a writer just wrote)."""
    written = {name: _size_and_digest(os.path.join(directory, name))
               for name in sorted(os.listdir(directory))}
    with open(os.path.join(directory, MANIFEST), "x") as f:
        json.dump(written, f, indent=1, sort_keys=True)


def _make_sibling_dir(parent, prefix):
    """Create a fresh uniquely named directory; unlike mkdtemp it honours umask."""
    while True:
        path = os.path.join(parent, prefix + secrets.token_hex(4))
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue


def write_atomically(out_dir, force, write, inputs=()):
    """Call write(tmp_dir), then move tmp_dir to out_dir in one rename.

    The temp dir sits next to out_dir (same file system, so rename is
    atomic). An old out_dir is renamed away first and deleted only after the
    new one is in place; on any failure (KeyboardInterrupt included) the old
    one is put back.
    """
    out_dir = os.path.abspath(out_dir)
    parent, base = os.path.split(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp_dir = _make_sibling_dir(parent, f".{base}.tmp-")
    old_dir = None
    try:
        write(tmp_dir)
        _write_manifest(tmp_dir)
        check_out_dir(out_dir, force, inputs)  # again: it may have appeared meanwhile
        if os.path.lexists(out_dir):
            old_dir = _make_sibling_dir(parent, f".{base}.old-")
            os.rename(out_dir, os.path.join(old_dir, base))
        try:
            os.rename(tmp_dir, out_dir)
        except OSError as err:
            raise DatasetError(f"{out_dir}: cannot move the new dataset into place: {err}") from None
    finally:
        # Not in place (rename failed or interrupted): put the old one back.
        # If that fails too, old_dir is kept rather than deleted.
        if old_dir is not None and not os.path.lexists(out_dir):
            moved = os.path.join(old_dir, base)
            if os.path.lexists(moved):
                os.rename(moved, out_dir)
        shutil.rmtree(tmp_dir, ignore_errors=True)
        if old_dir is not None:
            shutil.rmtree(old_dir, ignore_errors=True)
