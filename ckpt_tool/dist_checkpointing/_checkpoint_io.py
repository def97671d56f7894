"""Writer and reader of :mod:`~ckpt_tool.dist_checkpointing.checkpointer`: ``torch_dist`` I/O.

A checkpointer state dict is a nested dict (string or int keys) whose leaves are

* plain tensors: **replicated** — every rank holds the same key, shape and dtype (a DDP model,
  an optimizer state after all-gather). Each becomes a ShardedTensor keyed by its dotted path
  (``{"layer": {"w": t}}`` -> ``"layer.w"``) whose main replica lives on one rank; tensors are
  spread over the ranks largest first, so each rank writes about ``1/world`` of the bytes;
* ShardedTensor / ShardedObject / ShardedTensorFactory: sharded state (Megatron-Core style),
  saved as given;
* anything else: the common state dict, saved by rank 0.

The tensors' dict paths are stored in the common state dict under :data:`PATHS_KEY`, so a load
without a target rebuilds the nesting. Checkpoints are ordinary ``torch_dist`` checkpoints that
Megatron-Core loads (tensor keys are the dotted paths).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ckpt_tool.errors import UsageError

from . import serialization
from .mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
from .strategies.torch import TorchDistSaveShardedStrategy

__all__ = ["RankInfo", "STATE_DICT", "PATHS_KEY", "prepare_state_dict", "WriterHook",
           "CheckpointWriterConfig", "CheckpointWriter", "CheckpointReader"]

STATE_DICT = Dict[str, Any]
PATHS_KEY = "checkpointer_tensor_paths"
_SHARDED = (ShardedTensor, ShardedObject, ShardedTensorFactory)


@dataclass
class RankInfo:
    """This process's global rank and the world size."""

    global_rank: int
    global_world_size: int


def default_rank_info() -> RankInfo:
    """From the default process group when initialized, else a single rank."""
    if dist.is_available() and dist.is_initialized():
        return RankInfo(dist.get_rank(), dist.get_world_size())
    return RankInfo(0, 1)


def _check_no_tensor_in(value: Any, path: Tuple) -> None:
    if isinstance(value, (torch.Tensor,) + _SHARDED):
        raise UsageError(f"tensor inside a list/tuple at {'.'.join(map(str, path))}: "
                         "checkpointer state dicts nest tensors in dicts only")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_no_tensor_in(v, path + (k,))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_no_tensor_in(v, path + (i,))


def prepare_state_dict(state_dict: STATE_DICT, rank_info: RankInfo) -> STATE_DICT:
    """The sharded state dict that is saved for ``state_dict`` (see the module docstring).

    A new dict structure (leaves are not copied). Idempotent: a prepared dict is returned as is.
    """
    if PATHS_KEY in state_dict:
        return state_dict
    plain: List[Tuple[str, Tuple, torch.Tensor]] = []
    paths: Dict[str, list] = {}

    def walk(value: Any, path: Tuple) -> Any:
        if isinstance(value, dict):
            return {k: walk(v, path + (k,)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            _check_no_tensor_in(value, path)
            return value
        if isinstance(value, torch.Tensor):
            plain.append((".".join(map(str, path)), path, value))
            return value
        if isinstance(value, (ShardedTensor, ShardedTensorFactory)):
            paths[value.key] = list(path)
        return value

    out = walk(state_dict, ())
    loads = [0] * rank_info.global_world_size
    owners: Dict[str, int] = {}
    for key, _, t in sorted(plain, key=lambda e: (-e[2].numel() * e[2].element_size(), e[0])):
        if key in owners or key in paths:
            raise UsageError(f"two tensors map to the checkpoint key {key!r}")
        owners[key] = loads.index(min(loads))
        loads[owners[key]] += t.numel() * t.element_size()
    for key, path, t in plain:
        parent = out
        for k in path[:-1]:
            parent = parent[k]
        replica = (rank_info.global_rank - owners[key]) % rank_info.global_world_size
        parent[path[-1]] = ShardedTensor.from_rank_offsets(key, t, replica_id=replica)
        paths[key] = list(path)
    out[PATHS_KEY] = paths
    return out


class WriterHook(abc.ABC):
    """Callbacks around a checkpoint write: ``pre_commit`` before the save starts,
    ``post_commit`` once ``metadata.json`` is written (the checkpoint is complete)."""

    @abc.abstractmethod
    def pre_commit(self, path: str, **kwargs: Any) -> None:
        """Runs on every rank before the write."""

    @abc.abstractmethod
    def post_commit(self, path: str, **kwargs: Any) -> None:
        """Runs on every rank after the checkpoint is complete."""


@dataclass
class CheckpointWriterConfig:
    """Options of the ``torch_dist`` save.

    Attributes:
        thread_count: writer threads and data files per rank.
        validate_access_integrity: check the global sharding and the common state dict's
            agreement across ranks at every save (collectives).
    """

    thread_count: int = 2
    validate_access_integrity: bool = True


class CheckpointWriter:
    """Writes a checkpointer state dict as a ``torch_dist`` checkpoint (call on every rank)."""

    def __init__(self, config: Optional[CheckpointWriterConfig] = None,
                 rank_info: Optional[RankInfo] = None, commit_hook: Optional[WriterHook] = None):
        self._config = config or CheckpointWriterConfig()
        self._rank_info = rank_info or default_rank_info()
        self._commit_hook = commit_hook

    def write(self, path: str, state_dict: STATE_DICT, **kwargs: Any) -> None:
        """Save ``state_dict`` to the directory ``path``; ``metadata.json`` is written last,
        only if every rank succeeded (a failure raises on every rank)."""
        sharded = prepare_state_dict(state_dict, self._rank_info)
        if self._commit_hook is not None:
            self._commit_hook.pre_commit(path, **kwargs)
        strategy = TorchDistSaveShardedStrategy("torch_dist", 1,
                                                thread_count=self._config.thread_count)
        strategy.stage_host_tensors = False  # staged by the training process already
        # The async request run in place: its writer reports every failed file and its
        # finalization fails all ranks before ``.metadata``/``metadata.json`` are written.
        request = serialization.save(
            sharded, str(path), sharded_strategy=strategy, async_sharded_save=True,
            validate_access_integrity=self._config.validate_access_integrity)
        request.execute_sync()
        if self._commit_hook is not None:
            self._commit_hook.post_commit(path, **kwargs)

    def close(self) -> None:
        """Nothing to release."""


def _set_path(root: dict, path: list, value: Any) -> None:
    for k in path[:-1]:
        root = root.setdefault(k, {})
    root[path[-1]] = value


def _map_location(value: Any, location: Any) -> Any:
    if location is None:
        return value
    if not isinstance(location, (str, torch.device)):
        raise UsageError("default_map_location must be a device or a device name")
    if isinstance(value, dict):
        return {k: _map_location(v, location) for k, v in value.items()}
    return value.to(location) if isinstance(value, torch.Tensor) else value


_ABSENT = object()


def _lookup(root: Any, path: Tuple) -> Any:
    for k in path:
        if not isinstance(root, dict) or k not in root:
            return _ABSENT
        root = root[k]
    return root


class CheckpointReader:
    """Reads ``torch_dist`` checkpoints into checkpointer state dicts (call on every rank)."""

    def __init__(self, rank_info: Optional[RankInfo] = None):
        self._rank_info = rank_info or default_rank_info()

    def read(self, path: str, state_dict: Optional[STATE_DICT] = None, *,
             map_location: Any = None, **kwargs: Any) -> Tuple[STATE_DICT, List[str]]:
        """``(state_dict, missing_keys)``.

        Without ``state_dict``: everything — the common state dict plus every tensor, whole,
        at its saved dict path (``map_location`` applies). With ``state_dict``: only its keys;
        its tensors are loaded in place (ShardedTensors as their sharding says); keys the
        checkpoint lacks keep their given value and are listed (dotted paths) as missing.
        """
        path = str(path)
        if state_dict is None:
            loaded = serialization.load_plain_tensors(path)
            for key, where in (loaded.pop(PATHS_KEY, None) or {}).items():
                if key in loaded:
                    _set_path(loaded, where, loaded.pop(key))
            return _map_location(loaded, map_location), []
        request = dict(prepare_state_dict(state_dict, self._rank_info))
        request.pop(PATHS_KEY)
        in_ckpt = set(serialization.load_sharded_metadata(path))
        common = serialization.load_common_state_dict(path)
        to_load: Dict[str, Any] = {}
        missing: List[str] = []

        def key_of(sh: Any) -> str:
            return sh.unique_key if isinstance(sh, ShardedObject) else sh.key

        def collect(value: Any, where: Tuple) -> None:
            if isinstance(value, dict):
                for k, v in value.items():
                    collect(v, where + (k,))
            elif isinstance(value, ShardedTensorFactory) or (
                    isinstance(value, _SHARDED) and key_of(value) in in_ckpt):
                to_load[f"\0checkpointer/{len(to_load)}"] = value
            elif isinstance(value, _SHARDED) or _lookup(common, where) is _ABSENT:
                missing.append(".".join(map(str, where)))

        collect(request, ())
        slots = {id(v): k for k, v in to_load.items()}
        loaded = serialization.load(to_load, path, validate_access_integrity=False) \
            if to_load else {}

        def resolve(value: Any, original: Any, where: Tuple) -> Any:
            if isinstance(value, dict):
                return {k: resolve(v, original[k], where + (k,)) for k, v in value.items()}
            if id(value) in slots:
                return loaded[slots[id(value)]]
            if isinstance(value, _SHARDED):
                return original
            found = _lookup(common, where)
            return original if found is _ABSENT else found

        return resolve(request, state_dict, ()), missing
