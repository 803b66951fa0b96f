"""The launch plan and both launchers.

plan_run is the one place that decides devices, backend, world size,
rendezvous and threads; launch_ranks starts one process per device with
mp.spawn, or runs this process as one rank under torchrun. Each rank runs the
example's `run(rank, plan, args, job)` through run_rank, which installs the
rank's stop signal, reports its failure, waits for the other ranks at the
end and tears its process group down.
"""
import datetime
import multiprocessing.connection
import os
import pickle
import random
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from types import SimpleNamespace

import dgl
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import ForkingPickler

from . import dropout, stop
from .cli import UsageError, fail, is_first_process
from .graphbolt import INSTALL_CUDA_DGL
# How long ranks wait for the first load of the dataset under torchrun (a
# download and preprocessing of ogbn-papers100M takes hours). That wait runs
# over gloo: NCCL's own timeout (10 minutes in torch 2.2) would end it.
LOAD_TIMEOUT = datetime.timedelta(hours=6)


@dataclass
class Job:
    """What every rank needs, loaded once (the example's load_job makes it):
    the dataset and its item sets (train, validation, test), the sizes the
    model is built with, the fanout, and where the run starts (a
    gbrun.checkpoint.Start)."""

    dataset: object
    item_sets: tuple
    in_size: object  # a width, or {node type: width}
    num_classes: int
    fanout: list
    start: object


@dataclass(frozen=True)
class Plan:
    """How this launch runs, decided once by plan_run."""

    mode: str  # resolved: never "auto"
    storage: str  # "cpu", "pinned" or "cuda"
    backend: str  # "gloo" or "nccl"
    launcher: str  # "spawn" or "torchrun"
    world_size: int
    rank_offset: int  # global rank of this launch's first process
    local_rank: int
    local_world_size: int
    devices: list  # device strings, indexed by rank - rank_offset
    init_method: str
    threads: int
    autocast: bool  # bf16 autocast in the forward pass
    fused_dropout: bool  # the model's nn.Dropout as gbrun's one-pass kernel
    split_products: bool  # bf16 on CPU ranks: gbrun.split_products(model)
    rank_env: dict  # environment for spawned ranks
    notices: list  # lines to print before training
    load_timeout: datetime.timedelta = LOAD_TIMEOUT
    finish_timeout: float = 60.0  # seconds, --finish-timeout

    def device(self, rank):
        return torch.device(self.devices[rank - self.rank_offset])


def dgl_has_cuda():
    """True if this DGL and its GraphBolt library can run on CUDA. Asks for
    what only their CUDA builds register (libdgl's `device_api.cuda`,
    GraphBolt's `set_max_uva_threads` op), so it touches no GPU."""
    return (
        dgl.get_global_func("device_api.cuda", allow_missing=True) is not None
        and hasattr(torch.ops.graphbolt, "set_max_uva_threads")
    )


@dataclass(frozen=True)
class Machine:
    """What plan_run needs to know about this machine (tests make their own)."""

    cuda: bool  # torch sees CUDA devices
    dgl_cuda: bool  # DGL and GraphBolt were built with CUDA
    num_gpus: int
    num_cores: int
    gpu_bf16: bool = True  # the GPUs compute in bfloat16
    cpu_bf16: bool = False  # the CPU computes bfloat16 natively
    # Why gbrun's dropout kernel cannot be built here (None: it can), or a
    # function that says so: asked only where the plan would use the kernel
    # (it builds or loads it).
    dropout_problem: object = None


def detect_machine(precision):
    cuda, dgl_cuda = torch.cuda.is_available(), dgl_has_cuda()
    # Asked only when it matters: it initializes CUDA in this process.
    gpu_bf16 = not (precision == "bf16" and cuda and dgl_cuda) or (
        torch.cuda.is_bf16_supported()
    )
    cores = len(os.sched_getaffinity(0))
    return Machine(
        cuda, dgl_cuda, torch.cuda.device_count(), cores, gpu_bf16,
        cpu_has_bf16(), dropout.kernel_problem,
    )


def cpu_has_bf16():
    """True if the CPU has bfloat16 instructions (AVX512-BF16, AMX). Without
    them torch computes bf16 with scalar code: a SAGE step under autocast
    took 25x longer than in fp32 on an AVX2 machine."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def plan_run(args, gpus, num_workers, env=os.environ, machine=None,
             distributed=False):
    """The one place that decides devices, backend, world size, rendezvous
    and threads, from gbrun's own options in `args` (add_run_options), the
    example's device list `gpus` (--gpu) and its sampling workers per rank.
    Everything it needs comes in as arguments (the Machine: torch's CUDA,
    DGL's CUDA) so that every case can be checked without a GPU.
    `distributed`: for a trainer on DGL's distributed engine, whose graph
    and features stay on the graph servers (CPU storage), started as
    torchrun starts a rank (RANK, WORLD_SIZE, LOCAL_RANK)."""
    machine = machine or detect_machine(args.precision)
    cuda_available, dgl_cuda = machine.cuda, machine.dgl_cuda
    num_cuda_devices, num_cores = machine.num_gpus, machine.num_cores
    torchrun = all(key in env for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    mode, notices = args.mode, []
    if mode == "auto":
        gpu_mode = "cpu-cuda" if distributed else "pinned-cuda"
        mode = gpu_mode if cuda_available and dgl_cuda else "cpu-cpu"
        processes = ("trainer" if distributed else
                     "torchrun rank" if torchrun else "--gpu entry")
        if not cuda_available:
            notices.append(
                "CUDA is not available: using --mode cpu-cpu "
                f"(one CPU process per {processes}, gloo backend)."
            )
        elif not dgl_cuda:
            notices.append(
                f"torch sees {num_cuda_devices} GPU(s), but this DGL is a "
                "CPU-only build: using --mode cpu-cpu (one CPU process per "
                f"{processes}, gloo backend). To train on the GPUs: "
                f"{INSTALL_CUDA_DGL}"
            )
    storage, train_device = mode.split("-")
    check_mode(args, mode, machine, num_workers)
    if distributed and storage != "cpu":
        raise UsageError(
            f"--mode {mode}: on DGL's distributed engine the graph and "
            "features stay on the graph servers; use --mode cpu-cuda, "
            "cpu-cpu or auto"
        )

    if torchrun:
        # torchrun starts one process per rank; the device is LOCAL_RANK.
        rank, local_rank = int(env["RANK"]), int(env["LOCAL_RANK"])
        world_size = int(env["WORLD_SIZE"])
        local_world_size = int(env.get("LOCAL_WORLD_SIZE", world_size))
        device_ids, rank_offset = [local_rank], rank
        init_method = "env://"
    else:
        device_ids = parse_gpu_list(gpus)
        world_size = local_world_size = len(device_ids)
        rank_offset, local_rank = 0, 0
        port = args.master_port or free_port()
        init_method = f"tcp://127.0.0.1:{port}"

    if train_device == "cuda":
        missing = [i for i in device_ids if i >= num_cuda_devices]
        if missing and distributed:
            raise UsageError(
                f"{int(env.get('LOCAL_WORLD_SIZE', missing[0] + 1))} "
                f"trainers on this machine, one per GPU, but it has "
                f"{num_cuda_devices} CUDA device(s): start at most "
                f"{num_cuda_devices} trainers per machine, or train on the "
                "CPU (--mode cpu-cpu)"
            )
        if missing:
            raise UsageError(
                f"GPU {missing[0]} does not exist: {num_cuda_devices} CUDA "
                f"device(s) visible (ids 0..{num_cuda_devices - 1})"
            )
        devices = [f"cuda:{i}" for i in device_ids]
    else:
        devices = ["cpu"] * len(device_ids)

    if args.seed is not None and num_workers > 0:
        notices.append(
            "Note: with --num-workers > 0 sampling runs in worker processes "
            "that --seed does not reach; runs will differ."
        )
    autocast = args.precision == "bf16" and (
        train_device == "cuda" or machine.cpu_bf16
    )
    if args.precision == "bf16" and not autocast:
        notices.append(
            "--precision bf16: this CPU has no bfloat16 instructions "
            "(AVX512-BF16, AMX), so features are stored in bf16 (half the "
            "memory) and the model computes in fp32."
        )
    # GPUs have torch's fused dropout already.
    fused_dropout = train_device == "cpu" and args.fused_dropout
    problem = machine.dropout_problem
    if fused_dropout and callable(problem):
        problem = problem()
    if fused_dropout and problem:
        notices.append(f"--fused-dropout: {problem}; the model keeps "
                       "torch's dropout.")
        fused_dropout = False
    # Upstream's cpu_count // 2 // world_size is 0 on small machines.
    threads = args.threads or max(1, num_cores // local_world_size)
    rank_env = {"OMP_NUM_THREADS": str(threads)}
    if train_device == "cpu":
        # CPU ranks see no GPU, so no library starts CUDA in them (under
        # torchrun the ranks already run: this cannot apply).
        rank_env["CUDA_VISIBLE_DEVICES"] = ""
    return Plan(
        mode=mode,
        storage=storage,
        backend="nccl" if train_device == "cuda" else "gloo",
        launcher="torchrun" if torchrun else "spawn",
        world_size=world_size,
        rank_offset=rank_offset,
        local_rank=local_rank,
        local_world_size=local_world_size,
        devices=devices,
        init_method=init_method,
        threads=threads,
        autocast=autocast,
        fused_dropout=fused_dropout,
        # oneDNN builds each new bf16 product shape; fp32 goes to MKL.
        split_products=autocast and train_device == "cpu",
        rank_env=rank_env,
        notices=notices,
        finish_timeout=args.finish_timeout,
    )


def check_mode(args, mode, machine, num_workers):
    """Refuses a mode this machine cannot run, or options it cannot use."""
    storage, train_device = mode.split("-")
    cuda_available, dgl_cuda = machine.cuda, machine.dgl_cuda
    if train_device == "cuda" and not cuda_available:
        raise UsageError(
            f"--mode {mode} needs CUDA, but no CUDA device is available; "
            "use --mode cpu-cpu or auto"
        )
    if train_device == "cuda" and not dgl_cuda:
        raise UsageError(
            f"--mode {mode} needs CUDA, but this DGL is a CPU-only build "
            f"(as PyPI's is); install DGL's CUDA build: {INSTALL_CUDA_DGL}"
        )
    if args.gpu_cache_size > 0 and storage != "pinned":
        raise UsageError(
            f"--gpu-cache-size {args.gpu_cache_size} needs a CUDA training "
            f"device with pinned features (--mode pinned-cuda), but --mode "
            f"is {mode}"
        )
    if args.precision == "bf16" and train_device == "cuda" and not (
        machine.gpu_bf16
    ):
        raise UsageError(
            "--precision bf16: this GPU does not compute in bfloat16 "
            "(torch.cuda.is_bf16_supported() is False); use --precision fp32"
        )
    if num_workers > 0 and storage != "cpu":
        raise UsageError(
            f"--num-workers {num_workers}: with --mode {mode} sampling "
            "runs on the GPU, which worker processes cannot do; use "
            "--num-workers 0"
        )


def free_port():
    """A TCP port free now, for the rendezvous that rank 0 binds seconds
    later (two runs never collide on a fixed port). It comes from below the
    kernel's ephemeral range: a port in that range can be handed to any
    outgoing connection on the machine before rank 0 binds it."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768  # Linux's default
    below = range(max(1024, ephemeral_low - 12000), ephemeral_low)
    # Not the seeded generator: two runs with one --seed pick apart.
    tries = random.SystemRandom().sample(below, min(100, len(below)))
    for port in tries:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))  # let the kernel choose
        return sock.getsockname()[1]


def parse_gpu_list(text):
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise UsageError(
            f"--gpu '{text}': expected device ids like 0 or 0,1,2,3"
        ) from None
    if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise UsageError(
            f"--gpu '{text}': ids must be distinct and non-negative"
        )
    return ids


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
        check_shared_memory(job.dataset)
    except UsageError as error:
        # Under torchrun every rank finds the same bad input: rank 0 says so.
        fail(error, speak=is_first_process())
    except KeyboardInterrupt:
        sys.exit(128 + signal.SIGINT)  # Ctrl-C before anything started
    spawn(run, plan, args, job)


def spawn(run, plan, args, job):
    """One process per device; the first SIGTERM or SIGINT asks every rank
    to stop with a checkpoint, a second kills them. Exits non-zero when a
    rank failed, 128 + the signal's number when stopped by one."""
    os.environ.update(plan.rank_env)
    stop_request = mp.get_context("spawn").Value("i", 0)
    ranks = SimpleNamespace(processes=[])
    # From here on a signal is a stop request, also while the ranks start:
    # they are born with SIGINT and SIGTERM blocked (the mask survives
    # exec), so that a Ctrl-C during their imports cannot kill one of them
    # (torch's spawn wrapper would exit 0, and the others would wait for it)
    # but reaches them once they handle it (StopSignal).
    stop.relay_stop_signals(ranks, stop_request)
    unit = "gpu" if plan.backend == "nccl" else "CPU process"
    plural = "es" if unit.endswith("s") else "s"
    print(f"Training with {plan.world_size} {unit}"
          f"{plural * (plan.world_size > 1)}.", flush=True)
    stop_signals = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    try:
        context = mp.spawn(
            run_rank,
            args=(run, plan, args, job, stop_request),
            nprocs=plan.world_size,
            join=False,
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
        signum = stop_request.value or stopped_by_their_own(context.processes)
        if signum:
            # Stopped on request; rank 0 said where and how to resume.
            sys.exit(128 + signum)
        sys.exit(f"error: training failed: {error}")
    # Every rank ended well: done, also if a signal came too late to stop
    # training (during the last epoch's validation or the test).


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
    """mp.spawn's join, raising as it does when a rank failed, and sure to
    end the other ranks then: join() only sends them SIGTERM, which a rank
    takes as a stop request, and waits for them, so a rank hung after its
    peer died (in gloo's teardown, say) would keep the job alive for ever.
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


# A rank's failure is reported once: by its main thread's exception, or by
# a thread that watches the rank (the distributed trainer's TrainerWatch:
# a dead sampler, a lost server, no progress), whichever comes first; the
# other one's report (a consequence: the main thread's error on the dead
# sampler's queue) is left out.
FAILURE_REPORT = threading.Lock()


def run_rank(rank, run, plan, args, job, stop_request=None, on_failure=None):
    """The entry point of each rank: run() with the rank's stop signal
    installed (gbrun.stop), its failure reported, a wait for every rank at
    the end (rank 0 hosts the rendezvous store: nobody leaves before all are
    done) and its process group torn down. A rank stopped by a signal exits
    with 128 + its number, as a process killed by it would. `on_failure`:
    called, once the failure is reported, instead of the teardown (the
    distributed trainer exits at once)."""
    stopped_by = 0
    try:
        stop.install(plan.device(rank), stop_request)
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
        reported = FAILURE_REPORT.acquire(blocking=False)
        if reported:
            print(f"rank {rank} failed:\n{traceback.format_exc()}",
                  file=sys.stderr)
        if on_failure is not None:
            on_failure()
        if reported:
            # No on_failure ended the process: a later run in it (the tests
            # run several) reports its own failure.
            FAILURE_REPORT.release()
        raise
    finally:
        if dist.is_initialized():
            destroy_process_group()
    if stopped_by:
        sys.exit(128 + stopped_by)


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
                check_shared_memory(job.dataset)
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


def check_shared_memory(dataset, path="/dev/shm"):
    """Refuses a dataset that does not fit in `path`, where the ranks' one
    copy of it goes: writing past its end kills the process with SIGBUS (a
    bare 'Bus error'), as in Docker, whose /dev/shm is 64 MB by default."""
    graph = dataset.graph
    tensors = [graph.csc_indptr, graph.indices, graph.node_type_offset,
               graph.type_per_edge]
    tensors += list((graph.edge_attributes or {}).values())
    tensors += [dataset.feature.read(*key) for key in dataset.feature.keys()]
    needed = sum(
        t.untyped_storage().nbytes() for t in tensors
        if t is not None and not t.untyped_storage().is_shared()
    )
    try:
        stat = os.statvfs(path)
    except OSError:
        return  # no such file system: torch will say what it lacks
    free = stat.f_bavail * stat.f_frsize
    if needed > free:
        raise UsageError(
            f"the graph and features need {needed / 2**20:,.1f} MB of shared "
            f"memory, but {path} has {free / 2**20:,.1f} MB free (in Docker: "
            "docker run --shm-size=... or --ipc=host)"
        )


def barrier(device):
    """A barrier that tells NCCL the rank's GPU: before the first NCCL
    collective torch 2.2 would otherwise guess it, and can hang."""
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def destroy_process_group():
    """torch 2.2 destroys a gloo group while holding the GIL, and can
    deadlock if a gloo worker thread still has to free a tensor of a recent
    collective (freeing needs the GIL); fixed upstream in pytorch#154976.
    Sleeping first releases the GIL so that the worker can finish: in a
    2-rank stress test under load, 4 of 25 runs hung without it, 0 of 25
    with it."""
    time.sleep(0.2)
    dist.destroy_process_group()
