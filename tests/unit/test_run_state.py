"""gbrun.run_state: the checkpoint file's contents in one place, saved,
restored and checked by one manager."""
import types

import pytest
import torch

from gbrun import run_state
from gbrun.run_state import CheckpointManager, RunState


def states(lr=0.1):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler}


def test_a_checkpoint_holds_the_states_then_the_run_state(tmp_path):
    saved = states()
    saved["model"](torch.ones(1, 3)).sum().backward()
    saved["optimizer"].step()
    run = RunState(seed=1, epochs=3, key={"fanout": [5]}, kept={"best": 0.5})
    manager = CheckpointManager(dict(saved, none=None), run, None,
                                str(tmp_path))
    manager.save(1, step=2, partial=[[1.5, 3], [2.5, 4]])
    checkpoint = run_state.read_checkpoint(
        str(tmp_path / run_state.CHECKPOINT_FILE))
    assert list(checkpoint) == [
        "model", "optimizer", "scheduler", "epoch", "step", "partial",
        "seed", "epochs", "config", "kept"]
    assert checkpoint["config"] == {"fanout": [5]}
    # Restored into new objects, as saved; the run's own seed, epochs and
    # key stay (start_or_resume checked the saved ones).
    again = states(lr=0.5)
    run = RunState(seed=1, epochs=4, key={"fanout": [5], "more": 1})
    CheckpointManager(again, run, checkpoint, str(tmp_path))
    assert (run.epoch, run.step, run.partial) == (1, 2, [[1.5, 3], [2.5, 4]])
    assert (run.epochs, run.key, run.kept) == (
        4, {"fanout": [5], "more": 1}, {"best": 0.5})
    assert run.kept is not checkpoint["kept"]
    assert again["optimizer"].param_groups[0]["lr"] == 0.1
    assert torch.equal(again["model"].weight, saved["model"].weight)


def test_an_older_checkpoint_restores_without_the_newer_entries():
    old = {name: obj.state_dict() for name, obj in states().items()}
    old.update(epoch=2, seed=1, config={})
    run = RunState(seed=1, epochs=3, key={})
    CheckpointManager(states(), run, old, "ck")
    assert (run.epoch, run.step, run.partial, run.kept) == (2, 0, None, {})
    # Its run's epochs unrecorded, it is finished at this run's.
    predict = types.SimpleNamespace(predict="p.npy")
    assert not run_state.predicts_only(old, predict, 3)
    assert run_state.predicts_only(old, predict, 2)


def test_a_change_after_the_epochs_checkpoint_is_refused(tmp_path):
    saved = states()
    manager = CheckpointManager(saved, RunState(1, 2, {}), None, None)
    manager.remember()
    manager.check_unchanged(0)
    saved["optimizer"].step()  # no gradients: nothing changes
    saved["scheduler"].step()
    with pytest.raises(RuntimeError, match=r"the scheduler changed after "
                       r"progress\.save_epoch\(record\) in epoch 0 "
                       r"\(StepLR\.step\(\) after it\?\)"):
        manager.check_unchanged(0)
    manager.remember()
    manager.run.kept["x"] = 1
    with pytest.raises(RuntimeError, match="progress.kept changed"):
        manager.check_unchanged(0)
