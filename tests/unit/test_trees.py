"""gbrun.trees: one walk over nested data, and each job asked of it."""
import pytest
import torch

from gbrun import trees


def test_the_walk_keeps_the_shape_and_names_each_place():
    tree = {"a": (1, torch.ones(2)), "b": [{"c": None}]}
    assert trees.leaves(tree) == [
        (("a", [0]), 1), (("a", [1]), tree["a"][1]), (("b", [0], "c"), None)]
    on_cpu = trees.cpu_values(tree)
    assert isinstance(on_cpu["a"], tuple) and torch.equal(on_cpu["a"][1],
                                                          torch.ones(2))
    # Plain data is lists and dicts only (a resume key is compared so).
    assert trees.plain(tree) == {"a": [1, [1.0, 1.0]], "b": [{"c": None}]}
    assert trees.plain({"f": len}) == {"f": None}


def test_trees_are_the_same_only_with_the_same_keys_lengths_and_tensors():
    a = {"x": [torch.ones(2), 1], "y": "s"}
    assert trees.same(a, {"x": (torch.ones(2), 1), "y": "s"})
    assert not trees.same(a, {"x": [torch.ones(2), 1]})
    assert not trees.same(a, {"x": [torch.ones(2), 1, 2], "y": "s"})
    assert not trees.same(a, {"x": [torch.ones(2, dtype=torch.int64), 1],
                              "y": "s"})
    assert not trees.same({"x": torch.ones(1)}, {"x": [1.0]})


def test_the_first_difference_is_named_where_it_is():
    assert trees.difference(
        {"optimizer": {"param_groups": [{"lr": 0.1}, {"lr": 0.2}]}},
        {"optimizer": {"param_groups": [{"lr": 0.1}, {"lr": 0.3}]}}
    ) == "optimizer.param_groups[1].lr: 0.2 then, 0.3 now"
    # A list of values is one value; a repr, its first line that differs.
    assert trees.difference({"fanout": [5, 5]}, {"fanout": [10, 10]}) == (
        "fanout: [5, 5] then, [10, 10] now")
    assert trees.difference({"m": "SAGE(\n a\n b)"}, {"m": "SAGE(\n a\n c)"}
                            ) == "m: 'b)' then, 'c)' now"
    assert trees.difference({"s": {30: 1}}, {"s": {30: 2}}) == (
        "s.30: 1 then, 2 now")
    assert trees.difference({}, {"y": 1}) == "y: None then, 1 now"
    assert len(trees.difference("x" * 300, "y")) == 160


def test_only_tensors_and_plain_data_pass_and_their_bytes_are_counted():
    trees.check_plain({"a": [1, "s", None, torch.ones(1)]}, "kept")
    with pytest.raises(TypeError, match=r"kept\[1\]\['k'\] is a set"):
        trees.check_plain([1, {"k": set()}], "kept")
    assert trees.payload_bytes({"a": [torch.ones(4), "s"],
                                "b": torch.zeros(2, dtype=torch.int64)}) == 32
