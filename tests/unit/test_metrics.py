"""The distributed contracts the example relies on, checked on real gloo
process groups: how DistributedItemSampler shards items, and that
weighted_reduce, evaluate and a torchmetrics AUROC (with
gbrun.metrics.gather_all_tensors) are exact when ranks hold different numbers of
items (including none). The passing pieces share one 4-rank group: most of
a group's time is its processes' start-up."""
import types

import pytest
import torch

from helpers import edited_copy, run_gloo_group


def _shards(rank):
    import dgl.graphbolt as gb

    from gbrun.graphbolt import batches_per_rank

    counts = []

    def batches(items, batch_size, **flags):
        sampler = gb.DistributedItemSampler(
            gb.ItemSet(items), batch_size=batch_size, **flags
        )
        handed_out = [batch.tolist() for batch in sampler]
        # What the progress bar counts (gbrun reads GraphBolt's privates).
        counts.append((len(handed_out), batches_per_rank(sampler)))
        return handed_out

    def shared_out(item_set, seed):
        """One training pass as gbrun.batches runs it: the ranks share out
        one permutation of the items."""
        from gbrun.graphbolt import share_one_permutation

        sampler = gb.DistributedItemSampler(item_set, batch_size=10,
                                            shuffle=True, drop_last=True,
                                            drop_uneven_inputs=True)
        handed_out = []
        for pass_seed in (seed, seed + 1):
            share_one_permutation(sampler, pass_seed)
            handed_out.append([batch.seed_nodes for batch in sampler])
        return handed_out

    small = torch.arange(15)
    big = torch.arange(400)
    by_type = gb.ItemSetDict({
        "a": gb.ItemSet(torch.arange(300), names="seed_nodes"),
        "b": gb.ItemSet(torch.arange(1000, 1100), names="seed_nodes")})
    return {
        "permuted": [[torch.cat(batches).tolist() for batches in passes]
                     for passes in (shared_out(gb.ItemSet(
                         big, names="seed_nodes"), 5), shared_out(
                         gb.ItemSet(big, names="seed_nodes"), 5))],
        "permuted_by_type": [
            [sorted(sum((batch[key].tolist() for batch in batches
                         for key in batch), [])) for batches in passes]
            for passes in [shared_out(by_type, 9)]],
        "plain": batches(small, 2),
        "drop_last": batches(small, 2, drop_last=True),
        "drop_both": batches(small, 2, drop_last=True, drop_uneven_inputs=True),
        "unshuffled": batches(big, 10),
        "shuffled": [batches(big, 10, shuffle=True) for _ in range(2)],
        "counts": counts,
    }


def _pieces(rank, metric_copies):
    """Every piece below on this rank of a 4-rank group."""
    return {"shards": _shards(rank),
            "reduce": _reduce(rank, [2.0, 9.0, 0.0, 0.0], [4, 10, 0, 0]),
            "evaluate": _evaluate_uneven(rank),
            "auroc": _auroc(rank, sync=True),
            "metrics": {name: _evaluate_copy(rank, path)
                        for name, path in metric_copies.items()}}


# Metrics a user makes from the macro-F1 diff by swapping its class.
SWAPPED = {"MulticlassF1Score": "f1_score",
           "MulticlassAUROC": "auroc",
           "MulticlassAveragePrecision": "average_precision"}


@pytest.fixture(scope="module")
def pieces(tmp_path_factory):
    out = tmp_path_factory.mktemp("pieces")
    copy = edited_copy(out, "macro_f1")
    text = open(copy).read()
    assert text.count("MulticlassF1Score(") == 1
    copies = {}
    for name in SWAPPED:
        copies[name] = str(out / f"{name}.py")
        with open(copies[name], "w") as f:
            f.write(text.replace("MulticlassF1Score(", f"{name}("))
    return run_gloo_group(_pieces, 4, out, copies)


@pytest.mark.slow
def test_distributed_item_sampler_sharding(pieces):
    shards = [piece["shards"] for piece in pieces]
    for shard in shards:
        assert [counted for counted, _ in shard["counts"]] == [
            expected for _, expected in shard["counts"]]
    assert [s["plain"] for s in shards] == [
        [[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], [10, 11]], [[12, 13], [14]]
    ]
    assert shards[3]["drop_last"] == [[12, 13]]
    assert [s["drop_last"] for s in shards[:3]] == [
        s["plain"] for s in shards[:3]
    ]
    assert [s["drop_both"] for s in shards] == [
        [[0, 1]], [[4, 5]], [[8, 9]], [[12, 13]]
    ]
    for shard in shards:
        own = sorted(sum(shard["unshuffled"], []))
        first, second = (sum(epoch, []) for epoch in shard["shuffled"])
        # Shuffling stays inside the rank's own share of the items ...
        assert sorted(first) == sorted(second) == own
        # ... and gives a new order every epoch.
        assert first != second and first != own
    # Training passes as gbrun runs them (share_one_permutation): each
    # pass, the ranks' shares are disjoint slices of one permutation of all
    # the items (400 / 4 ranks: every item once), new every pass, the same
    # again under the same seed, and not the contiguous slices above.
    for which in ("permuted", "permuted_by_type"):
        for epoch in (0, 1):
            seen = sum((s[which][0][epoch] for s in shards), [])
            assert len(seen) == len(set(seen)) == 400, which
            assert all(sorted(s[which][0][0]) != sorted(s[which][0][1])
                       for s in shards), which
    for shard in shards:
        # The same shares again (the order inside one is the rank's own
        # shuffling, unseeded here).
        assert list(map(sorted, shard["permuted"][0])) == list(
            map(sorted, shard["permuted"][1]))
        assert sorted(shard["permuted"][0][0]) != sorted(
            sum(shard["unshuffled"], []))
    # Node types mix in every rank's share.
    assert all(min(s["permuted_by_type"][0][0]) < 300 <= 1000 <= max(
        s["permuted_by_type"][0][0]) for s in shards)


def _reduce(rank, sums, counts):
    from node_classification import weighted_reduce

    value = torch.tensor(sums[rank])
    return weighted_reduce(value, counts[rank]).item()


@pytest.mark.slow
def test_weighted_reduce_is_exact_with_unequal_and_zero_counts(pieces):
    # Rank 0 has mean 0.5 over 4 items, rank 1 mean 0.9 over 10 items and
    # ranks 2 and 3 no items at all: the exact mean is (2 + 9) / 14.
    results = [piece["reduce"] for piece in pieces]
    assert abs(results[0] - 11 / 14) < 1e-6
    # A plain mean of per-rank means would give (0.5 + 0.9 + 0) / 3.
    assert abs(results[0] - (0.5 + 0.9) / 3) > 0.1


def _evaluate_uneven(rank):
    import torch.nn as nn

    from node_classification import FEATURE_KEYS, evaluate

    class Logits(nn.Module):  # the features are the logits
        def forward(self, blocks, x):
            return x

    class Wrapped(nn.Module):  # stands in for DDP: evaluate uses .module
        def __init__(self):
            super().__init__()
            self.module = Logits()

    def batch(logits, labels):
        return types.SimpleNamespace(
            node_features={FEATURE_KEYS[0]: torch.tensor(logits)},
            labels=torch.tensor(labels), blocks=None)

    # Rank 0: 2 of 3 right. Other ranks: no items at all, as
    # DistributedItemSampler gives a rank whose share of a small evaluation
    # set is empty.
    batches = [[batch([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]], [0, 1, 1])], [],
               [], []]
    return evaluate(Wrapped(), batches[rank], 2, torch.device("cpu")).item()


@pytest.mark.slow
def test_evaluate_is_exact_when_a_rank_has_no_items(pieces):
    assert pieces[0]["evaluate"] == pytest.approx(2 / 3)


def _auroc(rank, sync):
    import torchmetrics

    import gbrun.graphbolt
    import gbrun.metrics

    torch.manual_seed(0)
    scores, labels = torch.randn(30, 4), torch.arange(30) % 4
    kwargs = {"dist_sync_fn": gbrun.metrics.gather_all_tensors} if sync else {}
    auroc = torchmetrics.classification.MulticlassAUROC(4, **kwargs)
    if rank == 0:  # the other ranks have no items
        auroc.update(scores, labels)
    exact = torchmetrics.functional.auroc(scores, labels, task="multiclass",
                                          num_classes=4)
    return auroc.compute().item(), exact.item()


@pytest.mark.slow
def test_auroc_over_ranks_some_without_items(pieces, tmp_path):
    # torchmetrics' own gather gives an empty rank a 1-D float32
    # placeholder against rank 0's [30, 4] scores and int64 labels: gloo
    # aborts the job. gbrun.metrics.gather_all_tensors gathers alike on every rank.
    exact = pieces[0]["auroc"][1]
    assert [piece["auroc"][0] for piece in pieces] == pytest.approx(
        [exact] * 4, abs=1e-7)
    with pytest.raises(Exception, match="terminated with signal SIGABRT"):
        run_gloo_group(_auroc, 2, tmp_path, False, timeout=60)


def _scores():
    torch.manual_seed(0)
    return torch.randn(30, 4), torch.arange(30) % 4


def _evaluate_copy(rank, path):
    """A copy's evaluate() where rank 0 has every item and the other ranks
    none: its value on every rank."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"copy_{rank}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    scores, labels = _scores()
    data = types.SimpleNamespace(
        node_features={key: scores for key in module.FEATURE_KEYS},
        labels=labels, blocks=None)

    class Logits(torch.nn.Module):  # the features are the logits
        def forward(self, blocks, x):
            return x

    model = types.SimpleNamespace(module=Logits(), eval=lambda: None)
    batches = [data] if rank == 0 else []
    return module.evaluate(model, batches, 4, torch.device("cpu")).item()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SWAPPED))
def test_every_torchmetrics_metric_is_exact_on_every_rank_one_with_items(
        pieces, name):
    # Made the template's way (create_metric, then gbrun.metrics.across_ranks
    # in evaluate), with no sync argument of the metric's own: AUROC and
    # average precision would abort the gloo group with torchmetrics' gather.
    import torchmetrics

    exact = getattr(torchmetrics.functional, SWAPPED[name])(
        *_scores(), task="multiclass", num_classes=4, average="macro").item()
    assert [piece["metrics"][name] for piece in pieces] == pytest.approx(
        [exact] * 4, abs=1e-6)
