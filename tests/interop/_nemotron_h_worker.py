"""torchrun worker (1 rank): the REAL Megatron-Core 0.16.1 hybrid ``MambaModel`` (pattern
``M*-``: Mamba-2, attention, squared-ReLU MLP; ``fixtures/_mamba_cpu.py``'s local stack spec
and CPU stand-ins, the scan included) and transformers 5.25's ``NemotronHForCausalLM`` of the
same shape, its weights (randomised) copied into Megatron-Core's parameters name by name;
rank 0 saves both fp32 logits for ``TOKENS`` to ``OUT`` (``{"megatron": ..., "hf": ...}``).

    torchrun --nproc-per-node 1 _nemotron_h_worker.py OUT [MUTATION]

``MUTATION`` ``swap_bc`` copies ``in_proj``'s B and C rows swapped (a mapping mistake the
logits must show).
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "fixtures"))

TOKENS = [[1, 5, 7, 99, 3, 4, 20, 50, 11, 0], [2, 3, 4, 5, 6, 7, 8, 9, 98, 97]]
HIDDEN, HEADS, GROUPS, HEAD_DIM, FFN, VOCAB = 64, 4, 2, 16, 128, 100
STATE, M_HEAD_DIM, M_GROUPS, M_HEADS = 16, 16, 2, 8
D_INNER = M_HEADS * M_HEAD_DIM


def hf_model():
    import torch
    import transformers

    torch.manual_seed(3)
    cfg = transformers.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, layers_block_type=["mamba", "attention", "mlp"],
        num_attention_heads=HEADS, num_key_value_heads=GROUPS, head_dim=HEAD_DIM,
        intermediate_size=FFN, mlp_hidden_act="relu2", ssm_state_size=STATE,
        mamba_num_heads=M_HEADS, mamba_head_dim=M_HEAD_DIM, n_groups=M_GROUPS, conv_kernel=4,
        use_conv_bias=True, mamba_proj_bias=False, attention_bias=False, mlp_bias=False,
        layer_norm_epsilon=1e-5, tie_word_embeddings=False, chunk_size=4)
    model = transformers.NemotronHForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.rand_like(p) * 4 + 0.5))
            elif name.endswith(("dt_bias", ".D")):
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))
    return model


def megatron_model():
    import torch
    from megatron.core.activations import squared_relu
    from megatron.core.models.mamba import MambaModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    import _mamba_cpu

    _mamba_cpu.patch_final_norm()
    config = TransformerConfig(
        num_layers=3, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
        kv_channels=HEAD_DIM, ffn_hidden_size=FFN, gated_linear_unit=False,
        activation_func=squared_relu, add_bias_linear=False, normalization="RMSNorm",
        layernorm_epsilon=1e-5, mamba_state_dim=STATE, mamba_head_dim=M_HEAD_DIM,
        mamba_num_groups=M_GROUPS, mamba_num_heads=M_HEADS, tensor_model_parallel_size=1,
        use_cpu_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0,
        attention_dropout=0.0, masked_softmax_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False)
    return MambaModel(config=config, mamba_stack_spec=_mamba_cpu.local_hybrid_stack_spec(),
                      vocab_size=128, max_sequence_length=16, hybrid_override_pattern="M*-",
                      share_embeddings_and_output_weights=False,
                      position_embedding_type="none").eval()


def megatron_weights(hf: dict, mutation: str) -> dict:
    """Megatron-Core's TP1 parameter names (local spec) <- the NemotronH tensors."""
    import torch

    out = {"embedding.word_embeddings.weight": torch.cat(
        [hf["model.embeddings.weight"], torch.zeros(128 - VOCAB, HIDDEN)]),
        "decoder.final_norm.weight": hf["model.norm_f.weight"],
        "output_layer.weight": torch.cat([hf["lm_head.weight"], torch.zeros(128 - VOCAB, HIDDEN)])}
    m, a, f = "model.layers.0.", "model.layers.1.", "model.layers.2."
    in_proj = hf[m + "mixer.in_proj.weight"]
    if mutation == "swap_bc":
        z, x, b, c, dt = in_proj.split([D_INNER, D_INNER, M_GROUPS * STATE,
                                        M_GROUPS * STATE, M_HEADS])
        in_proj = torch.cat([z, x, c, b, dt])
    out.update({"decoder.layers.0.norm.weight": hf[m + "norm.weight"],
                "decoder.layers.0.mixer.in_proj.weight": in_proj})
    for leaf in ("conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight",
                 "out_proj.weight"):
        out[f"decoder.layers.0.mixer.{leaf}"] = hf[m + "mixer." + leaf]
    q, k, v = (hf[a + f"mixer.{n}_proj.weight"] for n in "qkv")
    per = HEADS // GROUPS
    qkv = [torch.cat([q.view(GROUPS, per * HEAD_DIM, HIDDEN)[g],
                      k.view(GROUPS, HEAD_DIM, HIDDEN)[g], v.view(GROUPS, HEAD_DIM, HIDDEN)[g]])
           for g in range(GROUPS)]
    out.update({"decoder.layers.1.input_layernorm.weight": hf[a + "norm.weight"],
                "decoder.layers.1.self_attention.linear_qkv.weight": torch.cat(qkv),
                "decoder.layers.1.self_attention.linear_proj.weight": hf[a + "mixer.o_proj.weight"],
                "decoder.layers.2.pre_mlp_layernorm.weight": hf[f + "norm.weight"],
                "decoder.layers.2.mlp.linear_fc1.weight": hf[f + "mixer.up_proj.weight"],
                "decoder.layers.2.mlp.linear_fc2.weight": hf[f + "mixer.down_proj.weight"]})
    return out


def main() -> int:
    import _mamba_cpu
    import _mcore_family as F

    _mamba_cpu.install_kernel_stand_ins()
    F.init(1, 1, 1)
    import torch

    hf = hf_model()
    model = megatron_model()
    weights = megatron_weights(dict(hf.state_dict()), sys.argv[2] if len(sys.argv) > 2 else "")
    own = {k for k, _ in model.named_parameters()}
    assert own == set(weights), (sorted(own ^ set(weights)))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), missing
    tokens = torch.tensor(TOKENS)
    seq = tokens.shape[1]
    with torch.no_grad():
        pos = torch.arange(seq).unsqueeze(0).expand_as(tokens)
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
        got = model(tokens, pos, mask)[..., :VOCAB].float()
        want = hf(tokens).logits.float()
    torch.save({"megatron": got.clone(), "hf": want.clone()}, sys.argv[1])
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
