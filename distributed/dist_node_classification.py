"""
Train the example (node_classification.py, or your copy of it) across
machines on DGL's distributed engine (DistGraph).

The single-machine example keeps the whole graph in each process. Here the
graph is split into one partition per machine (distributed/partition_graph.py);
each machine runs graph servers that hold its partition, and trainers that
sample mini-batches from all servers over the network. Each trainer runs the
example's own run() (so its model, optimizer and schedule, keys, loop,
metric and any edit of run() train here too), from the file --example names,
with another data source: what DGL's distributed training guide says
changes between one machine and many.

    DGL's distributed initialise    here, before run()
    the DistGraph and node_split    gbrun.dgl_engine's Partitions.place,
                                    in place of the GraphBolt dataset
    the loader                      DGL's DistNodeDataLoader, built by the
                                    example's create_dataloader() (a copy
                                    whose GraphBolt pipeline is edited is
                                    refused: that edit would not run here)

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
├── parse_args / load_job        checks before anything connects (servers too)
├── dgl.distributed.initialize   servers serve their partition here
└── example.run                  each trainer, through gbrun.launch.run_rank
    ├── init_process_group       NCCL on GPUs, gloo on CPUs (env://)
    ├── sources.place            DistGraph + node_split (Partitions.place)
    ├── create_dataloader        DistNodeDataLoader batches, as GraphBolt's
    ├── train                    the example's loop, under Join
    └── evaluate                 the example's metric on the test set
"""
import argparse
import ast
import atexit
import dataclasses
import inspect
import json
import os
import sys
import threading
import time

import gbrun.graphbolt  # noqa: F401 (first: one line if DGL cannot load)
from gbrun import checkpoint, cli, launch, planning
from gbrun.data import datasets
from gbrun.dgl_engine.cleanup import (
    fail_fast, samplers_die_with_trainer, skip_last_collection,
    unlink_job_memory,
)
from gbrun.dgl_engine.files import DATASET_INFO_FILE, load_item_sets
from gbrun.dgl_engine.loader import DebugHooks
from gbrun.dgl_engine.partitions import Partitions
from gbrun.dgl_engine.watch import (
    FIRST_CLIENT_TIMEOUT_S, PROGRESS_TIMEOUT_S, TrainerWatch,
    exit_when_clients_are_gone,
)

import dgl
import torch
# The example's options that mean nothing here, and why.
NOT_HERE = {
    "gpu": "each trainer takes the GPU of its LOCAL_RANK",
    "dataset": "the partitions are the data (--part-config)",
    "data_root": "the partitions are the data (--part-config)",
    "gpu_cache_size": "the features stay on the graph servers",
}


def load_job(args, example, plan, env=os.environ):
    """Checks the arguments against the partitions and the example, and a
    checkpoint to resume; returns the gbrun.launch.Job whose dataset is the
    partitions. Servers run it too, so that bad input stops every process
    of the job with the same one-line error instead of leaving some waiting
    for the others."""
    if args.ip_config is None or args.part_config is None:
        raise cli.UsageError("--ip-config and --part-config are required "
                               "(the launchers set them)")
    config = read_json(args.part_config, "--part-config")
    if not isinstance(config, dict) or not {"num_parts", "graph_name"} <= set(
            config):
        raise cli.UsageError(
            f"--part-config {args.part_config} is not a DGL partition config")
    num_machines = count_machines(args.ip_config)
    if config["num_parts"] != num_machines:
        raise cli.UsageError(
            f"--part-config has {config['num_parts']} partitions but "
            f"--ip-config {args.ip_config} lists {num_machines} machines")
    if args.use_graphbolt and "part_graph_graphbolt" not in config.get(
            "part-0", {}):
        raise cli.UsageError(
            f"--use-graphbolt needs partitions written with "
            f"partition_graph.py --use-graphbolt; {args.part_config} has none")
    samplers = int(env.get("DGL_NUM_SAMPLER", "0"))
    if args.num_workers != samplers:
        raise cli.UsageError(
            f"--num-workers {args.num_workers} differs from the launcher's "
            f"sampler count DGL_NUM_SAMPLER={samplers}")
    info = read_json(
        os.path.join(os.path.dirname(args.part_config), DATASET_INFO_FILE),
        "dataset info (written by partition_graph.py)")
    check_keys(info, example)
    check_loader(example)
    data = Partitions(
        config["graph_name"], args.part_config,
        torch.bfloat16 if args.precision == "bf16" else None,
        node_types={key: info[key] for key in ("target", "edge_types")
                    if key in info},
        hooks=debug_hooks(args))
    num_classes = int(info["num_classes"])
    if "target" in info:
        # Several node types: a width per type, and the model takes the
        # dataset (docs/customising.md's edit): here, the partitions.
        in_size = {ntype: sum(info["features"][ntype][key] for key in keys)
                   for ntype, keys in example.FEATURE_KEYS.items()}
        model = example.create_model(in_size, num_classes, data)
    else:
        in_size = sum(info["features"][key] for key in example.FEATURE_KEYS)
        model = example.create_model(in_size, num_classes)
    fanout = cli.check_fanout(args.fanout, len(model.layers))
    server = env.get("DGL_ROLE") == "server"
    # A server saves no checkpoint: it needs the key only to refuse a
    # --resume as the trainers do (an optimizer imports torch._dynamo on
    # construction: about 1 CPU-s).
    key = example.resume_key(
        model, *example.create_optimizer(model, args), args, fanout
    ) if args.resume or not server else {}
    trainers = num_trainers(env, num_machines, samplers)
    # A server's plan is its machine's last trainer's: the job has more.
    # Trainer 0 writes the checkpoints, so it holds the directory's lock.
    start = checkpoint.start_or_resume(
        args, key, dataclasses.replace(plan, world_size=trainers),
        args.epochs, lock=not server and plan.rank_offset == 0)
    if start.trains:  # all but a --resume --predict of a finished run
        datasets.check_train_split(info["num_train"], args.batch_size,
                                   trainers)
    # The item sets as on one machine, in the partitions' node ids (an edit
    # may read them: class weights from the training labels).
    item_sets = load_item_sets(os.path.dirname(args.part_config))
    return launch.Job(data, item_sets, in_size, num_classes, fanout, start)


def debug_hooks(args):
    """The debugging options (for the tests) as the loaders apply them."""
    hang = args.hang_after_batches is not None
    at = args.hang_after_batches if hang else args.fail_after_batches
    return DebugHooks(record=[] if args.dump_seeds else None, fail_after=at,
                      fail_rank=args.fail_rank, hang=hang)


def graphbolt_pipeline(function):
    """create_dataloader's code after its first statement (the branch for
    DGL's distributed engine), without its docstring, as an AST dump."""
    tree = ast.parse(inspect.getsource(function).strip())
    body = tree.body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(
            getattr(body[0], "value", None), ast.Constant):
        body = body[1:]
    return [ast.dump(statement) for statement in body[1:]]


def check_loader(example):
    """Refuses a copy whose create_dataloader() edits the GraphBolt
    pipeline: DGL's distributed engine loads batches with DGL's own loader,
    so the edit would silently not run here."""
    shipped = cli.load_example(cli.SHIPPED_EXAMPLE)
    if graphbolt_pipeline(example.create_dataloader) != graphbolt_pipeline(
            shipped.create_dataloader):
        raise cli.UsageError(
            f"--example {example.__file__}: its create_dataloader() "
            "edits the GraphBolt pipeline, which DGL's distributed engine "
            "does not run (its batches come from DGL's DistNodeDataLoader, "
            "the branch for Partitions at the top); train that edit on one "
            "machine, or make it in the branch for Partitions")


def check_keys(info, example):
    """The partitions hold what the example reads (partition_graph.py wrote
    them with the same --example): the same features (per node type, for
    a graph of several), labels and kind of label."""
    several = "target" in info
    if isinstance(example.FEATURE_KEYS, dict) != several:
        raise cli.UsageError(
            "the partitions hold a graph of "
            f"{'several node types' if several else 'one node type'}, but "
            f"the example's FEATURE_KEYS {example.FEATURE_KEYS} name "
            f"{'none' if several else 'node types'}: partition again with "
            "partition_graph.py --example and this example")
    if several and getattr(example, "TARGET", info["target"]) != info["target"]:
        raise cli.UsageError(
            f"the partitions hold the labels of node type '{info['target']}',"
            f" but the example's TARGET is '{example.TARGET}': partition "
            "again with partition_graph.py --example and this example")
    if isinstance(example.FEATURE_KEYS, dict):
        missing = [(ntype, key) for ntype, keys in example.FEATURE_KEYS.items()
                   for key in keys
                   if key not in info["features"].get(ntype, {})] + [
            ntype for ntype in info["features"]
            if ntype not in example.FEATURE_KEYS]
    else:
        missing = [k for k in example.FEATURE_KEYS
                   if k not in info["features"]]
    if missing or info["label_key"] != example.LABEL_KEY or (
            info["labels"] != example.LABELS):
        raise cli.UsageError(
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
    """The trainer's plan (gbrun.planning.plan_run as for a torchrun rank). A
    server checks the plan of its machine's last trainer instead, so that a
    machine with fewer GPUs than trainers stops every process; it never
    trains, so it builds no dropout kernel."""
    machine = None
    if env.get("DGL_ROLE") == "server":
        machines = count_machines(args.ip_config)
        per_machine = num_trainers(env, machines, args.num_workers) // machines
        env = dict(env, RANK=str(per_machine - 1),
                   WORLD_SIZE=str(per_machine),
                   LOCAL_RANK=str(per_machine - 1),
                   LOCAL_WORLD_SIZE=str(per_machine))
        machine = dataclasses.replace(
            planning.detect_machine(args.precision), dropout_problem=None)
    return planning.plan_run(args, "0", args.num_workers, env, machine,
                           distributed=True)


def read_json(path, what):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise cli.UsageError(f"{what} {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise cli.UsageError(f"{what} {path} is not valid JSON ({error})"
                               ) from None


def count_machines(ip_config):
    try:
        with open(ip_config) as f:
            return sum(1 for line in f if line.strip())
    except FileNotFoundError:
        raise cli.UsageError(f"--ip-config {ip_config} does not exist"
                               ) from None


def parse_args(argv=None):
    """This script's options, then the example's (all of them but NOT_HERE,
    your own included): returns (args, the example module)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = cli.ArgumentParser(
        add_help=False,
        description="Train the example on DGL partitions across machines "
        "(started by launch_local.py or DGL's tools/launch.py). The "
        "example's options apply too; see the end of this help.",
    )
    parser.add_argument(
        "--example", type=cli.python_file, default=cli.SHIPPED_EXAMPLE,
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
        "--first-client-timeout", type=cli.positive_float,
        default=FIRST_CLIENT_TIMEOUT_S,
        help="Seconds a graph server, once it serves its partition, waits for"
        " the first trainer before it exits (a trainer that failed before"
        " connecting never comes). Loading the partition does not count.")
    parser.add_argument(
        "--connect-timeout", type=cli.positive_float, default=60.0,
        help="Seconds a trainer, connected to every graph server, waits for"
        " the job's other trainers to connect before it fails the job (one"
        " that failed before connecting never comes).")
    parser.add_argument(
        "--progress-timeout", type=cli.positive_float,
        default=PROGRESS_TIMEOUT_S,
        help="Seconds a trainer, once connected, may go without a batch"
        " (training, evaluating or predicting) before it fails the job: a"
        " hung trainer, or a machine cut off the network.")
    parser.add_argument(
        "-h", "--help", action="store_true",
        help="Show this help, then the example's options.")
    debug = parser.add_argument_group("debugging (used by the tests)")
    debug.add_argument(
        "--dump-seeds", default=None,
        help="Directory where each trainer saves the nodes of every pass "
        "(train, validation, test) in order and the seeds it handed out.")
    debug.add_argument(
        "--fail-after-batches", type=cli.int_at_least(0), default=None,
        help="Make trainer --fail-rank raise at this training batch.")
    debug.add_argument(
        "--hang-after-batches", type=cli.int_at_least(0), default=None,
        help="Make trainer --fail-rank sleep for ever at this training batch.")
    debug.add_argument("--fail-rank", type=cli.int_at_least(0), default=0,
                       help="See --fail-after-batches.")
    # tools/launch.py's torch.distributed launcher may pass this; the rank
    # comes from the environment either way.
    parser.add_argument("--local-rank", "--local_rank", type=int,
                        help=argparse.SUPPRESS)
    ours, rest = parser.parse_known_args(argv)
    example = cli.load_example(ours.example)
    if ours.help:
        parser.print_help()
        print(f"\nThe example's options ({ours.example}) apply too, except "
              f"{', '.join('--' + k.replace('_', '-') for k in NOT_HERE)}:\n")
        example.parse_args(["--help"])
    args = example.parse_args(rest)
    defaults = example.parse_args([])
    for name, why in NOT_HERE.items():
        if getattr(args, name, None) != getattr(defaults, name, None):
            parser.error(f"--{name.replace('_', '-')} does not apply to the "
                         f"distributed trainer: {why}")
    del ours.help
    vars(args).update(vars(ours))
    # What a checkpoint names as its data (the example's resume key).
    args.dataset = os.path.realpath(args.part_config or "")
    if args.dump_seeds:
        os.makedirs(args.dump_seeds, exist_ok=True)
    return args, example


def delay_for_tests(env=os.environ):
    """TEST_DELAY_SERVERS="ID,ID:SECONDS": those graph servers start
    serving SECONDS late, as a partition that takes long to load would."""
    ids, _, seconds = env.get("TEST_DELAY_SERVERS", "").partition(":")
    if env.get("DGL_SERVER_ID") in ids.split(","):
        time.sleep(float(seconds))


def main(argv=None):
    server = os.environ.get("DGL_ROLE") == "server"
    try:
        args, example = parse_args(argv)
        plan = plan_devices(args)
        job = load_job(args, example, plan)
    except cli.UsageError as error:
        cli.fail(error, speak=cli.is_first_process())
    # Every graph server: id -> (machine, ip, port, servers a machine).
    servers = dgl.distributed.rpc.read_ip_config(
        args.ip_config, int(os.environ.get("DGL_NUM_SERVER", "1")))
    if server:
        delay_for_tests()
        _, ip, port, _ = servers[int(os.environ["DGL_SERVER_ID"])]
        exit_when_clients_are_gone(
            ip, port,
            first_timeout_s=args.first_client_timeout,
            on_leave=lambda: unlink_job_memory(job.dataset.graph_name))
        # A server ends in initialize() (sys.exit once the job is done),
        # after DGL's own exit hooks (registered there, so run first).
        atexit.register(skip_last_collection, job.dataset.graph_name)
    else:
        # Bounds DGL's waits for a job that failed elsewhere. The watch and
        # run_rank report this trainer's failure once, whichever is first.
        report = threading.Lock()
        watch = TrainerWatch(
            {(ip, int(port)) for _, ip, port, _ in servers.values()},
            args.connect_timeout, job.dataset.graph_name,
            job.dataset.heartbeat, report, args.progress_timeout).start()
    # Servers never return from here; trainers connect to every server.
    dgl.distributed.initialize(args.ip_config, use_graphbolt=args.use_graphbolt)
    samplers_die_with_trainer()
    watch.serving()
    if plan.rank_offset == 0:
        for notice in plan.notices:
            print(notice)
        doing = "Training" if job.start.trains else "Predicting"
        print(f"{doing} with {plan.world_size} trainers.", flush=True)
    try:
        # The example's run(); on a failure, this trainer ends at once
        # (fail_fast). DGL's exit hook then shuts the servers.
        launch.run_rank(plan.rank_offset, example.run, plan, args, job,
                        on_failure=lambda: fail_fast(job.dataset.graph_name),
                        report=report)
    finally:
        watch.stop()
        if job.dataset.hooks.record is not None:
            torch.save(job.dataset.hooks.record, os.path.join(
                args.dump_seeds, f"rank{plan.rank_offset}.pt"))
    # Trained (a failure ended in fail_fast); DGL's exit hook, which shuts
    # the servers down, still runs.
    skip_last_collection()


if __name__ == "__main__":
    main()
