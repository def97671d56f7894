"""torchrun worker: the REAL Megatron-Core GPTModel with grouped-query attention and MoE layers
(GLM-4.5, GPT-OSS) for the Hugging Face tests; the jobs and their modes are
``_hf_mla_worker.py``'s (``load``: complete sharded state dict, default strictness, every
parameter loaded; ``save``: seeded values and expert biases, Megatron-LM-shaped state), the
model is built here.

    torchrun --nproc-per-node 4 _hf_moe_worker.py SPEC.json

A job's ``config`` holds ``TransformerConfig`` fields (JSON: ``activation`` ``silu`` or
``quick_gelu`` for ``activation_func``; ``window_size`` a list; ``yarn_*`` set as attributes), ``gpt`` the ``GPTModel``
arguments (``rotary_percent``, ``rotary_base``, ``position_embedding_type``), ``args`` (save)
the Megatron-LM ``args`` saved with it. Built from Megatron-Core 0.16.1's own specs:
``get_gpt_decoder_block_spec(config, use_transformer_engine=False)`` (non-homogeneous layers
from ``moe_layer_freq``, the local modules) and ``get_gpt_mtp_block_spec``, with
``fixtures/_mcore_mla.py``'s CPU stand-in for the norms under sequence parallelism
(``SequenceParallelRMSNorm``: TP > 1 with MoE needs it) and ``te_general_gemm`` names. With a
sliding window, Megatron-Core 0.16.1 builds the mask on ``"cuda"``
(``transformer/utils.get_sliding_window_causal_mask``): its own ``triu``/``tril`` run on the CPU,
as in ``_hf_logits_worker.py``.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _hf_mla_worker as W  # noqa: E402  (puts fixtures/ on sys.path)


def _cpu_window_mask() -> None:
    import types

    import torch
    from megatron.core.transformer import utils as mcore_utils

    def ones(*a, device=None, **k):
        return torch.ones(*a, **k)

    cpu_torch = types.ModuleType("torch")
    cpu_torch.__dict__.update(vars(torch), ones=ones)
    mcore_utils.torch = cpu_torch


def build(tp, pp, ep, dtype, parallel_output=True, mtp=False, vocab=128, seq=16, gpt=None,
          **fields):
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec,
                                                           get_gpt_mtp_block_spec)
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    import _mcore_mla as M

    M._no_te_gemm()
    fields = dict(fields)
    act = {"silu": F.silu, "quick_gelu": quick_gelu}[fields.pop("activation", "silu")]
    if fields.get("window_size"):
        fields["window_size"] = tuple(fields["window_size"])
        _cpu_window_mask()
    # YaRN: 0.16.1's TransformerConfig has no yarn_* fields; GPTModel and the attention read
    # them as attributes (Megatron-Bridge's GPT-OSS config subclass declares them)
    yarn = {k: fields.pop(k) for k in list(fields) if k.startswith("yarn_")}
    cfg = TransformerConfig(**{
        **dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=act,
               add_bias_linear=False, moe_router_load_balancing_type="none",
               moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather",
               moe_grouped_gemm=False, tensor_model_parallel_size=tp,
               pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
               expert_tensor_parallel_size=1, sequence_parallel=tp > 1,
               use_cpu_initialization=True, params_dtype=dtype, pipeline_dtype=dtype,
               bf16=dtype == torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0,
               masked_softmax_fusion=False, bias_activation_fusion=False,
               bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
               gradient_accumulation_fusion=False),
        **fields, "mtp_num_layers": 1 if mtp else None})
    for k, v in yarn.items():
        setattr(cfg, k, v)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    mtp_spec = get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False) if mtp else None
    for s in (spec, mtp_spec):
        M._replace_in_spec(s, WrappedTorchNorm, M.SequenceParallelRMSNorm)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=vocab,
                    max_sequence_length=seq, pre_process=ps.is_pipeline_first_stage(),
                    post_process=ps.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=False,
                    parallel_output=parallel_output, mtp_block_spec=mtp_spec,
                    **{"position_embedding_type": "rope", **(gpt or {})})


def args(tp, pp, dp, ep, dtype, **fields):
    import _mcore_cpu as H

    return H.megatron_args(tp, pp, dp, dtype, **{"expert_model_parallel_size": ep,
                                                 "expert_tensor_parallel_size": 1, **fields})


if __name__ == "__main__":
    W.BUILD, W.ARGS = build, args
    sys.exit(W.main())
