"""dgl.graphbolt, imported once with a one-line error where it cannot be:
dgl 2.4+ refuses to import GraphBolt's CPU build next to a CUDA torch, and
dgl 2.1-2.3 have no GraphBolt library for a torch they were not built for.

Also the one place that reads GraphBolt's private attributes: an item
sampler's shuffling state and its batch count, which no public API gives
(see seed_item_sampler and batches_per_rank, with the releases read).
tests/test_graphbolt_internals.py fails loudly when a release lacks them.
"""
import os
import sys

import numpy as np


# PyPI's torch 2.2.1 is a CUDA 12.1 build, PyPI's dgl a CPU-only one. DGL's
# CUDA build of the same release comes from DGL's own wheel index.
INSTALL_CUDA_DGL = (
    "pip install dgl==2.1.0+cu121 "
    "-f https://data.dgl.ai/wheels/torch-2.2/cu121/repo.html"
)

def cannot_load(error):
    """One line saying why dgl.graphbolt cannot load, and what to do."""
    if isinstance(error, ModuleNotFoundError) and error.name in ("dgl", "torch"):
        return (f"{error.name} is not installed "
                "(pip install -r requirements.txt)")
    if isinstance(error, FileNotFoundError):
        # dgl 2.1-2.3 ship one GraphBolt library per torch release.
        import torch

        return (f"{error} (this DGL has no GraphBolt library for torch "
                f"{torch.__version__}: pip install -r requirements.txt "
                "installs the versions that match)")
    return (f"{error} (for GPUs: {INSTALL_CUDA_DGL}; for CPU ranks: "
            "CUDA_VISIBLE_DEVICES= python ...)")


try:
    import dgl.graphbolt as gb
except (ImportError, FileNotFoundError) as error:
    print(f"{os.path.basename(sys.argv[0])}: error: {cannot_load(error)}",
          file=sys.stderr)
    sys.exit(2)

__all__ = ["gb", "INSTALL_CUDA_DGL"]


def seed_item_sampler(item_sampler, seed, rank, epoch, derive):
    """Makes one epoch's shuffling of `item_sampler` follow the run's seed,
    where GraphBolt takes none per epoch (`derive(*entropy)` -> an int):
    - dgl 2.1-2.2 (read in item_sampler.py at v2.1.0 and v2.2.1): each rank
      shuffles its own share with the sampler's `_rng`, an unseeded
      np.random.Generator: replaced by one seeded from (seed, rank, epoch);
    - dgl 2.3-2.4 (v2.3.0, v2.4.0): one permutation of all items from
      torch.Generator().manual_seed(_seed + _epoch), which every rank must
      draw alike: `_seed` from (seed, epoch), `_epoch` 0.
    Raises where a release has neither (it must be read again)."""
    if hasattr(item_sampler, "_rng"):
        item_sampler._rng = np.random.default_rng(derive(seed, rank, epoch))
    elif hasattr(item_sampler, "_seed") and hasattr(item_sampler, "_epoch"):
        item_sampler._seed = derive(seed, epoch) % (2**31 - 1)
        item_sampler._epoch = 0
    else:
        raise AttributeError(
            "this GraphBolt's ItemSampler has neither _rng (dgl 2.1-2.2) nor "
            "_seed and _epoch (dgl 2.3-2.4): update gbrun/graphbolt.py's "
            "seed_item_sampler for it"
        )


def batches_per_rank(item_sampler):
    """How many batches this rank's `item_sampler` hands out in a pass (the
    progress bar's total), as GraphBolt's own calculate_range shares the
    items out: its arguments are the sampler's _item_set, _world_size,
    _rank, _batch_size, _drop_last and _drop_uneven_inputs (the same names
    and module at dgl 2.1.0 and 2.4.0)."""
    from dgl.graphbolt.internal.item_sampler_utils import calculate_range

    size = item_sampler._batch_size
    _, _, count = calculate_range(
        item_sampler._world_size is not None, len(item_sampler._item_set),
        item_sampler._world_size or 1, item_sampler._rank or 0, 1, 0, size,
        item_sampler._drop_last, item_sampler._drop_uneven_inputs)
    return -(-count // size)
