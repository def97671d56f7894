"""The ``_extra_state`` ShardedObjects of a Megatron-Core checkpoint that ``ckpt`` builds (an
HF import, a legacy checkpoint stacked for a dist target): which ones
(:mod:`ckpt_tool.planning.extra_state`) and what each holds."""

from __future__ import annotations

from typing import Any, Mapping

from ckpt_tool.model import ObjectMeta, TensorMeta
from ckpt_tool.planning.extra_state import NONE, extra_state_objects, payload_kind

__all__ = ["ExtraStates"]


class ExtraStates:
    """The ``_extra_state`` objects of a ``spec`` (``local``/``te``) GPT with dist keys
    ``tensors``, and their payloads as the modules' ``get_extra_state`` gives them without
    FP8 state (``None``, or Transformer Engine's empty ``uint8`` tensor)."""

    def __init__(self, tensors: Mapping[str, TensorMeta], spec: str):
        self.spec = spec
        self.objects: tuple[ObjectMeta, ...] = tuple(extra_state_objects(tensors, spec))
        self._keys = frozenset(o.unique_key for o in self.objects)

    def __contains__(self, unique_key: object) -> bool:
        return unique_key in self._keys

    def payload(self, unique_key: str) -> Any:
        if unique_key not in self._keys:
            raise KeyError(unique_key)
        if payload_kind(self.spec, unique_key) == NONE:
            return None
        import torch

        return torch.empty(0, dtype=torch.uint8)
