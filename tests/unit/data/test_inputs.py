"""Tests of gbrun/data/inputs.py's transforms and warnings, called
directly (every check of a bad input is run through the converter, in
tests/unit/scripts/test_convert_to_ondisk.py)."""

import numpy as np
import pytest

from dataset_inputs import pair_set
from gbrun.data import inputs


def test_self_loops_and_repeated_edges_are_warned_of_with_their_option():
    edges = np.array([[0, 1, 1, 2, 2, 2], [0, 0, 1, 0, 0, 0]])
    assert inputs.edge_warnings(edges) == [
        "2 self-loops (an edge from a node to itself), e.g. node 0; "
        "--drop-self-loops removes them",
        "2 edges given more than once, e.g. 2 -> 0; --add-reverse-edges "
        "keeps each directed edge once (and adds its reverse)"]
    assert inputs.edge_warnings(edges, True, True) == []
    assert inputs.edge_warnings(np.array([[0, 1], [1, 0]])) == []


def test_edge_transforms():
    edges = np.array([[0, 1, 1, 2, 2], [1, 0, 1, 0, 0]])
    assert pair_set(inputs.drop_self_loops(edges)) == {(0, 1), (1, 0), (2, 0)}
    both = inputs.add_reverse_edges(edges)
    assert both.shape == (2, 5)  # duplicates and already-reversed pairs once
    assert pair_set(both) == {(0, 1), (1, 0), (1, 1), (2, 0), (0, 2)}


def test_split_nodes():
    train, val, test = inputs.split_nodes(10, (0.5, 0.3, 0.2), seed=3)
    assert (len(train), len(val), len(test)) == (5, 3, 2)
    assert sorted(np.concatenate([train, val, test]).tolist()) == list(range(10))
    partial = inputs.split_nodes(10, (0.5, 0.1, 0.1), seed=3)
    assert sum(len(ids) for ids in partial) == 7
    with pytest.raises(inputs.DatasetError, match="sum to"):
        inputs.split_nodes(10, (0.7, 0.2, 0.2))
    with pytest.raises(inputs.DatasetError, match=">= 0"):
        inputs.split_nodes(10, (1.1, -0.1, 0.0))
