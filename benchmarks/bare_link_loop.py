"""The link benchmark's baseline, in a process of its own: per step what
DGL's examples/sampling/graphbolt/link_prediction.py (v2.1.0, --mode
cpu-cpu) does, written here, with link_prediction.py's model. One process
on torch's default threads (upstream sets none), GraphBolt's CPU feature
store as it comes, and its DataLoader's prefetch thread (upstream's copy_to
ends the pipeline):

    ItemSampler -> sample_uniform_negative -> sample_neighbor
    -> exclude_seed_edges (and the reverse edges) -> fetch_feature
    -> copy_to -> embeddings, predictor(h_u * h_v), BCE, Adam

After the last epoch, upstream's evaluation: every node embedded layer by
layer over full neighbourhoods (batches of 1,024), then each validation
pair scored against its own negatives, by link_prediction.py's MRR.
Appends one metrics.jsonl record per epoch to --log-dir with the keys the
example writes (epoch_time, train_time, seeds_per_second: positive pairs
per second, data_wait; val_mrr on the last), so that benchmark.py reads
both alike.

    python benchmarks/bare_link_loop.py --dataset /tmp/links --log-dir /tmp/b
"""
import itertools
import os
import sys
import time
from functools import partial

from gbrun.cli import ArgumentParser, fanout_list, int_at_least, python_file

from bare_loop import EPOCHS

LINK_EXAMPLE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "link_prediction.py")
EVAL_BATCH_SIZE = 1024  # upstream's --eval-batch-size


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("--example", type=python_file, default=LINK_EXAMPLE)
    parser.add_argument("--batches", type=int_at_least(1), default=None,
                        help="Training steps per epoch (upstream's "
                        "--early-stop). Default: the whole train set.")
    parser.add_argument("--batch-size", type=int_at_least(1), default=512)
    parser.add_argument("--neg-ratio", type=int_at_least(1), default=1)
    parser.add_argument("--fanout", type=fanout_list, default=[10, 10, 10])
    parser.add_argument("--lr", type=float, default=0.0005)
    return parser.parse_args(argv)


def create_dataloader(graph, features, train_set, args, keys):
    """Upstream's training pipeline on CPU storage, stage for stage."""
    from gbrun.graphbolt import gb

    datapipe = gb.ItemSampler(train_set, batch_size=args.batch_size,
                              shuffle=True)
    datapipe = datapipe.sample_uniform_negative(graph, args.neg_ratio)
    datapipe = datapipe.sample_neighbor(graph, args.fanout)
    datapipe = datapipe.transform(
        partial(gb.exclude_seed_edges, include_reverse_edges=True))
    datapipe = datapipe.fetch_feature(features, node_feature_keys=keys)
    # Everything before copy_to runs in the DataLoader's prefetch thread.
    datapipe = datapipe.copy_to("cpu")
    return gb.DataLoader(datapipe, num_workers=0)


def train_epoch(model, optimizer, dataloader, batches, neg_ratio, example):
    """One epoch of upstream's step: (positive pairs, seconds waiting for
    the loader)."""
    import torch.nn.functional as F
    from gbrun.graphbolt import scored_pairs

    pairs, data_wait = 0, 0.0
    step_end = time.time()
    for data in itertools.islice(dataloader, batches):
        data_wait += time.time() - step_end
        sources, destinations, labels = scored_pairs(data)
        h = model(data.blocks, example.node_features(data))
        logits = model.score(h[sources], h[destinations])
        loss = F.binary_cross_entropy_with_logits(logits, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss.item()  # upstream sums the loss each step
        pairs += labels.size(0) // (1 + neg_ratio)  # the positive ones
        step_end = time.time()
    return pairs, data_wait


def embed(model, graph, features, all_nodes, example):
    """Every node's embedding, upstream's layer-wise inference: each layer
    over all nodes with full neighbourhoods before the next one."""
    import torch
    from gbrun.graphbolt import gb

    loader = gb.DataLoader(
        gb.ItemSampler(all_nodes, batch_size=EVAL_BATCH_SIZE)
        .sample_neighbor(graph, [-1])
        .fetch_feature(features, node_feature_keys=example.FEATURE_KEYS)
        .copy_to("cpu"), num_workers=0)
    x = None
    for layer_idx in range(len(model.layers)):
        y = torch.empty(graph.total_num_nodes, example.HIDDEN_SIZE)
        for data in loader:
            inputs = (example.node_features(data) if x is None
                      else x[data.input_nodes])
            y[data.seed_nodes] = model(data.blocks, inputs,
                                       first_layer=layer_idx)
        x = y
    return x


def validation_mrr(model, graph, features, all_nodes, valid_set, example):
    """MRR of the validation pairs, each against its own negatives, by
    link_prediction.py's metric (OGB's definition)."""
    import torch

    model.eval()
    with torch.no_grad():
        h = embed(model, graph, features, all_nodes, example)
        pairs, negatives = valid_set
        metric = example.create_metric(negatives.size(1))
        for start in range(0, len(pairs), EVAL_BATCH_SIZE):
            end = start + EVAL_BATCH_SIZE
            destinations = torch.cat([pairs[start:end, 1:],
                                      negatives[start:end]], dim=1)
            scores = model.score(h[pairs[start:end, 0]][:, None, :],
                                 h[destinations])
            metric.update(scores[:, 0], scores[:, 1:])
    model.train()
    return metric.compute()["MRR"].item()


def main(argv=None):
    args = parse_args(argv)
    import torch

    import gbrun.cli
    import gbrun.records
    from gbrun.data import datasets

    example = gbrun.cli.load_example(
        args.example, ("FEATURE_KEYS", "TASK", "HIDDEN_SIZE", "create_model",
                       "create_metric", "node_features"))
    dataset = datasets.load_dataset(args.dataset)
    train_set, valid_set, _ = datasets.check_link_task(
        dataset, args.dataset, example.FEATURE_KEYS, example.TASK)
    graph, features = dataset.graph, dataset.feature
    keys = example.FEATURE_KEYS
    model = example.create_model(datasets.feature_size(dataset, keys))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    dataloader = create_dataloader(graph, features, train_set, args, keys)
    os.makedirs(args.log_dir, exist_ok=True)
    for epoch in range(EPOCHS):
        start = time.time()
        pairs, data_wait = train_epoch(model, optimizer, dataloader,
                                       args.batches, args.neg_ratio, example)
        train_time = time.time() - start
        record = {"epoch": epoch, "train_time": train_time,
                  "seeds_per_second": pairs / train_time,
                  "data_wait": data_wait, "pairs": pairs}
        if epoch == EPOCHS - 1:  # upstream evaluates after training
            record["val_mrr"] = validation_mrr(
                model, graph, features, dataset.all_nodes_set, valid_set,
                example)
        record["epoch_time"] = time.time() - start
        gbrun.records.append_metrics(args.log_dir, record)


if __name__ == "__main__":
    sys.exit(main())
