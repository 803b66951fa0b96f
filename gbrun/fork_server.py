"""How the launcher's ranks start: CPU ranks fork from multiprocessing's fork
server, which imports the modules they need once (preload); GPU ranks are
spawned (rank_start_method)."""
import os
import sys
import sysconfig
import types


def rank_start_method(plan):
    """How the ranks start. CPU ranks fork from multiprocessing's fork
    server, a fresh process that imports preload(...) once and runs
    nothing else (no thread pool, nothing of the job, which each rank
    receives as a spawned one does): a rank then starts at once instead of
    after 3-4 s of CPU importing the same modules again. GPU ranks are
    spawned, as upstream's are: a process must not fork once CUDA is
    initialised, and DGL's CUDA build, which cannot be tried here, might
    touch it on import."""
    return "spawn" if plan.backend == "nccl" else "forkserver"


def preload(main):
    """What the fork server imports before it forks a CPU rank: each module
    the launching script `main` (sys.modules["__main__"]) holds a name from
    (torch, DGL, torchmetrics, gbrun's) and torch._dynamo, which torch 2.2's
    optimizers import at their first call; then gbrun.preloaded, which
    freezes them. Not "__main__" itself: Python 3.11 and 3.12's fork server
    never imports it (ensure_running asks spawn.get_preparation_data for
    "main_path", which it names "init_main_from_path": CPython gh-126631,
    fixed in 3.13), so each rank runs the script's body again, at once now
    that its imports are done. Left to the rank's own import: a module the
    server could find elsewhere (same_in_fork_server)."""
    names = {"torch._dynamo"}
    for key, value in vars(main).items():
        if key.startswith("__"):  # __builtins__, __loader__, ...
            continue
        if isinstance(value, types.ModuleType):
            names.add(value.__name__)
        elif isinstance(getattr(value, "__module__", None), str):
            names.add(value.__module__)
    names -= {main.__name__, "__main__", "__mp_main__"}
    wanted = [*sorted(names), "gbrun.preloaded"]  # that one freezes: last
    cwd = os.path.realpath(os.getcwd())
    try:
        taken = os.listdir(cwd)
    except OSError:
        taken = None  # unreadable: any name may be taken there
    installed = {os.path.realpath(path) for key, path in
                 sysconfig.get_paths().items()
                 if key in ("stdlib", "platstdlib", "purelib", "platlib")}
    return [name for name in wanted
            if same_in_fork_server(name, cwd, taken, installed)]


def same_in_fork_server(name, cwd, taken, installed):
    """True where the fork server would import module `name` from where this
    process did. The server's sys.path starts with its working directory
    `cwd` (whose entries are `taken`, None if unreadable) where this
    process's starts with the script's directory (3.11's server ignores the
    sys.path it is handed: CPython gh-117378), and it has none of the
    folders the script put on sys.path: only a module found in `cwd`, or in
    the interpreter's own folders `installed` (the standard library,
    site-packages) with its name not taken in `cwd`, is the same module
    there. Any other (beside the script, in a folder the script added, or
    installed in editable mode elsewhere) the ranks import themselves,
    rather than the server importing another one."""
    top = name.partition(".")[0]
    module = sys.modules.get(top)
    where = getattr(module, "__file__", None)
    if where is None:
        return False  # a builtin: nothing to import
    where = os.path.dirname(os.path.realpath(where))
    if hasattr(module, "__path__"):
        where = os.path.dirname(where)  # a package: the folder it is in
    if where == cwd:
        return True
    return (taken is not None and where in installed
            and not any(entry == top or entry.startswith(top + ".")
                        for entry in taken))
