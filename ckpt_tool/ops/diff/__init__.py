"""``diff``: compare two checkpoints of any formats, streaming, and list every difference.

Call order: :func:`diff` opens both checkpoints, matches tensor keys (``rename`` prefixes are
applied to A's keys, ``filter`` to the matched names), reports keys on one side only, dtype and
shape changes, then compares the values of every tensor both sides hold with the same shape:

1. ``_bytes.fast_equal`` (no torch): pieces both sides store alike, or whose raw elements
   can be located, are compared byte for byte; equal bytes mean equal values;
2. ``_values.compare_values``: every other piece (other grids, differing bytes, a dtype
   change) is read with ``reader.read(key, slices)`` and compared element-wise, within
   ``atol + rtol * |b|``; NaN equals NaN at the same position. Every differing tensor is
   listed with its count, max abs/rel diff and first differing index.

Memory: two pieces (chunks, or slabs of ``PIECE_BYTES``) at a time. Then the common state: the
full ``reader.common()`` of both sides (``args`` fields by name; byte-identical ``common.pt``
files are not loaded), or the metadata summaries with ``keys_only``. Stored objects (RNG
states, extra state) are matched by unique key; the payloads of those both sides hold are
compared (identical stored bytes, else both unpickled through the safe unpickler, field by
field as the common state; not with ``keys_only`` or ``filter``). A side without common state or
objects (safetensors, a plain state dict) is not compared on that part (a note says so): a dist
checkpoint and its safetensors export are identical.

A Megatron checkpoint (torch_dist, zarr, legacy) against a Hugging Face model directory is
seen in HF names through the export rules (``_hf_view``, planned by ``planning.hf_compare``):
its export, or the source of an import, is identical; a changed tensor is reported under its
HF name with the Megatron tensor it comes from (``mapped_from``); what HF cannot hold
(optimizer state, padded vocab rows, common state) is noted as not comparable, but the
settings ``config.json`` shares with ``args`` (sizes, heads, vocab, norm epsilon, rope theta, tied
embeddings) are compared, each disagreement a common-state difference. Such a diff (or any,
with ``similarity``) also reports each tensor's cosine similarity and largest absolute and
relative errors (``_similarity``), and names the first tensor in model order that disagrees
(cosine below 0.99: a transposed or swapped projection, not rounding).

Megatron-LM legacy files against a Megatron-Core dist checkpoint (torch_dist, zarr): the legacy
side is seen as Megatron-Core saves that model (``_stacked_view``: stacked layers, its
``_extra_state`` and ``rng_state`` objects), what ``convert`` writes from it; a legacy
checkpoint and its conversion are identical.

A dtype change is a difference, except with a tolerance (and values read): then the values
decide, so a bf16 export is identical to its fp32 source within ``rtol=2**-8``.

``resharded``: B is a reshard of A (or the reverse): both are seen as ``reshard`` reads a
source, the re-padded vocabulary is compared on the rows both hold, and what a reshard changes
by design is a note (``_resharded``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol

from ckpt_tool.errors import UsageError, plural
from ckpt_tool.model import FormatKind
from ckpt_tool.ops.manifest_checks import check_source_manifest
from ckpt_tool.parallel import ranks as current_ranks
from ckpt_tool.parallel import split_by_bytes
from ckpt_tool.ops.diff._resharded import RESHARDED_HINT
from ckpt_tool.ops.diff._similarity import (COSINE_FLOOR, Accumulator, Similarity,
                                            check_plotting, first_disagreeing, model_order)
from ckpt_tool.ops.diff._similarity import plot as plot_similarity
from ckpt_tool.ops.diff._values import CommonDiff, TensorDiff, js
from ckpt_tool.storage import as_path

__all__ = ["diff", "DiffResult", "TensorDiff", "MetaChange", "CommonDiff", "parse_rename",
           "Progress", "RESHARDED_HINT", "Similarity", "check_plotting", "plot_similarity"]


class Progress(Protocol):
    """Progress sink (the CLI's ``progress_bar``): totals once, then bytes as they are read."""

    def start(self, total_bytes: int, total_tensors: int) -> None: ...

    def update(self, nbytes: int, tensors_done: int) -> None: ...


@dataclass(frozen=True)
class MetaChange:
    """A dtype or shape change of one tensor (``key`` in B's naming)."""

    key: str
    a: Any
    b: Any

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "a": js(self.a), "b": js(self.b)}


@dataclass(frozen=True)
class DiffResult:
    """Everything ``diff`` found. ``identical`` is the exit-0 verdict."""

    a: str
    b: str
    format_a: str
    format_b: str
    only_in_a: tuple[str, ...] = ()
    only_in_b: tuple[str, ...] = ()
    dtype_changes: tuple[MetaChange, ...] = ()
    shape_changes: tuple[MetaChange, ...] = ()
    values: tuple[TensorDiff, ...] = ()
    common: tuple[CommonDiff, ...] = ()
    objects_only_in_a: tuple[str, ...] = ()
    objects_only_in_b: tuple[str, ...] = ()
    objects: tuple[CommonDiff, ...] = ()  # payload differences of objects both sides hold
    notes: tuple[str, ...] = ()
    stats: dict[str, int] = field(default_factory=dict)
    keys_only: bool = False
    atol: float = 0.0
    rtol: float = 0.0
    origins: dict[str, str] = field(default_factory=dict)
    similarity: tuple[Similarity, ...] = ()  # per tensor, in model order (see _similarity)

    @property
    def first_disagreeing(self) -> Similarity | None:
        """The first tensor (model order) whose cosine similarity is below 0.99."""
        return first_disagreeing(self.similarity)

    @property
    def common_differences(self) -> tuple[CommonDiff, ...]:
        return tuple(c for c in self.common if c.kind != "not_compared")

    @property
    def object_differences(self) -> tuple[CommonDiff, ...]:
        return tuple(c for c in self.objects if c.kind != "not_compared")

    @property
    def counted_dtype_changes(self) -> tuple[MetaChange, ...]:
        """Dtype changes that make the checkpoints differ: all of them, except with a
        tolerance and values read, where the values decide."""
        tolerant = (self.atol > 0 or self.rtol > 0) and not self.keys_only
        return () if tolerant else self.dtype_changes

    @property
    def identical(self) -> bool:
        return not (self.only_in_a or self.only_in_b or self.counted_dtype_changes
                    or self.shape_changes or self.values or self.common_differences
                    or self.objects_only_in_a or self.objects_only_in_b
                    or self.object_differences)

    def to_dict(self) -> dict[str, Any]:
        """The ``diff --json`` document."""
        return {
            "identical": self.identical, "a": self.a, "b": self.b,
            "format_a": self.format_a, "format_b": self.format_b,
            "keys_only": self.keys_only, "atol": self.atol, "rtol": self.rtol,
            "only_in_a": list(self.only_in_a), "only_in_b": list(self.only_in_b),
            "dtype_changes": [c.to_dict() for c in self.dtype_changes],
            "shape_changes": [c.to_dict() for c in self.shape_changes],
            "values": [v.to_dict() for v in self.values],
            "common": [c.to_dict() for c in self.common],
            "objects_only_in_a": list(self.objects_only_in_a),
            "objects_only_in_b": list(self.objects_only_in_b),
            "objects": [c.to_dict() for c in self.objects],
            "notes": list(self.notes), "stats": self.stats,
        } | ({"mapped_from": self.origins} if self.origins else {}) | ({
            "similarity": [x.to_dict() for x in self.similarity],
            "first_disagreeing": (self.first_disagreeing.key if self.first_disagreeing
                                  else None)} if self.similarity else {})

    def named(self, key: str) -> str:
        """``key`` with the Megatron tensor it was mapped from (HF vs Megatron diffs)."""
        side = "A" if FormatKind(self.format_b).hf_directory else "B"
        return f"{key} ({side}: {self.origins[key]})" if key in self.origins else key


def parse_rename(specs: Iterable[str]) -> list[tuple[str, str]]:
    """``["OLD=NEW", ...]`` -> ``[("OLD", "NEW"), ...]``; UsageError on a malformed one."""
    out = []
    for s in specs:
        old, sep, new = s.partition("=")
        if not sep or not old:
            raise UsageError(f"--rename {s!r}: expected OLD=NEW (a key prefix of A and its "
                             "name in B)")
        out.append((old, new))
    return out


def _renamer(rename: Iterable[tuple[str, str]]) -> Callable[[str], str]:
    pairs = list(rename)

    def apply(key: str) -> str:
        for old, new in pairs:
            if key.startswith(old):
                return new + key[len(old):]
        return key
    return apply


def _none_note(what: str, side: Any, name: str, lost: list[str]) -> str:
    """``common state not compared: B (safetensors) holds none; A's: args, iteration, …``."""
    shown = ", ".join(lost[:6]) + (f", … ({len(lost)} in all)" if len(lost) > 6 else "")
    return f"{what} not compared: {name} ({side.format}) holds none; {'AB'[name == 'A']}'s: {shown}"


def _object_groups(keys: list[str]) -> list[str]:
    """Object unique keys by their key (``rng_state/shard_0.0_2.2`` -> ``rng_state`` ×4)."""
    counts: dict[str, int] = {}
    for k in keys:
        base = k.split("/", 1)[0]
        counts[base] = counts.get(base, 0) + 1
    return [b if n == 1 else f"{b} ×{n}" for b, n in sorted(counts.items())]


def _match_objects_in_common(cdiffs: list[Any], obj_a: list[str], obj_b: list[str],
                             oa: list[str], ob: list[str]
                             ) -> tuple[list[Any], list[str], list[str], int]:
    """An object of one side that the other side holds as a common-state entry of the same
    name (legacy per-rank ``rng_state/mp_rank_00_000`` in torch_dist's ``common.pt``) is
    matched: it leaves the objects only on one side and the common-state differences. Also
    returns how many objects were matched."""
    def under(path: str, key: str) -> bool:
        return path == key or path.startswith(key + ".")

    only_b = [c.path for c in cdiffs if c.kind == "only_in_b"]
    only_a = [c.path for c in cdiffs if c.kind == "only_in_a"]
    moved_a = {k for k in oa if any(under(p, k) for p in only_b)}
    moved_b = {k for k in ob if any(under(p, k) for p in only_a)}

    def keep(c: Any) -> bool:
        keys = moved_a if c.kind == "only_in_b" else moved_b if c.kind == "only_in_a" else ()
        return not any(under(c.path, k) for k in keys)

    return ([c for c in cdiffs if keep(c)], [k for k in obj_a if k not in moved_a],
            [k for k in obj_b if k not in moved_b], len(moved_a) + len(moved_b))


def _match(keys_a: Iterable[str], keys_b: Iterable[str], rn: Callable[[str], str],
           rx: re.Pattern[str] | None) -> tuple[dict[str, str], list[str], list[str], list[str]]:
    """``{B-name: A-key}`` of the common keys, then only-in-A (B-names), only-in-B."""
    named: dict[str, str] = {}
    for k in keys_a:
        n = rn(k)
        if n in named:
            raise UsageError(f"--rename maps both {named[n]!r} and {k!r} to {n!r}")
        named[n] = k
    if rx is not None:
        named = {n: k for n, k in named.items() if rx.search(n)}
        keys_b = [k for k in keys_b if rx.search(k)]
    sb = set(keys_b)
    common = {n: named[n] for n in sorted(named) if n in sb}
    return (common, sorted(n for n in named if n not in sb), sorted(sb - set(named)),
            sorted(common))


def _vocab_pairs(pairs: list[tuple[str, Any, Any]], R: Any
                 ) -> tuple[list[tuple[str, Any, Any]], list[str]]:
    """``pairs`` with each re-padded vocabulary tensor trimmed to the rows both sides hold,
    and a note per pair of row counts."""
    out, padded = [], {}
    for n, t, u in pairs:
        rows = R.vocab_rows(n, t, u)
        if rows is None:
            out.append((n, t, u))
            continue
        padded.setdefault((t.shape[0], u.shape[0]), []).append(n)
        out.append((n, R.trimmed(t, rows), R.trimmed(u, rows)))
    return out, [f"expected after a reshard: the vocabulary re-padded, {x} rows in A and {y} in "
                 f"B, in {plural(len(names), 'tensor')} ({', '.join(names[:2])}"
                 f"{', …' if len(names) > 2 else ''}): compared on the {min(x, y)} rows both hold"
                 for (x, y), names in padded.items()]


def _merge_ranks(ranks: Any, values: list[TensorDiff], stats: dict[str, int],
                 sims: list[Similarity]
                 ) -> tuple[list[TensorDiff], dict[str, int], list[Similarity]]:
    """Every rank's differing tensors, counts and similarities, merged on rank 0 and shared
    with all (so every rank exits with the same code)."""
    parts = ranks.gather((values, stats, sims))
    merged = None
    if ranks.is_main:
        assert parts is not None
        all_values = sorted((v for vs, _, _ in parts for v in vs), key=lambda v: v.key)
        total = {k: (stats[k] if k == "tensors_common" else sum(st[k] for _, st, _ in parts))
                 for k in stats}
        merged = (all_values, total, [x for _, _, ss in parts for x in ss])
    return ranks.broadcast(merged)


def diff(a: str | Path, b: str | Path, *, rename: Iterable[tuple[str, str]] = (),
         filter: str | None = None, keys_only: bool = False, atol: float = 0.0,
         rtol: float = 0.0, trust: bool = False, progress: Progress | None = None,
         resharded: bool = False, similarity: bool = False) -> DiffResult:
    """Compare checkpoint ``a`` with ``b`` (see the module docstring); ``progress`` is told the
    bytes read (both sides) and the tensors finished. ``similarity``: each tensor's cosine
    similarity and errors (always between a Megatron checkpoint and an HF directory)."""
    from ckpt_tool.formats.base import open_checkpoint
    from ckpt_tool.ops.diff._hf_view import hf_view
    from ckpt_tool.ops._stacked_view import stacked_view
    from ckpt_tool.ops.diff._bytes import fast_equal
    from ckpt_tool.ops.diff._values import (compare_common, compare_objects, compare_values,
                                            same_common_file)
    from ckpt_tool.ops.diff import _resharded as R

    if atol < 0 or rtol < 0:
        raise UsageError("--atol and --rtol must be >= 0")
    try:
        rx = None if filter is None else re.compile(filter)
    except re.error as exc:
        raise UsageError(f"--filter {filter!r} is not a valid regular expression ({exc})"
                         ) from None
    rn = _renamer(rename)
    with open_checkpoint(a, trust=trust) as ra, open_checkpoint(b, trust=trust) as rb:
        if resharded:
            ra, rb = R.resharded_views(ra), R.resharded_views(rb)
        view = hf_view(ra, rb)  # a Megatron side against an HF directory: in HF names
        ra, rb = view.a, view.b
        notes: list[str] = list(view.notes)
        if not resharded:  # (--resharded sees legacy sides stacked already)
            # legacy files against a Megatron-Core dist checkpoint: in its stacked names
            stacked_a = stacked_view(ra, rb.metadata().format)
            stacked_b = stacked_view(rb, ra.metadata().format)
            for side, stacked in (("A", stacked_a), ("B", stacked_b)):
                if stacked is not None:
                    notes.append(f"{side} (legacy) seen as Megatron-Core saves it, as convert "
                                 "writes it to a dist format: stacked layers, _extra_state "
                                 "and rng_state objects")
            ra, rb = stacked_a or ra, stacked_b or rb
        ma, mb = ra.metadata(), rb.metadata()
        common, only_a, only_b, names = _match(ma.tensors, mb.tensors, rn, rx)
        pairs = [(n, ma.tensors[common[n]], mb.tensors[n]) for n in names]
        if resharded:  # a re-padded vocabulary: compared on the rows both sides hold
            pairs, padded = _vocab_pairs(pairs, R)
            notes += padded
        dtypes = tuple(MetaChange(n, t.dtype, u.dtype) for n, t, u in pairs if t.dtype != u.dtype)
        shapes = tuple(MetaChange(n, t.shape, u.shape) for n, t, u in pairs if t.shape != u.shape)
        ina, inb = ra.objects_in_common(), rb.objects_in_common()  # compared as common state
        oa = [o.unique_key for o in ma.objects if o.unique_key not in ina]
        ob = [o.unique_key for o in mb.objects if o.unique_key not in inb]
        obj_a: list[str] = []
        obj_b: list[str] = []
        both: dict[str, str] = {}  # {B unique key: A unique key}
        if oa and ob:
            both, obj_a, obj_b, _ = _match(oa, ob, rn, rx)
        object_note = (_none_note("stored objects", mb if oa else ma, "B" if oa else "A",
                                  _object_groups(oa or ob)) if bool(oa) != bool(ob) else None)
        same_shape = [(n, t, u) for n, t, u in pairs if t.shape == u.shape]
        stats = {"tensors_common": len(pairs), "tensors_compared": 0, "tensors_equal_bytes": 0,
                 "bytes_compared": 0}
        values: list[TensorDiff] = []
        sims: list[Similarity] = []
        similar = similarity or view.side is not None
        if keys_only:
            notes.append("--keys-only: values not compared")
        else:
            ranks = current_ranks()
            for given, m in ((a, ma), (b, mb)):  # what each side's manifest says, first
                check_source_manifest(as_path(given), as_path(m.root), ranks)
            todo = same_shape
            if ranks.world > 1:  # under torchrun: each rank compares its share (by bytes)
                share = set(split_by_bytes([(n, t.nbytes + u.nbytes) for n, t, u in same_shape],
                                           ranks.world)[ranks.rank])
                todo = [x for x in same_shape if x[0] in share]
            if progress is not None:
                progress.start(sum(t.nbytes + u.nbytes for _, t, u in todo), len(todo))
            done = [0, 0]

            def tick(nbytes: int, finished: str | None) -> None:
                done[0] += nbytes
                done[1] += finished is not None
                if progress is not None:
                    progress.update(nbytes, done[1])

            proven = fast_equal(todo, ma, mb, tick, ra.check_stored, rb.check_stored)
            for n, t, u in todo:
                eq = proven.get(n, set())
                if sum(math.prod(b - a for a, b in box) for box in eq) != t.numel:
                    acc = Accumulator() if similar else None  # (reads the equal pieces too)
                    found = compare_values(n, common[n], t, u, ra, rb, set() if acc else eq,
                                           atol, rtol, tick, acc.add if acc else None)
                    if found is not None:
                        values.append(found)
                    if acc is not None:
                        sims.append(acc.result(n))
                else:
                    stats["tensors_equal_bytes"] += 1
                    if similar:
                        sims.append(Similarity(n, 1.0, 0.0, 0.0))
                stats["tensors_compared"] += 1
                tick(0, n)
            stats["bytes_compared"] = done[0]
            if ranks.world > 1:
                values, stats, sims = _merge_ranks(ranks, values, stats, sims)
        cdiffs: list[CommonDiff] = []
        if rx is not None:
            notes.append("--filter: common state not compared")
        elif view.common_note:
            notes.append(view.common_note)
            # the settings both describe: args against config.json, through the rules
            cdiffs = [CommonDiff(what, "changed", x, y) for what, x, y in view.config]
        elif keys_only or not same_common_file(ma, mb):
            ca = {k: v for k, v in ma.common.items() if k != "keys"} if keys_only else ra.common()
            cb = {k: v for k, v in mb.common.items() if k != "keys"} if keys_only else rb.common()
            if ca and cb and resharded:
                ca, cb, note = R.aligned_optimizer_entries(ca, cb)
                notes += [note] if note else []
            if ca and cb:
                cdiffs = compare_common(ca, cb)
                # a side may keep the other's objects in its common state (legacy per-rank
                # ``rng_state/mp_rank_00_000`` -> torch_dist ``common.pt``): matched by name
                cdiffs, obj_a, obj_b, moved = _match_objects_in_common(cdiffs, obj_a, obj_b,
                                                                       oa, ob)
                if object_note and moved == len(oa or ob):
                    object_note = None
            elif ca or cb:
                notes.append(_none_note("common state", mb if ca else ma, "B" if ca else "A",
                                        sorted(str(k) for k in (ca or cb))))
        if resharded:
            cdiffs, expected = R.split_expected_common(cdiffs)
            notes += expected
            for side, keys in (("A", obj_a), ("B", obj_b)):
                kept, note = R.split_expected_objects(keys, side)
                keys[:] = kept
                notes += [note] if note else []
        objects: list[CommonDiff] = []
        if both and (keys_only or rx is not None):
            notes.append("object payloads not compared (--keys-only / --filter)")
        elif both:
            objects = compare_objects(both, ma, mb, ra, rb)
        if object_note:
            notes.insert(0, object_note)
        if any(c.kind == "not_compared" for c in cdiffs):
            notes.append("some common-state values cannot be compared (listed as not_compared)")
        if any(c.kind == "not_compared" for c in objects):
            notes.append("some object payloads cannot be compared (listed as not_compared)")
    if resharded:
        notes.append(f"--resharded: {stats.get('tensors_compared', 0)} of "
                     f"{plural(len(pairs), 'tensor')} compared in model space (weights and "
                     "optimizer state, whatever each side's layout)")
    elif any(n for n in (only_a, only_b, shapes)) and R.looks_resharded(cdiffs):
        notes.append(R.RESHARDED_HINT)
    shown = {*only_a, *only_b, *(c.key for c in (*dtypes, *shapes)), *(v.key for v in values),
             *(x.key for x in sims if not x.cosine >= COSINE_FLOOR)}
    return DiffResult(
        str(a), str(b), ma.format, mb.format, tuple(only_a), tuple(only_b), dtypes, shapes,
        tuple(values), tuple(cdiffs), tuple(obj_a), tuple(obj_b), tuple(objects), tuple(notes),
        stats, keys_only, float(atol), float(rtol),
        {k: view.origins[k] for k in sorted(shown) if k in view.origins},
        tuple(sorted(sims, key=lambda x: model_order(x.key))))
