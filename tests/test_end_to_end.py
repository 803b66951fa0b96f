"""node_classification.py run as users run it, on CPU ranks with gloo."""
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import yaml

from conftest import (
    NO_GPU,
    REPO,
    SCRIPT,
    epoch_lines,
    reported_test_accuracy,
    run_example,
)
from node_classification import free_port

CHANCE = 0.1  # the synthetic datasets here have 10 classes
FAST = ["--batch-size", 64, "--fanout", "5,5,5"]
CPU = ["--mode", "cpu-cpu"]  # CPU ranks on any machine, GPUs or not


def check_upstream_output(result, epochs):
    assert result.returncode == 0, result.stderr[-3000:]
    lines = epoch_lines(result.stdout)
    assert [int(line[0]) for line in lines] == list(range(epochs))
    for _, loss, acc, seconds, _ in lines:
        assert float(loss) >= 0 and 0 <= float(acc) <= 1 and float(seconds) > 0
    return reported_test_accuracy(result.stdout)


def test_two_cpu_ranks_learn_and_print_upstream_lines(small_dataset):
    # `auto` on a machine without CUDA (GPUs, if any, hidden).
    result = run_example(
        ["--gpu=0,1", "--dataset", small_dataset, "--epochs", 3, *FAST],
        env=NO_GPU,
    )
    accuracy = check_upstream_output(result, epochs=3)
    assert "CUDA is not available: using --mode cpu-cpu" in result.stdout
    assert "Training with 2 CPU processes." in result.stdout
    assert accuracy > CHANCE + 0.4, result.stdout


def test_validation_and_test_sets_smaller_than_one_batch_per_rank(synthetic):
    # 60 validation and 60 test nodes with batch 64 and two ranks: rank 1
    # receives no items at all (upstream crashes in torch.cat here).
    dataset = synthetic(
        "tiny_eval", "--num-nodes", 3000, "--feat-dim", 32,
        "--split", "0.6,0.02,0.02",
    )
    result = run_example(
        ["--gpu=0,1", "--mode", "cpu-cpu", "--dataset", dataset,
         "--epochs", 2, *FAST]
    )
    accuracy = check_upstream_output(result, epochs=2)
    # 60 test items: an exact accuracy is a multiple of 1/60.
    assert abs(accuracy * 60 - round(accuracy * 60)) < 0.01, accuracy


def test_torchrun_single_node(small_dataset):
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         "--nproc-per-node=2", SCRIPT, "--dataset", small_dataset,
         "--epochs", "2", *map(str, FAST + CPU)],
        capture_output=True, text=True, timeout=180, cwd=REPO,
    )
    accuracy = check_upstream_output(result, epochs=2)
    assert accuracy > CHANCE + 0.3, result.stdout


def test_torchrun_two_nodes_on_loopback(small_dataset):
    port = free_port()
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
             "--nproc-per-node=1", f"--node-rank={node}",
             "--master-addr=127.0.0.1", f"--master-port={port}",
             SCRIPT, "--dataset", small_dataset, "--epochs", "2",
             *map(str, FAST + CPU)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            cwd=REPO,
        )
        for node in (0, 1)
    ]
    outputs = [node.communicate(timeout=180) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[1][1][-3000:]
    result = subprocess.CompletedProcess([], 0, *outputs[0])
    accuracy = check_upstream_output(result, epochs=2)
    assert accuracy > CHANCE + 0.3
    # Only global rank 0 prints the results.
    assert epoch_lines(outputs[1][0]) == []


def test_an_exception_in_one_rank_fails_the_job(small_dataset, tmp_path):
    # Corrupt the labels of rank 1's share of the train set only (the
    # sampler gives rank 1 the items after the first 904 with batch 64),
    # so rank 0 is left waiting in DDP and has to be stopped.
    broken = str(tmp_path / "broken")
    shutil.copytree(small_dataset, broken, ignore=shutil.ignore_patterns(
        "preprocessed"))
    labels_path = os.path.join(broken, "train_labels.npy")
    labels = np.load(labels_path)
    labels[904:] = 99
    np.save(labels_path, labels)
    start = time.time()
    result = run_example(
        ["--gpu=0,1", "--dataset", broken, "--epochs", 3, *FAST, *CPU],
        timeout=90,
    )
    assert result.returncode != 0
    assert time.time() - start < 60
    # The cause is shown under the rank that raised it, whatever the
    # launcher reports first.
    cause = result.stderr.index("rank 1 failed:")
    assert "out of bounds" in result.stderr[cause:].split("rank 0 failed")[0]
    assert "error: training failed" in result.stderr


def test_a_killed_rank_fails_the_job_promptly(small_dataset):
    job = subprocess.Popen(
        [sys.executable, SCRIPT, "--gpu=0,1", "--dataset", small_dataset,
         "--epochs", "200", *map(str, FAST + CPU)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        cwd=REPO,
    )
    try:
        for line in job.stdout:
            if line.startswith("Epoch 00000"):
                break
        ranks = [p for p in psutil.Process(job.pid).children(recursive=True)
                 if "spawn_main" in " ".join(p.cmdline())]
        assert len(ranks) == 2
        ranks[1].send_signal(signal.SIGKILL)
        killed_at = time.time()
        assert job.wait(timeout=60) != 0
        assert time.time() - killed_at < 30
        assert not any(rank.is_running() for rank in ranks)
    finally:
        job.kill()
        job.wait()


def test_mode_needing_cuda_fails_before_spawning_without_cuda(small_dataset):
    start = time.time()
    result = run_example(
        ["--gpu=0,1", "--mode", "pinned-cuda", "--dataset", small_dataset],
        timeout=60, env=NO_GPU,
    )
    assert result.returncode == 2
    assert "--mode pinned-cuda needs CUDA" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Training" not in result.stdout
    assert time.time() - start < 30


def rewrite_metadata(dataset, tmp_path, edit):
    copy = str(tmp_path / "edited")
    shutil.copytree(dataset, copy, ignore=shutil.ignore_patterns(
        "preprocessed"))
    path = os.path.join(copy, "metadata.yaml")
    with open(path) as f:
        metadata = yaml.safe_load(f)
    edit(metadata)
    with open(path, "w") as f:
        yaml.safe_dump(metadata, f)
    return copy


def drop_num_classes(metadata):
    del metadata["tasks"][0]["num_classes"]


def rename_feat(metadata):
    for feature in metadata["feature_data"]:
        if feature["name"] == "feat":
            feature["name"] = "features"


@pytest.mark.parametrize(
    "args,message",
    [
        (["--fanout", "10,10"], "'10,10' has 2 values, but the model has 3"),
        (["--fanout", "10,0,5"], "each fanout is positive"),
        (["--batch-size", "0"], "--batch-size: 0 is too small"),
        (["--epochs", "0"], "--epochs: 0 is too small"),
        (["--num-workers", "-1"], "--num-workers: -1 is too small"),
        (["--lr", "-0.1"], "--lr: -0.1 must be positive"),
        (["--gpu", "0,x"], "--gpu '0,x'"),
        (["--mode", "gpu"], "invalid choice: 'gpu'"),
        (["--mode", "cuda-cuda"], "--mode cuda-cuda needs CUDA"),
        (["--gpu-cache-size", "1024"], "--gpu-cache-size 1024 needs a CUDA"),
        (["--batch-size", "901", "--gpu=0,1"],
         "use --batch-size 900 or less"),
    ],
)
def test_bad_arguments(small_dataset, capsys, no_cuda, args, message):
    import node_classification

    with pytest.raises(SystemExit) as exit_info:
        node_classification.main(["--dataset", small_dataset, *args])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert message in error
    assert len(error.splitlines()) == 1


@pytest.mark.parametrize(
    "edit,message",
    [
        (drop_num_classes, "has no num_classes in metadata.yaml"),
        (rename_feat, "has no node feature named 'feat' (it has: features"),
    ],
)
def test_bad_datasets(small_dataset, tmp_path, capsys, edit, message):
    import node_classification

    dataset = rewrite_metadata(small_dataset, tmp_path, edit)
    with pytest.raises(SystemExit) as exit_info:
        node_classification.main(["--dataset", dataset])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_dataset_paths_that_are_not_datasets(tmp_path, capsys):
    import node_classification

    for dataset, message in [
        (str(tmp_path), "is a directory without metadata.yaml"),
        (str(tmp_path / "nowhere"), "is neither a builtin dataset"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            node_classification.main(["--dataset", dataset])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_builtin_download_failure_says_how_to_run_offline(tmp_path, capsys):
    import node_classification

    # This machine has no route to DGL's download server; on one that has,
    # the test would download Cora, so it is skipped there.
    with pytest.raises(SystemExit) as exit_info:
        node_classification.main(
            ["--dataset", "cora", "--data-root", str(tmp_path)]
        )
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "could not fetch dataset 'cora'" in error
    assert "scripts/make_synthetic_dataset.py" in error
