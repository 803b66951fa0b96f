"""A run's progress: what exact resume needs, kept out of the example's loop.

The example hands Progress what is saved (model, optimizer, scheduler) once;
its CheckpointManager (gbrun.run_state) restores them from the checkpoint
being resumed and saves them with the run's state, and the epochs()
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
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from . import stop as stopping
from .batches import Batches, Evaluation
from .checkpoint import save_model
from .cli import UsageError
from .collectives import barrier
from .records import append_metrics
from .run_state import CheckpointManager, RunState


# An unseeded run shuffles each epoch anew, so a resume cannot take up the
# stopped run's order inside one: said, never silently inexact.
UNSEEDED_RESUME = (
    "Note: this run is unseeded, so the rest of epoch {epoch} comes from a "
    "new shuffle: some of its nodes train twice and others not at all "
    "(under --seed a resume trains exactly what the stopped run left).")


def say_resumed(start, epoch, step):
    """Where a resumed run starts (rank 0's line), and a note where it
    cannot train exactly what the stopped run left."""
    at = f"epoch {epoch}" + (f", step {step}" if step else "")
    print(f"Resuming from {start.checkpoint_dir} at {at}.")
    if step and start.seed is None:
        print(UNSEEDED_RESUME.format(epoch=epoch))


class Progress:
    """One rank's run: where it starts (`start`, a gbrun.checkpoint.Start),
    what it restores and saves (`states`: objects with state_dict() and
    load_state_dict(), such as the model, with or without DDP, the
    optimizer and an LR scheduler; None is skipped: see
    gbrun.run_state.CheckpointManager), the epochs it trains, the stop
    signal it answers (`plan.stop`, installed by gbrun.launch.run_rank) and
    the files it writes. Make it after init_process_group, in every rank.
    `kept` is a dict of your own values to keep across a resume (tensors
    and plain data): rank 0's is saved, and every rank gets it back."""

    def __init__(self, plan, start, **states):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = plan.device(self.rank)
        self.upcast = not plan.autocast
        self.start, self.stop = start, plan.stop
        if self.stop is None:
            raise RuntimeError(
                "no stop signal in this rank's plan: run() must be started "
                "by gbrun.launch (launch_ranks, or the distributed trainer)")
        self.checkpoints = CheckpointManager(
            states, RunState(start.seed, start.epochs, start.key),
            start.checkpoint, start.checkpoint_dir)
        self.states = self.checkpoints.states
        run = self.checkpoints.run
        self.start_epoch, self.start_step = run.epoch, run.step
        self.batches = None  # the epoch being trained
        self.saved = False  # whether save_epoch saved it
        self.optimizer_steps = OptimizerSteps(self.states)
        # A run that only predicts said so where it started (gbrun.checkpoint).
        if start.checkpoint is not None and start.trains and self.rank == 0:
            say_resumed(start, self.start_epoch, self.start_step)

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
        partial = self.checkpoints.run.partial
        for epoch in range(self.start_epoch, self.start.epochs):
            resumed = epoch == self.start_epoch and self.start_step
            loss, count = 0.0, 0
            if resumed:
                loss, count = partial[self.rank]
            self.batches = EpochBatches(
                self, train_loader, epoch,
                self.start_step if resumed else 0,
                torch.tensor(loss, device=self.device), count,
            )
            self.saved = False
            yield epoch, self.batches
            self._end_epoch(epoch)

    def _end_epoch(self, epoch):
        self.batches.check_trained()
        if self.rank == 0:
            if not self.saved:
                raise RuntimeError(
                    f"train() ended epoch {epoch} without "
                    "progress.save_epoch(record) on rank 0: it saves the "
                    "epoch's checkpoint, which --resume continues from")
            self.checkpoints.check_unchanged(epoch)
        if self.start.checkpoint_dir:
            agree_saved(None, self.device)
        if self.stop.agreed_now() and epoch + 1 < self.start.epochs:
            if self.rank == 0:
                stopping.report_stop(self.start.checkpoint_dir,
                                     self.stop.signum, epoch + 1, 0)
            barrier(self.device)
            raise stopping.Stopped(self.stop.signum)

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
        self.optimizer_steps.check_none_pending(
            "progress.save_epoch(record)", batches)
        if self.rank != 0:
            return
        if self.start.checkpoint_dir:
            try:
                self.checkpoints.save(batches.epoch + 1)
            except UsageError as error:
                # A full disk: rank 0 meets the others at the barrier that
                # waits for the checkpoint (_end_epoch) now, so that no
                # epoch line is printed, and every rank ends.
                agree_saved(f"{error}: --resume continues from it",
                            self.device)
        # What a later step of the schedule or edit of `kept` would change.
        self.checkpoints.remember()
        self.saved = True
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
        gathered = every_ranks_sums(batches, self.device, self.world_size)
        error = None
        if self.rank == 0:
            try:
                if self.start.checkpoint_dir:
                    partial = [[loss, int(count)] for loss, count in
                               (g.tolist() for g in gathered)]
                    self.checkpoints.save(batches.epoch, batches.step,
                                          partial)
                stopping.report_stop(self.start.checkpoint_dir,
                                     self.stop.signum, batches.epoch,
                                     batches.step)
            except UsageError as failed:  # a full disk: every rank ends
                error = f"{failed}: --resume continues from it"
        agree_saved(error, self.device)
        raise stopping.Stopped(self.stop.signum)

    @property
    def kept(self):
        """Your own values to keep across a resume (see Progress)."""
        return self.checkpoints.run.kept

    @kept.setter
    def kept(self, values):
        self.checkpoints.run.kept = values


def agree_saved(error, device):
    """Every rank, once rank 0 has tried to save a checkpoint (`error`: why
    it could not, on rank 0): the barrier that waits for it, which also
    tells every rank whether it failed. Then every rank ends with that one
    line (UsageError: rank 0 says it, exit status 2), instead of a
    traceback on rank 0 and the others' on the lost connection."""
    failed = torch.tensor([int(error is not None)], device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if int(failed.item()):
        raise UsageError(error or "rank 0 could not save the checkpoint")


def every_ranks_sums(batches, device, world_size):
    """Each rank's [loss sum, item count] of its `batches` so far, as a
    tensor on `device`, gathered on every rank."""
    batches.check_added()
    # On the rank's device: NCCL gathers only tensors on the input's GPU.
    sums = torch.stack([
        batches.loss_sum.detach().to(torch.float64),
        torch.tensor(batches.num_items, dtype=torch.float64, device=device),
    ])
    gathered = [torch.zeros_like(sums) for _ in range(world_size)]
    dist.all_gather(gathered, sums)
    return gathered


class OptimizerSteps:
    """A rank's optimizer steps, counted: a stop waits for a step that ended
    with one, so that a checkpoint never falls inside a gradient
    accumulation; and where a checkpoint is taken, none may be pending."""

    def __init__(self, states):
        self.states = states
        self.optimizers = [obj for obj in states.values()
                           if isinstance(obj, torch.optim.Optimizer)]
        self.count = 0
        for optimizer in self.optimizers:
            optimizer.register_step_post_hook(self._counted)

    def _counted(self, optimizer, args, kwargs):
        self.count += 1

    def check_none_pending(self, where, batches):
        """A checkpoint saves no gradients: refuses one taken (`where`) while
        a model holds gradients that no optimizer step has applied yet."""
        if not self.optimizers or batches.stepped_last:
            return
        for name, obj in self.states.items():
            if isinstance(obj, torch.nn.Module) and any(
                    p.grad is not None and bool(p.grad.any())
                    for p in obj.parameters()):
                raise RuntimeError(
                    f"{where} in epoch {batches.epoch}: the {name} "
                    "holds gradients accumulated since the last "
                    "optimizer.step(), which a checkpoint does not keep; "
                    "call optimizer.zero_grad() after the epoch's batches "
                    "(docs/customising.md, gradient accumulation)")


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
        counted, stop = self.progress.optimizer_steps, self.progress.stop
        self.optimizer_steps = counted.count
        for data in steps:
            yield data
            # The step is done: every rank agrees whether to stop here, and
            # stops once a step ends with an optimizer step (at once,
            # unless gradients are being accumulated).
            self.check_added()
            Join.notify_join_context(self)
            self.stepped_last = (not counted.optimizers
                                 or counted.count != self.optimizer_steps)
            self.optimizer_steps = counted.count
            if stop.agreed() and self.stepped_last:
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
