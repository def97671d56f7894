"""Low-level I/O of the Megatron-Core ``zarr`` checkpoint layout (zarr format v2 on a filesystem).

One directory per ShardedTensor key, ``<ckpt>/<key>/.zarray`` plus one uncompressed chunk file
per chunk (``0.0``, ``1.0``, ...). This module knows the bytes: dtype names (including the
``"bfloat16"`` name Megatron-Core patched into ``.zarray``), bit-exact torch <-> numpy
conversion, array creation and writes (:mod:`.zarr_v2`, no zarr-python) and reads with
tensorstore. It knows nothing of ShardedTensors;
:mod:`ckpt_tool.dist_checkpointing.strategies.zarr` builds on it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple, Union

import ml_dtypes
import numpy as np
import torch

from ckpt_tool.errors import CheckpointingException
from ckpt_tool.formats.mcore_dist.zarr_v2 import ZARRAY, ChunkLocks, V2Array

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
SYNC_SUFFIX = ".sync"

#: numpy dtype -> torch dtype for every dtype the zarr backend can store.
NUMPY_TO_TORCH: Dict[np.dtype, torch.dtype] = {
    np.dtype("bool"): torch.bool,
    np.dtype("uint8"): torch.uint8,
    np.dtype("int8"): torch.int8,
    np.dtype("int16"): torch.int16,
    np.dtype("int32"): torch.int32,
    np.dtype("int64"): torch.int64,
    np.dtype("float16"): torch.float16,
    np.dtype("float32"): torch.float32,
    np.dtype("float64"): torch.float64,
    np.dtype("complex64"): torch.complex64,
    np.dtype("complex128"): torch.complex128,
    BFLOAT16: torch.bfloat16,
}
TORCH_TO_NUMPY: Dict[torch.dtype, np.dtype] = {v: k for k, v in NUMPY_TO_TORCH.items()}

PathLike = Union[str, os.PathLike]


def numpy_dtype_for(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype a torch dtype is stored as; CheckpointingException if it has none."""
    try:
        return TORCH_TO_NUMPY[dtype]
    except KeyError:
        raise CheckpointingException(
            f"dtype {dtype} cannot be stored by the zarr backend "
            f"(supported: {sorted(str(d) for d in TORCH_TO_NUMPY)})"
        ) from None


def torch_dtype_for(dtype: Union[np.dtype, str]) -> torch.dtype:
    """The torch dtype of a numpy dtype or a ``.zarray`` dtype string (``"<f4"``, ``"bfloat16"``)."""
    if isinstance(dtype, str):
        dtype = BFLOAT16 if dtype.lstrip("<>|=") == "bfloat16" else np.dtype(dtype)
    dtype = np.dtype(dtype)
    if dtype.byteorder in "<>":  # big-endian data is byte-swapped on read
        dtype = dtype.newbyteorder("=")
    try:
        return NUMPY_TO_TORCH[dtype]
    except KeyError:
        raise CheckpointingException(f"zarr dtype {dtype} has no torch equivalent") from None


def tensor_to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A CPU numpy view/copy of ``tensor`` with identical bits (bf16 -> ``ml_dtypes.bfloat16``)."""
    x = tensor.detach()
    if x.device.type != "cpu":
        x = x.cpu()
    x = x.contiguous()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(BFLOAT16)
    numpy_dtype_for(x.dtype)  # raise a clear error for unsupported dtypes
    return x.numpy()


def numpy_to_tensor(x: np.ndarray) -> torch.Tensor:
    """A torch tensor with the same bits as ``x`` (``ml_dtypes.bfloat16`` -> ``torch.bfloat16``)."""
    x = np.asarray(x)
    if x.dtype.byteorder not in "=|":
        x = x.astype(x.dtype.newbyteorder("="))
    shape = x.shape  # np.ascontiguousarray makes 0-d arrays 1-d
    if x.dtype == BFLOAT16 or (x.dtype.kind == "V" and x.dtype.itemsize == 2):
        # ("<V2": an unpatched bf16 header)
        raw = np.ascontiguousarray(x).view(np.int16)
        return torch.from_numpy(raw).view(torch.bfloat16).reshape(shape)
    torch_dtype_for(x.dtype)
    return torch.from_numpy(np.ascontiguousarray(x)).reshape(shape)


def read_zarray(array_dir: PathLike) -> Dict[str, Any]:
    """Parse ``<array_dir>/.zarray``; CheckpointingException when missing or not JSON."""
    path = os.path.join(os.fspath(array_dir), ZARRAY)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointingException(f"Cannot read zarr array header {path}: {e}") from e


def iter_array_dirs(checkpoint_dir: PathLike) -> Iterator[Tuple[str, Path]]:
    """Yield ``(key, array_dir)`` for every zarr array under ``checkpoint_dir``.

    Keys are paths relative to the checkpoint (``/`` separated, so keys containing ``/`` work).
    ``<key>.sync`` directories (process synchronizers of flattened tensors) are not arrays and
    are skipped, as are directories of ShardedObjects (no ``.zarray``).
    """
    root = Path(checkpoint_dir)
    stack = [root]
    while stack:
        current = stack.pop()
        try:
            entries = sorted(os.scandir(current), key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            if not entry.is_dir() or entry.name.endswith(SYNC_SUFFIX):
                continue
            sub = Path(entry.path)
            if (sub / ZARRAY).is_file():
                yield sub.relative_to(root).as_posix(), sub
            else:
                stack.append(sub)


def process_synchronizer(sync_dir: PathLike) -> ChunkLocks:
    """Per-chunk inter-process locks in ``sync_dir`` (flattened tensors), as Megatron-Core took
    them through zarr-python 2's ProcessSynchronizer."""
    return ChunkLocks(sync_dir)


def create_array(
    array_dir: PathLike,
    shape: Sequence[int],
    dtype: torch.dtype,
    chunks: Sequence[int],
    synchronizer: Optional[ChunkLocks] = None,
) -> V2Array:
    """Create an empty zarr v2 array as Megatron-Core did and return it open for writing.

    Uncompressed, no filters, ``fill_value`` null, C order; bf16 arrays say ``"dtype":
    "bfloat16"`` (the header Megatron-Core patched in). Written by :mod:`.zarr_v2`, the same bytes
    as zarr-python 2 wrote, with any zarr-python installed or none.
    """
    np_dtype = numpy_dtype_for(dtype)
    if np_dtype == BFLOAT16:
        stored, name = np_dtype, "bfloat16"
    else:  # little-endian on disk, as zarr-python wrote it on every machine MCore ran on
        stored = np_dtype.newbyteorder("<")
        name = stored.str
    return V2Array.create(array_dir, shape, tuple(max(int(c), 1) for c in chunks), stored,
                          name, locks=synchronizer)


def open_array(array_dir: PathLike, mode: str = "r+",
               synchronizer: Optional[ChunkLocks] = None) -> V2Array:
    """Open an existing uncompressed zarr v2 array for writing (``mode`` ``"r+"``)."""
    if mode != "r+":
        raise CheckpointingException(f"zarr arrays are opened here for writing (r+), not {mode!r}")
    path = Path(array_dir)
    if not (path / ZARRAY).is_file():
        raise CheckpointingException(_not_found_message(path))
    header = V2Array.header(path, synchronizer)
    try:
        dtype = BFLOAT16 if header["dtype"] == "bfloat16" else np.dtype(header["dtype"])
        return V2Array(path, header["shape"], header["chunks"], dtype, locks=synchronizer)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointingException(f"Invalid zarr array header in {path}: {e}") from e


def write_region(arr: V2Array, selection, values: np.ndarray) -> None:
    """``arr[selection] = values`` (a tuple of slices and integers, as ``global_slice()``)."""
    arr[selection] = values


def write_coordinates(arr: V2Array, coordinates, values: np.ndarray) -> None:
    """Write ``values`` at the given per-axis coordinate arrays (flattened tensors)."""
    arr.set_coordinate_selection(tuple(coordinates), values)


def open_ts_array(array_dir: PathLike):
    """Open a zarr v2 array read-only with tensorstore (the spec Megatron-Core used)."""
    import tensorstore as ts

    spec = {
        "driver": "zarr",
        "metadata_key": ZARRAY,
        "kvstore": {"driver": "file", "path": os.fspath(array_dir)},
    }
    try:
        return ts.open(ts.Spec(spec), open=True, read=True).result()
    except Exception as e:  # tensorstore raises ValueError for missing/invalid arrays
        if not (Path(array_dir) / ZARRAY).exists():
            raise CheckpointingException(_not_found_message(Path(array_dir))) from e
        raise CheckpointingException(f"Array {array_dir} could not be loaded. Error: {e}") from e


def _not_found_message(path: Path) -> str:
    ckpt_dir = path.parent
    msg = f"Array {path} not found"
    if not ckpt_dir.exists():
        msg += f". Checkpoint directory {ckpt_dir} does not exist."
    else:
        names = sorted(p.name for p in ckpt_dir.iterdir())
        shown = ", ".join(names[:20]) + (", ..." if len(names) > 20 else "")
        msg += f". Checkpoint directory holds: {shown}"
    return msg
