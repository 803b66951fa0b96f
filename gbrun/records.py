"""A run's metrics file, metrics.jsonl (--log-dir): one JSON line per epoch
and one for the test result, appended, so that a resumed run continues the
file. Loads no torch: scripts/plot_metrics.py and the benchmark read it."""
import json
import math
import os

from .outputs import open_own

METRICS_FILE = "metrics.jsonl"


def append_metrics(directory, record):
    """Appends `record` (a dict of plain values) as one line of strict JSON
    to `directory`'s metrics.jsonl: a value that is no number (NaN, an
    epoch without validation items) is null, which every JSON reader
    takes, not a bare NaN."""
    record = {key: None if isinstance(value, float) and not math.isfinite(
        value) else value for key, value in record.items()}
    path = os.path.join(directory, METRICS_FILE)
    with os.fdopen(open_own(path, os.O_WRONLY | os.O_APPEND, "--log-dir's"),
                   "a") as f:
        f.write(json.dumps(record, allow_nan=False) + "\n")
