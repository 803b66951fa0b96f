"""Both launchers and a rank's lifecycle: launch_ranks starts one process
per device (the job loaded once, in the parent; CPU ranks fork from
multiprocessing's fork server, GPU ranks are spawned), or runs this
process as one rank under torchrun (the job loaded by the ranks in turn).
Each rank runs the example's `run(rank, plan, args, job)` through run_rank,
which installs the rank's stop signal, reports its failure once, waits for
the other ranks at the end and tears its process group down.
"""
import ctypes
import dataclasses
import gc
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import stat
import sys
import tempfile
import threading
import traceback
from dataclasses import dataclass
from types import SimpleNamespace

import psutil
import setproctitle
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import ForkingPickler

from . import fork_server, sources, stop
from .collectives import barrier, destroy_process_group
from .cli import UsageError, fail, is_first_process
from .planning import plan_run

@dataclass
class Job:
    """What every rank needs, loaded once (the example's load_job makes it):
    the dataset and its item sets (train, validation, test), the sizes the
    model is built with, the fanout, and where the run starts (a
    gbrun.checkpoint.Start)."""

    dataset: object
    item_sets: tuple
    in_size: object  # a width, or {node type: width}
    num_classes: int  # None for link prediction
    fanout: list
    start: object


def launch_ranks(run, load_job, args, gpus, num_workers, plan=None):
    """Plans the run (plan_run), then runs `run(rank, plan, args, job)` on
    every rank: one spawned process per device, with the job loaded once by
    `load_job(args, plan)` in this process; or, under torchrun, this
    process as one rank with job None (the ranks then load it in turn, see
    load_job_in_turn). Bad input before training: one line, exit 2, nothing
    spawned."""
    try:
        plan = plan or plan_run(args, gpus, num_workers)
        if plan.rank_offset == 0:
            for notice in plan.notices:
                print(notice)
        # Both launchers hand the dataset to other processes through files
        # in /dev/shm (the default, file descriptors, can run out of them).
        mp.set_sharing_strategy("file_system")
        if plan.launcher == "torchrun":
            run_rank(plan.rank_offset, run, plan, args, None)
            return
        job = load_job(args, plan)
        sources.of(job.dataset).check_shared_memory()
    except UsageError as error:
        # Under torchrun every rank finds the same bad input: rank 0 says so.
        fail(error, speak=is_first_process())
    except KeyboardInterrupt:
        sys.exit(128 + signal.SIGINT)  # Ctrl-C before anything started
    try:
        spawn(run, plan, args, job)
    finally:
        # The interpreter's last collections would walk every object torch
        # and DGL made (about 1 CPU-s); nothing left at exit needs them.
        gc.freeze()


RENDEZVOUS = "gbrun-rendezvous-"


def reclaim_rendezvous(root):
    """Removes the rendezvous directories under `root` that this user's
    launches left when killed (SIGKILL runs no cleanup): those named after
    a launcher pid that no longer runs. Another user's, or a symlink, is
    left alone."""
    for name in os.listdir(root):
        pid = name[len(RENDEZVOUS):].split("-")[0]
        if not name.startswith(RENDEZVOUS) or not pid.isdigit() or psutil.pid_exists(int(pid)):
            continue
        path = os.path.join(root, name)
        info = os.lstat(path)
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
            shutil.rmtree(path, ignore_errors=True)


def spawn(run, plan, args, job):
    """One process per device; the first SIGTERM or SIGINT asks every rank
    to stop with a checkpoint, a second kills them. Exits non-zero when a
    rank failed, 128 + the signal's number when stopped by one."""
    # The ranks meet through a file in a private directory (mode 0700),
    # removed when the job ends: nothing listens on the network. One named
    # after its launcher, so that a later launch removes what a killed one
    # could not.
    reclaim_rendezvous(tempfile.gettempdir())
    with tempfile.TemporaryDirectory(
            prefix=f"{RENDEZVOUS}{os.getpid()}-") as meeting:
        plan = dataclasses.replace(plan, init_method=f"file://{meeting}/store")
        os.environ.update(plan.rank_env, GBRUN_COMMAND=launch_command())
        start_method = fork_server.rank_start_method(plan)
        starts = mp.get_context(start_method)
        if start_method == "forkserver":
            starts.set_forkserver_preload(
                fork_server.preload(sys.modules["__main__"]))
        stop_request = starts.Value("i", 0)
        ranks = SimpleNamespace(processes=[])
        # From here on a signal is a stop request, also while the ranks start:
        # they are born with SIGINT and SIGTERM blocked (the mask survives
        # exec, and a fork: the fork server, started now, has it too), so
        # that a Ctrl-C during their start cannot kill one of them
        # (torch's spawn wrapper would exit 0, and the others would wait for it)
        # but reaches them once they handle it (StopSignal).
        stop.relay_stop_signals(ranks, stop_request)
        unit = "gpu" if plan.backend == "nccl" else "CPU process"
        plural = "es" if unit.endswith("s") else "s"
        doing = "Training" if job.start.trains else "Predicting"
        print(f"{doing} with {plan.world_size} {unit}"
              f"{plural * (plan.world_size > 1)}.", flush=True)
        stop_signals = {signal.SIGINT, signal.SIGTERM}
        signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
        try:
            context = mp.start_processes(
                run_rank,
                args=(run, plan, args, job, stop_request, None, None,
                      os.getpid()),
                nprocs=plan.world_size,
                join=False,
                start_method=start_method,
            )
            ranks.processes = context.processes
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, stop_signals)
        try:
            join_ranks(context)
        except mp.ProcessRaisedException:
            # join_ranks has ended the other ranks; each failed rank printed its
            # traceback.
            sys.exit("error: training failed; each failing rank's error is above")
        except mp.ProcessExitedException as error:
            if refused_by_every_rank(context.processes):
                sys.exit(2)  # rank 0 said why, in one line
            signum = stop_request.value or stopped_by_their_own(context.processes)
            if signum:
                # Stopped on request; rank 0 said where and how to resume.
                sys.exit(128 + signum)
            sys.exit(f"error: training failed: {error}")
        # Every rank ended well: done, also if a signal came too late to stop
        # training (during the last epoch's validation or the test).


def refused_by_every_rank(processes):
    """True where every rank ended as a refusal does (exit status 2: rank 0
    printed the one line, gbrun.cli.fail), a full disk say."""
    for process in processes:
        process.join()  # join_ranks kills one that would not end
    return {process.exitcode for process in processes} == {2}


# How a rank that stopped on a signal exits.
STOP_CODES = {128 + signal.SIGTERM, 128 + signal.SIGINT}


def stopped_by_their_own(processes):
    """The signal the ranks stopped on, where one took a signal of its own
    (a scheduler that signals one process of the job) and the launcher got
    none: the ranks agreed and exited with 128 + its number. A rank exits
    so only after every rank agreed and the checkpoint was written, so a
    rank that was still exiting when the others' grace ran out, and was
    ended by a signal (a negative exit code), stopped too. Else 0."""
    for process in processes:
        process.join()  # join_ranks kills one that would not end
    codes = {process.exitcode for process in processes}
    stops = codes & STOP_CODES
    if len(stops) != 1 or any(code >= 0 for code in codes - stops):
        return 0
    return stops.pop() - 128


# After a rank fails, how long the others have to end on their own (a lost
# peer makes them fail too, each printing its own cause) before being killed.
RANK_GRACE_S = 10


def join_ranks(context, grace_s=RANK_GRACE_S):
    """torch's join of started processes, raising as it does when a rank
    failed, and sure to end the other ranks then: join() only sends them
    SIGTERM, which a rank takes as a stop request, and waits for them, so a
    rank hung after its peer died (in gloo's teardown, say) would keep the
    job alive for ever.
    Once a rank has failed the others get `grace_s`, then SIGKILL. A rank
    that stopped on a signal (128 + its number) is not a failure: the
    others, stopping at the same step, get `grace_s` to end on their own
    before join() would signal them in the middle of their exit."""
    processes = context.processes
    alive = list(processes)
    while alive and not any(p.exitcode for p in processes):
        multiprocessing.connection.wait([p.sentinel for p in alive])
        alive = [p for p in processes if p.exitcode is None]
    if alive and {p.exitcode for p in processes} - {None} <= STOP_CODES:
        multiprocessing.connection.wait([p.sentinel for p in alive], grace_s)
        alive = [p for p in processes if p.exitcode is None]
    if alive:
        def kill_survivors():
            for process in alive:
                if process.is_alive():
                    process.kill()

        timer = threading.Timer(grace_s, kill_survivors)
        timer.daemon = True
        timer.start()
    # The failed rank is the one ended by now, so join() reports its cause.
    while not context.join():
        pass


def run_rank(rank, run, plan, args, job, stop_request=None, on_failure=None,
             report=None, parent=None):
    """The entry point of each rank: run() with the rank's stop signal
    installed (gbrun.stop) and handed on in the plan, its failure reported, a wait for every rank at
    the end (rank 0 hosts the rendezvous store: nobody leaves before all are
    done) and its process group torn down. A rank stopped by a signal exits
    with 128 + its number, as a process killed by it would. `on_failure`:
    called, once the failure is reported, instead of the teardown (the
    distributed trainer exits at once). `report`: a lock whose holder
    reports the rank's failure, shared with a thread that watches the rank
    (the distributed trainer's TrainerWatch: a dead sampler, a lost server,
    no progress), so that the failure is reported once, by whichever comes
    first (the other one's report is a consequence: the main thread's error
    on the dead sampler's queue); by default, a lock of this call's own.
    The rank dies with its parent (die_with_parent: `parent`, the spawning
    launcher's pid, or torchrun's agent) and shows in `ps` as the launch's
    command line, after its rank."""
    die_with_parent(parent)
    if mp.get_start_method() == "forkserver":
        # Its DataLoader workers start as its own children, as a spawned
        # rank's do, not from the fork server: torch's workers end when
        # their parent does, and the server outlives a killed rank.
        mp.set_start_method("spawn", force=True)
    show_in_ps(f"[rank {rank}] {launch_command()}")
    if report is None:
        report = threading.Lock()
    stopped_by = 0
    try:
        plan = dataclasses.replace(
            plan, stop=stop.install(plan.device(rank), stop_request))
        run(rank, plan, args, job)
        if dist.is_initialized():
            wait_for_every_rank(rank, plan)
    except stop.Stopped as stopped:
        stopped_by = stopped.signum
    except UsageError as error:
        # Bad input found in the ranks (torchrun loads the data there):
        # one line, from rank 0; every rank exits 2.
        fail(error, speak=rank == 0)
    except Exception:
        # Report every failing rank here: the launcher shows only one, often
        # a peer's "connection closed" instead of the cause.
        if report.acquire(blocking=False):
            print(f"rank {rank} failed:\n{traceback.format_exc()}",
                  file=sys.stderr)
        if on_failure is not None:
            on_failure()
        raise
    finally:
        if dist.is_initialized():
            destroy_process_group()
    if stopped_by:
        sys.exit(128 + stopped_by)


# prctl(2)'s option: a signal when the parent dies (psutil has no prctl).
PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid=None):
    """This process gets SIGKILL when its parent dies (a launcher the OOM
    killer chose, a closed terminal, torchrun's agent, a trainer whose DGL
    sampler this is), instead of training on and writing checkpoints that
    a new job on the same directory would race. `parent_pid`: the
    launcher's pid, for its ranks; exits at once where it is already gone.
    A CPU rank's parent is multiprocessing's fork server, which outlives
    the launcher as long as a rank runs (each holds the server's pipe), so
    such a rank watches the launcher itself: multiprocessing's
    parent_process(), whose pipe closes when the launcher dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent_pid is None or os.getppid() == parent_pid:
        return
    launcher = multiprocessing.parent_process()
    if launcher is None or launcher.pid != parent_pid or not launcher.is_alive():
        os._exit(1)

    def die_with_launcher():
        launcher.join()
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=die_with_launcher, daemon=True).start()


def show_in_ps(title):
    """This process's title in ps, within its command line's own space (a
    long title is cut at its end): without SPT_NOENV, which setproctitle
    reads at its first call, it would move the environment to make room,
    emptying /proc/<pid>/environ (what ps e, psutil and debuggers read).
    The environment is left as it was."""
    saved = os.environ.get("SPT_NOENV")
    os.environ["SPT_NOENV"] = "1"
    try:
        setproctitle.setproctitle(title)
    finally:
        if saved is None:
            del os.environ["SPT_NOENV"]
        else:
            os.environ["SPT_NOENV"] = saved


def launch_command():
    """How the launch was started, as `ps` shows a command (a spawned rank's
    own command line is multiprocessing's): the launcher's, passed on in
    GBRUN_COMMAND, or this process's."""
    return os.environ.get("GBRUN_COMMAND") or " ".join(
        [os.path.basename(sys.executable), *sys.argv])


def wait_for_every_rank(rank, plan):
    """The barrier at the end of a run, bounded by plan.finish_timeout: a
    rank that the others wait for longer is taken to be stuck in a
    collective they have left (torch's DataLoader, for one, makes a process
    group, with every rank, each time it is iterated), and this rank ends
    the job, naming the cause, instead of waiting for ever."""
    def give_up():
        print(f"rank {rank} failed: it finished run() and waited "
              f"{plan.finish_timeout:g} s (--finish-timeout) for the other "
              "ranks, which have not: a rank that runs collectives alone "
              "after training waits for ever for the others (a GraphBolt or "
              "torch DataLoader, a metric's compute() or a reduce on some "
              "ranks only). Run evaluation on every rank, and predict with "
              "--predict (docs/customising.md)",
              file=sys.stderr, flush=True)
        os._exit(1)

    timer = threading.Timer(plan.finish_timeout, give_up)
    timer.daemon = True
    timer.start()
    try:
        barrier(plan.device(rank))
    finally:
        timer.cancel()


def load_job_in_turn(rank, plan, load_job, args):
    """Under torchrun there is no parent to load the dataset once. Rank 0
    goes first (it may download or preprocess into the dataset directory),
    then the first process of each other node. Each of them hands the other
    ranks of its node what it loaded through shared memory, as mp.spawn
    does: a node holds one copy of the graph and features, not one per rank.
    The waits run over gloo with plan.load_timeout, whatever the backend."""
    world = dist.new_group(backend="gloo", timeout=plan.load_timeout)
    job, refusal = None, [None]
    if rank == 0:
        try:
            job = load_job(args, plan)
            if plan.local_world_size > 1:
                sources.of(job.dataset).check_shared_memory()
        except UsageError as error:
            refusal = [str(error)]
    # Every rank learns whether rank 0 refused the input, and waits for it.
    dist.broadcast_object_list(refusal, src=0, group=world)
    if refusal[0] is not None:
        raise UsageError(refusal[0])
    if plan.local_rank == 0 and rank != 0:
        job = load_job(args, plan)
    # torchrun numbers the ranks of a node consecutively.
    node_group, _ = dist.new_subgroups(
        plan.local_world_size, backend="gloo", timeout=plan.load_timeout
    )
    # ForkingPickler moves tensors to shared memory in place and pickles only
    # their names, counting one reference that the unpickling process
    # releases. So each receiver gets its own pickle: one pickle loaded twice
    # releases twice, and the graph's pickle also carries tensors made while
    # pickling, unlinked once the first receiver is done with them.
    payloads = None
    if plan.local_rank == 0:
        payloads = [b""] + [
            bytes(ForkingPickler.dumps(job))
            for _ in range(plan.local_world_size - 1)
        ]
    mine = [None]
    dist.scatter_object_list(
        mine, payloads, src=rank - plan.local_rank, group=node_group
    )
    return job if plan.local_rank == 0 else pickle.loads(mine[0])

