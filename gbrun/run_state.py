"""A run's state, in one room: what checkpoint.pt holds, how it is read and
checked, saved and restored (torchtitan's components/checkpoint.py).

The file holds the state_dict() of each object the example hands
gbrun.progress.Progress (model, optimizer, scheduler: under the names it
hands them by), then the RunState's entries (where the run is, and what
--resume compares), at the top level as checkpoints always had them:

    {"model": ..., "optimizer": ..., ["scheduler": ...,]
     "epoch", "step", "partial", "seed", "epochs", "config", "kept"}

RunState.state_dict and RunState.saved are the only places that name the
RunState's entries. A CheckpointManager, made by Progress in every rank,
is handed both (the example's objects and a RunState), restores them from
the checkpoint being resumed, saves them (rank 0) and says whether one
changed since. Before any rank starts, gbrun.checkpoint.start_or_resume
reads the file (read_checkpoint) and checks it against the run
(check_key, check_resume, predicts_only). Checkpoints hold tensors and
plain data only, and load with weights_only=True.
"""
import copy
import os
import pickle
import zipfile
from dataclasses import dataclass, field

import torch
from torch.nn.parallel import DistributedDataParallel

from .cli import UsageError
from .outputs import save_atomically
from .trees import check_plain, cpu_values, difference, same

CHECKPOINT_FILE = "checkpoint.pt"
# What a file must hold to be a checkpoint (an older one may lack the rest).
REQUIRED = {"model", "optimizer", "epoch", "seed", "config"}
# The part of a resume key that says how an epoch is cut into steps (the
# batch size): compared only for a checkpoint saved inside an epoch, whose
# resume skips the steps it trained.
STEPS_KEY = "steps"
# The part that names the dataset (gbrun.data.datasets.dataset_identity):
# compared by content, and named by the path it was read from.
DATASET_KEY = "dataset"
# The parts that only training reads (the optimizer and its schedule, how
# batches are sampled and cut, the dropout that runs): a run that trains
# nothing (--resume --predict of a finished run) does not compare them.
TRAINING_KEYS = ("optimizer", "scheduler", "fanout", STEPS_KEY, "negatives",
                 "loss", "dropout")


@dataclass
class RunState:
    """Where a run is, and what it is (torchtitan's TrainState): the next
    epoch to train, the steps of it trained (a stop inside it) and each
    rank's [loss sum, item count] over them (`partial`), the seed, the
    epochs the run trains to (a checkpoint at them is finished: --resume
    --predict of it only predicts), the resume key (`key`: what --resume
    compares) and the example's own values (`kept`, progress.kept)."""

    seed: int
    epochs: int
    key: dict
    epoch: int = 0
    step: int = 0
    partial: list = None
    kept: dict = field(default_factory=dict)

    def state_dict(self):
        check_plain(self.kept, "progress.kept")
        return {"epoch": self.epoch, "step": self.step,
                "partial": self.partial, "seed": self.seed,
                "epochs": self.epochs, "config": self.key,
                "kept": cpu_values(self.kept)}

    def load_state_dict(self, state):
        """Where the saved run was, and its kept values (a copy). The seed,
        epochs and key stay this run's: start_or_resume checked the saved
        ones against them."""
        saved = RunState.saved(state)
        self.epoch, self.step, self.partial = (saved.epoch, saved.step,
                                               saved.partial)
        self.kept = copy.deepcopy(saved.kept)

    @classmethod
    def saved(cls, checkpoint):
        """The RunState that `checkpoint` (a file's contents) holds, as
        saved; entries an older checkpoint lacks as none."""
        return cls(seed=checkpoint.get("seed"),
                   epochs=checkpoint.get("epochs"),
                   key=checkpoint.get("config"), epoch=checkpoint["epoch"],
                   step=checkpoint.get("step") or 0,
                   partial=checkpoint.get("partial"),
                   kept=checkpoint.get("kept") or {})


class CheckpointManager:
    """One rank's checkpoint: handed the example's `states` (name: an
    object with state_dict() and load_state_dict(), such as the model,
    with or without DDP, the optimizer and an LR scheduler; None is
    skipped) and the `run` (a RunState), it restores them from `checkpoint`
    (None: a run from scratch), saves them in `directory` (a run with a
    --checkpoint-dir, on rank 0) and refuses a change of them after the
    epoch's checkpoint."""

    def __init__(self, states, run, checkpoint, directory):
        self.states = {name: unwrapped(obj) for name, obj in states.items()
                       if obj is not None}
        self.run, self.directory = run, directory
        self.remembered = None
        if checkpoint is not None:
            restore(self.states, checkpoint, directory)
            run.load_state_dict(checkpoint)

    def save(self, epoch, step=0, partial=None):
        """Writes the checkpoint of the run at `epoch` after `step` steps of
        it (each rank's loss sum and item count over them: `partial`, for
        the epoch's average)."""
        self.run.epoch, self.run.step, self.run.partial = epoch, step, partial
        checkpoint = {name: cpu_state(obj)
                      for name, obj in self.states.items()}
        checkpoint.update(self.run.state_dict())
        save_atomically(checkpoint, os.path.join(self.directory,
                                                 CHECKPOINT_FILE))

    def remember(self):
        """Notes what a step of the schedule or an edit of the kept values
        would change (check_unchanged compares with it)."""
        self.remembered = dict(self._settings(),
                               kept=cpu_values(copy.deepcopy(self.run.kept)))

    def check_unchanged(self, epoch):
        """Refuses a state (or the kept values) changed since remember(), at
        progress.save_epoch(record) in `epoch`: its checkpoint would resume
        another run."""
        now = dict(self._settings(), kept=cpu_values(self.run.kept))
        # A scheduler first: its step changes the optimizer's rate too.
        optimizers_last = sorted(self.states, key=lambda name: isinstance(
            self.states[name], torch.optim.Optimizer))
        for name in optimizers_last:
            if not same(now[name], self.remembered[name]):
                raise RuntimeError(
                    f"the {name} changed after progress.save_epoch(record) "
                    f"in epoch {epoch} ({type(self.states[name]).__name__}"
                    ".step() after it?): its checkpoint would resume another "
                    "run; save after the epoch's last change")
        if not same(now["kept"], self.remembered["kept"]):
            raise RuntimeError(
                f"progress.kept changed after progress.save_epoch(record) in "
                f"epoch {epoch}: its checkpoint would lose that change; save "
                "after it")

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


def restore(states, checkpoint, checkpoint_dir):
    """Loads each of `states` (name: object) from `checkpoint`, exactly as
    saved; returns a copy of the checkpoint's kept values ({} if none)."""
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
    return copy.deepcopy(RunState.saved(checkpoint).kept)


def unwrapped(obj):
    """The module inside DDP, or obj: a checkpoint holds the model's own
    state_dict (no `module.` prefixes) whichever is handed over."""
    return obj.module if isinstance(obj, DistributedDataParallel) else obj


def cpu_state(obj):
    """obj.state_dict() with every tensor on the CPU, so that files saved by
    GPU ranks load on any machine."""
    return cpu_values(obj.state_dict())


def read_checkpoint(path):
    """The checkpoint at `path`, loaded as tensors and plain data only;
    one that is missing, unreadable or not a checkpoint refused in one
    line."""
    if not os.path.isfile(path):
        raise UsageError(f"--resume: there is no checkpoint '{path}'")
    if not zipfile.is_zipfile(path):
        # torch.save writes a zip archive: anything else is no checkpoint.
        raise UsageError(unreadable(path, ValueError(
            "not a zip archive, as torch.save writes")))
    try:
        # Tensors and plain containers only: nothing in the file can run.
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        missing = REQUIRED - set(checkpoint)
        if missing:
            raise KeyError(f"no {', '.join(sorted(missing))}")
    except pickle.UnpicklingError as error:
        if "Weights only load failed" not in str(error):
            raise UsageError(unreadable(path, error)) from None
        raise UsageError(
            f"checkpoint '{path}' holds objects other than tensors and plain "
            "data, which could run code when loaded; refused, nothing in it ran"
        ) from None
    except Exception as error:
        raise UsageError(unreadable(path, error)) from None
    return checkpoint


def unreadable(path, error):
    reason = (str(error).splitlines() or [""])[0]
    return (
        f"checkpoint '{path}' is unreadable, truncated or corrupted "
        f"({type(error).__name__}: {reason})"
    )


def check_key(checkpoint, config, path, ignore=()):
    """Refuses, in one line, a checkpoint (read from `path`) whose resume
    key differs from `config` in a part not in `ignore`: the dataset by
    content (named by both paths), the steps only inside an epoch."""
    saved_run = RunState.saved(checkpoint)
    for key, value in config.items():
        saved = saved_run.key.get(key)
        if key in ignore or saved == value:
            continue
        if key == DATASET_KEY:
            if dataset_content(saved) == dataset_content(value):
                continue  # the same bytes, elsewhere
            raise UsageError(
                f"checkpoint '{path}' was made with another dataset, "
                f"{dataset_named(saved)}, not this run's "
                f"{dataset_named(value)} "
                f"({difference(dataset_content(saved), dataset_content(value))})"
                "; refused: a run trains on its own dataset only (a finished "
                "run's checkpoint predicts on another: --resume --predict)")
        if key == STEPS_KEY:
            if not saved_run.step:
                continue  # a new epoch may be cut into steps anew
            raise UsageError(
                f"checkpoint '{path}' stopped inside epoch "
                f"{saved_run.epoch} after step {saved_run.step}, "
                f"which this run would cut into other steps "
                f"({difference(saved, value)}); resume with the same, or "
                "resume a checkpoint saved at an epoch's end"
            )
        raise UsageError(
            f"checkpoint '{path}' was made with another {key} "
            f"({difference(saved, value)}); refused"
        )


def check_resume(checkpoint, args, world_size, epochs):
    """Refuses, in one line, a checkpoint this run cannot continue: one
    stopped inside an epoch with another number of ranks, made with
    another --seed, or already at `epochs` (unless the run predicts)."""
    saved = RunState.saved(checkpoint)
    if saved.step and len(saved.partial or []) != world_size:
        raise UsageError(
            f"checkpoint stopped inside epoch {saved.epoch} with "
            f"{len(saved.partial or [])} ranks; resume it with as many, not "
            f"{world_size}"
        )
    if args.seed is not None and args.seed != saved.seed:
        raise UsageError(
            f"--seed {args.seed}: the checkpoint was made with --seed "
            f"{saved.seed}"
        )
    if saved.epoch >= epochs and not getattr(args, "predict", None):
        # The example names its epoch count's option; gbrun does not.
        raise UsageError(
            f"{epochs} epochs to train: the checkpoint has already trained "
            f"{saved.epoch} epochs; ask for more epochs, or add "
            "--predict FILE to predict with it"
        )


def predicts_only(checkpoint, args, epochs):
    """True for --resume --predict of a checkpoint with nothing left to
    train: saved at the end of the epochs its run was asked for (so
    --epochs need not repeat them), or at `epochs`."""
    if not getattr(args, "predict", None):
        return False
    saved = RunState.saved(checkpoint)
    asked = epochs if saved.epochs is None else saved.epochs
    finished = not saved.step and saved.epoch >= asked
    return finished or saved.epoch >= epochs


def dataset_content(identity):
    """What a resume key's dataset is compared by: its files' sizes and
    digests (gbrun.data.datasets.dataset_identity), or the whole identity
    of a checkpoint that predates its path."""
    if isinstance(identity, dict) and "files" in identity:
        return identity["files"]
    return identity


def dataset_named(identity):
    """The dataset of a resume key as a user names it: the path it was
    read from (or a builtin's name)."""
    if isinstance(identity, dict) and "path" in identity:
        return repr(identity["path"])
    return "a dataset whose path was not recorded"
