"""One rank's ``torch_dist`` load request, as the PyT state dict Megatron-Core's load reads.

:class:`~.torch.TorchDistLoadShardedStrategy` loads as Megatron-Core does: the requested
ShardedTensors and ShardedObjects become one DCP value per checkpoint key (a
:class:`~.checkpointable.CheckpointableShardedTensor`, a
:class:`~.checkpointable.LocalShardsContainer` of several, or a ``BytesIO`` placeholder for an
object) and ``torch.distributed.checkpoint`` loads them with
:class:`~._mcore_planners.MCoreLoadPlanner`, whose ``create_local_plan`` makes the read plan.
:class:`LoadRequests` adds what Megatron-Core's load does not do:

- :meth:`LoadRequests.check` raises request errors (a key or object the checkpoint lacks,
  another global shape, a region no saved chunk covers) on the rank that has them, before
  any read, as :class:`CheckpointReadError`;
- requests of one key with equal offsets and shape are read once, then copied;
- a tensor that Megatron-Core <= 0.15 stored N-D reformulated (``mcore_data`` of the metadata
  gives its original shape) is read into a block buffer in its stored index space and
  rearranged into the requested region by :meth:`LoadRequests.finish`.

Pure planning: nothing here reads storage.
"""

from __future__ import annotations

import io
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from ..core import CheckpointingException
from ..mapping import ShardedTensor
from .checkpointable import CheckpointableShardedTensor, LocalShardsContainer

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (offsets, sizes)


class CheckpointReadError(CheckpointingException, CheckpointException):
    """The load request does not fit the checkpoint (a key or region it lacks, another global
    shape): ours and torch's ``CheckpointException``, as Megatron-Core's DCP load raises."""

    def __init__(self, message: str, failures: Optional[dict] = None):
        CheckpointingException.__init__(self, message)
        self._failures = dict(failures or {})


def _chunk_shape(sh_ten: ShardedTensor) -> Tuple[int, ...]:
    return (1,) * sh_ten.prepend_axis_num + tuple(sh_ten.local_shape)


def _overlap(a: Box, b: Box) -> int:
    vol = 1
    for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1]):
        vol *= max(0, min(ao + asz, bo + bsz) - max(ao, bo))
    return vol


class TensorRequest:
    """One requested region of a saved tensor: a ShardedTensor whose ``data`` receives it.

    For a tensor stored N-D reformulated the read goes into a block buffer (:meth:`plan`) that
    :meth:`finish` rearranges into ``sh_ten.data``.
    """

    def __init__(self, sh_ten: ShardedTensor):
        self.sh_ten = sh_ten
        self.key, self.offsets = sh_ten.key, tuple(sh_ten.global_offset)
        self.sizes = _chunk_shape(sh_ten)
        self.read: ShardedTensor = sh_ten  # what DCP reads into
        self.block: Optional[Tuple[int, ...]] = None
        self.first_block: Optional[Tuple[int, ...]] = None

    def plan(self, stored_shape: Sequence[int], orig_shape: Optional[Sequence[int]]) -> Box:
        """The region to read, in the stored tensor's index space."""
        if orig_shape is None:
            return self.offsets, self.sizes
        block = tuple(o // s for o, s in zip(orig_shape, stored_shape[:-1]))
        if math.prod(block) != stored_shape[-1]:
            raise CheckpointingException(
                f"Cannot undo the N-D reformulation of {self.key}: stored {tuple(stored_shape)},"
                f" original {tuple(orig_shape)}")
        first = tuple(o // b for o, b in zip(self.offsets, block))
        last = tuple(-(-(o + s) // b) for o, s, b in zip(self.offsets, self.sizes, block))
        counts = tuple(e - f for f, e in zip(first, last)) + (stored_shape[-1],)
        self.block, self.first_block = block, first
        buffer = torch.empty(counts, dtype=self.sh_ten.data.dtype)
        self.read = ShardedTensor(self.key, buffer, buffer.dtype, counts, tuple(stored_shape),
                                  first + (0,), None)
        return first + (0,), counts

    def finish(self) -> None:
        """Move block-buffer values into the target (no-op for plain reads)."""
        if self.read is self.sh_ten:
            return
        buffer, n = self.read.data, len(self.block)
        counts = buffer.shape[:-1]
        blocks = buffer.reshape(*counts, *self.block)
        order = [d for i in range(n) for d in (i, n + i)]
        dense = blocks.permute(order).reshape([c * b for c, b in zip(counts, self.block)])
        start = [o - f * b for o, f, b in zip(self.offsets, self.first_block, self.block)]
        region = dense[tuple(slice(s, s + t) for s, t in zip(start, self.sizes))]
        target = self.sh_ten.data
        for _ in range(self.sh_ten.prepend_axis_num):
            target = target.unsqueeze(0)
        target.copy_(region)
        self.read = self.sh_ten


class LoadRequests:
    """This rank's tensor requests and object keys, checked against and planned for
    ``metadata``.

    Args:
        sharded_tensors: the ShardedTensors to load (with ``data``, not flattened).
        object_keys: unique keys of the ShardedObjects to load.
        metadata: the checkpoint's DCP metadata.
    """

    def __init__(self, sharded_tensors: Sequence[ShardedTensor], object_keys: Sequence[str],
                 metadata: Metadata):
        self.metadata = metadata
        self.object_keys = list(dict.fromkeys(object_keys))
        self.requests = [TensorRequest(sh) for sh in sharded_tensors]
        self._primary: Dict[tuple, TensorRequest] = {}
        self.by_key: Dict[str, List[TensorRequest]] = {}
        for req in self.requests:
            ident = (req.key, req.offsets, req.sizes)
            if ident not in self._primary:
                self._primary[ident] = req
                self.by_key.setdefault(req.key, []).append(req)
        mcore_data = getattr(metadata, "mcore_data", None) or {}
        self._orig_shapes = {
            key: (mcore_data.get(key) or {}).get("nd_reformulated_orig_global_shape")
            for key in self.by_key}

    @property
    def shapes_validation_sharded_tensors(self) -> List[ShardedTensor]:
        """What MCoreLoadPlanner checks the stored global shape of: keys stored as they are,
        whose tensors do not allow a shape mismatch."""
        return [r.sh_ten for key, reqs in self.by_key.items() for r in reqs
                if self._orig_shapes[key] is None and not r.sh_ten.allow_shape_mismatch]

    @property
    def allow_shape_mismatch_sharded_tensors(self) -> Dict[str, ShardedTensor]:
        """Keys whose tensors are read where they overlap the stored one, by key."""
        return {key: reqs[0].sh_ten for key, reqs in self.by_key.items()
                if self._orig_shapes[key] is None and reqs[0].sh_ten.allow_shape_mismatch}

    def check(self) -> None:
        """Raise CheckpointingException for the first request the checkpoint cannot serve;
        plans the reads of reformulated tensors."""
        md = self.metadata.state_dict_metadata
        for key, reqs in self.by_key.items():
            stored = md.get(key)
            if stored is None:
                raise CheckpointingException(f"{key} from model not in state dict: {sorted(md)}")
            if not hasattr(stored, "chunks"):
                raise CheckpointingException(f"{key} is stored as an object, not a tensor")
            orig = self._orig_shapes[key]
            shape = tuple(orig) if orig is not None else tuple(stored.size)
            strict = not reqs[0].sh_ten.allow_shape_mismatch
            expected = tuple(reqs[0].sh_ten.global_shape)
            if strict and expected != shape:
                raise CheckpointingException(
                    f"Global shape mismatch for loaded ({torch.Size(shape)}) and expected "
                    f"({expected}) tensor for key {key}")
            saved = [(tuple(c.offsets), tuple(c.sizes)) for c in stored.chunks]
            for req in reqs:
                box = req.plan(stored.size, orig)
                if strict and sum(_overlap(box, s) for s in saved) != math.prod(box[1]):
                    raise CheckpointingException(
                        f"Saved chunks of {key} do not cover the requested region "
                        f"{box[0]} + {box[1]}")
        for key in self.object_keys:
            if key not in md or hasattr(md[key], "chunks"):
                raise CheckpointingException(f"Object shard {key} not found in the checkpoint")

    def pyt_state_dict(self) -> Dict[str, Any]:
        """One DCP value per key (after :meth:`check`): loading it fills the requests."""
        out: Dict[str, Any] = {}
        for key, reqs in self.by_key.items():
            wrapped = [CheckpointableShardedTensor.from_sh_ten(r.read) for r in reqs]
            out[key] = wrapped[0] if len(wrapped) == 1 else LocalShardsContainer(wrapped)
        for key in self.object_keys:
            out[key] = io.BytesIO()  # replaced by the loaded object
        return out

    def finish(self) -> None:
        """After the load: rearrange reformulated reads and copy shared reads."""
        for req in self._primary.values():
            req.finish()
        for req in self.requests:
            src = self._primary[(req.key, req.offsets, req.sizes)]
            if src is not req:
                req.sh_ten.data.copy_(src.sh_ten.data)
