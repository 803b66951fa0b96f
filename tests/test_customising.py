"""docs/customising.md's four edits, each applied with `git apply` to a copy
of node_classification.py in a directory outside the checkout, and run end
to end there. A change to the example that breaks a diff fails here."""
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess

import pytest
import torch
import yaml

import gbrun
from conftest import (
    NO_GPU,
    REPO,
    SCRIPT,
    epoch_lines,
    reported_test_accuracy,
    run_example,
    run_examples,
)

DOC = os.path.join(REPO, "docs", "customising.md")
EDITS = ["gat", "cosine", "macro_f1", "keys"]  # the doc's diffs, in order
FAST = ["--gpu=0,1", "--batch-size", 64]


def doc_diffs():
    blocks = re.findall(r"```diff\n(.*?)```", open(DOC).read(), re.S)
    assert len(blocks) == len(EDITS), f"{len(blocks)} diff blocks in {DOC}"
    return dict(zip(EDITS, blocks))


def edited_copy(tmp_path, edit):
    """A directory outside the checkout holding node_classification.py with
    the doc's `edit` applied; returns the copy's path."""
    where = tmp_path / edit
    where.mkdir()
    shutil.copy(SCRIPT, where)
    (where / "edit.diff").write_text(doc_diffs()[edit])
    applied = subprocess.run(["git", "apply", "edit.diff"], cwd=where,
                             capture_output=True, text=True, timeout=60)
    assert applied.returncode == 0, (
        f"docs/customising.md's {edit} diff no longer applies to "
        f"node_classification.py:\n{applied.stderr}")
    return str(where / "node_classification.py")


def load(path, name):
    """The copy as a module of this process, for in-process refusals."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def refusal(module, capsys, *argv):
    with pytest.raises(SystemExit) as exited:
        module.main(list(map(str, argv)))
    printed = capsys.readouterr()
    error = printed.err.strip()
    assert exited.value.code == 2, error
    assert len(error.splitlines()) == 1 and "Traceback" not in error, error
    # Nothing claims that training starts.
    assert "Training with" not in printed.out, printed.out
    return error


def test_every_diff_applies_to_the_example(tmp_path):
    for edit in EDITS:
        edited_copy(tmp_path, edit)


@pytest.mark.slow
def test_a_2_layer_gat_trains_and_refuses_3_fanouts_and_sage_checkpoints(
        tmp_path, small_dataset, reference_run, capsys, nothing_spawned):
    gat = edited_copy(tmp_path, "gat")
    trained = run_example([*FAST, "--epochs", 1, "--seed", 1, "--dataset",
                           small_dataset], env=NO_GPU, script=gat)
    assert trained.returncode == 0, trained.stderr[-3000:]
    # Measured 0.87 after one epoch (seed 1); chance is 0.1.
    assert reported_test_accuracy(trained.stdout) > 0.6, trained.stdout

    module = load(gat, "gat_example")
    error = refusal(module, capsys, "--dataset", small_dataset,
                    "--fanout", "5,5,5")
    assert error.endswith("--fanout 5,5,5: 3 values, but the model has 2 "
                          "layers (one value per layer; default 10,10)")
    # The reference run's checkpoint is of the 3-layer SAGE.
    _, out = reference_run
    ckpt = shutil.copytree(out / "ckpt", tmp_path / "sage_ckpt")
    error = refusal(module, capsys, "--dataset", small_dataset, "--epochs", 9,
                    "--checkpoint-dir", ckpt, "--resume")
    assert "was made with another model (repr: 'SAGE(' then, 'GAT(' now)" in (
        error), error


@pytest.mark.slow
def test_a_cosine_schedule_resumed_after_sigterm_is_exact(
        tmp_path, small_dataset):
    cosine = edited_copy(tmp_path, "cosine")
    common = [*FAST, "--fanout", "5,5,5", "--epochs", 3, "--seed", 2,
              "--max-batches", 6, "--dataset", small_dataset,
              "--checkpoint-dir", tmp_path / "c"]
    # 6 steps and one check after validation per epoch: the 10th check is
    # epoch 1's third step, and each step reads the previous step's check,
    # so training stops after the fourth. A third epoch shows a scheduler
    # that resumed from scratch (its lr would stay at epoch 1's). The
    # uninterrupted run goes side by side with the stopped one.
    uninterrupted, stopped = run_examples(
        (common[:-2], NO_GPU),
        (common, {**NO_GPU, "TEST_SIGTERM_AT_CHECK": "10"}), script=cosine)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    checkpoint = torch.load(tmp_path / "c" / gbrun.CHECKPOINT_FILE,
                            weights_only=True)
    assert (checkpoint["epoch"], checkpoint["step"]) == (1, 4)
    # The schedule's state is saved: epoch 1 runs at lr 0.00075.
    assert checkpoint["scheduler"]["last_epoch"] == 1
    lr = checkpoint["optimizer"]["param_groups"][0]["lr"]
    assert lr == pytest.approx(0.00075)
    resumed = run_example([*common, "--resume"], env=NO_GPU, script=cosine)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert ([line[:3] for line in epoch_lines(stopped.stdout + resumed.stdout)]
            == [line[:3] for line in epoch_lines(uninterrupted.stdout)])
    assert len(epoch_lines(uninterrupted.stdout)) == 3
    assert reported_test_accuracy(resumed.stdout) == (
        reported_test_accuracy(uninterrupted.stdout))


@pytest.mark.slow
def test_macro_f1_is_exact_over_ranks_one_without_items(
        tmp_path, synthetic, capsys):
    # 60 validation nodes and batch 64: rank 0 scores them all, rank 1 none.
    # 540 test nodes: both ranks score some, so their counts must be summed.
    dataset = synthetic("small_val", "--num-nodes", 3000, "--feat-dim", 32,
                        "--num-classes", 10, "--split", "0.8,0.02,0.18")
    f1 = edited_copy(tmp_path, "macro_f1")
    # All neighbors: evaluation then depends on the model alone.
    run = run_example(
        [*FAST, "--fanout", "-1,-1,-1", "--epochs", 1, "--seed", 4,
         "--dataset", dataset, "--checkpoint-dir", tmp_path / "c",
         "--log-dir", tmp_path / "logs"], env=NO_GPU, script=f1)
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"^Epoch 00000 \| .* \| Macro-F1 \d\.\d{4} \|",
                     run.stdout, re.M), run.stdout
    assert re.search(r"^Test Macro-F1 \d\.\d{4}$", run.stdout, re.M)
    records = [json.loads(line) for line in
               open(tmp_path / "logs" / gbrun.METRICS_FILE)]
    reported = [records[0]["val_macro-f1"], records[1]["test_macro-f1"]]

    # The same model over every validation node, in this one process.
    import dgl.graphbolt as gb
    import torchmetrics

    module = load(f1, "macro_f1_example")
    args = module.parse_args(["--dataset", dataset, "--fanout", "-1,-1,-1"])
    job = module.load_job(args, 1)
    model = module.create_model(job.in_size, job.num_classes)
    model.load_state_dict(torch.load(tmp_path / "c" / gbrun.MODEL_FILE,
                                     weights_only=True))
    model.eval()

    def macro_f1(item_set, size):
        datapipe = gb.ItemSampler(item_set, batch_size=1000)
        datapipe = datapipe.sample_neighbor(job.dataset.graph, job.fanout)
        datapipe = datapipe.fetch_feature(job.dataset.feature,
                                          node_feature_keys=["feat"])
        predictions, labels = [], []
        with torch.no_grad():
            for data in gb.DataLoader(datapipe):
                predictions.append(
                    model(data.blocks, data.node_features["feat"]))
                labels.append(data.labels)
        predictions, labels = torch.cat(predictions), torch.cat(labels)
        assert len(labels) == size
        # Not trivially exact: the model predicts several classes.
        assert len(predictions.argmax(1).unique()) > 3
        return torchmetrics.functional.f1_score(
            predictions, labels, task="multiclass", num_classes=10,
            average="macro").item()

    exact = [macro_f1(job.item_sets[1], 60), macro_f1(job.item_sets[2], 540)]
    assert reported == pytest.approx(exact, abs=1e-6)

    # The plot takes the metric's keys from the log (its command line runs
    # in test_run_outputs.py's test_plot_metrics_names_a_missing_log).
    import plot_metrics

    plot_metrics.main([str(tmp_path / "logs"), "--out", str(tmp_path / "f1.png")])
    assert (tmp_path / "f1.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_a_dataset_with_other_keys(tmp_path, small_dataset, capsys,
                                   nothing_spawned):
    # The input feature is "x", the labels are the node feature "y", and the
    # item sets hold seed nodes only.
    dataset = str(tmp_path / "xy")
    shutil.copytree(small_dataset, dataset,
                    ignore=shutil.ignore_patterns("preprocessed"))
    with open(os.path.join(dataset, "metadata.yaml")) as f:
        metadata = yaml.safe_load(f)
    renames = {"feat": "x", "label": "y"}
    for feature in metadata["feature_data"]:
        feature["name"] = renames[feature["name"]]
    for split in ("train_set", "validation_set", "test_set"):
        data = metadata["tasks"][0][split][0]["data"]
        data[:] = [d for d in data if d["name"] == "seed_nodes"]
    with open(os.path.join(dataset, "metadata.yaml"), "w") as f:
        yaml.safe_dump(metadata, f)

    keys = edited_copy(tmp_path, "keys")
    run = run_example([*FAST, "--fanout", "5,5,5", "--epochs", 2, "--seed", 1,
                       "--dataset", dataset], env=NO_GPU, script=keys)
    assert run.returncode == 0, run.stderr[-3000:]
    # The reference run reaches 0.90 in 3 epochs; chance is 0.1.
    assert reported_test_accuracy(run.stdout) > 0.7, run.stdout

    original = load(SCRIPT, "unchanged_example")
    error = refusal(original, capsys, "--dataset", dataset)
    assert "has no node feature named 'feat' (it has: x, y)" in error
