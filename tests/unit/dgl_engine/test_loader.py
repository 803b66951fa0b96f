"""gbrun/dgl_engine/loader.py: DistLoader's passes over the items of
several node types take positions start..end of the types end to end, so
that a resumed pass starts at a step; the trainer's debugging options
(DebugHooks) fail one training loader and record from all."""
import torch


def test_a_loader_of_several_node_types_takes_positions_end_to_end():
    """DistLoader's passes over {node type: ids}: positions start..end of
    the types end to end (a resumed pass starts at a step)."""
    from gbrun.dgl_engine.loader import num_items, take

    parts = [("user", torch.arange(5)), ("item", torch.arange(10, 13))]
    assert num_items(dict(parts)) == 8 and num_items(torch.arange(4)) == 4
    taken = take(parts, 3, 7)
    assert [(ntype, ids.tolist()) for ntype, ids in taken] == [
        ("user", [3, 4]), ("item", [10, 11])]
    assert [(t, ids.tolist()) for t, ids in take(parts, 6, 99)] == [
        ("item", [11, 12])]
    assert take(parts, 8, 16) == []
    assert [(t, ids.tolist()) for t, ids in take([(None, torch.arange(4))],
                                                  1, 3)] == [(None, [1, 2])]


def test_debug_hooks_fail_one_training_loader_and_record_from_all():
    """--fail-after-batches / --hang-after-batches reach only trainer
    --fail-rank's training loader; --dump-seeds' record is one list that
    every loader appends to."""
    from gbrun.dgl_engine.loader import NO_HOOKS, DebugHooks

    hooks = DebugHooks(record=[], fail_after=3, fail_rank=1, hang=True)
    assert hooks.of_loader(True, 1) == hooks
    for is_train, rank in ((False, 1), (True, 0), (False, 0)):
        other = hooks.of_loader(is_train, rank)
        assert (other.fail_after, other.hang) == (None, False)
        assert other.record is hooks.record
    assert NO_HOOKS.of_loader(True, 0) == DebugHooks()


class FinishedFirst:
    """DGL's distributed loader with two sampler processes, where every
    second batch finishes before the one asked for before it (DGL 2.1 hands
    batches out as they finish): batches 1, 0, 3, 2, ..."""

    def __init__(self, g, nids, sampler, batch_size, shuffle, drop_last):
        ids = nids if not isinstance(nids, dict) else nids["user"]
        batches = [ids[i:i + batch_size] for i in range(0, len(ids), batch_size)]
        for i in range(0, len(batches) - 1, 2):
            batches[i], batches[i + 1] = batches[i + 1], batches[i]
        typed = (lambda seeds: {"user": seeds}) if isinstance(nids, dict) else (
            lambda seeds: seeds)
        self.batches = [(typed(seeds), typed(seeds), []) for seeds in batches]

    def __iter__(self):
        return iter(self.batches)


def test_a_training_pass_trains_its_batches_in_order_whatever_order_dgl_hands_them_out(
        monkeypatch):
    """With several samplers, DGL hands a pass's batches out as they
    finish; a training pass trains them in its own order, and a resumed
    pass (step 3) takes up exactly after the batches the stopped one
    trained: every node once per epoch."""
    from types import SimpleNamespace

    from gbrun.dgl_engine import loader

    monkeypatch.setattr(loader, "node_dataloader_class", lambda: FinishedFirst)
    nodes = torch.arange(100, 130)
    features = torch.arange(200.0)[:, None]
    g = SimpleNamespace(ndata={"feat": features, "label": torch.arange(200)})
    for nids, target in ((nodes, None), ({"user": nodes}, "user")):
        if target is not None:  # several node types: keyed by type
            g.nodes = {"user": SimpleNamespace(data=g.ndata)}
        dist = loader.DistLoader(
            g, nids, [5], 4, {"user": ["feat"]} if target else ["feat"],
            "label", "cpu", SimpleNamespace(beat=lambda: None),
            num_batches=7, target=target)
        order = dist.order(seed=3)[0][1]
        for step in (0, 3):
            batches = SimpleNamespace(step=step, rank=0, limit=None,
                                      name="train", pass_seed=lambda: 3)
            handed, total = dist.source(batches)
            seeds = [b.seed_nodes if target is None else b.seed_nodes["user"]
                     for b in handed]
            assert total == 7
            assert torch.equal(torch.cat(seeds), order[4 * step:28])


def test_a_batch_dgl_never_hands_out_is_an_error():
    from gbrun.dgl_engine.loader import in_request_order

    ids = torch.arange(12)
    sampled = [(None, ids[4:8], []), (None, ids[8:12], [])]  # no batch 0
    try:
        list(in_request_order(sampled, None, ids, 4))
    except RuntimeError as error:
        assert "batches [1, 2] of a pass but not batch 0" in str(error)
    else:
        raise AssertionError("a missing batch went unseen")
