"""gbrun.records: metrics.jsonl is strict JSON, which scripts/plot_metrics.py
draws with a gap where an epoch had no validation value."""
import json
import math
from xml.etree import ElementTree

import pytest

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


def polylines(svg):
    """The points of each line of a drawn SVG, in drawing order."""
    root = ElementTree.parse(svg).getroot()
    return [[tuple(map(float, point.split(",")))
             for point in line.get("points").split()]
            for line in root.iter("{http://www.w3.org/2000/svg}polyline")]


def test_plot_metrics_draws_null_as_a_gap(tmp_path):
    for epoch, value in enumerate([0.5, math.nan, 0.7, 0.6]):
        append_metrics(tmp_path, {"epoch": epoch, "loss": 1.0 - epoch / 10,
                                  "val_accuracy": value})
    plot_metrics.main([str(tmp_path), "--out", str(tmp_path / "c.svg")])
    loss, *accuracy = polylines(tmp_path / "c.svg")
    assert len(loss) == 4
    # Epoch 1 has no value: epoch 0 alone, then epochs 2-3.
    assert [len(line) for line in accuracy] == [1, 2]
    # Later epochs to the right; a higher value higher up (a smaller y).
    assert accuracy[0][0][0] < accuracy[1][0][0] < accuracy[1][1][0]
    assert accuracy[1][0][1] < accuracy[1][1][1] < accuracy[0][0][1]
    assert [y for _, y in loss] == sorted(y for _, y in loss)


def test_plot_metrics_refuses_another_image_format(tmp_path, capsys):
    append_metrics(tmp_path, {"epoch": 0, "loss": 1.0, "val_accuracy": 0.5})
    with pytest.raises(SystemExit) as stopped:
        plot_metrics.main([str(tmp_path), "--out", str(tmp_path / "c.png")])
    assert stopped.value.code == 2
    assert "--out " in capsys.readouterr().err
    assert not (tmp_path / "c.png").exists()
