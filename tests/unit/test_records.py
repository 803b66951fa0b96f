"""gbrun.records: metrics.jsonl is strict JSON, which scripts/plot_metrics.py
draws with a gap where an epoch had no validation value."""
import json
import math

import plot_metrics
from gbrun.records import METRICS_FILE, append_metrics


def strict(line):
    """The line parsed as strict JSON: NaN or Infinity is an error."""
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(line, parse_constant=refuse)


def test_a_value_that_is_no_number_is_written_as_null(tmp_path):
    append_metrics(tmp_path, {"epoch": 0, "loss": 0.5, "val_accuracy": 0.75})
    append_metrics(tmp_path, {"epoch": 1, "loss": math.inf,
                              "val_accuracy": math.nan})
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert [strict(line) for line in lines] == [
        {"epoch": 0, "loss": 0.5, "val_accuracy": 0.75},
        {"epoch": 1, "loss": None, "val_accuracy": None}]


def test_plot_metrics_draws_null_as_a_gap(tmp_path, monkeypatch):
    for epoch, value in enumerate([0.5, math.nan, 0.7]):
        append_metrics(tmp_path, {"epoch": epoch, "loss": 1.0,
                                  "val_accuracy": value})
    drawn = []
    import matplotlib.axes

    real = matplotlib.axes.Axes.plot

    def plot(self, x, y, *args, **kwargs):
        drawn.append(list(y))
        return real(self, x, y, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", plot)
    plot_metrics.main([str(tmp_path), "--out", str(tmp_path / "c.png")])
    assert drawn[0] == [1.0, 1.0, 1.0]
    assert drawn[1][0] == 0.5 and math.isnan(drawn[1][1]) and drawn[1][2] == 0.7
    assert (tmp_path / "c.png").stat().st_size > 0
