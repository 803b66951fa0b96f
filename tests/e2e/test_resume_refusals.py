"""What a resume refuses, in one line before a rank starts, and what it
restores: a checkpoint of another model, dataset, configuration, optimizer,
schedule, precision, dropout, seed or batch cut; a truncated one or one that
would run code; a finished checkpoint trains no further but predicts, also
on another dataset, saying so. All in-process, nothing spawned. (The runs
that stop and resume exactly: test_resume.py.)"""
import math
import os
import shutil

import pytest
import torch

import gbrun.checkpoint
import gbrun.outputs
import gbrun.trees
import gbrun.cli
import gbrun.data.datasets

from helpers import cpu_plan


class _RunsCode:
    """Unpickling this calls os.system: what a hostile checkpoint holds."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_that_would_run_code_is_refused(
    small_dataset, tmp_path, capsys, nothing_spawned
):
    path = make_checkpoint(tmp_path / "hostile", small_dataset)
    checkpoint = torch.load(path, weights_only=True)
    marker = tmp_path / "code-ran"
    checkpoint["config"]["extra"] = _RunsCode(marker)
    torch.save(checkpoint, path)
    error = resume_error(capsys, small_dataset, tmp_path / "hostile")
    assert "holds objects other than tensors and plain data" in error
    assert "nothing in it ran" in error
    assert not marker.exists()
    # The same file loaded the way the refusal protects against runs it.
    torch.load(path, weights_only=False)
    assert marker.exists()


DROPPED = object()


def make_checkpoint(directory, dataset_dir, position=(), run_epochs=None,
                    **changes):
    """A checkpoint of epoch 1 (or of `position`: epoch, step, partial sums)
    with seed 9 and `changes` to the configuration (DROPPED: no such key);
    `run_epochs`: the epochs its run was asked for (not recorded: None)."""
    import node_classification as nc

    args = nc.parse_args(["--dataset", dataset_dir, "--fanout", "5,5,5"])
    job = nc.load_job(args, cpu_plan(args, 1))
    model = nc.create_model(job.in_size, job.num_classes)
    optimizer = torch.optim.Adam(model.parameters())
    epoch, step, partial = position or (1, 0, None)
    checkpoint = {
        "model": model.state_dict(), "optimizer": optimizer.state_dict(),
        "epoch": epoch, "step": step, "partial": partial, "seed": 9,
        "config": {key: value for key, value in {**job.start.key, **changes}.items()
                   if value is not DROPPED},
    }
    if run_epochs is not None:
        checkpoint["epochs"] = run_epochs
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, gbrun.checkpoint.CHECKPOINT_FILE)
    gbrun.outputs.save_atomically(checkpoint, path)
    return path


def resume_error(capsys, dataset, directory, *extra):
    import node_classification as nc

    with pytest.raises(SystemExit) as exit_info:
        nc.main(["--dataset", dataset, "--fanout", "5,5,5", "--epochs", "3",
                 "--checkpoint-dir", str(directory), "--resume", *extra])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    return error


def test_resume_refuses_what_it_cannot_continue(small_dataset, tmp_path, capsys,
                                                nothing_spawned):
    import node_classification as nc

    assert "there is no checkpoint" in resume_error(
        capsys, small_dataset, tmp_path / "empty")

    # Another model: the first difference, on one line.
    model = nc.create_model(7, 10)
    other = nc.resume_key(model, *nc.create_optimizer(model, nc.parse_args([])),
                          nc.parse_args([]), [5, 5, 5])
    make_checkpoint(tmp_path / "other", small_dataset, model=other["model"])
    assert ("was made with another model (repr: '(fc_neigh): Linear("
            "in_features=7, out_features=256, bias=False)' then, '(fc_neigh): "
            "Linear(in_features=32, out_features=256, bias=False)' now)"
            ) in resume_error(
        capsys, small_dataset, tmp_path / "other")

    # The dataset by content: one file of other bytes is another dataset,
    # named by that file (a copy elsewhere is the same: test_staging.py).
    identity = gbrun.data.datasets.dataset_identity(small_dataset)
    files = identity["files"]
    edges = [name for name in files if name.startswith("edges")][0]
    for change, message in [
        ({"dataset": {"path": "/data/before",
                      "files": {**files, edges: "8 bytes, sha256 0000"}}},
         "another dataset, '/data/before', not this run's "
         f"'{os.path.abspath(small_dataset)}' ({edges}: '8 bytes, sha256 "
         f"0000' then, '{files[edges]}' now); refused"),
        ({"fanout": [1, 1, 1]}, "another fanout ([1, 1, 1] then, [5, 5, 5] now)"),
    ]:
        make_checkpoint(tmp_path / "changed", small_dataset, **change)
        assert message in resume_error(
            capsys, small_dataset, tmp_path / "changed")

    os.makedirs(tmp_path / "partial")
    torch.save({"model": {}, "epoch": 1},
               tmp_path / "partial" / gbrun.checkpoint.CHECKPOINT_FILE)
    assert "(KeyError: 'no config, optimizer, seed')" in resume_error(
        capsys, small_dataset, tmp_path / "partial")

    # The precision is part of what a resume must agree on ...
    make_checkpoint(tmp_path / "bf16", small_dataset, precision="bf16")
    assert "another precision ('bf16' then, 'fp32' now)" in (
        resume_error(capsys, small_dataset, tmp_path / "bf16"))
    # ... also where the checkpoint's configuration does not have it.
    make_checkpoint(tmp_path / "older", small_dataset, precision=DROPPED)
    assert "another precision (None then, 'fp32' now)" in (
        resume_error(capsys, small_dataset, tmp_path / "older"))

    # So is the dropout that ran: torch's and the fused kernel draw other
    # masks (the kernel builds here, as tests/unit/cpu/test_dropout.py needs).
    make_checkpoint(tmp_path / "fused", small_dataset)
    assert "another dropout ('fused' then, 'torch' now)" in resume_error(
        capsys, small_dataset, tmp_path / "fused", "--no-fused-dropout")

    make_checkpoint(tmp_path / "seeded", small_dataset)
    assert "--seed 4: the checkpoint was made with --seed 9" in resume_error(
        capsys, small_dataset, tmp_path / "seeded", "--seed", "4")
    assert "has already trained 1 epochs" in resume_error(
        capsys, small_dataset, tmp_path / "seeded", "--epochs", "1")

    # Stopped inside an epoch by two ranks: the sums are per rank.
    make_checkpoint(tmp_path / "inside", small_dataset,
                    position=(1, 3, [[1.5, 64], [1.25, 64]]))
    assert ("checkpoint stopped inside epoch 1 with 2 ranks; resume it with "
            "as many, not 1") in resume_error(
        capsys, small_dataset, tmp_path / "inside", "--gpu=0")

    # Another batch size cuts the epoch into other steps: refused inside
    # an epoch (the resume would skip other items), accepted at its end.
    assert ("stopped inside epoch 1 after step 3, which this run would cut "
            "into other steps (batch_size: 1024 then, 512 now)") in (
        resume_error(capsys, small_dataset, tmp_path / "inside", "--gpu=0,1",
                     "--batch-size", "512"))
    args = nc.parse_args(["--dataset", small_dataset, "--fanout", "5,5,5",
                          "--batch-size", "512"])
    key = nc.load_job(args, cpu_plan(args, 1)).start.key
    assert gbrun.checkpoint.load_checkpoint(tmp_path / "seeded", key)[
        "epoch"] == 1

    path = make_checkpoint(tmp_path / "cut", small_dataset)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    error = resume_error(capsys, small_dataset, tmp_path / "cut")
    assert f"checkpoint '{path}' is unreadable, truncated or corrupted" in error


def test_a_finished_checkpoint_predicts_on_another_dataset_saying_so(
        small_dataset, tmp_path, capsys, nothing_spawned):
    # The same nodes, features and labels, 10% fewer edges: a graph that
    # grew or was cleaned since training. --predict may use it, and says so;
    # training on it may not.
    import numpy as np

    import node_classification as nc

    other = tmp_path / "fewer_edges"
    shutil.copytree(small_dataset, other)
    edges = np.load(other / "edges.npy")
    np.save(other / "edges.npy", edges[:, : edges.shape[1] * 9 // 10])
    # Finished: its run trained the 3 epochs it was asked for.
    finished = make_checkpoint(tmp_path / "done", small_dataset,
                               position=(3, 0, None), run_epochs=3)
    unfinished = make_checkpoint(tmp_path / "half", small_dataset,
                                 run_epochs=3)
    predict = ["--predict", str(tmp_path / "p.npy")]
    # Only predicting, nothing that only training reads is compared or
    # checked: not --epochs (default 10), --fanout, --lr, nor a batch size
    # larger than the train set (1800 nodes).
    args = nc.parse_args(["--dataset", str(other), "--batch-size", "5000",
                          "--lr", "0.5", "--checkpoint-dir",
                          str(tmp_path / "done"), "--resume", *predict])
    job = nc.load_job(args, cpu_plan(args, 1))
    assert (job.start.epochs, job.start.trains) == (3, False)
    said = capsys.readouterr().out
    assert said.count(
        f"Predicting on another dataset, '{other}' (edges.npy: ") == 1, said
    assert said.count(
        f"with the model of {tmp_path / 'done'}, trained 3 epochs on "
        f"'{os.path.abspath(small_dataset)}'; nothing trains.") == 1, said
    job.start.lock.close()
    # Training on it is refused, naming both datasets, also where --predict
    # asks for more epochs of the run than it trained.
    both = (f"another dataset, '{os.path.abspath(small_dataset)}', not "
            f"this run's '{other}' (edges.npy: ")
    assert both in resume_error(capsys, str(other), tmp_path / "done")
    assert both in resume_error(capsys, str(other), tmp_path / "half",
                                *predict)
    # A finished checkpoint without --predict trains on (here: refused, at
    # --epochs); a training resume checks the train split.
    assert "has already trained 3 epochs" in resume_error(
        capsys, small_dataset, tmp_path / "done")
    assert "use --batch-size 1800 or less" in resume_error(
        capsys, small_dataset, tmp_path / "half", "--batch-size", "5000")
    assert os.path.exists(finished) and os.path.exists(unfinished)


def test_resume_refuses_another_optimizer_or_schedule_before_spawning(
        small_dataset, tmp_path, capsys, monkeypatch, nothing_spawned):
    # A checkpoint of the example as it is: Adam, no scheduler, --lr 0.001.
    import node_classification as nc

    make_checkpoint(tmp_path / "adam", small_dataset)

    def adamw(model, args):
        return torch.optim.AdamW(model.parameters(), lr=args.lr,
                                 weight_decay=0.01), None

    def with_schedule(model, args):
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
        return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 3, 0.5)

    def adam_decay(model, args):
        return torch.optim.Adam(model.parameters(), lr=args.lr,
                                weight_decay=0.01), None

    for create_optimizer, message in [
        (adamw, "another optimizer (class: 'Adam' then, 'AdamW' now)"),
        (with_schedule, "another scheduler (None then, {'class': 'StepLR', "
                        "'step_size': 3, 'gamma': 0.5} now)"),
        (adam_decay, "another optimizer (param_groups[0].weight_decay: 0 "
                     "then, 0.01 now)"),
    ]:
        monkeypatch.setattr(nc, "create_optimizer", create_optimizer)
        assert message in resume_error(capsys, small_dataset, tmp_path / "adam")
    monkeypatch.undo()
    assert ("another optimizer (param_groups[0].lr: 0.001 then, 0.5 now)" in
            resume_error(capsys, small_dataset, tmp_path / "adam", "--lr", "0.5"))

    # A warmup from 0 scales lr to 0 whatever --lr is: the key keeps the rate
    # set, and a change of the warmup is named as the scheduler's.
    def warmup(steps):
        def create_optimizer(model, args):
            optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
            return optimizer, torch.optim.lr_scheduler.LambdaLR(
                optimizer, lambda step: min(1.0, step / steps))
        return create_optimizer

    def warmup_from(start):
        def create_optimizer(model, args):
            optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
            return optimizer, torch.optim.lr_scheduler.LambdaLR(
                optimizer, lambda step: min(1.0, start + step / 10))
        return create_optimizer

    monkeypatch.setattr(nc, "create_optimizer", warmup(5))
    make_checkpoint(tmp_path / "warmup", small_dataset)
    assert ("another optimizer (param_groups[0].lr: 0.001 then, 0.01 now)"
            in resume_error(capsys, small_dataset, tmp_path / "warmup",
                            "--lr", "0.01"))
    monkeypatch.setattr(nc, "create_optimizer", warmup_from(0.5))
    make_checkpoint(tmp_path / "from_half", small_dataset)
    monkeypatch.setattr(nc, "create_optimizer", warmup_from(0.25))
    assert ("another scheduler (start_lrs: [0.0005] then, [0.00025] now)"
            in resume_error(capsys, small_dataset, tmp_path / "from_half"))


def test_the_resume_key_tells_apart_models_whose_repr_is_the_same():
    # A parameter's shape need not show in a module's repr (an embedding
    # table held as an nn.Parameter): the key compares shapes too, so such a
    # checkpoint is refused before a rank starts instead of failing inside.
    import node_classification as nc

    class Table(torch.nn.Module):
        def __init__(self, rows):
            super().__init__()
            self.table = torch.nn.Parameter(torch.zeros(rows, 4))

    args = nc.parse_args([])
    keys = []
    for rows in (3, 5):
        model = Table(rows)
        keys.append(nc.resume_key(model, *nc.create_optimizer(model, args),
                                  args, [5]))
    assert repr(Table(3)) == repr(Table(5))
    assert gbrun.trees.difference(keys[0], keys[1]) == (
        "model.shapes.table: [3, 4] then, [5, 4] now")


def test_resume_restores_optimizer_and_scheduler_as_saved():
    # A resumed run continues the schedule: the learning rate is the one the
    # scheduler had reached, not --lr (a cosine schedule resumed at --lr ran
    # its second epoch at the wrong rate).
    import node_classification as nc
    from gbrun.checkpoint import cpu_state
    from gbrun.run_state import restore

    def states(lr):
        model = nc.SAGE(4, 8, 2)
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, 4)
        return model, optimizer, scheduler

    model, optimizer, scheduler = states(0.001)
    model(*_tiny_batch()).sum().backward()
    optimizer.step()
    scheduler.step()
    saved = {"model": cpu_state(model), "optimizer": cpu_state(optimizer),
             "scheduler": cpu_state(scheduler), "epoch": 1, "step": 0}
    again, again_optimizer, again_scheduler = states(0.5)
    restore({"model": again, "optimizer": again_optimizer,
             "scheduler": again_scheduler}, saved, "ck")
    assert again_optimizer.param_groups[0]["lr"] == pytest.approx(
        0.001 * (1 + math.cos(math.pi / 4)) / 2)
    assert again_scheduler.last_epoch == 1
    step = again_optimizer.state_dict()["state"][0]["step"]
    assert float(step) == 1.0
    # A copy: stepping this optimizer leaves the checkpoint's state alone.
    assert again_optimizer.state[next(again.parameters())]["exp_avg"] is not (
        saved["optimizer"]["state"][0]["exp_avg"])
    # The example's own values come back too, on every rank, as copies.
    saved["kept"] = {"best": 0.75, "ema": {"w": torch.ones(2)}}
    kept = restore({"model": again}, saved, "ck")
    assert kept["best"] == 0.75 and kept.keys() == {"best", "ema"}
    assert torch.equal(kept["ema"]["w"], torch.ones(2))
    assert kept["ema"]["w"] is not saved["kept"]["ema"]["w"]
    # What a checkpoint cannot hold is refused when saving, naming it.
    kept["model"] = again
    with pytest.raises(TypeError, match=r"progress.kept\['model'\] is a SAGE"):
        gbrun.trees.check_plain(kept, "progress.kept")
    # A run with a scheduler refuses a checkpoint without one.
    del saved["scheduler"]
    with pytest.raises(gbrun.cli.UsageError, match="has no scheduler state"):
        restore({"model": again, "optimizer": again_optimizer,
                 "scheduler": again_scheduler}, saved, "ck")


def _tiny_batch():
    import dgl

    block = dgl.to_block(dgl.graph(([0, 1], [1, 0]), num_nodes=2))
    return [block] * 3, torch.ones(2, 4)


def test_resume_needs_a_checkpoint_dir(capsys, nothing_spawned):
    import node_classification as nc

    with pytest.raises(SystemExit) as exit_info:
        nc.main(["--resume"])
    assert exit_info.value.code == 2
    assert "--resume needs --checkpoint-dir" in capsys.readouterr().err
