"""A GPT-OSS directory in the form the openai/gpt-oss releases store it: the experts'
``gate_up_proj`` / ``down_proj`` as MXFP4 ``NAME_blocks`` uint8 ``[experts, out, in / 32, 16]``
(two e2m1 codes a byte, low nibble first) and ``NAME_scales`` uint8 ``[experts, out, in / 32]``
(an e8m0 exponent per 32 values along ``in``), everything else bf16, and
``quantization_config {"quant_method": "mxfp4", "modules_to_not_convert": [...]}`` with the
releases' list; and the same model dequantized by transformers' own
``integrations/mxfp4.convert_moe_packed_tensors`` (bf16, no ``quantization_config``).

The quantizer is the MXFP4 formula of the one transformers' ``Mxfp4Quantize`` calls
(``quantize_to_mxfp4`` -> triton_kernels ``numerics_details/mxfp.downcast_to_mxfp_torch``,
default rounding ``ROUND_UP``), written here in plain torch: per 32 values, the scale is the
smallest power of two >= amax / 6 (exponent + 127 stored; 0 where amax is 0) and each value
divided by it is rounded to the nearest e2m1 magnitude, ties away from zero, at most 6.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ckpt_tool.formats.hf.quant_codecs import E2M1_VALUES

# as openai/gpt-oss-20b and -120b store it in config.json
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                 "model.embed_tokens", "lm_head"]
MIDPOINTS = torch.tensor([(a + b) / 2 for a, b in zip(E2M1_VALUES[:7], E2M1_VALUES[1:8])])


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks, scales)`` of ``w`` ``[..., out, in]`` (``in`` a multiple of 32)."""
    *lead, rows, cols = w.shape
    g = w.float().reshape(*lead, rows, cols // 32, 32)
    amax = g.abs().amax(-1)
    mant, exp = torch.frexp(amax / 6.0)  # amax / 6 = mant * 2^exp, mant in [0.5, 1)
    exp = torch.where(mant == 0.5, exp - 1, exp)  # an exact power of two is its own scale
    exp = torch.where(amax > 0, exp, torch.full_like(exp, -127)).clamp(-127, 127)
    q = g / torch.exp2(exp.float()).unsqueeze(-1)
    code = (q.abs().unsqueeze(-1) >= MIDPOINTS).sum(-1)  # ties away from zero, clamped at 6
    code = (code | torch.where(q < 0, 8, 0)).to(torch.uint8)
    code = code.reshape(*lead, rows, cols // 32, 16, 2)
    return code[..., 0] | (code[..., 1] << 4), (exp + 127).to(torch.uint8)


def write_release(bf16_dir: Path, out: Path, dequantized: Path) -> dict:
    """From a bf16 ``GptOssForCausalLM`` directory: the MXFP4 release form at ``out`` and its
    transformers dequantization at ``dequantized``; returns the tensors stored at ``out``."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    stored, plain = {}, {}
    for f in sorted(bf16_dir.glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
                # transformers holds [experts, in, out]; the release stores [experts, out, in]
                blocks, scales = quantize_mxfp4(v.transpose(1, 2))
                stored[k + "_blocks"], stored[k + "_scales"] = blocks, scales
                plain[k] = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
            else:
                stored[k] = plain[k] = v.to(torch.bfloat16)
    config = json.loads((bf16_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    for d, tensors, cfg in ((out, stored, {**config, "quantization_config": {
            "quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}}),
            (dequantized, plain, config)):
        d.mkdir(parents=True)
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(cfg, indent=2))
    return stored
