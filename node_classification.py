"""
This script trains and tests a GraphSAGE model for node classification on
multiple GPUs with DistributedDataParallel (DDP), fed by GraphBolt's data
loader. It is DGL's examples/multigpu/graphbolt/node_classification.py, and
it also runs without a GPU (one CPU process per --gpu entry, gloo backend),
offline on a dataset directory, and under torchrun.

    # Two GPUs (DGL's CUDA build, see docs/gpus.md); else two CPU processes:
    python node_classification.py --gpu=0,1
    # Offline, on a synthetic dataset directory:
    python scripts/make_synthetic_dataset.py data/synthetic
    python node_classification.py --gpu=0,1 --dataset data/synthetic
    # One process per rank, started by torchrun:
    torchrun --standalone --nproc-per-node=2 node_classification.py \
        --dataset data/synthetic

This flowchart describes the main functional sequence of the example:
main
│
├───> Parse and check arguments, plan devices (nothing spawns on bad input)
│
├───> Load the dataset once (and, with --resume, the checkpoint)
│
└───> run (one process per device, or each torchrun process)
      │
      ├───> Init process group and build distributed SAGE model (HIGHLIGHT)
      │
      ├───> Get GraphBolt dataloaders with DistributedItemSampler (HIGHLIGHT)
      │
      ├───> train
      │     │
      │     └───> Training loop under Join (HIGHLIGHT)
      │           │
      │           ├───> SAGE.forward
      │           │
      │           ├───> Validation set evaluation
      │           │
      │           └───> Collect accuracy and loss from all ranks (HIGHLIGHT)
      │
      └───> Test set evaluation

The functions below the "Plumbing" line at the end (device planning, dataset
checks, checkpoints, CPU settings, the torchrun hand-off) support this path;
a template user need not read them.
"""
import argparse
import copy
import ctypes
import inspect
import itertools
import json
import os
import pickle
import platform
import random
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass

# Without this, importing dgl warns that no backend is configured.
os.environ.setdefault("DGLBACKEND", "pytorch")

import dgl
import numpy as np
import torch

# PyPI's torch 2.2.1 is a CUDA 12.1 build, PyPI's dgl a CPU-only one. DGL's
# CUDA build of the same release comes from DGL's own wheel index.
INSTALL_CUDA_DGL = (
    "pip install dgl==2.1.0+cu121 "
    "-f https://data.dgl.ai/wheels/torch-2.2/cu121/repo.html"
)
try:
    import dgl.graphbolt as gb
except ImportError as error:
    # dgl 2.4+ refuses to import GraphBolt's CPU build next to a CUDA torch.
    print(
        f"{os.path.basename(sys.argv[0])}: error: {error} (for GPUs: "
        f"{INSTALL_CUDA_DGL}; for CPU ranks: CUDA_VISIBLE_DEVICES= python ...)",
        file=sys.stderr,
    )
    sys.exit(2)
import dgl.nn as dglnn
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchmetrics.functional as MF
import tqdm
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.multiprocessing.reductions import ForkingPickler
from torch.nn.parallel import DistributedDataParallel as DDP

BUILTIN_DATASETS = ["cora", "ogbn-arxiv", "ogbn-products", "ogbn-papers100M"]
MODES = ["auto", "cpu-cpu", "cpu-cuda", "pinned-cuda", "cuda-cuda"]
NUM_LAYERS = 3
HIDDEN_SIZE = 256
FEAT_KEY = ("node", None, "feat")
CHECKPOINT_FILE = "checkpoint.pt"
MODEL_FILE = "model.pt"
METRICS_FILE = "metrics.jsonl"


class SAGE(nn.Module):
    def __init__(self, in_size, hidden_size, out_size):
        super().__init__()
        self.layers = nn.ModuleList()
        # Three-layer GraphSAGE-mean.
        self.layers.append(dglnn.SAGEConv(in_size, hidden_size, "mean"))
        self.layers.append(dglnn.SAGEConv(hidden_size, hidden_size, "mean"))
        self.layers.append(dglnn.SAGEConv(hidden_size, out_size, "mean"))
        self.dropout = nn.Dropout(0.5)

    def forward(self, blocks, x):
        hidden_x = x
        for layer_idx, (layer, block) in enumerate(zip(self.layers, blocks)):
            hidden_x = layer(block, hidden_x)
            is_last_layer = layer_idx == len(self.layers) - 1
            if not is_last_layer:
                hidden_x = F.relu(hidden_x)
                hidden_x = self.dropout(hidden_x)
        return hidden_x


def create_dataloader(
    graph, features, itemset, device, storage, is_train, args, seed
):
    ############################################################################
    # (HIGHLIGHT) Get a GraphBolt dataloader for node classification with
    # multi-process distributed training. DistributedItemSampler instead of
    # ItemSampler gives every rank its own contiguous share of the items, in
    # whole batches. For training, `drop_last` and `drop_uneven_inputs` give
    # every rank the same number of full batches; for evaluation nothing is
    # dropped, so every item is scored exactly once (some ranks may get none).
    ############################################################################
    item_sampler = gb.DistributedItemSampler(
        item_set=itemset,
        batch_size=args.batch_size,
        drop_last=is_train,
        shuffle=is_train,
        drop_uneven_inputs=is_train,
    )
    # Options that differ between GraphBolt releases, found by signature.
    options = graphbolt_options(device, storage)
    datapipe = item_sampler
    # With the graph on the GPU (pinned or device memory) sampling runs
    # there, so the seeds move first.
    if storage != "cpu":
        datapipe = datapipe.copy_to(device, **options["copy_to"])
    datapipe = datapipe.sample_neighbor(
        graph, args.fanout, **options["sample_neighbor"]
    )
    datapipe = datapipe.fetch_feature(
        features, node_feature_keys=["feat"], **options["fetch_feature"]
    )
    # GraphBolt's DataLoader runs everything before copy_to in a prefetch
    # thread, overlapping sampling with a GPU's training. CPU ranks sample
    # between steps instead, with the rank's own threads (upstream adds
    # copy_to("cpu"), which copies nothing but starts that thread).
    if storage == "cpu" and device.type == "cuda":
        datapipe = datapipe.copy_to(device)
    dataloader = gb.DataLoader(datapipe, args.num_workers, **options["DataLoader"])
    return Loader(
        dataloader, item_sampler, len(itemset), is_train, args, seed is not None
    )


def weighted_reduce(tensor, weight, dst=0):
    ########################################################################
    # (HIGHLIGHT) Collect accuracy and loss values from sub-processes and
    # obtain overall average values.
    #
    # Ranks may process different numbers of items (a rank can even have
    # none), so each rank sends sum(value * count) and its count; rank `dst`
    # divides the totals. A rank with no items adds zero to both sums.
    ########################################################################
    dist.reduce(tensor=tensor, dst=dst)
    weight = torch.tensor(weight, dtype=tensor.dtype, device=tensor.device)
    dist.reduce(tensor=weight, dst=dst)
    return tensor / weight


@torch.no_grad()
def evaluate(rank, model, loader, num_classes, device, name, autocast):
    """Returns (number of correct predictions, number of items) on this rank.
    Counting, instead of concatenating predictions, works when a rank
    receives no items at all."""
    model.eval()
    num_correct = torch.tensor(0.0, device=device)
    num_items = 0
    for data in loader.batches(rank, name):
        x = data.node_features["feat"]
        with torch.autocast(device.type, torch.bfloat16, enabled=autocast):
            # Call the wrapped module: no DDP hooks, no collectives.
            y_hat = model.module(data.blocks, x if autocast else x.float())
        y_hat = y_hat.float()
        y = data.labels
        accuracy = MF.accuracy(
            y_hat, y, task="multiclass", num_classes=num_classes
        )
        num_correct += accuracy * y.size(0)
        num_items += y.size(0)
    return num_correct, num_items


def train(rank, plan, args, job, model, optimizer, loaders, device, stop):
    """Trains from where `job` starts; returns 0, or the signal that stopped
    training (a resumable checkpoint is then saved)."""
    num_classes = job.config["num_classes"]
    # --precision bf16: features are stored in bfloat16 and, where the
    # device computes bf16 natively (plan.autocast), the forward pass runs
    # under autocast; parameters, optimizer, loss and metrics stay fp32.
    autocast = plan.autocast
    for epoch in range(job.start_epoch, args.epochs):
        if job.seed is not None:
            seed_epoch(job.seed, rank, epoch, loaders.train.item_sampler)
        epoch_start = synchronized_time(device)

        model.train()
        # Zero, or the sums of a run that stopped inside this epoch.
        step, total_loss, num_train_items = job.position(epoch, rank, device)
        data_wait = 0.0
        ########################################################################
        # (HIGHLIGHT) Use Join Context Manager to solve uneven input problem.
        #
        # DDP requires every rank to run the same number of steps, otherwise
        # the program may error or hang. `drop_uneven_inputs=True` in the
        # training sampler already evens them out; Join also covers custom
        # samplers that do not. See
        # https://pytorch.org/tutorials/advanced/generic_join.html
        ########################################################################
        with Join([model, stop]):
            step_end = time.time()
            for data in loaders.train.batches(rank, f"train {epoch}", step):
                # Host time spent waiting for the loader: sampling and
                # feature fetching that no prefetch thread hid.
                data_wait += time.time() - step_end
                if job.seed is not None:
                    # Dropout per step, so a run resumes at any step.
                    seed_step(job.seed, rank, epoch, step)
                # The input features are from the source nodes in the first
                # layer's computation graph.
                x = data.node_features["feat"]

                # The ground truth labels are from the destination nodes
                # in the last layer's computation graph.
                y = data.labels

                blocks = data.blocks

                with torch.autocast(device.type, torch.bfloat16, enabled=autocast):
                    y_hat = model(blocks, x if autocast else x.float())

                # Compute loss (in fp32).
                loss = F.cross_entropy(y_hat.float(), y)

                optimizer.zero_grad()
                loss.backward()
                optimizer.step()

                total_loss += loss.detach() * y.size(0)
                num_train_items += y.size(0)
                step += 1
                step_end = time.time()
                # SIGTERM or SIGINT on any rank: every rank stops here.
                if stop.agreed():
                    break
        if stop.signum:
            position = (epoch, step, total_loss, num_train_items)
            save_stop(args, job, model.module, optimizer, position, stop, rank)
            return stop.signum
        train_time = synchronized_time(device) - epoch_start

        # Evaluate the model.
        if rank == 0:
            print("Validating...")
        num_correct, num_val_items = evaluate(
            rank, model, loaders.valid, num_classes, device,
            f"validate {epoch}", autocast,
        )
        total_loss = weighted_reduce(total_loss, num_train_items)
        acc = weighted_reduce(num_correct, num_val_items)

        epoch_time = synchronized_time(device) - epoch_start
        # Every rank trains the same number of items (the sampler drops
        # uneven batches), so the world trains this many.
        seeds_per_second = num_train_items * plan.world_size / train_time
        if rank == 0:
            record = {
                "epoch": epoch,
                "loss": total_loss.item(),
                "val_accuracy": acc.item(),
                "epoch_time": epoch_time,
                "seeds_per_second": seeds_per_second,
                "ranks": plan.world_size,
            }
            # The checkpoint and metrics line first: an epoch line on the
            # screen means its checkpoint is on disk.
            save_epoch(args, job, model.module, optimizer, epoch, record)
            print(
                f"Epoch {epoch:05d} | "
                f"Average Loss {total_loss.item():.4f} | "
                f"Accuracy {acc.item():.4f} | "
                f"Time {epoch_time:.4f} | "
                f"Train Time {train_time:.4f} | "
                f"Seeds/s {seeds_per_second:.1f} | "
                f"Data Wait {data_wait:.4f}",
                flush=True,
            )
        # Nobody goes on until the checkpoint of this epoch is complete.
        if args.checkpoint_dir:
            barrier(device)
        # A signal during evaluation stops here, at the epoch's checkpoint.
        if stop.agreed() and epoch + 1 < args.epochs:
            if rank == 0:
                report_stop(args, stop.signum, epoch + 1, 0)
            return stop.signum
    return 0


def run(rank, plan, args, job, stop_request):
    """One training process (rank) from start to end. `job` is what the
    parent loaded once for every rank, or None under torchrun. Returns 0, or
    the signal that stopped training (see StopSignal)."""
    # Init process group; the rank's device comes from the plan.
    device = torch.device(plan.devices[rank - plan.rank_offset])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(plan.threads)
    dist.init_process_group(
        backend=plan.backend,
        init_method=plan.init_method,
        world_size=plan.world_size,
        rank=rank,
    )
    stop = StopSignal(device, stop_request)
    if job is None:
        job = load_job_in_turn(rank, plan, args)
    # After loading, so that memory freed while loading goes back to the
    # system; in each rank, however it was launched.
    keep_freed_memory()
    poll_less()
    graph, features = place_dataset(
        job.dataset, plan.storage, device, args.gpu_cache_size
    )

    # Create GraphSAGE model. It should be copied onto a GPU as a replica.
    if job.seed is not None:
        torch.manual_seed(job.seed)
    config = job.config
    model = SAGE(config["in_size"], config["hidden_size"], config["num_classes"])
    model = model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    restore(job.checkpoint, model, optimizer, args.lr)
    model = DDP(model)
    if job.checkpoint is not None and rank == 0:
        step = job.start_step
        at = f"epoch {job.start_epoch}" + (f", step {step}" if step else "")
        print(f"Resuming from {args.checkpoint_dir} at {at}.")

    # Create data loaders.
    task = job.dataset.tasks[0]

    def dataloader(itemset, is_train):
        return create_dataloader(
            graph, features, itemset, device, plan.storage, is_train, args,
            job.seed,
        )

    loaders = Loaders(
        train=dataloader(task.train_set, is_train=True),
        valid=dataloader(task.validation_set, is_train=False),
        test=dataloader(task.test_set, is_train=False),
    )

    # Model training.
    if rank == 0:
        print("Training...")
    stopped_by = train(
        rank, plan, args, job, model, optimizer, loaders, device, stop
    )
    if stopped_by:
        barrier(device)
        return stopped_by

    # Test the model.
    if rank == 0:
        print("Testing...")
    num_correct, num_test_items = evaluate(
        rank, model, loaders.test, config["num_classes"], device, "test",
        plan.autocast,
    )
    test_acc = weighted_reduce(num_correct, num_test_items)
    if rank == 0:
        print(f"Test Accuracy {test_acc.item():.4f}", flush=True)
        save_result(args, model.module, test_acc.item(), plan.world_size)
    # Rank 0 hosts the rendezvous store: nobody leaves before all are done.
    barrier(device)
    return 0


def parse_args(argv=None):
    parser = ArgumentParser(
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Multi-GPU (or multi-process CPU) training of a GraphSAGE "
        "model for node classification using the GraphBolt dataloader.",
    )
    parser.add_argument(
        "--gpu",
        type=str,
        default="0",
        help="GPU(s) in use. Can be a list of gpu ids for multi-gpu training,"
        " e.g., 0,1,2,3. In cpu-cpu mode each entry is one CPU process.",
    )
    parser.add_argument(
        "--epochs", type=int_at_least(1), default=10,
        help="Number of training epochs.",
    )
    parser.add_argument(
        "--lr", type=positive_float, default=0.001,
        help="Learning rate for optimization.",
    )
    parser.add_argument(
        "--batch-size", type=int_at_least(1), default=1024,
        help="Batch size (per rank) for training.",
    )
    parser.add_argument(
        "--fanout", type=fanout_list, default="10,10,10",
        help="Fan-out of neighbor sampling, one value per layer (3 layers);"
        " -1 takes all neighbors.",
    )
    parser.add_argument(
        "--num-workers", type=int_at_least(0), default=0,
        help="The number of data loading worker processes per rank (only"
        " where sampling runs on the CPU).",
    )
    parser.add_argument(
        "--gpu-cache-size", type=int_at_least(0), default=0,
        help="The capacity of the GPU feature cache in bytes (pinned-cuda).",
    )
    parser.add_argument(
        "--dataset", type=str, default="ogbn-products",
        help="A builtin GraphBolt dataset ("
        + ", ".join(BUILTIN_DATASETS)
        + ") or the path of an OnDiskDataset directory (with metadata.yaml).",
    )
    parser.add_argument(
        "--data-root", type=str, default="datasets",
        help="Where builtin datasets are downloaded to.",
    )
    parser.add_argument(
        "--mode", default="auto", choices=MODES,
        help="Dataset storage placement and train device: 'cpu' for CPU and"
        " RAM, 'pinned' for pinned memory in RAM, 'cuda' for GPU and GPU"
        " memory. 'auto' is pinned-cuda when torch and DGL have CUDA,"
        " otherwise cpu-cpu.",
    )
    parser.add_argument(
        "--precision", default="fp32", choices=["fp32", "bf16"],
        help="bf16: node features stored in bfloat16 (half the memory and"
        " the bytes each batch gathers) and the forward pass under autocast;"
        " parameters, optimizer, loss and metrics stay fp32.",
    )
    parser.add_argument(
        "--threads", type=int_at_least(1), default=None,
        help="CPU threads per rank for PyTorch and sampling (default: the"
        " machine's cores divided by the ranks on it).",
    )
    parser.add_argument(
        "--max-batches", type=int_at_least(1), default=None,
        help="Stop every training epoch and every evaluation after this many"
        " batches per rank (quick runs, benchmarks). Default: all.",
    )
    parser.add_argument(
        "--master-port", type=int_at_least(1), default=None,
        help="Rendezvous port on 127.0.0.1 (default: a free port).",
    )
    parser.add_argument(
        "--seed", type=int_at_least(0), default=None,
        help="Seed every random stream on every rank: the same seed repeats"
        " a run (CPU, --num-workers 0). Unseeded by default, as upstream.",
    )
    parser.add_argument(
        "--checkpoint-dir", default=None,
        help="Save a checkpoint here after every epoch, and the trained model"
        " as model.pt at the end.",
    )
    parser.add_argument(
        "--resume", action="store_true",
        help="Continue from the checkpoint in --checkpoint-dir.",
    )
    parser.add_argument(
        "--log-dir", default=None,
        help="Append one JSON line per epoch and one for the test result to"
        " metrics.jsonl here.",
    )
    args = parser.parse_args(argv)
    if args.resume and not args.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir")
    return args


def main(argv=None):
    args = parse_args(argv)
    try:
        plan = plan_run(args, os.environ, detect_machine(args.precision))
        if plan.rank_offset == 0:
            for notice in plan.notices:
                print(notice)
        # Both launchers hand the dataset to other processes through files
        # in /dev/shm (the default, file descriptors, can run out of them).
        mp.set_sharing_strategy("file_system")
        if plan.launcher == "torchrun":
            # Each torchrun process is one rank; they load the data in turn.
            run_rank(plan.rank_offset, plan, args, None)
            return
        unit = "gpu" if plan.backend == "nccl" else "CPU process"
        plural = "es" if unit.endswith("s") else "s"
        print(f"Training with {plan.world_size} {unit}"
              f"{plural * (plan.world_size > 1)}.")
        # Load and preprocess the dataset once, in the parent.
        job = load_job(args, plan.world_size)
    except UsageError as error:
        # Under torchrun every rank finds the same bad input: rank 0 says so.
        fail(error, speak=os.environ.get("RANK", "0") == "0")

    # Thread limiting to avoid resource competition; no GPU in CPU ranks.
    os.environ.update(plan.rank_env)
    stop_request = mp.get_context("spawn").Value("i", 0)
    context = mp.spawn(
        run_rank,
        args=(plan, args, job, stop_request),
        nprocs=plan.world_size,
        join=False,
    )
    relay_stop_signals(context, stop_request)
    try:
        while not context.join():
            pass
    except mp.ProcessRaisedException:
        # mp.spawn has already stopped the other ranks; each failed rank
        # printed its traceback.
        sys.exit("error: training failed; each failing rank's error is above")
    except mp.ProcessExitedException as error:
        if stop_request.value:
            # Stopped on request; rank 0 said where and how to resume.
            sys.exit(128 + stop_request.value)
        sys.exit(f"error: training failed: {error}")


# =============================================================================
# Plumbing. Everything below supports the training path above: a template
# user need not read it. Loaders and progress bars, GraphBolt API shapes,
# data placement, seeding, CPU settings, the rank's error reporting and
# teardown, dataset and checkpoint I/O, the launch plan, argument types.
# =============================================================================


@dataclass
class Loader:
    """A GraphBolt DataLoader with what the loops need around it."""

    dataloader: gb.DataLoader
    item_sampler: gb.DistributedItemSampler  # reseeded every epoch
    num_items: int
    is_train: bool
    args: argparse.Namespace
    seeded: bool

    def batches(self, rank, name, skip=0):
        """The mini-batches, at most --max-batches of them, after sampling
        and dropping the first `skip` (a resumed epoch); on rank 0 with a
        progress bar."""
        batches = self.dataloader
        if self.seeded:
            batches = sample_serially(batches)
        batches = itertools.islice(batches, skip, self.args.max_batches)
        if rank != 0:
            return batches
        total = self.rank0_batches()
        return tqdm.tqdm(batches, desc=name, total=total, initial=skip)

    def rank0_batches(self):
        """How many batches rank 0 gets (for the progress bar): training
        drops partial and uneven batches, evaluation drops nothing."""
        per_round = self.args.batch_size * dist.get_world_size()
        whole, rest = divmod(self.num_items, per_round)
        total = whole + (0 if self.is_train else rest > 0)
        return min(total, self.args.max_batches or total)


def sample_serially(batches):
    """Yields the loader's batches, sampling each with one thread. With more,
    dgl 2.1.0's sampling is not repeatable: only the calling thread's random
    engine is seeded, and unique_and_compact numbers ids in whichever order
    the threads insert them. Training keeps all threads. Costs about 15%
    with 1 rank x 2 threads on a 200k-node graph; nothing with 1 thread."""
    threads = torch.get_num_threads()
    iterator = iter(batches)
    while True:
        torch.set_num_threads(1)
        try:
            batch = next(iterator, None)
        finally:
            torch.set_num_threads(threads)
        if batch is None:
            return
        yield batch


@dataclass
class Loaders:
    train: Loader
    valid: Loader
    test: Loader


def _accepts(callable_, name):
    """True if `callable_` takes a parameter `name`: how this script tells
    GraphBolt releases apart (never by parsing version strings)."""
    return name in inspect.signature(callable_).parameters


def graphbolt_options(device, storage):
    """Keyword arguments for each pipeline stage on this GraphBolt release.
    - copy_to: dgl 2.1.0 copies seed_nodes only when asked to; newer
      releases copy everything and have no `extra_attrs`.
    - sample_neighbor: dgl 2.4 overlaps graph fetching (pinned graphs) and
      samples asynchronously on the GPU; older releases have no such knobs.
    - fetch_feature / DataLoader: GraphBolt overlaps feature fetching on a
      CUDA stream whenever torch has CUDA, even for a CPU rank (where a
      CPU-only DGL then crashes): only ranks that train on a GPU ask for
      it. dgl 2.4 has the knob on fetch_feature, 2.1-2.3 on the DataLoader."""
    on_gpu = device.type == "cuda"
    options = {
        "copy_to": {}, "sample_neighbor": {}, "fetch_feature": {},
        "DataLoader": {},
    }
    if _accepts(gb.CopyTo.__init__, "extra_attrs"):
        options["copy_to"]["extra_attrs"] = ["seed_nodes"]
    if _accepts(gb.NeighborSampler.__init__, "overlap_fetch"):
        options["sample_neighbor"]["overlap_fetch"] = storage == "pinned"
    if _accepts(gb.NeighborSampler.__init__, "asynchronous"):
        options["sample_neighbor"]["asynchronous"] = storage != "cpu"
    if _accepts(gb.FeatureFetcher.__init__, "overlap_fetch"):
        options["fetch_feature"]["overlap_fetch"] = on_gpu
    if _accepts(gb.DataLoader.__init__, "overlap_feature_fetch"):
        options["DataLoader"]["overlap_feature_fetch"] = on_gpu
    return options


def place_dataset(dataset, storage, device, gpu_cache_size):
    """Puts the graph and features where --mode says; with pinned features,
    optionally fronts them with a GPU cache of `gpu_cache_size` bytes."""
    if storage == "cuda":
        return dataset.graph.to(device), dataset.feature.to(device)
    if storage == "cpu":
        return dataset.graph, dataset.feature
    # Pin the graph and features (in place) to enable GPU access.
    feat = dataset.feature.read(*FEAT_KEY)
    graph = dataset.graph.pin_memory_()
    features = dataset.feature.pin_memory_()
    if gpu_cache_size > 0:
        # The loader fetches only "feat": a store of the cached feature
        # alone works with every GraphBolt release's public API.
        cached = make_gpu_cache(gb.TorchBasedFeature(feat), gpu_cache_size)
        features = gb.BasicFeatureStore({FEAT_KEY: cached})
    return graph, features


def make_gpu_cache(feature, cache_bytes):
    """A GPU cache of `cache_bytes` bytes in front of `feature`, for each
    GraphBolt API shape, told apart by signature: dgl 2.4+ has a function
    taking bytes; 2.2.1-2.3 a class taking bytes; 2.1-2.2.0 the same class
    taking rows (there `gb.gpu_cached_feature` is the module holding it)."""
    if inspect.isfunction(getattr(gb, "gpu_cached_feature", None)):
        return gb.gpu_cached_feature(feature, cache_bytes)
    if _accepts(gb.GPUCachedFeature.__init__, "max_cache_size_in_bytes"):
        return gb.GPUCachedFeature(feature, cache_bytes)
    row = feature.read(torch.tensor([0]))
    row_bytes = row.element_size() * row.numel()
    return gb.GPUCachedFeature(feature, max(1, cache_bytes // row_bytes))


def synchronized_time(device):
    """time.time() once the GPU has finished its queued work: CUDA runs
    asynchronously, so without this a timing measures only the launches."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.time()


def seed_epoch(seed, rank, epoch, item_sampler):
    """Derives this rank's randomness for one epoch (shuffling, neighbor
    sampling) from (seed, rank, epoch), like PyTorch's
    DistributedSampler.set_epoch: the same seed repeats a run, and a resumed
    run (which samples the batches it skips) continues it exactly. Sampling
    is serial under a seed (sample_serially); dropout is seeded per step."""
    epoch_seed = derived_seed(seed, rank, epoch)
    random.seed(epoch_seed)
    np.random.seed(epoch_seed)
    torch.manual_seed(epoch_seed)
    gb.seed(epoch_seed)
    # dgl 2.1.0's item sampler shuffles with its own unseeded
    # np.random.default_rng() and takes no seed argument, so replace it.
    if hasattr(item_sampler, "_rng"):
        item_sampler._rng = np.random.default_rng(epoch_seed)


def seed_step(seed, rank, epoch, step):
    torch.manual_seed(derived_seed(seed, rank, epoch, step))


def derived_seed(*entropy):
    return int(np.random.SeedSequence(list(entropy)).generate_state(1)[0])


def keep_freed_memory():
    """Make glibc's malloc keep freed memory for the next mini-batch.

    By default glibc returns large blocks to the kernel as soon as they are
    freed, and a thread other than the main one gets blocks over 64 MB
    straight from the kernel. Each batch's feature and activation tensors
    (tens to hundreds of MB) are then mapped, zero-filled page by page and
    unmapped again: on CPU ranks the kernel took nearly as much CPU time as
    the training (docs/performance.md). The cost: a rank keeps its peak
    batch memory between batches. Other C libraries have no mallopt."""
    if platform.libc_ver()[0] != "glibc":
        return
    mallopt = ctypes.CDLL(None).mallopt
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
    # Blocks under 1 GB come from the heap; older glibc caps this at 32 MB.
    if not mallopt(M_MMAP_THRESHOLD, 1 << 30):
        mallopt(M_MMAP_THRESHOLD, 32 << 20)
    # Free memory at the top of the heap goes back only beyond 1 GB.
    mallopt(M_TRIM_THRESHOLD, 1 << 30)
    # One heap for all threads, so a data loader's prefetch thread (with a
    # GPU it samples and fetches features) reuses memory like the main one.
    mallopt(M_ARENA_MAX, 1)


def poll_less(interval=0.001):
    """Make the data loader's prefetch thread poll every 1 ms, not 0.1 ms.

    With a GPU, GraphBolt's DataLoader runs the pipeline before copy_to in
    a torchdata Prefetcher thread, which wakes every 0.1 ms while its buffer
    is full (and the training loop likewise while it is empty), taking CPU
    time and the GIL from the other thread. Measured with CPU sampling in
    that thread: 3.7 s of CPU for 2.6 s of sampling, 2.7-3.0 s at 1 ms.
    1 ms still allows 2,000 batches a second. Nothing to do where GraphBolt
    does not use torchdata's Prefetcher."""
    prefetcher = sys.modules.get("torchdata.datapipes.iter.util.prefetcher")
    for name in ("PRODUCER_SLEEP_INTERVAL", "CONSUMER_SLEEP_INTERVAL"):
        if hasattr(prefetcher, name):
            setattr(prefetcher, name, max(getattr(prefetcher, name), interval))


def run_rank(rank, plan, args, job, stop_request=None):
    """The entry point of each rank: run() with its failure reported and its
    process group torn down. A rank that stopped on a signal exits with
    128 + the signal's number, as a process killed by it would."""
    try:
        stopped_by = run(rank, plan, args, job, stop_request)
    except UsageError as error:
        # Bad input found in the ranks (torchrun loads the data there):
        # one line, from rank 0; every rank exits 2.
        fail(error, speak=rank == 0)
    except Exception:
        # Report every failing rank here: the launcher shows only one, often
        # a peer's "connection closed" instead of the cause.
        print(f"rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr)
        raise
    finally:
        if dist.is_initialized():
            destroy_process_group()
    if stopped_by:
        sys.exit(128 + stopped_by)


class StopSignal(Joinable):
    """SIGTERM or SIGINT (a scheduler's preemption, Ctrl-C) stops every rank
    at the next step boundary with a checkpoint to resume from; a second one
    stops at once. A rank cannot stop alone (DDP would hang), so at every
    boundary the ranks agree with one small all-reduce. It is a Joinable so
    that, under Join, a rank that ran out of batches keeps answering.

    With mp.spawn the launcher receives the signal (a Ctrl-C reaches every
    process, so ranks ignore SIGINT) and passes it on in `stop_request`, a
    shared integer; under torchrun each rank receives it itself."""

    def __init__(self, device, stop_request):
        super().__init__()
        self.device = device
        self.stop_request = stop_request
        self.received = 0  # the signal, under torchrun
        self.signum = 0  # what the ranks agreed on
        if stop_request is None:
            for signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, self._receive)
        else:
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    def _receive(self, signum, frame):
        if self.received:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.received = signum

    def agreed(self):
        """True on every rank once any rank has received a signal."""
        Join.notify_join_context(self)
        return self.all_reduce() > 0

    def all_reduce(self):
        received = self.received
        if self.stop_request is not None:
            received = self.stop_request.value
        flag = torch.tensor([received], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.signum = int(flag.item())
        return self.signum

    def join_hook(self, **kwargs):
        return _AnswerStopSignal(self)

    @property
    def join_device(self):
        return self.device

    @property
    def join_process_group(self):
        return dist.group.WORLD


class _AnswerStopSignal(JoinHook):
    """What a rank that joined early does in each step of the others."""

    def __init__(self, stop):
        self.stop = stop

    def main_hook(self):
        self.stop.all_reduce()


def relay_stop_signals(context, stop_request):
    """In the launcher: the first SIGTERM or SIGINT asks the ranks to stop
    at the next step boundary; a second kills them."""

    def relay(signum, frame):
        if stop_request.value:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            os._exit(128 + signum)
        stop_request.value = signum

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, relay)


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


class UsageError(Exception):
    """Bad input: reported as one line, exit status 2, before any spawn."""


def fail(message, speak=True):
    """Bad input, as every script here reports it: one line naming the bad
    value, exit status 2. Processes that found the same bad input as another
    one that reports it (torchrun's ranks) exit without a word."""
    if speak:
        print(f"{os.path.basename(sys.argv[0])}: error: {message}",
              file=sys.stderr)
    sys.exit(2)


@dataclass
class Job:
    """What every rank needs, loaded once: the dataset, the model's
    configuration, the checkpoint to resume (or None), where to start, and
    the seed (--seed, or the checkpoint's)."""

    dataset: object
    config: dict
    checkpoint: dict
    start_epoch: int
    seed: int

    @property
    def start_step(self):
        """Steps of start_epoch a stopped run had already trained."""
        return self.checkpoint.get("step", 0) if self.checkpoint else 0

    def position(self, epoch, rank, device):
        """(step, loss sum, item count) where this rank's `epoch` starts:
        zero, or where a run stopped inside it."""
        step, sums = 0, (0.0, 0)
        if epoch == self.start_epoch and self.start_step:
            step = self.start_step
            sums = self.checkpoint["partial"][rank]
        return step, torch.tensor(sums[0], device=device), sums[1]


def load_job(args, world_size):
    """Loads and checks what every rank needs (see Job)."""
    dataset = load_dataset(args.dataset, args.data_root)
    if args.precision == "bf16":
        # Once, where the data is loaded: the ranks share this bf16 copy and
        # the fp32 one is released.
        feat = dataset.feature.read(*FEAT_KEY)
        dataset.feature.update(*FEAT_KEY, feat.to(torch.bfloat16))
        del feat
    check_train_split(
        len(dataset.tasks[0].train_set), args.batch_size, world_size
    )
    config = model_config(args, dataset)
    for directory in (args.checkpoint_dir, args.log_dir):
        if directory:
            os.makedirs(directory, exist_ok=True)
    checkpoint, start_epoch, seed = None, 0, args.seed
    if args.resume:
        checkpoint = load_checkpoint(args.checkpoint_dir, config)
        check_resume(checkpoint, args, world_size)
        start_epoch = checkpoint["epoch"]
        # Without --seed the run continues the checkpoint's sequence.
        seed = checkpoint["seed"] if seed is None else seed
    return Job(dataset, config, checkpoint, start_epoch, seed)


def load_job_in_turn(rank, plan, args):
    """Under torchrun there is no parent to load the dataset once. Rank 0
    goes first (it may download or preprocess into the dataset directory),
    then the first process of each other node. Each of them hands the other
    ranks of its node what it loaded through shared memory, as mp.spawn
    does: a node holds one copy of the graph and features, not one per rank."""
    job, refusal = None, [None]
    if rank == 0:
        try:
            job = load_job(args, plan.world_size)
        except UsageError as error:
            refusal = [str(error)]
    # Every rank learns whether rank 0 refused the input, and waits for it.
    dist.broadcast_object_list(refusal, src=0)
    if refusal[0] is not None:
        raise UsageError(refusal[0])
    if plan.local_rank == 0 and rank != 0:
        job = load_job(args, plan.world_size)
    # torchrun numbers the ranks of a node consecutively. The hand-off is
    # host bytes, so it goes over gloo whatever the training backend.
    node_group, _ = dist.new_subgroups(plan.local_world_size, backend="gloo")
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


def load_dataset(name_or_dir, data_root):
    """The one place that reads datasets (the scripts use it too): a builtin
    GraphBolt dataset (downloaded under `data_root` on first use) or an
    OnDiskDataset directory. Checks what training needs."""
    if name_or_dir in BUILTIN_DATASETS:
        try:
            dataset = gb.BuiltinDataset(name_or_dir, root=data_root).load()
        except Exception as error:
            raise UsageError(
                f"could not fetch dataset '{name_or_dir}' into "
                f"'{data_root}' ({type(error).__name__}: {error}); offline, "
                "make one with scripts/make_synthetic_dataset.py DIR and pass "
                "--dataset DIR"
            ) from None
    elif os.path.isdir(name_or_dir):
        if not os.path.isfile(os.path.join(name_or_dir, "metadata.yaml")):
            raise UsageError(
                f"--dataset '{name_or_dir}' is a directory without "
                "metadata.yaml, so it is not a GraphBolt OnDiskDataset"
            )
        dataset = gb.OnDiskDataset(name_or_dir).load()
    else:
        raise UsageError(
            f"--dataset '{name_or_dir}' is neither a builtin dataset "
            f"({', '.join(BUILTIN_DATASETS)}) nor a directory"
        )
    check_dataset(dataset, name_or_dir)
    return dataset


def check_dataset(dataset, name):
    if not dataset.tasks:
        raise UsageError(f"dataset '{name}' defines no task")
    task = dataset.tasks[0]
    if "num_classes" not in task.metadata:
        raise UsageError(
            f"dataset '{name}': task '{task.metadata.get('name', 0)}' has no "
            "num_classes in metadata.yaml"
        )
    if FEAT_KEY not in dataset.feature.keys():
        raise UsageError(
            f"dataset '{name}' has no node feature named 'feat' (it has: "
            f"{', '.join(str(k[2]) for k in dataset.feature.keys()) or 'none'})"
        )
    for split in ("train_set", "validation_set", "test_set"):
        itemset = getattr(task, split)
        if itemset is None or len(itemset) == 0:
            raise UsageError(f"dataset '{name}' has an empty {split}")


def check_train_split(num_train_items, batch_size, world_size):
    """The training sampler drops partial and uneven batches, so each rank
    needs one full batch: num_train_items >= batch_size * world_size."""
    if num_train_items < batch_size * world_size:
        largest = num_train_items // world_size
        raise UsageError(
            f"--batch-size {batch_size}: the train set has {num_train_items} "
            f"items, too few for one full batch on each of {world_size} "
            f"ranks; use --batch-size {largest} or less"
            if largest > 0
            else f"the train set has {num_train_items} items, fewer than the "
            f"{world_size} ranks"
        )


def model_config(args, dataset):
    """What a checkpoint must agree on to be resumed: model shape, data and
    sampling."""
    is_dir = args.dataset not in BUILTIN_DATASETS
    return {
        "dataset": os.path.realpath(args.dataset) if is_dir else args.dataset,
        "fanout": list(args.fanout),
        "in_size": dataset.feature.size(*FEAT_KEY)[0],
        "hidden_size": HIDDEN_SIZE,
        "num_classes": dataset.tasks[0].metadata["num_classes"],
        "precision": args.precision,
    }


def restore(checkpoint, model, optimizer, lr):
    """Loads a checkpoint's model and optimizer state; --lr wins over the
    saved learning rate."""
    if checkpoint is None:
        return
    model.load_state_dict(checkpoint["model"])
    # A copy: the checkpoint reached this rank through shared memory, and
    # load_state_dict keeps CPU tensors as they are, so otherwise every
    # rank would step the same Adam state.
    optimizer.load_state_dict(copy.deepcopy(checkpoint["optimizer"]))
    for group in optimizer.param_groups:
        group["lr"] = lr


def save_epoch(args, job, module, optimizer, epoch, record):
    """Rank 0 after each epoch: the checkpoint and the metrics line."""
    if args.checkpoint_dir:
        save_checkpoint(
            args.checkpoint_dir, module, optimizer, epoch + 1, job.seed,
            job.config,
        )
    if args.log_dir:
        append_metrics(args.log_dir, record)


def save_checkpoint(
    directory, module, optimizer, epoch, seed, config, step=0, partial=None
):
    # Randomness derives from (seed, rank, epoch, step), so the seed and the
    # position are all the random state a resumed run needs. A run stopped
    # inside `epoch` after `step` steps also keeps each rank's loss sum and
    # item count so far (`partial`), for the epoch's average.
    checkpoint = {
        "model": module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": epoch,
        "step": step,
        "partial": partial,
        "seed": seed,
        "config": config,
    }
    save_atomically(checkpoint, os.path.join(directory, CHECKPOINT_FILE))


def save_stop(args, job, module, optimizer, position, stop, rank):
    """Every rank, when a signal stopped training inside an epoch: rank 0
    saves where, with every rank's sums, and says how to go on."""
    epoch, step, total_loss, num_items = position
    sums = torch.tensor([total_loss.item(), num_items], dtype=torch.float64)
    gathered = [torch.zeros_like(sums) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, sums.to(stop.device))
    if rank != 0:
        return
    if args.checkpoint_dir:
        partial = [[loss, int(count)] for loss, count in
                   (g.tolist() for g in gathered)]
        save_checkpoint(
            args.checkpoint_dir, module, optimizer, epoch, job.seed,
            job.config, step, partial,
        )
    report_stop(args, stop.signum, epoch, step)


def report_stop(args, signum, epoch, step):
    where = f"epoch {epoch}" + (f" after step {step}" if step else "")
    if args.checkpoint_dir:
        then = (f"checkpoint saved in {args.checkpoint_dir}; run the same "
                "command with --resume to continue")
    else:
        then = "nothing saved (no --checkpoint-dir)"
    print(f"Stopped by {signal.Signals(signum).name} in {where}: {then}.",
          flush=True)


def save_result(args, module, test_accuracy, world_size):
    """Rank 0 at the end: the trained model (without DDP's "module."
    prefixes) and the test line of the metrics."""
    if args.checkpoint_dir:
        path = os.path.join(args.checkpoint_dir, MODEL_FILE)
        save_atomically(module.state_dict(), path)
    if args.log_dir:
        record = {"test_accuracy": test_accuracy, "ranks": world_size}
        append_metrics(args.log_dir, record)


def save_atomically(obj, path):
    """Write, flush to disk, then rename: a crash while saving leaves the
    previous file intact."""
    temporary = f"{path}.tmp{os.getpid()}"
    try:
        with open(temporary, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def load_checkpoint(directory, config):
    path = os.path.join(directory, CHECKPOINT_FILE)
    if not os.path.isfile(path):
        raise UsageError(f"--resume: there is no checkpoint '{path}'")
    try:
        # Tensors and plain containers only: nothing in the file can run.
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        missing = {"model", "optimizer", "epoch", "seed", "config"} - set(checkpoint)
        if missing:
            raise KeyError(f"no {', '.join(sorted(missing))}")
        saved_config = checkpoint["config"]
    except pickle.UnpicklingError as error:
        if "Weights only load failed" not in str(error):
            raise UsageError(unreadable(path, error)) from None
        raise UsageError(
            f"checkpoint '{path}' holds objects other than tensors and plain "
            "data, which could run code when loaded; refused, nothing in it ran"
        ) from None
    except Exception as error:
        raise UsageError(unreadable(path, error)) from None
    for key, value in config.items():
        if saved_config.get(key) != value:
            raise UsageError(
                f"checkpoint '{path}' was made with {key} "
                f"{saved_config.get(key)!r}, but this run has {value!r}"
            )
    return checkpoint


def unreadable(path, error):
    reason = (str(error).splitlines() or [""])[0]
    return (
        f"checkpoint '{path}' is unreadable, truncated or corrupted "
        f"({type(error).__name__}: {reason})"
    )


def check_resume(checkpoint, args, world_size):
    partial = checkpoint.get("partial")
    if checkpoint.get("step") and len(partial or []) != world_size:
        raise UsageError(
            f"checkpoint stopped inside epoch {checkpoint['epoch']} with "
            f"{len(partial or [])} ranks; resume it with as many, not "
            f"{world_size}"
        )
    if args.seed is not None and args.seed != checkpoint["seed"]:
        raise UsageError(
            f"--seed {args.seed}: the checkpoint was made with --seed "
            f"{checkpoint['seed']}"
        )
    if checkpoint["epoch"] >= args.epochs:
        raise UsageError(
            f"--epochs {args.epochs}: the checkpoint has already trained "
            f"{checkpoint['epoch']} epochs; pass a larger --epochs"
        )


def append_metrics(directory, record):
    with open(os.path.join(directory, METRICS_FILE), "a") as f:
        f.write(json.dumps(record) + "\n")


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
    rank_env: dict  # environment for spawned ranks
    notices: list  # lines to print before training


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


def detect_machine(precision):
    cuda, dgl_cuda = torch.cuda.is_available(), dgl_has_cuda()
    # Asked only when it matters: it initializes CUDA in this process.
    gpu_bf16 = not (precision == "bf16" and cuda and dgl_cuda) or (
        torch.cuda.is_bf16_supported()
    )
    cores = len(os.sched_getaffinity(0))
    return Machine(
        cuda, dgl_cuda, torch.cuda.device_count(), cores, gpu_bf16,
        cpu_has_bf16(),
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


def plan_run(args, env, machine):
    """The one place that decides devices, backend, world size, rendezvous
    and threads. Everything it needs comes in as arguments (the Machine:
    torch's CUDA, DGL's CUDA) so that every case can be checked without a
    GPU."""
    cuda_available, dgl_cuda = machine.cuda, machine.dgl_cuda
    num_cuda_devices, num_cores = machine.num_gpus, machine.num_cores
    mode, notices = args.mode, []
    if mode == "auto":
        mode = "pinned-cuda" if cuda_available and dgl_cuda else "cpu-cpu"
        if not cuda_available:
            notices.append(
                "CUDA is not available: using --mode cpu-cpu "
                "(one CPU process per --gpu entry, gloo backend)."
            )
        elif not dgl_cuda:
            notices.append(
                f"torch sees {num_cuda_devices} GPU(s), but this DGL is a "
                "CPU-only build: using --mode cpu-cpu (one CPU process per "
                f"--gpu entry, gloo backend). To train on the GPUs: "
                f"{INSTALL_CUDA_DGL}"
            )
    storage, train_device = mode.split("-")
    check_mode(args, mode, machine)

    torchrun = all(key in env for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if torchrun:
        # torchrun starts one process per rank; the device is LOCAL_RANK.
        rank, local_rank = int(env["RANK"]), int(env["LOCAL_RANK"])
        world_size = int(env["WORLD_SIZE"])
        local_world_size = int(env.get("LOCAL_WORLD_SIZE", world_size))
        device_ids, rank_offset = [local_rank], rank
        init_method = "env://"
    else:
        device_ids = parse_gpu_list(args.gpu)
        world_size = local_world_size = len(device_ids)
        rank_offset, local_rank = 0, 0
        port = args.master_port or free_port()
        init_method = f"tcp://127.0.0.1:{port}"

    if train_device == "cuda":
        missing = [i for i in device_ids if i >= num_cuda_devices]
        if missing:
            raise UsageError(
                f"GPU {missing[0]} does not exist: {num_cuda_devices} CUDA "
                f"device(s) visible (ids 0..{num_cuda_devices - 1})"
            )
        devices = [f"cuda:{i}" for i in device_ids]
    else:
        devices = ["cpu"] * len(device_ids)

    if args.seed is not None and args.num_workers > 0:
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
        rank_env=rank_env,
        notices=notices,
    )


def check_mode(args, mode, machine):
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
    if args.num_workers > 0 and storage != "cpu":
        raise UsageError(
            f"--num-workers {args.num_workers}: with --mode {mode} sampling "
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


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):
        # One line naming the bad value, instead of usage text plus error;
        # under torchrun every rank parses the same arguments: rank 0 says it.
        fail(message, speak=os.environ.get("RANK", "0") == "0")


def int_at_least(minimum):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"'{text}' is not an integer"
            ) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(
                f"{value} is too small (at least {minimum})"
            )
        return value

    return parse


def positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} must be positive")
    return value


def fanout_list(text):
    try:
        fanout = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"'{text}' is not a comma-separated list of integers"
        ) from None
    if len(fanout) != NUM_LAYERS:
        raise argparse.ArgumentTypeError(
            f"'{text}' has {len(fanout)} values, but the model has "
            f"{NUM_LAYERS} SAGE layers"
        )
    if any(f == 0 or f < -1 for f in fanout):
        raise argparse.ArgumentTypeError(
            f"'{text}': each fanout is positive, or -1 for all neighbors"
        )
    return fanout


if __name__ == "__main__":
    main()
