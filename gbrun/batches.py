"""A rank's mini-batches for one pass: skipped and limited, with a progress
bar on rank 0 and the time spent waiting for data, seeded so that a run
repeats and resumes exactly at any step (Batches); and an evaluation
loader whose every pass is seeded by its own name (Evaluation)."""
import contextlib
import itertools
import random
import time
import zlib

import numpy as np
import torch
import tqdm
from torch.utils.data.graph import traverse_dps
from torch.utils.data.graph_settings import get_all_graph_pipes

from .graphbolt import (
    batches_per_rank, gb, seed_item_sampler, share_one_permutation,
)
from .sources import BatchSource

def item_sampler_of(dataloader):
    """The DistributedItemSampler at the root of a GraphBolt DataLoader."""
    for pipe in get_all_graph_pipes(traverse_dps(dataloader.dataset)):
        if isinstance(pipe, gb.ItemSampler):
            return pipe
    raise ValueError("the data loader has no GraphBolt ItemSampler")


class Batches:
    """A data loader's mini-batches for one pass, at most `limit` of them,
    with a progress bar on rank 0; counts the steps and the host time spent
    waiting for data (`step`: batches handed out so far, skipped ones
    included). A training pass (`epoch` given) under a seed derives its
    shuffling and sampling from (seed, rank, epoch) and each step's dropout
    from (seed, rank, epoch, step), after skipping the `skip` batches a
    stopped run already trained: a run repeats, and resumes at any step.
    An evaluation pass under a seed (`epoch` None) derives its sampling
    from (seed, rank, *`pass_id`), the pass's own name: it gives the same
    result whatever ran before it in the process (a resume that goes
    straight to validation or the test prints what an uninterrupted run
    printed). `upcast`: bf16 node features reach the model in fp32 (--precision bf16
    where the device does not compute bf16: stored in bf16, computed in
    fp32). A pass ends once the device has done its queued work, so that a
    time taken after it counts the pass. The batches of a GraphBolt
    DataLoader, or of a gbrun.sources.BatchSource (DGL's distributed
    engine's DistLoader), which asks pass_seed() how to shuffle."""

    def __init__(self, dataloader, rank, name, seed=None, epoch=None, skip=0,
                 limit=None, upcast=False, device=None, pass_id=()):
        self.dataloader = dataloader
        self.rank, self.name = rank, name
        self.seed, self.epoch, self.pass_id = seed, epoch, pass_id
        self.step, self.limit = skip, limit
        self.upcast, self.device = upcast, device
        self.data_wait = 0.0

    def pass_seed(self):
        """The seed of this pass's randomness (None, unseeded): (seed, rank,
        epoch) for a training epoch, like PyTorch's
        DistributedSampler.set_epoch, so that the same seed repeats a run
        and a resumed run (which samples the batches it skips) continues it
        exactly; (seed, rank, *pass_id) for an evaluation pass."""
        if self.seed is None:
            return None
        if self.epoch is not None:
            return derived_seed(self.seed, self.rank, self.epoch)
        return derived_seed(self.seed, self.rank, *self.pass_id)

    def shared_seed(self):
        """The seed of a training epoch that every rank draws alike (the
        one permutation they share out): from (seed, epoch), or from the
        epoch alone in an unseeded run."""
        return derived_seed(*(() if self.seed is None else (self.seed,)),
                            self.epoch)

    def source(self):
        """(this pass's batches from batch `step` on, at most `limit` in
        all; rank 0's number of them, for the progress bar). Under a seed,
        every pass samples serially (see sample_serially)."""
        if isinstance(self.dataloader, BatchSource):
            return self.dataloader.source(self)
        item_sampler = item_sampler_of(self.dataloader)
        if self.epoch is not None:
            # The ranks share out one permutation of the whole train set,
            # new every epoch (an unseeded run's shuffling inside a share
            # and its sampling stay unseeded).
            share_one_permutation(item_sampler, self.shared_seed())
        seed = self.pass_seed()
        if seed is not None:
            # Shuffling, neighbor sampling and anything else random.
            seed_all(seed)
            if self.epoch is not None:
                # GraphBolt's item sampler takes no seed for an epoch.
                seed_item_sampler(item_sampler, seed, self.shared_seed())
        batches = self.dataloader if seed is None else sample_serially(
            self.dataloader, seed)
        batches = itertools.islice(batches, self.step, self.limit)
        return batches, rank0_batches(item_sampler, self.limit)

    def __iter__(self):
        batches, total = self.source()
        if self.rank == 0:
            batches = tqdm.tqdm(
                batches, desc=self.name, total=total, initial=self.step
            )
        batches = iter(batches)
        training = self.seed is not None and self.epoch is not None
        while True:
            start = time.time()
            data = next(batches, None)
            # Host time waiting for the loader: sampling and feature
            # fetching that no prefetch thread hid.
            self.data_wait += time.time() - start
            if data is None:
                if self.device is not None:
                    synchronized_time(self.device)
                return
            if training:
                torch.manual_seed(
                    derived_seed(self.seed, self.rank, self.epoch, self.step)
                )
            if self.upcast:
                data.node_features = {
                    key: value.float() if value.dtype == torch.bfloat16
                    else value for key, value in data.node_features.items()
                }
            # Counted before the step runs: a loop that breaks after it
            # (a stop) has trained `step` batches.
            self.step += 1
            yield data


class Evaluation:
    """A data loader whose every pass is a Batches pass (see
    Progress.evaluation), seeded by the pass's own name: (the loader's
    name, the epoch it validates or the end of training, which pass of
    this loader in that epoch)."""

    def __init__(self, progress, dataloader, name):
        self.progress, self.dataloader, self.name = progress, dataloader, name
        self.passes = {}  # epoch: passes of this loader so far

    def __iter__(self):
        progress = self.progress
        training = progress.batches is not None
        # Named by the epoch it validates, while training runs.
        name = f"{self.name} {progress.batches.epoch}" if training else (
            self.name)
        epoch = progress.batches.epoch if training else progress.start.epochs
        count = self.passes[epoch] = self.passes.get(epoch, 0) + 1
        return iter(Batches(
            self.dataloader, progress.rank, name, progress.start.seed,
            limit=progress.start.max_batches, upcast=progress.upcast,
            device=progress.device,
            pass_id=(zlib.crc32(self.name.encode()), epoch, count)))


def rank0_batches(item_sampler, limit):
    """How many batches rank 0 gets (the progress bar's total): training
    drops partial and uneven batches, evaluation drops nothing."""
    total = batches_per_rank(item_sampler)
    return min(total, limit or total)


def sample_serially(batches, seed):
    """Yields the loader's batches, sampling each with one thread. With more,
    dgl 2.1.0's sampling is not repeatable: only the calling thread's random
    engine is seeded, and unique_and_compact numbers ids in whichever order
    the threads insert them. Training keeps all threads. Costs about 15%
    with 1 rank x 2 threads on a 200k-node graph; nothing with 1 thread.
    torch's generator is seeded from (`seed`, the batch's index) before
    each batch is sampled: what samples with it (GraphBolt's uniform
    negatives) draws the same for a batch whether the batches before it
    were trained (whose dropout draws from it too) or skipped by a resume."""
    iterator = iter(batches)
    for index in itertools.count():
        # Only while sampling: the step that uses the batch has them all.
        with torch_threads(1):
            torch.manual_seed(derived_seed(seed, index))
            batch = next(iterator, None)
        if batch is None:
            return
        yield batch


@contextlib.contextmanager
def torch_threads(count):
    """torch's intra-op threads set to `count` inside the block, and back
    to what they were after it (a setting of the whole process)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def seed_all(seed):
    """Seeds every random engine that sampling, shuffling or a model reads."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    gb.seed(seed)


def derived_seed(*entropy):
    return int(np.random.SeedSequence(list(entropy)).generate_state(1)[0])


def synchronized_time(device):
    """time.time() once the GPU has finished its queued work: CUDA runs
    asynchronously, so without this a timing measures only the launches."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.time()
