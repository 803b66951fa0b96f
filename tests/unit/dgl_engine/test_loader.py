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
