"""One ``.distcp`` data file written item after item, at the speed of writing its bytes.

Each tensor item is the ``torch.save`` archive of the chunk
(:class:`ckpt_tool.formats.containers.torch_zip.torch_zip_write.TensorArchive`: the same bytes, written from the
chunk's raw buffer with two small header writes around one write of the data); a bytes item
is its payload, as DCP stores it. Tensors the raw writer does not cover (ZIP64-sized, float8,
...) go through DCP's own ``_write_item`` (``torch.save``) into the same file. Only one item's
data is held at a time; the file is fsynced before the results are returned.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ckpt_tool._program import interrupts_deferred
from ckpt_tool.digests import DigestedFile, digested_file
from ckpt_tool.formats.containers.torch_zip.torch_zip_write import TensorArchive, supported
from ckpt_tool.formats.write_guard import GuardedStream

__all__ = ["write_dcp_file", "raw_buffer"]


def raw_buffer(data: Any) -> memoryview:
    """The C-order bytes of a contiguous CPU tensor or numpy array, without a copy."""
    import numpy as np

    if hasattr(data, "element_size"):  # a torch tensor
        from ckpt_tool.formats.write_pieces import tensor_bytes

        return tensor_bytes(data) if data.numel() else memoryview(b"")
    return memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))


def _storage_info(storage_key: str, offset: int, length: int) -> Any:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(storage_key, offset, length)


def _through_torch(f: Any, path: str, data: Any, item: Any, storage_key: str,
                   transforms: Any, serialization_format: Any) -> Any:
    """DCP's own item writer (``torch.save``) into ``f`` (a torch tensor is made of a raw
    numpy piece first)."""
    import torch
    from torch.distributed.checkpoint.filesystem import _write_item

    if not isinstance(data, torch.Tensor):
        want = item.tensor_data.properties.dtype
        data = torch.from_numpy(data.copy()).view(want).reshape(tuple(item.tensor_data.chunk.sizes))
    f.flush()
    stream = GuardedStream(f, path)  # a full disk: the OSError, not an abort
    try:
        with interrupts_deferred():  # torch.save calls stream.write from C code
            return _write_item(transforms, stream, data, item, storage_key, serialization_format)
    finally:
        stream.check()


def write_dcp_file(path: str, storage_key: str, items: Sequence[Any],
                   resolve: Callable[[Any], Any], *, transforms: Any, serialization_format: Any,
                   on_written: Callable[[Any, int], None], sync: bool = True,
                   digest: str | None = None) -> list:
    """Write ``items`` (bytes items first, then tensors, in the given order) into a new file
    ``path``; ``resolve(item)`` gives each item's data (``io.BytesIO``, a contiguous CPU
    tensor or a numpy array of the chunk's elements); ``on_written(item, nbytes)`` after each
    tensor. ``digest``: ``"sha256"``/``"crc32"`` of the file for the integrity manifest,
    computed on a thread that follows the writer (``ckpt_tool.digests``). Returns DCP's
    ``WriteResult`` per item."""
    with digested_file(path, digest, sync=sync) as out:
        return _write_items(out, path, storage_key, items, resolve, transforms,
                            serialization_format, on_written)


def _write_items(out: DigestedFile, path: str, storage_key: str, items: Sequence[Any],
                 resolve: Callable[[Any], Any], transforms: Any, serialization_format: Any,
                 on_written: Callable[[Any, int], None]) -> list:
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    plain = not getattr(transforms, "extensions", None)
    ordered = ([i for i in items if i.type == WriteItemType.BYTE_IO]
               + [i for i in items if i.type != WriteItemType.BYTE_IO])
    results = []
    f = out.file
    for item in ordered:
        data = resolve(item)
        offset = f.tell()
        if item.type == WriteItemType.BYTE_IO and plain:
            length = out.write(data.getbuffer())
            result = WriteResult(index=item.index, size_in_bytes=length,
                                 storage_data=_storage_info(storage_key, offset, length))
        elif item.type != WriteItemType.BYTE_IO and plain and _raw_ok(item, data):
            chunk = item.tensor_data.chunk
            archive = TensorArchive(_dtype_name(item), tuple(chunk.sizes), _nbytes(data))
            length = archive.write(out.write, raw_buffer(data), with_crcs=True)
            result = WriteResult(index=item.index, size_in_bytes=length,
                                 storage_data=_storage_info(storage_key, offset, length))
        else:
            out.bypassed()  # torch.save writes into the stream: the file is digested only
            result = _through_torch(f, path, data, item, storage_key, transforms,
                                    serialization_format)
        results.append(result)
        nbytes = _nbytes(data) if item.type != WriteItemType.BYTE_IO else 0
        del data  # on disk: let it go before resolving the next item
        if item.type != WriteItemType.BYTE_IO:
            on_written(item, nbytes)
        out.position = f.tell()  # some items were written around ``out``
        out.advanced()  # what has reached the OS so far
    return results


def _dtype_name(item: Any) -> str:
    return str(item.tensor_data.properties.dtype).removeprefix("torch.")


def _nbytes(data: Any) -> int:
    return int(data.nbytes)


def _raw_ok(item: Any, data: Any) -> bool:
    return supported(_dtype_name(item), _nbytes(data))
