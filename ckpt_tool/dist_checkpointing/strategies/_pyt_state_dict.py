"""Turning ShardedTensors/ShardedObjects into values PyTorch DCP saves and loads (MCore's API).

Megatron-Core's ``torch_dist`` strategy converts a sharded state dict into a *PyT state dict*:
one entry per key, holding a DCP-checkpointable tensor (all of this rank's pieces of that
global tensor) or, for ShardedObjects, ``torch.save`` bytes. ``torch.distributed.checkpoint``
then saves or loads it with :class:`~._mcore_planners.MCoreSavePlanner` /
:class:`~._mcore_planners.MCoreLoadPlanner`. Our own strategy saves DCP items it plans
directly (:mod:`._dcp_planner`, the same bytes) and loads through ``MCoreLoadPlanner`` (see
:mod:`._load_requests`); these functions are for code written against Megatron-Core's
building blocks. Public names are re-exported by :mod:`.torch`.
"""

from __future__ import annotations

import io
from itertools import product
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard
from torch.distributed._shard.sharded_tensor import ShardedTensor as TorchShardedTensor
from torch.distributed._shard.sharded_tensor import ShardedTensorMetadata, TensorProperties
from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
from torch.distributed.checkpoint._traverse import OBJ_PATH, traverse_state_dict
from torch.torch_version import TorchVersion

from ..core import CheckpointingException
from ..mapping import (
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    is_main_replica,
)
from .checkpointable import CheckpointableShardedTensor, LocalShardsContainer

__all__ = ["flatten_state_dict", "sharded_tensor_to_torch_sharded_tensor",
           "mcore_to_pyt_state_dict"]

# DCP understands the _Checkpointable protocol from this version on
_CHECKPOINTABLE_TORCH = TorchVersion(torch.__version__) >= "2.6.0a0"


def flatten_state_dict(
    state_dict: ShardedStateDict,
) -> Tuple[ShardedStateDict, Dict[str, OBJ_PATH]]:
    """One-level copy of a nested state dict, and the paths to rebuild it.

    ``torch.distributed.checkpoint``'s flattening (keys are the path items joined by ``.``;
    ``torch.distributed.checkpoint._nested_dict.unflatten_state_dict`` inverts it), except that
    sharded values (ShardedTensor, ShardedObject, factories) are leaves like tensors.

    Raises ValueError when two paths join to the same key.
    """
    flattened: Dict[str, Any] = {}
    mappings: Dict[str, OBJ_PATH] = {}

    def visit(path: OBJ_PATH, value: Any) -> None:
        key = ".".join(str(p) for p in path)
        if key in flattened:
            raise ValueError(f"duplicated flatten key {key}")
        flattened[key] = value
        mappings[key] = path

    traverse_state_dict(state_dict, visit,
                        lambda x: isinstance(x, (torch.Tensor, ShardedBase)))
    return flattened, mappings


def _chunk_shape(sh_ten: ShardedTensor) -> Tuple[int, ...]:
    return (1,) * sh_ten.prepend_axis_num + tuple(sh_ten.local_shape)


def sharded_tensor_to_torch_sharded_tensor(
    sh_tens: List[ShardedTensor],
    rank: Optional[int] = None,
    load_legacy_1d_flatten_tensors: bool = False,
) -> TorchShardedTensor:
    """A PyTorch ``ShardedTensor`` whose local shards are the given pieces of one global tensor.

    The pieces must lie on a regular grid (``axis_fragmentations``); the metadata of the other
    ranks' pieces is derived from the grid, so nothing is communicated, but the default process
    group must be initialised. Each local shard is a view of the piece's ``data`` with the
    prepended axes as leading size-1 axes; non-contiguous ``data`` is first replaced by a
    contiguous copy (so a load fills ``sh_ten.data``). The result carries the first piece
    without data as ``mcore_sh_ten``.

    Args:
        sh_tens: this rank's pieces of one key (not flattened).
        rank: this process's rank (default: in the default group).
        load_legacy_1d_flatten_tensors: accepted for Megatron-Core compatibility; unused.
    """
    if rank is None:
        rank = torch.distributed.get_rank()
    first = sh_tens[0]
    if not first.has_regular_grid:
        raise CheckpointingException(f"{first.key} is not sharded on a regular grid")
    for sh_ten in sh_tens:
        if sh_ten.flattened_range is not None:
            raise CheckpointingException(f"flattened_range is not supported here ({sh_ten.key})")
        if not sh_ten.data.is_contiguous():
            sh_ten.data = sh_ten.data.contiguous()

    chunk = _chunk_shape(first)
    local: Dict[Tuple[int, ...], List[torch.Tensor]] = {}
    shards = []
    for sh_ten in sh_tens:
        view = sh_ten.data.view(_chunk_shape(sh_ten))
        local.setdefault(tuple(sh_ten.global_offset), []).append(view)
        shards.append(Shard.from_tensor_and_offsets(view, list(sh_ten.global_offset), rank))

    device = first.data.device.type
    other_rank = (rank + 1) % torch.distributed.get_world_size()
    shards_metadata = []
    for grid_index in product(*(range(f) for f in first.axis_fragmentations)):
        offset = tuple(i * c for i, c in zip(grid_index, chunk))
        if offset in local:
            shards_metadata += [ShardMetadata(list(offset), list(v.shape), f"rank:{rank}/{device}")
                                for v in local[offset]]
        else:  # another rank's piece: only its place in the grid matters
            shards_metadata.append(
                ShardMetadata(list(offset), list(chunk), f"rank:{other_rank}/{device}"))

    data = first.data
    metadata = ShardedTensorMetadata(
        shards_metadata=shards_metadata,
        size=torch.Size(first.global_shape),
        tensor_properties=TensorProperties(
            dtype=data.dtype, layout=data.layout, requires_grad=data.requires_grad,
            memory_format=torch.contiguous_format, pin_memory=data.is_pinned()),
    )
    pyt_sh_ten = TorchShardedTensor._init_from_local_shards_and_global_metadata(
        shards, sharded_tensor_metadata=metadata, process_group=None)
    pyt_sh_ten.mcore_sh_ten = first.without_data()
    return pyt_sh_ten


def _prepare_data(sh_ten: ShardedTensor, is_loading: bool, init_device) -> None:
    if sh_ten.data is None:
        if not is_loading:
            raise CheckpointingException(f"`data` attr is None for {sh_ten}")
        sh_ten.init_data(init_device,
                         init_fn=torch.zeros if sh_ten.allow_shape_mismatch else torch.empty)
        return
    sh_ten.data = sh_ten.data.detach()
    if sh_ten.allow_shape_mismatch and is_loading:
        sh_ten.data.zero_()  # only the overlap with the stored tensor is read


def _to_dcp_tensor(sh_tens: List[ShardedTensor], is_loading: bool, init_device,
                   load_legacy_1d_flatten_tensors: bool):
    for sh_ten in sh_tens:
        if not isinstance(sh_ten, ShardedTensor):
            raise CheckpointingException(f"expected ShardedTensors, got {sh_ten}")
        _prepare_data(sh_ten, is_loading, init_device)
    first = sh_tens[0]
    legacy = bool(first.prepend_axis_num) or first.flattened_range is not None
    if _CHECKPOINTABLE_TORCH and (not legacy or not first.has_regular_grid):
        if first.flattened_range is not None:
            raise CheckpointingException(
                f"flattened_range without a regular grid is not supported ({first.key})")
        wrapped = [CheckpointableShardedTensor.from_sh_ten(s) for s in sh_tens]
        return LocalShardsContainer(wrapped) if len(wrapped) > 1 else wrapped[0]
    if not first.has_regular_grid:
        raise CheckpointingException(
            f"Uneven sharding not supported for PyTorch version {torch.__version__}")
    torch_sh_ten = sharded_tensor_to_torch_sharded_tensor(
        sh_tens, None, load_legacy_1d_flatten_tensors)
    torch_sh_ten.key = first.key
    return torch_sh_ten


def _to_bytes(sh_objs: List[ShardedObject]) -> io.BytesIO:
    for sh_obj in sh_objs:
        if not isinstance(sh_obj, ShardedObject):
            raise CheckpointingException(f"expected ShardedObjects, got {sh_obj}")
    buf = io.BytesIO()
    torch.save([sh_obj.data for sh_obj in sh_objs], buf)
    buf.seek(0)
    return buf


def mcore_to_pyt_state_dict(
    state_dict: Dict[str, List[ShardedBase]],
    is_loading: bool = False,
    init_device: torch.device = torch.device("cpu"),
    load_legacy_1d_flatten_tensors: bool = False,
) -> Dict[str, Union[TorchShardedTensor, CheckpointableShardedTensor, LocalShardsContainer,
                     io.BytesIO]]:
    """Convert ``{key: [this rank's ShardedTensors (or ShardedObjects) of key]}`` for DCP.

    A list of ShardedTensors becomes a :class:`CheckpointableShardedTensor` (or a
    :class:`LocalShardsContainer` of several); with torch < 2.6, or for the prepended-axis
    tensors of Megatron-Core < 0.14 on a regular grid, a PyTorch ``ShardedTensor`` (see
    :func:`sharded_tensor_to_torch_sharded_tensor`). A list of ShardedObjects becomes a
    ``BytesIO`` with ``torch.save`` of their data list.

    The ShardedTensors are updated in place: ``data`` is detached; on load a missing ``data``
    is allocated on ``init_device`` (zeros for ``allow_shape_mismatch``, else uninitialised)
    and existing ``data`` of ``allow_shape_mismatch`` tensors is zeroed. Loading through the
    result fills their ``data``. Raises CheckpointingException when saving a ShardedTensor
    without data.

    Unlike Megatron-Core, no process group is needed unless a PyTorch ``ShardedTensor`` is
    built (``dcp.save``/``dcp.load`` with ``no_dist=True`` then work in one process).
    """
    pyt_state_dict = {}
    for key, values in state_dict.items():
        if isinstance(values[0], ShardedTensor):
            pyt_state_dict[key] = _to_dcp_tensor(values, is_loading, init_device,
                                                 load_legacy_1d_flatten_tensors)
        else:
            pyt_state_dict[key] = _to_bytes(values)
    return pyt_state_dict


def _unwrap_pyt_sharded_tensor(sh_ten: Any) -> Union[List[torch.Tensor], Any]:
    """The local tensors behind a value of :func:`mcore_to_pyt_state_dict` (prepended axes
    dropped); other values (loaded objects) unchanged."""
    value = sh_ten
    if isinstance(value, CheckpointableShardedTensor):
        return [value._sh_ten.data]
    if isinstance(value, LocalShardsContainer):
        return [shard._sh_ten.data for shard in value._local_shards]
    if not isinstance(value, TorchShardedTensor):
        return value
    prepend = value.mcore_sh_ten.prepend_axis_num
    out = []
    for shard in value.local_shards():
        tensor = shard.tensor
        for _ in range(prepend):
            tensor = tensor[0]
        out.append(tensor)
    return out


def _replace_state_dict_keys_with_sharded_keys(
    sharded_state_dict: ShardedStateDict, keep_only_main_replica: bool = False
) -> Tuple[Dict[str, List[ShardedBase]], Dict[str, OBJ_PATH], Dict[str, List[str]]]:
    """Group the sharded values by their checkpoint key (``unique_key`` for objects).

    Returns ``(values by key, flat key -> path in the nested dict, checkpoint key -> the flat
    keys of its values)``, the last two being what
    :func:`_replace_sharded_keys_with_state_dict_keys` needs to rebuild the nested dict. With
    ``keep_only_main_replica`` only main replicas are kept.
    """
    flat, mapping = flatten_state_dict(sharded_state_dict)
    by_key: Dict[str, List[ShardedBase]] = {}
    flat_keys: Dict[str, List[str]] = {}
    for flat_key, value in flat.items():
        if not isinstance(value, ShardedBase):
            raise CheckpointingException(f"{flat_key}: {type(value).__name__} is not sharded")
        if keep_only_main_replica and not is_main_replica(value.replica_id):
            continue
        key = value.unique_key if isinstance(value, ShardedObject) else value.key
        by_key.setdefault(key, []).append(value)
        flat_keys.setdefault(key, []).append(flat_key)
    return by_key, mapping, flat_keys


def _replace_sharded_keys_with_state_dict_keys(
    state_dict: Dict[str, List[Any]], flat_mapping: Dict[str, OBJ_PATH],
    rename_mapping: Dict[str, List[str]],
) -> Dict[str, Any]:
    """The nested dict again, from per-checkpoint-key value lists (inverse of
    :func:`_replace_state_dict_keys_with_sharded_keys`)."""
    flat = {}
    for key, values in state_dict.items():
        flat_keys = rename_mapping[key]
        if len(values) != len(flat_keys):
            raise CheckpointingException(
                f"{key}: {len(values)} values for {len(flat_keys)} state dict entries")
        flat.update(zip(flat_keys, values))
    return unflatten_state_dict(flat, flat_mapping)


def _restore_dict_types(x: Any, keys_template: Any) -> None:
    """Give the dict keys of ``x`` (rebuilt from a flattened dict, so all strings) the types
    they have in ``keys_template`` (e.g. int layer numbers), recursively, in place."""
    if isinstance(keys_template, dict):
        for key, template in keys_template.items():
            if not isinstance(key, str) and str(key) in x:
                x[key] = x.pop(str(key))
            _restore_dict_types(x[key], template)
    elif isinstance(keys_template, list):
        for value, template in zip(x, keys_template):
            _restore_dict_types(value, template)


def _get_filesystem_reader(checkpoint_dir, cache_metadata: bool = False):
    """A DCP reader of ``checkpoint_dir`` (remembering ``.metadata`` with ``cache_metadata``);
    the multi-storage client is not supported (see ``_mcore_names.MultiStorageClientFeature``).
    Ours reads ``.metadata`` through the allowlisting unpickler either way."""
    from .cached_metadata_filesystem_reader import CachedMetadataFileSystemReader

    return CachedMetadataFileSystemReader(checkpoint_dir)
