"""The benchmark's baseline, in a process of its own: what GraphBolt and the
example's model do without the example (no DDP, no Join, no metrics, no
evaluation), as GraphBolt comes or with the example's CPU settings
(--tuned). Appends one metrics.jsonl record per epoch to --log-dir, with
the keys the example writes (epoch_time, train_time, seeds_per_second,
data_wait), so that benchmark.py reads both alike.

    python benchmarks/bare_loop.py --dataset /tmp/perf200k --log-dir /tmp/b
"""
import itertools
import os
import sys
import time
import types

from gbrun.cli import (
    SHIPPED_EXAMPLE, ArgumentParser, fanout_list, int_at_least, python_file,
)

EPOCHS = 2  # epoch 0 warms up, epoch 1 is measured


def child_parser(description):
    """The options benchmark.py gives its child programs (this one and
    stage_split.py): what to train on, and how."""
    parser = ArgumentParser(description=description)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--example", type=python_file, default=SHIPPED_EXAMPLE)
    parser.add_argument("--threads", type=int_at_least(1), default=1)
    parser.add_argument("--batches", type=int_at_least(1), default=20)
    parser.add_argument("--batch-size", type=int_at_least(1), default=1024)
    parser.add_argument("--fanout", type=fanout_list, default=[10, 10, 10])
    parser.add_argument("--precision", choices=["fp32", "bf16"],
                        default="fp32")
    return parser


def create_model(example, dataset, fused_dropout, split_products):
    """The example's model for `dataset`, as the example's CPU ranks run
    it (gbrun.cpu.tune_model): its nn.Dropout fused (--fused-dropout), and in
    bf16 its products split (gbrun.cpu.products)."""
    import gbrun.cpu
    import gbrun.data.datasets

    model = example.create_model(
        gbrun.data.datasets.feature_size(dataset, example.FEATURE_KEYS),
        dataset.tasks[0].metadata["num_classes"])
    # The two fields of the example's plan that tune_model reads.
    return gbrun.cpu.tune_model(model, types.SimpleNamespace(
        fused_dropout=fused_dropout, split_products=split_products))


def parse_args(argv=None):
    parser = child_parser(__doc__.splitlines()[0])
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("--tuned", action="store_true",
                        help="The example's CPU settings: keep_freed_memory, "
                        "poll_less, its feature reads, fused dropout and, "
                        "in bf16, split products.")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import torch
    import torch.nn.functional as F

    import gbrun.cli
    import gbrun.cpu.memory
    import gbrun.data.datasets
    import gbrun.placement
    import gbrun.records
    from gbrun.graphbolt import gb

    example = gbrun.cli.load_example(args.example)
    if args.tuned:
        gbrun.cpu.memory.keep_freed_memory()
        gbrun.cpu.memory.poll_less()
    torch.set_num_threads(args.threads)
    dataset = gb.OnDiskDataset(args.dataset).load()
    bf16 = args.precision == "bf16"
    if bf16:
        # As the example's --precision bf16: bf16 features, autocast.
        gbrun.data.datasets.store_in_bf16(dataset, example.FEATURE_KEYS)
    features = dataset.feature
    if args.tuned:
        features = gbrun.placement.index_select_store(features)  # as the example reads
    task = dataset.tasks[0]
    datapipe = gb.ItemSampler(
        task.train_set, batch_size=args.batch_size, shuffle=True, drop_last=True
    )
    datapipe = datapipe.sample_neighbor(dataset.graph, args.fanout)
    datapipe = datapipe.fetch_feature(
        features, node_feature_keys=example.FEATURE_KEYS)
    # As upstream's example: copy_to makes the DataLoader prefetch batches
    # in a background thread.
    dataloader = gb.DataLoader(datapipe.copy_to("cpu"), num_workers=0)
    model = create_model(example, dataset, args.tuned, args.tuned and bf16)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001)
    os.makedirs(args.log_dir, exist_ok=True)
    for epoch in range(EPOCHS):
        start = time.time()
        data_wait, seeds = 0.0, 0
        step_end = time.time()
        for data in itertools.islice(dataloader, args.batches):
            data_wait += time.time() - step_end
            with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
                y_hat = model(data.blocks, example.node_features(data))
            loss = F.cross_entropy(y_hat.float(), data.labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seeds += data.labels.size(0)
            step_end = time.time()
        train_time = time.time() - start
        gbrun.records.append_metrics(args.log_dir, {
            "epoch": epoch, "epoch_time": train_time,
            "train_time": train_time,
            "seeds_per_second": seeds / train_time,
            "data_wait": data_wait})


if __name__ == "__main__":
    sys.exit(main())
