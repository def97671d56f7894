"""Megatron-Core dist checkpoints: the ``torch_dist`` and ``zarr`` sharded backends.

Both are a directory with ``metadata.json`` (``sharded_backend``), the common state (rank 0's
non-sharded state: ``common.pt``, or from Megatron-Core 0.19 the ``common_state`` object of the
sharded data, :mod:`.forms`) and the sharded data: DCP ``.metadata`` + ``*.distcp`` files for
``torch_dist``, one zarr array directory per tensor for ``zarr``. The path may also be a
training save directory (``latest_checkpointed_iteration.txt`` is followed).

The metadata path imports no torch: ``.metadata`` and ``common.pt`` are unpickled into
stand-ins through the allowlist. Reading tensors imports torch.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ckpt_tool.errors import CorruptCheckpointError, InputError
from ckpt_tool.formats.save_dir import resolve_checkpoint_dir
from ckpt_tool.formats.base import Format, Reader, register
from ckpt_tool.formats.mcore_dist.tokenizer_assets import tokenizer_assets
from ckpt_tool.formats.mcore_dist.forms import COMMON_FILE, COMMON_STATE_KEY, where_common
from ckpt_tool.formats.mcore_dist.training_config import training_config
from ckpt_tool.model import CheckpointMeta, ObjectMeta, TensorMeta

__all__ = ["read_backend_config", "infer_optimizer_sharding", "McoreDistReader",
           "TorchDistReader", "ZarrReader", "TORCH_DIST", "ZARR"]

METADATA_JSON = "metadata.json"
_DP_BUCKET_RE = re.compile(r"(chained_\d+\.)?optimizer\.distributed\.dp_group_idx_\d+\."
                           r"gbuf_idx_\d+\..*bucket_idx_")
_DP_PARAM_STATE_RE = re.compile(r"(chained_\d+\.)?optimizer\.distributed\.dp_group_idx_\d+\."
                                r"param_state")


def read_backend_config(ckpt_dir: Path) -> dict[str, Any]:
    """The parsed ``metadata.json``; InputError if absent, CorruptCheckpointError if bad."""
    f = ckpt_dir / METADATA_JSON
    if not f.is_file():
        present = [n for n in (".metadata", COMMON_FILE) if (ckpt_dir / n).is_file()]
        why = (f" (has {' and '.join(present)}: a plain PyTorch DCP checkpoint, format 'dcp', "
               f"or an interrupted Megatron-Core save, which writes {METADATA_JSON} last)"
               ) if present else ""
        raise InputError(f"no {METADATA_JSON}{why}", path=ckpt_dir)
    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(f"{METADATA_JSON} is not valid JSON ({exc})",
                                     path=ckpt_dir) from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("sharded_backend"), str):
        raise CorruptCheckpointError(f"{METADATA_JSON} has no 'sharded_backend' string",
                                     path=ckpt_dir)
    return cfg


def _sniffer(backend: str):
    def sniff(path: Path) -> str | None:
        try:
            d = resolve_checkpoint_dir(path)
            if not d.is_dir():
                return "not a directory"
            cfg = read_backend_config(d)
        except (InputError, OSError) as exc:
            return exc.message if isinstance(exc, InputError) else str(exc)
        if cfg["sharded_backend"] != backend:
            return f"{METADATA_JSON} says sharded_backend {cfg['sharded_backend']!r}"
        return unknown_backend_version(cfg)
    return sniff


#: What Megatron-Core's strategy registry loads (``strategies/base.py``,
#: ``default_strategies[action][(backend, version)]``): version 1 of each backend, and
#: ``torch`` (``common.pt``) for the common state (0.19 writes no common_backend fields).
_KNOWN_VERSIONS = {"sharded_backend_version": (1,), "common_backend": ("torch",),
                   "common_backend_version": (1,)}


def unknown_backend_version(cfg: dict) -> str | None:
    """Why Megatron-Core finds no strategy to load the checkpoint ``cfg`` describes (a
    version it has none for, a common backend other than ``torch``), or None."""
    for field, known in _KNOWN_VERSIONS.items():
        if field in cfg and (cfg[field] not in known or type(cfg[field]) is bool):
            return (f"{METADATA_JSON} says {field} {cfg[field]!r}: Megatron-Core has no "
                    f"strategy to load it (it loads {', '.join(map(repr, known))})")
    return None


def infer_optimizer_sharding(tensors: dict[str, TensorMeta], objects: list[ObjectMeta] | tuple,
                             content_metadata: Any) -> dict[str, Any] | None:
    """The optimizer state a checkpoint holds, decided from its keys (docs/formats.md §9).

    ``content_metadata["distrib_optim_sharding_type"]`` alone proves nothing: Megatron-LM writes
    ``dp_reshardable`` into every checkpoint, model-only ones and ones with a non-distributed
    optimizer included. Returns None when no optimizer state is stored, else ``{"type",
    "source", "declared"}`` with ``type`` one of ``dp_reshardable``, ``dp_zero_gather_scatter``,
    ``fully_sharded_model_space``, ``fully_reshardable`` (the distributed optimizer gathered to
    model space) or ``non_distributed`` (``Float16OptimizerWithFloat16Params`` /
    ``FP32Optimizer``: model-space ``optimizer.state.*`` without fp32 ``param`` keys).
    """
    declared = None
    if isinstance(content_metadata, dict):
        declared = content_metadata.get("distrib_optim_sharding_type")
    declared = str(declared) if declared else None

    def found(kind: str, why: str) -> dict[str, Any]:
        return {"type": kind, "source": why, "declared": declared}

    if any(_DP_BUCKET_RE.match(k) for k in tensors):
        return found("dp_reshardable", "per-bucket optimizer.distributed.* keys")
    if any(_DP_PARAM_STATE_RE.match(o.key) for o in objects):
        return found("dp_zero_gather_scatter", "the optimizer.distributed.*.param_state object")
    opt = {k: t for k, t in tensors.items() if k.startswith("optimizer.state.")}
    if not opt:
        return None
    for k, t in opt.items():
        if t.stored_shape is not None:
            return found("fully_sharded_model_space", "N-D flattened optimizer tensors")
        model_key = k.split(".", 3)[3] if k.count(".") >= 3 else ""
        model = tensors.get(model_key)
        if model is not None and len(t.shape) == 1 and t.shape != model.shape:
            return found("fully_sharded_model_space", "1-D flattened optimizer tensors")
    if any(k.startswith("optimizer.state.param.") for k in opt):
        return found("fully_reshardable", "model-space optimizer.state.{param,exp_avg,...} keys")
    return found("non_distributed", "model-space optimizer.state.* keys without fp32 'param' "
                 "(a non-distributed optimizer)")


class McoreDistReader(Reader):
    """What both backends share: directory resolution, metadata.json and the common state
    (``common.pt`` when there is one, as Megatron-Core 0.19 reads it, else the
    ``common_state`` object)."""

    def __init__(self, path: Path, *, trust: bool = False):
        super().__init__(path, trust=trust)
        self.root = resolve_checkpoint_dir(path)
        self.config = read_backend_config(self.root)
        self._meta: CheckpointMeta | None = None

    def sharded_metadata(self) -> tuple[dict[str, TensorMeta], list[ObjectMeta], dict[str, Any]]:
        raise NotImplementedError

    def _common_torch_free(self, objects: list[ObjectMeta]) -> Any:
        f = self.root / COMMON_FILE
        if f.is_file():
            from ckpt_tool.formats.common_state import load_torch_free

            return load_torch_free(f, trust=self.trust)
        obj = _common_object(objects)
        if obj is not None:
            return self._object_payload_torch_free(obj)
        return None

    def _object_payload_torch_free(self, obj: ObjectMeta) -> Any:
        return None

    def metadata(self) -> CheckpointMeta:
        """Every tensor and object, the common summary and backend facts; no tensor bytes."""
        if self._meta is not None:
            return self._meta
        from ckpt_tool.formats.common_state import summarize_common

        tensors, objects, extras = self.sharded_metadata()
        state = self._common_torch_free(objects)
        common = summarize_common(state) if state is not None else {}
        extras = {"sharded_backend": self.config.get("sharded_backend"),
                  "sharded_backend_version": self.config.get("sharded_backend_version"),
                  "common_backend": self.config.get("common_backend"),
                  "common_backend_version": self.config.get("common_backend_version"),
                  "common_file": COMMON_FILE if (self.root / COMMON_FILE).is_file() else None,
                  "common_object": getattr(_common_object(objects), "unique_key", None),
                  "modelopt_state": (self.root / "modelopt_state" / METADATA_JSON).is_file(),
                  **extras}
        extras["common_state"] = where_common(extras)
        extras["optimizer_sharding"] = infer_optimizer_sharding(
            tensors, objects, common.get("content_metadata"))
        config = training_config(self.root)
        if config is not None:  # Megatron-Bridge's / NeMo's files beside the checkpoint
            extras["training_config"] = config
        self._meta = CheckpointMeta(
            format=self.format_name, root=str(self.root), tensors=tensors,
            objects=tuple(objects), common=common, extras=extras,
            version=str(self.config.get("sharded_backend_version")))
        return self._meta

    def common_torch_free(self) -> dict[str, Any] | None:
        """``common.pt`` (or the ``common_state`` object) loaded without torch, tensors as
        placeholders."""
        return self._common_torch_free(list(self.metadata().objects))

    def check_common(self) -> None:
        """The CRC-32s of ``common.pt`` (or of the ``common_state`` object's item)."""
        from ckpt_tool.formats.containers.torch_zip.archive_check import check_file, check_many

        if not self.verify:
            return
        if (self.root / COMMON_FILE).is_file():
            check_file(self.root / COMMON_FILE, COMMON_FILE)
            return
        obj = _common_object(self.metadata().objects)
        if obj is not None and obj.file and obj.byte_offset is not None and obj.byte_length:
            check_many([(self.root / obj.file, obj.byte_offset, obj.byte_length)])

    def common(self) -> dict[str, Any]:
        """The full common state, loaded with torch through the safe unpickler."""
        f = self.root / COMMON_FILE
        if f.is_file():
            from ckpt_tool.formats.containers.pickle.safe_pickle import load_torch_file

            state = load_torch_file(f, trust=self.trust, verify=self.verify)
            return state if isinstance(state, dict) else {"value": state}
        obj = _common_object(self.metadata().objects)
        return self.read_object(obj.unique_key) if obj is not None else {}

    def objects_in_common(self) -> frozenset[str]:
        """The ``common_state`` object (Megatron-Core 0.19's common state), which is the common
        state rather than an object of its own (also when a ``common.pt`` outranks it)."""
        obj = _common_object(self.metadata().objects)
        return frozenset() if obj is None else frozenset({obj.unique_key})


def _common_object(objects: Any) -> ObjectMeta | None:
    """The ``common_state`` ShardedObject among ``objects`` (Megatron-Core 0.19), or None."""
    return next((o for o in objects if o.key == COMMON_STATE_KEY), None)


class TorchDistReader(McoreDistReader):
    """``sharded_backend: torch_dist``: DCP ``.metadata`` + ``*.distcp`` files."""

    format_name = "torch_dist"

    def sharded_metadata(self) -> tuple[dict[str, TensorMeta], list[ObjectMeta], dict[str, Any]]:
        from ckpt_tool.formats.containers.dcp.dcp_metadata import (dcp_tensor_metas,
                                                                   read_dcp_metadata_torch_free)

        md = read_dcp_metadata_torch_free(self.root, trust=self.trust)
        tensors, objects = dcp_tensor_metas(md)
        files = sorted({c.file for t in tensors.values() for c in t.chunks if c.file}
                       | {o.file for o in objects if o.file})
        mcore_data = getattr(md, "mcore_data", None)
        extras = {
            "dcp_version": getattr(md, "version", None),
            "data_files": len(files),
            "data_files_on_disk": len(list(self.root.glob("*.distcp"))),
            "has_all_local_plans": getattr(md, "all_local_plans", None) is not None,
            "metadata_class": getattr(type(md), "__stand_in_for__", type(md).__qualname__),
            "nd_reformulated": sorted(k for k, t in tensors.items() if t.stored_shape),
            "has_mcore_data": bool(mcore_data),
            "has_integrity_json": (self.root / "integrity.json").is_file(),
        }
        tokenizer = tokenizer_assets(self.root)  # Megatron-LM's tokenizer/ (tokenizer_assets.py)
        if tokenizer:
            extras["tokenizer_assets"] = [{"name": n, "size": size} for n, size in tokenizer]
        return tensors, objects, extras

    def _object_payload_torch_free(self, obj: ObjectMeta) -> Any:
        from ckpt_tool.formats.common_state import load_torch_free
        from ckpt_tool.formats.containers.dcp.dcp_items import read_item_bytes

        data = read_item_bytes(self.root, obj.file, obj.byte_offset, obj.byte_length,
                               verify=False)  # (metadata and validate: checked apart)
        payload = load_torch_free(data, trust=self.trust, where=self.root / str(obj.file))
        return payload[0] if isinstance(payload, list) and len(payload) == 1 else payload

    def read_object_torch_free(self, unique_key: str) -> Any:
        """:meth:`read_object` with tensors as placeholders: through the same allowlisting
        unpickler, without importing torch unless the pickle needs it (for validation)."""
        return self._object_payload_torch_free(self._object_meta(unique_key))

    def stored_object_bytes(self, unique_key: str) -> bytes | None:
        """The stored bytes item of a ShardedObject when it is ``torch.save([payload])`` that
        the safe unpickler accepts without torch (what a torch_dist writer would store for
        :meth:`read_object`'s value), else None."""
        from ckpt_tool.formats.containers.dcp.dcp_items import read_item_bytes

        o = self._object_meta(unique_key)
        data = read_item_bytes(self.root, o.file, o.byte_offset, o.byte_length,
                               verify=self.verify)
        payload = _torch_free_or_none(data, self.trust, self.root / str(o.file))
        return data if isinstance(payload, list) and len(payload) == 1 else None

    def common_file(self) -> Path | None:
        """``common.pt`` when it holds a dict the safe unpickler accepts without torch (the
        file :meth:`common` loads, as a torch_dist writer would store it), else None."""
        f = self.root / COMMON_FILE
        if not f.is_file():
            return None
        if self.verify:  # it is copied as it is: its CRCs first
            from ckpt_tool.formats.containers.torch_zip.archive_check import check_file

            check_file(f, COMMON_FILE)
        return f if isinstance(_torch_free_or_none(f, self.trust, f), dict) else None

    def common_torch_free_exact(self) -> dict[str, Any] | None:
        """:meth:`common` without torch when ``common.pt`` holds no more of torch than dtypes
        (they come as ``torch_save_object.TorchRef``; ``torch.save`` of the result gives the
        same bytes as of :meth:`common`'s), else None."""
        from ckpt_tool.formats.containers.torch_zip.torch_save_object import load_exact

        f = self.root / COMMON_FILE
        if f.is_file():
            if self.verify:
                from ckpt_tool.formats.containers.torch_zip.archive_check import check_file

                check_file(f, COMMON_FILE)
            state = load_exact(f, trust=self.trust)
        else:  # Megatron-Core 0.19: the common_state object's torch.save([state])
            obj = _common_object(self.metadata().objects)
            payload = None if obj is None else load_exact(
                self._item_bytes(obj), trust=self.trust)
            state = payload[0] if isinstance(payload, list) and len(payload) == 1 else None
        return state if isinstance(state, dict) else None

    def _item_bytes(self, o: ObjectMeta) -> bytes:
        from ckpt_tool.formats.containers.dcp.dcp_items import read_item_bytes

        return read_item_bytes(self.root, o.file, o.byte_offset, o.byte_length,
                               verify=self.verify)

    def object_item_torch_free(self, unique_key: str) -> bytes | None:
        """``torch.save([read_object(unique_key)])``'s bytes (what a torch_dist writer
        stores for it) made without torch when its payload holds no more of torch than dtypes
        (``torch_save_object``), else None."""
        from ckpt_tool.formats.containers.dcp.dcp_items import read_item_bytes
        from ckpt_tool.formats.containers.torch_zip.torch_save_object import (load_exact,
                                                                              object_item)

        o = self._object_meta(unique_key)
        data = read_item_bytes(self.root, o.file, o.byte_offset, o.byte_length,
                               verify=self.verify)
        payload = load_exact(data, trust=self.trust)
        if payload is None:
            return None
        return object_item(payload[0] if isinstance(payload, list) and len(payload) == 1
                           else payload)

    def stored_archives(self, chunks: Any) -> list[tuple[Path, int | None, int | None]]:
        """The items storing ``chunks`` (see :meth:`Reader.stored_archives`)."""
        from ckpt_tool.formats.containers.dcp.dcp_items import item_ranges

        return item_ranges(self.root, chunks)

    def read(self, key: str, slices: tuple[slice, ...] | None = None) -> Any:
        """The global tensor ``key`` (or ``slices`` of it), assembled from its stored chunks."""
        from ckpt_tool.formats.containers.dcp.dcp_items import assemble, load_chunk_view

        return assemble(self._tensor_meta(key), slices,
                        lambda c: load_chunk_view(self.root, c, trust=self.trust,
                                                  verify=self.verify))

    def read_object(self, unique_key: str) -> Any:
        """The payload of a ShardedObject (``rng_state/shard_0.0_1.2``)."""
        import io

        from ckpt_tool.formats.containers.dcp.dcp_items import read_item_bytes
        from ckpt_tool.formats.containers.pickle.safe_pickle import load_torch_file

        o = self._object_meta(unique_key)
        data = read_item_bytes(self.root, o.file, o.byte_offset, o.byte_length,
                               verify=self.verify)
        payload = load_torch_file(io.BytesIO(data), trust=self.trust, verify=False)
        # MCore stores torch.save([obj.data]) for a ShardedObject's bytes item.
        return payload[0] if isinstance(payload, list) and len(payload) == 1 else payload


class ZarrReader(McoreDistReader):
    """``sharded_backend: zarr``: one zarr v2 array directory per tensor."""

    format_name = "zarr"

    def sharded_metadata(self) -> tuple[dict[str, TensorMeta], list[ObjectMeta], dict[str, Any]]:
        from ckpt_tool.formats.mcore_dist.zarr_reader import scan_zarr_dir

        tensors, objects = scan_zarr_dir(self.root)
        chunk_files = sum(len(t.chunks) for t in tensors.values())
        return tensors, objects, {"arrays": len(tensors), "chunk_files": chunk_files,
                                  "object_files": len(objects)}

    def _object_payload_torch_free(self, obj: ObjectMeta) -> Any:
        from ckpt_tool.formats.common_state import load_torch_free

        return load_torch_free(self.root / str(obj.file), trust=self.trust)

    def read(self, key: str, slices: tuple[slice, ...] | None = None) -> Any:
        """The global tensor ``key`` (or ``slices`` of it) from its chunk files."""
        from ckpt_tool.formats.containers.dcp.dcp_items import assemble
        from ckpt_tool.formats.mcore_dist.zarr_reader import load_zarr_chunk

        meta = self._tensor_meta(key)
        try:
            za = json.loads((self.root / key / ".zarray").read_text(encoding="utf-8"))
            chunk_shape = tuple(int(c) for c in za["chunks"])
        except (OSError, ValueError, KeyError) as exc:
            raise CorruptCheckpointError(f"unreadable .zarray of {key} ({exc})",
                                         path=self.root) from None
        return assemble(meta, slices,
                        lambda c: load_zarr_chunk(self.root, meta, c, chunk_shape))

    def read_object(self, unique_key: str) -> Any:
        """The payload of a ShardedObject file (``<key>/shard_*.pt``)."""
        from ckpt_tool.formats.containers.pickle.safe_pickle import load_torch_file

        o = self._object_meta(unique_key)
        return load_torch_file(self.root / str(o.file), trust=self.trust, verify=self.verify)


def _torch_free_or_none(source: Any, trust: bool, where: Path) -> Any:
    """``load_torch_free`` of ``source``, or None when that needs torch or fails."""
    from ckpt_tool.errors import CkptError
    from ckpt_tool.formats.common_state import load_torch_free
    from ckpt_tool.formats.containers.pickle.torch_stand_ins import NeedsTorch

    try:
        return load_torch_free(source, trust=trust, where=where, torch_fallback=False)
    except (NeedsTorch, CkptError):
        return None


TORCH_DIST = register(Format(
    name="torch_dist", sniff=_sniffer("torch_dist"), open=TorchDistReader, remote=True,
    description="Megatron-Core dist checkpoint, torch_dist backend (DCP .metadata + .distcp)"))
ZARR = register(Format(
    name="zarr", sniff=_sniffer("zarr"), open=ZarrReader,
    description="Megatron-Core dist checkpoint, zarr backend (one zarr array per tensor)"))
