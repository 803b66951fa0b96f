"""The benchmark's stage split, in a process of its own, as one rank with
--threads threads: the median time per training batch of each stage,
measured one after the other on the same batches. Sampling is the seeds'
sample_neighbor; fetching is the input nodes' features read by GraphBolt's
store as it comes and by the example's (gbrun.placement.place_graph, CPU storage);
compute is the example's model's forward, backward and Adam step (with
its dropout fused, as on the example's CPU ranks, or torch's; in bf16 its
products split, as there). Prints
one JSON line.

    python benchmarks/stage_split.py --dataset /tmp/perf200k --fanout 10,10,10
"""
import argparse
import json
import statistics
import sys
import time

from bare_loop import child_parser, create_model


def parse_args(argv=None):
    parser = child_parser(__doc__.splitlines()[0])
    parser.add_argument("--fused-dropout", default=True,
                        action=argparse.BooleanOptionalAction,
                        help="As the example's option (default: on).")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import torch
    import torch.nn.functional as F

    import gbrun.cli
    import gbrun.cpu.memory
    import gbrun.data.datasets
    import gbrun.graphbolt
    import gbrun.placement
    from gbrun.graphbolt import gb

    example = gbrun.cli.load_example(args.example)
    gbrun.cpu.memory.keep_freed_memory()
    torch.set_num_threads(args.threads)
    keys = example.FEATURE_KEYS
    try:  # a dataset the example cannot train on: one line, exit 2
        dataset = gbrun.data.datasets.load_dataset(args.dataset)
        train_set = gbrun.data.datasets.check_dataset(
            dataset, args.dataset, keys, example.LABEL_KEY, example.LABELS)[0]
    except gbrun.cli.UsageError as error:
        gbrun.cli.fail(error)
    bf16 = args.precision == "bf16"
    if bf16:
        gbrun.data.datasets.store_in_bf16(dataset, keys)
    stock = dataset.feature
    _, placed = gbrun.placement.place_graph(dataset, "cpu", torch.device("cpu"), 0,
                                    keys)
    datapipe = gb.ItemSampler(train_set, batch_size=args.batch_size,
                              shuffle=True, drop_last=True)
    batches = iter(gb.DataLoader(datapipe.sample_neighbor(dataset.graph,
                                                          args.fanout)))
    model = create_model(example, dataset, args.fused_dropout, bf16)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001)
    times = {"sample": [], "fetch_graphbolt": [], "fetch": [], "compute": []}
    input_nodes = []

    def timed(stage, work, *work_args):
        start = time.perf_counter()
        result = work(*work_args)
        times[stage].append(time.perf_counter() - start)
        return result

    def read(store, ids):
        x = [store.read(*gbrun.data.datasets.node_key(key), ids) for key in keys]
        return x[0] if len(x) == 1 else torch.cat(x, dim=1)

    def step(data, x):
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            y_hat = model(data.blocks, x)
        loss = F.cross_entropy(y_hat.float(), data.labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    # One batch more than counted: the first warms up allocator and threads.
    for _ in range(args.batches + 1):
        data = timed("sample", next, batches)
        ids = data.node_ids()
        input_nodes.append(ids.numel())
        # Freed at once: only its time is kept.
        timed("fetch_graphbolt", lambda: read(stock, ids).numel())
        x = timed("fetch", read, placed, ids)
        timed("compute", step, data, x)
        del data, x
    # Medians without the warm-up batch.
    print(json.dumps({
        "fanout": args.fanout,
        "threads": args.threads,
        "precision": args.precision,
        "dropout": "fused" if args.fused_dropout else "torch",
        "input_nodes": statistics.median_high(input_nodes[1:]),
        **{f"{stage}_s": statistics.median_high(t[1:])
           for stage, t in times.items()},
    }), flush=True)


if __name__ == "__main__":
    sys.exit(main())
