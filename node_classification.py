"""
This script trains and tests a GraphSAGE model for node classification on
multiple GPUs with DistributedDataParallel (DDP), fed by GraphBolt's data
loader. It is DGL's examples/multigpu/graphbolt/node_classification.py, and
it also runs without a GPU (one CPU process per --gpu entry, gloo backend),
offline on a dataset directory, and under torchrun.

    # Two GPUs (DGL's CUDA build, see docs/gpus.md); else two CPU processes:
    python node_classification.py --gpu=0,1
    # Offline, on the graph that comes with the example (or a directory):
    python node_classification.py --gpu=0,1 --dataset synthetic
    # One process per rank, started by torchrun:
    torchrun --standalone --nproc-per-node=2 node_classification.py \
        --dataset synthetic

As a template: copy this file and edit it; every place you adapt is here
(the model, the dataset's keys, the optimizer and LR schedule, the metric,
what --resume compares). The package `gbrun` (launching, signals,
checkpoint files, dataset checks) comes with the install and needs no edits.

This flowchart describes the main functional sequence of the example:
main
│
├───> Parse arguments; plan devices; load the dataset once (load_job)
│
└───> run (one process per device, each torchrun process, or each trainer
      │    of distributed/dist_node_classification.py on DGL's engine)
      │
      ├───> Init process group and build distributed model (HIGHLIGHT)
      │
      ├───> Progress: restores a resumed run, saves it from now on
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
      ├───> Test set evaluation
      │
      └───> predict (--predict): every node, layer by layer over full
            neighbourhoods, each rank its share; rank 0 writes the file
"""
import argparse
import time

# First: one line, not a traceback, where GraphBolt cannot load.
from gbrun.graphbolt import gb, graphbolt_options
from gbrun import checkpoint, cli, cpu, launch, metrics, predicting, sources
from gbrun.data import datasets
from gbrun.progress import Progress

import dgl.nn as dglnn
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchmetrics
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

# The dataset's names: the node features the model reads (side by side),
# and the node feature with each node's label (used where a task's item
# sets carry no labels of their own).
FEATURE_KEYS = ["feat"]
LABEL_KEY = "label"
# What a label is: "class", one class per node (cross-entropy), "multi-hot",
# a 0/1 entry per class (multi-label), or "value", num_classes floats per
# node (regression; both in docs/customising.md). Labels of another shape,
# dtype or range are refused before training starts.
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

    def forward(self, blocks, x, first_layer=0):
        # One layer per block, from `first_layer` on: all of them when
        # training, one at a time when predicting every node (predict).
        hidden_x = x
        for layer_idx, block in enumerate(blocks, first_layer):
            hidden_x = self.layers[layer_idx](block, hidden_x)
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
    hyperparameters), the dataset (by content), the features and labels read
    and what shapes the data: a checkpoint of anything else is refused in
    one line before a rank starts. "steps", what cuts an epoch
    into steps, is compared only for a checkpoint saved inside an epoch; a
    run that only predicts compares no part in checkpoint.TRAINING_KEYS."""
    return {
        "model": checkpoint.described(model),
        "optimizer": checkpoint.hyperparameters(optimizer),
        "scheduler": checkpoint.hyperparameters(scheduler),
        "dataset": datasets.dataset_identity(args.dataset),
        "features": FEATURE_KEYS,
        "labels": [LABEL_KEY, LABELS],
        "fanout": fanout,
        "precision": args.precision,
        "steps": {"batch_size": args.batch_size},
    }


def node_features(data):
    """The model's input for a mini-batch: the FEATURE_KEYS features of its
    input nodes, side by side (one key is passed on as it is, uncopied)."""
    features = [data.node_features[key] for key in FEATURE_KEYS]
    return features[0] if len(features) == 1 else torch.cat(features, dim=1)


def create_dataloader(graph, features, itemset, device, storage, is_train, args,
                      fanout):
    if isinstance(graph, sources.ServedGraph):
        # DGL's distributed engine (distributed/): graph servers hold the
        # graph, and DGL's own loader samples this trainer's nodes, with
        # batches in GraphBolt's shape. The trainer refuses a copy whose
        # GraphBolt pipeline below is edited.
        return graph.dataloader(itemset, is_train, args.batch_size, fanout,
                                FEATURE_KEYS, LABEL_KEY, device)
    ############################################################################
    # (HIGHLIGHT) Get a GraphBolt dataloader for node classification with
    # multi-process distributed training. DistributedItemSampler instead of
    # ItemSampler gives every rank its own share of the items, in whole
    # batches (each training epoch's shares are cut from one new permutation
    # of all of them: gbrun.graphbolt.share_one_permutation). For training,
    # `drop_last` and `drop_uneven_inputs` give every rank the same number of
    # full batches; for evaluation nothing is dropped, so every item is
    # scored exactly once (some ranks may get none).
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
    # (HIGHLIGHT) Collect loss values from sub-processes and obtain the
    # overall average value.
    #
    # Ranks may process different numbers of items (a rank can even have
    # none), so each rank sends sum(value * count) and its count; rank `dst`
    # divides the totals. A rank with no items adds zero to both sums.
    ########################################################################
    dist.reduce(tensor=tensor, dst=dst)
    weight = torch.tensor(weight, dtype=tensor.dtype, device=tensor.device)
    dist.reduce(tensor=weight, dst=dst)
    return tensor / weight


def create_metric(num_classes):
    """The evaluation metric (named METRIC): any torchmetrics metric, whose
    state may be counts (accuracy, F1) or every prediction (AUROC)."""
    return torchmetrics.classification.MulticlassAccuracy(
        num_classes, average="micro"
    )


def to_prediction(y_hat):
    """What --predict writes for each node, from the model's outputs: the
    class (int64) for LABELS "class", each class's probability for
    "multi-hot", the values themselves for "value"."""
    if LABELS == "class":
        return y_hat.argmax(dim=1)
    if LABELS == "multi-hot":
        return torch.sigmoid(y_hat)
    return y_hat


@torch.no_grad()
def evaluate(model, dataloader, num_classes, device):
    """The metric over every item of `dataloader`, exact on every rank:
    compute() gathers every rank's state (here counts of correct
    predictions, in int64), and gbrun's gather also takes a rank that
    received no items."""
    model.eval()
    metric = metrics.across_ranks(create_metric(num_classes), device)
    for data in dataloader:
        x = node_features(data)
        with torch.autocast(device.type, torch.bfloat16,
                            enabled=x.dtype == torch.bfloat16):
            # Call the wrapped module: no DDP hooks, no collectives.
            y_hat = model.module(data.blocks, x)
        metric.update(y_hat.float(), data.labels)
    return metric.compute()


@torch.no_grad()
def predict(model, dataloader, every_node, device):
    """Every node's outputs, layer by layer over full neighbourhoods (DGL's
    layerwise_infer): each layer runs over all nodes, each rank computing
    its share, before the next one reads them. Returned on rank 0."""
    model.eval()
    for layer_idx in range(len(model.module.layers)):
        for data in every_node.batches(dataloader, layer_idx):
            if layer_idx == 0:
                x = node_features(data)
            else:
                x = every_node.inputs(data)  # the previous layer's outputs
            with torch.autocast(device.type, torch.bfloat16,
                                enabled=x.dtype == torch.bfloat16):
                y_hat = model.module(data.blocks, x, first_layer=layer_idx)
            every_node.add(data, y_hat)
        every_node.exchange()  # every rank, after each layer
    return every_node.outputs


def train(rank, args, model, optimizer, scheduler, train_loader, valid_loader,
          num_classes, device, progress):
    """Trains the epochs that `progress` has left (all of them, or those of
    a resumed run, from the step where it stopped).

    Change freely: the step (forward pass, loss, backward, optimizer, a
    scheduler stepped per batch), what is validated and what is printed.
    Exact resume and SIGTERM need the lines that name `progress` or
    `batches`, and each refuses loudly if dropped or misplaced: the epochs
    come from progress.epochs(), the batches are iterated inside Join and
    to the end, batches.add() runs once a step, and rank 0 calls
    progress.save_epoch() after the epoch's last change of the optimizer,
    the schedule or progress.kept. Values of your own that must survive a
    stop and --resume (the best metric so far, early-stopping patience) go
    in the dict `progress.kept`: each checkpoint saves rank 0's, and
    --resume gives it back to every rank. A stop signal (SIGTERM, Ctrl-C)
    ends training on every rank at one step (the first that ends with an
    optimizer.step(), should you accumulate gradients), with a checkpoint,
    by raising gbrun.stop.Stopped out of the Join block; `break` out of
    the epochs ends training early."""
    for epoch, batches in progress.epochs(train_loader):
        epoch_start = time.time()
        model.train()
        ########################################################################
        # (HIGHLIGHT) Use Join Context Manager to solve uneven input problem.
        #
        # DDP requires every rank to run the same number of steps, otherwise
        # the program may error or hang. `drop_uneven_inputs=True` in the
        # training sampler already evens them out; Join also covers custom
        # samplers that do not. See
        # https://pytorch.org/tutorials/advanced/generic_join.html
        ########################################################################
        with Join([model, batches]):
            for data in batches:
                # The input features are from the source nodes in the first
                # layer's computation graph.
                x = node_features(data)

                # The ground truth labels are from the destination nodes
                # in the last layer's computation graph.
                y = data.labels

                # --precision bf16 stores features in bf16; they arrive in
                # bf16 where the device computes it, and the forward pass
                # then runs under autocast.
                with torch.autocast(device.type, torch.bfloat16,
                                    enabled=x.dtype == torch.bfloat16):
                    y_hat = model(data.blocks, x)

                # The loss in fp32 (yours? add what it is to resume_key).
                loss = F.cross_entropy(y_hat.float(), y)

                optimizer.zero_grad()
                loss.backward()
                optimizer.step()

                # This rank's loss sum for the epoch (kept by a stop).
                batches.add(loss, y.size(0))

        if rank == 0:
            print("Validating...")
        metric = evaluate(model, valid_loader, num_classes, device)
        # The epoch's sums, with those of the steps a stopped run trained.
        total_loss, num_train_items = batches.totals()
        total_loss = weighted_reduce(total_loss, num_train_items)
        if scheduler is not None:
            scheduler.step()

        epoch_time = time.time() - epoch_start
        if rank == 0:
            # The checkpoint and metrics line first: an epoch line on the
            # screen means its checkpoint is on disk.
            progress.save_epoch({
                "epoch": epoch,
                "loss": total_loss.item(),
                "metric": METRIC,
                f"val_{METRIC.lower()}": metric.item(),
                "epoch_time": epoch_time,
            })
            print(
                f"Epoch {epoch:05d} | "
                f"Average Loss {total_loss.item():.4f} | "
                f"{METRIC} {metric.item():.4f} | "
                f"Time {epoch_time:.4f} | "
                f"{batches.speed}",  # Train Time, Seeds/s and Data Wait
                flush=True,
            )


def run(rank, plan, args, job):
    """One training process (rank) from start to end. `job` is what the
    parent loaded once for every rank, or None under torchrun."""
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
        job = launch.load_job_in_turn(rank, plan, load_job, args)
    # The graph and features where --mode puts them, and the item sets (on
    # DGL's distributed engine: a DistGraph, this trainer's node_split).
    graph, features, item_sets = sources.place(
        job, plan.storage, device, args.gpu_cache_size, FEATURE_KEYS
    )

    # DDP keeps one replica of the model per rank in sync.
    if job.start.seed is not None:
        torch.manual_seed(job.start.seed)
    model = create_model(job.in_size, job.num_classes).to(device)
    # Memory and loader settings; on CPU ranks, dropout (and ReLU then
    # dropout) in one pass and, in bf16, nn.Linear's products in shapes
    # that recur.
    cpu.tune_rank(model, plan)
    optimizer, scheduler = create_optimizer(model, args)
    # Restores what a resumed run saved; saves it from now on.
    progress = Progress(plan, job.start, model=model, optimizer=optimizer,
                        scheduler=scheduler)
    model = DDP(model, device_ids=[device] if device.type == "cuda" else None)

    train_set, valid_set, test_set = item_sets

    def dataloader(itemset, is_train, fanout=job.fanout):
        return create_dataloader(
            graph, features, itemset, device, plan.storage, is_train, args,
            fanout,
        )

    train_loader = dataloader(train_set, is_train=True)
    # Each evaluation pass at most --max-batches long, shown on rank 0.
    valid_loader = progress.evaluation(dataloader(valid_set, False), "validate")
    test_loader = progress.evaluation(dataloader(test_set, False), "test")

    if rank == 0 and job.start.trains:
        print("Training...")
    train(
        rank, args, model, optimizer, scheduler, train_loader, valid_loader,
        job.num_classes, device, progress,
    )

    if rank == 0:
        print("Testing...")
    metric = evaluate(model, test_loader, job.num_classes, device)
    if rank == 0:
        print(f"Test {METRIC} {metric.item():.4f}", flush=True)
        progress.save_final({
            "metric": METRIC, f"test_{METRIC.lower()}": metric.item(),
        })

    if args.predict:
        # Every node's prediction, in the dataset's node ids (rank 0 writes
        # the file); one layer at a time, over full neighbourhoods (-1) or
        # at most --predict-fanout neighbours.
        every_node = predicting.EveryNode(job, graph, progress)
        all_nodes = dataloader(every_node.item_set, False,
                               fanout=[args.predict_fanout])
        outputs = predict(model, all_nodes, every_node, device)
        every_node.save(to_prediction(outputs), args.predict, LABELS)


def load_job(args, plan):
    """Loads and checks, once, what every rank needs (a gbrun.launch.Job):
    bad input is refused here, before any rank trains."""
    dataset = datasets.load_dataset(args.dataset, args.data_root)
    item_sets = datasets.check_dataset(
        dataset, args.dataset, FEATURE_KEYS, LABEL_KEY, LABELS
    )
    if args.precision == "bf16":
        datasets.store_in_bf16(dataset, FEATURE_KEYS)
    in_size = datasets.feature_size(dataset, FEATURE_KEYS)
    num_classes = dataset.tasks[0].metadata["num_classes"]
    # Built here once to size the fanout and key the checkpoint.
    model = create_model(in_size, num_classes)
    fanout = cli.check_fanout(args.fanout, len(model.layers))
    key = resume_key(model, *create_optimizer(model, args), args, fanout)
    start = checkpoint.start_or_resume(args, key, plan, args.epochs)
    if start.trains:  # all but a --resume --predict of a finished run
        datasets.check_train_split(
            len(item_sets[0]), args.batch_size, plan.world_size
        )
    return launch.Job(dataset, item_sets, in_size, num_classes, fanout, start)


def parse_args(argv=None):
    parser = cli.ArgumentParser(
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
        "--epochs", type=cli.int_at_least(1), default=10,
        help="Number of training epochs.",
    )
    parser.add_argument(
        "--lr", type=cli.positive_float, default=0.001,
        help="Learning rate for optimization.",
    )
    parser.add_argument(
        "--batch-size", type=cli.int_at_least(1), default=1024,
        help="Batch size (per rank) for training.",
    )
    parser.add_argument(
        "--fanout", type=cli.fanout_list, default=None,
        help="Fan-out of neighbor sampling, one value per layer of the model;"
        " -1 takes all neighbors. Default: 10 per layer.",
    )
    parser.add_argument(
        "--num-workers", type=cli.int_at_least(0), default=0,
        help="The number of data loading worker processes per rank (only"
        " where sampling runs on the CPU).",
    )
    parser.add_argument(
        "--dataset", type=str, default="ogbn-products",
        help="A dataset that comes with the example ("
        + ", ".join(datasets.COMES_WITH) + "), a builtin GraphBolt dataset ("
        + ", ".join(datasets.BUILTIN_DATASETS)
        + ") or the path of an OnDiskDataset directory (with metadata.yaml).",
    )
    parser.add_argument(
        "--data-root", type=str, default="datasets",
        help="Where builtin datasets are downloaded to.",
    )
    # What gbrun reads: devices, precision, threads, seed, checkpoints.
    cli.add_run_options(parser)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    # Plans devices (bad input: one line, exit 2, nothing spawned), loads the
    # dataset once with load_job, and runs `run` in one process per device
    # (started by this process), or as this torchrun process's rank.
    launch.launch_ranks(run, load_job, args, args.gpu, args.num_workers)


if __name__ == "__main__":
    main()
