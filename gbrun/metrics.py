"""torchmetrics across ranks where a rank has no items."""
import torch
import torch.distributed as dist


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
