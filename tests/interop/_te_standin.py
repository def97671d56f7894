"""Megatron-Core's Transformer-Engine layer spec, built without Transformer Engine.

Transformer Engine needs CUDA and does not install on the CPU machines the tests run on, so
``get_gpt_layer_with_transformer_engine_spec`` (megatron-core 0.16.1) cannot name its modules.
:func:`te_layer_spec` calls that real function with its backend provider (the global
``TESpecProvider`` it instantiates) replaced by :class:`StandInTEProvider`, which hands out
Megatron-Core's own local modules where the spec asks for TE ones: stand-ins for
``TELayerNormColumnParallelLinear`` (norm + ``ColumnParallelLinear``),
``TEColumnParallelLinear``/``TERowParallelLinear`` (the local parallel linears, also the
experts' and shared experts') and ``TENorm`` (torch's LayerNorm/RMSNorm).
:func:`te_installed` makes ``TransformerBlock`` pick the ``TENorm`` stand-in for its final norm,
as it does wherever Transformer Engine imports (whatever the layer spec).

What this keeps from the real TE spec: the layer structure the real function builds (no
``input_layernorm`` module, the attention's pre-norm fused into ``linear_qkv``; for dense
layers the MLP's pre-norm fused into ``linear_fc1`` and ``pre_mlp_layernorm`` an
``IdentityOp``; for MoE layers a separate ``pre_mlp_layernorm`` norm, q/k layernorms as
separate norms), hence the checkpoint key set of a TE model: the fused norm's parameters are
named as TE names them (``layer_norm_weight``, ``layer_norm_bias``) and, as in TE's
``sharded_state_dict``, only ``weight``/``bias`` are split over tensor-parallel ranks. And the
``_extra_state`` of every TE module (linears and norms, which Megatron-Core saves as
ShardedObjects): what Transformer Engine 2.9-2.11 (the versions megatron-core 0.16.1 requires)
return from ``get_extra_state`` without FP8 state, an empty ``uint8`` tensor
(``transformer_engine/pytorch/module/base.py`` and ``ops/op.py``); loading accepts what TE
accepts without FP8 state (None or an empty tensor) and refuses FP8 state, which the stand-ins
cannot use.
What it does not prove: TE's kernels and FP8.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


class TEExtraState:
    """Transformer Engine's ``get_extra_state``/``set_extra_state`` without FP8 state. TE's
    modules have no load hook that fills in a missing ``_extra_state`` (Megatron-Core's local
    linears have one, which the linear stand-ins drop): a strict ``load_state_dict`` needs the
    entry."""

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        if state is None or (torch.is_tensor(state) and state.numel() == 0):
            return
        raise RuntimeError(f"{type(self).__name__}: FP8 extra state {type(state).__name__} "
                           "(the Transformer-Engine stand-ins hold none)")


def _te_linears():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    class TEColumnParallelLinearStandIn(TEExtraState, ColumnParallelLinear):
        """``TEColumnParallelLinear``: the local column-parallel linear, TE's extra state."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._load_state_dict_pre_hooks.clear()  # see TEExtraState

    class TERowParallelLinearStandIn(TEExtraState, RowParallelLinear):
        """``TERowParallelLinear``: the local row-parallel linear, TE's extra state."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._load_state_dict_pre_hooks.clear()  # see TEExtraState

    class TELayerNormColumnParallelLinearStandIn(TEColumnParallelLinearStandIn):
        """Norm then ColumnParallelLinear, the norm's parameters named as TE's
        ``TELayerNormColumnParallelLinear`` names them (``layer_norm_weight``/``_bias``)."""

        def __init__(self, input_size, output_size, *, config, **kwargs):
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.layer_norm = config.normalization
            self.eps = config.layernorm_epsilon
            dtype = config.params_dtype
            self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=dtype))
            if self.layer_norm == "LayerNorm":
                self.layer_norm_bias = torch.nn.Parameter(torch.zeros(input_size, dtype=dtype))

        def forward(self, x, *args, **kwargs):
            shape = (x.shape[-1],)
            if self.layer_norm == "LayerNorm":
                x = F.layer_norm(x, shape, self.layer_norm_weight, self.layer_norm_bias,
                                 self.eps)
            else:
                x = F.rms_norm(x, shape, self.layer_norm_weight, self.eps)
            return super().forward(x, *args, **kwargs)

    return (TEColumnParallelLinearStandIn, TERowParallelLinearStandIn,
            TELayerNormColumnParallelLinearStandIn)


_NORM_CLASSES: dict[type, type] = {}


class TENormStandIn:
    """``TENorm``: torch's LayerNorm or RMSNorm from the config (as Megatron-Core's
    ``WrappedTorchNorm`` builds it), with Transformer Engine's extra state."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5):
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        norm = WrappedTorchNorm(config=config, hidden_size=hidden_size, eps=eps)
        base = type(norm)
        if base not in _NORM_CLASSES:
            _NORM_CLASSES[base] = type(f"TE{base.__name__}StandIn", (TEExtraState, base), {})
        norm.__class__ = _NORM_CLASSES[base]
        return norm


@contextlib.contextmanager
def te_installed():
    """While building a model: ``TransformerBlock``'s default final norm is ``TENorm`` (the
    stand-in), as in ``megatron.core.transformer.transformer_block`` when TE imports."""
    from megatron.core.transformer import transformer_block

    saved = transformer_block.LayerNormImpl
    transformer_block.LayerNormImpl = TENormStandIn
    try:
        yield
    finally:
        transformer_block.LayerNormImpl = saved


def te_layer_spec(num_experts, qk_layernorm: bool):
    """The real ``get_gpt_layer_with_transformer_engine_spec`` over the stand-in provider."""
    from megatron.core.models import backends
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    column, row, norm_linear = _te_linears()

    class StandInTEProvider(backends.LocalSpecProvider):
        """TESpecProvider's answers with stand-ins: fused norm + linear where TE fuses."""

        def column_parallel_linear(self):
            return column

        def row_parallel_linear(self):
            return row

        def fuse_layernorm_and_linear(self) -> bool:
            return True

        def column_parallel_layer_norm_linear(self):
            return norm_linear

        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False):
            return TENormStandIn

        def grouped_mlp_modules(self, moe_use_grouped_gemm: bool,
                                moe_use_legacy_grouped_gemm: bool):
            assert not moe_use_grouped_gemm, "the stand-ins have no TEGroupedMLP"
            return SequentialMLP, MLPSubmodules(linear_fc1=column, linear_fc2=row)

    saved = getattr(gpt_layer_specs, "TESpecProvider", None)
    gpt_layer_specs.TESpecProvider = StandInTEProvider
    try:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=qk_layernorm)
    finally:
        if saved is None:
            del gpt_layer_specs.TESpecProvider
        else:
            gpt_layer_specs.TESpecProvider = saved
