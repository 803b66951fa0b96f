"""A broken install or environment is one line and exit status 2, as
docs/troubleshooting.md says: a torch that this DGL's GraphBolt was not
built for, no DGL, a /dev/shm too small for the dataset (Docker's)."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from helpers import NO_GPU, SCRIPT

# Run before the example in the same interpreter.
FAKES = {
    "another torch": "import torch\ntorch.__version__ = '2.3.0'\n",
    "no dgl": (
        "import builtins\n"
        "real = builtins.__import__\n"
        "def without_dgl(name, *args, **kwargs):\n"
        "    if name.split('.')[0] == 'dgl':\n"
        "        raise ModuleNotFoundError(\"No module named 'dgl'\", name='dgl')\n"
        "    return real(name, *args, **kwargs)\n"
        "builtins.__import__ = without_dgl\n"
    ),
}
MESSAGES = {
    "another torch": "Cannot find DGL C++ graphbolt library",
    "no dgl": "dgl is not installed (pip install -r requirements.txt)",
}


@pytest.mark.slow
@pytest.mark.parametrize("install", list(FAKES))
def test_a_broken_install_is_one_line(install, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(FAKES[install])
    done = subprocess.run(
        [sys.executable, SCRIPT, "--dataset", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, **NO_GPU, "PYTHONPATH": str(tmp_path)})
    error = done.stderr.strip()
    assert done.returncode == 2, error
    assert error.startswith("node_classification.py: error: ")
    assert MESSAGES[install] in error and len(error.splitlines()) == 1, error


@pytest.mark.slow
def test_a_dev_shm_too_small_for_the_dataset_is_one_line(small_dataset):
    # A 256 KB /dev/shm in a mount namespace of its own, as Docker gives a
    # container 64 MB: the ranks' copy of the data would not fit, and
    # writing past its end ended the job with a bare "Bus error".
    if os.geteuid() != 0 or not shutil.which("unshare"):
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true but this needs root and unshare")
        pytest.skip("needs root and unshare (util-linux)")
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c",
         'mount -t tmpfs -o size=256k tmpfs /dev/shm && exec "$@"', "-",
         sys.executable, SCRIPT, "--gpu=0,1", "--batch-size", "64",
         "--dataset", small_dataset],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, **NO_GPU})
    error = done.stderr.strip()
    assert done.returncode == 2, error
    assert re.search(r"error: the graph and features need 0\.\d MB of shared "
                     r"memory, but /dev/shm has 0\.\d MB free \(in Docker: "
                     r"docker run --shm-size=\.\.\. or --ipc=host\)$",
                     error), error
    assert len(error.splitlines()) == 1 and "Training with" not in done.stdout


def other_python():
    """A Python other than 3.11 and 3.12 on this machine (pyenv's, or on
    PATH), or None."""
    import glob

    found = sorted(glob.glob(os.path.expanduser(
        "~/.pyenv/versions/3.1[03]*/bin/python"))) + [
        shutil.which(name) for name in ("python3.13", "python3.10")]
    return next((path for path in found if path), None)


def test_requirements_stop_at_their_first_line_on_another_python():
    # No wheel of dgl 2.1.0 exists for 3.13: one line naming the Pythons
    # that work, before pip asks an index for anything.
    python = other_python()
    if python is None:
        pytest.skip("no Python other than 3.11 or 3.12 on this machine")
    requirements = os.path.join(os.path.dirname(SCRIPT), "requirements.txt")
    done = subprocess.run(
        [python, "-m", "pip", "install", "--dry-run", "--no-index",
         "-r", requirements], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines()
              if line.startswith("ERROR")]
    assert len(errors) == 1 and "this-project-needs-Python-3.11-or-3.12" in (
        errors[0]), done.stderr
    assert "torch" not in done.stdout + done.stderr


def test_the_requirements_guard_passes_this_python():
    from packaging.requirements import Requirement

    requirements = os.path.join(os.path.dirname(SCRIPT), "requirements.txt")
    lines = [line for line in open(requirements)
             if line.strip() and not line.startswith("#")]
    guard = Requirement(lines[0].strip())
    assert guard.name == "this-project-needs-python-3-11-or-3-12"
    assert not guard.marker.evaluate()  # this Python is 3.11 or 3.12
    assert guard.marker.evaluate({"python_version": "3.13"})
    assert guard.marker.evaluate({"python_version": "3.10"})
