"""Draw training curves from the metrics.jsonl that
`node_classification.py --log-dir DIR` writes, as an SVG image (a browser,
an editor or Jupyter shows it).

    python scripts/plot_metrics.py runs/a                    # -> curves.svg
    python scripts/plot_metrics.py runs/a runs/b --out compare.svg

One figure: average training loss and the validation metric (its name comes
from the records: Accuracy, or whatever the example's METRIC says) against
epoch, one line per run (labelled by its directory) so that runs overlay.
Written with the standard library, not matplotlib: installed, matplotlib
makes torchmetrics import pyplot in every process of every run (0.6 s of
each rank's 3.2 s of imports, measured on a 2-core EPYC).
"""
import itertools
import json
import math
import os
from xml.sax.saxutils import escape

from gbrun.cli import ArgumentParser, fail
from gbrun.records import METRICS_FILE

# matplotlib's default colours, one per run.
COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
           "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
PANEL_W, PANEL_H = 480, 340
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 34, 46  # the plot area's margins


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


def nice_ticks(low, high, count=5, integer=False):
    """About `count` round values (multiples of 1, 2 or 5 times a power of
    ten) from just below `low` to just above `high`: the axis's ticks, its
    first and last the axis's ends."""
    if not high > low:
        low, high = low - 0.5, high + 0.5
    raw = (high - low) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    if integer:
        step = max(1, round(step))
    first, last = math.floor(low / step), math.ceil(high / step)
    return [i * step for i in range(first, last + 1)]


def label(value):
    return f"{value:.6g}"


def panel(x0, title, ylabel, lines):
    """One panel's SVG elements, its left edge at `x0`: `lines` are
    (colour, [(epoch, value or None)]); None breaks the line (a gap)."""
    epochs = [x for _, line in lines for x, _ in line]
    values = [y for _, line in lines for _, y in line if y is not None]
    xs = nice_ticks(min(epochs, default=0), max(epochs, default=1),
                    integer=True)
    ys = nice_ticks(min(values, default=0), max(values, default=1))
    left, top = x0 + LEFT, TOP
    width, height = PANEL_W - LEFT - RIGHT, PANEL_H - TOP - BOTTOM

    def at(x, y):
        return (left + (x - xs[0]) / (xs[-1] - xs[0]) * width,
                top + (ys[-1] - y) / (ys[-1] - ys[0]) * height)

    out = [f'<text x="{left + width / 2}" y="20" text-anchor="middle" '
           f'font-weight="bold">{escape(title)}</text>',
           f'<rect x="{left}" y="{top}" width="{width}" height="{height}" '
           'fill="none" stroke="#444"/>']
    for x in xs:
        px, _ = at(x, ys[0])
        out += [f'<line x1="{px:.1f}" y1="{top}" x2="{px:.1f}" '
                f'y2="{top + height}" stroke="#ddd"/>',
                f'<text x="{px:.1f}" y="{top + height + 16}" '
                f'text-anchor="middle">{label(x)}</text>']
    for y in ys:
        _, py = at(xs[0], y)
        out += [f'<line x1="{left}" y1="{py:.1f}" x2="{left + width}" '
                f'y2="{py:.1f}" stroke="#ddd"/>',
                f'<text x="{left - 6}" y="{py + 4:.1f}" '
                f'text-anchor="end">{label(y)}</text>']
    out += [f'<text x="{left + width / 2}" y="{PANEL_H - 8}" '
            'text-anchor="middle">epoch</text>',
            f'<text transform="translate({x0 + 16},{top + height / 2}) '
            f'rotate(-90)" text-anchor="middle">{escape(ylabel)}</text>']
    for colour, line in lines:
        # A polyline per run of points between gaps (None values).
        for gap, run in itertools.groupby(line, key=lambda p: p[1] is None):
            if not gap:
                points = " ".join("%.1f,%.1f" % at(x, y) for x, y in run)
                out.append(f'<polyline points="{points}" fill="none" '
                           f'stroke="{colour}" stroke-width="2"/>')
        out += [f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="3" fill="{colour}"/>'
                for cx, cy in (at(x, y) for x, y in line if y is not None)]
    return out


def plot(runs, out):
    """Writes the two panels of `runs` ([(label, records)]) to `out`."""
    name = " / ".join(sorted({metric_name(records) for _, records in runs}))
    losses, metrics, legend = [], [], []
    for index, (run_label, records) in enumerate(runs):
        colour = COLOURS[index % len(COLOURS)]
        key = f"val_{metric_name(records).lower()}"
        # null (an epoch without validation items, or no number): a gap.
        losses.append((colour, [(r["epoch"], r["loss"]) for r in records]))
        metrics.append((colour, [(r["epoch"], r.get(key)) for r in records]))
        # The legend, a row per run under the panels (never over a line).
        y = PANEL_H + 18 * index
        legend += [f'<rect x="{LEFT}" y="{y}" width="12" height="12" '
                   f'fill="{colour}"/>',
                   f'<text x="{LEFT + 18}" y="{y + 11}">'
                   f'{escape(run_label)}</text>']
    elements = (panel(0, "Loss", "average training loss", losses)
                + panel(PANEL_W, name, f"validation {name}", metrics) + legend)
    height = PANEL_H + 18 * len(runs) + 6
    with open(out, "w") as f:
        f.write(f'<svg xmlns="http://www.w3.org/2000/svg" '
                f'width="{2 * PANEL_W}" height="{height}" '
                'font-family="sans-serif" font-size="12">\n'
                '<rect width="100%" height="100%" fill="white"/>\n'
                + "\n".join(elements) + "\n</svg>\n")


def main(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", help="--log-dir of each run")
    parser.add_argument("--out", default="curves.svg",
                        help="the SVG image to write")
    args = parser.parse_args(argv)
    if not args.out.endswith(".svg"):
        parser.error(f"--out {args.out}: the image is SVG; name it *.svg")
    try:
        runs = [(d, read_epochs(d)) for d in args.run_dirs]
    except ValueError as error:
        fail(error)
    plot(runs, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
