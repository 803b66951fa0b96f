"""A run's progress: what exact resume needs, kept out of the example's loop.

The example hands Progress what is saved (model, optimizer, scheduler) once;
Progress restores them from the checkpoint being resumed, and its epochs()
iterator owns the rest: skipping the steps a stopped run trained, seeding,
the stop agreement (each epoch's batches are the Joinable), the checkpoint
of a stop and the barrier after each epoch. Each touch point the loop keeps
fails loudly when it is dropped or misplaced, so an edit of the loop cannot
make a resume silently inexact:

    for epoch, batches in progress.epochs(train_loader):   # skips, seeds
        with Join([model, batches]):      # iterating outside Join: refused
            for data in batches:          # stops every rank at one step
                ...                       # the step, as you write it
                batches.add(loss, y.size(0))   # missing in a step: refused
        total_loss, num_train_items = batches.totals()
        ...
        progress.save_epoch(record)       # rank 0; missing or too early,
                                          # or a state changed after it:
                                          # refused
"""
import copy
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.nn.parallel import DistributedDataParallel

from . import stop as stopping
from .batches import Batches, Evaluation
from .checkpoint import (
    CHECKPOINT_FILE, check_plain, cpu_state, cpu_values, save_atomically,
    save_model,
)
from .cli import UsageError
from .collectives import barrier
from .records import append_metrics


class Progress:
    """One rank's run: where it starts (`start`, a gbrun.checkpoint.Start),
    what it restores and saves (`states`: objects with state_dict() and
    load_state_dict(), such as the model, with or without DDP, the
    optimizer and an LR scheduler; None is skipped), the epochs it trains
    and the files it writes. Make it after init_process_group, in every
    rank. `kept` is a dict of your own values to keep across a resume
    (tensors and plain data): rank 0's is saved, and every rank gets it
    back."""

    def __init__(self, plan, start, **states):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = plan.device(self.rank)
        self.upcast = not plan.autocast
        self.start, self.stop = start, stopping.installed()
        self.states = {name: unwrapped(obj) for name, obj in states.items()
                       if obj is not None}
        checkpoint = start.checkpoint or {}
        self.start_epoch = checkpoint.get("epoch", 0)
        self.start_step = checkpoint.get("step", 0)
        self.kept = restore(self.states, start.checkpoint,
                            start.checkpoint_dir)
        self.batches = None  # the epoch being trained
        self.saved = None  # what save_epoch saved of it
        # A stop waits for a step that ended with an optimizer step: a
        # checkpoint never falls inside a gradient accumulation.
        self.optimizers = [obj for obj in self.states.values()
                           if isinstance(obj, torch.optim.Optimizer)]
        self.optimizer_steps = 0
        for optimizer in self.optimizers:
            optimizer.register_step_post_hook(self._count_step)
        # A run that only predicts said so where it started (gbrun.checkpoint).
        if start.checkpoint is not None and start.trains:
            if self.rank == 0:
                at = f"epoch {self.start_epoch}" + (
                    f", step {self.start_step}" if self.start_step else "")
                print(f"Resuming from {start.checkpoint_dir} at {at}.")

    def epochs(self, train_loader):
        """Yields (epoch, its batches) for every epoch left to train. After
        each epoch: its checkpoint must be saved (save_epoch, rank 0), every
        rank waits until it is, and a signal that came during validation
        stops the run there (gbrun.stop.Stopped). A `break` out of the
        epochs (early stopping) ends training there."""
        try:
            yield from self._epochs(train_loader)
        finally:
            self.batches = None  # what follows is after training

    def _epochs(self, train_loader):
        for epoch in range(self.start_epoch, self.start.epochs):
            resumed = epoch == self.start_epoch and self.start_step
            loss, count = 0.0, 0
            if resumed:
                loss, count = self.start.checkpoint["partial"][self.rank]
            self.batches = EpochBatches(
                self, train_loader, epoch,
                self.start_step if resumed else 0,
                torch.tensor(loss, device=self.device), count,
            )
            self.saved = None
            yield epoch, self.batches
            self._end_epoch(epoch)

    def _count_step(self, optimizer, args, kwargs):
        self.optimizer_steps += 1

    def _check_no_pending_gradients(self, where):
        """A checkpoint saves no gradients: refuses one taken while the
        model holds gradients that no optimizer step has applied yet."""
        if not self.optimizers or self.batches.stepped_last:
            return
        for name, obj in self.states.items():
            if isinstance(obj, torch.nn.Module) and any(
                    p.grad is not None and bool(p.grad.any())
                    for p in obj.parameters()):
                raise RuntimeError(
                    f"{where} in epoch {self.batches.epoch}: the {name} "
                    "holds gradients accumulated since the last "
                    "optimizer.step(), which a checkpoint does not keep; "
                    "call optimizer.zero_grad() after the epoch's batches "
                    "(docs/customising.md, gradient accumulation)")

    def _end_epoch(self, epoch):
        self.batches.check_trained()
        if self.rank == 0:
            self._check_saved(epoch)
        if self.start.checkpoint_dir:
            self._agree_saved(None)
        if self.stop.agreed_now() and epoch + 1 < self.start.epochs:
            if self.rank == 0:
                stopping.report_stop(self.start.checkpoint_dir,
                                     self.stop.signum, epoch + 1, 0)
            barrier(self.device)
            raise stopping.Stopped(self.stop.signum)

    def _check_saved(self, epoch):
        if self.saved is None:
            raise RuntimeError(
                f"train() ended epoch {epoch} without "
                "progress.save_epoch(record) on rank 0: it saves the epoch's "
                "checkpoint, which --resume continues from")
        now = self._settings()
        # A scheduler first: its step changes the optimizer's rate too.
        optimizers_last = sorted(self.states.items(), key=lambda item:
                                 isinstance(item[1], torch.optim.Optimizer))
        for name, obj in optimizers_last:
            if not same(now[name], self.saved[name]):
                raise RuntimeError(
                    f"the {name} changed after progress.save_epoch(record) "
                    f"in epoch {epoch} ({type(obj).__name__}.step() after "
                    "it?): its checkpoint would resume another run; save "
                    "after the epoch's last change")
        if not same(cpu_values(self.kept), self.saved["kept"]):
            raise RuntimeError(
                f"progress.kept changed after progress.save_epoch(record) in "
                f"epoch {epoch}: its checkpoint would lose that change; save "
                "after it")

    def evaluation(self, dataloader, name):
        """`dataloader` for evaluation: each pass (`for data in ...`) is at
        most --max-batches long, sampled serially under a seed, shown on
        rank 0 as `name`, in the features' compute precision."""
        return Evaluation(self, dataloader, name)

    def save_epoch(self, record):
        """After an epoch's training, validation and schedule, on rank 0 (a
        no-op elsewhere): the checkpoint that --resume continues from (the
        next epoch, step 0), then `record` with the epoch's speed and the
        number of ranks as a line of metrics.jsonl."""
        batches = self.batches
        if batches is None or not batches.finished:
            raise RuntimeError(
                "progress.save_epoch(record) before the epoch's batches were "
                "trained to the end: call it after the epoch's loop")
        self._check_no_pending_gradients("progress.save_epoch(record)")
        if self.rank != 0:
            return
        if self.start.checkpoint_dir:
            try:
                self._save(batches.epoch + 1, step=0, partial=None)
            except UsageError as error:
                # A full disk: rank 0 meets the others at the barrier that
                # waits for the checkpoint (_end_epoch) now, so that no
                # epoch line is printed, and every rank ends.
                self._agree_saved(f"{error}: --resume continues from it")
        # What a later step of the schedule or edit of `kept` would change.
        self.saved = dict(self._settings(),
                          kept=cpu_values(copy.deepcopy(self.kept)))
        if self.start.log_dir:
            append_metrics(self.start.log_dir, {
                **record, **batches.speed_record()})

    def save_final(self, record):
        """On rank 0 at the end (a no-op elsewhere): the model this run
        trained as model.pt (a run that resumed a finished checkpoint, to
        predict, trained none), and `record` (the test result) with the
        number of ranks as a line of metrics.jsonl."""
        if self.rank != 0:
            return
        if self.start.checkpoint_dir and self.start_epoch < self.start.epochs:
            save_model(self.states["model"], self.start.checkpoint_dir,
                       self.start.key)
        if self.start.log_dir:
            append_metrics(self.start.log_dir,
                           {**record, "ranks": self.world_size})

    def save_stop(self, batches):
        """Every rank, once a signal stopped training inside an epoch: rank 0
        saves where, with every rank's loss sum and item count, and says how
        to go on; then every rank raises gbrun.stop.Stopped."""
        batches.check_added()
        # On the rank's device: NCCL gathers only tensors on the input's GPU.
        sums = torch.stack([
            batches.loss_sum.detach().to(torch.float64),
            torch.tensor(batches.num_items, dtype=torch.float64,
                         device=self.device),
        ])
        gathered = [torch.zeros_like(sums) for _ in range(self.world_size)]
        dist.all_gather(gathered, sums)
        error = None
        if self.rank == 0:
            try:
                if self.start.checkpoint_dir:
                    partial = [[loss, int(count)] for loss, count in
                               (g.tolist() for g in gathered)]
                    self._save(batches.epoch, batches.step, partial)
                stopping.report_stop(self.start.checkpoint_dir,
                                     self.stop.signum, batches.epoch,
                                     batches.step)
            except UsageError as failed:  # a full disk: every rank ends
                error = f"{failed}: --resume continues from it"
        self._agree_saved(error)
        raise stopping.Stopped(self.stop.signum)

    def _agree_saved(self, error):
        """Every rank, once rank 0 has tried to save a checkpoint (`error`:
        why it could not, on rank 0): the barrier that waits for it, which
        also tells every rank whether it failed. Then every rank ends with
        that one line (UsageError: rank 0 says it, exit status 2), instead
        of a traceback on rank 0 and the others' on the lost connection."""
        failed = torch.tensor([int(error is not None)], device=self.device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if int(failed.item()):
            raise UsageError(error or "rank 0 could not save the checkpoint")

    def _settings(self):
        """What a step of the schedule changes, by state: an optimizer's
        param_groups (without the parameters), a scheduler's state_dict; a
        model's parameters change only with the optimizer's step (None)."""
        settings = {}
        for name, obj in self.states.items():
            if isinstance(obj, torch.nn.Module):
                settings[name] = None
            elif isinstance(obj, torch.optim.Optimizer):
                settings[name] = [
                    {k: copy.deepcopy(v) for k, v in group.items()
                     if k != "params"} for group in obj.param_groups]
            else:
                settings[name] = copy.deepcopy(obj.state_dict())
        return settings

    def _save(self, epoch, step, partial):
        """Writes the checkpoint, with the epochs the run trains to (a
        checkpoint at that epoch is finished: --resume --predict of it only
        predicts). A stopped run also keeps each rank's loss sum and item
        count so far (`partial`), for the epoch's average."""
        check_plain(self.kept, "progress.kept")
        checkpoint = {name: cpu_state(obj) for name, obj in self.states.items()}
        checkpoint.update(
            epoch=epoch, step=step, partial=partial, seed=self.start.seed,
            epochs=self.start.epochs, config=self.start.key,
            kept=cpu_values(self.kept),
        )
        save_atomically(checkpoint, os.path.join(self.start.checkpoint_dir,
                                                 CHECKPOINT_FILE))


class EpochBatches(Batches, Joinable):
    """One training epoch's batches (see Batches), and this rank's loss sum
    and item count over the epoch (a resumed epoch's earlier steps
    included). It is a Joinable: iterate it inside `with Join([model,
    batches]):`. At every step boundary the ranks agree on a stop signal;
    once they have, the iteration ends on every rank at the same step, and
    leaving the Join saves the checkpoint and raises gbrun.stop.Stopped."""

    def __init__(self, progress, dataloader, epoch, skip, loss_sum,
                 num_items):
        Batches.__init__(
            self, dataloader, progress.rank, f"train {epoch}",
            progress.start.seed, epoch, skip, progress.start.max_batches,
            progress.upcast, progress.device)
        Joinable.__init__(self)
        self.progress = progress
        self.loss_sum, self.num_items = loss_sum, num_items
        self.skipped, self.added, self.items_added = skip, 0, 0
        self.in_join = self.started = self.finished = False
        self.train_time = 0.0
        # Whether the last step ended with an optimizer step.
        self.stepped_last, self.optimizer_steps = True, None

    def __iter__(self):
        if not self.in_join:
            raise RuntimeError(
                "iterate an epoch's batches inside `with Join([model, "
                "batches]):`: its stop agreement answers there for a rank "
                "that has run out of batches")
        if self.started:
            raise RuntimeError("an epoch's batches are iterated once")
        self.started = True
        start = time.time()
        steps = Batches.__iter__(self)
        progress = self.progress
        self.optimizer_steps = progress.optimizer_steps
        for data in steps:
            yield data
            # The step is done: every rank agrees whether to stop here, and
            # stops once a step ends with an optimizer step (at once,
            # unless gradients are being accumulated).
            self.check_added()
            Join.notify_join_context(self)
            self.stepped_last = (not progress.optimizers
                                 or progress.optimizer_steps
                                 != self.optimizer_steps)
            self.optimizer_steps = progress.optimizer_steps
            if progress.stop.agreed() and self.stepped_last:
                steps.close()
                break
        else:
            self.finished = True
        self.train_time = time.time() - start

    def add(self, loss, count):
        """Adds a step's loss (the mean over its `count` items) to this
        rank's sums for the epoch: once a step, after its loss."""
        self.loss_sum += loss.detach().float() * count
        self.num_items += count
        self.added += 1
        self.items_added += count

    def check_added(self):
        trained = self.step - self.skipped
        if self.added != trained:
            raise RuntimeError(
                f"batches.add(loss, count) ran {self.added} times in "
                f"{trained} steps of epoch {self.epoch}: call it once a "
                "step, after the loss (the epoch's loss, and a stop's "
                "checkpoint, come from it)")

    def totals(self):
        """(loss sum, item count) of this rank's epoch so far, a resumed
        epoch's earlier steps included."""
        self.check_added()
        return self.loss_sum, self.num_items

    def check_trained(self):
        if not self.finished:
            raise RuntimeError(
                f"epoch {self.epoch} ended before its batches did: iterate "
                "`for data in batches:` to the end, inside Join (--max-"
                "batches limits an epoch)")
        self.check_added()

    def speed_record(self):
        seeds = self.items_added * self.progress.world_size
        return {
            "train_time": self.train_time,
            "seeds_per_second": seeds / max(self.train_time, 1e-9),
            "data_wait": self.data_wait,
            "ranks": self.progress.world_size,
        }

    @property
    def speed(self):
        """The epoch's speed as the epoch line prints it."""
        record = self.speed_record()
        return (f"Train Time {record['train_time']:.4f} | "
                f"Seeds/s {record['seeds_per_second']:.1f} | "
                f"Data Wait {record['data_wait']:.4f}")

    def join_hook(self, **kwargs):
        self.in_join = True  # Join's constructor asks every joinable
        return _AnswerStop(self)

    @property
    def join_device(self):
        return self.device

    @property
    def join_process_group(self):
        return dist.group.WORLD


class _AnswerStop(JoinHook):
    def __init__(self, batches):
        self.batches = batches

    def main_hook(self):
        # A rank that ran out of batches, in each step of the others.
        self.batches.progress.stop.answer()

    def post_hook(self, is_last_joiner):
        # Every rank, once all have joined: the loop's last flag, and the
        # stop's checkpoint if the ranks agreed on one inside the epoch.
        # Agreed at its last step, the stop comes after the epoch's
        # validation and checkpoint, at the epoch boundary.
        stop = self.batches.progress.stop
        stop.settle()
        if stop.signum and not self.batches.finished:
            self.batches.progress.save_stop(self.batches)


def restore(states, checkpoint, checkpoint_dir):
    """Loads each of `states` (name: object) from `checkpoint` (or does
    nothing, for None), exactly as saved; returns a copy of the checkpoint's
    `kept` values ({} if none)."""
    if checkpoint is None:
        return {}
    for name, obj in states.items():
        if checkpoint.get(name) is None:
            raise UsageError(
                f"checkpoint in '{checkpoint_dir}' has no {name} state; "
                "this run has one"
            )
        # A copy: the checkpoint reached this rank through shared memory,
        # and load_state_dict keeps CPU tensors as they are, so otherwise
        # every rank would step the same optimizer state.
        obj.load_state_dict(copy.deepcopy(checkpoint[name]))
    return copy.deepcopy(checkpoint.get("kept") or {})


def unwrapped(obj):
    """The module inside DDP, or obj: a checkpoint holds the model's own
    state_dict (no `module.` prefixes) whichever is handed over."""
    return obj.module if isinstance(obj, DistributedDataParallel) else obj


def same(a, b):
    """True if two states (dicts, lists, tensors, plain values) are equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and a.dtype == b.dtype
                and bool(torch.equal(a, b)))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b
