"""split_by_bytes: deterministic, balanced, complete."""

from __future__ import annotations

import random

from ckpt_tool.parallel import Ranks, mine, split_by_bytes


def test_every_item_once_in_original_order():
    items = [(f"k{i}", random.Random(i).randint(1, 1000)) for i in range(200)]
    parts = split_by_bytes(items, 4)
    flat = [x for p in parts for x in p]
    assert sorted(flat) == sorted(k for k, _ in items)
    order = {k: i for i, (k, _) in enumerate(items)}
    assert all([order[x] for x in p] == sorted(order[x] for x in p) for p in parts)


def test_balanced_within_the_largest_item():
    items = [(i, n) for i, n in enumerate([900, 500, 400, 300, 300, 200, 100, 100, 50, 50])]
    parts = split_by_bytes(items, 3)
    size = dict(items)
    loads = [sum(size[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(size.values())
    assert split_by_bytes(items, 3) == parts  # deterministic


def test_single_rank_takes_everything():
    items = [("a", 1), ("b", 2)]
    assert split_by_bytes(items, 1) == [["a", "b"]]
    assert mine(items, Ranks()) == ["a", "b"]
    assert mine(items, Ranks(rank=1, world=2)) == split_by_bytes(items, 2)[1]
