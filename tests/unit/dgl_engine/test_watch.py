"""gbrun/dgl_engine/watch.py: a trainer's failure is reported once. The
trainer's watch (TrainerWatch, which names a dead sampler) and its main
thread (in gbrun.launch.run_rank) share one report: whichever holds it
first reports, the other stays silent."""
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
