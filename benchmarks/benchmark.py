"""
Measure what node_classification.py trains per second on CPU ranks, where its
time and memory go, and what it adds on top of a bare GraphBolt loop.

    python scripts/make_synthetic_dataset.py /tmp/perf200k --num-nodes 200000 \\
        --avg-degree 20 --feat-dim 100 --num-classes 10
    python benchmarks/benchmark.py --dataset /tmp/perf200k
    python benchmarks/benchmark.py --dataset /tmp/perf200k --ranks 1,2 --threads 1,2 \\
        --num-workers 0,1 --batches 20 --json perf.json
    # One rank's time per batch by stage, at two fanouts, without full runs:
    python benchmarks/benchmark.py --dataset /tmp/perf200k --no-runs \\
        --stages 5,5,5 --stages 10,10,10
    # link_prediction.py (2 ranks) against upstream's link-prediction step:
    python scripts/make_synthetic_dataset.py /tmp/links --link-negatives 100
    python benchmarks/benchmark.py --dataset /tmp/links --task link --repeat 3

One invocation measures, on the same data:
  (a) the baseline: a bare single-process GraphBolt loop (ItemSampler,
      sample_neighbor, fetch_feature, SAGE forward, backward, Adam step; no
      DDP, no Join, no metrics) with node_classification.py's SAGE, as
      GraphBolt comes ("bare") and with the example's CPU settings
      (keep_freed_memory(), poll_less(), its feature reads and fused
      dropout) applied ("bare+tuned");
  (b) node_classification.py itself, for every combination of --ranks,
      --threads (per rank), --num-workers (per rank), --precision and
      --dropout, as a user runs it:
      `--mode cpu-cpu --gpu 0,1,.. --epochs 2 --max-batches N`;
  (c) with --stages, one rank's time per batch by stage (sampling, feature
      fetching through GraphBolt's CPU read and through the example's, the
      model's step), one thread, for each --stages fanout, --precision and
      --dropout.
With --task link, instead: (a) bare_link_loop.py, upstream DGL v2.1.0's
link-prediction step in one process on torch's default threads, trained on
ranks x --batches batches (as many positive pairs as the example's ranks
together), and (b) link_prediction.py, alternating round by round; the
table gives positive pairs/s (the median of the rounds, the slowest and
fastest), x upstream (the median of each round's ratio) and the validation
MRR after the two epochs. Its MRR compares where --batches covers the
example's evaluation (every node in batches of --batch-size per rank).
Every run is its own process tree, launched and watched from here:

main
├── parse_args
├── plan_runs                          a Run (settings, command) per configuration
├── measure                            launch, watch, read metrics.jsonl
│   ├── sample_tree                    CPU times (and PSS/USS) of every process
│   └── summarize                      per-batch times, CPU in the training window
├── print_rows                         the tables
├── link_rows / print_link             --task link: medians, x upstream, MRR
├── measure_stages / print_stages      --stages: one rank's split, per fanout
├── (child) bare_loop.py               the baseline, a module of its own
├── (child) bare_link_loop.py          --task link: upstream's step, likewise
└── (child) stage_split.py             the stage split, likewise

Two epochs of N batches each: epoch 0 warms up (first DDP step, fresh heap,
thread pools) and gives the start-up time; epoch 1 is the measurement.
Validation and test are cut to N batches as well. What each column means:
  seeds/s       training seeds per second, all ranks together (epoch 1); with
                --repeat, the fastest repetition (its row), and
  worst         the slowest one
  x bare        seeds/s against the bare loop as GraphBolt comes, with as
                many threads per process
  x cores       against the bare loop on the same cores (ranks x threads
                threads in one process)
  x 1rank       against one rank with the same threads and workers
  x fp32        against the same run in fp32
  x torch       against the same run with torch's dropout (--dropout
                fused,torch; the example's --no-fused-dropout)
  s/batch       wall time per training batch on rank 0, split into
  wait          time blocked on the data loader (sampling and feature fetching
                that its prefetch thread did not hide) and
  compute       the rest: forward, backward, gradient all-reduce, optimizer
  user, sys     CPU seconds of the whole process tree inside epoch 1's
                training loop (sampled every --interval s, interpolated)
  tree MiB      summed PSS of the process tree during epoch 0's training (its
                largest sample): what the job occupies, memory shared between
                ranks counted once. Memory is not read during epoch 1: each
                read costs the kernel ~0.1 s of CPU that the ranks would lose
  peak MiB      the same over the whole run but epoch 1 (includes loading the
                dataset)
  rank USS      peak memory unique to one rank (largest rank): its heap,
                not the graph and features it shares with the others
  launcher      peak USS of the launcher process (it loaded the dataset and
                waits)
  start s       from the command to the first training batch (epoch 0); with
                --repeat, the quickest of the repetitions
  load          1-minute load average before the run (the machine may be shared)

The example's hooks used here: --max-batches, --threads, and --log-dir,
whose metrics.jsonl gives each epoch's epoch_time, train_time,
seeds_per_second and data_wait (the bare loop writes the same records).
"""
import argparse
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import psutil

from gbrun.cli import (
    SHIPPED_EXAMPLE, ArgumentParser, fanout_list, int_at_least,
    positive_float, python_file,
)
from gbrun.records import METRICS_FILE

from bare_link_loop import LINK_EXAMPLE
from bare_loop import EPOCHS

HERE = os.path.dirname(os.path.abspath(__file__))
TORCH_DROPOUT = " torch-dropout"  # in the name of a run with torch's dropout


@dataclass
class Run:
    """One configuration to measure: its name in the table, how it runs
    and the command that runs it (writing its metrics to `log_dir`)."""

    name: str
    command: list
    ranks: int = None  # None: the bare loop, one process
    threads: int = 1
    workers: int = 0
    precision: str = "fp32"
    dropout: str = "fused"
    env: dict = field(default_factory=dict)
    log_dir: str = None


# ----------------------------------------------------------------- commands
def bare_command(args, threads, tuned, precision, log_dir):
    return [
        sys.executable, os.path.join(HERE, "bare_loop.py"),
        "--dataset", args.dataset, "--example", args.example,
        "--log-dir", log_dir, "--threads", str(threads),
        "--batches", str(args.batches), "--batch-size", str(args.batch_size),
        "--fanout", ",".join(map(str, args.fanout)), "--precision", precision,
    ] + (["--tuned"] if tuned else [])


def bare_link_command(args, log_dir):
    """Upstream's link-prediction step in one process (bare_link_loop.py),
    trained on as many positive pairs per epoch as the example's ranks
    together: ranks x --batches steps of --batch-size pairs."""
    return [
        sys.executable, os.path.join(HERE, "bare_link_loop.py"),
        "--dataset", args.dataset, "--example", args.example,
        "--log-dir", log_dir, "--batches", str(args.ranks[0] * args.batches),
        "--batch-size", str(args.batch_size),
        "--neg-ratio", str(args.neg_ratio),
        "--fanout", ",".join(map(str, args.fanout)),
    ]


def dropout_flag(dropout):
    return "--fused-dropout" if dropout == "fused" else "--no-fused-dropout"


def stages_command(args, fanout, precision, dropout):
    return [sys.executable, os.path.join(HERE, "stage_split.py"),
            "--dataset", args.dataset, "--example", args.example,
            "--threads", "1", "--batches", str(args.batches), "--batch-size",
            str(args.batch_size), "--fanout", ",".join(map(str, fanout)),
            "--precision", precision, dropout_flag(dropout)]


def measure_stages(args):
    """The stage split of one rank with one thread, for each --stages
    fanout, --precision and --dropout, each in its own process; with
    --repeat, round-robin, the repetition with the fastest compute (and
    every repetition's compute in compute_s_all)."""
    settings = list(itertools.product(args.stages, args.precision,
                                      args.dropout))
    repeats = [[] for _ in settings]
    for _ in range(args.repeat):
        for setting, results in zip(settings, repeats):
            results.append(split_once(args, *setting))
    records = []
    for results in repeats:
        measured = [r for r in results if r["exit_code"] == 0]
        if len(measured) < len(results):
            records.append(next(r for r in results if r["exit_code"] != 0))
            continue
        best = dict(min(measured, key=lambda r: r["compute_s"]))
        best["compute_s_all"] = [r["compute_s"] for r in measured]
        best["worst_compute_s"] = max(best["compute_s_all"])
        records.append(best)
    return records


def split_once(args, fanout, precision, dropout):
    done = subprocess.run(stages_command(args, fanout, precision, dropout),
                          capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        print(f"stage split {fanout} {precision} {dropout}: failed (exit code"
              f" {done.returncode}):\n{done.stderr[-2000:]}", file=sys.stderr)
        return {"fanout": fanout, "precision": precision, "dropout": dropout,
                "exit_code": done.returncode}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]), exit_code=0)


def script_command(args, ranks, threads, workers, precision, dropout,
                   log_dir):
    if args.launcher == "torchrun":
        start = [sys.executable, "-m", "torch.distributed.run",
                 f"--nproc-per-node={ranks}", args.example]
    else:
        start = [sys.executable, args.example,
                 "--gpu", ",".join(str(i) for i in range(ranks))]
    return start + [
        "--log-dir",
        log_dir,
        "--dataset",
        args.dataset,
        "--mode",
        "cpu-cpu",
        "--threads",
        str(threads),
        "--num-workers",
        str(workers),
        "--epochs",
        str(EPOCHS),
        "--max-batches",
        str(args.batches),
        "--batch-size",
        str(args.batch_size),
        "--fanout",
        ",".join(map(str, args.fanout)),
        "--precision",
        precision,
        dropout_flag(dropout),
    ] + (["--neg-ratio", str(args.neg_ratio)] if args.task == "link" else [])


# ---------------------------------------------------------------- measuring
def measure(command, env, interval, timeout, root_role, log_dir):
    """Run `command`, sampling its process tree until it exits, and reading
    the epoch records it appends to log_dir/metrics.jsonl as they come.
    Returns (epoch records with their arrival times, samples, launch time,
    exit code, stderr tail)."""
    records = []
    metrics = os.path.join(log_dir, METRICS_FILE)
    with tempfile.TemporaryFile() as stderr:
        launched = time.time()
        process = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env=env,
            text=True,
            # Its own session, so that a timeout stops exactly this tree.
            start_new_session=True,
        )
        root = psutil.Process(process.pid)
        samples = []
        while process.poll() is None:
            if time.time() - launched > timeout:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                break
            # Reading a process's memory (PSS, USS) makes the kernel walk its
            # page tables: about 0.1 s of CPU per look at a 2-rank job. That
            # time is taken from the ranks, so memory is read in every epoch
            # but the timed one; CPU times cost microseconds.
            read_records(metrics, records)
            timed = epochs_done(records) == EPOCHS - 1
            samples.append(sample_tree(root, root_role, memory=not timed))
            time.sleep(interval)
        read_records(metrics, records)
        stderr.seek(0)
        tail = stderr.read().decode(errors="replace").splitlines()[-15:]
    epochs = [record for record in records if "train_time" in record]
    return epochs, samples, launched, process.returncode, tail


def read_records(path, records):
    """Appends the records written to `path` since the last call, each with
    the time it was seen (`arrived`)."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return
    now = time.time()
    for line in lines[len(records):]:
        records.append(dict(json.loads(line), arrived=now))


def epochs_done(records):
    return sum(1 for record in records if "train_time" in record)


def sample_tree(root, root_role, memory=True):
    """One look at the tree: total CPU times and, if `memory`, PSS/USS per
    process with its role (launcher, rank or worker)."""
    procs = [] if memory else None
    sample = {"t": time.time(), "user": 0.0, "system": 0.0, "procs": procs}
    try:
        processes = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return sample
    for process in processes:
        try:
            cpu = process.cpu_times()
            if memory:
                info = process.memory_full_info()
                procs.append({
                    "pid": process.pid,
                    "role": process_role(root, process, root_role),
                    "pss": info.pss,
                    "uss": info.uss,
                })
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        sample["user"] += cpu.user
        sample["system"] += cpu.system
    return sample


def process_role(root, process, root_role):
    """A process of the measured tree: the root is `root_role` ("rank" for
    the bare loop, which trains in the root itself, else "launcher"); a
    rank is titled "[rank N] ..." (gbrun.launch.run_rank titles every rank:
    the launcher's fork from multiprocessing's fork server, torchrun's are
    its children), unlike its parent (a worker forked from a rank inherits
    the title); the root's other children are helpers (the fork server,
    the resource tracker); anything else is a data loader worker."""
    if process.pid == root.pid:
        return root_role
    if titled_rank(process) and not titled_rank(process.parent()):
        return "rank"
    if process.ppid() == root.pid:
        return "helper"
    return "worker"


def titled_rank(process):
    return process is not None and " ".join(process.cmdline()).startswith("[rank ")


def cpu_at(samples, moment):
    """Tree CPU times (user, system) at `moment`, linearly interpolated."""
    for before, after in zip(samples, samples[1:]):
        if before["t"] <= moment <= after["t"]:
            share = (moment - before["t"]) / max(after["t"] - before["t"], 1e-9)
            return tuple(
                before[k] + share * (after[k] - before[k]) for k in ("user", "system")
            )
    return None


def training_window(epoch):
    """When an epoch's training loop ran: it began `epoch_time` seconds
    before the epoch's record arrived and lasted `train_time`."""
    start = epoch["arrived"] - epoch["epoch_time"]
    return start, start + epoch["train_time"]


def summarize(epochs, samples, launched, ranks, batch_size):
    """The table's numbers from the Epoch lines and the samples."""
    first, last = epochs[0], epochs[-1]
    warm_start, warm_end = training_window(first)
    train_start, train_end = training_window(last)
    seeds = last["seeds_per_second"] * last["train_time"]
    batches = max(1, round(seeds / (ranks * batch_size)))
    result = {
        "seeds_per_s": last["seeds_per_second"],
        "batches_per_rank": batches,
        "s_per_batch": last["train_time"] / batches,
        "wait_per_batch": last["data_wait"] / batches,
        "compute_per_batch": (last["train_time"] - last["data_wait"]) / batches,
        "startup_s": warm_start - launched,
        # The link task's validation MRR after the last epoch.
        "val_mrr": last.get("val_mrr"),
    }
    cpu_start, cpu_end = cpu_at(samples, train_start), cpu_at(samples, train_end)
    if cpu_start and cpu_end:
        result["user_s"] = cpu_end[0] - cpu_start[0]
        result["sys_s"] = cpu_end[1] - cpu_start[1]
        result["sys_per_user"] = result["sys_s"] / max(result["user_s"], 1e-9)
    looked = [s for s in samples if s["procs"] is not None]
    tree = [(s["t"], sum(p["pss"] for p in s["procs"])) for s in looked]
    if tree:
        result["tree_pss_peak_mib"] = max(pss for _, pss in tree) / 2**20
    # Memory is not read in the timed epoch; the warm-up epoch trains as many
    # batches of the same size.
    training = [pss for t, pss in tree if warm_start <= t <= warm_end]
    if training:
        result["tree_pss_train_mib"] = max(training) / 2**20
    for role in ("rank", "launcher", "worker"):
        uss = [p["uss"] for s in looked for p in s["procs"] if p["role"] == role]
        result[f"{role}_uss_peak_mib"] = max(uss) / 2**20 if uss else None
    return result


# ---------------------------------------------------------------- reporting
COLUMNS = [  # (title, width, format, key)
    ("run", 28, "", "name"),
    ("seeds/s", 8, ".0f", "seeds_per_s"),
    ("worst", 6, ".0f", "worst_seeds_per_s"),
    ("x bare", 6, ".2f", "vs_bare"),
    ("x cores", 7, ".2f", "vs_bare_cores"),
    ("x 1rank", 7, ".2f", "vs_one_rank"),
    ("x fp32", 6, ".2f", "vs_fp32"),
    ("x torch", 7, ".2f", "vs_torch_dropout"),
    ("s/batch", 7, ".3f", "s_per_batch"),
    ("wait", 6, ".3f", "wait_per_batch"),
    ("compute", 7, ".3f", "compute_per_batch"),
    ("user s", 6, ".1f", "user_s"),
    ("sys s", 6, ".1f", "sys_s"),
    ("sys/usr", 7, ".0%", "sys_per_user"),
    ("tree MiB", 8, ".0f", "tree_pss_train_mib"),
    ("peak MiB", 8, ".0f", "tree_pss_peak_mib"),
    ("rank USS", 8, ".0f", "rank_uss_peak_mib"),
    ("launcher", 8, ".0f", "launcher_uss_peak_mib"),
    ("start s", 7, ".1f", "startup_s"),
    ("load", 5, ".2f", "load_before"),
]


def print_rows(columns, records):
    """A line of titles, then a line per record: the first column aligned
    left, the others right, "-" for a figure the record lacks."""
    def line(cells):
        first, *rest = cells
        return "  ".join([f"{first:<{columns[0][1]}}"] + [
            f"{cell:>{width}}" for cell, (_, width, _, _) in zip(rest, columns[1:])
        ])

    print(line([title for title, _, _, _ in columns]))
    for record in records:
        cells = []
        for _, _, spec, key in columns:
            value = record.get(key)
            if isinstance(value, list):  # a fanout
                value = ",".join(map(str, value))
            cells.append("-" if value is None else format(value, spec))
        print(line(cells), flush=True)


STAGE_COLUMNS = [  # (title, width, format, key)
    ("fanout", 12, "", "fanout"),
    ("precision", 9, "", "precision"),
    ("dropout", 7, "", "dropout"),
    ("input nodes", 11, ",.0f", "input_nodes"),
    ("sample", 7, ".3f", "sample_s"),
    ("fetch gb", 8, ".3f", "fetch_graphbolt_s"),
    ("fetch", 6, ".3f", "fetch_s"),
    ("compute", 7, ".3f", "compute_s"),
    ("worst", 6, ".3f", "worst_compute_s"),
]


def print_stages(stages):
    print("stages of one rank, 1 thread, s per batch (median); fetch gb: "
          "GraphBolt's CPU read as it comes, fetch: the example's")
    print_rows(STAGE_COLUMNS, stages)


LINK_COLUMNS = [  # (title, width, format, key)
    ("run", 22, "", "name"),
    ("pairs/s", 7, ".0f", "median_seeds_per_s"),
    ("min", 6, ".0f", "worst_seeds_per_s"),
    ("max", 6, ".0f", "seeds_per_s"),
    ("x upstream", 10, ".2f", "vs_upstream"),
    ("MRR", 6, ".4f", "median_val_mrr"),
    ("MRR range", 13, "", "val_mrr_range"),
    ("s/batch", 7, ".3f", "median_s_per_batch"),
    ("wait", 6, ".3f", "median_wait_per_batch"),
    ("compute", 7, ".3f", "median_compute_per_batch"),
    ("load", 5, ".2f", "median_load_before"),
]
MEDIANS = ("seeds_per_s", "val_mrr", "s_per_batch", "wait_per_batch",
           "compute_per_batch", "load_before")


def median(values):
    values = sorted(values)
    middle = len(values) // 2
    return (values[middle] if len(values) % 2
            else (values[middle - 1] + values[middle]) / 2)


def link_rows(runs, repeats):
    """The link task's table, a record per configuration: medians over the
    rounds (MEDIANS) beside the fastest and slowest, and x upstream, the
    median over rounds of its positive pairs/s against the upstream loop's
    in the same round (the two ran one after the other)."""
    upstream = next((results for run, results in zip(runs, repeats)
                     if run.ranks is None), None)
    records = []
    for run, results in zip(runs, repeats):
        record = best_of(results)
        measured = [r for r in results if "seeds_per_s" in r]
        for key in MEDIANS:
            values = [r[key] for r in measured if r.get(key) is not None]
            if values:
                record[f"median_{key}"] = median(values)
        mrr = [r["val_mrr"] for r in measured if r.get("val_mrr") is not None]
        if mrr:
            record["val_mrr_all"] = mrr
            record["val_mrr_range"] = f"{min(mrr):.4f}-{max(mrr):.4f}"
        if upstream is not None and run.ranks is not None:
            ratios = [mine["seeds_per_s"] / theirs["seeds_per_s"]
                      for mine, theirs in zip(results, upstream)
                      if "seeds_per_s" in mine and "seeds_per_s" in theirs]
            if ratios:
                record["vs_upstream_all"] = ratios
                record["vs_upstream"] = median(ratios)
        records.append(record)
    return records


def print_link(records):
    print("positive pairs/s of all ranks (median of the rounds, min, max); "
          "MRR: validation, after the same epochs")
    print_rows(LINK_COLUMNS, records)


def add_ratios(runs):
    """x bare: against the bare loop (default allocator) with as many threads
    per process; x cores: against it on as many threads in all; x 1rank:
    against one rank with the same threads and workers; x fp32: against the
    same run in fp32; x torch: against the same run with torch's dropout."""
    bare = {
        (r["threads"], r["precision"]): r
        for r in runs
        if r["name"].startswith("bare ") and "+tuned" not in r["name"]
    }
    one_rank = {
        (r["threads"], r["workers"], r["precision"], r["dropout"]): r
        for r in runs
        if r.get("ranks") == 1 and "seeds_per_s" in r
    }
    # The same run in fp32: what the same name has without " bf16".
    fp32 = {r["name"]: r for r in runs if r["precision"] == "fp32"}
    by_name = {r["name"]: r for r in runs}
    for run in runs:
        if "seeds_per_s" not in run:
            continue
        base = bare.get((run["threads"], run["precision"]))
        if base and "seeds_per_s" in base and base is not run:
            run["vs_bare"] = run["seeds_per_s"] / base["seeds_per_s"]
        # The same cores: ranks x threads against one bare process with as
        # many threads in all.
        cores = bare.get(((run.get("ranks") or 1) * run["threads"],
                          run["precision"]))
        if cores and "seeds_per_s" in cores and cores is not run:
            run["vs_bare_cores"] = run["seeds_per_s"] / cores["seeds_per_s"]
        if run.get("ranks"):
            key = (run["threads"], run["workers"], run["precision"],
                   run["dropout"])
            single = one_rank.get(key)
            if single and single is not run:
                run["vs_one_rank"] = run["seeds_per_s"] / single["seeds_per_s"]
        same = fp32.get(run["name"].replace(f" {run['precision']}", ""))
        if same and same is not run and "seeds_per_s" in same:
            run["vs_fp32"] = run["seeds_per_s"] / same["seeds_per_s"]
        torch_dropout = by_name.get(run["name"] + TORCH_DROPOUT)
        if torch_dropout and "seeds_per_s" in torch_dropout:
            run["vs_torch_dropout"] = (run["seeds_per_s"]
                                       / torch_dropout["seeds_per_s"])


def wait_for_load(threshold, deadline):
    """Other people's jobs skew CPU timings: wait for a quieter machine (the
    previous run's own load fades within a minute or two)."""
    while os.getloadavg()[0] >= threshold and time.time() < deadline:
        time.sleep(5)


# --------------------------------------------------------------------- main
def count_list(text):
    """Comma-separated counts, each at least 1: 1,2."""
    return [int_at_least(1)(part) for part in text.split(",")]


def worker_list(text):
    return [int_at_least(0)(part) for part in text.split(",")]


def dropout_list(text):
    values = text.split(",")
    if not values or any(v not in ("fused", "torch") for v in values):
        raise argparse.ArgumentTypeError(
            f"'{text}': fused, torch or fused,torch")
    return values


def precision_list(text):
    values = text.split(",")
    if not values or any(v not in ("fp32", "bf16") for v in values):
        raise argparse.ArgumentTypeError(f"'{text}': fp32, bf16 or fp32,bf16")
    return values


def name_value(text):
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"'{text}': expected NAME=VALUE")
    return text


def model_layers(example, task):
    """The layers of the example's model: one fanout value each. Imports
    torch and DGL (seconds), so it comes after every cheap check."""
    import gbrun.cli

    if task == "link":  # create_model(in_size): no classes
        return len(gbrun.cli.load_example(
            example, ("TASK", "create_model")).create_model(1).layers)
    return len(gbrun.cli.load_example(example).create_model(1, 2).layers)


# What --task changes: the example, the baseline, and the defaults that
# reproduce the figures of docs/performance.md for that task.
TASK_DEFAULTS = {
    "node": {"example": SHIPPED_EXAMPLE, "ranks": [1, 2], "threads": [1, 2],
             "batches": 20, "batch_size": 1024},
    "link": {"example": LINK_EXAMPLE, "ranks": [2], "threads": [1],
             "batches": 100, "batch_size": 512},
}


def parse_args(argv=None):
    parser = ArgumentParser(
        description="Throughput, CPU and memory of node_classification.py "
        "(or link_prediction.py) against a bare GraphBolt loop."
    )
    parser.add_argument("--dataset", required=True, help="OnDiskDataset directory.")
    parser.add_argument(
        "--task", choices=["node", "link"], default="node",
        help="node: node_classification.py against bare_loop.py; link:"
        " link_prediction.py against upstream's link-prediction step in one"
        " process (bare_link_loop.py), positive pairs/s and MRR, median of"
        " the rounds. Default: node",
    )
    parser.add_argument(
        "--ranks", type=count_list, default=None,
        help="Rank counts. Default: 1,2 (--task link: 2, one value only)")
    parser.add_argument(
        "--threads", type=count_list, default=None,
        help="Threads per rank (and for the bare loop; upstream's link loop"
        " takes torch's default). Default: 1,2 (--task link: 1)",
    )
    parser.add_argument(
        "--num-workers", type=worker_list, default=[0],
        help="Data loader worker processes per rank. Default: 0",
    )
    parser.add_argument(
        "--batches", type=int_at_least(1), default=None,
        help="Batches per rank per epoch (and per evaluation). Default: 20"
        " (--task link: 100; the upstream loop steps ranks x as many)",
    )
    parser.add_argument(
        "--precision", type=precision_list, default=["fp32"],
        help="Precisions to compare, fp32 and/or bf16 (the example's"
        " --precision). Default: fp32",
    )
    parser.add_argument(
        "--dropout", type=dropout_list, default=["fused"],
        help="The example's dropout to compare: fused (--fused-dropout)"
        " and/or torch (--no-fused-dropout), for the example's runs and the"
        " stage split. Default: fused",
    )
    parser.add_argument("--batch-size", type=int_at_least(1), default=None,
                        help="Default: 1024 (--task link: 512 pairs)")
    parser.add_argument("--fanout", type=fanout_list, default=[10, 10, 10])
    parser.add_argument("--neg-ratio", type=int_at_least(1), default=1,
                        help="--task link: negatives per positive pair.")
    parser.add_argument(
        "--example", type=python_file, default=None,
        help="The example to measure (its model is the bare loop's too). "
        "Default: node_classification.py (--task link: link_prediction.py)",
    )
    parser.add_argument(
        "--launcher", choices=["spawn", "torchrun"], default="spawn",
        help="Start the ranks with the example's mp.spawn (--gpu 0,1,..) or"
        " with torchrun --nproc-per-node. Default: spawn",
    )
    parser.add_argument(
        "--no-bare", action="store_true", help="Skip the bare-loop baselines."
    )
    parser.add_argument(
        "--env", type=name_value, action="append", default=[],
        metavar="NAME=VALUE",
        help="Extra environment for the example's runs (not the baselines),"
        " e.g. MALLOC_ARENA_MAX=1. Repeatable.",
    )
    parser.add_argument("--interval", type=positive_float, default=0.25,
                        help="Seconds between samples of the process tree.")
    parser.add_argument("--timeout", type=positive_float, default=1800,
                        help="Seconds before a run is killed.")
    parser.add_argument(
        "--repeat", type=int_at_least(1), default=1,
        help="Run every configuration this many times (round-robin) and"
        " report the fastest; on a shared machine use 3 or more. Default: 1",
    )
    parser.add_argument(
        "--wait-for-load", type=positive_float, default=None, metavar="LOAD",
        help="On a shared machine: before each run, wait (at most 10 min)"
        " until the 1-minute load average is below LOAD.",
    )
    parser.add_argument(
        "--stages", type=fanout_list, action="append", default=None,
        metavar="FANOUT",
        help="Also split one rank's time per batch into sampling, feature"
        " fetching and compute (1 thread), at this fanout, e.g. 10,10,10,"
        " for each --precision; repeat for several fanouts.",
    )
    parser.add_argument(
        "--no-runs", action="store_true",
        help="Only the --stages split: no bare loops or example runs.",
    )
    parser.add_argument("--json", help="Also write every figure to this file.")
    args = parser.parse_args(argv)
    for name, value in TASK_DEFAULTS[args.task].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.no_runs and not args.stages:
        parser.error("--no-runs needs --stages")
    if args.task == "link" and args.stages:
        parser.error("--stages splits node_classification.py's step only")
    if args.task == "link" and len(args.ranks) > 1:
        # The upstream loop trains as many pairs as the ranks together.
        parser.error(f"--ranks '{','.join(map(str, args.ranks))}': --task"
                     " link compares one rank count with upstream's loop")
    if not os.path.isfile(os.path.join(args.dataset, "metadata.yaml")):
        parser.error(f"--dataset '{args.dataset}' has no metadata.yaml")
    args.dataset = os.path.abspath(args.dataset)
    # Last: the example's model takes importing torch and DGL (seconds).
    num_layers = model_layers(args.example, args.task)
    for fanout in [args.fanout] + (args.stages or []):
        if len(fanout) != num_layers:
            parser.error(
                f"--fanout '{','.join(map(str, fanout))}' needs {num_layers}"
                " values, one per layer of the example's model"
            )
    return args


def plan_runs(args, log_root):
    """A Run per configuration, each writing its metrics to a directory of
    its own under `log_root`."""
    runs = []

    def log_dir():
        return os.path.join(log_root, str(len(runs)))

    if args.task == "link" and not args.no_bare:
        # torch's default threads (threads None), as upstream sets none.
        runs.append(Run("upstream loop 1p", bare_link_command(args, log_dir()),
                        threads=None, log_dir=log_dir()))
    elif not args.no_bare:
        for precision, threads, tuned in itertools.product(
            args.precision, args.threads, (False, True)
        ):
            name = f"bare {threads}t" + ("+tuned" if tuned else "")
            name += "" if precision == "fp32" else f" {precision}"
            runs.append(Run(name, bare_command(args, threads, tuned, precision,
                                               log_dir()),
                            threads=threads, precision=precision,
                            dropout="fused" if tuned else "torch",
                            log_dir=log_dir()))
    extra = dict(item.split("=", 1) for item in args.env)
    for precision, ranks, threads, workers, dropout in itertools.product(
        args.precision, args.ranks, args.threads, args.num_workers,
        args.dropout,
    ):
        name = f"script {ranks}r x {threads}t" + (f" w{workers}" if workers else "")
        name += "" if precision == "fp32" else f" {precision}"
        name += TORCH_DROPOUT if dropout == "torch" else ""
        if args.launcher == "torchrun":
            name = name.replace("script", "torchrun")
        runs.append(Run(name, script_command(args, ranks, threads, workers,
                                             precision, dropout, log_dir()),
                        ranks, threads, workers, precision, dropout, extra,
                        log_dir()))
    return runs


def run_once(args, run):
    """One measured run: a record of its settings and figures."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if run.threads is not None:  # else torch's default, as upstream's
        env["OMP_NUM_THREADS"] = str(run.threads)
    env.update(run.env)
    if args.wait_for_load is not None:
        wait_for_load(args.wait_for_load, deadline=time.time() + 600)
    root_role = "launcher" if run.ranks else "rank"
    shutil.rmtree(run.log_dir, ignore_errors=True)  # a repetition's own
    load_before = os.getloadavg()[0]
    epochs, samples, launched, code, tail = measure(
        run.command, env, args.interval, args.timeout, root_role, run.log_dir
    )
    record = {
        "name": run.name,
        "ranks": run.ranks,
        "threads": run.threads,
        "workers": run.workers,
        "precision": run.precision,
        "dropout": run.dropout,
        "command": run.command,
        "env": run.env,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "exit_code": code,
    }
    if code == 0 and len(epochs) == EPOCHS and len(samples) > 2:
        record.update(summarize(epochs, samples, launched, run.ranks or 1,
                                args.batch_size))
    else:
        print(f"{run.name}: failed (exit code {code}); its last lines:",
              file=sys.stderr)
        print("\n".join(tail), file=sys.stderr)
    mrr = record.get("val_mrr")
    print(
        f"  {run.name}: {record.get('seeds_per_s', 0):.0f} seeds/s, "
        + ("" if mrr is None else f"MRR {mrr:.4f}, ")
        + f"load {load_before:.2f} -> {record['load_after']:.2f}",
        file=sys.stderr,
        flush=True,
    )
    return record


def best_of(repeats):
    """The repetition with the most seeds/s (interference from other jobs
    only ever slows a run down), with the range of all of them."""
    measured = [r for r in repeats if "seeds_per_s" in r]
    if not measured:
        return repeats[-1]
    best = dict(max(measured, key=lambda r: r["seeds_per_s"]))
    best["seeds_per_s_all"] = [r["seeds_per_s"] for r in measured]
    best["worst_seeds_per_s"] = min(best["seeds_per_s_all"])
    # Start-up is its own measurement: the quickest of all repetitions.
    best["startup_s_all"] = [r["startup_s"] for r in measured]
    best["startup_s"] = min(best["startup_s_all"])
    return best


def main(argv=None):
    args = parse_args(argv)
    print(
        f"{args.dataset}: batch {args.batch_size}, fanout "
        f"{','.join(map(str, args.fanout))}, {args.batches} batches per rank "
        f"per epoch, {args.repeat} round(s); {os.cpu_count()} cores; load "
        f"{os.getloadavg()[0]:.2f}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as log_root:
        runs = [] if args.no_runs else plan_runs(args, log_root)
        repeats = [[] for _ in runs]
        # Round-robin, so that a busy spell on the machine hits every
        # configuration rather than all repetitions of one.
        for _ in range(args.repeat):
            for run, results in zip(runs, repeats):
                results.append(run_once(args, run))
    all_runs = [r for results in repeats for r in results]
    if args.task == "link":
        records = link_rows(runs, repeats)
        print_link(records)
    else:
        records = [best_of(results) for results in repeats]
        add_ratios(records)
    if records and args.task == "node":
        print_rows(COLUMNS, records)
    stages = measure_stages(args) if args.stages else []
    if stages:
        print_stages(stages)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "dataset": args.dataset,
                    "batch_size": args.batch_size,
                    "fanout": args.fanout,
                    "batches": args.batches,
                    "repeat": args.repeat,
                    "cores": os.cpu_count(),
                    "runs": records,
                    "stages": stages,
                    "all_runs": all_runs,
                },
                f,
                indent=1,
            )
    if any(r["exit_code"] != 0 for r in all_runs + stages):
        sys.exit(1)


if __name__ == "__main__":
    main()
