"""What ``torch.distributed.checkpoint.save`` decides for one saving process, without torch.

The streaming DCP writers (``dcp_streaming``) hand DCP a fixed list of items and let its
protocol plan them and write ``.metadata``. For a single process that protocol is
deterministic, and this module reproduces it as plain data: the items
(:class:`PlannedItem`, one per target chunk, then the bytes items), their data files
(:func:`assign_files`: the same buckets and order the DCP writers use) and the ``Metadata``
object (:func:`metadata_pickle`), pickled with references to torch's classes written as
opcodes (``pickle_refs``), so that ``pickle.load`` of it with torch gives what DCP itself
would have pickled (``tests/formats/test_dcp_raw_save.py`` compares the two):

``Metadata(state_dict_metadata={fqn: TensorStorageMetadata(TensorProperties(dtype), size,
[ChunkStorageMetadata(offsets, sizes), ...]) | BytesStorageMetadata()},
planner_data, storage_data={MetadataIndex(fqn, offset, index): _StorageInfo(file, offset,
length)}, storage_meta=StorageMeta(checkpoint_id, save_id), version="1.0.0",
all_local_plans=[SavePlan(items=[WriteItem(...)...])])`` (the last one as Megatron-Core
>= 0.11 stores it). Pure: no I/O, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ckpt_tool.errors import UsageError
from ckpt_tool.formats.containers.pickle.pickle_refs import Call, dumps, instance, ref
from ckpt_tool.model import TensorMeta, dtype_itemsize
from ckpt_tool.planning.overlap import grid_tiling

__all__ = ["PlannedItem", "check_grid", "planned_items", "rank_plans", "assign_files",
           "metadata_pickle", "DCP_VERSION"]

#: ``torch.distributed.checkpoint.metadata`` ``CURRENT_DCP_VERSION`` (torch >= 2.4)
DCP_VERSION = "1.0.0"
_MD = "torch.distributed.checkpoint.metadata"
_PLANNER = "torch.distributed.checkpoint.planner"
_REFS: dict[tuple[str, str], type] = {}
_SHARD, _BYTE_IO = 2, 3  # WriteItemType values


def _ref(module: str, name: str) -> type:
    if (module, name) not in _REFS:
        _REFS[(module, name)] = ref(module, name)
    return _REFS[(module, name)]


@dataclass(frozen=True)
class PlannedItem:
    """One DCP item: a tensor chunk (``offsets`` set) or a bytes item (``offsets`` None)."""

    fqn: str
    offsets: tuple[int, ...] | None = None
    sizes: tuple[int, ...] = ()
    dtype: str = ""
    shape: tuple[int, ...] = ()

    @property
    def is_bytes(self) -> bool:
        return self.offsets is None

    @property
    def nbytes(self) -> int:
        """The chunk's bytes (what DCP's writers balance files by); 0 for a bytes item."""
        return 0 if self.is_bytes else math.prod(self.sizes) * dtype_itemsize(self.dtype)


def check_grid(t: TensorMeta) -> None:
    """Every chunk inside the global shape, no two overlapping, and the chunk volumes adding
    up to the tensor's (what DCP's global plan validation checks, and holes)."""
    volume = 0
    for c in t.chunks:
        if len(c.offsets) != len(t.shape) or len(c.sizes) != len(t.shape) or any(
                o < 0 or s < 0 or o + s > n for o, s, n in zip(c.offsets, c.sizes, t.shape)):
            raise UsageError(f"tensor {t.key}: chunk at {list(c.offsets)} size {list(c.sizes)} "
                             f"is outside its global shape {list(t.shape)}")
        volume += math.prod(c.sizes)
    if volume != math.prod(t.shape):
        raise UsageError(f"tensor {t.key}: target chunks hold {volume} elements, the tensor "
                         f"{math.prod(t.shape)} (the chunk grid must tile the tensor)")
    boxes = sorted((tuple(c.offsets), tuple(c.sizes)) for c in t.chunks if math.prod(c.sizes))
    if grid_tiling(t.shape, boxes):  # the usual layouts, in one pass
        return
    for n, (oa, sa) in enumerate(boxes):  # sorted by offsets: a later box starting past
        for ob, sb in boxes[n + 1:]:     # this one's end along axis 0 cannot overlap it
            if t.shape and ob[0] >= oa[0] + sa[0]:
                break
            if all(b < a + m and a < b + k for a, m, b, k in zip(oa, sa, ob, sb)):
                raise UsageError(f"tensor {t.key}: target chunks at {list(oa)} and {list(ob)} "
                                 "overlap (the chunk grid must tile the tensor)")


def planned_items(tensors: Sequence[TensorMeta], object_keys: Sequence[str]) -> list[PlannedItem]:
    """One item per target chunk (the whole tensor when it has none), then the bytes items."""
    items = []
    for t in tensors:
        if t.chunks:
            check_grid(t)
        chunks = [(c.offsets, c.sizes) for c in t.chunks] or [((0,) * len(t.shape), t.shape)]
        items += [PlannedItem(t.key, tuple(int(v) for v in o), tuple(int(v) for v in s),
                              t.dtype, tuple(int(v) for v in t.shape)) for o, s in chunks]
    return items + [PlannedItem(k) for k in object_keys]


def rank_plans(items: Sequence[PlannedItem], world: int,
               file_of: Callable[[PlannedItem], str | None] | None = None
               ) -> list[list[PlannedItem]]:
    """Each of ``world`` saving ranks' items (its local plan), as the streaming DCP path
    splits them (``dcp_streaming.run_dcp_save``): items bound for one named file stay
    together (two ranks never write one file), the groups balanced by bytes
    (``parallel.split_by_bytes``; a bytes item counts 1), a rank's items grouped in the
    order their groups first appear in ``items``."""
    from ckpt_tool.parallel import split_by_bytes

    if world <= 1:
        return [list(items)]
    groups: dict[Any, list[PlannedItem]] = {}
    for n, item in enumerate(items):
        groups.setdefault((file_of(item) if file_of else None) or n, []).append(item)
    shares = split_by_bytes([(g, sum(max(1, i.nbytes) for i in groups[g])) for g in groups],
                            world)
    return [[i for g in share for i in groups[g]] for share in shares]


def assign_files(items: Sequence[PlannedItem], files: int, prefix: str = "__0_",
                 file_of: Callable[[PlannedItem], str | None] | None = None
                 ) -> list[tuple[str, list[PlannedItem]]]:
    """``[(file name, its items in write order)]``: with ``file_of`` naming every tensor's
    file, those files (bytes items join their named file, else the first); otherwise
    ``files`` buckets, bytes items round robin, tensors largest first onto the least-filled
    bucket, ``{prefix}{n}.distcp`` for the non-empty ones. In a file bytes items come first."""
    named = [file_of(i) if file_of else None for i in items]
    if any(not i.is_bytes for i in items) and all(
            n is not None for n, i in zip(named, items) if not i.is_bytes):
        buckets: dict[str, list[PlannedItem]] = {}
        for name, item in zip(named, items):
            if not item.is_bytes:
                buckets.setdefault(name, []).append(item)
        first = sorted(buckets)[0]
        for name, item in zip(named, items):
            if item.is_bytes:
                buckets[name if name in buckets else first].append(item)
        out = [(name, buckets[name]) for name in sorted(buckets)]
    else:
        lists: list[list[PlannedItem]] = [[] for _ in range(max(1, files))]
        sizes = [0] * len(lists)
        for n, item in enumerate(i for i in items if i.is_bytes):
            lists[n % len(lists)].append(item)
        for item in sorted((i for i in items if not i.is_bytes), key=lambda i: i.nbytes,
                           reverse=True):
            target = sizes.index(min(sizes))
            lists[target].append(item)
            sizes[target] += item.nbytes
        out = [(f"{prefix}{n}.distcp", b) for n, b in enumerate(b for b in lists if b)]
    return [(name, [i for i in b if i.is_bytes] + [i for i in b if not i.is_bytes])
            for name, b in out]


class _Builder:
    """The pickled objects, shared where DCP shares them (one TensorProperties and size per
    tensor)."""

    def __init__(self) -> None:
        self._props: dict[str, Any] = {}
        self._sizes: dict[tuple[int, ...], Call] = {}
        self._chunks: dict[tuple[str, tuple[int, ...]], Any] = {}

    def size(self, values: Sequence[int]) -> Call:
        """``torch.Size(values)``, one object per value (immutable: pickled once, then
        memo references; a layer's chunks repeat their sizes across tensors and states)."""
        key = tuple(values)
        found = self._sizes.get(key)
        if found is None:
            found = self._sizes[key] = Call(_ref("torch", "Size"), (key,))
        return found

    def properties(self, dtype: str) -> Any:
        if dtype not in self._props:  # TensorProperties.__getstate__: a tuple
            self._props[dtype] = instance(_ref(_MD, "TensorProperties"), (
                _ref("torch", dtype),
                Call(_ref("torch.serialization", "_get_layout"), ("torch.strided",)),
                False, Call(_ref(_MD, "_MEM_FORMAT_ENCODING"), (0,)), False))
        return self._props[dtype]

    def chunk(self, item: PlannedItem) -> Any:
        """The item's ``ChunkStorageMetadata``, one per chunk: the tensor's entry in
        ``state_dict_metadata`` and its ``WriteItem`` share it (as in DCP, whose global
        plan appends each write item's chunk)."""
        key = (item.fqn, item.offsets or ())
        found = self._chunks.get(key)
        if found is None:
            found = self._chunks[key] = instance(_ref(_MD, "ChunkStorageMetadata"), {
                "offsets": self.size(item.offsets or ()), "sizes": self.size(item.sizes)})
        return found

    def index(self, item: PlannedItem, index: int | None) -> Any:
        state: dict[str, Any] = {"fqn": item.fqn, "index": index}
        if not item.is_bytes:
            state["offset"] = self.size(item.offsets or ())
        return instance(_ref(_MD, "MetadataIndex"), state)

    def write_item(self, item: PlannedItem) -> Any:
        tensor_data = None if item.is_bytes else instance(_ref(_PLANNER, "TensorWriteData"), {
            "chunk": self.chunk(item), "properties": self.properties(item.dtype),
            "size": self.size(item.shape)})
        return instance(_ref(_PLANNER, "WriteItem"), {
            "index": self.index(item, None),
            "type": Call(_ref(_PLANNER, "WriteItemType"), (_BYTE_IO if item.is_bytes else _SHARD,)),
            "bytes_io_data": None, "tensor_data": tensor_data})


def metadata_pickle(items: Sequence[PlannedItem],
                    written: Sequence[tuple[PlannedItem, str, int, int]], *,
                    checkpoint_id: str, save_id: str, planner_data: Any = None,
                    keep_local_plans: bool = True,
                    plans: Sequence[Sequence[PlannedItem]] | None = None) -> bytes:
    """The ``.metadata`` bytes for ``items`` (in global plan order: every rank's local plan
    in rank order), stored as ``written``: ``(item, file, offset, length)`` in the order
    the ranks and their files were written. ``plans``: the local plans (``all_local_plans``;
    default one, ``items``)."""
    b = _Builder()
    state_md: dict[str, Any] = {}
    chunks: dict[str, list] = {}
    chunk_index: dict[tuple[str, tuple[int, ...]], int] = {}
    for item in items:
        if item.is_bytes:
            state_md[item.fqn] = instance(_ref(_MD, "BytesStorageMetadata"))
            continue
        if item.fqn not in chunks:
            chunks[item.fqn] = []
            state_md[item.fqn] = instance(_ref(_MD, "TensorStorageMetadata"), {
                "properties": b.properties(item.dtype), "size": b.size(item.shape),
                "chunks": chunks[item.fqn]})
        chunk_index[(item.fqn, item.offsets or ())] = len(chunks[item.fqn])
        chunks[item.fqn].append(b.chunk(item))
    storage = {}
    for item, file, offset, length in written:
        index = None if item.is_bytes else chunk_index[(item.fqn, item.offsets or ())]
        storage[b.index(item, index)] = instance(
            _ref("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
            {"relative_path": file, "offset": offset, "length": length})
    state: dict[str, Any] = {
        "state_dict_metadata": state_md,
        "planner_data": planner_data,
        "storage_data": storage,
        "storage_meta": instance(_ref(_MD, "StorageMeta"), {
            "checkpoint_id": checkpoint_id, "save_id": save_id, "load_id": None,
            "modules": []}),
        "version": DCP_VERSION,
        "all_local_plans": None,
    }
    if keep_local_plans:
        state["all_local_plans"] = [instance(_ref(_PLANNER, "SavePlan"), {
            "items": [b.write_item(i) for i in plan], "storage_data": None,
            "planner_data": {}, "usable": True}) for plan in (plans or [items])]
    return dumps(instance(_ref(_MD, "Metadata"), state), list(_REFS.values()))
