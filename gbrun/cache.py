"""The user's cache directory for what gbrun builds once and reuses: the
dropout kernel (gbrun.cpu.dropout) and preprocessed datasets
(gbrun.data.staging). What is loaded from it can run code (a shared library,
GraphBolt's pickled graph), so it is used only where no other user (root
aside) can change what a path in it leads to:

- every directory from the cache root down is this user's, not a symlink,
  and writable by nobody else (mode 0700 where gbrun creates it);
- every directory above the root, from / down, is root's or this user's and
  writable by nobody else, unless it is sticky and root's, as /tmp is (in a
  sticky directory only an entry's owner can rename or remove it). Symlinks
  above the root are resolved first (os.path.realpath), then the real path
  is checked. ACLs are not read.

The check walks from / one directory at a time by descriptor (openat with
O_NOFOLLOW, then fstat), so what is checked is what is used: a directory
swapped in or out between two of its steps is seen, not followed. Code that
loads from the cache opens by descriptor from that walk's end (open_dir,
open_file): the dropout kernel is loaded from /proc/self/fd/N of the file
checked, never by its path again.

The root is $GBRUN_CACHE, else $XDG_CACHE_HOME/gbrun, else ~/.cache/gbrun,
else (none of them usable) $TMPDIR/gbrun-<uid>. A relative $GBRUN_CACHE is
refused; a relative $XDG_CACHE_HOME is ignored, as the XDG spec says; a HOME
that is empty or relative (HOME="" made ~ mean /, so /.cache/gbrun) passes
~/.cache over with that reason, for $TMPDIR/gbrun-<uid>; HOME unset is the
home in the password database, as for a shell. Where a preferred root is
passed over, passed_over says why, for the line that tells the user where a
dataset was preprocessed."""
import errno
import os
import stat
import tempfile

# A directory as a place, not as content to read: no read permission needed
# (a home of mode 0711), and a symlink is opened as itself (O_NOFOLLOW).
_AS_PLACE = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


class CacheError(OSError):
    """No cache directory that is safely this user's: one line, why."""


def roots(env=os.environ):
    """The candidate cache roots, in order of preference. A candidate that
    cannot be one is a CacheError in the list, for passed_over to tell."""
    if env.get("GBRUN_CACHE"):
        return [env["GBRUN_CACHE"]]
    fallback = os.path.join(tempfile.gettempdir(), f"gbrun-{os.getuid()}")
    xdg = env.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return [os.path.join(xdg, "gbrun"), fallback]
    home = env.get("HOME")
    if home is None:  # as a shell reads ~: the password database
        home = os.path.expanduser("~")
        unusable = "HOME is not set and this user has no home in the " \
                   "password database"
    else:
        unusable = f"HOME is {home!r}, not an absolute path"
    if not os.path.isabs(home):
        return [CacheError(f"{unusable}, so there is no ~/.cache"), fallback]
    return [os.path.join(home, ".cache", "gbrun"), fallback]


def check_private(path):
    """Refuses (CacheError) a directory that is a symlink, is not this
    user's, or that others may write to."""
    try:
        info = os.lstat(path)
    except OSError as error:
        raise CacheError(f"cache directory {path}: {error.strerror}") from None
    _check_private(info, path)


def _check_private(info, path):
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


def _check_above(info, path, below):
    """A directory above the cache (`below`): root's or this user's, and
    writable by nobody else unless sticky and root's (/tmp)."""
    where = f"cache directory {below} is under {path}, which"
    if not stat.S_ISDIR(info.st_mode):
        raise CacheError(f"{where} is not a directory")
    if info.st_uid not in (0, os.getuid()):
        raise CacheError(f"{where} belongs to uid {info.st_uid} (neither "
                         "root nor this user)")
    sticky = info.st_mode & stat.S_ISVTX and info.st_uid == 0
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not sticky:
        raise CacheError(f"{where} is writable by others (mode "
                         f"{stat.S_IMODE(info.st_mode):04o}) and not a "
                         "sticky directory of root's, as /tmp is")


def _step(parent, name, path, check, create):
    """The descriptor of `parent`'s entry `name` (shown as `path`), made
    (0700) first where `create` and missing, and checked by `check`."""
    try:
        try:
            fd = os.open(name, _AS_PLACE, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                raise
            try:
                os.mkdir(name, 0o700, dir_fd=parent)
            except FileExistsError:  # made meanwhile (another rank)
                pass
            fd = os.open(name, _AS_PLACE, dir_fd=parent)
    except OSError as error:
        raise CacheError(f"cache directory {path}: {error.strerror}") from None
    try:
        check(os.fstat(fd), path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _walk(above, private, create):
    """A descriptor (O_PATH) of the directory `above` + `private` (lists of
    names below /), reached from / one name at a time: / and each of
    `above` checked by _check_above, each of `private` by _check_private;
    missing ones made where `create`."""
    shown = os.path.join("/", *above, *private)

    def check_above(info, path):
        _check_above(info, path, shown)

    fd = os.open("/", _AS_PLACE)
    path = "/"
    try:
        check_above(os.fstat(fd), path)
        steps = [(name, check_above) for name in above]
        steps += [(name, _check_private) for name in private]
        for name, check in steps:
            path = os.path.join(path, name)
            fd, parent = _step(fd, name, path, check, create), fd
            os.close(parent)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _names(path):
    return [name for name in path.split("/") if name]


def open_root(root, parts, create=True):
    """(path, descriptor) of `root`'s subdirectory `parts`: `root`'s parent
    resolved (realpath) and every directory from / to it checked as above
    the cache, `root` and each of `parts` as the cache's own, made 0700 where
    missing (create). The path is the one checked, symlinks above resolved:
    one that others could repoint is not followed again by what uses the
    path. The caller closes the descriptor."""
    if isinstance(root, CacheError):
        raise root
    if not os.path.isabs(root):  # only $GBRUN_CACHE can be (roots)
        raise CacheError(f"cache directory {root!r} is not an absolute path")
    parent = os.path.realpath(os.path.dirname(os.path.abspath(root)))
    private = _names(os.path.basename(os.path.abspath(root)))
    if not private:
        raise CacheError(f"cache directory {root} is /")
    private += [name for part in parts for name in _names(part)]
    fd = _walk(_names(parent), private, create)
    path = os.path.join(parent, *private)
    if not os.access(".", os.W_OK, dir_fd=fd):
        os.close(fd)
        raise CacheError(f"cache directory {path} is not writable")
    return path, fd


def open_cache_dir(*parts, env=os.environ):
    """(path, descriptor) of the first usable cache root's subdirectory
    `parts` (made where missing), or CacheError naming why the last
    candidate was refused. The caller closes the descriptor; opening what is
    in it by the descriptor (open_file, /proc/self/fd/N) uses what was
    checked."""
    problem = None
    for root in roots(env):
        try:
            return open_root(root, parts)
        except CacheError as error:
            problem = error
    raise problem


def cache_dir(*parts, env=os.environ):
    """The path of open_cache_dir(*parts): for what is written and read by
    path in a directory nobody else can change."""
    path, fd = open_cache_dir(*parts, env=env)
    os.close(fd)
    return path


def passed_over(*parts, env=os.environ):
    """Why cache_dir(*parts) uses a later candidate root than the first:
    the CacheError's line of each root it refuses before the one it uses
    (none where the first serves). A user told where gbrun put something
    (a preprocessed dataset, in /tmp say) is then told why not in the root
    they set up."""
    reasons = []
    for root in roots(env):
        try:
            os.close(open_root(root, parts)[1])
            break
        except CacheError as error:
            reasons.append(str(error))
    return reasons


def open_dir(path):
    """A descriptor (O_PATH) of the existing directory `path`, checked from
    / down: every directory above it as above the cache, `path` itself as
    the cache's own (check_private). For loading what a path names, as
    GraphBolt loads a preprocessed graph (a pickle), from the directory that
    was checked: pass it f"/proc/self/fd/{fd}" (a subpath of it resolves
    below that very directory, whatever was renamed since), keep the
    descriptor open while loading, then close it."""
    if not os.path.isabs(path):
        raise CacheError(f"cache directory {path!r} is not an absolute path")
    parent = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    return _walk(_names(parent), [os.path.basename(os.path.abspath(path))],
                 create=False)


def open_file(directory, name, path):
    """A descriptor (O_RDONLY) of the file `name` in the directory of
    descriptor `directory` (shown as `path`), or CacheError where it is a
    symlink, not a regular file, not this user's or writable by others.
    FileNotFoundError where there is none."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
                     | os.O_NONBLOCK, dir_fd=directory)  # a FIFO: no wait
    except OSError as error:
        if error.errno == errno.ENOENT:
            raise
        why = (" is a symlink" if error.errno == errno.ELOOP  # O_NOFOLLOW's
               else f": {error.strerror}")
        raise CacheError(f"cache file {path}{why}") from None
    info = os.fstat(fd)
    problem = (
        "is not a regular file" if not stat.S_ISREG(info.st_mode)
        else f"belongs to uid {info.st_uid}, not to this user ({os.getuid()})"
        if info.st_uid != os.getuid()
        else f"is writable by others (mode {stat.S_IMODE(info.st_mode):04o})"
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) else None)
    if problem:
        os.close(fd)
        raise CacheError(f"cache file {path} {problem}")
    return fd
