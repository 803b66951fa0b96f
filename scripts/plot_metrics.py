"""Draw training curves from the metrics.jsonl that
`node_classification.py --log-dir DIR` writes.

    python scripts/plot_metrics.py runs/a                    # -> curves.png
    python scripts/plot_metrics.py runs/a runs/b --out compare.png

One figure: average training loss and the validation metric (its name comes
from the records: Accuracy, or whatever the example's METRIC says) against
epoch, one line per run (labelled by its directory) so that runs overlay.
"""
import json
import os

from gbrun.cli import ArgumentParser, fail
from gbrun.records import METRICS_FILE


def read_epochs(run_dir):
    """The per-epoch records of one run, by epoch. A resumed run appends to
    the same file, so a later record of an epoch replaces an earlier one."""
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such file (train with --log-dir {run_dir})")
    epochs = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(f"{path}:{number}: not a JSON line") from None
            if "epoch" in record:
                epochs[record["epoch"]] = record
    if not epochs:
        raise ValueError(f"{path}: no epoch records")
    return [epochs[epoch] for epoch in sorted(epochs)]


def metric_name(records):
    """The validation metric's name, as the example wrote it."""
    return records[-1].get("metric", "Accuracy")


def plot(runs, out):
    # Imported here: a bad argument is refused before matplotlib loads.
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, (loss_axes, acc_axes) = plt.subplots(1, 2, figsize=(10, 4))
    for label, records in runs:
        epochs = [r["epoch"] for r in records]
        key = f"val_{metric_name(records).lower()}"
        loss_axes.plot(epochs, [r["loss"] for r in records], marker="o", label=label)
        # null (an epoch without validation items): a gap in the line.
        acc_axes.plot(epochs, [float("nan") if r[key] is None else r[key]
                               for r in records], marker="o", label=label)
    name = " / ".join(sorted({metric_name(records) for _, records in runs}))
    loss_axes.set(xlabel="epoch", ylabel="average training loss", title="Loss")
    acc_axes.set(xlabel="epoch", ylabel=f"validation {name}", title=name)
    for axes in (loss_axes, acc_axes):
        axes.grid(True, alpha=0.3)
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.legend()
    figure.tight_layout()
    figure.savefig(out)


def main(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", help="--log-dir of each run")
    parser.add_argument("--out", default="curves.png", help="image to write")
    args = parser.parse_args(argv)
    try:
        runs = [(d, read_epochs(d)) for d in args.run_dirs]
    except ValueError as error:
        fail(error)
    plot(runs, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
