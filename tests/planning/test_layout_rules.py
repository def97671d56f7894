"""Layout rules: the built-in table on every key of the real fixtures, user TOML rules, the
unknown-key error (its suggested rule must work), and the chunk-grid fallback."""

from __future__ import annotations

import re

import pytest

from ckpt_tool.errors import UsageError
from ckpt_tool.formats.legacy import layout as L
from ckpt_tool.formats.base import open_checkpoint
from ckpt_tool.planning.grid import infer_rule_from_grid
from ckpt_tool.planning.layout import (COLUMN, GLU, QKV, REPLICATED, ROW, VOCAB, RuleSet,
                                       UnknownKeyError, leading_axes, legacy_split, load_rules,
                                       rule_for)

DIST = ["fixtures/mcore016_gpt_tp2pp2_fp32", "fixtures/mcore016_gpt_tp2pp2_bf16_optim",
        "fixtures/mcore015_gpt_flattened_optim", "fixtures/mcore015_zarr_gpt_tp2pp2"]
LEGACY = ["fixtures/megatron_legacy_tp2pp2", "fixtures/megatron_legacy_tp2_release"]


@pytest.fixture(scope="module")
def metas():
    return {f: open_checkpoint(f).metadata() for f in DIST + LEGACY}


EXPECTED = {
    "embedding.word_embeddings.weight": (VOCAB, 0),
    "output_layer.weight": (VOCAB, 0),
    "embedding.position_embeddings.weight": (REPLICATED, None),
    "decoder.layers.self_attention.linear_qkv.weight": (QKV, 0),
    "decoder.layers.self_attention.linear_qkv.bias": (QKV, 0),
    "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (REPLICATED, None),
    "decoder.layers.3.input_layernorm.weight": (REPLICATED, None),
    "decoder.layers.mlp.linear_fc1.weight": (GLU, 0),
    "decoder.layers.mlp.linear_fc1.bias": (GLU, 0),
    "decoder.layers.mlp.linear_fc1.weight_w": (COLUMN, 0),
    "decoder.layers.mlp.linear_fc2.weight": (ROW, 1),
    "decoder.layers.mlp.linear_fc2.bias": (REPLICATED, None),
    "decoder.layers.self_attention.linear_proj.weight": (ROW, 1),
    "decoder.layers.self_attention.linear_proj.bias": (REPLICATED, None),
    "decoder.final_layernorm.weight": (REPLICATED, None),
    "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc2.weight": (ROW, 1),
    "decoder.layers.mlp.router.weight": (REPLICATED, None),
    "decoder.layers.mlp.experts.local_experts.linear_fc1.weight": (GLU, 0),
    "decoder.layers.1.mlp.experts.local_experts.5.linear_fc2.weight": (ROW, 1),
    "decoder.layers.mlp.experts.linear_fc1.weight3": (GLU, 0),
    "decoder.layers.mlp.shared_experts.linear_fc2.weight": (ROW, 1),
    "decoder.layers.mlp.shared_experts.gate_weight": (REPLICATED, None),
    "decoder.layers.self_attention.q_layernorm.weight": (REPLICATED, None),
}


@pytest.mark.parametrize("key", sorted(EXPECTED))
def test_builtin_kind_and_axis(key):
    rule = rule_for(key)
    assert (rule.kind, rule.axis) == EXPECTED[key]
    assert rule.expert == (".experts." in key and "shared_experts" not in key)


def test_every_fixture_key_has_a_rule(metas):
    for meta in metas.values():
        for key in meta.tensors:
            rule_for(key)  # raises UnknownKeyError otherwise


def test_agrees_with_legacy_reader_split(metas):
    """The legacy reader's split rule (docs/formats.md §5) and ours agree on every key."""
    for f in LEGACY:
        for key, t in metas[f].tensors.items():
            for swiglu in (True, False):
                assert legacy_split(key, swiglu=swiglu) == L.split_rule(key, swiglu=swiglu), key
            assert t.origin == L.split_rule(key, swiglu=True)[0]


def test_stacked_axes(metas):
    m = metas["fixtures/mcore016_gpt_tp2pp2_fp32"]
    for key, t in m.tensors.items():
        lead = leading_axes(key, len(t.shape), rule_for(key))
        assert lead == (1 if key.startswith("decoder.layers.") else 0), key
    for key, t in metas["fixtures/megatron_legacy_tp2pp2"].tensors.items():
        assert leading_axes(key, len(t.shape), rule_for(key)) == 0


def test_unknown_key_error_names_key_and_its_rule_works(tmp_path):
    key = "decoder.layers.7.self_attention.my_adapter.weight"
    with pytest.raises(UnknownKeyError) as ei:
        rule_for(key)
    assert key in ei.value.message
    hint = ei.value.hint
    assert "[[rules]]" in hint and "kind =" in hint
    toml = hint[hint.index("[[rules]]"):]
    (tmp_path / "r.toml").write_text(toml)
    rules = load_rules([tmp_path / "r.toml"])
    rule = rules.rule_for(key)
    assert (rule.kind, rule.axis) == (COLUMN, 0)
    assert rules.rule_for("decoder.layers.self_attention.my_adapter.weight") is rule
    assert rules.find("decoder.layers.7.self_attention.other.weight") is None


def test_user_rules_override_builtin_and_later_files_win(tmp_path):
    a = tmp_path / "a.toml"
    a.write_text("[[rules]]\npattern = 'output_layer\\.weight$'\nkind = 'replicated'\n")
    b = tmp_path / "b.toml"
    b.write_text("[[rules]]\npattern = 'output_layer\\.weight$'\nkind = 'column'\naxis = 1\n"
                 "ndim = 2\n")
    assert load_rules([a]).rule_for("output_layer.weight").kind == REPLICATED
    rule = load_rules([a, b]).rule_for("output_layer.weight")
    assert (rule.kind, rule.axis, rule.ndim, rule.origin) == (COLUMN, 1, 2, str(b))
    assert load_rules([a, b]).rule_for("embedding.word_embeddings.weight").kind == VOCAB


@pytest.mark.parametrize("text, needle", [
    ("[[rules]]\npattern = 'x'\nkind = 'diagonal'\n", "unknown kind"),
    ("[[rules]]\npattern = '('\nkind = 'row'\n", "bad regular expression"),
    ("[[rules]]\nkind = 'row'\n", "needs 'pattern'"),
    ("[[rules]]\npattern = 'x'\nkind = 'row'\nsplit = 1\n", "unknown field"),
    ("[[rules]]\npattern = 'x'\nkind = 'row'\naxis = -1\n", "axis"),
    ("rules = 3\n", "array of tables"),
    ("[[rules]\n", "not valid TOML"),
])
def test_bad_rule_files(tmp_path, text, needle):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(UsageError, match=re.escape(needle)):
        load_rules([p])


def test_missing_rule_file(tmp_path):
    with pytest.raises(UsageError, match="cannot read"):
        load_rules([tmp_path / "nope.toml"])


def test_chunk_grid_inference_matches_builtin(metas):
    """On MCore's TP2 grid, the fallback finds what the built-in rules say (GLU, whose grid
    interleaves 2*tp fragments, is the one it cannot tell)."""
    for f in DIST[:2]:
        for key, t in metas[f].tensors.items():
            got = infer_rule_from_grid(t, 2)
            want = rule_for(key)
            if want.kind == GLU:
                assert got is None, key
            elif want.kind == REPLICATED:
                assert got is not None and got.kind == REPLICATED, key
            else:
                assert got is not None and (got.kind, got.axis) == (COLUMN, want.axis), key
                assert leading_axes(key, len(t.shape), got) == leading_axes(
                    key, len(t.shape), want)
            assert infer_rule_from_grid(t, 1) is None


def test_ruleset_order():
    rs = RuleSet()
    assert rs.rules == rs.builtin
    assert rs.find("totally.unknown") is None
