"""The user's cache directory for what gbrun builds once and reuses: the
dropout kernel (gbrun.cpu.dropout) and preprocessed datasets
(gbrun.data.staging). What is loaded from it can run code (a shared library,
GraphBolt's pickled graph), so it is used only if it is this user's own:
every directory from the cache root down is owned by this user, not a
symlink, and writable by nobody else (mode 0700 where gbrun creates it).

The root is $GBRUN_CACHE, else $XDG_CACHE_HOME/gbrun, else ~/.cache/gbrun,
else (none of them usable) $TMPDIR/gbrun-<uid>; a relative path is refused
(HOME unset made '~' a directory named '~' under the working directory).
Where a preferred root is passed over, passed_over says why, for the line
that tells the user where a dataset was preprocessed."""
import os
import stat
import tempfile


class CacheError(OSError):
    """No cache directory that is safely this user's: one line, why."""


def roots(env=os.environ):
    """The candidate cache roots, in order of preference."""
    if env.get("GBRUN_CACHE"):
        return [env["GBRUN_CACHE"]]
    home = os.path.expanduser("~")
    base = env.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")
    return [os.path.join(base, "gbrun"),
            os.path.join(tempfile.gettempdir(), f"gbrun-{os.getuid()}")]


def check_private(path):
    """Refuses (CacheError) a directory that is a symlink, is not this
    user's, or that others may write to."""
    try:
        info = os.lstat(path)
    except OSError as error:
        raise CacheError(f"cache directory {path}: {error.strerror}") from None
    if stat.S_ISLNK(info.st_mode):
        raise CacheError(f"cache directory {path} is a symlink")
    if not stat.S_ISDIR(info.st_mode):
        raise CacheError(f"cache directory {path} is not a directory")
    if info.st_uid != os.getuid():
        raise CacheError(f"cache directory {path} belongs to uid "
                         f"{info.st_uid}, not to this user ({os.getuid()})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheError(f"cache directory {path} is writable by others "
                         f"(mode {stat.S_IMODE(info.st_mode):04o})")


def private_dir(path):
    """`path`, created with mode 0700 where missing (its parents too), and
    checked (check_private)."""
    if not os.path.isabs(path):
        raise CacheError(f"cache directory {path!r} is not an absolute path "
                         "(is HOME set?)")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as error:
        raise CacheError(f"cache directory {path}: {error.strerror}") from None
    check_private(path)
    return path


def usable(root, parts):
    """`root`'s subdirectory `parts` (each level created 0700 and checked),
    writable, or CacheError naming why not."""
    path = private_dir(root)
    for part in parts:
        path = private_dir(os.path.join(path, part))
    if not os.access(path, os.W_OK):
        raise CacheError(f"cache directory {path} is not writable")
    return path


def cache_dir(*parts, env=os.environ):
    """The first usable cache root's subdirectory `parts`, or CacheError
    naming why the last candidate was refused."""
    problem = None
    for root in roots(env):
        try:
            return usable(root, parts)
        except CacheError as error:
            problem = error
    raise problem


def passed_over(*parts, env=os.environ):
    """Why cache_dir(*parts) uses a later candidate root than the first:
    the CacheError's line of each root it refuses before the one it uses
    (none where the first serves). A user told where gbrun put something
    (a preprocessed dataset, in /tmp say) is then told why not in the root
    they set up."""
    reasons = []
    for root in roots(env):
        try:
            usable(root, parts)
            break
        except CacheError as error:
            reasons.append(str(error))
    return reasons
