"""Command-line pieces every script here shares: the one-line refusal of bad
input (exit status 2) and argument types that name the bad value. No torch
import, so that the launcher of simulated machines starts fast."""
import argparse
import os
import re
import sys


class UsageError(Exception):
    """Bad input: reported as one line, exit status 2, before any spawn."""


def fail(message, speak=True):
    """Bad input, as every script here reports it: one line naming the bad
    value, exit status 2. Processes that found the same bad input as another
    one that reports it (torchrun's ranks) exit without a word."""
    if speak:
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


def port(text):
    value = int_at_least(1)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(
            f"{value} is not a TCP port (1-65535)"
        )
    return value


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


# What the scripts that train or read data as the example does take from it.
EXAMPLE_NAMES = ("FEATURE_KEYS", "LABEL_KEY", "LABELS", "METRIC",
                 "create_model", "create_optimizer", "resume_key",
                 "node_features", "evaluate", "train", "parse_args")


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
