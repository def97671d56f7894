"""Layout rules as data: which axis each parameter splits along across tensor-parallel ranks,
and how.

A :class:`Rule` matches a key (regex, ``re.search``) of the unsplit TP=1/PP=1 model. Keys may
be per-layer (``decoder.layers.3.mlp.linear_fc1.weight``, legacy files, heterogeneous dist
checkpoints) or stacked (``decoder.layers.mlp.linear_fc1.weight`` with a leading layer axis,
dist checkpoints); optimizer keys (``optimizer.state.exp_avg.<model key>``) use the rule of
their model key. ``axis`` counts in the module's own tensor (without stacked layer/expert
axes): column, GLU, QKV and vocab split axis 0, row axis 1.

Kinds (docs/formats.md section 5):

- ``column``: even split of ``axis``.
- ``row``: even split of ``axis`` (1) — bias of a row-parallel linear is ``replicated``.
- ``vocab``: even split of axis 0 after padding the rows to the layout's padded vocab.
- ``glu``: the gated ``linear_fc1`` ``[W; V]``: rank r holds ``[W_r; V_r]``. Without a gated
  linear unit it is ``column``.
- ``qkv``: fused QKV rows ``ng x (np/ng + 2) x head_dim``. Megatron-Core 0.16 splits it
  evenly like ``column`` for every valid layout (also when tp > num_query_groups, where it
  all-gathers and slices at run time); the kind exists for the feasibility checks.
- ``replicated``: every rank holds the whole tensor.

``expert = true`` rules split by the expert-tensor-parallel size and place experts by expert
parallelism. User rules (TOML, :func:`load_rules`) are tried before the built-in ones.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from ckpt_tool.errors import UsageError

__all__ = ["Rule", "COLUMN", "ROW", "VOCAB", "GLU", "QKV", "REPLICATED", "KINDS",
           "BUILTIN_RULES", "RuleSet", "load_rules", "rule_for", "model_key", "module_ndim",
           "leading_axes", "stacked_expert_axis", "example_rule", "legacy_split", "UnknownKeyError"]

COLUMN, ROW, VOCAB, GLU, QKV, REPLICATED = "column", "row", "vocab", "glu", "qkv", "replicated"
KINDS = (COLUMN, ROW, VOCAB, GLU, QKV, REPLICATED)
_DEFAULT_AXIS = {COLUMN: 0, ROW: 1, VOCAB: 0, GLU: 0, QKV: 0, REPLICATED: None}
_OPTIMIZER_PREFIX = re.compile(r"^optimizer\.state\.[^.]+\.")
_STACKED = re.compile(r"(?:^|\.)layers\.(?!\d)")
_EXPERT_INDEX = re.compile(r"experts\.(?:local_experts\.)?\d+\.|linear_fc\d\.(weight|bias)\d+$")


class UnknownKeyError(UsageError):
    """No rule knows a key (and its source chunk grid cannot tell)."""


@dataclass(frozen=True)
class Rule:
    """How keys matching ``pattern`` split across TP ranks (see the module docstring)."""

    pattern: str
    kind: str
    axis: int | None = None
    expert: bool = False
    origin: str = "builtin"
    ndim: int | None = None
    #: the source's chunk grid, where it tells, overrides the kind (a module the layer specs
    #: build either split or replicated, e.g. MLA's down projections)
    grid_first: bool = False
    _re: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UsageError(f"layout rule {self.pattern!r}: unknown kind {self.kind!r} "
                             f"(one of {', '.join(KINDS)})")
        try:
            object.__setattr__(self, "_re", re.compile(self.pattern))
        except re.error as exc:
            raise UsageError(f"layout rule {self.pattern!r}: bad regular expression ({exc})") \
                from None
        if self.axis is None and self.kind != REPLICATED:
            object.__setattr__(self, "axis", _DEFAULT_AXIS[self.kind])

    def matches(self, key: str) -> bool:
        return self._re.search(model_key(key)) is not None

    def to_dict(self) -> dict[str, object]:
        return {"pattern": self.pattern, "kind": self.kind, "axis": self.axis,
                "expert": self.expert, "ndim": self.ndim, "origin": self.origin}


def _r(pattern: str, kind: str, expert: bool = False) -> Rule:
    return Rule(pattern, kind, expert=expert)


_LIN = r"(?:weight|bias)\d*"  # TE grouped experts: weight0, weight1, ...
# First match wins. Megatron-Core GPT names, local and Transformer-Engine specs.
BUILTIN_RULES: tuple[Rule, ...] = (
    _r(r"_extra_state$", REPLICATED),
    _r(r"(^|\.)(word_embeddings|output_layer)\.weight$", VOCAB),
    _r(r"(^|\.)position_embeddings\.weight$", REPLICATED),
    # norms: TE-fused (linear_qkv.layer_norm_*, linear_fc1.layer_norm_*), local spec, q/k norms
    _r(r"\.layer_norm_(weight|bias)$", REPLICATED),
    _r(r"(^|\.)(input_layernorm|pre_mlp_layernorm|pre_cross_attn_layernorm|final_layernorm|"
       r"final_norm|q_layernorm|k_layernorm|kv_layernorm|post_attention_layernorm|post_mlp_layernorm)\.",
       REPLICATED),
    _r(r"(^|\.)linear_qkv\.(weight|bias)$", QKV),
    _r(r"(^|\.)linear_(q|kv|k|v)\.(weight|bias)$", COLUMN),
    # Multi-Latent Attention: the up projections (and linear_q_proj without a q LoRA rank)
    # are column-parallel; the down projections are column-parallel in the local spec and
    # replicated (TE "duplicated") in the Transformer-Engine spec: the source's chunk grid
    # decides (``grid_first``); its norms are replicated (above, and kv_layernorm)
    _r(r"(^|\.)linear_(q_proj|q_up_proj|kv_up_proj)\.(weight|bias)$", COLUMN),
    Rule(r"(^|\.)linear_(q_down_proj|kv_down_proj)\.(weight|bias)$", COLUMN, grid_first=True),
    # attention sinks (GPT-OSS: softmax_type "learnable"): one offset per head
    Rule(r"(^|\.)core_attention\.softmax_offset$", COLUMN, ndim=1),
    # Mamba mixers (hybrid models): in_proj and conv1d are stored per component (z, x, B, C,
    # dt; x, B, C), each split by tensor parallelism along its rows; the per-head A_log, D,
    # dt_bias and the gated norm split likewise; out_proj is row-parallel
    _r(r"(^|\.)mixer\.in_proj\.weight\.(z|x|B|C|dt)$", COLUMN),
    Rule(r"(^|\.)mixer\.conv1d\.weight\.(x|B|C)$", COLUMN, ndim=3),
    Rule(r"(^|\.)mixer\.conv1d\.bias\.(x|B|C)$", COLUMN, ndim=1),
    Rule(r"(^|\.)mixer\.(A_log|D|dt_bias)$", COLUMN, ndim=1),
    Rule(r"(^|\.)mixer\.norm\.weight$", COLUMN, ndim=1),
    _r(r"(^|\.)mixer\.out_proj\.weight$", ROW),
    # Multi-Token Prediction: eh_proj is column-parallel; enorm/hnorm replicated norms
    _r(r"(^|\.)mtp\.layers\.\d+\.eh_proj\.weight$", COLUMN),
    _r(r"(^|\.)mtp\.layers\.\d+\.(enorm|hnorm)\.", REPLICATED),
    # MoE: router and its bias replicated; shared experts split by TP like a dense MLP
    _r(r"(^|\.)router\.(weight|bias|expert_bias)$", REPLICATED),
    _r(r"(^|\.)shared_experts\.gate_weight$", REPLICATED),
    _r(r"(^|\.)shared_experts\.linear_fc1\.(weight|bias)$", GLU),
    _r(r"(^|\.)shared_experts\.linear_fc2\.weight$", ROW),
    _r(r"(^|\.)shared_experts\.linear_fc2\.bias$", REPLICATED),
    # routed experts: expert tensor parallel, placed by expert parallel
    _r(r"(^|\.)experts\.(.*\.)?linear_fc1\.(weight|bias)(_w|_v)$", COLUMN, expert=True),
    _r(rf"(^|\.)experts\.(.*\.)?linear_fc1\.{_LIN}$", GLU, expert=True),
    _r(r"(^|\.)experts\.(.*\.)?linear_fc2\.weight\d*$", ROW, expert=True),
    _r(r"(^|\.)experts\.(.*\.)?linear_fc2\.bias\d*$", REPLICATED, expert=True),
    # dense MLP and attention output
    _r(r"(^|\.)linear_fc1\.(weight|bias)(_w|_v)$", COLUMN),  # singleton_local_shards halves
    _r(r"(^|\.)linear_fc1\.(weight|bias)$", GLU),
    _r(r"(^|\.)(linear_proj|linear_fc2)\.weight$", ROW),
    _r(r"(^|\.)(linear_proj|linear_fc2)\.bias$", REPLICATED),
)


def model_key(key: str) -> str:
    """The model key a (possibly optimizer-state) key is about."""
    return _OPTIMIZER_PREFIX.sub("", key, count=1)


def module_ndim(key: str, rule: Rule) -> int:
    """Dimensions of the module's own tensor: the rule's ``ndim`` when set, else 1 for biases
    and 2 for weights."""
    if rule.ndim is not None:
        return rule.ndim
    last = model_key(key).rsplit(".", 1)[-1]
    if rule.kind == ROW:
        return 2
    return 1 if last.startswith("bias") or last.endswith("bias") else 2


def stacked_expert_axis(key: str, rule: Rule) -> bool:
    """Whether an expert key carries a stacked global-expert axis (dist keys without an expert
    number: ``...experts.local_experts.linear_fc1.weight``, not ``...local_experts.3...`` nor
    TE grouped ``linear_fc1.weight3``)."""
    return rule.expert and _EXPERT_INDEX.search(model_key(key)) is None


def leading_axes(key: str, ndim: int, rule: Rule) -> int:
    """Stacked axes in front of the module tensor (layer axis of stacked dist keys, expert
    axis of stacked experts). Split kinds: ``ndim`` minus the module's own dimensions;
    replicated: counted from the key."""
    if rule.ndim is not None or rule.kind != REPLICATED:
        return max(ndim - module_ndim(key, rule), 0)
    lead = 1 if _STACKED.search(model_key(key)) else 0
    if stacked_expert_axis(key, rule):
        lead += 1
    return min(lead, ndim)


def example_rule(key: str) -> str:
    """A TOML rule a user could add for ``key`` (suffix after the layer number)."""
    mk = model_key(key)
    m = re.search(r"layers\.(?:\d+\.)?(.*)$", mk)
    tail = m.group(1) if m else mk
    pattern = "(^|\\.)" + re.escape(tail).replace("\\.", "\\.") + "$"
    return ("[[rules]]\n"
            f"pattern = '{pattern}'\n"
            "kind = \"column\"   # one of: " + ", ".join(KINDS) + "\n"
            "axis = 0           # axis of the per-layer tensor that tensor parallelism splits\n")


class RuleSet:
    """User rules first, then the built-in table; :meth:`rule_for` returns the first match."""

    def __init__(self, user: Sequence[Rule] = (), builtin: Sequence[Rule] = BUILTIN_RULES):
        self.user = tuple(user)
        self.builtin = tuple(builtin)

    @property
    def rules(self) -> tuple[Rule, ...]:
        return self.user + self.builtin

    def find(self, key: str) -> Rule | None:
        """The first rule matching ``key``, or None."""
        for rule in self.rules:
            if rule.matches(key):
                return rule
        return None

    def rule_for(self, key: str) -> Rule:
        """The rule for ``key``; :class:`UnknownKeyError` naming it and a rule to add."""
        rule = self.find(key)
        if rule is None:
            raise UnknownKeyError(
                f"no layout rule knows how {key!r} splits across tensor-parallel ranks",
                hint="add a rule to a TOML file passed with --rules, e.g.\n" + example_rule(key))
        return rule


def load_rules(paths: Iterable[str | Path] = ()) -> RuleSet:
    """The built-in rules with the user rules of each TOML file in front (later files first).

    File format::

        [[rules]]
        pattern = '(^|\\.)my_proj\\.weight$'   # regex searched in the TP1/PP1 key
        kind = "column"                      # column|row|vocab|glu|qkv|replicated
        axis = 0                             # optional, default by kind
        expert = false                       # optional
        ndim = 2                             # optional: dims of the per-layer tensor
    """
    user: list[Rule] = []
    for path in paths:
        p = Path(path)
        try:
            doc = tomllib.loads(p.read_text(encoding="utf-8"))
        except OSError as exc:
            raise UsageError(f"cannot read layout rules: {exc.strerror}", path=p) from None
        except tomllib.TOMLDecodeError as exc:
            raise UsageError(f"layout rules are not valid TOML: {exc}", path=p) from None
        entries = doc.get("rules", [])
        if not isinstance(entries, list):
            raise UsageError("layout rules: 'rules' must be an array of tables ([[rules]])",
                             path=p)
        file_rules = []
        for i, e in enumerate(entries):
            if not isinstance(e, dict) or "pattern" not in e or "kind" not in e:
                raise UsageError(f"layout rule #{i + 1} needs 'pattern' and 'kind'", path=p)
            unknown = set(e) - {"pattern", "kind", "axis", "expert", "ndim"}
            if unknown:
                raise UsageError(f"layout rule #{i + 1}: unknown field(s) "
                                 f"{', '.join(sorted(unknown))}", path=p)
            axis = e.get("axis")
            if axis is not None and (not isinstance(axis, int) or axis < 0):
                raise UsageError(f"layout rule #{i + 1}: axis must be an integer >= 0", path=p)
            ndim = e.get("ndim")
            if ndim is not None and (not isinstance(ndim, int) or ndim < 1):
                raise UsageError(f"layout rule #{i + 1}: ndim must be an integer >= 1", path=p)
            file_rules.append(Rule(str(e["pattern"]), str(e["kind"]), axis=axis,
                                   expert=bool(e.get("expert", False)), origin=str(p),
                                   ndim=ndim))
        user = file_rules + user
    return RuleSet(user)


def legacy_split(key: str, *, swiglu: bool, rules: RuleSet | None = None
                 ) -> tuple[str, int | None]:
    """``(kind, dim)`` in the terms of ``formats.legacy.layout.split_rule`` (qkv is a column
    split; GLU without SwiGLU too), so the legacy reader can take its rules from here;
    :class:`UnknownKeyError` for a key no rule knows."""
    rule = rule_for(key, rules)
    kind = rule.kind
    if kind == QKV or (kind == GLU and not swiglu):
        kind = COLUMN
    return kind, rule.axis


def rule_for(key: str, rules: RuleSet | None = None) -> Rule:
    """Module-level shortcut: the rule for ``key`` in ``rules`` (default: built-in only)."""
    return (rules or RuleSet()).rule_for(key)
