"""Checkpoint files, the resume key, and where a run starts.

start_or_resume decides, once and before any rank trains, where a run
starts (a Start): from scratch, or from a checkpoint it checks against the
example's resume key and this launch. gbrun.progress.Progress saves and
restores the run with the file functions here: checkpoint.pt after every
epoch and when stopped, model.pt at the end, with model.json beside it
(what the model was made with: its resume key, which load_model checks).
Checkpoints hold
tensors and plain data only, and load with weights_only=True.
"""
import errno
import fcntl
import inspect
import json
import os
import socket
import tempfile
import zipfile
import pickle
from dataclasses import dataclass

import torch

from . import outputs
from .records import METRICS_FILE
from .cli import UsageError

CHECKPOINT_FILE = "checkpoint.pt"
MODEL_FILE = "model.pt"
MODEL_CONFIG_FILE = "model.json"
LOCK_FILE = "lock"
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
        return self.checkpoint is None or self.checkpoint["epoch"] < self.epochs


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
    process of global rank 0 (the launcher under mp.spawn), which writes
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
        seed = checkpoint["seed"] if args.seed is None else args.seed
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
    then = checkpoint["config"].get(DATASET_KEY)
    now = key.get(DATASET_KEY)
    trained = (f"the model of {args.checkpoint_dir}, trained "
               f"{checkpoint['epoch']} epochs on {dataset_named(then)}")
    said = f"Predicting with {trained}; nothing trains."
    if dataset_content(then) != dataset_content(now):
        said = (f"Predicting on another dataset, {dataset_named(now)} "
                f"({difference(dataset_content(then), dataset_content(now))})"
                f", with {trained}; nothing trains.")
    if speak:
        print(said, flush=True)
    return checkpoint, checkpoint["epoch"]


def predicts_only(checkpoint, args, epochs):
    """True for --resume --predict of a checkpoint with nothing left to
    train: saved at the end of the epochs its run was asked for (so
    --epochs need not repeat them), or at `epochs`."""
    if not getattr(args, "predict", None):
        return False
    done = checkpoint["epoch"]
    finished = not checkpoint.get("step") and done >= checkpoint.get(
        "epochs", epochs)
    return finished or done >= epochs


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


def check_key(checkpoint, config, path, ignore=()):
    """Refuses, in one line, a checkpoint (read from `path`) whose resume
    key differs from `config` in a part not in `ignore`: the dataset by
    content (named by both paths), the steps only inside an epoch."""
    saved_config = checkpoint["config"]
    for key, value in config.items():
        saved = saved_config.get(key)
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
            if not checkpoint.get("step"):
                continue  # a new epoch may be cut into steps anew
            raise UsageError(
                f"checkpoint '{path}' stopped inside epoch "
                f"{checkpoint['epoch']} after step {checkpoint['step']}, "
                f"which this run would cut into other steps "
                f"({difference(saved, value)}); resume with the same, or "
                "resume a checkpoint saved at an epoch's end"
            )
        raise UsageError(
            f"checkpoint '{path}' was made with another {key} "
            f"({difference(saved, value)}); refused"
        )


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


def check_resume(checkpoint, args, world_size, epochs):
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
    if checkpoint["epoch"] >= epochs and not getattr(args, "predict", None):
        # The example names its epoch count's option; gbrun does not.
        raise UsageError(
            f"{epochs} epochs to train: the checkpoint has already trained "
            f"{checkpoint['epoch']} epochs; ask for more epochs, or add "
            "--predict FILE to predict with it"
        )


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


def save_atomically(obj, path, save=None):
    """Write with `save(obj, file)` (torch.save by default), flush to disk,
    then rename: a crash while saving leaves the previous file intact."""
    # A new file of a name nobody could plant a symlink at beforehand, in
    # the directory as `path` names it: resolved from the working directory
    # as the rename's target is (on a simulated machine, /tmp may be
    # another mount than the one the working directory lies on).
    parent = os.path.dirname(path) or os.curdir
    descriptor, temporary = tempfile.mkstemp(
        dir=parent,
        prefix=f".{os.path.basename(path)}.")
    # mkstemp returns the name made absolute: keep it as `parent` spells it.
    temporary = os.path.join(parent, os.path.basename(temporary))
    os.fchmod(descriptor, 0o666 & ~umask())  # as open() would make it
    try:
        with os.fdopen(descriptor, "wb") as f:
            (save or torch.save)(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except (OSError, RuntimeError) as error:
        full = disk_full(error)
        if full is None:
            raise
        raise UsageError(
            f"could not write {path}: {full.strerror} (about "
            f"{payload_bytes(obj) / 2**20:,.1f} MB to write); the previous "
            f"{os.path.basename(path)} there, if any, is intact") from None
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    directory = os.open(parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def umask():
    """This process's umask, read where reading does not change it (Linux
    shows it in /proc/self/status); Linux's usual 022 otherwise."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def disk_full(error):
    """The OSError of a full disk (or quota) behind `error`, or None: torch's
    zip writer raises a RuntimeError of its own while handling it."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC,
                                                          errno.EDQUOT):
            return error
        error = error.__cause__ or error.__context__
    return None


def payload_bytes(obj):
    """The bytes of the tensors in `obj` (dicts, lists, tensors, arrays):
    about what saving it writes."""
    if isinstance(obj, dict):
        return sum(payload_bytes(value) for value in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(payload_bytes(value) for value in obj)
    return getattr(obj, "nbytes", 0) or (
        obj.numel() * obj.element_size() if isinstance(obj, torch.Tensor)
        else 0)


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
