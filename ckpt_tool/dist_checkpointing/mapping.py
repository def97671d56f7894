"""Sharded values: how a local tensor/object relates to a global one.

A training script replaces the tensors of its state dict by :class:`ShardedTensor` (usually via
:meth:`ShardedTensor.from_rank_offsets`), non-tensor per-shard values by :class:`ShardedObject`,
and tensors that need a transformation around (de)serialization by :class:`ShardedTensorFactory`.
Names, fields and semantics follow Megatron-Core's ``dist_checkpointing.mapping``; the
non-tensor classes are defined in ``sharded_objects`` and re-exported here.

One deliberate extension: Megatron-Core 0.16 rejects ``flattened_range``; here it is accepted
(with the <= 0.15 semantics) so flattened distributed-optimizer shards can still be described.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, List, Optional, Tuple, Union

import numpy as np
import torch

from ._base import (
    CommonStateDict,
    ReplicaId,
    ShardedBase,
    ShardedStateDict,
    StateDict,
    is_main_replica,
)
from ._shard_math import (
    flat_local_coordinates,
    flattened_range_problem,
    layout_from_rank_offsets,
    narrow_flattened_range,
)
from .core import CheckpointingException
from .dict_utils import dict_list_map_inplace
from .sharded_objects import (
    FactoryBuildFn,
    FactoryMergeFn,
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensorFactory,
    apply_factories,
    apply_factory_merges,
)

__all__ = [
    "StateDict",
    "CommonStateDict",
    "ShardedStateDict",
    "ReplicaId",
    "FactoryBuildFn",
    "FactoryMergeFn",
    "CheckpointingException",
    "ShardedBase",
    "ShardedTensor",
    "ShardedObject",
    "ShardedTensorFactory",
    "LocalNonpersistentObject",
    "is_main_replica",
    "apply_factories",
    "apply_factory_merges",
    "dict_list_map_inplace",
]


@dataclass
class ShardedTensor(ShardedBase):
    """A local tensor that is one piece of a global tensor spread over processes.

    Args:
        key: name of the global tensor (the same on every rank holding a piece of it).
        data: the local tensor; None when only the metadata is needed.
        dtype: dtype of the tensor.
        local_shape: shape of the local piece (before flattening, see ``flattened_range``).
        global_shape: shape of the global tensor.
        global_offset: element offset of the local piece inside the global tensor.
        axis_fragmentations: how many equal pieces each global axis is cut into; None for an
            irregular sharding.
        replica_id: identifies copies of the same piece on different ranks; only the main
            replica (0 or all zeros) is saved.
        prepend_axis_num: number of leading global axes the local tensor lacks (as if it were
            unsqueezed that many times), e.g. the stacked-layer or expert axis.
        allow_shape_mismatch: the stored global shape may differ on load (padded tensors).
        flattened_range: ``data`` is this contiguous slice of the flattened local piece.
    """

    key: str
    data: Optional[torch.Tensor] = field(repr=False)
    dtype: torch.dtype
    local_shape: Tuple[int, ...]
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    axis_fragmentations: Optional[Tuple[int, ...]]
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: Optional[slice] = None

    def __post_init__(self):
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        """Check that data, shapes, offsets and fragmentation are mutually consistent.

        Tensors built with :meth:`from_rank_offsets` / :meth:`from_rank_offsets_flat` always
        pass.
        """
        if len(self.global_shape) != len(self.global_offset):
            raise CheckpointingException(
                f"Global offset dimensions should be equal to global shape dimensions for {self}"
            )
        if len(self.local_shape) + self.prepend_axis_num != len(self.global_shape):
            raise CheckpointingException(
                f"Local shape together with `prepend_axis_num` dimensions should be "
                f"equal to global shape dimensions for {self}"
            )
        if self.axis_fragmentations is not None:
            for off, size in zip(self.global_offset[self.prepend_axis_num :], self.local_shape):
                # size 0 occurs for ranks that hold no part of a parameter (custom FSDP)
                if size != 0 and off % size != 0:
                    raise CheckpointingException(
                        f"Global offset ({off}) must be divisible by local shape ({size}) "
                        f"for {self}."
                    )
        if self.flattened_range is not None:
            problem = flattened_range_problem(self.flattened_range, self.local_shape)
            if problem:
                raise CheckpointingException(f"{problem} for {self}")
        if self.data is None:
            return
        if self.data.dtype != self.dtype:
            raise CheckpointingException(f"Data dtype should match `dtype` attribute for {self}")
        if self.flattened_range is None:
            if tuple(self.data.shape) != tuple(self.local_shape):
                raise CheckpointingException(
                    f"Data shape should match `local_shape` attribute for {self}"
                )
        else:
            expected = self.flattened_range.stop - self.flattened_range.start
            if self.data.ndim != 1 or self.data.numel() != expected:
                raise CheckpointingException(
                    f"Data should be 1D with {expected} elements for a flattened {self}, "
                    f"got shape {tuple(self.data.shape)}"
                )

    @property
    def has_regular_grid(self) -> bool:
        """True if the global tensor is cut into a regular grid (``axis_fragmentations``)."""
        return self.axis_fragmentations is not None

    def global_slice(self) -> Tuple[Union[int, slice], ...]:
        """Index of the local piece in the global tensor (ints for the prepended axes)."""
        n = self.prepend_axis_num
        assert len(self.global_offset) == len(self.local_shape) + n
        ranges = tuple(
            slice(off, off + size)
            for off, size in zip(self.global_offset[n:], self.local_shape)
        )
        return tuple(self.global_offset[:n]) + ranges

    def local_coordinates(self) -> Tuple[np.ndarray, ...]:
        """Per-axis local indices of the elements of a flattened ``data`` (row-major)."""
        if self.flattened_range is None:
            raise CheckpointingException(
                f"`local_coordinates` is undefined for {type(self).__name__} "
                f"without `flattened_range`"
            )
        return flat_local_coordinates(self.flattened_range, self.local_shape)

    def global_coordinates(self) -> Tuple[np.ndarray, ...]:
        """Per-axis global indices of the elements of a flattened ``data``."""
        if self.flattened_range is None:
            raise CheckpointingException(
                f"`global_coordinates` is undefined for {type(self).__name__} "
                f"without `flattened_range`"
            )
        local = self.local_coordinates()
        n = self.prepend_axis_num
        prepended = tuple(np.full_like(local[0], off) for off in self.global_offset[:n])
        return prepended + tuple(c + off for c, off in zip(local, self.global_offset[n:]))

    def local_chunk_offset_in_global(self) -> Tuple[int, ...]:
        """Position of the local piece in the grid of pieces of the global tensor."""
        n = self.prepend_axis_num
        assert len(self.global_offset) == len(self.local_shape) + n
        grid_pos = list(self.global_offset[:n])
        for off, size in zip(self.global_offset[n:], self.local_shape):
            assert off % size == 0, str(self)
            grid_pos.append(off // size)
        return tuple(grid_pos)

    def max_allowed_chunks(self) -> Tuple[int, ...]:
        """Size of one grid piece along each global axis (``global_shape // fragmentation``)."""
        sizes = []
        for axis_len, fragments in zip(self.global_shape, self.axis_fragmentations):
            if not self.allow_shape_mismatch and axis_len % fragments != 0:
                raise CheckpointingException(
                    f"Axis shape ({axis_len}) not divisible by axis fragmentation ({fragments})"
                )
            sizes.append(axis_len // fragments)
        return tuple(sizes)

    def without_data(self) -> "ShardedTensor":
        return replace(self, data=None)

    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: Tuple[int, int, int],
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        flattened_range: None = None,
        **init_kwargs,
    ) -> "ShardedTensor":
        """Describe ``data`` by the position of this rank along the sharded axes.

        Args:
            key: global tensor name.
            data: the local tensor.
            rank_offsets: triples ``(axis, rank_on_axis, fragments_on_axis)``: the global axis
                ``axis`` (counting prepended axes) is cut into ``fragments_on_axis`` equal
                pieces and ``data`` is piece number ``rank_on_axis``. Unlisted axes are whole.
            replica_id: see :class:`ShardedTensor`.
            prepend_axis_num: see :class:`ShardedTensor`; prepended axes have local size 1.
            flattened_range: must be None (use :meth:`from_rank_offsets_flat`).
            init_kwargs: further :class:`ShardedTensor` fields (e.g. ``allow_shape_mismatch``).
        """
        if flattened_range is not None:
            raise ValueError(
                "Cannot instantiate a flat ShardedTensor with `from_rank_offsets` method."
                " Use `from_rank_offsets_flat` instead"
            )
        try:
            global_shape, global_offset, fragmentations = layout_from_rank_offsets(
                key, data.shape, rank_offsets, prepend_axis_num
            )
        except ValueError as e:
            raise CheckpointingException(str(e)) from None
        return cls(
            key,
            data,
            data.dtype,
            tuple(data.shape),
            global_shape,
            global_offset,
            fragmentations,
            replica_id,
            prepend_axis_num,
            **init_kwargs,
        )

    @classmethod
    def from_rank_offsets_flat(
        cls,
        key: str,
        data: torch.Tensor,
        non_flat_local_shape: Tuple[int, ...],
        *args,
        flattened_range: Optional[slice] = None,
        **kwargs,
    ) -> "ShardedTensor":
        """Like :meth:`from_rank_offsets` for a 1-D ``data`` that is ``flattened_range`` of the
        flattened local piece of shape ``non_flat_local_shape``.
        """
        if flattened_range is None:
            raise CheckpointingException(
                "Cannot instantiate a non-flat ShardedTensor with `from_rank_offsets_flat` "
                "method. Use `from_rank_offsets` instead"
            )
        if data.ndim != 1:
            raise CheckpointingException(
                f"Flattened ShardedTensor requires 1D data, got shape: {tuple(data.shape)}"
            )
        if flattened_range.stop - flattened_range.start != data.numel():
            raise CheckpointingException(
                f"Flattened ShardedTensor data length ({data.numel()}) must meet the "
                f"slice length: {flattened_range.stop - flattened_range.start}"
            )
        shape_only = torch.empty(tuple(non_flat_local_shape), dtype=data.dtype, device="meta")
        template = cls.from_rank_offsets(key, shape_only, *args, **kwargs)
        return replace(template, data=data, flattened_range=flattened_range)

    def init_data(self, device: Union[str, torch.device], init_fn: Callable = torch.empty) -> None:
        """Allocate ``data`` with ``init_fn(local_shape, dtype=..., device=...)`` if it is None
        (flattened tensors get the ``flattened_range`` slice of it).
        """
        if self.data is not None:
            return
        full = init_fn(self.local_shape, dtype=self.dtype, device=device)
        if self.flattened_range is not None:
            full = full.flatten()[self.flattened_range.start : self.flattened_range.stop]
        self.data = full

    def narrow(self, dim: int, start: int, length: int) -> List["ShardedTensor"]:
        """``torch.narrow`` for sharded tensors: narrow the local piece on every rank alike.

        ``dim`` counts local axes only. Global shape and offset along that axis shrink by the
        factor ``length / local_shape[dim]``, so only regular grids can be narrowed. Returns
        one tensor for non-flat tensors; for flattened ones (``dim`` must be 0) zero or one,
        depending on whether ``flattened_range`` overlaps the narrowed part.
        """
        g_dim = dim + self.prepend_axis_num
        local_len = self.local_shape[dim]
        for value in (self.global_shape, self.global_offset):
            assert value[g_dim] % local_len == 0, (
                f"Only regular grid of local tensors is supported for narrowing, got: {self}"
            )

        def with_axis(values, new):
            values = list(values)
            values[g_dim] = new
            return tuple(values)

        global_shape = with_axis(self.global_shape, self.global_shape[g_dim] * length // local_len)
        global_offset = with_axis(
            self.global_offset, self.global_offset[g_dim] * length // local_len
        )

        if self.flattened_range is None:
            new_data = self.data.narrow(dim, start, length)
            return [
                replace(
                    self,
                    data=new_data,
                    local_shape=tuple(new_data.shape),
                    global_shape=global_shape,
                    global_offset=global_offset,
                )
            ]

        if dim != 0:
            raise CheckpointingException(
                f"Narrowing along the first axis is supported for now only, got dim={dim}"
            )
        narrowed = narrow_flattened_range(self.flattened_range, self.local_shape, start, length)
        if narrowed is None:
            return []
        new_range, data_lo, data_hi = narrowed
        new_data = self.data[data_lo:data_hi]
        local_shape = (length,) + tuple(self.local_shape[1:])
        return [
            replace(
                self,
                data=new_data,
                local_shape=local_shape,
                global_shape=global_shape,
                global_offset=global_offset,
                flattened_range=new_range,
            )
        ]

    def __str__(self) -> str:
        extra = "" if self.flattened_range is None else f", flattened_range={self.flattened_range}"
        return (
            f"{type(self).__name__}(key='{self.key}', dtype={self.dtype}, "
            f"local_shape={tuple(self.local_shape)}, global_shape={tuple(self.global_shape)}, "
            f"global_offset={tuple(self.global_offset)}, replica_id={self.replica_id}{extra})"
        )
