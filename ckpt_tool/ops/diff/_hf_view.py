"""A Megatron checkpoint seen in Hugging Face names, for ``diff`` against an HF directory.

:func:`hf_view` plans the view (``planning.hf_compare``, the export rules of ``convert --to
hf``) and wraps the Megatron side's reader in :class:`MappedReader`: its metadata holds the HF
tensors (names, shapes, dtypes) and ``read`` computes them from the Megatron tensors as the
export does (``_hf_source.HfSource``: one layer's tensor at a time). A tensor copied whole keeps
its source's chunks, so equal bytes are still proven by ``memcmp``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ckpt_tool.errors import CkptError
from ckpt_tool.formats.base import Reader
from ckpt_tool.model import CheckpointMeta, ChunkRef, TensorMeta
from ckpt_tool.ops._hf_source import HfSource
from ckpt_tool.planning.hf_compare import common_note, mapped_side, plan_hf_view
from ckpt_tool.planning.hf_plan import Recipe
from ckpt_tool.planning.source_layout import args_of

__all__ = ["MappedReader", "HfDiffView", "hf_view"]


class MappedReader(Reader):
    """``reader``'s checkpoint with the tensors of ``recipes`` (HF names) instead of its
    own; common state and objects are the reader's."""

    def __init__(self, reader: Reader, recipes: tuple[Recipe, ...]):
        super().__init__(reader.path, trust=reader.trust)
        self.verify = reader.verify
        self.inner = reader
        self.recipes = {r.key: r for r in recipes}
        self.source = HfSource(reader, self.recipes)
        inner = reader.metadata()
        tensors = {}
        for r in recipes:
            p = r.parts[0]
            src = inner.tensors[p.sources[0].key]
            whole = len(r.parts) == 1 and p.op == "copy" and not p.sources[0].index
            chunks = src.chunks if whole and src.shape == r.shape and src.dtype == r.dtype \
                else (ChunkRef(offsets=(0,) * len(r.shape), sizes=r.shape),)
            tensors[r.key] = TensorMeta(key=r.key, dtype=r.dtype, shape=r.shape, chunks=chunks)
        self.meta = replace(inner, tensors=tensors)

    def stored_archives(self, chunks: Any) -> list[Any]:
        return self.inner.stored_archives(chunks)

    def metadata(self) -> CheckpointMeta:
        """The inner checkpoint's metadata with the mapped tensors."""
        return self.meta

    def read(self, key: str, slices: tuple[slice, ...] | None = None) -> Any:
        """HF tensor ``key`` (or ``slices`` of it), computed from the Megatron tensors."""
        shape = self._tensor_meta(key).shape
        sl = tuple(slices or ()) + (slice(None),) * (len(shape) - len(slices or ()))
        box = [s.indices(n)[:2] for s, n in zip(sl, shape)]
        return self.source.read(key, tuple(a for a, _ in box),
                                tuple(max(b - a, 0) for a, b in box))

    def read_object(self, unique_key: str) -> Any:
        return self.inner.read_object(unique_key)

    def common(self) -> dict[str, Any]:
        return self.inner.common()

    def objects_in_common(self) -> frozenset[str]:
        return self.inner.objects_in_common()


@dataclass(frozen=True)
class HfDiffView:
    """The two readers to compare (one of them mapped), where each HF tensor of the mapped
    side comes from, the notes on what cannot be compared, and the settings where the
    Megatron side's args and config.json disagree."""

    a: Reader
    b: Reader
    side: str | None
    origins: dict[str, str]
    notes: tuple[str, ...]
    common_note: str | None = None
    config: tuple[tuple[str, Any, Any], ...] = ()  # (what, A's value, B's value)


def hf_view(ra: Reader, rb: Reader) -> HfDiffView:
    """The readers ``diff`` compares: unchanged unless one is an HF directory and the other a
    Megatron checkpoint, which is then seen in HF names. A Megatron side the rules cannot map
    is compared by its own names, with a note saying why."""
    ma, mb = ra.metadata(), rb.metadata()
    side = mapped_side(ma.format, mb.format)
    if side is None:
        return HfDiffView(ra, rb, None, {}, ())
    mega, hf = (ra, rb) if side == "a" else (rb, ra)
    common = mega.common()
    try:
        view = plan_hf_view(mega.metadata(), args_of(mega.metadata(), common), hf.metadata(),
                            hf.common()["config"], side=side)
    except CkptError as exc:
        return HfDiffView(ra, rb, None, {}, (
            f"names not mapped through the Hugging Face rules ({exc.message}): compared as "
            "stored",))
    mapped = MappedReader(mega, view.recipes)
    a, b = (mapped, rb) if side == "a" else (ra, mapped)
    note = common_note(side, mega.metadata().format, [str(k) for k in common])
    config = tuple((what, m, h) if side == "a" else (what, h, m) for what, m, h in view.config)
    return HfDiffView(a, b, side, view.origins, view.notes, note, config)
