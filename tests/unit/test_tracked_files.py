"""No tracked file lies where Python tooling expects build output or an
environment: the names GitHub's standard Python .gitignore ignores at any
depth (github/gitignore's Python.gitignore), which black's and ruff's
default excludes skip too. A contributor who has that .gitignore, as a
project's or a global one, never stages a new file in such a folder (green
locally, ImportError in CI), and formatters skip it without a word. git
itself reads the patterns (check-ignore), as a global excludes file beside
the project's own .gitignore, over the index's files."""
import os
import shutil
import subprocess

import pytest

from helpers import REPO

# The build-output, packaging and environment names of that .gitignore
# (listed here, not copied; checked against its 2026 version), as patterns.
BUILD_LIKE = ("__pycache__/", "*.py[cod]", "*.so", "build/", "dist/",
              "develop-eggs/", "downloads/", "eggs/", ".eggs/", "lib/",
              "lib64/", "parts/", "sdist/", "var/", "wheels/",
              "share/python-wheels/", "*.egg-info/", "*.egg", "htmlcov/",
              ".tox/", ".nox/", "cover/", ".cache", "instance/", "target/",
              "docs/_build/", "__pypackages__/", ".env", ".venv", "env/",
              "venv/", "ENV/", "/site", "*.log", "*.spec", "*.manifest")


def git(*args, stdin=None):
    return subprocess.run(["git", "-C", REPO, *args], input=stdin,
                          capture_output=True, text=True, timeout=60)


def not_a_checkout():
    """Why the tracked files cannot be read here, or None."""
    if shutil.which("git") is None:
        return "needs git"
    top = git("rev-parse", "--show-toplevel")
    if top.returncode != 0 or not os.path.samefile(top.stdout.strip(), REPO):
        return (f"{REPO} is not a git checkout (or git refuses it): the "
                f"tracked files are the index's. {top.stderr.strip()}")
    return None


def test_no_tracked_file_is_ignored_by_the_standard_python_gitignore(
        tmp_path):
    reason = not_a_checkout()
    if reason:
        # CI runs on a clone: there a skip would hide the check.
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    tracked = git("ls-files", "-z")
    assert tracked.returncode == 0, tracked.stderr
    assert tracked.stdout, "git ls-files lists nothing"
    standard = tmp_path / "python.gitignore"
    standard.write_text("\n".join(BUILD_LIKE) + "\n")
    # --no-index: a tracked file counts as ignored too (that is the point).
    # Exit status 0: some path is ignored; 1: none is.
    found = git("-c", f"core.excludesFile={standard}", "check-ignore",
                "--no-index", "--stdin", "-z", "-v", stdin=tracked.stdout)
    assert found.returncode in (0, 1), found.stderr
    # -z -v: source, line, pattern and path of each ignored path, each
    # field ended by a NUL.
    fields = found.stdout.split("\0")[:-1]
    ignored = []
    for at in range(0, len(fields), 4):
        source, line, pattern, path = fields[at:at + 4]
        ignored.append(f"{path} (pattern {pattern!r}, "
                       f"{os.path.basename(source)}:{line})")
    assert found.returncode == 1 and not ignored, (
        "tracked files in folders that GitHub's standard Python .gitignore "
        "ignores "
        "(rename the folder):\n" + "\n".join(ignored))
