"""gbrun/dgl_engine/watch.py: a trainer's failure is reported once. The
trainer's watch (TrainerWatch, which names a dead sampler) and its main
thread (in gbrun.launch.run_rank) share one report: whichever holds it
first reports, the other stays silent. A graph server whose clients have
gone lets other processes have the cores its spinning threads take."""
import os
import threading
import time

import pytest


def test_a_trainers_failure_is_reported_once(capfd, monkeypatch):
    """A sampler that dies: the trainer's watch names it, and the main
    thread fails on the queue the sampler answered on, a consequence. Of
    the two, the first reports and the other is left out (CI once printed
    both: "rank 3 failed" twice)."""
    import threading

    import gbrun.dgl_engine.watch
    import gbrun.launch
    import node_classification as nc
    from helpers import cpu_plan

    args = nc.parse_args(["--gpu=0"])
    plan = cpu_plan(args, 1)

    def run(rank, plan, args, job):
        raise RuntimeError("the dead sampler's queue")

    # The watch and the main thread share one report, as the distributed
    # trainer makes them. The watch reported first (it holds the report):
    # the main thread's error is not printed.
    report = threading.Lock()
    with report:
        with pytest.raises(RuntimeError):
            gbrun.launch.run_rank(0, run, plan, args, None, report=report)
    assert "failed" not in capfd.readouterr().err
    # The main thread reports first: the watch stays silent (and leaves
    # the exit to it).
    exits = []
    monkeypatch.setattr(gbrun.dgl_engine.watch, "fail_fast",
                        lambda *args, **kwargs: exits.append(args))
    watch = gbrun.dgl_engine.watch.TrainerWatch(
        [], 1, "g", gbrun.dgl_engine.watch.Heartbeat(), report)
    watch.samplers = []
    with report:
        watch.fail("its sampler process 1 died")
    assert capfd.readouterr().err == "" and exits == []
    # Alone, each reports.
    with pytest.raises(RuntimeError):
        gbrun.launch.run_rank(0, run, plan, args, None, report=report)
    assert capfd.readouterr().err.startswith(
        "rank 0 failed:\nTraceback")
    report.release()  # the main thread's (its process ends, here not)
    monkeypatch.setenv("RANK", "3")
    watch.fail("its sampler process 1 died")
    assert capfd.readouterr().err == (
        "rank 3 failed: its sampler process 1 died; exiting\n")
    assert exits == [("g",)]


def test_a_server_idles_the_threads_that_spin_once_its_clients_are_gone():
    """As DGL's receive thread of a dead client spins: a thread busy on a
    core goes to SCHED_IDLE; a thread waiting (as one reading a clean
    shutdown waits in recv), and the main thread, keep their policy."""
    from gbrun.dgl_engine.watch import idle_spinning_threads

    stop = threading.Event()
    ids = {}

    def spin():
        ids["spin"] = threading.get_native_id()
        while not stop.is_set():
            pass

    def wait():
        ids["wait"] = threading.get_native_id()
        stop.wait()

    threads = [threading.Thread(target=spin), threading.Thread(target=wait)]
    for thread in threads:
        thread.start()
    try:
        spent = idle_spinning_threads({}, 0.5)
        time.sleep(0.5)
        idle_spinning_threads(spent, 0.5)
        assert os.sched_getscheduler(ids["spin"]) == os.SCHED_IDLE
        assert os.sched_getscheduler(ids["wait"]) == os.SCHED_OTHER
        assert os.sched_getscheduler(os.getpid()) == os.SCHED_OTHER
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        # pytest's own threads, had one been busy, run as before.
        for tid in map(int, os.listdir("/proc/self/task")):
            if os.sched_getscheduler(tid) == os.SCHED_IDLE:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
