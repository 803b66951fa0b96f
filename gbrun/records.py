"""A run's metrics file, metrics.jsonl (--log-dir): one JSON line per epoch
and one for the test result, appended, so that a resumed run continues the
file. Loads no torch: scripts/plot_metrics.py and the benchmark read it."""
import json
import os

METRICS_FILE = "metrics.jsonl"


def append_metrics(directory, record):
    """Appends `record` (a dict of plain values) as one line to
    `directory`'s metrics.jsonl."""
    with open(os.path.join(directory, METRICS_FILE), "a") as f:
        f.write(json.dumps(record) + "\n")
