"""Where a run starts, the trained model's files, and the resume key's
parts the example asks for.

start_or_resume decides, once and before any rank trains, where a run
starts (a Start): from scratch, or from a checkpoint it checks against the
example's resume key and this launch (the checkpoint file itself, its
contents, checks and restore, are gbrun.run_state's). The example builds
its resume key with described(model) and hyperparameters(optimizer or
scheduler). gbrun.progress.Progress writes model.pt at the end
(save_model), with model.json beside it (what the model was made with: its
resume key, which load_model checks).
"""
import fcntl
import inspect
import json
import os
import socket
from dataclasses import dataclass

import torch

from . import outputs
from .cli import UsageError
from .outputs import save_atomically
from .records import METRICS_FILE
from .run_state import (
    CHECKPOINT_FILE, DATASET_KEY, TRAINING_KEYS, RunState, check_key,
    check_resume, cpu_state, dataset_content, dataset_named, predicts_only,
    read_checkpoint,
)
from .trees import difference, plain

MODEL_FILE = "model.pt"
MODEL_CONFIG_FILE = "model.json"
LOCK_FILE = "lock"


@dataclass
class Start:
    """Where a run starts and what it writes: the checkpoint to resume (None:
    from scratch), the seed (--seed, or the checkpoint's), the epochs to
    train, --max-batches, the output directories (None where not asked
    for), and the resume key every checkpoint of the run carries."""

    checkpoint: dict
    seed: int
    epochs: int
    max_batches: int
    checkpoint_dir: str
    log_dir: str
    key: dict
    # The checkpoint directory's lock (a DirectoryLock), held by the process
    # that made the Start for as long as it keeps it: not handed to ranks.
    lock: object = None

    def __getstate__(self):
        return dict(self.__dict__, lock=None)

    @property
    def trains(self):
        """False for a run that only predicts (--resume --predict of a
        finished run): it skips what only training needs."""
        return (self.checkpoint is None
                or RunState.saved(self.checkpoint).epoch < self.epochs)


class DirectoryLock:
    """An exclusive advisory lock (flock) on `directory`'s LOCK_FILE, for as
    long as this object lives: one job per checkpoint directory. The kernel
    releases it when its holder dies, so a crash never leaves it stale. A
    directory another process holds is refused in one line naming it."""

    def __init__(self, directory):
        path = os.path.join(directory, LOCK_FILE)
        self.descriptor = None  # (for close, where the open is refused)
        self.descriptor = outputs.open_own(path, os.O_RDWR,
                                           "--checkpoint-dir's lock file")
        try:
            fcntl.flock(self.descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(self.descriptor, 1000).decode(errors="replace")
            self.close()
            raise UsageError(
                f"--checkpoint-dir {directory} is in use by another job "
                f"({holder.strip() or 'its holder is unnamed'}): wait for it "
                "to end, or use another directory") from None
        os.ftruncate(self.descriptor, 0)
        os.write(self.descriptor, f"pid {os.getpid()} on "
                 f"{socket.gethostname()}".encode())

    def close(self):
        if self.descriptor is not None:
            os.close(self.descriptor)  # releases the lock
            self.descriptor = None

    __del__ = close


def start_or_resume(args, key, plan, epochs, lock=None):
    """Where the run starts (a Start). Creates --checkpoint-dir and
    --log-dir; with --resume, loads the checkpoint and refuses, in one line,
    one that this run cannot continue: made with another `key` (the
    example's resume key, plus the dropout `plan` runs), another number of
    ranks inside an epoch, another seed, or already at `epochs`. With
    --predict, a checkpoint at the end of its run (or at `epochs`) only
    predicts: nothing trains, whatever `epochs`, and the parts of the key
    that only training reads (TRAINING_KEYS) are not compared; it may
    predict on another dataset, said in one line. Takes the checkpoint
    directory's lock (DirectoryLock) where `lock`, by default in the
    process of global rank 0 (the launcher, where it started the ranks),
    which writes
    the checkpoints."""
    key = dict(key, dropout="fused" if plan.fused_dropout else "torch")
    predict = getattr(args, "predict", None)
    for option, directory in (("--checkpoint-dir", args.checkpoint_dir),
                              ("--log-dir", args.log_dir),
                              ("--predict", predict and os.path.dirname(
                                  os.path.abspath(predict)))):
        if directory:
            writable_directory(option, directory)
    if predict:
        outputs.check_replaceable(predict, "--predict")
    if args.log_dir:  # checked before training, not at the first epoch's end
        os.close(outputs.open_own(os.path.join(args.log_dir, METRICS_FILE),
                                  os.O_WRONLY | os.O_APPEND, "--log-dir's"))
    if lock is None:
        lock = plan.rank_offset == 0
    held = DirectoryLock(args.checkpoint_dir) if (
        lock and args.checkpoint_dir) else None
    checkpoint, seed = None, args.seed
    if args.resume:
        try:
            checkpoint, epochs = resumed(args, key, plan.world_size, epochs,
                                         speak=lock)
        except BaseException:
            if held:  # a refusal leaves the directory free at once
                held.close()
            raise
        # Without --seed the run continues the checkpoint's sequence.
        seed = RunState.saved(checkpoint).seed if args.seed is None else (
            args.seed)
    return Start(checkpoint, seed, epochs, args.max_batches,
                 args.checkpoint_dir, args.log_dir, key, held)


def resumed(args, key, world_size, epochs, speak=True):
    """(the checkpoint --resume continues, the epochs the run trains to):
    checked against `key` (load_checkpoint, check_resume) where the run
    trains; where it only predicts (predicts_only), against the key but
    TRAINING_KEYS, said in one line naming the dataset the model was
    trained on (where `speak`: by one process of the job), and the run's
    epochs are the checkpoint's."""
    path = os.path.join(args.checkpoint_dir, CHECKPOINT_FILE)
    checkpoint = read_checkpoint(path)
    if not predicts_only(checkpoint, args, epochs):
        check_key(checkpoint, key, path)
        check_resume(checkpoint, args, world_size, epochs)
        return checkpoint, epochs
    check_key(checkpoint, key, path, ignore=TRAINING_KEYS + (DATASET_KEY,))
    saved = RunState.saved(checkpoint)
    then = saved.key.get(DATASET_KEY)
    now = key.get(DATASET_KEY)
    trained = (f"the model of {args.checkpoint_dir}, trained "
               f"{saved.epoch} epochs on {dataset_named(then)}")
    said = f"Predicting with {trained}; nothing trains."
    if dataset_content(then) != dataset_content(now):
        said = (f"Predicting on another dataset, {dataset_named(now)} "
                f"({difference(dataset_content(then), dataset_content(now))})"
                f", with {trained}; nothing trains.")
    if speak:
        print(said, flush=True)
    return checkpoint, saved.epoch


def writable_directory(option, directory):
    """Makes `directory` where missing; refuses, in one line naming
    `option`, one that cannot be made or written, before any rank trains
    (not when the first epoch would save)."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as error:
        raise UsageError(f"{option}: cannot make {directory} "
                         f"({error.strerror})") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise UsageError(f"{option}: {directory} is not writable")


def load_checkpoint(directory, config, ignore=()):
    """The checkpoint in `directory`, once read (read_checkpoint) and
    checked against the resume key `config` but the parts in `ignore`
    (check_key)."""
    path = os.path.join(directory, CHECKPOINT_FILE)
    checkpoint = read_checkpoint(path)
    check_key(checkpoint, config, path, ignore)
    return checkpoint


def hyperparameters(obj):
    """An optimizer's or LR scheduler's class and hyperparameters as plain
    data, for the resume key (None for None): each of an optimizer's
    param_groups without its parameters, with the learning rate that was set
    (a scheduler's initial_lr, where it has scaled lr: a warmup from 0 would
    otherwise hide --lr); a scheduler's constructor arguments that it keeps
    under the same name (those that are plain data; a function, as LambdaLR
    takes, cannot be compared) and, where it starts from other rates than
    those set, the rates it starts from (so a change of such a schedule is
    named as the scheduler's)."""
    if obj is None:
        return None
    described = {"class": type(obj).__name__}
    if isinstance(obj, torch.optim.Optimizer):
        described["param_groups"] = [
            {k: plain(group.get("initial_lr", v) if k == "lr" else v)
             for k, v in group.items() if k in obj.defaults}
            for group in obj.param_groups
        ]
        return described
    skip = {"self", "optimizer", "last_epoch", "verbose"}
    for name in inspect.signature(type(obj).__init__).parameters:
        value = plain(getattr(obj, name, None))
        if name not in skip and value is not None:
            described[name] = value
    groups = getattr(getattr(obj, "optimizer", None), "param_groups", [])
    start_lrs = [group["lr"] for group in groups]
    if start_lrs != [group.get("initial_lr", group["lr"]) for group in groups]:
        described["start_lrs"] = start_lrs
    return described


def save_model(model, directory, key):
    """The trained `model`'s state_dict as model.pt in `directory`, and, as
    model.json, what rebuilds and checks it: the model's class and sizes
    (its repr) and parameter shapes, and the run's resume `key` (dataset,
    features, labels, ...)."""
    save_atomically(cpu_state(model), os.path.join(directory, MODEL_FILE))
    config = {"model": described(model), "key": key}
    save_atomically(config, os.path.join(directory, MODEL_CONFIG_FILE),
                    save=lambda config, f: f.write(
                        json.dumps(config, indent=1).encode()))


def described(model):
    """A model's class and sizes (its repr) and parameter shapes."""
    return {"repr": repr(model),
            "shapes": {k: list(v.shape) for k, v in model.state_dict().items()}}


def load_model(model, directory):
    """`model` (built as the example builds it) with the weights of
    `directory`'s model.pt, once model.json says they were trained by such
    a model (the same class, sizes and parameter shapes); otherwise one line
    (UsageError). Returns the run's resume key from model.json (what else
    the model was trained with: dataset, features, labels)."""
    path = os.path.join(directory, MODEL_CONFIG_FILE)
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as error:
        raise UsageError(f"{path}: cannot be read ({error}); --checkpoint-dir "
                         "writes it beside model.pt") from None
    if config.get("model") != described(model):
        raise UsageError(
            f"{os.path.join(directory, MODEL_FILE)} was trained by another "
            f"model ({difference(config.get('model'), described(model))})")
    model.load_state_dict(torch.load(os.path.join(directory, MODEL_FILE),
                                     map_location="cpu", weights_only=True))
    return config["key"]
