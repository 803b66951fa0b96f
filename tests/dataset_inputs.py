"""What the tests of the dataset writer (gbrun/data/ondisk.py, outdir.py)
and its two command lines share: small input files, the converter's
arguments for them, and each script's main() run in this process.

The converter's command line runs as a subprocess, exactly as a user runs
it, in one test (the generator's runs for every dataset conftest makes);
every other test calls the script's main() in this process with the same
arguments, working directory and sys.argv, and checks its exit status and
output: the same code once the interpreter has started, without a second
and a half of start-up per call.
"""

import io
import os
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np

import convert_to_ondisk
import make_synthetic_dataset
from gbrun.data import ondisk
from helpers import REPO

ROOT = Path(REPO)
SCRIPTS = ROOT / "scripts"
CONVERT = SCRIPTS / "convert_to_ondisk.py"
SYNTHETIC = SCRIPTS / "make_synthetic_dataset.py"
NUM_NODES = 40
MAINS = {CONVERT: convert_to_ondisk.main, SYNTHETIC: make_synthetic_dataset.main}


def run(script, *args, cwd=None):
    """`python script args` in `cwd`, as main() in this process: returns
    its exit status and output as subprocess.run would."""
    argv = [str(arg) for arg in args]
    out, err = io.StringIO(), io.StringIO()
    saved_argv, saved_cwd = sys.argv, os.getcwd()
    sys.argv = [str(script), *argv]  # the program name in error lines
    try:
        if cwd is not None:
            os.chdir(cwd)
        with redirect_stdout(out), redirect_stderr(err):
            try:
                code = MAINS[script](argv) or 0
            except SystemExit as exited:
                code = exited.code
                if isinstance(code, str):  # sys.exit(message)
                    print(code, file=sys.stderr)
                    code = 1
                code = code or 0
    finally:
        sys.argv = saved_argv
        os.chdir(saved_cwd)
    return subprocess.CompletedProcess([script, *argv], code, out.getvalue(),
                                       err.getvalue())


def run_script(script, *args):
    return subprocess.run(
        [sys.executable, str(script), *map(str, args)],
        capture_output=True, text=True, timeout=120,
    )


def make_inputs(directory, num_nodes=NUM_NODES, seed=0):
    """Small valid input files; returns {name: path} and the arrays."""
    rng = np.random.default_rng(seed)
    arrays = {
        "features": rng.normal(size=(num_nodes, 3)),
        "labels": np.r_[0:4, rng.integers(0, 4, num_nodes - 4)],  # all classes in train
        # Every node has an edge; plus a self-loop and a duplicate edge.
        "edges": np.concatenate(
            [np.stack([np.arange(num_nodes), (np.arange(num_nodes) + 1) % num_nodes]),
             [[5, 7], [5, 3]], [[7, 3], [7, 3]]], axis=1),
        "train": np.arange(0, 24),
        "val": np.arange(24, 32),
        "test": np.arange(32, 40),
    }
    paths = {}
    for name, array in arrays.items():
        paths[name] = Path(directory) / f"{name}.npy"
        np.save(paths[name], array)
    return paths, arrays


def convert_args(paths, with_idx=True):
    args = ["--edges", paths["edges"], "--features", paths["features"], "--labels", paths["labels"]]
    if with_idx:
        args += ["--train-idx", paths["train"], "--val-idx", paths["val"], "--test-idx", paths["test"]]
    return args


def load(directory):
    import dgl.graphbolt as gb

    return gb.OnDiskDataset(str(directory)).load()


def pair_set(edges):
    return set(zip(np.asarray(edges[0]).tolist(), np.asarray(edges[1]).tolist()))


def leftovers(parent):
    """Temp or backup dirs the writer may have left in parent."""
    return [p.name for p in Path(parent).iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def snapshot_tree(directory):
    return {str(path.relative_to(directory)): path.read_bytes() if path.is_file() else None
            for path in sorted(directory.rglob("*"))}


def write_small_dataset(out, arrays, force=True):
    return ondisk.write_ondisk_dataset(
        out, arrays["edges"], arrays["features"], arrays["labels"],
        arrays["train"], arrays["val"], arrays["test"], force=force,
    )
