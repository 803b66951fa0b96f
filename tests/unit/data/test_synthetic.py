"""Tests of gbrun/data/synthetic.py: the planted graph
(make_synthetic_dataset.py's own tests are in tests/unit/scripts/)."""

import numpy as np

from gbrun.data import synthetic

def test_synthetic_edges_are_homophilous(tmp_path):
    edges, features, labels = synthetic.make_dataset(2000, 10, 16, 10, seed=0)
    same = (labels[edges[0]] == labels[edges[1]]).mean()
    # 80% of edges within a class (plus 1/10 of the random rest), seen
    # through the 10% of labels that are redrawn at random: about 0.68.
    assert 0.6 < same < 0.75, same
    assert features.dtype == np.float32 and features.shape == (2000, 16)
    assert abs(edges.shape[1] - 20000) < 100  # only self-loops dropped
