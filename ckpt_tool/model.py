"""The one metadata model every checkpoint format maps into.

Frozen dataclasses with ``to_dict``/``from_dict`` and no torch import. ``inspect``, ``validate``,
``diff`` and the reshard planner work on these objects only; readers and writers move bytes.

Dtypes are torch dtype names without the ``torch.`` prefix (``"bfloat16"``, ``"float32"``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Finding",
    "DTYPE_ITEMSIZE",
    "dtype_itemsize",
    "ChunkRef",
    "TensorMeta",
    "ObjectMeta",
    "CheckpointMeta",
    "FormatKind",
    "is_optimizer_key",
    "split_chained",
]

DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1,
    "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1,
    "complex64": 8, "complex128": 16,
}


_OPTIMIZER_PREFIXES = ("optimizer.", "optim.", "optimizer/", "opt_param_scheduler")
# Megatron-Core's ChainedOptimizer (dense + expert optimizers) prefixes each optimizer's keys
# with ``chained_{i}.`` in the forms that are not fully reshardable.
_CHAINED_RE = re.compile(r"^chained_(\d+)\.(?=optimizer\.)")


def is_optimizer_key(key: str) -> bool:
    """True for optimizer state (Megatron-Core ``optimizer.*`` and ``chained_{i}.optimizer.*``,
    DCP ``optim.*``, schedulers)."""
    return key.startswith(_OPTIMIZER_PREFIXES) or _CHAINED_RE.match(key) is not None


def split_chained(key: str) -> tuple[int | None, str]:
    """``(i, rest)`` for a ChainedOptimizer key ``chained_{i}.optimizer.…``, else
    ``(None, key)``."""
    m = _CHAINED_RE.match(key)
    return (int(m.group(1)), key[m.end():]) if m else (None, key)


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name (``"bfloat16"`` -> 2)."""
    try:
        return DTYPE_ITEMSIZE[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}") from None


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """Where one stored piece of a global tensor lives.

    ``offsets``/``sizes`` place the piece in the global tensor. ``file`` is relative to the
    checkpoint root; ``byte_offset``/``byte_length`` is the stored item's range in that file
    (for DCP: the whole ``torch.save`` archive of the piece). ``transforms`` lists stream
    transforms (e.g. ``"stream.zstd/1"``) applied to the stored bytes. ``layout`` says how the
    bytes are stored: ``"torch_save"`` (a torch.save zip item), ``"raw"`` (C-order little-endian
    elements), ``"flat"`` (a flattened N-D reformulated piece, see ``TensorMeta.stored_shape``)
    or ``"zarr_edge"`` (a zarr v2 edge chunk: raw, but padded to the array's full chunk shape).
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str | None = None
    byte_offset: int | None = None
    byte_length: int | None = None
    transforms: tuple[str, ...] = ()
    layout: str = "raw"

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "offsets": list(self.offsets), "sizes": list(self.sizes), "file": self.file,
            "byte_offset": self.byte_offset, "byte_length": self.byte_length,
            "transforms": list(self.transforms), "layout": self.layout,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ChunkRef:
        return cls(
            offsets=tuple(d["offsets"]), sizes=tuple(d["sizes"]), file=d.get("file"),
            byte_offset=d.get("byte_offset"), byte_length=d.get("byte_length"),
            transforms=tuple(d.get("transforms", ())), layout=d.get("layout", "raw"),
        )


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """One global tensor: its key, dtype, global shape and the chunks that store it.

    ``stored_shape`` is set when the on-disk tensor has another shape than the logical one
    (Megatron-Core's N-D reformulated flattened optimizer state); ``shape`` is always the
    logical global shape users expect.
    """

    key: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[ChunkRef, ...] = ()
    stored_shape: tuple[int, ...] | None = None
    origin: str | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_itemsize(self.dtype)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "dtype": self.dtype, "shape": list(self.shape), "chunks": len(self.chunks),
            "nbytes": self.nbytes,
        }
        if self.stored_shape is not None:
            d["stored_shape"] = list(self.stored_shape)
        return d

    def to_full_dict(self) -> dict[str, Any]:
        """Like ``to_dict`` but with every chunk spelled out (for ``from_dict`` round trips)."""
        d = self.to_dict()
        d["key"] = self.key
        d["chunks"] = [c.to_dict() for c in self.chunks]
        d["origin"] = self.origin
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorMeta:
        stored = d.get("stored_shape")
        return cls(
            key=d["key"], dtype=d["dtype"], shape=tuple(d["shape"]),
            chunks=tuple(ChunkRef.from_dict(c) for c in d.get("chunks", ())),
            stored_shape=None if stored is None else tuple(stored), origin=d.get("origin"),
        )


@dataclass(frozen=True)
class ObjectMeta:
    """A non-tensor stored item: a ShardedObject (``unique_key`` like ``rng_state/shard_0.0_1.1``)
    or another bytes item, with where its bytes live."""

    key: str
    unique_key: str
    file: str | None = None
    byte_offset: int | None = None
    byte_length: int | None = None
    global_shape: tuple[int, ...] = ()
    global_offset: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key, "unique_key": self.unique_key, "file": self.file,
            "byte_offset": self.byte_offset, "byte_length": self.byte_length,
            "global_shape": list(self.global_shape), "global_offset": list(self.global_offset),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ObjectMeta:
        return cls(
            key=d["key"], unique_key=d["unique_key"], file=d.get("file"),
            byte_offset=d.get("byte_offset"), byte_length=d.get("byte_length"),
            global_shape=tuple(d.get("global_shape", ())),
            global_offset=tuple(d.get("global_offset", ())),
        )


@dataclass(frozen=True)
class FormatKind:
    """What a format's registry name says about how its checkpoints are stored, for code that
    treats several formats alike: each of these facts is named here once, never by testing
    format names elsewhere. ``FormatKind("zarr").megatron_dist``; a checkpoint's is
    :attr:`CheckpointMeta.kind`."""

    name: str

    @property
    def megatron_dist(self) -> bool:
        """A Megatron-Core dist checkpoint (``torch_dist``, ``zarr``): ``metadata.json`` names
        the backend; the common state is ``common.pt`` or the ``common_state`` object."""
        return self.name in ("torch_dist", "zarr")

    @property
    def dcp_files(self) -> bool:
        """Tensors and objects are items of DCP ``.distcp`` files, each a ``torch.save``
        archive, listed by ``.metadata`` (``torch_dist``, ``dcp``)."""
        return self.name in ("torch_dist", "dcp")

    @property
    def whole_file_archives(self) -> bool:
        """Each data file is one ``torch.save`` archive (``legacy`` rank files, ``torch``)."""
        return self.name in ("legacy", "torch")

    @property
    def torch_save_archives(self) -> bool:
        """Its data are ``torch.save`` zip archives (items or whole files): CRC-checked."""
        return self.dcp_files or self.whole_file_archives

    @property
    def zarr_arrays(self) -> bool:
        """One zarr array directory per tensor (Megatron-Core's ``zarr`` backend)."""
        return self.name == "zarr"

    @property
    def legacy_rank_files(self) -> bool:
        """Megatron-LM's legacy checkpoint: one ``torch.save`` file per model-parallel rank."""
        return self.name == "legacy"

    @property
    def plain_dcp(self) -> bool:
        """A PyTorch DCP checkpoint that is not a (complete) Megatron-Core one."""
        return self.name == "dcp"

    @property
    def hf_directory(self) -> bool:
        """A Hugging Face model directory (``config.json`` + safetensors)."""
        return self.name == "hf"

    @property
    def megatron(self) -> bool:
        """What Megatron-LM resumes from: a Megatron-Core dist or a legacy checkpoint."""
        return self.megatron_dist or self.legacy_rank_files

    @property
    def megatron_ckpt_format(self) -> str | None:
        """Megatron-LM's ``--ckpt-format`` that loads it (``torch_dist`` for both dist
        backends, ``torch`` for legacy rank files); None where Megatron-LM does not resume."""
        return "torch" if self.legacy_rank_files else "torch_dist" if self.megatron_dist \
            else None


@dataclass(frozen=True)
class CheckpointMeta:
    """A whole checkpoint as the rest of ckpt_tool sees it.

    ``format`` is the registry name (``"torch_dist"``, ``"zarr"``, ``"dcp"``, ...); ``root`` the
    resolved checkpoint directory (or file); ``common`` a JSON-safe summary of the common state
    (iteration, parallel sizes, model sizes, ...); ``extras`` format-specific facts (backend
    versions, optimizer sharding type, ...).
    """

    format: str
    root: str
    tensors: dict[str, TensorMeta] = field(default_factory=dict)
    objects: tuple[ObjectMeta, ...] = ()
    common: dict[str, Any] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)
    version: str | None = None

    @property
    def kind(self) -> FormatKind:
        """What :attr:`format` says about how the checkpoint is stored."""
        return FormatKind(self.format)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def bytes_per_dtype(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.tensors.values():
            out[t.dtype] = out.get(t.dtype, 0) + t.nbytes
        return dict(sorted(out.items()))

    def to_dict(self) -> dict[str, Any]:
        """The ``inspect --json`` document."""
        return {
            "format": self.format,
            "version": self.version,
            "root": self.root,
            "tensors": {k: t.to_dict() for k, t in sorted(self.tensors.items())},
            "objects": [o.to_dict() for o in self.objects],
            "common": self.common,
            "extras": self.extras,
            "totals": {"tensors": len(self.tensors), "nbytes": self.total_bytes,
                       "bytes_per_dtype": self.bytes_per_dtype()},
        }

    def to_full_dict(self) -> dict[str, Any]:
        d = self.to_dict()
        d["tensors"] = {k: t.to_full_dict() for k, t in sorted(self.tensors.items())}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CheckpointMeta:
        return cls(
            format=d["format"], root=d["root"], version=d.get("version"),
            tensors={k: TensorMeta.from_dict({**v, "key": k}) for k, v in d["tensors"].items()},
            objects=tuple(ObjectMeta.from_dict(o) for o in d.get("objects", ())),
            common=dict(d.get("common", {})), extras=dict(d.get("extras", {})),
        )


@dataclass(frozen=True)
class Finding:
    """One problem ``validate`` found. ``severity`` is ``"error"`` or ``"warning"``; ``key`` the
    tensor/object it concerns, ``file`` the file (relative to the checkpoint root) if any."""

    severity: str
    key: str | None
    file: str | None
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {"severity": self.severity, "key": self.key, "file": self.file,
                "message": self.message}
