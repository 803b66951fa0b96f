"""gbrun/placement.py: where the graph and features go for each mode; a
pin that DGL refuses is one line naming the mode that needs none."""
import pytest
import torch

import gbrun.cli
import gbrun.data.datasets
import gbrun.placement


def test_a_refused_pin_is_one_line(small_dataset, monkeypatch):
    dataset = gbrun.data.datasets.load_dataset(small_dataset)

    def refused():
        raise AssertionError  # what dgl 2.1.0 raises: a bare assert

    monkeypatch.setattr(dataset.graph, "pin_memory_", refused)
    with pytest.raises(gbrun.cli.UsageError) as refusal:
        gbrun.placement.place_graph(dataset, "pinned", torch.device("cuda:0"), 0,
                            "feat")
    message = str(refusal.value)
    assert "pinning the graph and features in host memory failed" in message
    assert "--mode cpu-cuda" in message and "\n" not in message
