"""Save/load strategies for the ``zarr`` backend (removed from Megatron-Core, still on disk).

Layout (what Megatron-Core <= 0.15 wrote and read): one zarr v2 array per ShardedTensor key at
``<checkpoint>/<key>/``, chunked by ``global_shape // axis_fragmentations`` (one chunk per
local shard), uncompressed little-endian chunk files, ``"dtype": "bfloat16"`` for bf16.
ShardedObjects are not handled here: the common strategy saves them as
``<checkpoint>/<key>/shard_<offsets>_<shape>.pt`` (``can_handle_sharded_objects`` is False, as
in Megatron-Core).

Saving writes the v2 format itself (:mod:`ckpt_tool.formats.mcore_dist.zarr_v2`: the bytes
zarr-python 2 wrote for Megatron-Core, with zarr-python 3 installed or none); loading reads
exactly the requested slice of each global array through tensorstore, so a checkpoint can be
loaded at another sharding than it was saved.
"""

from __future__ import annotations

import logging
import os
import shutil
from itertools import starmap
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch

from ckpt_tool._torchrun import group_initialized
from ..core import CheckpointingException
from ..dict_utils import dict_list_map_inplace, nested_values
from ..mapping import ShardedStateDict, ShardedTensor, is_main_replica
from ckpt_tool.formats.mcore_dist import zarr_store as zio
from .base import LoadShardedStrategy, SaveShardedStrategy, StrategyAction, register_default_strategy

__all__ = [
    "ZarrSaveShardedStrategy",
    "ZarrLoadShardedStrategy",
    "TensorStoreLoadShardedStrategy",
    "register_default_zarr_strategies",
    "load_zarr_based_sharded_metadata",
    "postprocess_numpy_array",
    "pad_to_expected_shape",
    "flatten_range",
    "merge_global_slice_with_shape",
    "open_ts_array",
    "numpy_to_torch_dtype_dict",
    "torch_to_numpy_dtype_dict",
]

logger = logging.getLogger(__name__)

numpy_to_torch_dtype_dict = zio.NUMPY_TO_TORCH
torch_to_numpy_dtype_dict = zio.TORCH_TO_NUMPY
open_ts_array = zio.open_ts_array
HAS_BFLOAT16 = True


def register_default_zarr_strategies() -> None:
    """Make the zarr strategies the defaults for backend ``("zarr", 1)`` (save and load)."""
    register_default_strategy(
        StrategyAction.SAVE_SHARDED, "zarr", 1, ZarrSaveShardedStrategy("zarr", 1)
    )
    register_default_strategy(StrategyAction.LOAD_SHARDED, "zarr", 1, ZarrLoadShardedStrategy())


def _sync_errors(step: str, error: Optional[BaseException]) -> None:
    """Collective barrier that also fails every rank if ``step`` failed on any rank.

    A rank raising alone would leave the others waiting forever in the next collective.
    """
    if not group_initialized():
        if error is not None:
            raise error
        return
    messages: List[Optional[str]] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(messages, None if error is None else str(error))
    if error is not None:
        raise error
    failed = [(rank, msg) for rank, msg in enumerate(messages) if msg is not None]
    if failed:
        rank, msg = failed[0]
        raise CheckpointingException(f"zarr save failed while {step} on rank {rank}: {msg}")


class ZarrSaveShardedStrategy(SaveShardedStrategy):
    """Write ShardedTensors as zarr v2 arrays, one directory per key (Megatron-Core layout).

    Every rank calls :meth:`save` collectively. The rank holding the main replica of the first
    chunk (all-zero offset) of a key creates its array; after a barrier every rank writes the
    chunks of its main replicas; a final barrier ends the save. Without an initialised process
    group the save runs single-process.
    """

    _warned = False

    def __init__(self, backend: str = "zarr", version: int = 1):
        super().__init__(backend, version)

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]):
        """Save all ShardedTensors of ``sharded_state_dict`` under ``checkpoint_dir``."""
        if not ZarrSaveShardedStrategy._warned:
            ZarrSaveShardedStrategy._warned = True
            logger.warning(
                "The `zarr` checkpoint backend was removed from Megatron-Core; "
                "prefer `torch_dist` for new checkpoints."
            )
        checkpoint_dir = Path(checkpoint_dir)
        tensors = [t for t in nested_values(sharded_state_dict) if isinstance(t, ShardedTensor)]
        arrays: List[Optional[object]] = [None] * len(tensors)
        error = None
        try:
            for i, ten in enumerate(tensors):
                _check_saveable(ten)
                if _creates_array(ten):
                    arrays[i] = _create_array(ten, checkpoint_dir)
        except Exception as e:  # noqa: BLE001 - re-raised on every rank by _sync_errors
            error = e
        _sync_errors("creating arrays", error)  # arrays exist before anyone writes
        try:
            for i, ten in enumerate(tensors):
                if not is_main_replica(ten.replica_id):
                    continue
                if arrays[i] is None:
                    arrays[i] = _open_created_array(ten, checkpoint_dir)
                _write_tensor(ten, arrays[i])
        except Exception as e:  # noqa: BLE001
            error = e
        _sync_errors("writing chunks", error)


def _check_saveable(ten: ShardedTensor) -> None:
    if ten.data is None:
        raise CheckpointingException(f"Cannot save {ten}: it has no data")
    if ten.axis_fragmentations is None:
        raise CheckpointingException(
            f"The zarr backend needs a regular grid of shards (axis_fragmentations) for {ten}"
        )
    zio.numpy_dtype_for(ten.dtype)


def _creates_array(ten: ShardedTensor) -> bool:
    """The main replica of the chunk at the global origin creates the array."""
    fr = ten.flattened_range
    return (
        is_main_replica(ten.replica_id)
        and all(off == 0 for off in ten.global_offset)
        and (fr is None or fr.start == 0)
    )


def _open_created_array(ten: ShardedTensor, checkpoint_dir: Path):
    try:
        return zio.open_array(
            checkpoint_dir / ten.key, "r+", synchronizer=_synchronizer(ten, checkpoint_dir)
        )
    except CheckpointingException as e:
        raise CheckpointingException(
            f"{e}. The array of {ten.key!r} is created by the rank saving the main replica of "
            f"its chunk at global offset 0; no rank did."
        ) from e


def _synchronizer(ten: ShardedTensor, checkpoint_dir: Path):
    # Several ranks write parts of the same chunk only for flattened tensors: lock per chunk.
    if ten.flattened_range is None:
        return None
    return zio.process_synchronizer(checkpoint_dir / f"{ten.key}{zio.SYNC_SUFFIX}")


def _create_array(ten: ShardedTensor, checkpoint_dir: Path):
    logger.debug("Creating zarr array %s", checkpoint_dir / ten.key)
    return zio.create_array(
        checkpoint_dir / ten.key,
        ten.global_shape,
        ten.dtype,
        ten.max_allowed_chunks(),
        synchronizer=_synchronizer(ten, checkpoint_dir),
    )


def _write_tensor(ten: ShardedTensor, arr) -> None:
    values = zio.tensor_to_numpy(ten.data)
    if ten.flattened_range is None:
        zio.write_region(arr, ten.global_slice(), values)
    else:
        zio.write_coordinates(arr, ten.global_coordinates(), values.reshape(-1))


class ZarrLoadShardedStrategy(LoadShardedStrategy):
    """Load ShardedTensors from zarr arrays by reading each requested slice with tensorstore.

    Works at any sharding: each ShardedTensor's ``global_slice()`` is read from the global
    array, whatever the chunking on disk. bf16 round-trips bit-exactly. ``allow_shape_mismatch``
    tensors are read clipped to the stored shape and zero-padded to their local shape.
    """

    def __init__(self, load_directly_on_device: bool = False):
        super().__init__()
        self.load_directly_on_device = load_directly_on_device

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]):
        """Replace every ShardedTensor of ``sharded_state_dict`` by its loaded tensor (in place)."""
        checkpoint_dir = Path(checkpoint_dir)
        opened: Dict[str, object] = {}

        def load_one(ten):
            if not isinstance(ten, ShardedTensor):
                raise CheckpointingException(
                    f"The zarr load strategy loads ShardedTensors only, got {type(ten).__name__}"
                )
            if ten.key not in opened:
                opened[ten.key] = zio.open_ts_array(checkpoint_dir / ten.key)
            return _load_tensor(ten, opened[ten.key], self.load_directly_on_device)

        dict_list_map_inplace(load_one, sharded_state_dict)
        return sharded_state_dict

    def load_tensors_metadata(self, checkpoint_dir: Union[str, Path]):
        """Data-less ShardedTensors (key, dtype, global shape) for every array, keyed by key."""

        def shape_and_dtype(array_dir: str):
            header = zio.read_zarray(array_dir)
            return tuple(header["shape"]), header["dtype"]

        return load_zarr_based_sharded_metadata(Path(checkpoint_dir), shape_and_dtype)

    def remove_sharded_tensors(self, checkpoint_dir: Union[str, Path], key_prefix: str):
        """Delete the arrays (and synchronizer dirs) of all keys starting with ``key_prefix``."""
        for key, array_dir in list(zio.iter_array_dirs(checkpoint_dir)):
            if key.startswith(key_prefix):
                shutil.rmtree(array_dir)
                sync_dir = Path(f"{array_dir}{zio.SYNC_SUFFIX}")
                if sync_dir.is_dir():
                    shutil.rmtree(sync_dir)

    def check_backend_compatibility(self, loaded_backend):
        """Only checkpoints written by the ``zarr`` backend can be loaded."""
        if loaded_backend != "zarr":
            raise CheckpointingException(
                f"{type(self).__name__} loads `zarr` checkpoints, not `{loaded_backend}`"
            )

    def check_version_compatibility(self, loaded_version):
        """Version 1 is the only zarr format Megatron-Core ever wrote."""
        if int(loaded_version) != 1:
            raise CheckpointingException(
                f"Unsupported zarr backend version {loaded_version} (known: 1)"
            )


class TensorStoreLoadShardedStrategy(ZarrLoadShardedStrategy):
    """Megatron-Core's name for the tensorstore-based zarr loader (same behaviour)."""


def _load_tensor(ten: ShardedTensor, arr, load_directly_on_device: bool):
    stored_shape = tuple(arr.shape)
    selection = ten.global_slice()
    if tuple(ten.global_shape) != stored_shape:
        if not ten.allow_shape_mismatch:
            raise CheckpointingException(
                f"Global shape mismatch for loaded ({stored_shape}) and expected "
                f"({tuple(ten.global_shape)}) tensor for key {ten.key}"
            )
        selection = merge_global_slice_with_shape(selection, stored_shape, ten.key)
    values = arr[selection].read().result()
    loaded = postprocess_numpy_array(values, ten)
    if load_directly_on_device and ten.data is not None:
        ten.data.data.copy_(loaded)
        return ten.data
    return loaded


def merge_global_slice_with_shape(global_slice, actual_shape, key):
    """Clip the slices of ``global_slice`` to ``actual_shape`` (a smaller stored tensor)."""

    def clip(dim_slice, dim_size):
        if not isinstance(dim_slice, slice):
            return dim_slice
        if dim_slice.start >= dim_size:
            raise CheckpointingException(
                f"Got empty slice for ShardedTensor {key} ({dim_slice}, {dim_size})"
            )
        return slice(dim_slice.start, min(dim_slice.stop, dim_size), dim_slice.step)

    if len(global_slice) != len(actual_shape):
        raise CheckpointingException(
            f"Rank mismatch for {key}: slice {global_slice} vs stored shape {actual_shape}"
        )
    return tuple(starmap(clip, zip(global_slice, actual_shape)))


def postprocess_numpy_array(loaded_array, sharded_tensor, apply_flattened_range=True):
    """Turn a loaded numpy array into the torch tensor ``sharded_tensor`` expects.

    Checks the local shape (zero-pads when ``allow_shape_mismatch``), then applies
    ``flattened_range`` if any.
    """
    x = zio.numpy_to_tensor(loaded_array)
    if tuple(x.shape) != tuple(sharded_tensor.local_shape):
        if not sharded_tensor.allow_shape_mismatch:
            raise CheckpointingException(
                f"Local shape mismatch for loaded ({tuple(x.shape)}) and expected "
                f"({tuple(sharded_tensor.local_shape)}) tensor for key {sharded_tensor.key}"
            )
        x = pad_to_expected_shape(x, sharded_tensor)
    if apply_flattened_range and sharded_tensor.flattened_range is not None:
        x = flatten_range(sharded_tensor, x)
    return x


def flatten_range(sharded_tensor, x):
    """The ``flattened_range`` slice of the flattened local tensor ``x``."""
    return x.flatten()[sharded_tensor.flattened_range]


def pad_to_expected_shape(x: torch.Tensor, expected_sharded_ten: ShardedTensor):
    """Zero-pad ``x`` at the end of each axis up to ``expected_sharded_ten.local_shape``.

    With ``DIST_CKPT_PAD_REPLICATE=1`` the last row is repeated instead (Megatron-Core's
    testing switch).
    """
    expected = tuple(expected_sharded_ten.local_shape)
    if x.ndim != len(expected):
        raise CheckpointingException(f"Cannot pad {tuple(x.shape)} to {expected}")
    pad: List[int] = []
    for have, want in reversed(list(zip(x.shape, expected))):
        if have > want:
            raise CheckpointingException(
                f"Expected shape ({want}) smaller than actual ({have}) for {expected_sharded_ten}"
            )
        pad.extend((0, want - have))
    if not int(os.environ.get("DIST_CKPT_PAD_REPLICATE", 0)):
        return torch.nn.functional.pad(x, pad)
    work = x.float() if x.dtype == torch.bfloat16 else x
    out = torch.nn.functional.pad(work.unsqueeze(0), pad, mode="replicate").squeeze(0)
    return out.to(x.dtype)


def load_zarr_based_sharded_metadata(
    checkpoint_dir: Path, get_shape_dtype_fn: Callable[[str], Tuple[Tuple[int, ...], object]]
) -> ShardedStateDict:
    """Data-less, unsharded ShardedTensors for every zarr array of ``checkpoint_dir``.

    ``get_shape_dtype_fn(array_dir)`` returns ``(shape, dtype)``; dtype may be a numpy dtype or
    a ``.zarray`` dtype string. ``<key>.sync`` directories and ShardedObject directories are
    skipped.
    """
    metadata: Dict[str, ShardedTensor] = {}
    for key, array_dir in zio.iter_array_dirs(checkpoint_dir):
        shape, dtype = get_shape_dtype_fn(str(array_dir))
        shape = tuple(int(s) for s in shape)
        metadata[key] = ShardedTensor(
            key=key,
            data=None,
            dtype=zio.torch_dtype_for(dtype),
            local_shape=shape,
            global_shape=shape,
            global_offset=(0,) * len(shape),
            axis_fragmentations=(1,) * len(shape),
        )
    return metadata


# The strategy registry imports this module when a ("zarr", 1) strategy is first requested.
register_default_zarr_strategies()
