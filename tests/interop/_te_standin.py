"""Megatron-Core's Transformer-Engine layer spec, built without Transformer Engine.

Transformer Engine needs CUDA and does not install on the CPU machines the tests run on, so
``get_gpt_layer_with_transformer_engine_spec`` (megatron-core 0.16.1) cannot name its modules.
:func:`te_layer_spec` calls that real function with its backend provider (the global
``TESpecProvider`` it instantiates) replaced by :class:`StandInTEProvider`, which hands out
Megatron-Core's own local modules where the spec asks for TE ones, and
:class:`LayerNormColumnParallelLinear` where it asks for ``TELayerNormColumnParallelLinear``.

What this keeps from the real TE spec: the layer structure the real function builds (no
``input_layernorm`` module, the attention's pre-norm fused into ``linear_qkv``; for dense
layers the MLP's pre-norm fused into ``linear_fc1`` and ``pre_mlp_layernorm`` an
``IdentityOp``; for MoE layers a separate ``pre_mlp_layernorm`` norm, q/k layernorms as
separate norms), hence the checkpoint key set of a TE model: the fused norm's parameters are
named as TE names them (``layer_norm_weight``, ``layer_norm_bias``) and, as in TE's
``sharded_state_dict``, only ``weight``/``bias`` are split over tensor-parallel ranks.
What it does not prove: TE's kernels and its ``_extra_state`` (FP8 metadata) entries, which
the stand-ins do not have.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _layer_norm_column_parallel_linear():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    class LayerNormColumnParallelLinear(ColumnParallelLinear):
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

    return LayerNormColumnParallelLinear


def te_layer_spec(num_experts, qk_layernorm: bool):
    """The real ``get_gpt_layer_with_transformer_engine_spec`` over the stand-in provider."""
    from megatron.core.models import backends
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    norm_linear = _layer_norm_column_parallel_linear()

    class StandInTEProvider(backends.LocalSpecProvider):
        """TESpecProvider's answers with local modules: fused norm + linear where TE fuses."""

        def fuse_layernorm_and_linear(self) -> bool:
            return True

        def column_parallel_layer_norm_linear(self):
            return norm_linear

        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False):
            return WrappedTorchNorm  # like TENorm: LayerNorm or RMSNorm from the config

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
