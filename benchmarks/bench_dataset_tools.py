"""Time the dataset tools at scale (a benchmark, not a test).

    python benchmarks/bench_dataset_tools.py                       # 2M nodes, 20M edges, 64 features
    python benchmarks/bench_dataset_tools.py --num-nodes 200000 --num-edges 2000000

Each tool runs as its own subprocess, exactly as a user runs it, so the
peak RSS reported is that process's alone (from os.wait4). Inputs for the
converter are random .npy files written first (not timed). Everything goes
into a temporary directory that is deleted at the end unless --keep.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from gbrun.cli import ArgumentParser, int_at_least

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")


def write_inputs(directory, num_nodes, num_edges, feat_dim, seed=0):
    """Random converter inputs; returns {name: path} and their total bytes."""
    rng = np.random.default_rng(seed)
    arrays = {
        "edges": rng.integers(0, num_nodes, size=(2, num_edges), dtype=np.int64),
        "features": rng.standard_normal((num_nodes, feat_dim), dtype=np.float32),
        "labels": rng.integers(0, 10, size=num_nodes, dtype=np.int64),
    }
    paths, total = {}, 0
    for name, array in arrays.items():
        paths[name] = os.path.join(directory, f"{name}.npy")
        np.save(paths[name], array)
        total += array.nbytes
    return paths, total


def timed_run(command):
    """Run command; return (wall seconds, peak RSS in MiB) of that process."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        sys.exit(f"error: {' '.join(command)} failed with exit code {process.returncode}")
    return wall, usage.ru_maxrss / 1024  # ru_maxrss is in KiB on Linux


def report(label, wall, rss_mib, input_bytes):
    ratio = f" ({rss_mib * 2**20 / input_bytes:.1f}x the input arrays)" if input_bytes else ""
    print(f"{label:<34} {wall:7.1f} s   peak RSS {rss_mib:7.0f} MiB{ratio}", flush=True)


def parse_args():
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-nodes", type=int_at_least(1), default=2_000_000)
    parser.add_argument("--num-edges", type=int_at_least(1), default=20_000_000)
    parser.add_argument("--feat-dim", type=int_at_least(1), default=64)
    parser.add_argument("--workdir", help="where to write (default: a new temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the written files")
    return parser.parse_args()


def main():
    args = parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_dataset_tools-")
    os.makedirs(workdir, exist_ok=True)
    python = sys.executable
    try:
        paths, input_bytes = write_inputs(workdir, args.num_nodes, args.num_edges, args.feat_dim)
        print(
            f"{args.num_nodes} nodes, {args.num_edges} edges, {args.feat_dim} features: "
            f"input arrays {input_bytes / 2**20:.0f} MiB, in {workdir}", flush=True,
        )
        convert = [
            python, os.path.join(SCRIPTS, "convert_to_ondisk.py"), os.path.join(workdir, "converted"),
            "--edges", paths["edges"], "--features", paths["features"], "--labels", paths["labels"],
        ]
        report("convert_to_ondisk.py", *timed_run(convert), input_bytes)
        report(
            "convert_to_ondisk.py --add-reverse-edges",
            *timed_run(convert + ["--add-reverse-edges", "--drop-self-loops", "--force"]),
            input_bytes,
        )
        synthetic = [
            python, os.path.join(SCRIPTS, "make_synthetic_dataset.py"), os.path.join(workdir, "synthetic"),
            "--num-nodes", str(args.num_nodes), "--avg-degree", str(args.num_edges / args.num_nodes),
            "--feat-dim", str(args.feat_dim),
        ]
        # The generator's own arrays are the same size as the converter's inputs.
        report("make_synthetic_dataset.py", *timed_run(synthetic), input_bytes)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
