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

As a template: copy this file and edit it; every place you adapt is here
(the model, the dataset's keys, the optimizer and LR schedule, the metric,
what --resume compares). The package `gbrun` (launching, signals,
checkpoint files, dataset checks) comes with the install and needs no edits.

This flowchart describes the main functional sequence of the example:
main
│
├───> Parse arguments; plan devices; load the dataset once (load_job)
│
└───> run (one process per device, or each torchrun process)
      │
      ├───> Init process group and build distributed model (HIGHLIGHT)
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
"""
import argparse

import gbrun
from gbrun.graphbolt import gb  # first: one line if GraphBolt cannot load

import dgl.nn as dglnn
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

# The dataset's names: the node features the model reads (side by side),
# and the node feature with each node's label (used where a task's item
# sets carry no labels of their own).
FEATURE_KEYS = ["feat"]
LABEL_KEY = "label"
# What a label is: "class", one class per node (cross-entropy), or
# "multi-hot", a 0/1 entry per class (multi-label; docs/customising.md).
# Labels of another shape or range are refused before training starts.
LABELS = "class"
HIDDEN_SIZE = 256
# The evaluation metric's name in the epoch line, metrics.jsonl and plots.
METRIC = "Accuracy"


class SAGE(nn.Module):
    def __init__(self, in_size, hidden_size, out_size):
        super().__init__()
        self.layers = nn.ModuleList()
        # Three-layer GraphSAGE-mean.
        self.layers.append(dglnn.SAGEConv(in_size, hidden_size, "mean"))
        self.layers.append(dglnn.SAGEConv(hidden_size, hidden_size, "mean"))
        self.layers.append(dglnn.SAGEConv(hidden_size, out_size, "mean"))
        # ReLU then dropout between layers. On CPU ranks gbrun runs this
        # pair in one pass (--fused-dropout), as any other nn.Dropout.
        self.relu_dropout = nn.Sequential(nn.ReLU(), nn.Dropout(0.5))

    def forward(self, blocks, x):
        hidden_x = x
        for layer_idx, (layer, block) in enumerate(zip(self.layers, blocks)):
            hidden_x = layer(block, hidden_x)
            is_last_layer = layer_idx == len(self.layers) - 1
            if not is_last_layer:
                hidden_x = self.relu_dropout(hidden_x)
        return hidden_x


def create_model(in_size, num_classes):
    """The model every rank trains. Sampling takes one block per entry of
    `model.layers`, so the fanout has one value per layer."""
    return SAGE(in_size, HIDDEN_SIZE, num_classes)


def create_optimizer(model, args):
    """The optimizer and an optional LR scheduler, stepped once per epoch.
    Checkpoints save both, and --resume restores them as saved."""
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = None
    return optimizer, scheduler


def resume_key(model, optimizer, scheduler, args, fanout):
    """What a checkpoint must agree on to be resumed, derived from the model
    itself (its class and constructor arguments, as its repr shows them, and
    every parameter's shape), the optimizer and scheduler (class and
    hyperparameters) and what shapes the data: a checkpoint of anything else
    is refused in one line before a rank starts."""
    return {
        "model": {
            "repr": repr(model),
            "shapes": {k: list(v.shape) for k, v in model.state_dict().items()},
        },
        "optimizer": gbrun.settings(optimizer),
        "scheduler": gbrun.settings(scheduler),
        "dataset": gbrun.dataset_identity(args.dataset),
        "fanout": fanout,
        "precision": args.precision,
    }


def node_features(data):
    """The model's input for a mini-batch: the FEATURE_KEYS features of its
    input nodes, side by side (one key is passed on as it is, uncopied)."""
    features = [data.node_features[key] for key in FEATURE_KEYS]
    return features[0] if len(features) == 1 else torch.cat(features, dim=1)


def create_dataloader(graph, features, itemset, device, storage, is_train, args,
                      fanout):
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
    options = gbrun.graphbolt_options(device, storage)
    datapipe = item_sampler
    # With the graph on the GPU (pinned or device memory) sampling runs
    # there, so the seeds move first.
    if storage != "cpu":
        datapipe = datapipe.copy_to(device, **options["copy_to"])
    datapipe = datapipe.sample_neighbor(
        graph, fanout, **options["sample_neighbor"]
    )
    datapipe = datapipe.fetch_feature(
        features, node_feature_keys=FEATURE_KEYS, **options["fetch_feature"]
    )
    # GraphBolt's DataLoader runs everything before copy_to in a prefetch
    # thread, overlapping sampling with a GPU's training. CPU ranks sample
    # between steps instead, with the rank's own threads.
    if storage == "cpu" and device.type == "cuda":
        datapipe = datapipe.copy_to(device)
    return gb.DataLoader(datapipe, args.num_workers, **options["DataLoader"])


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
def evaluate(model, dataloader, num_classes, state, name):
    """The metric over every item of `dataloader`, exact across ranks (on
    rank 0). Counting correct predictions (in int64: exact at any size),
    instead of concatenating them, works when a rank receives no items."""
    model.eval()
    num_correct = torch.tensor(0, device=state.device)
    num_items = 0
    for data in state.batches(dataloader, name):
        x = node_features(data)
        with torch.autocast(state.device.type, torch.bfloat16,
                            enabled=state.autocast):
            # Call the wrapped module: no DDP hooks, no collectives.
            y_hat = model.module(data.blocks, x if state.autocast else x.float())
        y = data.labels
        num_correct += (y_hat.argmax(dim=1) == y).sum()
        num_items += y.size(0)
    return weighted_reduce(num_correct, num_items)


def train(rank, args, model, optimizer, scheduler, train_loader, valid_loader,
          state):
    """Trains from where `state` starts; returns 0, or the signal that
    stopped training (a resumable checkpoint is then saved). Values of your
    own that must survive a stop and --resume (the best metric so far,
    early-stopping patience) go in the dict `state.kept`: each checkpoint
    saves rank 0's, and --resume gives it back to every rank."""
    num_classes, device = state.job.num_classes, state.device
    for epoch in state.epochs():
        epoch_start = gbrun.synchronized_time(device)
        model.train()
        # Zero, or the sums of a run that stopped inside this epoch.
        total_loss, num_train_items = state.sums_so_far(epoch)
        items_before = num_train_items
        batches = state.batches(train_loader, f"train {epoch}", epoch)
        ########################################################################
        # (HIGHLIGHT) Use Join Context Manager to solve uneven input problem.
        #
        # DDP requires every rank to run the same number of steps, otherwise
        # the program may error or hang. `drop_uneven_inputs=True` in the
        # training sampler already evens them out; Join also covers custom
        # samplers that do not. See
        # https://pytorch.org/tutorials/advanced/generic_join.html
        ########################################################################
        with Join([model, state.stop]):
            for data in batches:
                # The input features are from the source nodes in the first
                # layer's computation graph.
                x = node_features(data)

                # The ground truth labels are from the destination nodes
                # in the last layer's computation graph.
                y = data.labels

                # --precision bf16 stores features in bf16; the forward pass
                # runs in bf16 where the device computes it (state.autocast).
                with torch.autocast(device.type, torch.bfloat16,
                                    enabled=state.autocast):
                    y_hat = model(data.blocks, x if state.autocast else x.float())

                # The loss in fp32, whatever the forward pass computed in.
                loss = F.cross_entropy(y_hat.float(), y)

                optimizer.zero_grad()
                loss.backward()
                optimizer.step()

                total_loss += loss.detach() * y.size(0)
                num_train_items += y.size(0)
                # SIGTERM or SIGINT on any rank: every rank stops here.
                if state.stop.agreed():
                    break
        if state.stop.signum:
            return state.save_stop(
                epoch, batches.step, total_loss, num_train_items
            )
        train_time = gbrun.synchronized_time(device) - epoch_start

        if rank == 0:
            print("Validating...")
        metric = evaluate(
            model, valid_loader, num_classes, state, f"validate {epoch}"
        )
        total_loss = weighted_reduce(total_loss, num_train_items)
        if scheduler is not None:
            scheduler.step()

        epoch_time = gbrun.synchronized_time(device) - epoch_start
        # Every rank trains the same number of items (the sampler drops
        # uneven batches); a resumed epoch counts only what it trained.
        world_size = dist.get_world_size()
        seeds_per_second = (
            (num_train_items - items_before) * world_size / train_time
        )
        if rank == 0:
            # The checkpoint and metrics line first: an epoch line on the
            # screen means its checkpoint is on disk.
            state.save_epoch(epoch, {
                "epoch": epoch,
                "loss": total_loss.item(),
                "metric": METRIC,
                f"val_{METRIC.lower()}": metric.item(),
                "epoch_time": epoch_time,
                "train_time": train_time,
                "seeds_per_second": seeds_per_second,
                "data_wait": batches.data_wait,
                "ranks": world_size,
            })
            print(
                f"Epoch {epoch:05d} | "
                f"Average Loss {total_loss.item():.4f} | "
                f"{METRIC} {metric.item():.4f} | "
                f"Time {epoch_time:.4f} | "
                f"Train Time {train_time:.4f} | "
                f"Seeds/s {seeds_per_second:.1f} | "
                f"Data Wait {batches.data_wait:.4f}",
                flush=True,
            )
        if state.stopped_after(epoch):
            return state.stop.signum
    return 0


def run(rank, plan, args, job, stop):
    """One training process (rank) from start to end. `job` is what the
    parent loaded once for every rank, or None under torchrun. Returns 0, or
    the signal that stopped training."""
    ############################################################################
    # (HIGHLIGHT) Init process group; the rank's device comes from the plan.
    ############################################################################
    device = plan.device(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(plan.threads)
    dist.init_process_group(
        backend=plan.backend,
        init_method=plan.init_method,
        world_size=plan.world_size,
        rank=rank,
    )
    if job is None:
        # torchrun: no parent loaded the dataset; the ranks load it in turn.
        job = gbrun.load_job_in_turn(rank, plan, load_job, args)
    # Once the data is loaded, in each rank however it was launched.
    gbrun.keep_freed_memory()
    gbrun.poll_less()
    graph, features = gbrun.place_dataset(
        job.dataset, plan.storage, device, args.gpu_cache_size, FEATURE_KEYS
    )

    # DDP keeps one replica of the model per rank in sync.
    if job.seed is not None:
        torch.manual_seed(job.seed)
    model = create_model(job.in_size, job.num_classes).to(device)
    # CPU ranks: dropout, and ReLU then dropout, in one pass; in bf16,
    # nn.Linear's products in shapes that recur.
    gbrun.tune_model(model, plan)
    optimizer, scheduler = create_optimizer(model, args)
    # Restores the states of a resumed run; saves them from now on.
    state = gbrun.RunState(
        rank, args, job, stop, device, plan.autocast,
        {"model": model, "optimizer": optimizer, "scheduler": scheduler},
    )
    model = DDP(model)

    train_set, valid_set, test_set = job.item_sets

    def dataloader(itemset, is_train):
        return create_dataloader(
            graph, features, itemset, device, plan.storage, is_train, args,
            job.fanout,
        )

    train_loader = dataloader(train_set, is_train=True)
    valid_loader = dataloader(valid_set, is_train=False)
    test_loader = dataloader(test_set, is_train=False)

    if rank == 0:
        print("Training...")
    stopped_by = train(
        rank, args, model, optimizer, scheduler, train_loader, valid_loader,
        state,
    )
    if stopped_by:
        return stopped_by

    if rank == 0:
        print("Testing...")
    metric = evaluate(model, test_loader, job.num_classes, state, "test")
    if rank == 0:
        print(f"Test {METRIC} {metric.item():.4f}", flush=True)
        state.save_result({
            "metric": METRIC,
            f"test_{METRIC.lower()}": metric.item(),
            "ranks": plan.world_size,
        })
    # Rank 0 hosts the rendezvous store: nobody leaves before all are done.
    gbrun.barrier(device)
    return 0


def load_job(args, world_size):
    """Loads and checks, once, what every rank needs (see gbrun.Job): bad
    input is refused here, before any rank trains."""
    dataset = gbrun.load_dataset(args.dataset, args.data_root)
    item_sets = gbrun.check_dataset(
        dataset, args.dataset, FEATURE_KEYS, LABEL_KEY, LABELS
    )
    gbrun.check_train_split(len(item_sets[0]), args.batch_size, world_size)
    if args.precision == "bf16":
        gbrun.store_in_bf16(dataset, FEATURE_KEYS)
    in_size = gbrun.feature_size(dataset, FEATURE_KEYS)
    num_classes = dataset.tasks[0].metadata["num_classes"]
    # Built here once to size the fanout and key the checkpoint.
    model = create_model(in_size, num_classes)
    fanout = gbrun.check_fanout(args.fanout, len(model.layers))
    config = resume_key(model, *create_optimizer(model, args), args, fanout)
    checkpoint, seed = gbrun.open_checkpoint(args, config, world_size)
    return gbrun.Job(
        dataset, item_sets, in_size, num_classes, fanout, config, checkpoint,
        seed,
    )


def parse_args(argv=None):
    parser = gbrun.ArgumentParser(
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
        "--epochs", type=gbrun.int_at_least(1), default=10,
        help="Number of training epochs.",
    )
    parser.add_argument(
        "--lr", type=gbrun.positive_float, default=0.001,
        help="Learning rate for optimization.",
    )
    parser.add_argument(
        "--batch-size", type=gbrun.int_at_least(1), default=1024,
        help="Batch size (per rank) for training.",
    )
    parser.add_argument(
        "--fanout", type=gbrun.fanout_list, default=None,
        help="Fan-out of neighbor sampling, one value per layer of the model;"
        " -1 takes all neighbors. Default: 10 per layer.",
    )
    parser.add_argument(
        "--num-workers", type=gbrun.int_at_least(0), default=0,
        help="The number of data loading worker processes per rank (only"
        " where sampling runs on the CPU).",
    )
    parser.add_argument(
        "--gpu-cache-size", type=gbrun.int_at_least(0), default=0,
        help="The capacity of the GPU feature cache in bytes (pinned-cuda).",
    )
    parser.add_argument(
        "--dataset", type=str, default="ogbn-products",
        help="A builtin GraphBolt dataset ("
        + ", ".join(gbrun.BUILTIN_DATASETS)
        + ") or the path of an OnDiskDataset directory (with metadata.yaml).",
    )
    parser.add_argument(
        "--data-root", type=str, default="datasets",
        help="Where builtin datasets are downloaded to.",
    )
    parser.add_argument(
        "--mode", default="auto", choices=gbrun.MODES,
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
        "--fused-dropout", action=argparse.BooleanOptionalAction, default=True,
        help="On CPU ranks, run the model's nn.Dropout layers as one pass with"
        " a hashed random mask (a C kernel built once with cc);"
        " --no-fused-dropout keeps torch's.",
    )
    parser.add_argument(
        "--threads", type=gbrun.int_at_least(1), default=None,
        help="CPU threads per rank for PyTorch and sampling (default: the"
        " machine's cores divided by the ranks on it).",
    )
    parser.add_argument(
        "--max-batches", type=gbrun.int_at_least(1), default=None,
        help="Stop every training epoch and every evaluation after this many"
        " batches per rank (quick runs, benchmarks). Default: all.",
    )
    parser.add_argument(
        "--master-port", type=gbrun.port, default=None,
        help="Rendezvous port on 127.0.0.1 (default: a free port).",
    )
    parser.add_argument(
        "--seed", type=gbrun.int_at_least(0), default=None,
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
    # Plans devices (bad input: one line, exit 2, nothing spawned), loads the
    # dataset once with load_job, and runs `run` in one process per device
    # (mp.spawn), or as this torchrun process's rank.
    gbrun.launch_ranks(run, args, load_job)


if __name__ == "__main__":
    main()
