"""Checkpoints, resume and run outputs.

A Job is what the parent loads once for every rank; a RunState is one rank's
view of the run: where training starts (epoch, step, loss sums so far), the
states it restores and saves (model, optimizer, scheduler: whatever
state_dicts it is given), and the files: checkpoint.pt after every epoch and
when stopped, model.pt at the end, metrics.jsonl. Checkpoints hold tensors
and plain data only, and load with weights_only=True.
"""
import copy
import inspect
import json
import os
import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .cli import UsageError
from .batches import Batches
from .launch import barrier
from .stop import report_stop

CHECKPOINT_FILE = "checkpoint.pt"
MODEL_FILE = "model.pt"
METRICS_FILE = "metrics.jsonl"
REQUIRED = {"model", "optimizer", "epoch", "seed", "config"}


@dataclass
class Job:
    """What every rank needs, loaded once: the dataset and its item sets
    (train, validation, test), the sizes the model is built with, the fanout,
    what a checkpoint must agree on (`config`), the checkpoint to resume (or
    None) and the seed (--seed, or the checkpoint's)."""

    dataset: object
    item_sets: tuple
    in_size: int
    num_classes: int
    fanout: list
    config: dict
    checkpoint: dict
    seed: int


def open_checkpoint(args, config, world_size):
    """Creates the output directories; with --resume, loads the checkpoint
    and refuses one that this run cannot continue: made with another
    `config` (the example's resume key), another number of ranks inside an
    epoch, another seed, or already at --epochs. Returns (checkpoint or
    None, seed)."""
    for directory in (args.checkpoint_dir, args.log_dir):
        if directory:
            os.makedirs(directory, exist_ok=True)
    if not args.resume:
        return None, args.seed
    checkpoint = load_checkpoint(args.checkpoint_dir, config)
    check_resume(checkpoint, args, world_size)
    # Without --seed the run continues the checkpoint's sequence.
    seed = checkpoint["seed"] if args.seed is None else args.seed
    return checkpoint, seed


def load_checkpoint(directory, config):
    path = os.path.join(directory, CHECKPOINT_FILE)
    if not os.path.isfile(path):
        raise UsageError(f"--resume: there is no checkpoint '{path}'")
    try:
        # Tensors and plain containers only: nothing in the file can run.
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        missing = REQUIRED - set(checkpoint)
        if missing:
            raise KeyError(f"no {', '.join(sorted(missing))}")
        saved_config = checkpoint["config"]
    except pickle.UnpicklingError as error:
        if "Weights only load failed" not in str(error):
            raise UsageError(unreadable(path, error)) from None
        raise UsageError(
            f"checkpoint '{path}' holds objects other than tensors and plain "
            "data, which could run code when loaded; refused, nothing in it ran"
        ) from None
    except Exception as error:
        raise UsageError(unreadable(path, error)) from None
    for key, value in config.items():
        saved = saved_config.get(key)
        if saved != value:
            raise UsageError(
                f"checkpoint '{path}' was made with another {key} "
                f"({difference(saved, value)}); refused"
            )
    return checkpoint


def difference(saved, value, where=""):
    """The first place where two configurations differ, on one line."""
    if isinstance(saved, dict) and isinstance(value, dict):
        for key in list(value) + [k for k in saved if k not in value]:
            if saved.get(key) != value.get(key):
                return difference(saved.get(key), value.get(key),
                                  f"{where}.{key}" if where else key)
    if (isinstance(saved, list) and isinstance(value, list)
            and len(saved) == len(value)
            and all(isinstance(v, dict) for v in saved + value)):
        # An optimizer's param_groups: the first group that differs.
        for i, (then, now) in enumerate(zip(saved, value)):
            if then != now:
                return difference(then, now, f"{where}[{i}]")
    if isinstance(saved, str) and isinstance(value, str):
        # A model's repr: the first line that differs.
        for then, now in zip(saved.splitlines(), value.splitlines()):
            if then != now:
                saved, value = then.strip(), now.strip()
                break
    text = f"{where}: " * bool(where) + f"{saved!r} then, {value!r} now"
    return text if len(text) <= 160 else text[:157] + "..."


def settings(obj):
    """An optimizer's or LR scheduler's class and hyperparameters as plain
    data, for the resume key (None for None): each of an optimizer's
    param_groups without its parameters (and without what a scheduler adds
    to it, such as initial_lr); a scheduler's constructor arguments that it
    keeps under the same name (those that are plain data; a function, as
    LambdaLR takes, cannot be compared)."""
    if obj is None:
        return None
    described = {"class": type(obj).__name__}
    if isinstance(obj, torch.optim.Optimizer):
        described["param_groups"] = [
            {k: plain(v) for k, v in group.items() if k in obj.defaults}
            for group in obj.param_groups
        ]
        return described
    skip = {"self", "optimizer", "last_epoch", "verbose"}
    for name in inspect.signature(type(obj).__init__).parameters:
        value = plain(getattr(obj, name, None))
        if name not in skip and value is not None:
            described[name] = value
    return described


def plain(value):
    """`value` as numbers, strings, lists and dicts (tensors as lists), or
    None where it is something else."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return None


def unreadable(path, error):
    reason = (str(error).splitlines() or [""])[0]
    return (
        f"checkpoint '{path}' is unreadable, truncated or corrupted "
        f"({type(error).__name__}: {reason})"
    )


def check_resume(checkpoint, args, world_size):
    partial = checkpoint.get("partial")
    if checkpoint.get("step") and len(partial or []) != world_size:
        raise UsageError(
            f"checkpoint stopped inside epoch {checkpoint['epoch']} with "
            f"{len(partial or [])} ranks; resume it with as many, not "
            f"{world_size}"
        )
    if args.seed is not None and args.seed != checkpoint["seed"]:
        raise UsageError(
            f"--seed {args.seed}: the checkpoint was made with --seed "
            f"{checkpoint['seed']}"
        )
    if checkpoint["epoch"] >= args.epochs:
        raise UsageError(
            f"--epochs {args.epochs}: the checkpoint has already trained "
            f"{checkpoint['epoch']} epochs; pass a larger --epochs"
        )


class RunState:
    """One rank's run: where it starts, what it restores and saves.

    `states` maps names to objects with state_dict()/load_state_dict() (the
    model without DDP, the optimizer, an LR scheduler or None). They are
    restored here from the checkpoint being resumed, exactly as saved, and
    saved by rank 0 after every epoch and when a signal stops training.
    Randomness derives from (seed, rank, epoch, step), so the seed and the
    position are all the random state a resumed run needs. `kept` is the
    example's own dict of values to keep across a resume (tensors and plain
    data): rank 0's is saved, and every rank gets it back."""

    def __init__(self, rank, args, job, stop, device, autocast, states,
                 batches=Batches):
        self.rank, self.args, self.job = rank, args, job
        self.make_batches = batches  # Batches, or DistBatches on a DistGraph
        self.stop, self.device, self.autocast = stop, device, autocast
        self.states = {k: v for k, v in states.items() if v is not None}
        checkpoint = job.checkpoint or {}
        self.start_epoch = checkpoint.get("epoch", 0)
        self.start_step = checkpoint.get("step", 0)
        self.kept = copy.deepcopy(checkpoint.get("kept") or {})
        if job.checkpoint is not None:
            self._restore(job.checkpoint)
            if rank == 0:
                at = f"epoch {self.start_epoch}" + (
                    f", step {self.start_step}" if self.start_step else "")
                print(f"Resuming from {args.checkpoint_dir} at {at}.")

    def _restore(self, checkpoint):
        for name, obj in self.states.items():
            if checkpoint.get(name) is None:
                raise UsageError(
                    f"checkpoint in '{self.args.checkpoint_dir}' has no "
                    f"{name} state; this run has one"
                )
            # A copy: the checkpoint reached this rank through shared memory,
            # and load_state_dict keeps CPU tensors as they are, so otherwise
            # every rank would step the same optimizer state.
            obj.load_state_dict(copy.deepcopy(checkpoint[name]))

    def epochs(self):
        return range(self.start_epoch, self.args.epochs)

    def batches(self, dataloader, name, epoch=None):
        """The batches of one pass: a training epoch (`epoch` given; it
        skips the steps a stopped run already trained) or an evaluation."""
        skip = self.start_step if epoch == self.start_epoch else 0
        return self.make_batches(
            dataloader, self.rank, name, self.job.seed, epoch, skip,
            self.args.max_batches,
        )

    def sums_so_far(self, epoch):
        """(loss sum, item count) where this rank's `epoch` starts: zero, or
        where a run stopped inside it."""
        loss, count = 0.0, 0
        if epoch == self.start_epoch and self.start_step:
            loss, count = self.job.checkpoint["partial"][self.rank]
        return torch.tensor(loss, device=self.device), count

    def save_epoch(self, epoch, record):
        """Rank 0 after each epoch: the checkpoint (the next epoch starts at
        step 0) and the metrics line."""
        if self.args.checkpoint_dir:
            self._save(epoch + 1, step=0, partial=None)
        if self.args.log_dir:
            append_metrics(self.args.log_dir, record)

    def stopped_after(self, epoch):
        """After an epoch's line: nobody goes on until its checkpoint is
        complete, and a signal that came during evaluation stops every rank
        here, at that checkpoint. True if stopped."""
        if self.args.checkpoint_dir:
            barrier(self.device)
        if self.stop.agreed_now() and epoch + 1 < self.args.epochs:
            if self.rank == 0:
                report_stop(self.args.checkpoint_dir, self.stop.signum,
                            epoch + 1, 0)
            barrier(self.device)
            return True
        return False

    def save_stop(self, epoch, step, total_loss, num_items):
        """Every rank, when a signal stopped training inside an epoch: rank 0
        saves where, with every rank's loss sum and item count, and says how
        to go on. Returns the signal."""
        # On the rank's device: NCCL gathers only tensors on the input's GPU.
        sums = torch.stack([
            total_loss.detach().to(torch.float64),
            torch.tensor(num_items, dtype=torch.float64, device=self.device),
        ])
        gathered = [torch.zeros_like(sums) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, sums)
        if self.rank == 0:
            if self.args.checkpoint_dir:
                partial = [[loss, int(count)] for loss, count in
                           (g.tolist() for g in gathered)]
                self._save(epoch, step, partial)
            report_stop(self.args.checkpoint_dir, self.stop.signum, epoch, step)
        barrier(self.device)
        return self.stop.signum

    def save_result(self, record):
        """Rank 0 at the end: the trained model and the test line of the
        metrics."""
        if self.args.checkpoint_dir:
            path = os.path.join(self.args.checkpoint_dir, MODEL_FILE)
            save_atomically(cpu_state(self.states["model"]), path)
        if self.args.log_dir:
            append_metrics(self.args.log_dir, record)

    def _save(self, epoch, step, partial):
        # A stopped run also keeps each rank's loss sum and item count so far
        # (`partial`), for the epoch's average.
        checkpoint = {name: cpu_state(obj) for name, obj in self.states.items()}
        check_plain(self.kept, "state.kept")
        checkpoint.update(
            epoch=epoch, step=step, partial=partial, seed=self.job.seed,
            config=self.job.config, kept=cpu_values(self.kept),
        )
        save_atomically(checkpoint, os.path.join(
            self.args.checkpoint_dir, CHECKPOINT_FILE))


def cpu_state(obj):
    """obj.state_dict() with every tensor on the CPU, so that files saved by
    GPU ranks load on any machine."""
    return cpu_values(obj.state_dict())


def cpu_values(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: cpu_values(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(cpu_values(v) for v in value)
    return value


def check_plain(value, where):
    """Refuses what a checkpoint cannot hold: it loads with
    weights_only=True, so tensors and plain data only."""
    if isinstance(value, dict):
        for key, item in value.items():
            check_plain(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]")
    elif not (value is None or isinstance(value, (bool, int, float, str,
                                                  torch.Tensor))):
        raise TypeError(
            f"{where} is a {type(value).__name__}: a checkpoint holds tensors "
            "and plain data only (numbers, strings, lists, dicts); keep a "
            "model's state_dict(), not the model"
        )


def save_atomically(obj, path):
    """Write, flush to disk, then rename: a crash while saving leaves the
    previous file intact."""
    temporary = f"{path}.tmp{os.getpid()}"
    try:
        with open(temporary, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def append_metrics(directory, record):
    with open(os.path.join(directory, METRICS_FILE), "a") as f:
        f.write(json.dumps(record) + "\n")
