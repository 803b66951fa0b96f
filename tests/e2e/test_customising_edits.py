"""docs/customising.md's edits, each applied with `git apply` to a copy of
node_classification.py in a directory outside the checkout (two or three
together where their runs can be shared), and run end to end there. A
change to the example that breaks a diff fails here."""
import importlib.util
import json
import math
import os
import re
import shutil
import signal

import pytest
import torch
import yaml

import gbrun.checkpoint
import gbrun.data.datasets
from helpers import (
    DISTRIBUTED,
    cpu_plan,
    EDITS,
    HETERO_FLOOR,
    NO_GPU,
    ON_TOP_OF,
    SCRIPT,
    edited_copy,
    epoch_lines,
    reported_test_accuracy,
    run_example,
    run_examples,
)

FAST = ["--gpu=0,1", "--batch-size", 64]
# HETERO_FLOOR (helpers.py) is the heterogeneous edit's floor. The same
# with the items' features left unread and an embedding learned per item
# (4 epochs at lr 0.003; 2 at the default rate reach 0.60). Seeds 0-5:
# 0.8981 0.9000 0.9074 0.9056 0.9000 0.8926.
EMBEDDING_FLOOR = 0.85


def load(path, name):
    """The copy as a module of this process, for in-process refusals."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Predictions:
    """The trained model.pt of an edited copy (`module`), run in this
    process over every item of one split, with all neighbors (as the runs
    these tests check sample with --fanout -1,-1,-1)."""

    def __init__(self, module, dataset, checkpoint_dir):
        args = module.parse_args(["--dataset", dataset, "--fanout", "-1,-1,-1"])
        self.module, self.job = module, module.load_job(args, cpu_plan(args, 1))
        # The heterogeneous edit's model also takes the dataset, and
        # outputs, and is scored on, its TARGET node type.
        self.target = getattr(module, "TARGET", None)
        dataset = [self.job.dataset] if self.target else []
        self.model = module.create_model(self.job.in_size, self.job.num_classes,
                                         *dataset)
        self.model.load_state_dict(torch.load(
            os.path.join(checkpoint_dir, gbrun.checkpoint.MODEL_FILE), weights_only=True))
        self.model.eval()

    def __call__(self, split, size):
        """(scores, labels) over the split's items (1: validation, 2: test),
        of which there must be `size`."""
        import dgl.graphbolt as gb

        datapipe = gb.ItemSampler(self.job.item_sets[split], batch_size=1000)
        datapipe = datapipe.sample_neighbor(self.job.dataset.graph,
                                            self.job.fanout)
        datapipe = datapipe.fetch_feature(
            self.job.dataset.feature, node_feature_keys=self.module.FEATURE_KEYS)
        scores, labels = [], []
        with torch.no_grad():
            for data in gb.DataLoader(datapipe):
                y_hat = self.model(data.blocks, self.module.node_features(data))
                y = data.labels
                if self.target:
                    y_hat, y = y_hat[self.target], y[self.target]
                scores.append(y_hat)
                labels.append(y)
        scores, labels = torch.cat(scores), torch.cat(labels)
        assert len(labels) == size
        return scores, labels


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
    for edit in [edit for edits in EDITS.values() for edit in edits]:
        edited_copy(tmp_path, *ON_TOP_OF.get(edit, ()), edit)
    # The edits the slow tests run together.
    edited_copy(tmp_path, "gat", "keys")
    edited_copy(tmp_path, "multi_label", "best_model")
    edited_copy(tmp_path, "two_features", "auroc")
    edited_copy(tmp_path, "link_dot_product", "link_auroc")
    edited_copy(tmp_path, "link_softmax", "link_degree_negatives")


def other_keys(dataset, out):
    """A copy of `dataset` whose input feature is "x", whose labels are the
    node feature "y", and whose item sets hold seed nodes only."""
    copy = str(out / "xy")
    shutil.copytree(dataset, copy, ignore=shutil.ignore_patterns("preprocessed"))
    with open(os.path.join(copy, "metadata.yaml")) as f:
        metadata = yaml.safe_load(f)
    renames = {"feat": "x", "label": "y"}
    for feature in metadata["feature_data"]:
        feature["name"] = renames[feature["name"]]
    for split in ("train_set", "validation_set", "test_set"):
        data = metadata["tasks"][0][split][0]["data"]
        data[:] = [d for d in data if d["name"] == "seed_nodes"]
    with open(os.path.join(copy, "metadata.yaml"), "w") as f:
        yaml.safe_dump(metadata, f)
    return copy


@pytest.fixture(scope="module")
def short_runs(tmp_path_factory, small_dataset, synthetic, hetero_dataset):
    """The edits whose checks need one short run, side by side (most of
    each run is start-up): {edit: (CompletedProcess, copy, dataset, out)}.
    macro-F1 and AUROC run on a validation set of 60 nodes with batch 64,
    so that rank 0 scores them all and rank 1 none (540 test nodes: both
    score some), and with all neighbors, so that their evaluation depends
    on the model alone."""
    import numpy as np

    out = tmp_path_factory.mktemp("short")
    small_val = synthetic("small_val", "--num-nodes", 3000, "--feat-dim", 32,
                          "--num-classes", 10, "--split", "0.8,0.02,0.18")
    noise = np.random.default_rng(0).normal(size=(3000, 3)).astype("float32")
    all_neighbors = [*FAST, "--fanout", "-1,-1,-1", "--epochs", 1, "--seed", 4]
    runs = {
        # The GAT reading the dataset of other keys: one run for both
        # edits (each test checks its own floor on it; the GAT's refusals
        # are checked on a copy of that edit alone).
        "gat+keys": ([*FAST, "--epochs", 1, "--seed", 1],
                     other_keys(small_dataset, out)),
        "macro_f1": (all_neighbors, small_val),
        "auroc": (all_neighbors, with_feature(small_val, out, "degree",
                                              noise)),
        # Embeddings learn from nothing: more epochs, a higher rate.
        "embedding": ([*FAST, "--fanout", "-1,-1,-1", "--epochs", 4, "--lr",
                       0.003, "--seed", 1, "--predict", out / "emb.npy"],
                      hetero_dataset),
    }
    copies = {"gat+keys": ("gat", "keys"), "macro_f1": ("macro_f1",),
              "auroc": ("two_features", "auroc"),
              "embedding": ("hetero", "embedding")}
    started = []
    for edit, (args, dataset) in runs.items():
        copy = edited_copy(out, *copies[edit])
        outputs = ["--checkpoint-dir", out / edit / "c", "--log-dir",
                   out / edit / "logs"]
        started.append(([*args, "--dataset", dataset, *outputs], NO_GPU, copy))
    done = run_examples(*started, timeout=240)
    return {edit: (run, copy, runs[edit][1], out / edit)
            for edit, run, (_, _, copy) in zip(runs, done, started)}


@pytest.mark.slow
def test_a_2_layer_gat_trains_and_refuses_3_fanouts_and_sage_checkpoints(
        tmp_path, short_runs, small_dataset, capsys, nothing_spawned):
    trained, _, _, _ = short_runs["gat+keys"]
    assert trained.returncode == 0, trained.stderr[-3000:]
    # Seeds 0-4 after its one epoch: test_a_dataset_with_other_keys says.
    assert reported_test_accuracy(trained.stdout) > 0.6, trained.stdout

    module = load(edited_copy(tmp_path, "gat"), "gat_example")
    error = refusal(module, capsys, "--dataset", small_dataset,
                    "--fanout", "5,5,5")
    assert error.endswith("--fanout 5,5,5: 3 values, but the model has 2 "
                          "layers (one value per layer; default 10,10)")
    # The macro-F1 run's checkpoint is of the 3-layer SAGE (the model is
    # the first part of the resume key compared).
    _, _, _, out = short_runs["macro_f1"]
    ckpt = shutil.copytree(out / "c", tmp_path / "sage_ckpt")
    error = refusal(module, capsys, "--dataset", small_dataset, "--epochs", 9,
                    "--checkpoint-dir", ckpt, "--resume")
    assert "was made with another model (repr: 'SAGE(' then, 'GAT(' now)" in (
        error), error


@pytest.mark.slow
def test_macro_f1_is_exact_over_ranks_one_without_items(tmp_path, short_runs):
    run, f1, dataset, out = short_runs["macro_f1"]
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"^Epoch 00000 \| .* \| Macro-F1 \d\.\d{4} \|",
                     run.stdout, re.M), run.stdout
    assert re.search(r"^Test Macro-F1 \d\.\d{4}$", run.stdout, re.M)
    records = [json.loads(line) for line in
               open(out / "logs" / gbrun.records.METRICS_FILE)]
    reported = [records[0]["val_macro-f1"], records[1]["test_macro-f1"]]

    # The same model over every validation and test node, in this process.
    import torchmetrics

    predictions = Predictions(load(f1, "macro_f1_example"), dataset, out / "c")
    exact = []
    for split, size in ((1, 60), (2, 540)):
        scores, labels = predictions(split, size)
        # Not trivially exact: the model predicts several classes.
        assert len(scores.argmax(1).unique()) > 3
        exact.append(torchmetrics.functional.f1_score(
            scores, labels, task="multiclass", num_classes=10,
            average="macro").item())
    assert reported == pytest.approx(exact, abs=1e-6)

    # The plot takes the metric's keys from the log (its command line runs
    # in test_runs_repeat_and_resume_exactly.py's test_plot_metrics_names_a_missing_log).
    import plot_metrics

    plot_metrics.main([str(out / "logs"), "--out", str(tmp_path / "f1.svg")])
    assert ">validation Macro-F1</text>" in (tmp_path / "f1.svg").read_text()


@pytest.mark.slow
def test_a_dataset_with_other_keys(short_runs, capsys, nothing_spawned):
    # The input feature is "x", the labels are the node feature "y", and the
    # item sets hold seed nodes only.
    run, _, dataset, _ = short_runs["gat+keys"]
    assert run.returncode == 0, run.stderr[-3000:]
    # The GAT after one epoch on this dataset, seeds 0-4 (measured
    # 2026-12-07): 0.8617 0.7883 0.8533 0.8550 0.8383; chance is 0.1.
    assert reported_test_accuracy(run.stdout) > 0.7, run.stdout

    original = load(SCRIPT, "unchanged_example")
    error = refusal(original, capsys, "--dataset", dataset)
    assert "has no node feature named 'feat' (it has: x, y)" in error


@pytest.mark.slow
def test_several_node_and_edge_types_learn_exactly_resume_and_predict(
        tmp_path, hetero_dataset, capsys, nothing_spawned):
    """The relational GraphSAGE edit on users and items: a user's own
    features give a nearest-class-mean guess 0.30 (5 classes), the items it
    bought 0.88; the edit learns from them, reports the metric over every
    user with a rank that scores none, resumes exactly, and predicts every
    user."""
    import numpy as np

    # 60 validation users: with batch 64, rank 1 scores none.
    dataset = hetero_dataset
    copy = edited_copy(tmp_path, "hetero")
    common = [*FAST, "--fanout", "-1,-1,-1", "--epochs", 2, "--seed", 1,
              "--dataset", dataset]
    # 18 steps an epoch and rank, and one check after validation: check 21
    # is read at epoch 1's step 3.
    uninterrupted, stopped = run_examples(
        ([*common, "--checkpoint-dir", tmp_path / "u", "--log-dir",
          tmp_path / "logs"], NO_GPU),
        ([*common, "--checkpoint-dir", tmp_path / "s"],
         {**NO_GPU, "TEST_SIGTERM_AT_CHECK": "21"}), script=copy,
        timeout=240)  # a loaded machine has passed the default 120 s
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert reported_test_accuracy(uninterrupted.stdout) > HETERO_FLOOR, (
        uninterrupted.stdout)
    resumed = run_example([*common, "--checkpoint-dir", tmp_path / "s",
                           "--resume", "--predict", tmp_path / "p.npy"],
                          env=NO_GPU, script=copy, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at epoch 1, step 3." in resumed.stdout
    line = re.compile(r"^(Epoch \d+ \| Average Loss \S+ \| Accuracy \S+) \|"
                      r"|^(Test Accuracy \d\.\d{4})$", re.M)
    assert line.findall(stopped.stdout + resumed.stdout) == (
        line.findall(uninterrupted.stdout))
    assert same_tensors(tmp_path / "u" / "model.pt", tmp_path / "s" / "model.pt")

    # The accuracy in metrics.jsonl is the one over every user.
    records = [json.loads(line) for line in
               open(tmp_path / "logs" / gbrun.records.METRICS_FILE)]
    reported = [records[-2]["val_accuracy"], records[-1]["test_accuracy"]]
    module = load(copy, "hetero_example")
    predictions = Predictions(module, dataset, tmp_path / "u")
    exact = []
    for split, size in ((1, 60), (2, 540)):
        scores, labels = predictions(split, size)
        assert len(scores.argmax(1).unique()) > 3  # not trivially exact
        exact.append((scores.argmax(1) == labels).float().mean().item())
    assert reported == pytest.approx(exact, abs=1e-6)

    # --predict: every user's class, in the dataset's user ids; over full
    # neighbourhoods layer by layer, as the test evaluated its users.
    predicted = np.load(tmp_path / "p.npy")
    assert predicted.dtype == np.int64 and predicted.shape == (3000,)
    users, labels = predictions.job.item_sets[2][0:540]["user"]
    assert (predicted[users] == labels.numpy()).mean() == pytest.approx(
        exact[1], abs=1e-6)

    # --precision bf16 stores every type's features in bf16.
    args = module.parse_args(["--dataset", dataset, "--precision", "bf16"])
    job = module.load_job(args, cpu_plan(args, 1))
    for ntype, keys in module.FEATURE_KEYS.items():
        feature = job.dataset.feature.read(
            *gbrun.data.datasets.node_key(keys[0], ntype))
        assert feature.dtype == torch.bfloat16, ntype

    # A TARGET without the labels, refused naming both types.
    module.TARGET = "item"
    assert refusal(module, capsys, "--dataset", dataset).endswith(
        f"dataset '{dataset}': the train_set's seeds are of node type 'user', "
        "but TARGET is 'item'")
    module.TARGET = "user"
    # Keys of another schema, refused naming them.
    module.FEATURE_KEYS = {"user": ["feat"], "shop": ["feat"]}
    assert refusal(module, capsys, "--dataset", dataset).endswith(
        "FEATURE_KEYS names node type 'shop', but dataset "
        f"'{dataset}' has node types item, user")
    # A node type left out (it was a KeyError building the model).
    module.FEATURE_KEYS = {"user": ["feat"]}
    assert refusal(module, capsys, "--dataset", dataset).endswith(
        f"FEATURE_KEYS names no features for node type item of dataset "
        f"'{dataset}': give each type its features, or [] and a learned "
        "embedding (docs/customising.md#a-node-type-without-features)")
    module.FEATURE_KEYS = {"user": ["feat"], "item": ["x"]}
    assert refusal(module, capsys, "--dataset", dataset).endswith(
        f"dataset '{dataset}' has no feature 'x' of node type 'item' (it "
        "has: feat)")
    # DGL's chunked-input pipeline route takes one node type: refused in
    # one line (partition_graph.py takes it: on two machines in
    # test_distributed_edits.py).
    spec = importlib.util.spec_from_file_location(
        "chunk_dataset", os.path.join(DISTRIBUTED, "chunk_dataset.py"))
    chunk_dataset = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chunk_dataset)
    with pytest.raises(SystemExit) as exited:
        chunk_dataset.main(["write", "--dataset", dataset, "--out",
                            str(tmp_path / "chunks"), "--num-chunks", "2",
                            "--example", copy])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().endswith(
        "FEATURE_KEYS per node type (a graph of several node types): "
        "chunk_dataset.py writes graphs of one node type; partition this one "
        "with partition_graph.py")


@pytest.mark.slow
def test_a_node_type_without_features_learns_an_embedding(short_runs):
    """The items' features left unread: the model learns a vector per item,
    which must tell the users' classes (their own features alone: 0.30)."""
    run, _, _, out = short_runs["embedding"]
    assert run.returncode == 0, run.stderr[-3000:]
    assert reported_test_accuracy(run.stdout) > EMBEDDING_FLOOR, run.stdout
    model = torch.load(out / "c" / gbrun.checkpoint.MODEL_FILE,
                       weights_only=True)
    assert model["embeddings.item.weight"].shape == (1500, 64)
    assert "layers.0.mods.bought-by.fc_neigh.weight" in model
    assert model["layers.0.mods.bought-by.fc_neigh.weight"].shape[1] == 64
    import numpy as np

    predicted = np.load(out.parent / "emb.npy")
    assert predicted.dtype == np.int64 and predicted.shape == (3000,)


@pytest.mark.slow
def test_multi_label_with_the_best_model_kept_across_a_resume(
        tmp_path, multi_label_dataset, capsys, nothing_spawned):
    copy = edited_copy(tmp_path, "multi_label", "best_model")
    # Seed 1 at lr 0.03 validates best after epoch 0 (Micro-F1 0.6217, then
    # 0.5797 after epoch 1): a resumed run that forgot the best would write
    # epoch 1's model as best.pt.
    common = [*FAST, "--fanout", "5,5,5", "--epochs", 2, "--seed", 1,
              "--lr", 0.03, "--max-batches", 6, "--dataset",
              multi_label_dataset]
    # The 10th check is epoch 1's third step; training stops after the 4th.
    uninterrupted, stopped = run_examples(
        ([*common, "--checkpoint-dir", tmp_path / "u"], NO_GPU),
        ([*common, "--checkpoint-dir", tmp_path / "s"],
         {**NO_GPU, "TEST_SIGTERM_AT_CHECK": "10"}), script=copy)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    f1 = [float(v) for v in re.findall(r"^Epoch \d+ \| .* \| Micro-F1 (\d\.\d{4})",
                                       uninterrupted.stdout, re.M)]
    assert len(f1) == 2 and f1[0] > f1[1], uninterrupted.stdout
    assert re.search(r"^Test Micro-F1 0\.[5-9]\d{3}$", uninterrupted.stdout,
                     re.M), uninterrupted.stdout
    resumed = run_example([*common, "--checkpoint-dir", tmp_path / "s",
                           "--resume", "--predict", tmp_path / "p.npy"],
                          env=NO_GPU, script=copy)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # --predict writes every node's scores (to_prediction follows LABELS).
    import numpy as np

    scores = np.load(tmp_path / "p.npy")
    assert scores.dtype == np.float32 and scores.shape == (3000, 5)
    assert 0 <= scores.min() and scores.max() <= 1

    def saved(run):
        best = torch.load(tmp_path / run / "best.pt", weights_only=True)
        kept = torch.load(tmp_path / run / gbrun.checkpoint.CHECKPOINT_FILE,
                          weights_only=True)["kept"]
        return best, kept

    (best, kept), (best_again, kept_again) = saved("u"), saved("s")
    assert kept == kept_again == {"best": pytest.approx(f1[0], abs=5e-5)}
    assert best.keys() == best_again.keys()
    assert all(torch.equal(best[k], best_again[k]) for k in best)

    # The unchanged example refuses this dataset in one line, spawning
    # nothing: its labels are multi-hot, not one class per node.
    error = refusal(load(SCRIPT, "unchanged"), capsys, "--dataset",
                    multi_label_dataset)
    assert ("the train_set's labels have shape [1800, 5] and dtype float32, "
            "but the example takes one integer class in [0, 5) per node"
            ) in error


def with_feature(dataset, tmp_path, name, values):
    """A copy of `dataset` with one more node feature `name`."""
    import numpy as np

    copy = str(tmp_path / f"with_{name}")
    shutil.copytree(dataset, copy, ignore=shutil.ignore_patterns("preprocessed"))
    np.save(os.path.join(copy, f"node_{name}.npy"), values)
    with open(os.path.join(copy, "metadata.yaml")) as f:
        metadata = yaml.safe_load(f)
    metadata["feature_data"].append({
        "domain": "node", "name": name, "format": "numpy", "in_memory": True,
        "path": f"node_{name}.npy"})
    with open(os.path.join(copy, "metadata.yaml"), "w") as f:
        yaml.safe_dump(metadata, f)
    return copy


@pytest.mark.slow
def test_auroc_is_exact_over_ranks_one_without_items_on_two_features(
        short_runs):
    run, auroc, dataset, out = short_runs["auroc"]
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"^Test AUROC \d\.\d{4}$", run.stdout, re.M), run.stdout
    records = [json.loads(line) for line in
               open(out / "logs" / gbrun.records.METRICS_FILE)]
    reported = [records[0]["val_auroc"], records[1]["test_auroc"]]

    import torchmetrics

    module = load(auroc, "auroc_example")
    predictions = Predictions(module, dataset, out / "c")
    assert predictions.job.in_size == 32 + 3  # both features, side by side
    exact = [torchmetrics.functional.auroc(*predictions(split, size),
                                           task="multiclass", num_classes=10,
                                           average="macro").item()
             for split, size in ((1, 60), (2, 540))]
    assert reported == pytest.approx(exact, abs=1e-6)


def same_tensors(first, second):
    """Two model.pt files hold equal tensors, key by key."""
    a = torch.load(first, weights_only=True)
    b = torch.load(second, weights_only=True)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_cosine_accumulation_and_early_stopping_resume_exactly(tmp_path,
                                                               small_dataset):
    copy = edited_copy(tmp_path, "cosine", "accumulation", "early_stopping")
    # No epoch beats the first by 1.0: epochs 0 and 1 train, and the
    # validation of epoch 1 ends training (patience 1).
    text = open(copy).read()
    for old, new in (("PATIENCE = 3", "PATIENCE = 1"),
                     ("MIN_DELTA = 0.0", "MIN_DELTA = 1.0")):
        assert text.count(old) == 1
        text = text.replace(old, new)
    open(copy, "w").write(text)
    common = [*FAST, "--fanout", "5,5,5", "--epochs", 4, "--seed", 3,
              "--max-batches", 6, "--dataset", small_dataset]
    # 6 steps and one check after validation per epoch; each step reads the
    # previous step's check. Check 9 (epoch 1's second step) is read at
    # step 3, which only adds its gradients (ACCUMULATE = 2): the stop waits
    # for step 4's optimizer step. Stopping at step 3 would lose half an
    # accumulation.
    uninterrupted, stopped = run_examples(
        ([*common, "--checkpoint-dir", tmp_path / "u"], NO_GPU),
        ([*common, "--checkpoint-dir", tmp_path / "s"],
         {**NO_GPU, "TEST_SIGTERM_AT_CHECK": "9"}), script=copy)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    ckpt = tmp_path / "s" / gbrun.checkpoint.CHECKPOINT_FILE
    checkpoint = torch.load(ckpt, weights_only=True)
    assert (checkpoint["epoch"], checkpoint["step"]) == (1, 4)
    # The schedule's state is saved: epoch 1 runs at the cosine's rate for
    # epoch 1 of 4 (a schedule resumed from scratch would train it at 0.001).
    assert checkpoint["scheduler"]["last_epoch"] == 1
    lr = checkpoint["optimizer"]["param_groups"][0]["lr"]
    assert lr == pytest.approx(0.001 * (1 + math.cos(math.pi / 4)) / 2)
    assert "Early stopping before epoch 2." in uninterrupted.stdout
    assert len(epoch_lines(uninterrupted.stdout)) == 2
    # Resumed at epoch 1, step 4: 2 steps left (checks 1-2), then epoch 1's
    # check 3, after the validation that ends training: the stop comes at
    # epoch 2.
    resumed = [*common, "--checkpoint-dir", tmp_path / "s", "--resume"]
    second = run_example(resumed, env={**NO_GPU, "TEST_SIGTERM_AT_CHECK": "3"},
                         script=copy)
    assert second.returncode == 128 + signal.SIGTERM, second.stderr[-3000:]
    assert torch.load(ckpt, weights_only=True)["kept"]["worse_epochs"] == 1
    # The last resume goes straight to the test: it evaluates in a process
    # that trained nothing, and prints what the uninterrupted run printed.
    last = run_example(resumed, env=NO_GPU, script=copy)
    assert last.returncode == 0, last.stderr[-3000:]
    assert "Early stopping before epoch 2." in last.stdout
    assert not epoch_lines(last.stdout)
    assert ([line[:3] for line in epoch_lines(stopped.stdout + second.stdout)]
            == [line[:3] for line in epoch_lines(uninterrupted.stdout)])
    assert reported_test_accuracy(last.stdout) == (
        reported_test_accuracy(uninterrupted.stdout))
    assert same_tensors(tmp_path / "u" / "model.pt", tmp_path / "s" / "model.pt")


@pytest.fixture(scope="module")
def value_dataset(tmp_path_factory):
    """3,000 nodes with one float to regress each, written by the
    converter's writer with kind "value": the target is a latent value per
    node plus its neighbors' mean; the features are a noisy view of the
    latent. 60 validation nodes: with batch 64, rank 1 scores none."""
    import numpy as np

    from gbrun.data import inputs, ondisk

    rng = np.random.default_rng(0)
    num_nodes = 3000
    latent = rng.normal(0, 1, num_nodes)
    src, dst = rng.integers(0, num_nodes, (2, 30000))
    sums = np.bincount(dst, latent[src], num_nodes)
    counts = np.maximum(np.bincount(dst, minlength=num_nodes), 1)
    target = (latent + sums / counts).astype(np.float32)
    features = (latent[:, None] + rng.normal(0, 0.5, (num_nodes, 8))
                ).astype(np.float32)
    train, val, test = inputs.split_nodes(num_nodes, (0.8, 0.02, 0.18), seed=1)
    out = str(tmp_path_factory.mktemp("data") / "values")
    ondisk.write_ondisk_dataset(out, np.stack([src, dst]), features, target,
                                train, val, test, kind="value")
    return out


@pytest.mark.slow
def test_node_regression_is_exact_over_ranks_and_predicts(
        tmp_path, value_dataset, capsys, nothing_spawned):
    # (Its resume is the loop's, as every edit's: SIGTERM and --resume are
    # checked on the edits that change what a resume holds, and on the
    # several node types' item sets.)
    copy = edited_copy(tmp_path, "regression")
    run = run_example([*FAST, "--fanout", "-1,-1,-1", "--epochs", 2, "--seed",
                       5, "--lr", 0.01, "--dataset", value_dataset,
                       "--checkpoint-dir", tmp_path / "u", "--log-dir",
                       tmp_path / "logs", "--predict", tmp_path / "p.npy"],
                      env=NO_GPU, script=copy)
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"^Epoch 00001 \| Average Loss \S+ \| MAE \d\.\d{4} \|",
                     run.stdout, re.M), run.stdout
    # --predict writes every node's value (to_prediction follows LABELS).
    import numpy as np

    values = np.load(tmp_path / "p.npy")
    assert values.dtype == np.float32 and values.shape == (3000, 1)
    assert np.isfinite(values).all() and values.std() > 0

    # The MAE in metrics.jsonl is the one over every prediction.
    records = [json.loads(line) for line in
               open(tmp_path / "logs" / gbrun.records.METRICS_FILE)]
    reported = [records[-2]["val_mae"], records[-1]["test_mae"]]
    predictions = Predictions(load(copy, "regression_example"),
                              value_dataset, tmp_path / "u")
    exact, baseline = [], []
    for split, size in ((1, 60), (2, 540)):
        values, targets = predictions(split, size)
        assert values.shape == targets.shape == (size, 1)
        exact.append((values - targets).abs().mean().item())
        baseline.append((targets - targets.mean()).abs().mean().item())
    assert reported == pytest.approx(exact, abs=1e-6)
    # It learns: test MAE 0.351 after 2 epochs (seed 5), where predicting
    # the targets' mean scores 0.899.
    assert exact[1] < 0.6 * baseline[1], (exact, baseline)

    # The unchanged example refuses float labels in one line.
    error = refusal(load(SCRIPT, "unchanged_for_values"), capsys,
                    "--dataset", value_dataset)
    assert ("the train_set's labels have shape [2400, 1] and dtype float32, "
            "but the example takes one integer class in [0, 1) per node"
            ) in error, error
