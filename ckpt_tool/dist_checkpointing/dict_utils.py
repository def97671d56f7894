"""Helpers for nested state dicts.

Only ``dict`` and ``list`` are containers here: every function descends into them and treats
anything else (tuples, tensors, ShardedTensors…) as a leaf. Behaviour matches Megatron-Core's
``dist_checkpointing.dict_utils``, including its corner cases (noted where they are surprising).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Dict, Iterable, Iterator, List, Tuple, TypeVar, Union

import numpy as np
import torch

__all__ = [
    "extract_matching_values",
    "diff",
    "inspect_types",
    "nested_values",
    "nested_items_iter",
    "dict_map",
    "dict_map_with_key",
    "dict_list_map_inplace",
    "dict_list_map_outplace",
    "merge",
    "map_reduce",
]

U = TypeVar("U")
V = TypeVar("V")
Nested = Union[dict, list]


def extract_matching_values(
    x: Nested, predicate: Callable[[Any], bool], return_lists_as_dicts: bool = False
) -> Tuple[Nested, Nested]:
    """Split ``x`` into (matching, non-matching) leaves, both keeping the nesting of ``x``.

    Args:
        x: a dict or a list (anything else raises ValueError).
        predicate: called on each leaf; True puts the leaf on the matching side.
        return_lists_as_dicts: represent lists on both sides as ``{index: value}`` dicts so
            the original positions survive (useful to merge the two halves back).

    Empty containers inside a dict are kept on the non-matching side. Inside a list an empty
    container is a leaf and goes wherever ``predicate`` sends it.
    """
    if isinstance(x, dict):
        items: Iterable = x.items()
        matching: Nested = {}
        rest: Nested = {}
        recurse_into_empty = True
    elif isinstance(x, list):
        items = enumerate(x)
        matching = {} if return_lists_as_dicts else []
        rest = {} if return_lists_as_dicts else []
        recurse_into_empty = False
    else:
        raise ValueError(f"Unexpected top-level object type: {type(x)}")

    def put(target: Nested, k, v) -> None:
        if isinstance(target, dict):
            target[k] = v
        else:
            target.append(v)

    for k, v in items:
        if isinstance(v, (dict, list)) and (v or recurse_into_empty):
            sub_match, sub_rest = extract_matching_values(v, predicate, return_lists_as_dicts)
            if sub_match:
                put(matching, k, sub_match)
            if sub_rest or not v:
                put(rest, k, sub_rest)
        else:
            put(matching if predicate(v) else rest, k, v)
    return matching, rest


def diff(x1: Any, x2: Any, prefix: Tuple = ()) -> Tuple[list, list, list]:
    """Recursively compare two nested values.

    Returns ``(only_left, only_right, mismatch)``: key paths present only in ``x1``, only in
    ``x2``, and entries ``(path, type(left), type(right), ...)`` for leaves that differ
    (tensors are compared element-wise; the entry then also carries the count, shape and
    positions of differing elements). Lists, tuples and numpy arrays are compared item by item
    and must have the same type on both sides; for them the "only" lists hold bare indices.
    Objects with ``replica_id`` (sharded values) are compared through their ``data``.
    """
    if isinstance(x1, dict) and isinstance(x2, dict):
        only_left = [prefix + (k,) for k in x1.keys() - x2.keys()]
        only_right = [prefix + (k,) for k in x2.keys() - x1.keys()]
        mismatch: list = []
        for k in x2.keys() & x1.keys():
            _merge_diff((only_left, only_right, mismatch), diff(x1[k], x2[k], prefix + (k,)))
        return only_left, only_right, mismatch

    if isinstance(x1, (list, tuple, np.ndarray)):
        assert type(x1) == type(x2), (type(x1), type(x2))  # noqa: E721 (exact type on purpose)
        n1, n2 = len(x1), len(x2)
        # MCore reports surplus positions as bare indices, largest first.
        only_left = list(range(n1 - 1, n2 - 1, -1))
        only_right = list(range(n2 - 1, n1 - 1, -1))
        mismatch = []
        for i, (a, b) in enumerate(zip(x1, x2)):
            _merge_diff((only_left, only_right, mismatch), diff(a, b, prefix + (i,)))
        return only_left, only_right, mismatch

    if isinstance(x1, torch.Tensor) and isinstance(x2, torch.Tensor):
        report = [prefix, type(x1), type(x2)]
        try:
            a, b = (x1, x2) if x1.device == x2.device else (x1.cpu(), x2.cpu())
            differs = not torch.all(a == b)
            neq = a != b
            report.extend([neq.sum(), neq.shape, neq.nonzero().tolist()])
        except (RuntimeError, TypeError, ValueError):
            differs = True
            report.extend([x1.shape, x2.shape])
        return [], [], [tuple(report)] if differs else []

    if hasattr(x1, "replica_id") and hasattr(x2, "replica_id"):
        assert type(x1) == type(x2), (type(x1), type(x2))  # noqa: E721
        return diff(x1.data, x2.data, prefix + (type(x1),))

    try:
        differs = bool(x1 != x2)
    except RuntimeError:
        differs = True
    return [], [], [(prefix, type(x1), type(x2))] if differs else []


def _merge_diff(acc: Tuple[list, list, list], part: Tuple[list, list, list]) -> None:
    for target, extra in zip(acc, part):
        target.extend(extra)


def inspect_types(x: Any, prefix: Tuple = (), indent: int = 4) -> None:
    """Print the nesting of ``x`` with the type (and a short repr) of every leaf."""
    pad = " " * indent * len(prefix)
    if isinstance(x, (dict, list)):
        print()
        entries = x.items() if isinstance(x, dict) else enumerate(x)
        marker = ">" if isinstance(x, dict) else "-"
        for k, v in entries:
            print(f"{pad}{marker} {k}: ", end="")
            inspect_types(v, prefix + (k,), indent)
        return
    if isinstance(x, torch.Tensor):
        print(f"Tensor of shape {x.shape}")
        return
    try:
        text = str(x)
    except Exception:  # a broken __str__ must not break inspection
        text = "<no string repr>"
    if len(text) > 30:
        text = text[:30] + "... (truncated)"
    print(f"[{type(x)}]: {text}")


def nested_values(x: Nested) -> Iterator[Any]:
    """Yield every leaf of ``x`` (depth-first, in insertion order)."""
    for _, _, v in nested_items_iter(x):
        yield v


def nested_items_iter(x: Nested) -> Iterator[Tuple[Nested, Any, Any]]:
    """Yield ``(container, key, leaf)`` for every leaf, so callers can assign in place."""
    entries = x.items() if isinstance(x, dict) else enumerate(x)
    for k, v in entries:
        if isinstance(v, (dict, list)):
            yield from nested_items_iter(v)
        else:
            yield x, k, v


def dict_map(f: Callable, d: Nested) -> None:
    """Replace every leaf ``v`` of ``d`` by ``f(v)``, in place."""
    for container, k, v in nested_items_iter(d):
        container[k] = f(v)


def dict_map_with_key(f: Callable, d: Nested) -> None:
    """Replace every leaf ``v`` (stored under key/index ``k``) by ``f(k, v)``, in place."""
    for container, k, v in nested_items_iter(d):
        container[k] = f(k, v)


def dict_list_map_inplace(f: Callable[[U], V], x: Union[Dict, List, U]) -> Union[Dict, List, V]:
    """Apply ``f`` to every leaf, mutating the dicts/lists of ``x``; returns ``x``.

    A bare leaf (not a container) is returned as ``f(x)``.
    """
    if isinstance(x, dict):
        for k in x:
            x[k] = dict_list_map_inplace(f, x[k])
        return x
    if isinstance(x, list):
        x[:] = [dict_list_map_inplace(f, v) for v in x]
        return x
    return f(x)


def dict_list_map_outplace(f: Callable[[U], V], x: Union[Dict, List, U]) -> Union[Dict, List, V]:
    """Like :func:`dict_list_map_inplace` but builds new containers, leaving ``x`` untouched."""
    if isinstance(x, dict):
        return {k: dict_list_map_outplace(f, v) for k, v in x.items()}
    if isinstance(x, list):
        return [dict_list_map_outplace(f, v) for v in x]
    return f(x)


def merge(x1: Nested, x2: Nested, key: Tuple[Union[str, int], ...] = ()) -> Nested:
    """Merge ``x2`` into ``x1`` recursively (in place) and return ``x1``.

    Dict keys missing in ``x1`` are added; lists must have equal lengths and merge position by
    position. Two leaves meeting at the same path is an error (ValueError).
    """
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            x1[k] = merge(x1[k], v2, key + (k,)) if k in x1 else v2
        return x1
    if isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise ValueError(
                f"Cannot merge two lists with different lengths ({len(x1)} and {len(x2)}, "
                f"encountered at level {key})"
            )
        for i, v2 in enumerate(x2):
            x1[i] = merge(x1[i], v2, key + (i,))
        return x1
    raise ValueError(
        f"Duplicate non-dict and non-list values encountered: `{x1}` and `{x2}` "
        f"(at level {key})"
    )


def map_reduce(
    xs: Iterable,
    key_fn: Callable = lambda x: x,
    value_fn: Callable = lambda x: x,
    reduce_fn: Callable = lambda x: x,
) -> dict:
    """Group ``value_fn(x)`` by ``key_fn(x)`` and reduce each group with ``reduce_fn``.

    Same contract as ``more_itertools.map_reduce``; groups keep first-seen order.
    """
    groups: Dict[Any, list] = defaultdict(list)
    for x in xs:
        groups[key_fn(x)].append(value_fn(x))
    return {k: reduce_fn(vs) for k, vs in groups.items()}
