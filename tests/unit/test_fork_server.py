"""gbrun/fork_server.py and gbrun/preloaded.py: CPU ranks fork from the fork
server, GPU ranks are spawned; the server imports the launching script's
modules, but none that it could find elsewhere than the script did, and
then freezes them."""
import dataclasses
import os
import sys
import types

import gbrun.cli
from gbrun import fork_server
import node_classification as nc
from helpers import cpu_plan


def test_cpu_ranks_fork_from_the_fork_server_and_gpu_ranks_are_spawned():
    # A GPU rank must not come from a fork: the server would have imported
    # DGL's CUDA build, which may touch CUDA on import.
    plan = cpu_plan(nc.parse_args(["--dataset", "x"]), 2)
    assert plan.backend == "gloo"
    assert fork_server.rank_start_method(plan) == "forkserver"
    gpu_plan = dataclasses.replace(plan, backend="nccl")
    assert fork_server.rank_start_method(gpu_plan) == "spawn"


def script(folder, **names):
    """A launching script's module, as `python folder/copy.py` makes it."""
    main = types.ModuleType("__main__")
    main.__file__ = str(folder / "copy.py")
    vars(main).update(names)
    return main


def beside(folder, name, monkeypatch):
    """A module `name` imported from `folder` (a script's own module)."""
    (folder / f"{name}.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return __import__(name)


def test_the_server_imports_what_the_script_imported(tmp_path, monkeypatch):
    import torch
    import torchmetrics

    repo = os.path.dirname(nc.__file__)
    monkeypatch.chdir(repo)
    main = script(tmp_path / "copy", torch=torch, metric=torchmetrics,
                  fail=gbrun.cli.fail, FEATURES=["feat"],
                  SAGE=type("SAGE", (), {"__module__": "__main__"}))
    # The module a name comes from, whether the name is a module's or not;
    # not the script itself, which Python 3.11's server cannot import; last,
    # the module that freezes them (gc.freeze) once they are imported.
    assert fork_server.preload(main) == [
        "gbrun.cli", "torch", "torch._dynamo", "torchmetrics", "gbrun.preloaded"]
    # The real example's, as `python node_classification.py` launches it.
    assert {"dgl.graphbolt", "dgl.nn.pytorch", "gbrun.launch", "torch",
            "torchmetrics"} <= set(fork_server.preload(nc))


def test_a_module_the_server_could_find_elsewhere_is_left_to_the_ranks(
        tmp_path, monkeypatch):
    import torchmetrics

    folder = tmp_path / "copy"
    folder.mkdir()
    libs = tmp_path / "libs"
    libs.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    main = script(folder, my_model=beside(folder, "my_model", monkeypatch),
                  my_lib=beside(libs, "my_lib", monkeypatch),
                  torchmetrics=torchmetrics, fail=gbrun.cli.fail)
    # Beside the script, in a folder the script put on sys.path, or gbrun
    # from the checkout it is installed from (editable): the server's
    # sys.path has none of them, and another folder may hold another one.
    assert fork_server.preload(main) == ["torch._dynamo", "torchmetrics"]
    # A name taken in the working directory, where the server looks first.
    (elsewhere / "torchmetrics.py").write_text("")
    assert fork_server.preload(main) == ["torch._dynamo"]
    (elsewhere / "torchmetrics.py").unlink()
    (elsewhere / "torch").mkdir()
    assert fork_server.preload(main) == ["torchmetrics"]
    # Run from the script's own folder: the server finds the same file.
    monkeypatch.chdir(folder)
    assert fork_server.preload(main) == [
        "my_model", "torch._dynamo", "torchmetrics"]


def test_the_servers_last_import_freezes_what_it_imported():
    import gc
    import importlib

    sys.modules.pop("gbrun.preloaded", None)
    assert gc.get_freeze_count() == 0
    try:
        importlib.import_module("gbrun.preloaded")
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()  # this process goes on collecting as before
