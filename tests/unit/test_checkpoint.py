"""gbrun.checkpoint: one job per checkpoint directory, files written so that
a crash, a full disk or a planted symlink never costs the previous one, a
file that is no checkpoint named as such, and model.pt loaded only into
the model that trained it. (Resume keys: tests/e2e/test_resume_refusals.py;
exact resumes: tests/e2e/test_resume.py.)"""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import gbrun.checkpoint as checkpoint
from gbrun.cli import UsageError
from gbrun.outputs import save_atomically

# A process that holds the lock of the directory argv[1] until killed.
HOLDER = """
import sys, time
import gbrun.checkpoint
lock = gbrun.checkpoint.DirectoryLock(sys.argv[1])
print("held", flush=True)
time.sleep(600)
"""


def test_a_directory_in_use_is_refused_until_its_holder_dies(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UsageError) as refused:
            checkpoint.DirectoryLock(str(tmp_path))
        assert str(refused.value) == (
            f"--checkpoint-dir {tmp_path} is in use by another job (pid "
            f"{holder.pid} on {os.uname().nodename}): wait for it to end, or "
            "use another directory")
    finally:
        holder.kill()  # SIGKILL: no clean-up of its own runs
        holder.wait()
    # The kernel released the lock with the process: nothing stale.
    lock = checkpoint.DirectoryLock(str(tmp_path))
    lock.close()


def test_a_lock_is_released_when_its_holder_lets_go(tmp_path):
    first = checkpoint.DirectoryLock(str(tmp_path))
    with pytest.raises(UsageError, match="in use by another job"):
        checkpoint.DirectoryLock(str(tmp_path))
    first.close()
    checkpoint.DirectoryLock(str(tmp_path)).close()


def test_a_symlink_planted_beside_the_checkpoint_is_not_followed(tmp_path):
    # Names a writer could have used before (checkpoint.pt.tmp, ...) lead
    # to a file of someone else's: saving must not write through them.
    victim = tmp_path / "victim"
    victim.write_text("precious")
    path = tmp_path / checkpoint.CHECKPOINT_FILE
    for name in ("checkpoint.pt.tmp", ".checkpoint.pt.tmp",
                 f"checkpoint.pt.{os.getpid()}",
                 f"checkpoint.pt.tmp{os.getpid()}"):  # the name of old
        os.symlink(victim, tmp_path / name)
    save_atomically({"epoch": 1}, str(path))
    assert victim.read_text() == "precious"
    assert torch.load(path, weights_only=True) == {"epoch": 1}
    assert not stat_mode(path) & 0o022  # umask 022: rw-r--r--


def stat_mode(path):
    return os.stat(path).st_mode & 0o777


# Run in a private mount namespace with a 1 MiB tmpfs at argv[1]: a small
# checkpoint, then one of 4 MB that cannot fit.
FULL_DISK = """
import os, sys, torch
import gbrun.checkpoint as checkpoint
from gbrun.cli import UsageError
from gbrun.outputs import save_atomically
path = os.path.join(sys.argv[1], checkpoint.CHECKPOINT_FILE)
save_atomically({"epoch": 1, "w": torch.zeros(10)}, path)
try:
    save_atomically({"epoch": 2, "w": torch.zeros(1 << 20)}, path)
except UsageError as error:
    print(error)
print(torch.load(path, weights_only=True)["epoch"], sorted(os.listdir(sys.argv[1])))
"""


def test_a_full_disk_is_one_line_and_the_previous_checkpoint_stays(tmp_path):
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare for a private tmpfs")
    target = tmp_path / "ckpt"
    target.mkdir()
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c",
         f"mount -t tmpfs -o size=1m tmpfs {target} && "
         f"exec {sys.executable} -c \"$0\" {target}", FULL_DISK],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    error, survivor = done.stdout.strip().splitlines()
    assert error == (
        f"could not write {target}/checkpoint.pt: No space left on device "
        "(about 4.0 MB to write); the previous checkpoint.pt there, if any, "
        "is intact"), error
    assert survivor == "1 ['checkpoint.pt']"  # no temporary file left


def test_a_file_that_is_no_checkpoint_is_named_corrupted(tmp_path):
    (tmp_path / checkpoint.CHECKPOINT_FILE).write_bytes(b"\x80\x04junk")
    with pytest.raises(UsageError) as refused:
        checkpoint.load_checkpoint(str(tmp_path), {})
    assert "is unreadable, truncated or corrupted" in str(refused.value)
    assert "not a zip archive" in str(refused.value)


@pytest.mark.parametrize("option, make", [
    ("--log-dir", lambda tmp: str(tmp / "a-file" / "logs")),
    ("--checkpoint-dir", lambda tmp: str(tmp / "a-file" / "ckpt")),
])
def test_a_directory_that_cannot_be_made_is_refused_before_spawning(
        tmp_path, capsys, nothing_spawned, small_dataset, option, make):
    import node_classification as nc

    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        nc.main(["--dataset", small_dataset, option, make(tmp_path)])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error.endswith(f"{option}: cannot make {make(tmp_path)} "
                          "(Not a directory)"), error
    assert len(error.splitlines()) == 1


def test_model_pt_loads_only_into_the_model_that_trained_it(tmp_path):
    import node_classification as nc

    trained = nc.create_model(8, 3)
    checkpoint.save_model(trained, str(tmp_path), {"dataset": "x"})
    again = nc.create_model(8, 3)
    assert checkpoint.load_model(again, str(tmp_path)) == {"dataset": "x"}
    for a, b in zip(trained.parameters(), again.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(UsageError) as refused:
        checkpoint.load_model(nc.create_model(8, 5), str(tmp_path))
    assert "model.pt was trained by another model" in str(refused.value)
    os.remove(tmp_path / checkpoint.MODEL_CONFIG_FILE)
    with pytest.raises(UsageError, match="writes it beside model.pt"):
        checkpoint.load_model(again, str(tmp_path))


def _planted(tmp_path, name, kind):
    """At tmp_path/name: a symlink, a hard link or a FIFO, each to a
    victim file of a user's; returns the victim's path."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    target = tmp_path / name
    if kind == "symlink":
        os.symlink(victim, target)
    elif kind == "hard link":
        os.link(victim, target)
    else:
        os.mkfifo(target)
    return victim


@pytest.mark.parametrize("kind, said", [
    ("symlink", "cannot be opened as a regular file (Too many levels of symbolic links"),
    ("hard link", "is a file with 2 links (a hard link to another)"),
    ("fifo", "regular file"),
])
def test_the_lock_and_metrics_are_never_written_through_a_link(tmp_path, kind, said):
    """A lock or metrics.jsonl planted as a link to a user's file, or a
    FIFO: one line naming it, the user's file untouched (a hard-linked lock
    was truncated to 'pid N on HOST' before)."""
    from gbrun import records

    for name, write, what in (
            (checkpoint.LOCK_FILE, lambda: checkpoint.DirectoryLock(str(tmp_path)),
             "--checkpoint-dir's lock file"),
            (records.METRICS_FILE, lambda: records.append_metrics(str(tmp_path), {"epoch": 0}),
             "--log-dir's")):
        victim = _planted(tmp_path, name, kind)
        with pytest.raises(UsageError) as refused:
            write()
        assert str(refused.value).startswith(f"{what} {tmp_path / name}")
        assert said in str(refused.value)
        if kind != "fifo":
            assert victim.read_text() == "precious"
        os.remove(tmp_path / name)
        victim.unlink()


def test_predict_replaces_only_an_earlier_prediction(tmp_path):
    """A file of the user's (a dataset's own .npy, say) at --predict's
    name is refused before anything trains; a prediction --predict wrote
    (its record beside it) is replaced, but not once it changed."""
    from gbrun import outputs

    path = tmp_path / "node_feat.npy"
    np.save(path, np.ones(3))
    with pytest.raises(UsageError, match="the file exists and is not one --predict wrote"):
        outputs.check_replaceable(str(path), "--predict")
    outputs.write_record(str(path))
    outputs.check_replaceable(str(path), "--predict")  # an earlier one
    np.save(path, np.zeros(3))
    with pytest.raises(UsageError, match="not one --predict wrote"):
        outputs.check_replaceable(str(path), "--predict")
