"""Command-line pieces every script here shares: the one-line refusal of bad
input (exit status 2) and argument types that name the bad value. No torch
import, so that the launcher of simulated machines starts fast."""
import argparse
import os
import re
import sys
import traceback


MODES = ["auto", "cpu-cpu", "cpu-cuda", "pinned-cuda", "cuda-cuda"]


class UsageError(Exception):
    """Bad input: reported as one line, exit status 2, before any spawn."""


# Set (to anything but empty), a one-line error is preceded by the
# traceback it was made from, its hidden cause included.
TRACEBACK_ENV = "GBRUN_TRACEBACK"


def fail(message, speak=True):
    """Bad input, as every script here reports it: one line naming the bad
    value, exit status 2. Processes that found the same bad input as another
    one that reports it (torchrun's ranks) exit without a word. Called while
    an exception is handled, with GBRUN_TRACEBACK set, its traceback (and
    the cause it was raised from, shown or not) comes first."""
    if speak:
        error = sys.exc_info()[1]
        if error is not None and os.environ.get(TRACEBACK_ENV):
            error.__suppress_context__ = False
            traceback.print_exception(error, file=sys.stderr)
        print(f"{os.path.basename(sys.argv[0])}: error: {message}",
              file=sys.stderr)
    sys.exit(2)


def is_first_process(env=os.environ):
    """Under torchrun every rank parses the same arguments: rank 0 speaks.
    On DGL's distributed engine so do graph server 0 and trainer 0: either
    may be the first process a launcher sees end."""
    if env.get("DGL_ROLE") == "server":
        return env.get("DGL_SERVER_ID", "0") == "0"
    return env.get("RANK", "0") == "0"


class ArgumentParser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Values such as --fanout -1,5,5 are values, not options (argparse
        # takes only plain negative numbers for values).
        self._negative_number_matcher = re.compile(r"^-\d+(,-?\d+)*$|^-\d*\.\d+$")

    def error(self, message):
        # One line naming the bad value, instead of usage text plus error.
        fail(message, speak=is_first_process())

    def parse_known_args(self, args=None, namespace=None):
        parsed, rest = super().parse_known_args(args, namespace)
        if getattr(parsed, "resume", False) and not parsed.checkpoint_dir:
            self.error("--resume needs --checkpoint-dir")
        predict = getattr(parsed, "predict", None)
        if predict is not None and not predict.endswith(".npy"):
            self.error(f"--predict {predict}: the file's name ends in .npy")
        return parsed, rest


def add_run_options(parser):
    """Adds the options gbrun reads (and only those: gbrun reads no other
    option of the example's, so the example's own can be renamed freely):
    where training runs and how fast, what a run saves and logs, seeding
    and resuming."""
    run = parser.add_argument_group("running, saving and resuming (gbrun)")
    add_device_options(run)
    add_saving_options(run)
    return parser


def add_device_options(run):
    """Where and how fast ranks train (add_run_options' first part)."""
    run.add_argument(
        "--mode", default="auto", choices=MODES,
        help="Dataset storage placement and train device: 'cpu' for CPU and"
        " RAM, 'pinned' for pinned memory in RAM, 'cuda' for GPU and GPU"
        " memory. 'auto' is pinned-cuda when torch and DGL have CUDA,"
        " otherwise cpu-cpu.",
    )
    run.add_argument(
        "--precision", default="fp32", choices=["fp32", "bf16"],
        help="bf16: node features stored in bfloat16 (half the memory and"
        " the bytes each batch gathers) and the forward pass under autocast"
        " where the device computes bf16; parameters, optimizer, loss and"
        " metrics stay fp32.",
    )
    run.add_argument(
        "--fused-dropout", action=argparse.BooleanOptionalAction, default=True,
        help="On CPU ranks, run the model's nn.Dropout layers as one pass with"
        " a hashed random mask (a C kernel built once with cc);"
        " --no-fused-dropout keeps torch's. A checkpoint resumes only with"
        " the dropout it was made with.",
    )
    run.add_argument(
        "--threads", type=int_at_least(1), default=None,
        help="CPU threads per rank for PyTorch and sampling (default: the"
        " machine's cores divided by the ranks on it).",
    )
    run.add_argument(
        "--gpu-cache-size", type=int_at_least(0), default=0,
        help="The capacity of the GPU feature cache in bytes (pinned-cuda).",
    )
    run.add_argument(
        "--max-batches", type=int_at_least(1), default=None,
        help="Stop every training epoch and every evaluation after this many"
        " batches per rank (quick runs, benchmarks). Default: all.",
    )


def add_saving_options(run):
    """Seeding, what a run saves and logs, resuming, how it ends
    (add_run_options' second part)."""
    run.add_argument(
        "--seed", type=int_at_least(0), default=None,
        help="Seed every random stream on every rank: the same seed repeats"
        " a run (CPU, --num-workers 0). Unseeded by default, as upstream.",
    )
    run.add_argument(
        "--checkpoint-dir", default=None,
        help="Save a checkpoint here after every epoch, and the trained model"
        " as model.pt at the end.",
    )
    run.add_argument(
        "--resume", action="store_true",
        help="Continue from the checkpoint in --checkpoint-dir.",
    )
    run.add_argument(
        "--predict", default=None, metavar="FILE",
        help="After training and the test, write every node's prediction to"
        " FILE (.npy, a row per node in the dataset's node ids), computed"
        " layer by layer over full neighbourhoods. With --resume of a"
        " finished run: only predict (whatever --epochs; on another dataset"
        " too), without repeating the options only training reads.",
    )
    run.add_argument(
        "--predict-fanout", type=fanout_value, default=-1, metavar="N",
        help="Neighbors each node reads in every layer when predicting: -1,"
        " all of them (the file then depends on no sampling), or at most N,"
        " for graphs whose full neighbourhoods do not fit.",
    )
    run.add_argument(
        "--finish-timeout", type=positive_float, default=60.0,
        help="Seconds a rank that has finished waits for the others before"
        " it fails the job: a rank left in a collective that the others"
        " never join (work on some ranks only after training) would wait"
        " for ever.",
    )
    run.add_argument(
        "--log-dir", default=None,
        help="Append one JSON line per epoch and one for the test result to"
        " metrics.jsonl here.",
    )


def int_at_least(minimum):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"'{text}' is not an integer"
            ) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(
                f"{value} is too small (at least {minimum})"
            )
        return value

    return parse


def positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} must be positive")
    return value


def python_file(text):
    """An existing .py file (an example to load), as an absolute path."""
    if not (text.endswith(".py") and os.path.isfile(text)):
        raise argparse.ArgumentTypeError(f"'{text}' is not a Python file")
    return os.path.abspath(text)


# The example this repository ships, beside the package (requirements.txt
# installs gbrun in editable mode): the default --example of every script
# that trains or reads data as the example does.
SHIPPED_EXAMPLE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "node_classification.py")
# What those scripts take from it.
EXAMPLE_NAMES = ("FEATURE_KEYS", "LABEL_KEY", "LABELS", "METRIC",
                 "create_model", "create_optimizer", "resume_key",
                 "node_features", "evaluate", "train", "run", "parse_args")


def load_example(path, names=EXAMPLE_NAMES):
    """The example at `path` (node_classification.py or a user's copy) as
    a module, refused in one line if it lacks one of `names`. Importing it
    imports torch and DGL."""
    import importlib.util

    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    missing = [n for n in names if not hasattr(module, n)]
    task = getattr(module, "TASK", None)  # link_prediction.py's, say
    if missing and task is not None:
        raise UsageError(
            f"--example {path} trains the dataset's task '{task}'; this "
            "runs copies of node_classification.py only (node "
            "classification; docs/distributed.md)")
    if missing:
        raise UsageError(
            f"--example {path} has no {', '.join(missing)}: is it a copy of "
            "node_classification.py?"
        )
    return module


def fanout_list(text):
    """Comma-separated neighbors per layer, -1 for all. Its length is
    checked against the model's layers once the model exists (check_fanout)."""
    try:
        fanout = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"'{text}' is not a comma-separated list of integers"
        ) from None
    if any(f == 0 or f < -1 for f in fanout):
        raise argparse.ArgumentTypeError(
            f"'{text}': each fanout is positive, or -1 for all neighbors"
        )
    return fanout


def fanout_value(text):
    """One fanout, for every layer's block (a layer-wise prediction)."""
    fanout = fanout_list(text)
    if len(fanout) != 1:
        raise argparse.ArgumentTypeError(
            f"'{text}': one value, used by every layer")
    return fanout[0]


def check_fanout(fanout, num_layers, default=10):
    """The fanout to sample with: --fanout, or `default` per layer; one
    value per layer of the model."""
    if fanout is None:
        return [default] * num_layers
    if len(fanout) != num_layers:
        text = ",".join(map(str, fanout))
        raise UsageError(
            f"--fanout {text}: {len(fanout)} values, but the model has "
            f"{num_layers} layers (one value per layer; default "
            f"{','.join([str(default)] * num_layers)})"
        )
    return list(fanout)
