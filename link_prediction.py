"""
This script trains and tests a GraphSAGE model for link prediction on
multiple GPUs with DistributedDataParallel (DDP), fed by GraphBolt's data
loader: node_classification.py's second task, with the same support package
(gbrun) and the same guarantees (exact metrics over ranks, exact resume,
SIGTERM, one-line refusals). Its model, sampling and MRR are those of DGL's
examples/sampling/graphbolt/link_prediction.py, spread over ranks.

    # The link-prediction graph that comes with the example (made on first
    # use), or any dataset with a link task (docs/own-data.md converts yours):
    python link_prediction.py --gpu=0,1 --dataset synthetic-links
    # Every node's embedding, to score any pair afterwards:
    python link_prediction.py --gpu=0,1 --dataset synthetic-links \
        --predict embeddings.npy

As a template: copy this file and edit it; every place you adapt is here
(the model and its score, the negatives, the optimizer, the metric, what
--resume compares). It trains on one machine; DGL's distributed engine
(distributed/) runs node_classification.py's copies only.

main
│
├───> Parse arguments; plan devices; load the dataset once (load_job)
│
└───> run (one process per device, or each torchrun process)
      │
      ├───> Init process group and build distributed model
      │
      ├───> Get GraphBolt dataloaders: the train set's node pairs with
      │     DistributedItemSampler, uniform negatives, seed edges excluded
      │     from the sampled neighbourhoods (HIGHLIGHT)
      │
      ├───> train: binary cross-entropy on positive and negative pairs,
      │     under Join; each epoch validated by MRR
      │
      ├───> Test set evaluation: every node's embedding layer by layer over
      │     full neighbourhoods, each rank scoring its share of the pairs
      │
      └───> --predict: every node's embedding, written by rank 0
"""
import argparse
import time
from functools import partial

# First: one line, not a traceback, where GraphBolt cannot load.
from gbrun.graphbolt import (
    exclude_seed_edges, gb, graphbolt_options, scored_pairs,
)
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

# The node features the model reads (side by side), and the dataset's task
# this trains: its train set holds node pairs, its validation and test sets
# node pairs with negative destinations (convert_to_ondisk.py --link-...).
FEATURE_KEYS = ["feat"]
TASK = "link_prediction"
HIDDEN_SIZE = 256
# The epoch line shows MRR and Hits@k for each k here.
HITS_AT = (1, 3, 10)
METRIC = "MRR"


class SAGE(nn.Module):
    def __init__(self, in_size, hidden_size):
        super().__init__()
        self.layers = nn.ModuleList()
        # Three-layer GraphSAGE-mean: every node's embedding.
        self.layers.append(dglnn.SAGEConv(in_size, hidden_size, "mean"))
        self.layers.append(dglnn.SAGEConv(hidden_size, hidden_size, "mean"))
        self.layers.append(dglnn.SAGEConv(hidden_size, hidden_size, "mean"))
        # A pair's score (a logit) from its two embeddings.
        self.predictor = nn.Sequential(
            nn.Linear(hidden_size, hidden_size),
            nn.ReLU(),
            nn.Linear(hidden_size, hidden_size),
            nn.ReLU(),
            nn.Linear(hidden_size, 1),
        )

    def forward(self, blocks, x, pairs=None, first_layer=0):
        # One layer per block, from `first_layer` on: all of them when
        # training, one at a time when embedding every node (embed). With
        # `pairs` (sources, destinations: rows of the last layer's outputs),
        # their scores; else the embeddings.
        hidden_x = x
        for layer_idx, block in enumerate(blocks, first_layer):
            hidden_x = self.layers[layer_idx](block, hidden_x)
            is_last_layer = layer_idx == len(self.layers) - 1
            if not is_last_layer:
                hidden_x = F.relu(hidden_x)
        if pairs is None:
            return hidden_x
        return self.score(hidden_x[pairs[0]], hidden_x[pairs[1]])

    def score(self, h_src, h_dst):
        return self.predictor(h_src * h_dst).squeeze(-1)


def create_model(in_size):
    """The model every rank trains. Sampling takes one block per entry of
    `model.layers`, so the fanout has one value per layer."""
    return SAGE(in_size, HIDDEN_SIZE)


def create_optimizer(model, args):
    """The optimizer and an optional LR scheduler, stepped once per epoch.
    Checkpoints save both, and --resume restores them as saved."""
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = None
    return optimizer, scheduler


def resume_key(model, optimizer, scheduler, args, fanout):
    """What a checkpoint must agree on to be resumed (see
    node_classification.py's): here also the loss, the task and the
    negatives."""
    return {
        "model": checkpoint.described(model),
        "optimizer": checkpoint.hyperparameters(optimizer),
        "scheduler": checkpoint.hyperparameters(scheduler),
        "loss": "binary cross-entropy",
        "dataset": datasets.dataset_identity(args.dataset),
        "features": FEATURE_KEYS,
        "task": TASK,
        "negatives": {"ratio": args.neg_ratio},
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
                      fanout, directed=False):
    # Every rank its own share of the items (node pairs when training,
    # nodes when embedding them), as node_classification.py shares them.
    item_sampler = gb.DistributedItemSampler(
        item_set=itemset,
        batch_size=args.batch_size,
        drop_last=is_train,
        shuffle=is_train,
        drop_uneven_inputs=is_train,
    )
    options = graphbolt_options(device, storage)
    datapipe = item_sampler
    if storage != "cpu":
        datapipe = datapipe.copy_to(device, **options["copy_to"])
    if is_train:
        ########################################################################
        # (HIGHLIGHT) Negatives: for each positive pair (u, v) of the batch,
        # --neg-ratio pairs (u, v') with v' drawn uniformly from all nodes.
        ########################################################################
        datapipe = datapipe.sample_uniform_negative(graph, args.neg_ratio)
    datapipe = datapipe.sample_neighbor(
        graph, fanout, **options["sample_neighbor"]
    )
    if is_train:
        ########################################################################
        # (HIGHLIGHT) The batch's pairs, and their reverses, taken out of the
        # sampled neighbourhoods: the model must not read the edge it is
        # asked to predict (a directed task's reverses are other facts).
        # (GraphBolt's gb.exclude_seed_edges: the same subgraphs, faster.)
        ########################################################################
        datapipe = datapipe.transform(
            partial(exclude_seed_edges, include_reverse_edges=not directed)
        )
    datapipe = datapipe.fetch_feature(
        features, node_feature_keys=FEATURE_KEYS, **options["fetch_feature"]
    )
    if storage == "cpu" and device.type == "cuda":
        datapipe = datapipe.copy_to(device)
    return gb.DataLoader(datapipe, args.num_workers, **options["DataLoader"])


def create_pair_loader(pairs, batch_size):
    """This rank's share of an evaluation set, (pairs, negatives) batches:
    whole batches, nothing dropped, so that every pair is scored once (some
    ranks may get none)."""
    return gb.DistributedItemSampler(
        item_set=gb.ItemSet(pairs),
        batch_size=batch_size,
        minibatcher=as_they_are,
    )


def as_they_are(batch, names):
    """An evaluation batch as the item set holds it: (pairs, negatives)."""
    return batch


def weighted_reduce(tensor, weight, dst=0):
    """The mean over every rank's items: each rank sends sum(value * count)
    and its count; rank `dst` divides the totals (a rank with no items adds
    zero to both)."""
    dist.reduce(tensor=tensor, dst=dst)
    weight = torch.tensor(weight, dtype=tensor.dtype, device=tensor.device)
    dist.reduce(tensor=weight, dst=dst)
    return tensor / weight


class RankCounts(torchmetrics.Metric):
    """MRR and Hits@k as OGB's link-prediction evaluator defines them (the
    one DGL's example uses): a positive pair's rank among its own negatives
    is 1 + those scored above it + half of those scored equal. The state
    counts the pairs of each rank (in halves): integers, which the ranks
    add exactly, whatever their shares."""

    def __init__(self, num_negatives):
        super().__init__()
        self.add_state("counts", torch.zeros(2 * num_negatives + 3,
                                             dtype=torch.int64),
                       dist_reduce_fx="sum")

    def update(self, positive, negatives):
        above = (negatives > positive[:, None]).sum(1)
        tied = (negatives >= positive[:, None]).sum(1)
        twice_rank = above + tied + 2
        self.counts += torch.bincount(twice_rank, minlength=len(self.counts))

    def compute(self):
        rank = torch.arange(len(self.counts), dtype=torch.float64) / 2
        counts = self.counts.to(torch.float64).cpu()
        total = counts.sum()
        values = {"MRR": (counts[2:] / rank[2:]).sum() / total}
        for k in HITS_AT:
            values[f"Hits@{k}"] = counts[rank <= k].sum() / total
        return values


def create_metric(num_negatives):
    """The evaluation metrics, {name: value}; METRIC names the main one."""
    return RankCounts(num_negatives)


@torch.no_grad()
def embed(model, dataloader, every_node, device):
    """Every node's embedding, layer by layer over full neighbourhoods
    (DGL's layerwise inference): each layer runs over all nodes, each rank
    computing its share, before the next one reads them. Afterwards
    every_node.read(nodes) gives any node's, on every rank."""
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


@torch.no_grad()
def evaluate(model, all_nodes, every_node, pair_loader, num_negatives,
             device):
    """The metrics of every pair of an evaluation set, exact on every rank:
    every node is embedded (embed), then each rank scores its share of the
    pairs (`pair_loader`), each positive against its own negatives."""
    embed(model, all_nodes, every_node, device)
    metric = metrics.across_ranks(create_metric(num_negatives), device)
    for pairs, negatives in pair_loader:
        sources = every_node.read(pairs[:, 0])
        # Each pair's destination, then its negatives: (pairs, 1 + K).
        destinations = torch.cat([pairs[:, 1:], negatives], dim=1)
        h_dst = every_node.read(destinations.reshape(-1)).view(
            *destinations.shape, -1)
        scores = model.module.score(sources[:, None, :], h_dst).float()
        metric.update(scores[:, 0], scores[:, 1:])
    return metric.compute()


def train(rank, args, model, optimizer, scheduler, train_loader, validate,
          device, progress):
    """Trains the epochs that `progress` has left, as node_classification.py's
    train() does (its docstring says which lines exact resume and SIGTERM
    need); `validate()` gives the validation metrics."""
    for epoch, batches in progress.epochs(train_loader):
        epoch_start = time.time()
        model.train()
        with Join([model, batches]):
            for data in batches:
                x = node_features(data)
                # The batch's positive pairs then its negatives (rows of
                # the model's outputs), labelled 1.0 and 0.0.
                sources, destinations, y = scored_pairs(data)
                with torch.autocast(device.type, torch.bfloat16,
                                    enabled=x.dtype == torch.bfloat16):
                    logits = model(data.blocks, x, (sources, destinations))
                loss = F.binary_cross_entropy_with_logits(logits.float(), y)

                optimizer.zero_grad()
                loss.backward()
                optimizer.step()

                # This rank's loss sum, counted in positive pairs (the
                # train set's items; Seeds/s counts them too).
                batches.add(loss, y.size(0) // (1 + args.neg_ratio))

        if rank == 0:
            print("Validating...")
        metric = validate()
        total_loss, num_train_items = batches.totals()
        total_loss = weighted_reduce(total_loss, num_train_items)
        if scheduler is not None:
            scheduler.step()

        epoch_time = time.time() - epoch_start
        if rank == 0:
            progress.save_epoch({
                "epoch": epoch,
                "loss": total_loss.item(),
                "metric": METRIC,
                **{f"val_{name.lower()}": value.item()
                   for name, value in metric.items()},
                "epoch_time": epoch_time,
            })
            print(
                f"Epoch {epoch:05d} | "
                f"Average Loss {total_loss.item():.4f} | "
                + "".join(f"{name} {value.item():.4f} | "
                          for name, value in metric.items())
                + f"Time {epoch_time:.4f} | "
                f"{batches.speed}",  # Train Time, Seeds/s and Data Wait
                flush=True,
            )


def run(rank, plan, args, job):
    """One training process (rank) from start to end. `job` is what the
    parent loaded once for every rank, or None under torchrun."""
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
        job = launch.load_job_in_turn(rank, plan, load_job, args)
    graph, features, item_sets = sources.place(
        job, plan.storage, device, args.gpu_cache_size, FEATURE_KEYS
    )

    if job.start.seed is not None:
        torch.manual_seed(job.start.seed)
    model = create_model(job.in_size).to(device)
    cpu.tune_rank(model, plan)
    optimizer, scheduler = create_optimizer(model, args)
    progress = Progress(plan, job.start, model=model, optimizer=optimizer,
                        scheduler=scheduler)
    model = DDP(model, device_ids=[device] if device.type == "cuda" else None)

    train_set, valid_set, test_set = item_sets
    train_loader = create_dataloader(
        graph, features, train_set, device, plan.storage, True, args,
        job.fanout, datasets.is_directed(job.dataset, TASK),
    )
    # Evaluation embeds every node (over full neighbourhoods, or at most
    # --predict-fanout neighbours), then scores this rank's pairs.
    every_node = predicting.EveryNode(job, graph, progress, name="embed")
    all_nodes = create_dataloader(
        graph, features, every_node.item_set, device, plan.storage, False,
        args, [args.predict_fanout],
    )

    def evaluate_pairs(pairs):
        """The metrics of an evaluation set, (pairs, negatives)."""
        return evaluate(model, all_nodes, every_node,
                        create_pair_loader(pairs, args.batch_size),
                        pairs[1].size(1), device)

    if rank == 0 and job.start.trains:
        print("Training...")
    train(rank, args, model, optimizer, scheduler, train_loader,
          partial(evaluate_pairs, valid_set), device, progress)

    if rank == 0:
        print("Testing...")
    metric = evaluate_pairs(test_set)
    if rank == 0:
        print("Test " + " | ".join(f"{name} {value.item():.4f}"
                                   for name, value in metric.items()),
              flush=True)
        progress.save_final({
            "metric": METRIC,
            **{f"test_{name.lower()}": value.item()
               for name, value in metric.items()},
        })

    if args.predict:
        # The embeddings the test scored, in the dataset's node ids (rank 0
        # writes the file): model.module.score(h[u], h[v]) scores any pair.
        every_node.save(every_node.outputs, args.predict, "embedding")


def load_job(args, plan):
    """Loads and checks, once, what every rank needs (a gbrun.launch.Job):
    bad input is refused here, before any rank trains."""
    dataset = datasets.load_dataset(args.dataset, args.data_root)
    train_set, valid_set, test_set = datasets.check_link_task(
        dataset, args.dataset, FEATURE_KEYS, TASK
    )
    if args.precision == "bf16":
        datasets.store_in_bf16(dataset, FEATURE_KEYS)
    in_size = datasets.feature_size(dataset, FEATURE_KEYS)
    model = create_model(in_size)
    fanout = cli.check_fanout(args.fanout, len(model.layers))
    key = resume_key(model, *create_optimizer(model, args), args, fanout)
    start = checkpoint.start_or_resume(args, key, plan, args.epochs)
    if start.trains:  # all but a --resume --predict of a finished run
        datasets.check_train_split(len(train_set), args.batch_size,
                                   plan.world_size)
    return launch.Job(dataset, (train_set, valid_set, test_set), in_size,
                      None, fanout, start)


def parse_args(argv=None):
    parser = cli.ArgumentParser(
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Multi-GPU (or multi-process CPU) training of a GraphSAGE "
        "model for link prediction using the GraphBolt dataloader.",
    )
    parser.add_argument(
        "--gpu", type=str, default="0",
        help="GPU(s) in use. Can be a list of gpu ids for multi-gpu training,"
        " e.g., 0,1,2,3. In cpu-cpu mode each entry is one CPU process.",
    )
    parser.add_argument(
        "--epochs", type=cli.int_at_least(1), default=10,
        help="Number of training epochs.",
    )
    parser.add_argument(
        "--lr", type=cli.positive_float, default=0.0005,
        help="Learning rate for optimization.",
    )
    parser.add_argument(
        "--batch-size", type=cli.int_at_least(1), default=512,
        help="Positive pairs per batch (per rank) for training; pairs and"
        " nodes per batch for evaluation.",
    )
    parser.add_argument(
        "--neg-ratio", type=cli.int_at_least(1), default=1,
        help="Negative pairs sampled per positive pair in training.",
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
        "--dataset", type=str, required=True,
        help="The path of an OnDiskDataset directory (with metadata.yaml)"
        f" with a task named '{TASK}', or synthetic-links (comes with the"
        " example).",
    )
    parser.add_argument(
        "--data-root", type=str, default="datasets",
        help="Where builtin datasets are downloaded to.",
    )
    cli.add_run_options(parser)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    launch.launch_ranks(run, load_job, args, args.gpu, args.num_workers)


if __name__ == "__main__":
    main()
