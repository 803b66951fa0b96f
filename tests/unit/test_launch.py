"""gbrun/launch.py, in-process: what a killed launch left behind is
removed by the next one."""
import os
import subprocess
import sys

from gbrun import launch


def test_a_later_launch_removes_the_rendezvous_a_killed_one_left(tmp_path):
    """Named after a launcher that no longer runs: removed. A running
    launcher's, another user's and a symlink: left alone."""
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    left = tmp_path / f"{launch.RENDEZVOUS}{ended.pid}-abc"
    left.mkdir()
    (left / "store").write_text("")
    running = tmp_path / f"{launch.RENDEZVOUS}{os.getpid()}-abc"
    running.mkdir()
    others = tmp_path / f"{launch.RENDEZVOUS}{ended.pid}-other"
    others.mkdir()
    os.chown(others, 12345, 12345)
    link = tmp_path / f"{launch.RENDEZVOUS}{ended.pid}-link"
    link.symlink_to(running)
    launch.reclaim_rendezvous(str(tmp_path))
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(
        [running.name, others.name, link.name])
