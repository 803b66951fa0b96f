"""The launch plan: the one place that decides devices, backend, world
size, rendezvous and threads (plan_run), from gbrun's options, the
example's device list and what this machine has (a Machine, which tests
make themselves, so that every decision is checked without a GPU)."""
import datetime
import os
from dataclasses import dataclass

import dgl
import torch

from .cli import UsageError
from .cpu import dropout, info
from .graphbolt import INSTALL_CUDA_DGL

# How long ranks wait for the first load of the dataset under torchrun (a
# download and preprocessing of ogbn-papers100M takes hours). That wait runs
# over gloo: NCCL's own timeout (10 minutes in torch 2.2) would end it.
LOAD_TIMEOUT = datetime.timedelta(hours=6)


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
    # The rendezvous: "env://" under torchrun; with the launcher's ranks,
    # where init_method is None, launch.spawn makes a file:// store in a
    # private directory (plan_run changes nothing on the machine).
    init_method: str
    threads: int
    autocast: bool  # bf16 autocast in the forward pass
    fused_dropout: bool  # the model's nn.Dropout as gbrun's one-pass kernel
    split_products: bool  # bf16 on CPU ranks: gbrun.cpu.products
    rank_env: dict  # environment for spawned ranks
    notices: list  # lines to print before training
    load_timeout: datetime.timedelta = LOAD_TIMEOUT
    finish_timeout: float = 60.0  # seconds, --finish-timeout
    # The rank's gbrun.stop.StopSignal, which gbrun.launch.run_rank installs
    # in the rank and hands on in the plan (None in the launcher).
    stop: object = None

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
        info.has_bf16(), dropout.kernel_problem,
    )


def plan_run(args, gpus, num_workers, env=os.environ, machine=None,
             distributed=False):
    """The one place that decides devices, backend, world size, rendezvous
    and threads, from gbrun's own options in `args` (add_run_options), the
    example's device list `gpus` (--gpu) and its sampling workers per rank.
    Everything it needs comes in as arguments (the Machine: torch's CUDA,
    DGL's CUDA) so that every case can be checked without a GPU.
    `distributed`: for a trainer on DGL's distributed engine, whose graph
    and features stay on the graph servers (CPU storage), started as
    torchrun starts a rank (RANK, WORLD_SIZE, LOCAL_RANK).
    Each decision is one function below: the mode, where the ranks are,
    their devices, how the model computes, threads, the ranks' environment."""
    machine = machine or detect_machine(args.precision)
    torchrun = all(key in env for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    mode, notices = choose_mode(args.mode, machine, torchrun, distributed)
    storage, train_device = mode.split("-")
    check_mode(args, mode, machine, num_workers, distributed)
    device_ids, ranks = place_ranks(gpus, env, torchrun)
    devices = choose_devices(device_ids, train_device, machine, env,
                             distributed)
    if args.seed is not None and num_workers > 0:
        notices.append(
            "Note: with --num-workers > 0 sampling runs in worker processes "
            "that --seed does not reach; runs will differ" + (
                "." if distributed else ", and a resume inside an epoch "
                "trains some of its nodes twice and others not at all (the "
                "workers keep the order of the epoch they started in)."))
    compute, compute_notices = choose_compute(args, train_device, machine)
    threads, thread_notices = choose_threads(
        args.threads, train_device, ranks["local_world_size"],
        machine.num_cores)
    return Plan(
        mode=mode,
        storage=storage,
        backend="nccl" if train_device == "cuda" else "gloo",
        launcher="torchrun" if torchrun else "spawn",
        devices=devices,
        threads=threads,
        rank_env=rank_environment(threads, train_device, torchrun),
        notices=notices + compute_notices + thread_notices,
        finish_timeout=args.finish_timeout,
        **ranks,
        **compute,
    )


def choose_mode(mode, machine, torchrun, distributed):
    """--mode, with "auto" resolved from what the machine has; and the
    notice that says why "auto" means CPU ranks, if it does."""
    if mode != "auto":
        return mode, []
    gpu_mode = "cpu-cuda" if distributed else "pinned-cuda"
    if machine.cuda and machine.dgl_cuda:
        return gpu_mode, []
    processes = ("trainer" if distributed else
                 "torchrun rank" if torchrun else "--gpu entry")
    if not machine.cuda:
        return "cpu-cpu", [
            "CUDA is not available: using --mode cpu-cpu "
            f"(one CPU process per {processes}, gloo backend)."
        ]
    return "cpu-cpu", [
        f"torch sees {machine.num_gpus} GPU(s), but this DGL is a "
        "CPU-only build: using --mode cpu-cpu (one CPU process per "
        f"{processes}, gloo backend). To train on the GPUs: "
        f"{INSTALL_CUDA_DGL}"
    ]


def place_ranks(gpus, env, torchrun):
    """The device ids of this launch's ranks, and where the ranks are (the
    Plan's world_size, rank_offset, local_rank, local_world_size and
    init_method): given by torchrun's environment, or one rank per --gpu
    entry."""
    if torchrun:
        # torchrun starts one process per rank; the device is LOCAL_RANK.
        rank, local_rank = int(env["RANK"]), int(env["LOCAL_RANK"])
        world_size = int(env["WORLD_SIZE"])
        return [local_rank], dict(
            world_size=world_size, rank_offset=rank, local_rank=local_rank,
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", world_size)),
            init_method="env://")
    device_ids = parse_gpu_list(gpus)
    # One machine stays on it: the ranks meet through a file (no TCP
    # store, which listens on every interface), and gloo's and NCCL's
    # sockets are bound to the loopback interface (rank_environment).
    return device_ids, dict(
        world_size=len(device_ids), rank_offset=0, local_rank=0,
        local_world_size=len(device_ids), init_method=None)


def choose_devices(device_ids, train_device, machine, env, distributed):
    """The ranks' device strings, refused where a GPU id does not exist."""
    if train_device != "cuda":
        return ["cpu"] * len(device_ids)
    num_cuda_devices = machine.num_gpus
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
    return [f"cuda:{i}" for i in device_ids]


def choose_compute(args, train_device, machine):
    """How the model computes (the Plan's autocast, fused_dropout and
    split_products), and the notices where an option cannot apply."""
    notices = []
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
    return dict(
        autocast=autocast, fused_dropout=fused_dropout,
        # oneDNN builds each new bf16 product shape; fp32 goes to MKL.
        split_products=autocast and train_device == "cpu",
    ), notices


def choose_threads(threads, train_device, local_world_size, num_cores):
    """Threads per rank (--threads, or the cores shared among this
    machine's ranks), and a notice where CPU ranks outnumber the cores."""
    notices = []
    if train_device == "cpu" and local_world_size > num_cores:
        notices.append(
            f"{local_world_size} CPU processes on {num_cores} cores: they "
            "take turns on the cores, one thread each, and each step trains "
            f"{local_world_size} x --batch-size seeds (the batch size is per "
            "process), so an epoch has fewer steps than with "
            f"{num_cores} processes.")
    # Upstream's cpu_count // 2 // world_size is 0 on small machines.
    return threads or max(1, num_cores // local_world_size), notices


def rank_environment(threads, train_device, torchrun):
    """The environment spawned ranks start with."""
    rank_env = {"OMP_NUM_THREADS": str(threads)}
    if not torchrun:
        rank_env.update(GLOO_SOCKET_IFNAME="lo", NCCL_SOCKET_IFNAME="lo")
        # GraphBolt (dgl 2.1-2.4, internal/sample_utils.py) samples a graph
        # of several node types in the order of a set of their names, which
        # Python orders by the process's string hash: a seeded run repeats
        # it, and a resume continues it, only where every launch's ranks
        # hash alike (under torchrun, export PYTHONHASHSEED yourself).
        rank_env["PYTHONHASHSEED"] = os.environ.get("PYTHONHASHSEED", "0")
    if train_device == "cpu":
        # CPU ranks see no GPU, so no library starts CUDA in them (under
        # torchrun the ranks already run: this cannot apply).
        rank_env["CUDA_VISIBLE_DEVICES"] = ""
    return rank_env


def check_mode(args, mode, machine, num_workers, distributed=False):
    """Refuses a mode this machine (or DGL's distributed engine) cannot
    run, or options it cannot use."""
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
    if distributed and storage != "cpu":
        raise UsageError(
            f"--mode {mode}: on DGL's distributed engine the graph and "
            "features stay on the graph servers; use --mode cpu-cuda, "
            "cpu-cpu or auto"
        )


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
