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
