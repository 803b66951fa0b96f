"""The datasets that come with the example: `--dataset synthetic` (the
README's quick-start graph) and `synthetic-links` (the docs' link-prediction
graph), made on first use into gbrun's cache by gbrun.data.synthetic (the
same bytes as make_synthetic_dataset.py with the same arguments), never
downloaded.

Each is made once: under a lock (two jobs, or torchrun's ranks, that start
together wait for the first), into a directory of its own that is renamed
into place whole, beside a record of the fingerprint it was written with.
What is found there later is used only if it still has that fingerprint;
anything else (a directory gbrun did not write, a file changed since) is
refused in one line that says how to have it made again."""
import contextlib
import fcntl
import io
import json
import os
import shutil
import tempfile

from .. import cache
from . import fingerprint, synthetic
from .metadata import read_metadata

# Each name: gbrun.data.synthetic.write's arguments where they differ from
# its DEFAULTS (make_synthetic_dataset.py's), as that script's options.
MADE = {
    "synthetic": {},
    "synthetic-links": {"num_nodes": 2000, "avg_degree": 5, "feat_dim": 32,
                        "link_negatives": 50},
}
DATA = "data"  # the dataset, inside the name's directory
RECORD = "made.json"  # beside it: its fingerprint as written


def options(name):
    """The make_synthetic_dataset.py options that write the same bytes."""
    return " ".join(f"--{key.replace('_', '-')} {value}"
                    for key, value in MADE[name].items())


def directory(name):
    """(the dataset directory of builtin `name`, whether it was made now).
    Raises CacheError where the cache is not usable or what is there is not
    what gbrun wrote."""
    root = cache.cache_dir("builtin")
    home = os.path.join(root, name)
    with _locked(os.path.join(root, f"{name}.lock")):
        made = not os.path.lexists(home)
        if made:
            _make(root, home, name)
        _check(home, name)
    return os.path.join(home, DATA), made


@contextlib.contextmanager
def _locked(path):
    """An exclusive lock on `path` (a file of its own, never followed)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _make(root, home, name):
    building = tempfile.mkdtemp(dir=root, prefix=f".{name}-building-")
    try:
        data = os.path.join(building, DATA)
        # The writer's notes (negatives that are edges) concern the user's
        # own data; these bytes are the project's.
        with contextlib.redirect_stderr(io.StringIO()):
            synthetic.write(data, **{**synthetic.DEFAULTS, **MADE[name]})
        record = {"name": name, "files": _fingerprint(data)}
        with open(os.path.join(building, RECORD), "x") as f:
            json.dump(record, f, indent=1)
        try:
            os.rename(building, home)
        except OSError:
            if not os.path.isdir(home):  # else made meanwhile, by a job
                raise                    # that did not take the lock
    finally:
        shutil.rmtree(building, ignore_errors=True)


def _fingerprint(data):
    return fingerprint.fingerprint(data, read_metadata(data))


def _check(home, name):
    """Refuses what is at `home` unless it is the dataset gbrun made there,
    unchanged."""
    again = f"; remove {home} to have it made again"
    try:
        for path in (home, os.path.join(home, DATA)):
            cache.check_private(path)
        fd = os.open(os.path.join(home, RECORD), os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd) as f:
            recorded = json.load(f)["files"]
        found = _fingerprint(os.path.join(home, DATA))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise cache.CacheError(
            f"{home} is not the builtin dataset '{name}' as gbrun made it "
            f"({type(error).__name__}: {error}){again}") from None
    changed = sorted(set(recorded) ^ set(found)
                     | {path for path in recorded if recorded[path] != found.get(path)})
    if changed:
        raise cache.CacheError(
            f"{home}: the builtin dataset '{name}' changed since gbrun made it "
            f"({', '.join(changed[:3])}){again}")
