"""--predict: every node's prediction, layer by layer over full
neighbourhoods, in the dataset's node ids; the same file from 2 ranks and
from a 1-rank --resume of the finished checkpoint, which does not train;
the files of a GPU rank (tagged cuda:0) load and predict without CUDA, as
docs/running.md loads them."""
import os
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import gbrun.checkpoint
import gbrun.outputs
from helpers import NO_GPU, REFERENCE, REPO, reported_test_accuracy, run_example


def items_of_test_set(dataset_dir):
    """(node ids, labels) of the dataset's test set."""
    import gbrun.data.datasets

    test_set = gbrun.data.datasets.load_dataset(dataset_dir).tasks[0].test_set
    ids, labels = zip(*[(int(i), int(l)) for i, l in test_set])
    return np.array(ids), np.array(labels)


@pytest.mark.slow
def test_two_ranks_and_a_one_rank_resume_predict_the_same_file(
        reference_run, small_dataset, tmp_path, capsys, monkeypatch):
    reference, out = reference_run
    first = np.load(out / "predictions.npy")
    assert first.dtype == np.int64 and first.shape == (3000,)
    assert "Predictions of 3000 nodes written to" in reference.stdout
    # The test nodes' predictions score what the printed test metric says
    # (full neighbourhoods in the file, sampled ones in the test line):
    # 0.8983 printed, 0.9083 from the file (seed 1); 0.9033, 0.9167 (seed 2).
    ids, labels = items_of_test_set(small_dataset)
    from_file = float((first[ids] == labels).mean())
    assert from_file == pytest.approx(
        reported_test_accuracy(reference.stdout), abs=0.02)

    # One rank resumes the finished checkpoint: it predicts, trains nothing.
    # Nothing that only training reads needs repeating: not --epochs (3
    # trained, default 10), --fanout nor --seed; and the train set's check
    # of the batch size (1800 nodes) is not made.
    shutil.copytree(out / "ckpt", tmp_path / "ckpt")
    again = run_example(
        ["--gpu=0", "--batch-size", 5000, "--dataset", small_dataset,
         "--checkpoint-dir", tmp_path / "ckpt", "--resume", "--predict",
         tmp_path / "again.npy"], env=NO_GPU)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Training" not in again.stdout and "Epoch " not in again.stdout, (
        again.stdout)
    assert (f"Predicting with the model of {tmp_path / 'ckpt'}, trained 3 "
            f"epochs on '{small_dataset}'; nothing trains.") in again.stdout
    assert "Predicting with 1 CPU process." in again.stdout
    second = np.load(tmp_path / "again.npy")
    # Equal but for ties between two classes' float outputs.
    assert (first == second).mean() > 0.998
    # With --predict-fanout, sampled neighbourhoods: another file, that
    # still scores near the full one.
    args = [a for a in REFERENCE if a != "--gpu=0,1"]
    sampled = run_example(
        ["--gpu=0", *args, "--dataset", small_dataset, "--checkpoint-dir",
         tmp_path / "ckpt", "--resume", "--predict", tmp_path / "s.npy",
         "--predict-fanout", 2], env=NO_GPU)
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    third = np.load(tmp_path / "s.npy")
    assert (third != first).mean() > 0.01
    assert float((third[ids] == labels).mean()) == pytest.approx(from_file,
                                                               abs=0.1)
    # Without --predict, the finished checkpoint is refused, naming it,
    # before any rank starts.
    import gbrun.launch
    import node_classification as nc

    monkeypatch.setattr(gbrun.launch.mp, "spawn", None)
    with pytest.raises(SystemExit) as exit_info:
        nc.main(["--gpu=0", *map(str, args), "--dataset", small_dataset,
                 "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().endswith(
        "ask for more epochs, or add --predict FILE to predict with it")


def _predict_shares(rank, cases, num_nodes):
    """In a gloo group: for each case (each rank's node ids, or per node
    type {type: each rank's ids}), rank `rank` adds outputs for its ids and
    exchanges; returns, per case, the outputs of every node (per type for
    several), or the error's text."""
    from gbrun import predicting

    job = SimpleNamespace(dataset=SimpleNamespace(
        all_nodes_set=SimpleNamespace(names="seed_nodes")))
    progress = SimpleNamespace(rank=rank, device=torch.device("cpu"),
                               start=SimpleNamespace(seed=None), upcast=False)

    def outputs(ids):
        return (ids.float() + 1).unsqueeze(1).repeat(1, 2)

    results = []
    for shares in cases:
        several = isinstance(shares, dict)
        counts = {ntype: num_nodes for ntype in shares} if several else (
            num_nodes)
        every_node = predicting.EveryNode(job, SimpleNamespace(
            num_nodes=counts, indices=torch.zeros(0, dtype=torch.int64)),
            progress)
        if several:
            ids = {ntype: torch.tensor(share[rank], dtype=torch.int64)
                   for ntype, share in shares.items() if share[rank]}
            if ids:
                every_node.add(SimpleNamespace(seed_nodes=ids),
                               {ntype: outputs(i) for ntype, i in ids.items()})
        else:
            ids = torch.tensor(shares[rank], dtype=torch.int64)
            if len(ids):
                every_node.add(SimpleNamespace(seed_nodes=ids), outputs(ids))
        try:
            every_node.exchange()
            results.append({ntype: shared.previous for ntype, shared
                            in every_node.types.items()} if several else
                           every_node.types[None].previous)
        except RuntimeError as error:
            results.append(str(error))
    return results


@pytest.mark.slow
def test_every_node_is_predicted_once_across_ranks(tmp_path):
    from helpers import run_gloo_group

    # Three ranks, one with no nodes: every rank has every node's outputs,
    # each row from the rank that computed it. Then a node of two ranks'
    # shares, and one of none: refused on every rank. Then two node types:
    # each exchanged on its own, "item" computed by rank 2 alone (ranks 0
    # and 1 learn its width from it); a type no rank computed has no
    # outputs (it is no input of the next layer).
    results = run_gloo_group(_predict_shares, 3, tmp_path, [
        [[0, 1, 2], [], [3, 4]], [[0, 1, 2], [2, 3], []],
        {"user": [[0, 4], [1, 2, 3], []], "item": [[], [], [0, 1, 2, 3, 4]],
         "shop": [[], [], []]},
        {"user": [[0, 1], [2, 3], []]}], 5)
    expected = (torch.arange(5).float() + 1).unsqueeze(1).repeat(1, 2)
    assert all(torch.equal(ok, expected) for ok, *_ in results)
    assert [bad for _, bad, *_ in results] == [
        "--predict: of 5 nodes, the ranks predicted 1 none and 1 more than "
        "once: the all-nodes loader must hand every rank its own share "
        "(create_dataloader's DistributedItemSampler, is_train False)"] * 3
    for _, _, types, _ in results:
        assert types.keys() == {"user", "item", "shop"}
        assert torch.equal(types["user"], expected)
        assert torch.equal(types["item"], expected)
        assert types["shop"] is None
    assert [missing for *_, missing in results] == [
        "--predict: of 5 nodes of type 'user', the ranks predicted 1 none "
        "and 0 more than once: the all-nodes loader must hand every rank "
        "its own share (create_dataloader's DistributedItemSampler, "
        "is_train False)"] * 3


def test_predictions_of_another_kind_than_labels_are_refused(tmp_path):
    from gbrun import predicting

    every_node = predicting.EveryNode.__new__(predicting.EveryNode)
    every_node.rank = 0
    shared = SimpleNamespace(num_nodes=3, previous=torch.zeros(3, 4),
                             dataset_ids=lambda: torch.arange(3))
    # The last layer output one type of two: its predictions are the file's.
    every_node.types = {"user": shared,
                        "item": SimpleNamespace(num_nodes=5, previous=None)}
    with pytest.raises(RuntimeError, match=(
            r"LABELS is 'class', so the predictions are int64 class ids, "
            r"one per node \(3 nodes\); to_prediction\(\) returned a "
            r"torch.float32 tensor of shape \(3, 4\)")):
        every_node.save(torch.zeros(3, 4), str(tmp_path / "p.npy"), "class")
    with pytest.raises(RuntimeError, match="LABELS is 'multi-hot'"):
        every_node.save(torch.zeros(3, dtype=torch.int64),
                        str(tmp_path / "p.npy"), "multi-hot")
    # Written in the dataset's ids: row dataset_ids()[i] is prediction i.
    shared.dataset_ids = lambda: torch.tensor([2, 0, 1])
    every_node.save(torch.tensor([7, 8, 9]), str(tmp_path / "p.npy"), "class")
    assert np.load(tmp_path / "p.npy").tolist() == [8, 9, 7]
    # A last layer that output two node types is not one file.
    every_node.types["item"].previous = torch.zeros(5, 4)
    with pytest.raises(RuntimeError, match=(
            "--predict writes one node type's predictions, but the model's "
            "last layer output node types user, item")):
        every_node.save(torch.tensor([7, 8, 9]), str(tmp_path / "p.npy"),
                        "class")
    # Unless the caller names the one it writes (a link model's two ends).
    every_node.types["item"].dataset_ids = lambda: torch.arange(5)
    every_node.save(torch.arange(5), str(tmp_path / "i.npy"), "class", "item")
    assert np.load(tmp_path / "i.npy").tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(RuntimeError, match=(
            "outputs of node type 'shop' asked for, but the model's last "
            "layer output node types user, item")):
        every_node.save(torch.arange(5), str(tmp_path / "i.npy"), "class",
                        "shop")


def docs_prediction_snippet(dataset, model_dir):
    """docs/running.md's load-and-predict snippet, on `dataset` and the
    model.pt and model.json in `model_dir`."""
    doc = open(os.path.join(REPO, "docs", "running.md")).read()
    blocks = [block.split("```")[0] for block in doc.split("```python\n")[1:]]
    (snippet,) = [block for block in blocks if "load_model" in block]
    assert 'load_dataset("synthetic")' in snippet and '"runs/a"' in snippet, snippet
    return snippet.replace('load_dataset("synthetic")', f"load_dataset({str(dataset)!r})"
                           ).replace('"runs/a"', repr(str(model_dir)))


@pytest.mark.slow
def test_files_saved_by_gpu_ranks_load_without_cuda(
        reference_run, small_dataset, tmp_path, monkeypatch, capsys):
    # Files whose tensors are tagged cuda:0, as torch.save writes them from
    # a GPU rank, loaded the ways the project loads files, with no GPU.
    trained, out = reference_run
    model = torch.load(out / "ckpt" / gbrun.checkpoint.MODEL_FILE, weights_only=True)
    checkpoint = torch.load(out / "ckpt" / gbrun.checkpoint.CHECKPOINT_FILE,
                            weights_only=True)
    monkeypatch.setattr(torch.serialization, "location_tag",
                        lambda storage: "cuda:0")
    (tmp_path / "ckpt").mkdir()
    model_file = str(tmp_path / "ckpt" / gbrun.checkpoint.MODEL_FILE)
    gbrun.outputs.save_atomically(model, model_file)
    gbrun.outputs.save_atomically(
        checkpoint, str(tmp_path / "ckpt" / gbrun.checkpoint.CHECKPOINT_FILE))
    monkeypatch.undo()

    # The docs' snippet, run as a user runs it (a process of its own, with
    # CUDA hidden), loads it and predicts as well as the trained model
    # scored (chance is 0.1).
    shutil.copy(out / "ckpt" / gbrun.checkpoint.MODEL_CONFIG_FILE,
                tmp_path / "ckpt")
    predicted = subprocess.run(
        [sys.executable, "-c",
         docs_prediction_snippet(small_dataset, tmp_path / "ckpt")],
        capture_output=True, text=True, timeout=120, cwd=REPO,
        env={**os.environ, **NO_GPU})
    assert predicted.returncode == 0, predicted.stderr[-2000:]
    found = re.search(r"predicted (\d+) nodes; test accuracy (\d\.\d+)",
                      predicted.stdout)
    assert found and int(found[1]) == 3000, predicted.stdout
    assert abs(float(found[2]) - reported_test_accuracy(trained.stdout)) < 0.1

    # The rest in this process, which sees no GPU, as torch.load asks
    # (torch.cuda.is_available), whatever the machine has.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    # The tag is honoured: without map_location the file does not load
    # (weights_only's unpickler raises its own error, naming CUDA).
    with pytest.raises(Exception, match="CUDA"):
        torch.load(model_file, weights_only=True)
    # scripts/check_gpu.py's check (a script run as `python -c CODE FILE`)
    # loads it on the CPU.
    import check_gpu

    monkeypatch.setattr(sys, "argv", ["-c", model_file])
    exec(check_gpu.LOAD_ON_CPU, {"__name__": "__main__"})
    assert capsys.readouterr().out == f"{len(model)} tensors\n"
    # --resume loads such a checkpoint on the CPU.
    loaded = gbrun.checkpoint.load_checkpoint(str(tmp_path / "ckpt"),
                                              checkpoint["config"])
    assert loaded["epoch"] == checkpoint["epoch"]
