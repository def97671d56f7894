"""Nested dict/list helpers: behaviour and equality with Megatron-Core's dict_utils."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from ckpt_tool.dist_checkpointing import dict_utils as du


@pytest.fixture(scope="module")
def mc():
    return pytest.importorskip("megatron.core.dist_checkpointing.dict_utils")


def sample():
    return {
        "a": 1,
        "b": {"c": "text", "d": [1, "x", {"e": 2.5}, [], {}], "empty": {}},
        "l": [[], {}, [3, "y"], 4],
        "t": (1, 2),
        "empty_list": [],
    }


def is_number(v):
    return isinstance(v, (int, float))


def is_empty_container(v):
    return v == [] or v == {}


class TestExtractMatchingValues:
    def test_split_keeps_structure(self):
        match, rest = du.extract_matching_values(sample(), is_number)
        assert match == {"a": 1, "b": {"d": [1, {"e": 2.5}]}, "l": [[3], 4]}
        assert rest == {
            "b": {"c": "text", "d": ["x", [], {}], "empty": {}},
            "l": [[], {}, ["y"]],
            "t": (1, 2),
            "empty_list": [],
        }

    def test_lists_as_dicts(self):
        match, rest = du.extract_matching_values(sample(), is_number, return_lists_as_dicts=True)
        assert match["b"]["d"] == {0: 1, 2: {"e": 2.5}}
        assert match["l"] == {2: {0: 3}, 3: 4}
        assert rest["empty_list"] == {}  # an empty list becomes an empty dict too

    def test_top_level_list_and_bad_input(self):
        assert du.extract_matching_values([1, "a", 2], is_number) == ([1, 2], ["a"])
        with pytest.raises(ValueError):
            du.extract_matching_values(5, is_number)


class TestDiff:
    def test_dicts(self):
        x1, x2 = {"a": 1, "b": {"c": 2}, "x": 0}, {"a": 1, "b": {"c": 3}, "y": 0}
        left, right, mismatch = du.diff(x1, x2)
        assert left == [("x",)] and right == [("y",)]
        assert mismatch == [(("b", "c"), int, int)]

    def test_lists_report_bare_indices(self):
        left, right, mismatch = du.diff([1, 2, 3, 4], [1, 5])
        assert left == [3, 2] and right == [] and mismatch == [((1,), int, int)]
        with pytest.raises(AssertionError):
            du.diff([1], (1,))

    def test_tensors(self):
        _, _, mismatch = du.diff({"t": torch.tensor([1, 2, 3])}, {"t": torch.tensor([1, 0, 3])})
        (entry,) = mismatch
        assert entry[0] == ("t",) and entry[3] == 1 and entry[5] == [[1]]
        assert du.diff(torch.ones(2), torch.ones(2)) == ([], [], [])
        _, _, shape_mismatch = du.diff(torch.ones(2), torch.ones(3))
        assert shape_mismatch == [
            ((), torch.Tensor, torch.Tensor, torch.Size([2]), torch.Size([3]))]

    def test_sharded_values_compare_data(self):
        from ckpt_tool.dist_checkpointing.mapping import ShardedObject

        a, b = ShardedObject("k", 1, (1,), (0,)), ShardedObject("k", 2, (1,), (0,))
        assert du.diff(a, b) == ([], [], [((ShardedObject,), int, int)])

    def test_numpy_arrays(self):
        _, _, mismatch = du.diff(np.array([1, 2]), np.array([1, 3]))
        assert len(mismatch) == 1


def test_nested_values_and_items():
    d = sample()
    assert list(du.nested_values(d)) == [1, "text", 1, "x", 2.5, 3, "y", 4, (1, 2)]
    items = list(du.nested_items_iter(d))
    assert [v for _, _, v in items] == list(du.nested_values(d))
    container, key, value = items[4]
    assert container[key] == value == 2.5


def test_dict_map_variants():
    d = {"a": 1, "b": [2, {"c": 3}]}
    du.dict_map(lambda v: v * 10, d)
    assert d == {"a": 10, "b": [20, {"c": 30}]}
    du.dict_map_with_key(lambda k, v: (k, v), d)
    assert d == {"a": ("a", 10), "b": [(0, 20), {"c": ("c", 30)}]}

    src = {"a": [1, 2], "b": 3}
    out = du.dict_list_map_outplace(lambda v: -v, src)
    assert out == {"a": [-1, -2], "b": -3} and src == {"a": [1, 2], "b": 3}
    inner = src["a"]
    assert du.dict_list_map_inplace(lambda v: v + 1, src) is src
    assert src == {"a": [2, 3], "b": 4} and src["a"] is inner
    assert du.dict_list_map_inplace(lambda v: v + 1, 1) == 2


def test_merge():
    x1 = {"a": {"b": 1}, "l": [{"x": 1}, {}]}
    out = du.merge(x1, {"a": {"c": 2}, "l": [{"y": 2}, {"z": 3}], "n": 0})
    assert out is x1
    assert x1 == {"a": {"b": 1, "c": 2}, "l": [{"x": 1, "y": 2}, {"z": 3}], "n": 0}
    with pytest.raises(ValueError, match="different lengths"):
        du.merge([1], [1, 2])
    with pytest.raises(ValueError, match="Duplicate"):
        du.merge({"a": 1}, {"a": 2})


def test_map_reduce():
    words = ["apple", "avocado", "banana", "blueberry", "cherry"]
    assert du.map_reduce(words, key_fn=lambda w: w[0], value_fn=len, reduce_fn=sum) == {
        "a": 12, "b": 15, "c": 6}
    assert du.map_reduce([1, 1, 2]) == {1: [1, 1], 2: [2]}


def test_inspect_types(capsys):
    du.inspect_types({"a": torch.zeros(2), "b": ["x" * 40]})
    out = capsys.readouterr().out
    assert "> a: Tensor of shape torch.Size([2])" in out
    assert "- 0: [<class 'str'>]: " + "x" * 30 + "... (truncated)" in out


@pytest.mark.interop
class TestAgainstMegatronCore:
    PREDICATES = [is_number, is_empty_container, lambda v: isinstance(v, str), lambda v: True]

    @pytest.mark.parametrize("pred", PREDICATES)
    @pytest.mark.parametrize("as_dicts", [False, True])
    def test_extract_matching_values(self, mc, pred, as_dicts):
        for x in (sample(), sample()["l"], [[], [1], {"a": []}]):
            assert du.extract_matching_values(copy.deepcopy(x), pred, as_dicts) == (
                mc.extract_matching_values(copy.deepcopy(x), pred, as_dicts))

    @pytest.mark.parametrize(
        "x1, x2",
        [
            (sample(), sample()),
            ({"a": 1, "b": {"c": [1, 2, 3]}}, {"b": {"c": [1, 9]}, "d": 0}),
            ({"a": {"x": 1}}, {"a": 5}),
            ({"l": [1, [2, 3]]}, {"l": [1, [2, 4], 5]}),
            ({"t": (1, 2)}, {"t": (1, 3)}),
        ],
    )
    def test_diff(self, mc, x1, x2):
        assert du.diff(x1, x2) == mc.diff(x1, x2)

    def test_diff_tensors(self, mc):
        x1 = {"t": torch.tensor([1, 2, 3]), "u": torch.ones(2)}
        x2 = {"t": torch.tensor([1, 0, 0]), "u": torch.ones(3)}
        ours, theirs = du.diff(x1, x2), mc.diff(x1, x2)
        assert ours[:2] == theirs[:2]
        assert [str(e) for e in sorted(ours[2], key=str)] == [
            str(e) for e in sorted(theirs[2], key=str)]

    def test_map_helpers(self, mc):
        def twice(v):
            return v * 2 if is_number(v) else v

        for fn in ("dict_map",):
            a, b = sample(), sample()
            getattr(du, fn)(twice, a)
            getattr(mc, fn)(twice, b)
            assert a == b
        a, b = sample(), sample()
        du.dict_map_with_key(lambda k, v: (k, v), a)
        mc.dict_map_with_key(lambda k, v: (k, v), b)
        assert a == b
        assert du.dict_list_map_outplace(twice, sample()) == mc.dict_list_map_outplace(
            twice, sample())
        assert du.dict_list_map_inplace(twice, sample()) == mc.dict_list_map_inplace(
            twice, sample())
        assert list(du.nested_values(sample())) == list(mc.nested_values(sample()))
        assert [(k, v) for _, k, v in du.nested_items_iter(sample())] == [
            (k, v) for _, k, v in mc.nested_items_iter(sample())]

    def test_merge_and_map_reduce(self, mc):
        x2 = {"b": {"new": 1, "empty": {"q": [2]}}, "z": [1]}
        assert du.merge(sample(), copy.deepcopy(x2)) == mc.merge(sample(), copy.deepcopy(x2))
        xs = list(range(20))
        assert du.map_reduce(xs, lambda x: x % 3, lambda x: x * x, sum) == mc.map_reduce(
            xs, lambda x: x % 3, lambda x: x * x, sum)

    def test_inspect_types(self, mc, capsys):
        x = {"a": torch.zeros(2), "b": ["y" * 40, {"c": None}], "n": 3}
        du.inspect_types(x)
        ours = capsys.readouterr().out
        mc.inspect_types(x)
        assert ours == capsys.readouterr().out
