"""Write a DeepSeek-V3 Hugging Face directory in the released FP8 form, at the real tensor shapes.

    python bench/make_deepseek_v3_fp8.py OUT [--layers 4] [--dense 1] [--experts 256]
        [--mtp] [--pow2-scales] [--set KEY=VALUE ...] [--dry-run]

What ``deepseek-ai/DeepSeek-V3`` on the Hub holds, with random content and fewer layers:

* ``config.json``: the release's (``DeepseekV3ForCausalLM``, hidden 7168, 128 heads, MLA ranks
  ``q_lora_rank`` 1536 / ``kv_lora_rank`` 512, 256 routed experts of width 2048 + 1 shared,
  dense width 18432, vocab 129,280, yarn rope, ``quantization_config`` fp8 e4m3 with 128x128
  blocks), with ``num_hidden_layers`` = ``--layers``, ``first_k_dense_replace`` = ``--dense``
  (3 in the release), ``n_routed_experts`` = ``--experts`` (256 unless the disk says
  otherwise: a MoE layer of 256 experts is 11.5 GB) and ``num_nextn_predict_layers`` 1 with
  ``--mtp`` (its layer written after the last, as the release does), else 0. ``--set``
  overrides any other field (small shapes for a smoke test).
* the tensors where and as the release stores them: every linear weight of attention, of the
  dense MLP, of the routed and shared experts ``float8_e4m3fn`` with a
  float32 ``weight_scale_inv`` of ``ceil(rows/128) x ceil(cols/128)`` blocks (partial edge
  blocks where the rows do not divide: ``kv_a_proj_with_mqa``'s 576); norms, embeddings,
  ``lm_head``, the router ``gate`` and MTP's ``eh_proj`` bfloat16; ``gate.e_score_correction_bias`` float32;
* safetensors shards of at most 5 GB (the release: 163 shards of about 4.3 GB, named
  ``model-00001-of-000163.safetensors``) and ``model.safetensors.index.json``.

Content: FP8 codes uniform over the finite e4m3 codes, with 448 (the largest) in every
128x128 block, as a quantizer that scales each block's amax to 448 leaves them; scales
``2^u``, ``u`` uniform in [-16, -10] (``--pow2-scales``: integer ``u``, as DeepSeek-V3.1's
``ue8m0`` scales); bf16 weights of magnitude 2^-10..2^-3, norms in [1, 2). Each tensor is
drawn from a generator seeded by its name (the MTP layer's ``embed_tokens`` and
``shared_head.head``: the model's, whose copies they are) (``tensor_bytes`` gives it again), written a slab of
at most 64 MiB at a time: memory stays near one slab whatever the model's size.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
import zlib
from pathlib import Path

BLOCK = 128
SHARD_BYTES = 5 * 10**9
SLAB_BYTES = 64 << 20
ITEM = {"F8_E4M3": 1, "BF16": 2, "F32": 4}

# deepseek-ai/DeepSeek-V3 config.json (the release; auto_map names its remote code)
RELEASE_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "pretraining_tp": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                            "quant_method": "fp8", "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "seq_aux": True, "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "transformers_version": "4.33.1", "use_cache": True,
    "v_head_dim": 128, "vocab_size": 129280,
}


def make_config(layers: int, dense: int, experts: int, mtp: bool,
                overrides: dict | None = None) -> dict:
    c = {**RELEASE_CONFIG, "num_hidden_layers": layers, "first_k_dense_replace": dense,
         "n_routed_experts": experts, "num_nextn_predict_layers": int(mtp)}
    c.update(overrides or {})
    return c


def _linear(out: list, name: str, rows: int, cols: int) -> None:
    out.append((name + ".weight", "F8_E4M3", (rows, cols)))
    out.append((name + ".weight_scale_inv", "F32", (-(-rows // BLOCK), -(-cols // BLOCK))))


def _layer(out: list, p: str, c: dict, moe: bool) -> None:
    h, heads = c["hidden_size"], c["num_attention_heads"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    q_lora, kv_lora = c["q_lora_rank"], c["kv_lora_rank"]
    out.append((p + "input_layernorm.weight", "BF16", (h,)))
    _linear(out, p + "self_attn.q_a_proj", q_lora, h)
    out.append((p + "self_attn.q_a_layernorm.weight", "BF16", (q_lora,)))
    _linear(out, p + "self_attn.q_b_proj", heads * (nope + rope), q_lora)
    _linear(out, p + "self_attn.kv_a_proj_with_mqa", kv_lora + rope, h)
    out.append((p + "self_attn.kv_a_layernorm.weight", "BF16", (kv_lora,)))
    _linear(out, p + "self_attn.kv_b_proj", heads * (nope + v), kv_lora)
    _linear(out, p + "self_attn.o_proj", h, heads * v)
    out.append((p + "post_attention_layernorm.weight", "BF16", (h,)))
    if not moe:
        ffn = c["intermediate_size"]
        for proj, shape in (("gate_proj", (ffn, h)), ("up_proj", (ffn, h)),
                            ("down_proj", (h, ffn))):
            _linear(out, f"{p}mlp.{proj}", *shape)
        return
    e, m = c["n_routed_experts"], c["moe_intermediate_size"]
    out.append((p + "mlp.gate.weight", "BF16", (e, h)))
    out.append((p + "mlp.gate.e_score_correction_bias", "F32", (e,)))
    for i in range(e):
        for proj, shape in (("gate_proj", (m, h)), ("up_proj", (m, h)), ("down_proj", (h, m))):
            _linear(out, f"{p}mlp.experts.{i}.{proj}", *shape)
    s = m * c["n_shared_experts"]
    for proj, shape in (("gate_proj", (s, h)), ("up_proj", (s, h)), ("down_proj", (h, s))):
        _linear(out, f"{p}mlp.shared_experts.{proj}", *shape)


def tensors(c: dict) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(name, safetensors dtype, shape)`` of every tensor, in the order written."""
    h, vocab, layers = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    out: list = [("model.embed_tokens.weight", "BF16", (vocab, h))]
    for i in range(layers):
        _layer(out, f"model.layers.{i}.", c, moe=i >= c["first_k_dense_replace"])
    for j in range(c["num_nextn_predict_layers"]):
        p = f"model.layers.{layers + j}."
        _layer(out, p, c, moe=True)
        out += [(p + "enorm.weight", "BF16", (h,)), (p + "hnorm.weight", "BF16", (h,))]
        out.append((p + "eh_proj.weight", "BF16", (h, 2 * h)))
        out += [(p + "embed_tokens.weight", "BF16", (vocab, h)),
                (p + "shared_head.norm.weight", "BF16", (h,)),
                (p + "shared_head.head.weight", "BF16", (vocab, h))]
    out += [("model.norm.weight", "BF16", (h,)), ("lm_head.weight", "BF16", (vocab, h))]
    return out


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return ITEM[dtype] * math.prod(shape)


def shards(ts: list) -> list[list]:
    """Tensors grouped into shards of at most SHARD_BYTES (a tensor never split)."""
    out: list[list] = [[]]
    size = 0
    for t in ts:
        n = nbytes(t[1], t[2])
        if out[-1] and size + n > SHARD_BYTES:
            out.append([])
            size = 0
        out[-1].append(t)
        size += n
    return out


def _rng(name: str, seed: int):
    import numpy as np

    # the MTP layer's embedding and head are copies of the model's (the release shares them)
    if name.endswith(".embed_tokens.weight"):
        name = "model.embed_tokens.weight"
    elif name.endswith(".shared_head.head.weight"):
        name = "lm_head.weight"
    return np.random.Generator(np.random.PCG64([seed, zlib.crc32(name.encode())]))


def tensor_bytes(name: str, dtype: str, shape: tuple[int, ...], *, seed: int = 0,
                 pow2_scales: bool = False):
    """The tensor's bytes, as numpy arrays of at most SLAB_BYTES, in order."""
    import numpy as np

    rng = _rng(name, seed)
    if dtype == "F8_E4M3":
        rows, cols = shape
        step = max(BLOCK, SLAB_BYTES // cols // BLOCK * BLOCK)
        for r0 in range(0, rows, step):
            n = min(step, rows - r0)
            a = rng.integers(0, 256, (n, cols), dtype=np.uint8)
            a[(a & 0x7F) == 0x7F] = 0  # the NaN codes of e4m3fn
            a[::BLOCK, ::BLOCK] = 0x7E  # 448: every block's amax
            yield a
        return
    n = math.prod(shape)
    if dtype == "F32":
        if name.endswith("_scale_inv"):
            u = rng.integers(-16, -9, n) if pow2_scales else rng.uniform(-16, -10, n)
            yield np.exp2(u).astype(np.float32)
        else:
            yield (rng.standard_normal(n) * 0.01).astype(np.float32)
        return
    norm = "norm" in name.rsplit(".", 2)[-2]
    step = SLAB_BYTES // 2
    for s in range(0, n, step):
        r = rng.integers(0, 1 << 16, min(step, n - s), dtype=np.uint16)
        if norm:  # [1, 2)
            yield (r & 0x007F) | np.uint16(127 << 7)
        else:  # sign, exponent 117..124, mantissa
            yield (r & 0x807F) | ((((r >> 7) & 7) + 117) << 7).astype(np.uint16)


def _header(group: list) -> bytes:
    head: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, dtype, shape in group:
        n = nbytes(dtype, shape)
        head[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write(out: Path, c: dict, *, seed: int = 0, pow2_scales: bool = False) -> int:
    """Write the directory; returns the bytes of its shards."""
    out.mkdir(parents=True, exist_ok=True)
    groups = shards(tensors(c))
    weight_map, total = {}, 0
    for i, group in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-{len(groups):06d}.safetensors"
        tmp = out / (fname + ".tmp")
        with open(tmp, "wb") as f:
            f.write(_header(group))
            for name, dtype, shape in group:
                for a in tensor_bytes(name, dtype, shape, seed=seed, pow2_scales=pow2_scales):
                    f.write(memoryview(a).cast("B"))
                weight_map[name] = fname
                total += nbytes(dtype, shape)
            f.flush()
            os.fsync(f.fileno())
        tmp.rename(out / fname)
        print(f"  {fname}: {len(group)} tensors", file=sys.stderr, flush=True)
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(c, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"_from_model_config": True, "bos_token_id": c["bos_token_id"],
         "eos_token_id": c["eos_token_id"], "do_sample": True, "temperature": 0.6,
         "top_p": 0.95, "transformers_version": "4.46.3"}, indent=2) + "\n")
    return total


def _value(s: str):
    try:
        return json.loads(s)
    except json.JSONDecodeError:
        return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dense", type=int, default=1, help="first_k_dense_replace")
    ap.add_argument("--experts", type=int, default=256, help="n_routed_experts")
    ap.add_argument("--mtp", action="store_true", help="write the MTP layer")
    ap.add_argument("--pow2-scales", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--dry-run", action="store_true", help="print the sizes, write nothing")
    a = ap.parse_args()
    over = {k: _value(v) for k, v in (s.split("=", 1) for s in a.set)}
    c = make_config(a.layers, a.dense, a.experts, a.mtp, over)
    ts = tensors(c)
    fp8 = sum(nbytes(d, s) for _, d, s in ts if d == "F8_E4M3")
    total = sum(nbytes(d, s) for _, d, s in ts)
    print(f"{a.out}: {c['num_hidden_layers']} layers ({c['first_k_dense_replace']} dense), "
          f"{c['n_routed_experts']} experts, MTP {c['num_nextn_predict_layers']}: "
          f"{len(ts)} tensors, {total / 1e9:.2f} GB ({fp8 / 1e9:.2f} GB FP8), "
          f"{len(shards(ts))} shards", file=sys.stderr)
    if not a.dry_run:
        write(a.out, c, seed=a.seed, pow2_scales=a.pow2_scales)


if __name__ == "__main__":
    main()
