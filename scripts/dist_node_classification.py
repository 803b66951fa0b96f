"""
Train GraphSAGE for node classification across machines with DGL's
distributed engine (DistGraph).

The single-machine example keeps the whole graph in each process. Here the
graph is split into one partition per machine (scripts/partition_graph.py);
each machine runs graph servers that hold its partition, and trainers that
sample mini-batches from all servers over the network. The model and its
evaluation (the metric, exact across trainers) are node_classification.py's,
so an edit there applies here too; the options are a subset of its own, and
the epoch line stops at `Time` (docs/distributed.md).

This script is both the server and the trainer: a launcher starts it with
DGL_ROLE=server or DGL_ROLE=client in the environment, and
`dgl.distributed.initialize` turns the server processes into graph servers
that never return. Do not run it by hand; use a launcher:

    # One laptop, two simulated machines (root + iproute2, see docs/distributed.md):
    python scripts/partition_graph.py --dataset datasets/synthetic \
        --num-parts 2 --out partitions/synthetic --balance-train --balance-edges
    python scripts/launch_local.py --part-config partitions/synthetic/synthetic.json \
        --num-machines 2 -- --epochs 10

    # A real cluster: DGL's tools/launch.py (ssh, shared file system):
    python3 dgl/tools/launch.py --workspace /shared/project \
        --num_trainers 1 --num_samplers 0 --num_servers 1 \
        --part_config partitions/synthetic/synthetic.json \
        --ip_config ip_config.txt \
        "python3 scripts/dist_node_classification.py --ip-config ip_config.txt \
         --part-config partitions/synthetic/synthetic.json --epochs 10"

Call tree:
main
├── parse_args / plan_job            checks before anything connects (servers too)
├── dgl.distributed.initialize       servers serve their partition here
└── run
    ├── init_process_group("gloo")   rendezvous from MASTER_ADDR/PORT, RANK
    ├── DistGraph + node_split       each trainer's share of the nodes (HIGHLIGHT)
    ├── train
    │   ├── create_dataloader        DistNodeDataLoader (HIGHLIGHT)
    │   ├── Join                     trainers with fewer batches (HIGHLIGHT)
    │   └── evaluate_nodes
    │       └── evaluate             the example's metric, exact across trainers
    └── evaluate_nodes on the test set
"""
import argparse
import json
import os
import sys
import time
import traceback
from types import SimpleNamespace

import dgl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from gbrun import fail
from gbrun.launch import destroy_process_group

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The model, its metric and the exact reduce are the example's: edit them
# there.
from node_classification import (  # noqa: E402
    FEATURE_KEY, METRIC, create_model, evaluate, weighted_reduce,
)

# One fanout value per layer of the example's model.
NUM_LAYERS = len(create_model(1, 2).layers)

DATASET_INFO_FILE = "dataset_info.json"  # written by partition_graph.py


def create_dataloader(g, node_ids, fanout, batch_size, shuffle):
    ############################################################################
    # (HIGHLIGHT) DistNodeDataLoader samples each mini-batch by asking the
    # servers that own the seeds' neighbours, wherever they are. It iterates
    # over this trainer's own node_ids only, so unlike GraphBolt's
    # DistributedItemSampler it needs no rank or world size. Sampler processes
    # come from DGL_NUM_SAMPLER (the launcher sets it), not from an argument.
    ############################################################################
    sampler = dgl.dataloading.NeighborSampler(fanout)
    return dgl.dataloading.DistNodeDataLoader(
        g,
        node_ids,
        sampler,
        batch_size=batch_size,
        shuffle=shuffle,
        drop_last=False,
    )


def dump_path(dump_dir, name):
    """Where --dump-seeds saves one list of seed ids (None: not saved)."""
    return None if dump_dir is None else os.path.join(dump_dir, name)


class DistPass:
    """What the example's evaluate asks of its `state`, for a DistGraph: the
    device (the CPU), no autocast, and the batches of one pass shaped like
    GraphBolt's (blocks, node_features, labels), fetched from the servers
    that own them. Keeps the seeds it handed out, for --dump-seeds."""

    device = torch.device("cpu")
    autocast = False

    def __init__(self, g):
        self.g, self.seen = g, []

    def batches(self, dataloader, name):
        for _, seeds, blocks in dataloader:
            self.seen.append(seeds)
            yield SimpleNamespace(
                blocks=blocks,
                node_features={FEATURE_KEY: self.g.ndata["feat"][
                    blocks[0].srcdata[dgl.NID]]},
                labels=self.g.ndata["label"][seeds].long(),
            )


def evaluate_nodes(model, g, node_ids, num_classes, fanout, batch_size, name,
                   dump_to=None):
    """The example's metric (its evaluate, exact across trainers) over every
    trainer's node_ids; each node is scored once. On rank 0."""
    dataloader = (
        create_dataloader(g, node_ids, fanout, batch_size, False)
        if len(node_ids) > 0
        else []
    )
    state = DistPass(g)
    metric = evaluate(model, dataloader, num_classes, state, name)
    if dump_to is not None:
        seen = torch.cat(state.seen) if state.seen else torch.empty(0)
        torch.save(seen, dump_to)
    return metric.item()


def train_one_epoch(model, optimizer, dataloader, g, debug, rank):
    """Return this trainer's sum of (loss x seeds), its seed count and ids."""
    model.train()
    loss_sum, num_seeds, seen = 0.0, 0, []
    ############################################################################
    # (HIGHLIGHT) Trainers rarely get the same number of batches. Join lets a
    # trainer that runs out keep answering the others' gradient all-reduces
    # instead of leaving them waiting forever.
    ############################################################################
    with Join([model]):
        for step, (_, seeds, blocks) in enumerate(dataloader):
            if debug["fail_rank"] == rank and step == debug["fail_after"]:
                raise RuntimeError(f"--fail-after-batches {step} on rank {rank}")
            # Features and labels are fetched from the servers that own them.
            x = g.ndata["feat"][blocks[0].srcdata[dgl.NID]]
            y = g.ndata["label"][seeds].long()
            loss = F.cross_entropy(model(blocks, x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss_sum += loss.item() * len(seeds)
            num_seeds += len(seeds)
            seen.append(seeds)
    return loss_sum, num_seeds, torch.cat(seen) if seen else torch.empty(0)


def train(model, g, splits, num_classes, fanout, args, rank):
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    # A trainer without seeds still takes part: Join answers the others.
    train_loader = (
        create_dataloader(g, splits["train"], fanout, args.batch_size, True)
        if len(splits["train"]) > 0
        else []
    )
    debug = {"fail_rank": args.fail_rank, "fail_after": args.fail_after_batches}
    for epoch in range(args.epochs):
        epoch_start = time.time()
        loss_sum, num_seeds, seeds = train_one_epoch(
            model, optimizer, train_loader, g, debug, rank
        )
        if args.dump_seeds:
            torch.save(seeds, dump_path(args.dump_seeds, f"train_e{epoch}_r{rank}.pt"))
        average_loss = weighted_reduce(
            torch.tensor(float(loss_sum), dtype=torch.float64), num_seeds
        ).item()
        metric = evaluate_nodes(
            model, g, splits["val"], num_classes, fanout, args.batch_size,
            f"validate {epoch}",
            dump_path(args.dump_seeds, f"val_e{epoch}_r{rank}.pt"),
        )
        if rank == 0:
            print(
                f"Epoch {epoch:05d} | "
                f"Average Loss {average_loss:.4f} | "
                f"{METRIC} {metric:.4f} | "
                f"Time {time.time() - epoch_start:.4f}",
                flush=True,
            )


def run(args, plan):
    # The launcher sets MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE.
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"Training with {world_size} trainers.", flush=True)
    torch.manual_seed(args.seed)

    g = dgl.distributed.DistGraph(plan["graph_name"], part_config=args.part_config)
    ############################################################################
    # (HIGHLIGHT) node_split gives each trainer a disjoint share of a mask's
    # nodes. force_even=True makes the shares differ by at most one node and
    # cover every node exactly once, which keeps validation and test metrics
    # exact. The shares follow the partitions' id ranges, so with
    # partition_graph.py --balance-train they are mostly local nodes.
    ############################################################################
    partition_book = g.get_partition_book()
    splits = {
        name: dgl.distributed.node_split(
            g.ndata[f"{name}_mask"], partition_book, force_even=True
        )
        for name in ("train", "val", "test")
    }
    in_size = g.ndata["feat"].shape[1]
    model = DDP(create_model(in_size, plan["num_classes"]))

    num_classes = plan["num_classes"]
    train(model, g, splits, num_classes, plan["fanout"], args, rank)
    metric = evaluate_nodes(
        model, g, splits["test"], num_classes, plan["fanout"],
        args.batch_size, "test", dump_path(args.dump_seeds, f"test_r{rank}.pt"),
    )
    if rank == 0:
        print(f"Test {METRIC} {metric:.4f}", flush=True)
    # Nobody destroys the group before every trainer is done.
    dist.barrier()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Distributed GraphSAGE node classification on DGL "
        "partitions (start it with launch_local.py or DGL's tools/launch.py)."
    )
    parser.add_argument(
        "--ip-config",
        default=os.environ.get("DGL_IP_CONFIG"),
        help="File with one 'IP [PORT]' line per machine. Default: "
        "$DGL_IP_CONFIG, set by the launchers.",
    )
    parser.add_argument(
        "--part-config",
        default=os.environ.get("DGL_CONF_PATH"),
        help="Partition config written by partition_graph.py. Default: "
        "$DGL_CONF_PATH, set by the launchers.",
    )
    parser.add_argument(
        "--epochs", type=int, default=10, help="Number of training epochs."
    )
    parser.add_argument(
        "--lr", type=float, default=0.001, help="Learning rate for Adam."
    )
    parser.add_argument(
        "--batch-size", type=int, default=1024, help="Seeds per mini-batch."
    )
    parser.add_argument(
        "--fanout",
        type=str,
        default=",".join(["10"] * NUM_LAYERS),
        help="Neighbours sampled per layer, one number per layer "
        f"({NUM_LAYERS} layers); -1 takes all. Default: 10 per layer",
    )
    parser.add_argument(
        "--num-workers",
        type=int,
        default=0,
        help="Sampler processes per trainer. Must equal the launcher's "
        "sampler count ($DGL_NUM_SAMPLER). Default: 0",
    )
    parser.add_argument("--seed", type=int, default=0, help="Random seed.")
    parser.add_argument(
        "--use-graphbolt",
        action="store_true",
        help="Sample with GraphBolt on the servers (partition with "
        "partition_graph.py --use-graphbolt).",
    )
    debug = parser.add_argument_group("debugging (used by the tests)")
    debug.add_argument(
        "--dump-seeds",
        default=None,
        help="Directory to save each trainer's train/val/test seed ids into.",
    )
    debug.add_argument(
        "--fail-after-batches",
        type=int,
        default=None,
        help="Make trainer --fail-rank raise after this many batches.",
    )
    debug.add_argument(
        "--fail-rank", type=int, default=0, help="See --fail-after-batches."
    )
    # torch.distributed.launch (used by older DGL tools/launch.py) passes this;
    # the rank comes from the environment either way.
    parser.add_argument("--local-rank", "--local_rank", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def read_json(path, what):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        fail(f"{what} {path} does not exist")
    except json.JSONDecodeError as e:
        fail(f"{what} {path} is not valid JSON ({e})")


def count_machines(ip_config):
    try:
        with open(ip_config) as f:
            return sum(1 for line in f if line.strip())
    except FileNotFoundError:
        fail(f"--ip-config {ip_config} does not exist")


def plan_job(args):
    """Check the arguments against the partition files; return what run needs.

    Servers run this too, so a bad config stops every process with the same
    one-line error instead of leaving some waiting for the others.
    """
    if args.ip_config is None or args.part_config is None:
        fail("--ip-config and --part-config are required")
    try:
        fanout = [int(f) for f in args.fanout.split(",")]
    except ValueError:
        fanout = []
    if len(fanout) != NUM_LAYERS or any(f == 0 or f < -1 for f in fanout):
        fail(
            f"--fanout needs {NUM_LAYERS} comma-separated positive "
            f"numbers (or -1), one per layer; got {args.fanout}"
        )
    if args.epochs < 1:
        fail(f"--epochs must be at least 1, got {args.epochs}")
    if args.batch_size < 1:
        fail(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.lr <= 0:
        fail(f"--lr must be positive, got {args.lr}")
    num_samplers = int(os.environ.get("DGL_NUM_SAMPLER", "0"))
    if args.num_workers != num_samplers:
        fail(
            f"--num-workers {args.num_workers} differs from the "
            f"launcher's sampler count DGL_NUM_SAMPLER={num_samplers}"
        )
    config = read_json(args.part_config, "--part-config")
    if "num_parts" not in config or "graph_name" not in config:
        fail(f"--part-config {args.part_config} is not a DGL partition config")
    num_machines = count_machines(args.ip_config)
    if config["num_parts"] != num_machines:
        fail(
            f"--part-config has {config['num_parts']} partitions but "
            f"--ip-config {args.ip_config} lists {num_machines} machines"
        )
    if args.use_graphbolt and "part_graph_graphbolt" not in config.get("part-0", {}):
        fail(
            f"--use-graphbolt needs partitions written with "
            f"partition_graph.py --use-graphbolt; {args.part_config} has none"
        )
    info_path = os.path.join(os.path.dirname(args.part_config), DATASET_INFO_FILE)
    info = read_json(info_path, "dataset info (written by partition_graph.py)")
    return {
        "graph_name": config["graph_name"],
        "num_classes": int(info["num_classes"]),
        "fanout": fanout,
    }


def main():
    args = parse_args()
    plan = plan_job(args)
    if args.dump_seeds:
        os.makedirs(args.dump_seeds, exist_ok=True)
    # Servers never return from here; trainers connect to every server.
    dgl.distributed.initialize(args.ip_config, use_graphbolt=args.use_graphbolt)
    try:
        run(args, plan)
    except BaseException:
        # Leave at once with a non-zero code: a clean teardown (gloo, DGL's
        # exit hook) waits for the other trainers, so it would hang this rank
        # instead of failing the job. The launcher then stops the others.
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    finally:
        if dist.is_initialized():
            destroy_process_group()


if __name__ == "__main__":
    main()
