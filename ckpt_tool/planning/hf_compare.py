"""How ``diff`` compares a Megatron checkpoint with a Hugging Face model directory (pure).

``diff`` between a Megatron-Core dist (torch_dist, zarr) or Megatron-LM legacy checkpoint and
an HF directory sees the Megatron side through the export recipes of ``convert --to hf``
(:func:`ckpt_tool.planning.hf_plan.plan_export`, with the architecture of the HF side's
``config.json``): its tensors get HF names and shapes, so a faithful export (or the source of
an import) has the same tensors as the HF side, and a tensor that changed is reported under its
HF name together with the Megatron tensor it comes from (:func:`origin`).

The common states are not alike (``args`` on one side, ``config.json`` on the other), but the
settings both describe are compared through the same rules (:func:`config_differences`:
config.json read as Megatron-LM ``args`` by ``args_from_hf_config``): hidden size, layers,
heads, query groups, head size, FFN size, vocab size, norm epsilon, rope theta, tied
embeddings; each that disagrees is a difference. What an HF directory cannot hold is listed as
not comparable, never as a difference:
optimizer state, the padded vocab rows of the embedding and output layer, the common state
(``args``, iteration; the HF side holds ``config.json``), extra state and rotary buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckpt_tool.errors import CkptError
from ckpt_tool.model import CheckpointMeta, is_optimizer_key
from ckpt_tool.planning.hf_plan import Part, Recipe, Src, plan_export
from ckpt_tool.planning.hf_families import Family
from ckpt_tool.planning.hf_rules import (GPT2_CONFIG_NAMES, ArchRule, args_from_hf_config,
                                         rule_for_config)

__all__ = ["MEGATRON_FORMATS", "HfView", "mapped_side", "plan_hf_view", "origin", "common_note",
           "config_differences"]

MEGATRON_FORMATS = ("torch_dist", "zarr", "legacy")
_QKV = ("query", "key", "value")


@dataclass(frozen=True)
class HfView:
    """The Megatron side in HF names: one recipe per HF tensor, where each comes from
    (``origins``: HF name -> Megatron name), and what cannot be compared (``notes``)."""

    recipes: tuple[Recipe, ...]
    origins: dict[str, str]
    notes: tuple[str, ...]
    config: tuple[tuple[str, Any, Any], ...] = ()  # config_differences


def mapped_side(format_a: str, format_b: str) -> str | None:
    """``"a"`` or ``"b"``: the Megatron side to see in HF names; None when the two are not
    one HF directory and one Megatron checkpoint."""
    if format_b == "hf" and format_a in MEGATRON_FORMATS:
        return "a"
    if format_a == "hf" and format_b in MEGATRON_FORMATS:
        return "b"
    return None


def _src(s: Src) -> str:
    return s.key + (str(list(s.index)) if s.index else "")


def origin(r: Recipe) -> str:
    """Where HF tensor ``r`` comes from, in Megatron names:
    ``decoder.layers.self_attention.linear_qkv.weight[0] (query rows)``."""
    p: Part = r.parts[0]
    src = ", ".join(_src(s) for s in p.sources)
    what = {"qkv_split": lambda: f"{_QKV[p.param('part')]} rows of each query group",
            "glu_split": lambda: ("gate", "up")[p.param("half")] + " half",
            "qkv_to_cat": lambda: "q/k/v regrouped" + (", transposed" if p.param("transpose")
                                                      else ""),
            "t": lambda: "transposed",
            "rows": lambda: f"rows 0-{r.shape[0] - 1}"}.get(p.op)
    return f"{src} ({what()})" if what else src


def _count(keys: list[str]) -> str:
    shown = ", ".join(keys[:3]) + (", …" if len(keys) > 3 else "")
    return f"{len(keys)} tensor{'s' * (len(keys) != 1)} ({shown})"


def plan_hf_view(meta: CheckpointMeta, args: dict[str, Any], hf: CheckpointMeta,
                 config: dict[str, Any], *, side: str = "a") -> HfView:
    """The HF view of Megatron checkpoint ``meta`` (its ``args``, possibly empty) for comparing
    it with HF directory ``hf`` (its ``config``); ``side`` names the Megatron side in the notes
    (``"a"``/``"b"``). Raises what ``plan_export`` raises when the names cannot be mapped."""
    me, other = side.upper(), "B" if side == "a" else "A"
    rule = rule_for_config(config)
    if isinstance(rule, Family):  # layers that differ (DeepSeek-V3): not mapped here yet
        from ckpt_tool.errors import UnsupportedError

        raise UnsupportedError(f"diff does not map {rule.architecture} names yet",
                               hint="convert the HF side with --to torch_dist and diff those")
    config_diffs = config_differences(args, config, rule)
    if not args.get("num_layers"):
        args = {**args_from_hf_config(config, rule),
                **{k: v for k, v in args.items() if v is not None}}
    vocab = int(config.get("vocab_size") or args.get("vocab_size")
                or args.get("padded_vocab_size"))
    recipes = plan_export(meta, args, rule, vocab=vocab)
    have = {r.key for r in recipes}
    embed = next((r for r in recipes if r.key == rule.embed), None)
    if rule.lm_head in hf.tensors and rule.lm_head not in have and embed is not None:
        # tied embeddings: transformers may store the tied copy, Megatron does not
        recipes.append(Recipe(rule.lm_head, embed.dtype, embed.shape, embed.parts))
    notes: list[str] = []
    optim = sorted(k for k in meta.tensors if is_optimizer_key(k))
    if optim:
        notes.append(f"optimizer state not comparable: {other} (hf) holds model weights only; "
                     f"{me}'s: {_count(optim)}")
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        t = meta.tensors.get(key)
        if t is not None and t.shape and t.shape[0] > vocab:
            notes.append(f"padded vocab rows not comparable: {me}'s {key} has {t.shape[0]} "
                         f"rows, {other} (hf) holds vocab_size {vocab}; rows {vocab}-"
                         f"{t.shape[0] - 1} not compared")
    extra = sorted(k for k in meta.tensors if not is_optimizer_key(k)
                   and ("_extra_state" in k or k.endswith("rotary_emb.inv_freq")))
    if extra:
        notes.append(f"extra state not comparable: {other} (hf) holds none; {me}'s: "
                     f"{_count(extra)}")
    buffers = sorted(k for k in hf.tensors if k.endswith("rotary_emb.inv_freq"))
    if buffers:
        notes.append(f"rotary buffers not comparable: {me} ({meta.format}) holds none; "
                     f"{other}'s: {_count(buffers)}")
    return HfView(tuple(recipes), {r.key: origin(r) for r in recipes}, tuple(notes),
                  tuple(config_diffs))


# (Megatron-LM argument, config.json name): the settings both sides describe
_SETTINGS = (("hidden_size", "hidden_size"), ("num_layers", "num_hidden_layers"),
             ("num_attention_heads", "num_attention_heads"),
             ("num_query_groups", "num_key_value_heads"), ("kv_channels", "head_dim"),
             ("ffn_hidden_size", "intermediate_size"), ("vocab_size", "vocab_size"),
             ("norm_epsilon", "rms_norm_eps"), ("rotary_base", "rope_theta"),
             ("untie_embeddings_and_output_weights", "tie_word_embeddings"))
# GPT-2 has one key/value head per query head of n_embd / n_head: both follow from n_head
_NOT_IN_GPT2 = ("num_key_value_heads", "head_dim")
_GPT2_FIELD = ({new: old for old, new in GPT2_CONFIG_NAMES.items()}
               | {"intermediate_size": "n_inner"})


def _settings(args: dict[str, Any], rule: ArchRule) -> dict[str, Any]:
    heads = args.get("num_attention_heads")
    out = dict(args)
    if heads and not args.get("group_query_attention", True):
        out["num_query_groups"] = heads  # Megatron-LM ignores it without the flag
    if heads and args.get("hidden_size") and not args.get("kv_channels"):
        out["kv_channels"] = int(args["hidden_size"]) // int(heads)
    if rule.moe:  # config.json's FFN size is the experts'
        out["ffn_hidden_size"] = args.get("moe_ffn_hidden_size") or args.get("ffn_hidden_size")
    if rule.position != "rope":
        out.pop("rotary_base", None)
    return out


def config_differences(args: dict[str, Any], config: dict[str, Any], rule: ArchRule
                       ) -> list[tuple[str, Any, Any]]:
    """``(what, args value, config.json value)`` for each setting of :data:`_SETTINGS` where
    Megatron-LM ``args`` and HF ``config`` (read through ``rule``) disagree; settings ``args``
    lack are not compared, and nothing is without ``args``."""
    if not args.get("num_layers"):
        return []
    try:
        hf = _settings(args_from_hf_config(config, rule), rule)
    except (CkptError, KeyError, TypeError, ValueError):
        return []  # a config.json plan_export cannot read either: the names are not mapped
    mine = _settings(args, rule)
    out = []
    for arg, field in _SETTINGS:
        a, b = mine.get(arg), hf.get(arg)
        if a is None or b is None or (rule.name == "gpt2" and field in _NOT_IN_GPT2):
            continue
        same = float(a) == float(b) if isinstance(a, (int, float)) and not isinstance(
            a, bool) else bool(a) == bool(b)
        if not same:
            name = _GPT2_FIELD.get(field, field) if rule.name == "gpt2" else field
            shown = config.get(name, b if arg != "untie_embeddings_and_output_weights" else not b)
            out.append((f"args.{arg} / config.json {name}", a, shown))
    return out


def common_note(side: str, fmt: str, common_keys: list[str]) -> str:
    """The note saying the two common states cannot be compared."""
    me, other = side.upper(), "B" if side == "a" else "A"
    shown = ", ".join(sorted(common_keys)[:6]) or "nothing"
    return (f"common state not comparable: {other} (hf) holds config.json, {me} ({fmt}) "
            f"holds {shown}")
