"""Low-level I/O of the Megatron-Core ``zarr`` checkpoint layout (zarr format v2 on a filesystem).

One directory per ShardedTensor key, ``<ckpt>/<key>/.zarray`` plus one uncompressed chunk file
per chunk (``0.0``, ``1.0``, ...). This module knows the bytes: dtype names (including the
``"bfloat16"`` name Megatron-Core patched into ``.zarray``), bit-exact torch <-> numpy
conversion, array creation with zarr-python 2 and reads with tensorstore. It knows nothing of
ShardedTensors; :mod:`ckpt_tool.dist_checkpointing.strategies.zarr` builds on it.
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

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
ZARRAY = ".zarray"
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


def _zarr():
    try:
        import zarr
    except ImportError as e:  # pragma: no cover - zarr is a dependency
        raise CheckpointingException("the zarr backend needs `zarr<3` (pip install 'zarr<3')") from e
    if int(zarr.__version__.split(".")[0]) >= 3:
        raise CheckpointingException(
            f"the zarr backend writes zarr format v2 through zarr-python 2; found zarr {zarr.__version__}"
        )
    return zarr


def process_synchronizer(sync_dir: PathLike):
    """A zarr ProcessSynchronizer (file locks in ``sync_dir``), as used for flattened tensors."""
    zarr = _zarr()
    try:
        import fasteners  # noqa: F401  (zarr's ProcessSynchronizer needs it)
    except ImportError as e:
        raise CheckpointingException(
            "saving flattened tensors with the zarr backend needs `fasteners`"
        ) from e
    return zarr.ProcessSynchronizer(os.fspath(sync_dir))


def create_array(
    array_dir: PathLike,
    shape: Sequence[int],
    dtype: torch.dtype,
    chunks: Sequence[int],
    synchronizer: Optional[Any] = None,
):
    """Create an empty zarr v2 array as Megatron-Core did and return it opened ``r+``.

    Uncompressed, no filters, ``fill_value`` null, C order, chunk files written even when all
    zeros. A bfloat16 array is created with zarr's 2-byte void type and its header is then
    rewritten to say ``"dtype": "bfloat16"`` (what tensorstore/ml_dtypes understand).
    """
    zarr = _zarr()
    np_dtype = numpy_dtype_for(dtype)
    store_dtype = np.dtype("V2") if np_dtype == BFLOAT16 else np_dtype
    try:
        arr = zarr.create(
            tuple(int(s) for s in shape),
            dtype=store_dtype,
            store=os.fspath(array_dir),
            chunks=tuple(max(int(c), 1) for c in chunks),
            compressor=None,
            fill_value=None,
            write_empty_chunks=True,
            synchronizer=synchronizer,
        )
    except zarr.errors.ContainsArrayError as e:
        raise CheckpointingException(f"Array {array_dir} already exists") from e
    if np_dtype == BFLOAT16:
        header = arr.store[ZARRAY]
        patched = header.replace(b'"<V2"', b'"bfloat16"').replace(b'"|V2"', b'"bfloat16"')
        if patched == header:
            raise CheckpointingException(f"Unexpected zarr header for a bf16 array: {header!r}")
        arr.store[ZARRAY] = patched
    return arr


def open_array(array_dir: PathLike, mode: str = "r+", synchronizer: Optional[Any] = None):
    """Open an existing zarr array with zarr-python 2 (bf16 headers need ml_dtypes, imported here)."""
    zarr = _zarr()
    path = Path(array_dir)
    try:
        return zarr.open_array(os.fspath(path), mode=mode, synchronizer=synchronizer)
    except (zarr.errors.ArrayNotFoundError, FileNotFoundError, KeyError) as e:
        raise CheckpointingException(_not_found_message(path)) from e


def write_region(arr, selection, values: np.ndarray) -> None:
    """``arr[selection] = values`` with bf16 values matched to how zarr sees the array."""
    if values.dtype == BFLOAT16 and arr.dtype != BFLOAT16:
        values = values.view(arr.dtype)  # array opened as raw "V2"
    arr[selection] = values


def write_coordinates(arr, coordinates, values: np.ndarray) -> None:
    """Write ``values`` at the given per-axis coordinate arrays (flattened tensors)."""
    if values.dtype == BFLOAT16 and arr.dtype != BFLOAT16:
        values = values.view(arr.dtype)
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
