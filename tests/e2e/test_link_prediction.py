"""link_prediction.py, the template's second task: it learns (MRR far above
chance on a graph whose edges mostly join nodes of one class), its MRR is
exact over ranks one of which scores no pairs, --predict's embeddings
reproduce it, a stopped run resumes exactly, a training batch never samples
its own pairs, and what it cannot train is refused in one line."""
import json
import os
import re
import shutil
import signal
import sys

import numpy as np
import pytest
import torch

import gbrun.checkpoint
import gbrun.records
import gbrun.stop

from helpers import (
    DISTRIBUTED, NO_GPU, REPO, one_rank_item_sampler, run_examples,
    run_gloo_group,
)

LINK = os.path.join(REPO, "link_prediction.py")
NEGATIVES = 50  # of each evaluation pair in conftest.py's link_dataset
# Two CPU ranks, 8 steps each per epoch on the dataset below. A batch of
# 512 holds all of the 489 validation or test pairs, so rank 1 scores none.
ARGS = ["--gpu=0,1", "--batch-size", 512, "--fanout", "5,5,5", "--lr", 0.003,
        "--epochs", 4, "--seed", 0]
# Test MRR of ARGS for seeds 0-5 on this dataset (measured 2026-12-07 on an
# AMD EPYC, after the split became one of distinct pairs; chance is 0.089
# with 50 negatives): 0.3043 0.3190 0.2976 0.3104 0.3105 0.2995. The floor
# sits below the lowest seed:
LEARNS = 0.25
TEST_LINE = re.compile(
    r"^Test MRR (\d\.\d{4}) \| Hits@1 (\d\.\d{4}) \| Hits@3 (\d\.\d{4}) \| "
    r"Hits@10 (\d\.\d{4})$", re.M)
EPOCH_LINE = re.compile(r"^(Epoch \d{5} \| Average Loss .*? \| )Time ", re.M)
# A stop check per step and one after each epoch's validation: check 12 is
# read at step 4 of epoch 1 (test_resume.py says how the hook counts).
STOP_AT_CHECK = 12


@pytest.fixture(scope="module")
def link_runs(link_dataset, tmp_path_factory):
    """{name: (CompletedProcess, its directory)}: the seeded reference run
    (checkpoints, metrics and --predict), and beside it the same run stopped
    by SIGTERM inside epoch 1, then resumed; beside the resume, the
    reference's model predicting on another dataset (`predicted`)."""
    out = tmp_path_factory.mktemp("link_runs")

    def args(name, *extra):
        return [*map(str, ARGS), "--dataset", link_dataset,
                "--checkpoint-dir", str(out / name / "ckpt"), *extra]

    reference, stopped = run_examples(
        (args("reference", "--log-dir", str(out / "reference" / "logs"),
              "--predict", str(out / "reference" / "embeddings.npy")),
         NO_GPU),
        (args("stopped"), {**NO_GPU, gbrun.stop.TEST_HOOK: str(STOP_AT_CHECK)}),
        script=LINK, timeout=180)
    # --resume --predict of the finished run, with none of its training
    # options (default --epochs 10, a batch larger than the train set).
    other = fewer_edges(link_dataset, out / "fewer_edges")
    predict = ["--gpu=0", "--dataset", other, "--batch-size", "100000",
               "--checkpoint-dir", str(out / "reference" / "ckpt"),
               "--resume", "--predict", str(out / "predicted.npy")]
    resumed, predicted = run_examples(
        (args("stopped", "--resume"), NO_GPU), (predict, NO_GPU),
        script=LINK, timeout=180)
    return {"reference": (reference, out / "reference"),
            "stopped": (stopped, out / "stopped"),
            "resumed": (resumed, out / "stopped"),
            "predicted": (predicted, out)}


def fewer_edges(dataset, copy):
    """A copy of `dataset` without its last 10% of edges: another dataset
    (a graph cleaned since training) of the same nodes and features."""
    shutil.copytree(dataset, copy)
    edges = np.load(os.path.join(copy, "edges.npy"))
    np.save(os.path.join(copy, "edges.npy"), edges[:, : edges.shape[1] * 9 // 10])
    return str(copy)


def chance_mrr(negatives):
    """The MRR of scores that know nothing: a rank uniform in 1..K+1."""
    return float(np.mean(1 / np.arange(1, negatives + 2)))


@pytest.mark.slow
def test_link_prediction_learns_and_its_mrr_is_exact_over_ranks(
        link_runs, link_dataset):
    run, out = link_runs["reference"]
    assert run.returncode == 0, run.stderr[-3000:]
    found = TEST_LINE.findall(run.stdout)
    assert len(found) == 1, run.stdout
    assert float(found[0][0]) > LEARNS > 2 * chance_mrr(NEGATIVES)
    records = [json.loads(line) for line in
               open(out / "logs" / gbrun.records.METRICS_FILE)]
    reported = records[-1]
    assert set(reported) >= {"test_mrr", "test_hits@1", "test_hits@10"}

    # The test pairs, scored in this one process from the embeddings
    # --predict wrote (every node's, in the dataset's ids) and the trained
    # model's score: the MRR two ranks printed, one of which had no pairs.
    pairs = torch.from_numpy(np.load(os.path.join(link_dataset,
                                                  "test_node_pairs.npy")))
    negatives = torch.from_numpy(np.load(os.path.join(
        link_dataset, "test_negative_dsts.npy")))
    assert len(pairs) <= ARGS[ARGS.index("--batch-size") + 1]  # rank 1: none
    embeddings = torch.from_numpy(np.load(out / "embeddings.npy"))
    assert embeddings.dtype == torch.float32 and embeddings.shape == (2000, 256)
    assert f"Embeddings of 2000 nodes written to {out / 'embeddings.npy'}" in (
        run.stdout)

    module = load_link_example()
    model = module.create_model(32)
    gbrun.checkpoint.load_model(model, out / "ckpt")
    metric = module.create_metric(NEGATIVES)
    with torch.no_grad():
        destinations = torch.cat([pairs[:, 1:], negatives], dim=1)
        scores = model.score(embeddings[pairs[:, 0]][:, None, :],
                             embeddings[destinations])
        metric.update(scores[:, 0], scores[:, 1:])
    exact = {name: value.item() for name, value in metric.compute().items()}
    assert {name: reported[f"test_{name.lower()}"] for name in exact} == (
        pytest.approx(exact, abs=1e-12))
    # Not trivially exact: the ranks spread.
    assert 0 < exact["Hits@1"] < exact["Hits@10"] < 1


@pytest.mark.slow
def test_a_finished_link_model_predicts_on_another_dataset(link_runs,
                                                          link_dataset):
    reference, out = link_runs["reference"]
    predicted, runs = link_runs["predicted"]
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    # One line names both datasets; nothing trains, and nothing says so.
    assert (f"Predicting on another dataset, '{runs / 'fewer_edges'}' "
            "(edges.npy: ") in predicted.stdout
    assert (f"with the model of {out / 'ckpt'}, trained 4 epochs on "
            f"'{link_dataset}'; nothing trains.") in predicted.stdout
    assert "Training" not in predicted.stdout
    assert "Epoch " not in predicted.stdout
    assert len(TEST_LINE.findall(predicted.stdout)) == 1, predicted.stdout
    assert (f"Embeddings of 2000 nodes written to {runs / 'predicted.npy'}"
            in predicted.stdout)
    # The trained model's embeddings of the other graph: near, not equal.
    first = np.load(out / "embeddings.npy")
    again = np.load(runs / "predicted.npy")
    assert again.shape == first.shape and not np.array_equal(again, first)
    # The model the run trained stays as it was.
    assert os.path.getmtime(out / "ckpt" / "model.pt") < os.path.getmtime(
        out / "embeddings.npy")


def load_link_example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("link_example", LINK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_a_stopped_link_run_resumes_exactly(link_runs):
    reference, _ = link_runs["reference"]
    stopped, out = link_runs["stopped"]
    resumed, _ = link_runs["resumed"]
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-2000:]
    assert "Stopped by SIGTERM in epoch 1 after step 4: checkpoint saved" in (
        stopped.stdout)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"Resuming from {out / 'ckpt'} at epoch 1, step 4." in (
        resumed.stdout)
    # Every epoch line (but its times) and the test line, as uninterrupted.
    assert EPOCH_LINE.findall(stopped.stdout + resumed.stdout) == (
        EPOCH_LINE.findall(reference.stdout))
    assert len(EPOCH_LINE.findall(reference.stdout)) == 4
    assert TEST_LINE.findall(resumed.stdout) == (
        TEST_LINE.findall(reference.stdout))


def _link_metrics(rank, splits):
    """The example's metrics of 60 pairs' scores, for each split of
    `splits` (rank r scoring the pairs of split[r]): its values on every
    rank, and one process's."""
    import gbrun.metrics

    module = load_link_example()
    torch.manual_seed(0)
    # Rounded scores: ties, which count half.
    positive, negatives = torch.randn(60).round(), torch.randn(60, 8).round()
    found = []
    for shares in splits:
        metric = gbrun.metrics.across_ranks(module.create_metric(8),
                                            torch.device("cpu"))
        share = slice(*shares[rank])
        if shares[rank][1] > shares[rank][0]:
            metric.update(positive[share], negatives[share])
        found.append({k: v.item() for k, v in metric.compute().items()})
    alone = module.create_metric(8)
    alone.update(positive, negatives)
    return found, {k: v.item() for k, v in alone.compute().items()}


@pytest.mark.slow
def test_link_metrics_are_exact_over_ranks_one_without_pairs(tmp_path):
    # Two ranks, twice: rank 0 scores 25 pairs and rank 1 the other 35;
    # then rank 0 all 60 and rank 1 none.
    splits = [[(0, 25), (25, 60)], [(0, 60), (0, 0)]]
    # (A loaded machine has taken more than run_gloo_group's default 120 s
    # to start the ranks.)
    results = run_gloo_group(_link_metrics, 2, tmp_path, splits, timeout=300)
    alone = results[0][1]
    assert [found for found, _ in results] == [[alone] * len(splits)] * 2
    # OGB's ranks: 1 + negatives above + half the tied ones.
    torch.manual_seed(0)
    positive, negatives = torch.randn(60).round(), torch.randn(60, 8).round()
    rank = 1 + (negatives > positive[:, None]).sum(1) + 0.5 * (
        negatives == positive[:, None]).sum(1)
    assert alone["MRR"] == pytest.approx((1 / rank.double()).mean().item(),
                                         abs=1e-12)
    assert alone["Hits@3"] == pytest.approx((rank <= 3).double().mean().item())


def _sampled_edges_of_training_batches(module, dataset, directed):
    """(positive pairs, sampled edges) of the first training batches of
    link_prediction.py's loader (of a `directed` task or not), with all
    neighbours sampled, as original node ids."""
    import gbrun.data.datasets

    torch.manual_seed(0)  # the same batches every time
    args = module.parse_args(["--dataset", dataset, "--batch-size", "256",
                              "--fanout", "-1,-1,-1"])
    data = gbrun.data.datasets.load_dataset(dataset)
    train_set, _, _ = gbrun.data.datasets.check_link_task(
        data, dataset, module.FEATURE_KEYS, module.TASK)
    loader = module.create_dataloader(
        data.graph, data.feature, train_set, torch.device("cpu"), "cpu",
        True, args, [-1, -1, -1], directed)
    found = []
    for step, batch in zip(range(3), loader):
        src, dst = batch.node_pairs  # dgl 2.1: the positive pairs
        sampled = []
        for subgraph in batch.sampled_subgraphs:
            csc = subgraph.sampled_csc
            rows = subgraph.original_row_node_ids[csc.indices]
            columns = subgraph.original_column_node_ids.repeat_interleave(
                csc.indptr.diff())
            sampled.append(torch.stack([rows, columns]))
        found.append((torch.stack([src, dst]), torch.cat(sampled, dim=1)))
    return found


@pytest.mark.slow
def test_a_training_batch_samples_none_of_its_pairs_nor_their_reverses(
        link_dataset, monkeypatch):
    """Nor, for a directed task (convert_to_ondisk.py --directed), its own
    pairs, while their reverses (other facts) stay."""
    # In this process, as one rank of all the pairs.
    one_rank_item_sampler(monkeypatch)
    module = load_link_example()
    # GraphBolt's DataLoader pickles the pipeline's classes by module name.
    monkeypatch.setitem(sys.modules, module.__name__, module)
    undirected, directed = (
        _sampled_edges_of_training_batches(module, str(link_dataset), directed)
        for directed in (False, True))
    num_nodes = 2000
    reverses_kept = 0
    for batches, reverse_excluded in ((undirected, True), (directed, False)):
        for pairs, sampled in batches:
            keys = set((pairs[0] * num_nodes + pairs[1]).tolist())
            reverses = set((pairs[1] * num_nodes + pairs[0]).tolist()) - keys
            edges = set((sampled[0] * num_nodes + sampled[1]).tolist())
            assert sampled.size(1) > 10 * pairs.size(1)  # every neighbour
            assert not keys & edges
            if reverse_excluded:
                assert not reverses & edges
            else:
                reverses_kept += len(reverses & edges)
    assert reverses_kept > 0


def test_what_link_prediction_cannot_train_is_refused_in_one_line(
        small_dataset, capsys, nothing_spawned):
    module = load_link_example()
    with pytest.raises(SystemExit) as exited:
        module.main(["--dataset", str(small_dataset), "--gpu=0,1"])
    error = capsys.readouterr().err.strip()
    assert exited.value.code == 2 and len(error.splitlines()) == 1, error
    assert f"dataset '{small_dataset}' has no task named 'link_prediction' " \
        "(its tasks: node_classification)" in error

    # DGL's distributed engine runs node classification only.
    sys.path.insert(0, DISTRIBUTED)
    try:
        import dist_node_classification
    finally:
        sys.path.remove(DISTRIBUTED)
    with pytest.raises(SystemExit) as exited:
        dist_node_classification.main(["--example", LINK])
    error = capsys.readouterr().err.strip()
    assert exited.value.code == 2 and len(error.splitlines()) == 1, error
    assert "trains the dataset's task 'link_prediction'; this runs copies " \
        "of node_classification.py only" in error
