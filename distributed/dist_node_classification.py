"""
Train the example (node_classification.py, or your copy of it) across
machines on DGL's distributed engine (DistGraph).

The single-machine example keeps the whole graph in each process. Here the
graph is split into one partition per machine (distributed/partition_graph.py);
each machine runs graph servers that hold its partition, and trainers that
sample mini-batches from all servers over the network. The trainers run the
example's own model, optimizer and schedule, keys, `train` loop and
`evaluate` (with its metric), from the file --example names: an edit there
trains here too. Only the data loading is DGL's distributed one, and its
batches reach the example's loop in the shape GraphBolt's have.

This script is both the server and the trainer: a launcher starts it with
DGL_ROLE=server or DGL_ROLE=client in the environment, and
`dgl.distributed.initialize` turns the server processes into graph servers
that never return. Do not run it by hand; use a launcher:

    # One laptop, two simulated machines (root + iproute2, docs/distributed.md):
    python distributed/partition_graph.py --dataset data/synthetic \\
        --num-parts 2 --out partitions/synthetic --balance-train --balance-edges
    python distributed/launch_local.py --part-config partitions/synthetic/synthetic.json \\
        --num-machines 2 -- --epochs 10 --checkpoint-dir runs/d

    # A real cluster: DGL's tools/launch.py (ssh, shared file system), see
    # docs/distributed.md.

Call tree:
main
├── parse_args / plan_job        checks before anything connects (servers too)
├── dgl.distributed.initialize   servers serve their partition here
└── run                          each trainer
    ├── init_process_group       NCCL on GPUs, gloo on CPUs (HIGHLIGHT)
    ├── DistGraph + node_split   each trainer's share of the nodes (HIGHLIGHT)
    ├── DistLoader               DistNodeDataLoader batches, as GraphBolt's
    ├── example.train            the example's loop, under Join
    └── example.evaluate         the example's metric on the test set
"""
import argparse
import json
import os
import sys

import gbrun  # first: it says in one line if DGL cannot load

import dgl
import torch
import torch.distributed as dist
from gbrun.distributed import (
    DistBatches, DistLoader, exit_when_clients_are_gone, fail_fast,
    samplers_die_with_trainer,
)
from torch.nn.parallel import DistributedDataParallel as DDP

DEFAULT_EXAMPLE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "node_classification.py")
DATASET_INFO_FILE = "dataset_info.json"  # written by partition_graph.py
# The example's options that mean nothing here, and why.
NOT_HERE = {
    "gpu": "each trainer takes the GPU of its LOCAL_RANK",
    "dataset": "the partitions are the data (--part-config)",
    "data_root": "the partitions are the data (--part-config)",
    "gpu_cache_size": "the features stay on the graph servers",
    "master_port": "the launcher sets the rendezvous",
}


def run(args, example, plan, job, graph_name):
    """One trainer from start to end; returns 0, or the signal that stopped
    training (a resumable checkpoint is then saved)."""
    rank = plan.rank_offset
    device = plan.device(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(plan.threads)
    ############################################################################
    # (HIGHLIGHT) The model's process group: NCCL between GPU trainers, gloo
    # between CPU ones, from the rendezvous the launcher set (MASTER_ADDR,
    # MASTER_PORT, RANK, WORLD_SIZE). DGL's own RPC carries the graph.
    ############################################################################
    dist.init_process_group(backend=plan.backend)
    stop = gbrun.StopSignal(device, None)  # SIGTERM to any trainer stops all
    samplers_die_with_trainer()
    if rank == 0:
        for notice in plan.notices:
            print(notice)
        print(f"Training with {plan.world_size} trainers.", flush=True)

    g = dgl.distributed.DistGraph(graph_name, part_config=args.part_config)
    ############################################################################
    # (HIGHLIGHT) node_split gives each trainer a disjoint share of a mask's
    # nodes, mostly of its own machine's partition. force_even=True makes the
    # shares differ by at most one node and cover every node exactly once,
    # which keeps validation and test metrics exact. rank= the trainer's
    # torch rank: by default DGL splits by the order in which trainers
    # connected, and a resumed run would give a trainer another share.
    ############################################################################
    partition_book = g.get_partition_book()
    train_ids, valid_ids, test_ids = (
        dgl.distributed.node_split(g.ndata[f"{name}_mask"], partition_book,
                                   rank=rank, force_even=True)
        for name in ("train", "val", "test")
    )
    # As GraphBolt's drop_last and drop_uneven_inputs: every trainer trains
    # as many full batches as the one with the fewest.
    num_batches = torch.tensor(len(train_ids) // args.batch_size)
    dist.all_reduce(num_batches, op=dist.ReduceOp.MIN)

    if job.seed is not None:
        torch.manual_seed(job.seed)
    model = example.create_model(job.in_size, job.num_classes).to(device)
    gbrun.tune_model(model, plan)  # as the example's run()
    optimizer, scheduler = example.create_optimizer(model, args)
    state = gbrun.RunState(
        rank, args, job, stop, device, plan.autocast,
        {"model": model, "optimizer": optimizer, "scheduler": scheduler},
        batches=DistBatches,
    )
    model = DDP(model, device_ids=[device] if device.type == "cuda" else None)

    record = [] if args.dump_seeds else None

    def dataloader(nids, batches=None):
        return DistLoader(
            g, nids, job.fanout, args.batch_size, example.FEATURE_KEYS,
            example.LABEL_KEY, device, batches,
            torch.bfloat16 if args.precision == "bf16" else None, record,
        )

    train_loader = dataloader(train_ids, int(num_batches))
    if args.fail_after_batches is not None and rank == args.fail_rank:
        train_loader.fail_after = args.fail_after_batches

    if rank == 0:
        print("Training...")
    stopped_by = example.train(
        rank, args, model, optimizer, scheduler, train_loader,
        dataloader(valid_ids), state,
    )
    if not stopped_by:
        if rank == 0:
            print("Testing...")
        metric = example.evaluate(model, dataloader(test_ids),
                                  job.num_classes, state, "test")
        if rank == 0:
            print(f"Test {example.METRIC} {metric.item():.4f}", flush=True)
            state.save_result({
                "metric": example.METRIC,
                f"test_{example.METRIC.lower()}": metric.item(),
                "ranks": plan.world_size,
            })
    if record is not None:
        torch.save(record, os.path.join(args.dump_seeds, f"rank{rank}.pt"))
    # Nobody tears the group down before every trainer is done.
    gbrun.barrier(device)
    gbrun.launch.destroy_process_group()
    return stopped_by


def plan_job(args, example, env=os.environ):
    """Checks the arguments against the partitions and the example, and a
    checkpoint to resume; returns (gbrun.Job, graph name). Servers run it
    too, so that bad input stops every process of the job with the same
    one-line error instead of leaving some waiting for the others."""
    if args.ip_config is None or args.part_config is None:
        raise gbrun.UsageError("--ip-config and --part-config are required "
                               "(the launchers set them)")
    config = read_json(args.part_config, "--part-config")
    if not isinstance(config, dict) or not {"num_parts", "graph_name"} <= set(
            config):
        raise gbrun.UsageError(
            f"--part-config {args.part_config} is not a DGL partition config")
    num_machines = count_machines(args.ip_config)
    if config["num_parts"] != num_machines:
        raise gbrun.UsageError(
            f"--part-config has {config['num_parts']} partitions but "
            f"--ip-config {args.ip_config} lists {num_machines} machines")
    if args.use_graphbolt and "part_graph_graphbolt" not in config.get(
            "part-0", {}):
        raise gbrun.UsageError(
            f"--use-graphbolt needs partitions written with "
            f"partition_graph.py --use-graphbolt; {args.part_config} has none")
    samplers = int(env.get("DGL_NUM_SAMPLER", "0"))
    if args.num_workers != samplers:
        raise gbrun.UsageError(
            f"--num-workers {args.num_workers} differs from the launcher's "
            f"sampler count DGL_NUM_SAMPLER={samplers}")
    info = read_json(
        os.path.join(os.path.dirname(args.part_config), DATASET_INFO_FILE),
        "dataset info (written by partition_graph.py)")
    check_keys(info, example)
    in_size = sum(info["features"][key] for key in example.FEATURE_KEYS)
    num_classes = int(info["num_classes"])
    model = example.create_model(in_size, num_classes)
    fanout = gbrun.check_fanout(args.fanout, len(model.layers))
    key = example.resume_key(model, *example.create_optimizer(model, args),
                             args, fanout)
    trainers = num_trainers(env, num_machines, samplers)
    gbrun.check_train_split(info["num_train"], args.batch_size, trainers)
    checkpoint, seed = gbrun.open_checkpoint(args, key, trainers)
    job = gbrun.Job(None, None, in_size, num_classes, fanout, key, checkpoint,
                    seed)
    return job, config["graph_name"]


def check_keys(info, example):
    """The partitions hold what the example reads (partition_graph.py wrote
    them with the same --example)."""
    missing = [k for k in example.FEATURE_KEYS if k not in info["features"]]
    if missing or info["label_key"] != example.LABEL_KEY or (
            info["labels"] != example.LABELS):
        raise gbrun.UsageError(
            f"the partitions hold the features {sorted(info['features'])}, "
            f"labels '{info['label_key']}' ({info['labels']}); the example "
            f"reads {example.FEATURE_KEYS}, labels '{example.LABEL_KEY}' "
            f"({example.LABELS}): partition again with partition_graph.py "
            "--example and this example")


def num_trainers(env, num_machines, samplers):
    """Trainers in the job: WORLD_SIZE in a trainer; in a server, DGL's
    client count less the sampler processes."""
    if "WORLD_SIZE" in env:
        return int(env["WORLD_SIZE"])
    return int(env.get("DGL_NUM_CLIENT", num_machines)) // (1 + samplers)


def plan_devices(args, env=os.environ):
    """The trainer's plan (gbrun.plan_run as for a torchrun rank). A server
    checks the plan of its machine's last trainer instead, so that a
    machine with fewer GPUs than trainers stops every process."""
    if env.get("DGL_ROLE") == "server":
        machines = count_machines(args.ip_config)
        per_machine = num_trainers(env, machines, args.num_workers) // machines
        env = dict(env, RANK=str(per_machine - 1),
                   WORLD_SIZE=str(per_machine),
                   LOCAL_RANK=str(per_machine - 1),
                   LOCAL_WORLD_SIZE=str(per_machine))
    return gbrun.plan_run(args, env, distributed=True)


def read_json(path, what):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise gbrun.UsageError(f"{what} {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise gbrun.UsageError(f"{what} {path} is not valid JSON ({error})"
                               ) from None


def count_machines(ip_config):
    try:
        with open(ip_config) as f:
            return sum(1 for line in f if line.strip())
    except FileNotFoundError:
        raise gbrun.UsageError(f"--ip-config {ip_config} does not exist"
                               ) from None


def parse_args(argv=None):
    """This script's options, then the example's (all of them but NOT_HERE,
    your own included): returns (args, the example module)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = gbrun.ArgumentParser(
        add_help=False,
        description="Train the example on DGL partitions across machines "
        "(started by launch_local.py or DGL's tools/launch.py). The "
        "example's options apply too; see the end of this help.",
    )
    parser.add_argument(
        "--example", type=gbrun.python_file, default=DEFAULT_EXAMPLE,
        help="The example file to train: the model, optimizer, keys, loop "
        "and metric come from it. Default: node_classification.py of this "
        "repository.")
    parser.add_argument(
        "--ip-config", default=os.environ.get("DGL_IP_CONFIG"),
        help="File with one 'IP [PORT]' line per machine. Default: "
        "$DGL_IP_CONFIG, set by the launchers.")
    parser.add_argument(
        "--part-config", default=os.environ.get("DGL_CONF_PATH"),
        help="Partition config written by partition_graph.py. Default: "
        "$DGL_CONF_PATH, set by the launchers.")
    parser.add_argument(
        "--use-graphbolt", action="store_true",
        help="Sample with GraphBolt on the servers (partitions written with "
        "partition_graph.py --use-graphbolt).")
    parser.add_argument(
        "-h", "--help", action="store_true",
        help="Show this help, then the example's options.")
    debug = parser.add_argument_group("debugging (used by the tests)")
    debug.add_argument(
        "--dump-seeds", default=None,
        help="Directory where each trainer saves the nodes of every pass "
        "(train, validation, test) in order and the seeds it handed out.")
    debug.add_argument(
        "--fail-after-batches", type=gbrun.int_at_least(0), default=None,
        help="Make trainer --fail-rank raise at this training batch.")
    debug.add_argument("--fail-rank", type=gbrun.int_at_least(0), default=0,
                       help="See --fail-after-batches.")
    # tools/launch.py's torch.distributed launcher may pass this; the rank
    # comes from the environment either way.
    parser.add_argument("--local-rank", "--local_rank", type=int,
                        help=argparse.SUPPRESS)
    ours, rest = parser.parse_known_args(argv)
    example = gbrun.load_example(ours.example)
    if ours.help:
        parser.print_help()
        print(f"\nThe example's options ({ours.example}) apply too, except "
              f"{', '.join('--' + k.replace('_', '-') for k in NOT_HERE)}:\n")
        example.parse_args(["--help"])
    args = example.parse_args(rest)
    defaults = example.parse_args([])
    for name, why in NOT_HERE.items():
        if getattr(args, name) != getattr(defaults, name):
            parser.error(f"--{name.replace('_', '-')} does not apply to the "
                         f"distributed trainer: {why}")
    del ours.help
    vars(args).update(vars(ours))
    # What a checkpoint names as its data (the example's resume key).
    args.dataset = os.path.realpath(args.part_config or "")
    if args.dump_seeds:
        os.makedirs(args.dump_seeds, exist_ok=True)
    return args, example


def main(argv=None):
    args, example = parse_args(argv)
    server = os.environ.get("DGL_ROLE") == "server"
    try:
        job, graph_name = plan_job(args, example)
        plan = plan_devices(args)
    except gbrun.UsageError as error:
        gbrun.fail(error, speak=gbrun.cli.is_first_process())
    if server:
        port = dgl.distributed.rpc.read_ip_config(
            args.ip_config, int(os.environ["DGL_NUM_SERVER"])
        )[int(os.environ["DGL_SERVER_ID"])][2]
        exit_when_clients_are_gone(port)
    # Servers never return from here; trainers connect to every server.
    dgl.distributed.initialize(args.ip_config, use_graphbolt=args.use_graphbolt)
    try:
        stopped_by = run(args, example, plan, job, graph_name)
    except BaseException:
        fail_fast()
    if stopped_by:
        # DGL's exit hook (every trainer stopped alike) shuts the servers.
        sys.exit(128 + stopped_by)


if __name__ == "__main__":
    main()
