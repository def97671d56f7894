"""The parameter registration order under the key prefixes frameworks save with: Megatron-LM and
Megatron-Bridge the unwrapped GPTModel's names, NeMo 2 the DDP-wrapped chunk's (``module.``)."""

from __future__ import annotations

from pathlib import Path

from ckpt_tool.formats.base import open_checkpoint
from ckpt_tool.planning.param_order import model_key_prefix, moe_expert_keys, stage_params

FIX = Path(__file__).resolve().parents[2] / "fixtures"
NEMO = (FIX / "nemo2_mcore016_gpt_tp2dp2_distopt" / "checkpoints"
        / "default--val_loss=0.00-step=1-consumed_samples=4.0-last")
BRIDGE = FIX / "mcore016_gpt_tp2dp2_distopt_bridge"


def _model_keys(path: Path) -> list[str]:
    return [k for k in open_checkpoint(path).metadata().tensors
            if not k.startswith("optimizer.")]


def test_nemo_keys_are_ordered_as_the_unwrapped_models_under_their_prefix():
    nemo, bridge = _model_keys(NEMO), _model_keys(BRIDGE)
    assert model_key_prefix(nemo) == "module." and model_key_prefix(bridge) == ""
    plain = stage_params(bridge, "local", [0, 1], True, True)
    wrapped = stage_params(nemo, "local", [0, 1], True, True, prefix="module.")
    assert wrapped == [("module." + k, layer, e) for k, layer, e in plain]
    assert {k for k, _l, _e in wrapped} == set(nemo)  # every parameter has its place
    assert stage_params(nemo, "local", [0, 1], True, True) == []  # without it: none
    assert moe_expert_keys("module.")[0].startswith("module.decoder.layers.mlp.experts.")


def test_keys_that_do_not_agree_on_a_prefix_have_none():
    assert model_key_prefix(["module.decoder.x", "decoder.y"]) == ""
    assert model_key_prefix(["module.module.embedding.word_embeddings.weight"]) == \
        "module.module."
    assert model_key_prefix(["something.else"]) == ""
