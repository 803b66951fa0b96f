"""The loop a user edits: each line of train() that exact resume needs
refuses loudly when it is dropped or misplaced (never a silently inexact
resume, never an ignored SIGTERM), and train() reaches the package in at
most 8 lines. Each edit runs the copy's own run() in this process, as the
only rank of a gloo group, for 3 batches an epoch."""
import os
import dataclasses
import gc
import re
import signal
import subprocess
import sys
import traceback

import pytest
import torch
import torch.distributed as dist

from helpers import REPO, SCRIPT, cpu_plan

LOOP_TOUCH = os.path.join(os.path.dirname(REPO), "shared", "tools",
                          "loop_touch.py")
SCHEDULED = ("    scheduler = None\n", "    scheduler = "
             "torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)\n")
STEP_LATE = ('''        if scheduler is not None:
            scheduler.step()
''', "", '''                flush=True,
            )
''', '''                flush=True,
            )
        if scheduler is not None:
            scheduler.step()
''')
# (edit: pairs of old and new text, what the refusal says)
EDITS = {
    "upstream's epochs and loader instead of progress's": ((
        "    for epoch, batches in progress.epochs(train_loader):\n",
        "    for epoch in range(args.epochs):\n",
        "        with Join([model, batches]):\n", "        with Join([model]):\n",
        "            for data in batches:\n", "            for data in train_loader:\n",
        "                batches.add(loss, y.size(0))\n", "",
        "        total_loss, num_train_items = batches.totals()\n",
        "        total_loss, num_train_items = loss.detach(), 1\n",
        "                f\"{batches.speed}\",", "                \"\","),
        r"save_epoch\(record\) before the epoch's batches were trained to "
        r"the end"),
    "no Join": ((
        "        with Join([model, batches]):\n", "        if True:\n"),
        r"inside `with Join\(\[model, batches\]\):`"),
    "Join without the batches": ((
        "        with Join([model, batches]):\n",
        "        with Join([model]):\n"),
        r"inside `with Join\(\[model, batches\]\):`"),
    "the loader instead of the batches": ((
        "            for data in batches:\n",
        "            for data in train_loader:\n"),
        r"batches\.add\(loss, count\) ran \d+ times in 0 steps"),
    "no batches.add": ((
        "                batches.add(loss, y.size(0))\n", ""),
        r"batches\.add\(loss, count\) ran 0 times in 1 steps of epoch 0"),
    "a break in the batches": ((
        "                batches.add(loss, y.size(0))\n",
        "                batches.add(loss, y.size(0))\n                break\n"),
        r"save_epoch\(record\) before the epoch's batches were trained to "
        r"the end"),
    "no save_epoch": ((
        "            progress.save_epoch({\n", "            ({\n"),
        r"train\(\) ended epoch 0 without progress\.save_epoch\(record\)"),
    "the schedule stepped after save_epoch": (
        SCHEDULED + STEP_LATE,
        r"the scheduler changed after progress\.save_epoch\(record\) in "
        r"epoch 0 \(StepLR\.step\(\) after it\?\)"),
    "an accumulation left pending at the epoch's end": ((
        "            for data in batches:\n",
        "            for step, data in enumerate(batches, 1):\n",
        "                optimizer.zero_grad()\n                loss.backward()\n"
        "                optimizer.step()\n",
        "                loss.backward()\n                if step % 2 == 0:\n"
        "                    optimizer.step()\n"
        "                    optimizer.zero_grad()\n"),
        r"save_epoch\(record\) in epoch 0: the model holds gradients "
        r"accumulated since the last optimizer\.step\(\)"),
    "kept changed after save_epoch": ((
        '''                flush=True,
            )
''', '''                flush=True,
            )
            progress.kept["last"] = epoch
'''), r"progress\.kept changed after progress\.save_epoch\(record\)"),
}


def edited(tmp_path, name, replacements):
    text = open(SCRIPT).read()
    for old, new in zip(replacements[::2], replacements[1::2]):
        assert text.count(old) == 1, f"{name}: {old!r}"
        text = text.replace(old, new)
    path = tmp_path / "node_classification.py"
    path.write_text(text)
    return str(path)


def run_in_process(path, argv):
    """The copy at `path` as the only rank of a gloo group in this process:
    its load_job, then its run(), as gbrun.launch runs a rank."""
    from gbrun import cli, stop

    example = cli.load_example(path)
    args = example.parse_args(argv)
    plan = cpu_plan(args, 1)
    job = example.load_job(args, plan)
    # Its group meets through a file beside the copy (as launch.spawn's).
    plan = dataclasses.replace(plan, init_method="file://" + os.path.join(
        os.path.dirname(os.path.abspath(path)), "store"))
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT,
                                                 signal.SIGTERM)}
    plan = dataclasses.replace(plan, stop=stop.install(torch.device("cpu"),
                                                      None))
    try:
        example.run(0, plan, args, job)
    except BaseException as error:
        # run()'s frames (the DDP model, its reducer) go now, while the
        # group lives, as a rank's do: left to the exception's end, after
        # destroy_process_group, the reducer held the group's last reference
        # and gloo's destructor hung once (a CI run, "no save_epoch").
        traceback.clear_frames(error.__traceback__)
        gc.collect()
        raise
    finally:
        if job.start.lock:  # as the launcher's end releases it
            job.start.lock.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


@pytest.mark.slow
@pytest.mark.parametrize("edit", list(EDITS))
def test_a_dropped_or_misplaced_touch_point_is_refused(
        edit, tmp_path, small_dataset):
    replacements, refusal = EDITS[edit]
    path = edited(tmp_path, edit, replacements)
    argv = ["--dataset", small_dataset, "--gpu=0", "--epochs", "2",
            "--batch-size", "64", "--fanout", "5,5,5", "--max-batches", "3",
            "--seed", "1", "--threads", "1", "--checkpoint-dir",
            str(tmp_path / "ck")]
    with pytest.raises(RuntimeError, match=refusal):
        run_in_process(path, argv)


@pytest.mark.slow
def test_the_unedited_loop_runs_in_process(tmp_path, small_dataset, capsys):
    # The harness above, on the example as it is: the refusals come from
    # the edits, not from running a rank in this process.
    run_in_process(SCRIPT, [
        "--dataset", small_dataset, "--gpu=0", "--epochs", "2",
        "--batch-size", "64", "--fanout", "5,5,5", "--max-batches", "3",
        "--seed", "1", "--threads", "1", "--checkpoint-dir",
        str(tmp_path / "ck")])
    printed = capsys.readouterr().out
    assert printed.count("Epoch 0000") == 2 and "Test Accuracy" in printed


@pytest.mark.skipif(not os.path.exists(LOOP_TOUCH),
                    reason="the shared tools are not beside this checkout")
def test_train_reaches_the_package_in_at_most_8_lines():
    counted = subprocess.run([sys.executable, LOOP_TOUCH, SCRIPT],
                             capture_output=True, text=True, check=True)
    assert int(counted.stdout.split()[0]) <= 8, counted.stdout


@pytest.mark.slow
def test_the_examples_own_options_can_be_renamed(tmp_path, small_dataset,
                                                 capsys):
    # gbrun reads only the options it adds (gbrun.cli.add_run_options): a
    # copy that renames upstream's own trains, resumes and refuses as before.
    renames = {"--epochs": "--num-epochs", "--batch-size": "--seeds-per-batch",
               "--gpu": "--devices", "--num-workers": "--workers",
               "--lr": "--learning-rate"}
    text = open(SCRIPT).read()
    for old, new in renames.items():
        attribute = lambda option: "args." + option[2:].replace("-", "_")
        assert f'"{old}"' in text and attribute(old) in text, old
        text = re.sub(re.escape(attribute(old)) + r"\b", attribute(new),
                      text.replace(f'"{old}"', f'"{new}"'))
    path = tmp_path / "node_classification.py"
    path.write_text(text)
    argv = ["--dataset", small_dataset, "--devices=0", "--num-epochs", "1",
            "--seeds-per-batch", "64", "--fanout", "5,5,5", "--max-batches",
            "3", "--seed", "1", "--threads", "1", "--learning-rate", "0.01",
            "--checkpoint-dir", str(tmp_path / "ck")]
    run_in_process(str(path), argv)
    assert "Test Accuracy" in capsys.readouterr().out
    from gbrun.cli import UsageError

    with pytest.raises(UsageError, match="the checkpoint has already trained"
                       " 1 epochs; ask for more epochs"):
        run_in_process(str(path), [*argv, "--resume"])


@pytest.mark.slow
def test_progress_may_be_made_before_or_after_ddp(tmp_path, small_dataset):
    # No hidden order: Progress saves the model inside DDP as the model
    # itself (no "module." prefixes), whichever it was handed.
    text = open(SCRIPT).read()
    ddp = ("    model = DDP(model, device_ids=[device] if device.type == "
           "\"cuda\" else None)\n")
    made = "    progress = Progress(plan, job.start, model=model, optimizer=optimizer,\n"
    assert text.count(ddp) == 1 and text.count(made) == 1
    text = text.replace(ddp, "").replace(made, ddp + made)
    path = tmp_path / "node_classification.py"
    path.write_text(text)
    run_in_process(str(path), [
        "--dataset", small_dataset, "--gpu=0", "--epochs", "1",
        "--batch-size", "64", "--fanout", "5,5,5", "--max-batches", "2",
        "--threads", "1", "--checkpoint-dir", str(tmp_path / "ck")])
    saved = torch.load(tmp_path / "ck" / "checkpoint.pt", weights_only=True)
    assert saved["model"] and not any(k.startswith("module.")
                                      for k in saved["model"])


@pytest.mark.slow
def test_an_unseeded_resume_inside_an_epoch_says_it_is_not_exact(
        tmp_path, small_dataset, capsys, monkeypatch):
    # Unseeded, an epoch's order is a new shuffle in the resumed run: the
    # resume says so in one line instead of being silently inexact.
    from gbrun import stop
    from gbrun.progress import UNSEEDED_RESUME

    argv = ["--dataset", small_dataset, "--gpu=0", "--epochs", "1",
            "--batch-size", "64", "--fanout", "5,5,5", "--max-batches", "5",
            "--threads", "1", "--checkpoint-dir", str(tmp_path / "ck")]
    monkeypatch.setenv(stop.TEST_HOOK, "1")  # stops after step 2
    with pytest.raises(stop.Stopped):
        run_in_process(SCRIPT, argv)
    monkeypatch.delenv(stop.TEST_HOOK)
    capsys.readouterr()
    run_in_process(SCRIPT, [*argv, "--resume"])
    printed = capsys.readouterr().out.splitlines()
    at = printed.index(f"Resuming from {tmp_path / 'ck'} at epoch 0, step 2.")
    assert printed[at + 1] == UNSEEDED_RESUME.format(epoch=0)
