"""torchmetrics across ranks where a rank has no items."""
import functools
import warnings

import torch
import torch.distributed as dist


def across_ranks(metric, device):
    """`metric` (a torchmetrics Metric or MetricCollection) on `device`,
    made to sync its state over the process group in compute() with
    gather_all_tensors below: exact on every rank, also where a rank saw no
    items, whatever the metric (the example's evaluate() makes every metric
    this way, so no metric needs a sync argument of its own)."""
    import torchmetrics

    if isinstance(metric, torchmetrics.MetricCollection):
        parts = list(metric.values())
    elif isinstance(metric, torchmetrics.Metric):
        parts = [metric]
    else:
        raise TypeError(
            f"create_metric() returned a {type(metric).__name__}; evaluate() "
            "takes a torchmetrics Metric or MetricCollection")
    for part in parts:
        part.dist_sync_fn = gather_all_tensors
    # A rank without items computes before any update, by design here: its
    # warning is silenced in each compute() call, not in the process.
    # torchmetrics wraps each instance's compute() the same way itself.
    for part in {id(p): p for p in [metric, *parts]}.values():
        part.compute = without_update_warning(part.compute)
    return metric.to(device)


def without_update_warning(compute):
    """`compute`, run without torchmetrics' warning that it was called
    before update()."""
    @functools.wraps(compute)
    def call(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=r"The ``compute`` method of metric .* was "
                "called before the ``update`` method", category=UserWarning)
            return compute(*args, **kwargs)

    return call


def gather_all_tensors(result, group=None):
    """torchmetrics' gather_all_tensors (pass it as a metric's
    `dist_sync_fn`), also where this rank's metric saw no items.

    For a state that is a list of tensors (AUROC's or average precision's
    predictions and targets) torchmetrics 1.9 gives such a rank the
    placeholder torch.tensor([]): 1-D and float32, where the other ranks
    hold [N, C] floats or [N] int64. The ranks then gather buffers of other
    sizes: gloo aborts the job ("op.preamble.length <= op.nbytes. 8 vs 4"),
    NCCL can hang. Here an empty tensor first takes the trailing shape and
    dtype of a rank that has items, so that every rank gathers alike."""
    from torchmetrics.utilities.distributed import (
        gather_all_tensors as gather,
    )

    kinds = [None] * dist.get_world_size(group)
    mine = (list(result.shape[1:]), str(result.dtype)) if result.numel() else None
    dist.all_gather_object(kinds, mine, group=group)
    others = [kind for kind in kinds if kind is not None]
    if result.numel() == 0 and others:
        shape, dtype = others[0]
        result = torch.empty([0, *shape], dtype=getattr(torch, dtype[6:]),
                             device=result.device)
    return gather(result, group)
