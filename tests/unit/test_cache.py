"""gbrun.cache: the cache is used only where no other user (root aside) can
change what its paths lead to: every directory above its root, from /, is
root's or this user's and writable by nobody else unless sticky and root's
(as /tmp); an unusable HOME is passed over with the reason; a directory is
opened by descriptor, so what was checked is what is read. (The cache's own
directories, and the line that says a root was passed over, are tested in
unit/data/test_staging.py; loading the kernel from it, with another user
swapping directories meanwhile, in unit/cpu/test_dropout.py.)"""
import os
import pwd
import re

import pytest

import gbrun.cache as cache

OTHER_UID = 12345
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0,
                               reason="needs root to give a directory away")


@pytest.fixture
def temp(tmp_path, monkeypatch):
    """$TMPDIR, the last candidate root, a directory of this test's own."""
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    return tmp_path / "tmp"


def above(tmp_path, mode, uid):
    """tmp_path/above (of `mode` and owner `uid`)/mid (this user's, 0700):
    the root's parent is mid, and above is two levels up."""
    (tmp_path / "above" / "mid").mkdir(parents=True, mode=0o700)
    os.chmod(tmp_path / "above", mode)
    os.chown(tmp_path / "above", uid, -1)
    return tmp_path / "above" / "mid" / "cache"


@ROOT_ONLY
@pytest.mark.parametrize("mode, uid, problem", [
    (0o755, 0, None),
    (0o1777, 0, None),  # as /tmp
    (0o777, 0, "is writable by others (mode 0777) and not a sticky "
               "directory of root's, as /tmp is"),
    (0o775, 0, "is writable by others (mode 0775)"),
    (0o1777, OTHER_UID, f"belongs to uid {OTHER_UID} (neither root nor "
                        "this user)"),
    (0o755, OTHER_UID, f"belongs to uid {OTHER_UID}"),
])
def test_every_directory_above_the_root_is_roots_or_this_users_alone(
        tmp_path, mode, uid, problem):
    root = above(tmp_path, mode, uid)
    env = {"GBRUN_CACHE": str(root)}
    if problem is None:
        assert cache.cache_dir("datasets", env=env) == str(root / "datasets")
        return
    with pytest.raises(cache.CacheError, match=re.escape(
            f"cache directory {root / 'datasets'} is under "
            f"{tmp_path / 'above'}, which {problem}")):
        cache.cache_dir("datasets", env=env)
    assert not root.exists()  # nothing made where others could reach it


@ROOT_ONLY
def test_a_symlink_above_the_root_is_followed_and_where_it_leads_checked(
        tmp_path):
    root = above(tmp_path, 0o777, 0)
    os.symlink(tmp_path / "above" / "mid", tmp_path / "link")
    with pytest.raises(cache.CacheError, match=re.escape(
            f"is under {tmp_path / 'above'}, which is writable by others")):
        cache.cache_dir(env={"GBRUN_CACHE": str(tmp_path / "link" / "cache")})
    os.chmod(tmp_path / "above", 0o755)
    # The path given back is the one checked: the link is not followed again.
    assert cache.cache_dir(env={"GBRUN_CACHE": str(tmp_path / "link" / "cache")}
                           ) == str(root)


@pytest.mark.parametrize("home", ["", "relative"])
def test_a_home_that_is_not_an_absolute_path_is_passed_over(temp, home):
    # HOME="" made the cache /.cache/gbrun (os.path.expanduser gives "/").
    env = {"HOME": home}
    assert cache.passed_over(env=env) == [
        f"HOME is {home!r}, not an absolute path, so there is no ~/.cache"]
    assert cache.cache_dir(env=env) == str(temp / f"gbrun-{os.getuid()}")


def test_home_unset_is_the_home_a_shell_reads(temp):
    home = pwd.getpwuid(os.getuid()).pw_dir
    assert cache.roots({})[0] == os.path.join(home, ".cache", "gbrun")


def test_a_relative_xdg_cache_home_is_ignored(tmp_path):
    # The XDG spec: a relative path in these variables is invalid, ignored.
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    env = {"HOME": str(home), "XDG_CACHE_HOME": "relative"}
    assert cache.cache_dir(env=env) == str(home / ".cache" / "gbrun")
    assert os.stat(home / ".cache").st_mode & 0o777 == 0o700


def test_a_directory_opened_is_read_as_checked_whatever_is_renamed_after(
        tmp_path):
    checked = tmp_path / "checked"
    checked.mkdir(mode=0o700)
    (checked / "graph").write_text("checked")
    fd = cache.open_dir(str(checked))
    try:
        # Renamed away and another put in its place: the descriptor's path
        # still reads the directory that was checked.
        checked.rename(tmp_path / "moved")
        checked.mkdir()
        (checked / "graph").write_text("planted")
        assert open(f"/proc/self/fd/{fd}/graph").read() == "checked"
    finally:
        os.close(fd)
    os.chmod(checked, 0o777)
    with pytest.raises(cache.CacheError, match=re.escape(
            f"cache directory {checked} is writable by others (mode 0777)")):
        cache.open_dir(str(checked))
    os.symlink(tmp_path / "moved", tmp_path / "link")
    with pytest.raises(cache.CacheError, match="is a symlink"):
        cache.open_dir(str(tmp_path / "link"))
