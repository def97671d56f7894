"""Test helper: random Llama and GPT-2 model directories as transformers saves them
(config.json, sharded safetensors + index), any size, written one shard at a time."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def llama_config(hidden: int = 8, inter: int = 12, layers: int = 2, heads: int = 2,
                 kv: int = 1, vocab: int = 10, dtype: str = "float32") -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab,
            "max_position_embeddings": 16, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            "torch_dtype": dtype}


def llama_dir(root: Path, shards: int = 2, seed: int = 0, **sizes) -> Path:
    """``root`` with ``config.json`` (``llama_config(**sizes)``) and ``shards`` safetensors
    files + ``model.safetensors.index.json``; returns ``root``."""
    cfg = llama_config(**sizes)
    h, i, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_key_value_heads"]
    hd = h // cfg["num_attention_heads"]
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h),
              "lm_head.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update({p + "self_attn.q_proj.weight": (h, h),
                       p + "self_attn.k_proj.weight": (kv * hd, h),
                       p + "self_attn.v_proj.weight": (kv * hd, h),
                       p + "self_attn.o_proj.weight": (h, h), p + "mlp.gate_proj.weight": (i, h),
                       p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
                       p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    return _save(root, cfg, shapes, shards, seed)


def gpt2_config(hidden: int = 16, layers: int = 2, heads: int = 4, vocab: int = 50,
                positions: int = 32, dtype: str = "float32") -> dict:
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": hidden,
            "n_layer": layers, "n_head": heads, "n_positions": positions, "vocab_size": vocab,
            "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new",
            "torch_dtype": dtype}


def gpt2_dir(root: Path, shards: int = 1, seed: int = 0, **sizes) -> Path:
    """``root`` with a GPT-2 ``config.json`` (``gpt2_config(**sizes)``: one key/value head
    per query head, tied embeddings) and its weights (Conv1D ``[in, out]``)."""
    cfg = gpt2_config(**sizes)
    h = cfg["n_embd"]
    shapes = {"transformer.wte.weight": (cfg["vocab_size"], h),
              "transformer.wpe.weight": (cfg["n_positions"], h),
              "transformer.ln_f.weight": (h,), "transformer.ln_f.bias": (h,)}
    for n in range(cfg["n_layer"]):
        p = f"transformer.h.{n}."
        shapes.update({p + "ln_1.weight": (h,), p + "ln_1.bias": (h,), p + "ln_2.weight": (h,),
                       p + "ln_2.bias": (h,), p + "attn.c_attn.weight": (h, 3 * h),
                       p + "attn.c_attn.bias": (3 * h,), p + "attn.c_proj.weight": (h, h),
                       p + "attn.c_proj.bias": (h,), p + "mlp.c_fc.weight": (h, 4 * h),
                       p + "mlp.c_fc.bias": (4 * h,), p + "mlp.c_proj.weight": (4 * h, h),
                       p + "mlp.c_proj.bias": (h,)})
    return _save(root, cfg, shapes, shards, seed)


def _save(root: Path, cfg: dict, shapes: dict, shards: int, seed: int) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(seed)
    keys = sorted(shapes)
    names = [f"model-{k + 1:05d}-of-{shards:05d}.safetensors" for k in range(shards)]
    weight_map = {}
    for k, name in enumerate(names):
        part = {key: torch.randn(shapes[key], generator=g).to(getattr(torch, cfg["torch_dtype"]))
                for key in keys[k::shards]}
        save_file(part, str(root / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
        del part
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}))
    return root
