"""Test helper: a random Llama model directory as transformers saves it (config.json,
sharded safetensors + index), any size, written one shard at a time."""

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
