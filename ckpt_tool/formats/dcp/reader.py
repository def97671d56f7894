"""Plain PyTorch DCP checkpoints (``torch.distributed.checkpoint.save``: FSDP2, torchtitan, ...).

A directory with a ``.metadata`` pickle and ``*.distcp`` data files, and *without* Megatron-Core's
``metadata.json`` (those are ``torch_dist``/``zarr``, registered before this format). Tensors
are keyed by their DCP fqn; bytes items (non-tensor values: ``torch.save`` of the object) become
``ObjectMeta`` with ``unique_key`` = fqn.

A save without collectives (``dcp.save(..., use_collectives=False)``) writes no global
``.metadata`` but one ``__{rank}.metadata`` per rank describing that rank's items (data in
``__{rank}_{n}.distcp``); they are merged into one ``CheckpointMeta`` (a chunk or bytes item
written by several ranks, i.e. replicated, is kept once: the lowest rank's copy).

The metadata path imports no torch (``dcp_metadata.read_dcp_metadata_torch_free``); reads go through
``dcp_items`` and the allowlisting unpickler.
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

from ckpt_tool.errors import CkptError, CorruptCheckpointError, InputError, UnsupportedError
from ckpt_tool.formats.save_dir import resolve_checkpoint_dir
from ckpt_tool.formats.base import Format, Reader, register
from ckpt_tool.model import CheckpointMeta, ObjectMeta, TensorMeta
from ckpt_tool.storage import as_path, is_remote, read_range

__all__ = ["DcpReader", "DCP", "sniff", "metadata_files", "merge_metas", "nest"]

METADATA_FILE = ".metadata"
MCORE_METADATA_JSON = "metadata.json"
_RANK_METADATA_RE = re.compile(r"__(\d+)\.metadata")
# The common summary reads bytes items no larger than this, at most this many of them.
_SUMMARY_MAX_BYTES = 64 * 1024
_SUMMARY_MAX_ITEMS = 256
_SUMMARY_MAX_STR = 200
_SUMMARY_MAX_LIST = 16
# Megatron-Core ShardedObject unique keys (``rng_state/shard_0.1_2.2``): objects, not common state
_SHARDED_OBJECT_RE = re.compile(r"/shard_[\d.]+?(?:_[\d.]+)?$")


def _checkpoint_dir(path: Path) -> Path:
    p = as_path(path)
    if p.is_file() and _RANK_METADATA_RE.fullmatch(p.name):
        return p.parent
    return resolve_checkpoint_dir(p)


def metadata_files(root: Path) -> list[tuple[int | None, str]]:
    """``[(None, ".metadata")]`` for a global save, else ``[(rank, "__{rank}.metadata"), ...]``
    sorted by rank (torch's loader also prefers the global file when both exist)."""
    if (root / METADATA_FILE).is_file():
        return [(None, METADATA_FILE)]
    ranks = []
    for f in root.glob("__*.metadata"):
        m = _RANK_METADATA_RE.fullmatch(f.name)
        if m and f.is_file():
            ranks.append(int(m.group(1)))
    return [(r, f"__{r}.metadata") for r in sorted(ranks)]


def sniff(path: Path) -> str | None:
    """A directory with ``.metadata`` (or ``__{rank}.metadata``) and no ``metadata.json``."""
    try:
        d = _checkpoint_dir(path)
    except InputError as exc:
        return exc.message
    if not d.is_dir():
        return "not a directory"
    if (d / MCORE_METADATA_JSON).exists():
        return f"has {MCORE_METADATA_JSON} (a Megatron-Core dist checkpoint)"
    try:
        if metadata_files(d):
            return None
        if (d / (METADATA_FILE + ".tmp")).exists() or any(d.glob("*.distcp")):
            return (f"*.distcp files but no {METADATA_FILE} (an interrupted DCP save: "
                    f"{METADATA_FILE} is written last)")
    except OSError as exc:
        return str(exc)
    return f"no {METADATA_FILE} file"


def merge_metas(parts: list[tuple[str, dict[str, TensorMeta], list[ObjectMeta]]]
                ) -> tuple[dict[str, TensorMeta], list[ObjectMeta], int]:
    """Merge per-rank ``(name, tensors, objects)`` into one view.

    Chunks are united by offsets and bytes items by key; an item several ranks wrote
    (replicated) is kept once, from the first part. Returns the number of such duplicates.
    A key with different dtypes or global shapes, or a chunk with different sizes at the same
    offsets, raises CorruptCheckpointError.
    """
    tensors: dict[str, TensorMeta] = {}
    chunk_maps: dict[str, dict[tuple[int, ...], Any]] = {}
    first: dict[str, str] = {}
    objects: dict[str, ObjectMeta] = {}
    duplicates = 0
    for name, part_tensors, part_objects in parts:
        for key, t in part_tensors.items():
            if key not in tensors:
                tensors[key], first[key] = t, name
                chunk_maps[key] = {c.offsets: c for c in t.chunks}
                continue
            prev = tensors[key]
            if (prev.dtype, prev.shape) != (t.dtype, t.shape):
                raise CorruptCheckpointError(
                    f"tensor {key}: {first[key]} says {prev.dtype} {list(prev.shape)}, {name} "
                    f"says {t.dtype} {list(t.shape)}")
            cmap = chunk_maps[key]
            for c in t.chunks:
                old = cmap.get(c.offsets)
                if old is None:
                    cmap[c.offsets] = c
                elif old.sizes != c.sizes:
                    raise CorruptCheckpointError(
                        f"tensor {key}: chunk at {list(c.offsets)} has sizes {list(old.sizes)} "
                        f"in {first[key]} but {list(c.sizes)} in {name}")
                else:
                    duplicates += 1
            if prev.origin is None and t.origin is not None:
                tensors[key] = TensorMeta(prev.key, prev.dtype, prev.shape, prev.chunks,
                                          prev.stored_shape, t.origin)
        for o in part_objects:
            if o.unique_key in objects:
                duplicates += 1
            else:
                objects[o.unique_key] = o
    for key, cmap in chunk_maps.items():
        t = tensors[key]
        if len(cmap) != len(t.chunks):
            tensors[key] = TensorMeta(t.key, t.dtype, t.shape,
                                      tuple(sorted(cmap.values(), key=lambda c: c.offsets)),
                                      t.stored_shape, t.origin)
    objs = sorted(objects.values(), key=lambda o: o.unique_key)
    return tensors, objs, duplicates


def _storage_meta(sm: Any) -> dict[str, Any] | None:
    from ckpt_tool.formats.common_state import jsonable

    if sm is None:
        return None
    out = {}
    for name in ("checkpoint_id", "save_id", "load_id", "modules"):
        v = getattr(sm, name, None)
        if v is not None and v != []:
            out[name] = jsonable(v)
    return out


def _is_small_value(v: Any, depth: int = 0) -> bool:
    if v is None or isinstance(v, (bool, int, float)):
        return True
    if isinstance(v, str):
        return len(v) <= _SUMMARY_MAX_STR
    if isinstance(v, (list, tuple)) and depth == 0:
        return len(v) <= _SUMMARY_MAX_LIST and all(_is_small_value(x, 1) for x in v)
    return False


class DcpReader(Reader):
    """Reader of a plain DCP checkpoint directory (see the module docstring)."""

    format_name = "dcp"

    def __init__(self, path: Path, *, trust: bool = False):
        super().__init__(path, trust=trust)
        self.root = _checkpoint_dir(path)
        if not self.root.is_dir():
            raise InputError("not a directory", path=self.root,
                             hint="pass the DCP checkpoint directory")
        self._meta: CheckpointMeta | None = None
        self._object_transforms: dict[str, tuple[str, ...]] = {}

    # -- metadata ---------------------------------------------------------------------------
    def metadata(self) -> CheckpointMeta:
        """Tensors, bytes items, a summary of small bytes values and DCP facts; no tensor bytes."""
        if self._meta is not None:
            return self._meta
        from ckpt_tool.formats.containers.dcp.dcp_metadata import (dcp_tensor_metas,
                                                                   read_dcp_metadata_torch_free)

        files = metadata_files(self.root)
        if not files:
            raise InputError(f"no {METADATA_FILE} file", path=self.root,
                             hint="not a complete DCP checkpoint: the save may have been "
                                  "interrupted")
        parts, mds = [], []
        for rank, name in files:
            md = read_dcp_metadata_torch_free(self.root, trust=self.trust, rank=rank)
            mds.append(md)
            tensors, objects = dcp_tensor_metas(md)
            parts.append((name, tensors, objects))
            for idx, info in (getattr(md, "storage_data", None) or {}).items():
                td = tuple(getattr(info, "transform_descriptors", None) or ())
                if getattr(idx, "offset", None) is None and td:
                    self._object_transforms.setdefault(idx.fqn, td)
        if len(parts) == 1:
            tensors, objects, duplicates = parts[0][1], parts[0][2], 0
        else:
            try:
                tensors, objects, duplicates = merge_metas(parts)
            except CorruptCheckpointError as exc:
                exc.path = exc.path or str(self.root)
                raise
        md0 = mds[0]
        referenced = ({c.file for t in tensors.values() for c in t.chunks if c.file}
                      | {o.file for o in objects if o.file})
        on_disk = {f.name for f in self.root.glob("*.distcp")}
        versions = sorted({str(v) for v in (getattr(m, "version", None) for m in mds)
                           if v is not None})
        metadata_class = getattr(type(md0), "__stand_in_for__", type(md0).__qualname__)
        transforms = sorted({t for tm in tensors.values() for c in tm.chunks
                             for t in c.transforms}
                            | {t for td in self._object_transforms.values() for t in td})
        extras: dict[str, Any] = {
            "dcp_version": versions[0] if len(versions) == 1 else (versions or None),
            "metadata_files": [name for _, name in files],
            "per_rank_metadata": files[0][0] is not None,
            "metadata_class": metadata_class,
            "storage_meta": _storage_meta(getattr(md0, "storage_meta", None)),
            "tensor_items": len(tensors),
            "bytes_items": len(objects),
            "chunks": sum(len(t.chunks) for t in tensors.values()),
            "data_files": len(referenced),
            "data_files_on_disk": len(on_disk),
            "missing_data_files": sorted(referenced - on_disk),
            "transforms": transforms,
            "has_planner_data": bool(getattr(md0, "planner_data", None)),
        }
        if duplicates:
            extras["replicated_items"] = duplicates
        mcore = _megatron_core_signs(self.root, metadata_class, objects)
        if mcore:
            # Megatron-Core writes metadata.json last and refuses a directory without it
            extras["megatron_core_save"] = mcore
            extras["note"] = (f"looks like an interrupted Megatron-Core save ({mcore} but no "
                              f"{MCORE_METADATA_JSON}); read as plain DCP")
        self._meta = CheckpointMeta(
            format=self.format_name, root=str(self.root), tensors=tensors,
            objects=tuple(objects), common=self._summary(objects), extras=extras,
            version=None if not versions else ",".join(versions))
        return self._meta

    def _summary(self, objects: list[ObjectMeta]) -> dict[str, Any]:
        """``{"values": {fqn: value}}`` for the bytes items that hold small plain values
        (numbers, short strings, short lists of them), loaded torch-free; others are left out."""
        from ckpt_tool.formats.common_state import jsonable, load_torch_free
        from ckpt_tool.formats.containers.pickle.torch_stand_ins import NeedsTorch

        small = [o for o in objects if o.file and o.byte_length is not None
                 and o.byte_offset is not None and o.byte_length <= _SUMMARY_MAX_BYTES
                 and o.unique_key not in self._object_transforms][:_SUMMARY_MAX_ITEMS]
        values: dict[str, Any] = {}
        unreadable: dict[str, str] = {}
        by_file: dict[str, list[ObjectMeta]] = {}
        for o in small:
            by_file.setdefault(str(o.file), []).append(o)
        for file, objs in sorted(by_file.items()):
            try:
                # an object is read item by item (ranged GETs), never whole
                f = _ItemRanges(self.root / file) if is_remote(self.root) \
                    else open(self.root / file, "rb")
            except OSError as exc:
                for o in objs:
                    unreadable[o.unique_key] = f"cannot open {file} ({exc.strerror})"
                continue
            with f:
                for o in sorted(objs, key=lambda o: o.byte_offset or 0):
                    f.seek(int(o.byte_offset or 0))
                    try:
                        data = f.read(int(o.byte_length or 0))
                    except FileNotFoundError:
                        data = b""
                    if len(data) != o.byte_length:
                        unreadable[o.unique_key] = f"{file} is truncated"
                        continue
                    try:
                        v = load_torch_free(data, trust=self.trust, where=self.root / file,
                                                  torch_fallback=False)
                    except NeedsTorch:
                        continue
                    except CkptError as exc:
                        unreadable[o.unique_key] = exc.message
                        continue
                    if _is_small_value(v):
                        values[o.unique_key] = jsonable(v)
        out: dict[str, Any] = {}
        if values:
            out["values"] = dict(sorted(values.items()))
        if unreadable:
            out["unreadable"] = dict(sorted(unreadable.items()))
        return out

    # -- data -------------------------------------------------------------------------------
    def stored_archives(self, chunks: Any) -> list[tuple[Path, int | None, int | None]]:
        """The items storing ``chunks`` (see :meth:`Reader.stored_archives`)."""
        from ckpt_tool.formats.containers.dcp.dcp_items import item_ranges

        return item_ranges(self.root, chunks)

    def read(self, key: str, slices: tuple[slice, ...] | None = None) -> Any:
        """The global tensor ``key`` (DCP fqn), or ``slices`` of it, assembled from its chunks."""
        from ckpt_tool.formats.containers.dcp.dcp_items import assemble, load_chunk_view

        return assemble(self._tensor_meta(key), slices,
                        lambda c: load_chunk_view(self.root, c, trust=self.trust,
                                                  verify=self.verify))

    def read_object(self, unique_key: str) -> Any:
        """The value of a bytes item (fqn): DCP stores ``torch.save(value)``, loaded safely."""
        from ckpt_tool.formats.containers.dcp.dcp_items import read_item_bytes
        from ckpt_tool.formats.containers.pickle.safe_pickle import load_torch_file

        o = self._object_meta(unique_key)
        if unique_key in self._object_transforms:
            raise UnsupportedError(f"stream transforms {list(self._object_transforms[unique_key])}"
                                   " are not supported yet")
        data = read_item_bytes(self.root, o.file, o.byte_offset, o.byte_length,
                               verify=self.verify)
        try:
            return load_torch_file(io.BytesIO(data), trust=self.trust, verify=False)
        except CorruptCheckpointError as exc:
            exc.path = exc.path or str(self.root / str(o.file))
            raise

    def read_object_torch_free(self, unique_key: str) -> Any:
        """:meth:`read_object` with tensors as placeholders, through the same allowlisting
        unpickler, without importing torch unless the pickle needs it (for validation)."""
        from ckpt_tool.formats.common_state import load_torch_free
        from ckpt_tool.formats.containers.dcp.dcp_items import read_item_bytes

        o = self._object_meta(unique_key)  # (validate checks the CRCs in its own pass)
        data = read_item_bytes(self.root, o.file, o.byte_offset, o.byte_length, verify=False)
        return load_torch_free(data, trust=self.trust, where=self.root / str(o.file))

    def objects_with_transforms(self) -> frozenset[str]:
        """The bytes items stored through stream transforms (read by :meth:`metadata`)."""
        return frozenset(self._object_transforms)

    def check_common(self) -> None:
        """The CRC-32s of the bytes items the common state is made of."""
        from ckpt_tool.formats.containers.torch_zip.archive_check import check_many

        common = self.objects_in_common()
        if self.verify:
            check_many((self.root / str(o.file), o.byte_offset, o.byte_length)
                       for o in self.metadata().objects if o.unique_key in common
                       and o.file and o.byte_offset is not None and o.byte_length)

    def objects_in_common(self) -> frozenset[str]:
        """The bytes items that are the common state: all but Megatron-Core ShardedObjects
        (``key/shard_<offset>_<shape>``), which stay objects."""
        return frozenset(o.unique_key for o in self.metadata().objects
                         if not _SHARDED_OBJECT_RE.search(o.unique_key))

    def common(self) -> dict[str, Any]:
        """The common state: the bytes items (not ShardedObjects) nested again by the
        checkpoint's ``planner_data`` (``optimizer.param_groups.0.lr`` ->
        ``{"optimizer": {"param_groups": [{"lr": …}]}}``, as ``dcp_to_torch_save`` does); a
        key without a path stays flat. Loaded through the safe unpickler."""
        from ckpt_tool.formats.containers.dcp.dcp_metadata import read_dcp_metadata_torch_free

        keys = sorted(self.objects_in_common())
        paths: dict[str, Any] = {}
        for rank, _name in metadata_files(self.root):
            md = read_dcp_metadata_torch_free(self.root, trust=self.trust, rank=rank)
            paths.update(getattr(md, "planner_data", None) or {})
        return nest({k: self.read_object(k) for k in keys}, paths)


class _ItemRanges:
    """``seek`` + ``read`` of one object as one ranged GET per read (the summary's items)."""

    def __init__(self, path: Any):
        self._path, self._pos = path, 0

    def seek(self, pos: int) -> None:
        self._pos = pos

    def read(self, n: int) -> bytes:
        return read_range(self._path, self._pos, n)

    def __enter__(self) -> "_ItemRanges":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _megatron_core_signs(root: Path, metadata_class: Any, objects: list[ObjectMeta]) -> str:
    """What shows a DCP directory to be a Megatron-Core dist checkpoint's data (``""`` when
    nothing does): ``common.pt`` (0.12-0.18 write it first), Megatron-Core's ``MCoreMetadata``
    class of ``.metadata`` (0.15), the ``common_state`` object (0.19's common state)."""
    signs = []
    if (root / "common.pt").is_file():
        signs.append("common.pt")
    if "megatron" in str(metadata_class):
        signs.append("MCoreMetadata")
    if any(o.key == "common_state" for o in objects):
        signs.append("the common_state object of Megatron-Core 0.19")
    return " and ".join(signs)


def nest(flat: dict[str, Any], paths: dict[str, Any]) -> dict[str, Any]:
    """``{fqn: value}`` nested by ``paths[fqn]`` (a tuple of dict keys and list indices);
    a missing or unusable path keeps the fqn as a top-level key. Pure."""
    root: dict[Any, Any] = {}
    for fqn, value in flat.items():
        path = paths.get(fqn)
        if not isinstance(path, (tuple, list)) or not path:
            path = (fqn,)
        node = root
        ok = True
        for part in path[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                ok = False
                break
            node = nxt
        if ok and path[-1] not in node:
            node[path[-1]] = value
        else:
            root[fqn] = value
    return _lists(root)


def _lists(node: Any) -> Any:
    """Dicts keyed by 0..n-1 (list indices in a DCP path) back into lists."""
    if not isinstance(node, dict):
        return node
    out = {k: _lists(v) for k, v in node.items()}
    if out and all(isinstance(k, int) for k in out) and sorted(out) == list(range(len(out))):
        return [out[i] for i in range(len(out))]
    return out


DCP = register(Format(
    name="dcp", sniff=sniff, open=DcpReader, remote=True,
    description="PyTorch DCP checkpoint (torch.distributed.checkpoint: .metadata + .distcp; "
                "FSDP2, torchtitan), also per-rank __{rank}.metadata saves"))
