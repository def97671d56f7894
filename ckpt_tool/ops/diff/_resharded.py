"""``diff --resharded``: B is a reshard of A (or A of B); are the weights and the optimizer
state the same?

Both sides are seen as ``reshard`` itself sees a source: a Megatron-LM legacy checkpoint in
Megatron-Core's stacked names (``_stacked_view.stacked_view``), optimizer state of any
form Megatron-Core writes in model space (``_optim_unflatten.unflatten_bucketed_optimizer``:
``dp_reshardable`` buckets and ``dp_zero_gather_scatter`` buffers rebuilt and proven, the
flattened ``fully_sharded_model_space`` and legacy ``distrib_optim.pt`` per parameter), so that
every weight and every fp32 main param / Adam moment is compared element by element whatever
the TP/PP/EP layout of each side. A vocabulary re-padded for the new TP size (embedding, output
layer and their optimizer state: a shape change in dim 0 only) is compared on the rows both
sides hold.

What a reshard changes by design is a note, not a difference: the parallel sizes in ``args``
(:data:`ckpt_tool.planning.reshard.RESHARD_ARGS`), the common ``optimizer`` entry written per
optimizer of the new layout (a chained dense + expert entry at EP > 1, one at EP 1, where the
experts join the dense optimizer: the dense optimizer's param groups are compared),
the content metadata's optimizer sharding type, the RNG states keyed by the old ``(pp, tp)`` (dropped: ``--no-load-rng``), and the
per-rank copies a legacy checkpoint keeps under its old rank names.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from ckpt_tool.formats.base import Reader
from ckpt_tool.model import TensorMeta

__all__ = ["resharded_views", "vocab_rows", "trimmed", "aligned_optimizer_entries",
           "split_expected_common", "split_expected_objects", "looks_resharded", "RESHARDED_HINT"]

RESHARDED_HINT = "after a reshard, --resharded compares the weights and optimizer state across layouts"

_VOCAB = re.compile(r"(^|\.)(word_embeddings|output_layer)\.weight$")
# per-rank objects of Megatron-LM legacy files (and of their reshards): keyed by the old rank
_PER_RANK = re.compile(r"^(rng_state|opt_param_scheduler|optimizer|distrib_optim)/mp_rank_\d+")


def resharded_views(reader: Reader) -> Reader:
    """``reader`` as ``reshard`` reads a source for a torch_dist target (see the module
    docstring); raises what that view raises for optimizer state it cannot rebuild."""
    from ckpt_tool.ops._optim_unflatten import unflatten_bucketed_optimizer
    from ckpt_tool.ops._stacked_view import stacked_view

    return unflatten_bucketed_optimizer(stacked_view(reader, "torch_dist") or reader)


def vocab_rows(name: str, a: TensorMeta, b: TensorMeta) -> int | None:
    """The rows to compare when ``name`` is a vocabulary-parallel tensor (or its optimizer
    state) whose padded vocabulary differs between the sides: the rows both hold; else None."""
    if (not _VOCAB.search(name) or len(a.shape) != len(b.shape) or not a.shape
            or a.shape[1:] != b.shape[1:] or a.shape[0] == b.shape[0]):
        return None
    return min(a.shape[0], b.shape[0])


def trimmed(t: TensorMeta, rows: int) -> TensorMeta:
    """``t`` seen as its first ``rows`` rows (reads of it stay inside them)."""
    return replace(t, shape=(rows, *t.shape[1:]))


def aligned_optimizer_entries(ca: dict[str, Any], cb: dict[str, Any]
                              ) -> tuple[dict[str, Any], dict[str, Any], str | None]:
    """Both common states with comparable ``optimizer`` entries, and a note when they had to be
    aligned: where one side's entry is chained (``{0: dense, 1: expert}``) and the other's is
    one optimizer, the chained side is seen as its dense (first) optimizer."""
    oa, ob = ca.get("optimizer"), cb.get("optimizer")
    if _chained(oa) == _chained(ob) or not (isinstance(oa, dict) and isinstance(ob, dict)):
        return ca, cb, None
    counts = [len(o) if _chained(o) else 1 for o in (oa, ob)]
    if _chained(oa):
        ca = {**ca, "optimizer": oa[min(oa)]}
    else:
        cb = {**cb, "optimizer": ob[min(ob)]}
    return ca, cb, (f"expected after a reshard: the common optimizer entry, one per optimizer of "
                    f"the layout (A {counts[0]}, B {counts[1]}: the experts have an optimizer "
                    "of their own at EP > 1); the dense optimizer's compared")


def _chained(entry: Any) -> bool:
    return isinstance(entry, dict) and bool(entry) and all(isinstance(k, int) for k in entry)


def _is_expected(path: str, kind: str) -> str | None:
    from ckpt_tool.planning.reshard import RESHARD_ARGS

    head, _, field = path.partition(".")
    if head == "args" and field in RESHARD_ARGS:
        return "the parallel sizes in args"
    if head == "content_metadata" and (field == "distrib_optim_sharding_type"
                                       or kind == "only_in_b"):
        return "the content metadata's optimizer form (written fully_reshardable)"
    if head == "rng_state" and kind in ("only_in_a", "only_in_b"):
        return "rng_state keyed by the old (pp, tp) (dropped: train with --no-load-rng)"
    return None


def split_expected_common(cdiffs: list[Any]) -> tuple[list[Any], list[str]]:
    """(the common-state differences left, one note per kind of expected change)."""
    left, seen = [], {}
    for c in cdiffs:
        why = _is_expected(c.path, c.kind)
        if why is None:
            left.append(c)
        else:
            seen.setdefault(why, []).append(c)
    notes = []
    for why, cs in seen.items():
        shown = ", ".join(f"{c.path} {_short(c.a)} -> {_short(c.b)}" if c.kind == "changed"
                          else c.path for c in cs[:6])
        more = f", … ({len(cs)} in all)" if len(cs) > 6 else ""
        notes.append(f"expected after a reshard: {why}: {shown}{more}")
    return left, notes


def split_expected_objects(only: list[str], side: str) -> tuple[list[str], str | None]:
    """(the objects only on ``side`` left, a note on the expected ones: RNG states keyed by
    the old layout, a legacy checkpoint's per-rank copies)."""
    expected = [k for k in only if k.split("/", 1)[0] == "rng_state" or _PER_RANK.match(k)]
    if not expected:
        return only, None
    groups: dict[str, int] = {}
    for k in expected:
        base = k.split("/", 1)[0]
        groups[base] = groups.get(base, 0) + 1
    what = ", ".join(f"{b} ×{n}" for b, n in sorted(groups.items()))
    return ([k for k in only if k not in expected],
            f"expected after a reshard: objects keyed by the old ranks only in {side}: {what} "
            "(rng_state is dropped: train with --no-load-rng)")


def looks_resharded(cdiffs: list[Any]) -> bool:
    """The common-state differences include a change of parallel sizes in ``args``."""
    from ckpt_tool.planning.reshard import RESHARD_ARGS

    return any(c.path.partition(".")[0] == "args" and c.path.partition(".")[2] in RESHARD_ARGS
               and c.kind == "changed" for c in cdiffs)


def _short(v: Any) -> str:
    text = str(v)
    return text if len(text) <= 40 else text[:37] + "..."
