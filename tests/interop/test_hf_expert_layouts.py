"""transformers 5's two expert layouts: per expert (``mlp.experts.{e}.gate_proj`` ...: what
``save_pretrained`` writes by default) and fused (``mlp.experts.gate_up_proj`` ``[experts,
2 x ffn, hidden]``, each expert ``[gate; up]``, and ``mlp.experts.down_proj`` ``[experts,
hidden, ffn]``: ``save_pretrained(save_original_format=False)``, the layout transformers 5
computes with). An import reads either into the same Megatron-Core tensors (the per-expert
import is the one the logits tests prove); an export writes either (``--hf-experts``; default
the layout an imported source had, else per expert), and transformers computes the source's
logits from both.
"""

from __future__ import annotations

import json

import pytest
import torch

from _hf_jobs import COMMON, ckpt, hf_logits, randomise, runner, tensors
from ckpt_tool.cli.app import app

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("experts")
    torch.manual_seed(31)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, head_dim=16, tie_word_embeddings=False,
        **COMMON))
    randomise(model)
    model.save_pretrained(tmp / "per")
    model.save_pretrained(tmp / "fused", save_original_format=False)
    assert "model.layers.0.mlp.experts.gate_up_proj" in tensors(tmp / "fused")
    for name in ("per", "fused"):
        ckpt("convert", tmp / name, tmp / f"{name}_mc", "--to", "torch_dist", "--tp", "2")
    return tmp


def test_both_layouts_import_to_the_same_megatron_tensors(qwen3_moe):
    a, b = tensors(qwen3_moe / "per_mc"), tensors(qwen3_moe / "fused_mc")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("source,layout,fused", [("per_mc", None, False),
                                                 ("fused_mc", None, True),
                                                 ("per_mc", "fused", True),
                                                 ("fused_mc", "per-expert", False)])
def test_export_layout_gives_the_source_logits(qwen3_moe, source, layout, fused):
    out = qwen3_moe / f"{source}_{layout}"
    ckpt("convert", qwen3_moe / source, out, "--to", "hf",
         *(["--hf-experts", layout] if layout else []))
    keys = tensors(out)
    assert ("model.layers.1.mlp.experts.gate_up_proj" in keys) == fused
    assert ("model.layers.1.mlp.experts.3.down_proj.weight" in keys) == (not fused)
    torch.testing.assert_close(hf_logits(out), hf_logits(qwen3_moe / "per"), rtol=1e-5,
                               atol=1e-6)


def test_unknown_layout_and_dense_models_are_refused(qwen3_moe, tmp_path):
    result = runner.invoke(app, ["convert", str(qwen3_moe / "per_mc"), str(tmp_path / "x"),
                                 "--to", "hf", "--hf-experts", "stacked", "--no-progress"])
    assert result.exit_code == 2 and "--hf-experts" in result.output
    assert not (tmp_path / "x").exists()
    result = runner.invoke(app, ["convert", str(qwen3_moe / "per"), str(tmp_path / "y"),
                                 "--to", "torch_dist", "--hf-experts", "fused", "--no-progress"])
    assert result.exit_code == 2 and not (tmp_path / "y").exists()
    config = json.loads((qwen3_moe / "per" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
