"""DistributedOptimizer state that a reader already presents per parameter (model space), under
the older name of the fp32 main parameter, rewritten in the form Megatron-Core 0.16 resumes from
at any layout (``fully_reshardable``). Used by :func:`ckpt_tool.ops._optim_unflatten.
unflatten_bucketed_optimizer`."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ckpt_tool.formats.base import Reader
from ckpt_tool.model import CheckpointMeta, TensorMeta

__all__ = ["ModelSpaceDistOptimizerView"]

_MAIN_0_15 = "optimizer.state.fp32_param."
_MCORE_LM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable",
                      "singleton_local_shards": False, "chained_optim_avoid_prefix": True}


class ModelSpaceDistOptimizerView(Reader):
    """DistributedOptimizer state that a reader already presents per parameter but under the
    older name of the fp32 main parameter (``optimizer.state.fp32_param.<key>``: Megatron-Core
    0.15's ``fully_sharded_model_space``, the legacy ``distrib_optim.pt`` whose slots the legacy
    reader rebuilds) in the form Megatron-Core 0.16 resumes from at any layout:
    ``fully_reshardable`` (``optimizer.state.{param,exp_avg,exp_avg_sq}.<key>``), its common
    ``optimizer`` entry and the content metadata Megatron-LM writes, with ``fully_reshardable``
    as the sharding type. ``drop_objects``: keys of objects the new form has no place for."""

    def __init__(self, reader: Reader, summary: str, drop_objects: tuple[str, ...] = ()):
        super().__init__(reader.path, trust=reader.trust)
        self.verify = reader.verify
        self.inner = reader
        self.format_name = reader.format_name
        meta = reader.metadata()
        self._names: dict[str, str] = {}
        tensors: dict[str, TensorMeta] = {}
        for k, t in meta.tensors.items():
            new = ("optimizer.state.param." + k[len(_MAIN_0_15):]
                   if k.startswith(_MAIN_0_15) else k)
            self._names[new] = k
            tensors[new] = replace(t, key=new)
        objects = tuple(o for o in meta.objects if o.key not in drop_objects)
        extras = dict(meta.extras)
        extras["optimizer_sharding"] = {"type": "fully_reshardable", "declared": None,
                                        "source": summary}
        common = dict(meta.common)
        common["content_metadata"] = self._content_metadata(common.get("content_metadata"))
        self._meta = replace(meta, tensors=tensors, objects=objects, extras=extras,
                             common=common)

    def stored_archives(self, chunks: Any) -> list[Any]:
        return self.inner.stored_archives(chunks)

    @staticmethod
    def _content_metadata(cm: Any) -> dict[str, Any]:
        return {**(cm if isinstance(cm, dict) else _MCORE_LM_METADATA),
                "distrib_optim_sharding_type": "fully_reshardable"}

    def metadata(self) -> CheckpointMeta:
        return self._meta

    def objects_in_common(self) -> frozenset[str]:
        return self.inner.objects_in_common()

    def common(self) -> dict[str, Any]:
        common = dict(self.inner.common())
        optimizer = dict(common.get("optimizer") or {})
        optimizer.pop("param_state", None)
        optimizer["param_state_sharding_type"] = "fully_reshardable"
        common["optimizer"] = optimizer
        common["content_metadata"] = self._content_metadata(common.get("content_metadata"))
        return common

    def read(self, key: str, slices: tuple[slice, ...] | None = None) -> Any:
        return self.inner.read(self._names.get(key, key), slices)

    def read_object(self, unique_key: str) -> Any:
        return self.inner.read_object(unique_key)

    def close(self) -> None:
        self.inner.close()
