"""End-to-end checks of training on DGL's distributed engine.

A tiny synthetic dataset is partitioned for 2 machines; scripts/launch_local.py
then runs 2 simulated machines (a network and a mount namespace each) on this
host. The checks: the upstream output lines, accuracy against chance and against
node_classification.py, every train/val/test node used exactly once per epoch,
failures that end the job promptly with a non-zero exit, clear errors for bad
partition configs, and nothing left behind (namespaces, processes).

Runs that need namespaces are skipped without root and iproute2, except when
CI=true, where a missing prerequisite fails the test instead.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "scripts")
MAIN_SCRIPT = os.path.join(REPO, "node_classification.py")
LAUNCHER = os.path.join(SCRIPTS, "launch_local.py")
TRAINER = os.path.join(SCRIPTS, "dist_node_classification.py")

NUM_CLASSES = 4
# Small and quick, yet enough epochs that both scripts get near their
# ceiling, so their test accuracies can be compared within a few points.
TRAIN_ARGS = ["--batch-size", "128", "--fanout", "5,5,5", "--lr", "0.003"]
EPOCHS = 6
JOB_TIMEOUT_S = 90

FIRST_LINE = "Training with 2 trainers."
EPOCH_LINE = re.compile(
    r"^Epoch (\d{5}) \| Average Loss \d+\.\d{4} \| "
    r"Accuracy (\d\.\d{4}) \| Time \d+\.\d{4}$",
    re.MULTILINE,
)
TEST_LINE = re.compile(r"^Test Accuracy (\d\.\d{4})$", re.MULTILINE)


def missing_prerequisite():
    if os.geteuid() != 0:
        return "simulated machines need root (network and mount namespaces)"
    for tool in ("ip", "unshare", "nsenter", "setpriv"):
        if shutil.which(tool) is None:
            return f"simulated machines need {tool} (iproute2, util-linux)"
    return None


@pytest.fixture
def namespaces():
    """Skip (or, under CI=true, fail) when namespaces cannot be made."""
    reason = missing_prerequisite()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but {reason}")
        pytest.skip(reason)


def run_script(script, args, timeout=120):
    return subprocess.run(
        [sys.executable, script, *map(str, args)],
        capture_output=True, text=True, timeout=timeout, cwd=REPO,
    )


@pytest.fixture(scope="module")
def partitions(tmp_path_factory):
    """A 2,000-node synthetic dataset and its 2 partitions (both formats)."""
    root = tmp_path_factory.mktemp("dist")
    dataset = root / "synthetic"
    made = run_script(
        os.path.join(SCRIPTS, "make_synthetic_dataset.py"),
        [dataset, "--num-nodes", 2000, "--avg-degree", 10, "--feat-dim", 16,
         "--num-classes", NUM_CLASSES, "--seed", 0],
    )
    assert made.returncode == 0, made.stderr
    out = root / "parts"
    done = run_script(
        os.path.join(SCRIPTS, "partition_graph.py"),
        ["--dataset", dataset, "--num-parts", 2, "--out", out,
         "--balance-train", "--balance-edges", "--use-graphbolt"],
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return {"dataset": str(dataset), "out": str(out),
            "part_config": str(out / "synthetic.json")}


def leftovers(run_id):
    """Processes of launcher run_id that still exist (its namespaces have no
    names and live only as long as its processes)."""
    marker = f"DGLSIM_RUN={run_id}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            pass
    return found


def start_launcher(part_config, num_machines, trainer_args, log_dir, timeout):
    stdout = open(log_dir / "stdout.txt", "w")
    stderr = open(log_dir / "stderr.txt", "w")
    proc = subprocess.Popen(
        [sys.executable, LAUNCHER, "--part-config", part_config,
         "--num-machines", str(num_machines), "--timeout", str(timeout),
         "--", *map(str, trainer_args)],
        stdout=stdout, stderr=stderr, cwd=REPO,
    )
    stdout.close()
    stderr.close()
    return proc


def finish(proc, log_dir, timeout):
    """Wait (bounded) for the launcher; check it left nothing behind."""
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"launcher still running after {timeout} s")
    left = leftovers(proc.pid)
    assert left == [], f"processes left behind: {left}"
    return (code, (log_dir / "stdout.txt").read_text(),
            (log_dir / "stderr.txt").read_text())


def launch(part_config, trainer_args, log_dir, num_machines=2):
    proc = start_launcher(part_config, num_machines, trainer_args, log_dir, JOB_TIMEOUT_S)
    return finish(proc, log_dir, JOB_TIMEOUT_S + 30)


def wait_for_output(log_dir, pattern, proc, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if re.search(pattern, (log_dir / "stdout.txt").read_text(), re.MULTILINE):
            return
        time.sleep(0.2)
    pytest.fail(f"no line matching {pattern!r} within {timeout} s")


def child_pids(parent, env_key, env_value):
    """Children of parent whose environment has env_key=env_value."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and f"{env_key}={env_value}".encode() in env:
            found.append(int(pid))
    return found


def original_ids(part_out, seed_files):
    """Dataset ids of the seeds saved by --dump-seeds, sorted."""
    orig_nids = torch.load(os.path.join(part_out, "orig_nids.pt"))
    seeds = torch.cat([torch.load(path) for path in seed_files]).long()
    return orig_nids[seeds].sort().values


def dataset_ids(dataset, split):
    """Sorted node ids of one split, read the way the example reads them."""
    import dgl.graphbolt as gb

    task = gb.OnDiskDataset(dataset).load().tasks[0]
    item_set = {"train": task.train_set, "val": task.validation_set,
                "test": task.test_set}[split]
    return item_set[:][0].long().sort().values


@pytest.fixture(scope="module")
def two_machine_run(partitions, tmp_path_factory):
    """One training job on 2 simulated machines, shared by several checks."""
    if missing_prerequisite() is not None:
        return None
    log_dir = tmp_path_factory.mktemp("two_machines")
    dump = log_dir / "seeds"
    code, out, err = launch(
        partitions["part_config"],
        [*TRAIN_ARGS, "--epochs", EPOCHS, "--dump-seeds", dump],
        log_dir,
    )
    return {"code": code, "stdout": out, "stderr": err, "dump": dump}


# --- Partitioning --------------------------------------------------------------


def test_partition_outputs(partitions):
    with open(partitions["part_config"]) as f:
        config = json.load(f)
    assert config["num_parts"] == 2
    assert "part_graph_graphbolt" in config["part-1"]
    with open(os.path.join(partitions["out"], "dataset_info.json")) as f:
        assert json.load(f)["num_classes"] == NUM_CLASSES
    orig_nids = torch.load(os.path.join(partitions["out"], "orig_nids.pt"))
    assert torch.equal(orig_nids.sort().values, torch.arange(2000))


@pytest.mark.parametrize("make_bad, message", [
    (lambda tmp: tmp / "absent", "is neither a builtin dataset"),
    (lambda tmp: tmp, "is a directory without metadata.yaml"),
], ids=["missing directory", "no metadata.yaml"])
def test_partition_rejects_bad_dataset(tmp_path, make_bad, message):
    bad = make_bad(tmp_path)
    done = run_script(
        os.path.join(SCRIPTS, "partition_graph.py"),
        ["--dataset", bad, "--num-parts", 2, "--out", tmp_path / "out"],
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("partition_graph.py: error: ")
    assert message in lines[0] and str(bad) in lines[0]


# --- Bad partition configs: caught before anything starts ------------------------


def test_launcher_rejects_missing_part_config(tmp_path):
    done = run_script(LAUNCHER, ["--part-config", tmp_path / "none.json",
                                 "--num-machines", 2, "--", "--epochs", 1])
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"launch_local.py: error: --part-config {tmp_path / 'none.json'} "
        "does not exist")


def test_launcher_rejects_mismatched_part_config(partitions):
    done = run_script(LAUNCHER, ["--part-config", partitions["part_config"],
                                 "--num-machines", 3, "--", "--epochs", 1])
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"launch_local.py: error: --part-config {partitions['part_config']} "
        "has 2 partitions "
        f"but --num-machines is 3"
    )


def test_trainer_rejects_mismatched_ip_config(partitions, tmp_path):
    # What a user of DGL's tools/launch.py sees with the wrong ip_config.
    ip_config = tmp_path / "ip_config.txt"
    ip_config.write_text("10.0.0.1\n10.0.0.2\n10.0.0.3\n")
    done = run_script(TRAINER, ["--ip-config", ip_config,
                                "--part-config", partitions["part_config"]])
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"dist_node_classification.py: error: --part-config has 2 partitions "
        f"but --ip-config {ip_config} "
        f"lists 3 machines"
    )


# --- Training on 2 simulated machines ----------------------------------------------


def test_two_machines_print_upstream_lines(namespaces, two_machine_run):
    assert two_machine_run["code"] == 0, two_machine_run["stderr"][-3000:]
    out = two_machine_run["stdout"]
    lines = [line for line in out.splitlines()
             if line.startswith(("Training with", "Epoch", "Test Accuracy"))]
    assert lines[0] == FIRST_LINE
    assert [int(e) for e, _ in EPOCH_LINE.findall(out)] == list(range(EPOCHS))
    assert len(lines) == 1 + EPOCHS + 1 and TEST_LINE.search(lines[-1])


def test_two_machines_learn(namespaces, two_machine_run):
    accuracy = float(TEST_LINE.search(two_machine_run["stdout"]).group(1))
    assert accuracy > 2.5 / NUM_CLASSES, "barely above chance"


def test_every_node_used_once_per_epoch(namespaces, two_machine_run, partitions):
    dump = two_machine_run["dump"]
    for name in ("train", "val"):
        expected = dataset_ids(partitions["dataset"], name)
        for epoch in range(EPOCHS):
            files = sorted(dump.glob(f"{name}_e{epoch}_r*.pt"))
            assert len(files) == 2, files
            assert torch.equal(original_ids(partitions["out"], files), expected), (name, epoch)
    files = sorted(dump.glob("test_r*.pt"))
    assert torch.equal(original_ids(partitions["out"], files),
                       dataset_ids(partitions["dataset"], "test"))


@pytest.mark.skipif(not os.path.exists(MAIN_SCRIPT), reason="node_classification.py not there yet")
def test_accuracy_matches_single_machine_example(namespaces, two_machine_run, partitions):
    single = run_script(
        MAIN_SCRIPT,
        ["--gpu=0,1", "--mode", "cpu-cpu", "--epochs", EPOCHS,
         "--dataset", partitions["dataset"], *TRAIN_ARGS],
        timeout=JOB_TIMEOUT_S,
    )
    assert single.returncode == 0, single.stderr[-3000:]
    expected = float(TEST_LINE.search(single.stdout).group(1))
    got = float(TEST_LINE.search(two_machine_run["stdout"]).group(1))
    assert abs(got - expected) <= 0.05, (got, expected)


def test_graphbolt_sampling_on_servers(namespaces, partitions, tmp_path):
    code, out, err = launch(
        partitions["part_config"],
        [*TRAIN_ARGS, "--epochs", 2, "--use-graphbolt"],
        tmp_path,
    )
    assert code == 0, err[-3000:]
    assert len(EPOCH_LINE.findall(out)) == 2
    assert float(TEST_LINE.search(out).group(1)) > 1.5 / NUM_CLASSES


# --- Failures end the job, promptly and cleanly ---------------------------------


def test_failing_trainer_fails_the_job(namespaces, partitions, tmp_path):
    code, _, err = launch(
        partitions["part_config"],
        [*TRAIN_ARGS, "--epochs", 2, "--fail-after-batches", 1, "--fail-rank", 1],
        tmp_path,
    )
    assert code != 0
    assert "RuntimeError: --fail-after-batches 1 on rank 1" in err
    # Rank 0 fails too once rank 1 is gone; either may be reported first.
    assert re.search(r"^error: machine \d trainer 0 \(rank \d\) exited with code 1; "
                     r"stopping the job$", err, re.MULTILINE), err[-2000:]


@pytest.mark.parametrize("how", ["kill a server", "interrupt the launcher"])
def test_killed_job_fails_and_cleans_up(namespaces, partitions, tmp_path, how):
    proc = start_launcher(partitions["part_config"], 2,
                          [*TRAIN_ARGS, "--epochs", 1000], tmp_path, JOB_TIMEOUT_S)
    wait_for_output(tmp_path, r"^Epoch 00000", proc, timeout=60)
    if how == "kill a server":
        servers = child_pids(proc.pid, "DGL_ROLE", "server")
        assert len(servers) == 2, servers
        os.kill(servers[1], signal.SIGKILL)
    else:
        proc.send_signal(signal.SIGINT)
    started = time.monotonic()
    code, _, err = finish(proc, tmp_path, timeout=30)
    assert code != 0
    assert time.monotonic() - started < 20
    if how == "kill a server":
        assert "error: machine 1 server 0 exited with code -9" in err
