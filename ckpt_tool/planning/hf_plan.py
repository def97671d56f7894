"""Per-tensor recipes between a Megatron-Core GPT checkpoint and an HF model directory (pure).

``plan_export`` (Megatron -> HF) and ``plan_import`` (HF -> Megatron) read only metadata and
an architecture rule (:mod:`ckpt_tool.planning.hf_rules`) and return ``Recipe``s: for each
target tensor, its shape, dtype and the parts it is made of. A part names its source tensors
(``Src``: a key, and the leading indices of a stacked ``decoder.layers.*`` tensor) and one
transform; ``ckpt_tool.ops._hf_source`` executes them. Every source tensor of the model must
be used by some recipe: a tensor no rule places (a bias Llama has no room for, an extra
layer) is an error, never silently dropped; shapes that contradict the config are errors too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckpt_tool.errors import InputError, UnsupportedError
from ckpt_tool.model import CheckpointMeta, TensorMeta, is_optimizer_key
from ckpt_tool.planning.hf_rules import TE_NORMS, ArchRule, LayerMap

__all__ = ["Src", "Part", "Recipe", "Geometry", "plan_export", "plan_import", "mcore_spec"]


@dataclass(frozen=True)
class Src:
    """A source tensor, or the sub-tensor at ``index`` (leading dims) of a stacked one."""

    key: str
    index: tuple[int, ...] = ()


@dataclass(frozen=True)
class Part:
    """The sub-tensor of the target at ``index`` (leading dims; ``()`` = all of it), made by
    ``op`` from ``sources``: ``copy``, ``t`` (transpose), ``qkv_split`` (params ``part``),
    ``qkv_fuse``, ``qkv_to_cat`` / ``qkv_from_cat`` (one [q; k; v] tensor, ``transpose``d
    when a Conv1D weight), ``glu_split`` (``half``), ``glu_fuse``, ``rows`` (keep or
    zero-pad to ``rows``)."""

    index: tuple[int, ...]
    op: str
    sources: tuple[Src, ...]
    params: tuple[tuple[str, int], ...] = ()

    def param(self, name: str) -> int:
        return dict(self.params)[name]


@dataclass(frozen=True)
class Recipe:
    """One target tensor: key, dtype, global shape and its parts."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    parts: tuple[Part, ...]


@dataclass(frozen=True)
class Geometry:
    """Attention geometry: query groups, query heads per group, head size."""

    groups: int
    q_per_group: int
    head_dim: int

    @property
    def params(self) -> tuple[tuple[str, int], ...]:
        return (("groups", self.groups), ("q_per_group", self.q_per_group),
                ("head_dim", self.head_dim))


def refuse_unplaced(meta: CheckpointMeta, used: set[str], architecture: str, *,
                    export: bool) -> None:
    """UnsupportedError naming the source's model tensors no rule placed (``used``: those
    placed): a part no rule knows is refused by name, never dropped."""
    left = sorted(_model_keys(meta) - used)
    if not left:
        return
    shown = ", ".join(left[:3]) + (", ..." if len(left) > 3 else "")
    if export:
        raise UnsupportedError(f"{len(left)} model tensor(s) have no place in {architecture}: "
                               + shown, path=meta.root, hint="pick the matching architecture "
                               "(--hf-arch) or use --to safetensors")
    raise UnsupportedError(f"{len(left)} HF tensor(s) have no place in the Megatron-Core model "
                           f"of {architecture}: " + shown, path=meta.root,
                           hint="check config.json (architecture, layer count, features)")


def _model_keys(meta: CheckpointMeta) -> set[str]:
    return {k for k in meta.tensors if not is_optimizer_key(k) and "_extra_state" not in k
            and not k.endswith("rotary_emb.inv_freq")}


def mcore_spec(meta: CheckpointMeta) -> str:
    """``te`` when the norms are fused into the linears (``layer_norm_weight``), else
    ``local``."""
    return "te" if any(".linear_qkv.layer_norm_weight" in k for k in meta.tensors) else "local"


def _mcore_name(m: LayerMap, spec: str) -> str:
    if m.transform != "norm":
        return m.mcore
    base, _, leaf = m.mcore.rpartition(".")
    local, te = TE_NORMS[base]
    if spec == "moe" and base == "pre_mlp_layernorm":  # no fc1 to fuse the norm into
        return f"{local}.{leaf}"
    return f"{te}_{leaf}" if spec in ("te", "moe") else f"{local}.{leaf}"


def _find_layer_src(meta: CheckpointMeta, m: LayerMap, i: int, layers: int
                    ) -> tuple[str, Src | None]:
    """The source of ``m`` in layer ``i``: norms under their TE name (dist checkpoints, TE
    legacy files) or their local-spec name (local-spec legacy files)."""
    names = [_mcore_name(m, "te"), _mcore_name(m, "local")] if m.transform == "norm" \
        else [m.mcore]
    for name in names:
        src = _layer_src(meta, name, i, layers)
        if src is not None:
            return name, src
    return names[0], None


def _layer_src(meta: CheckpointMeta, name: str, i: int, layers: int) -> Src | None:
    per = f"decoder.layers.{i}.{name}"
    if per in meta.tensors:
        return Src(per)
    stacked = f"decoder.layers.{name}"
    t = meta.tensors.get(stacked)
    if t is not None and t.shape and t.shape[0] == layers:
        return Src(stacked, (i,))
    return None


EXPERTS_STACKED = "decoder.layers.mlp.experts.experts."  # SequentialMLP in dist checkpoints


def _expert_src(meta: CheckpointMeta, m: LayerMap, i: int, e: int, layers: int) -> Src | None:
    leaf = m.mcore.removeprefix("mlp.experts.")
    per = f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{leaf}"
    if per in meta.tensors:
        return Src(per)
    t = meta.tensors.get(EXPERTS_STACKED + leaf)
    if t is not None and len(t.shape) > 2 and t.shape[0] == layers and e < t.shape[1]:
        return Src(EXPERTS_STACKED + leaf, (i, e))
    return None


def _shape(meta: CheckpointMeta, s: Src) -> tuple[int, ...]:
    return tuple(meta.tensors[s.key].shape[len(s.index):])


def _contradiction(what: str, root: str, settings: str = "config.json",
                   architecture: str | None = None) -> InputError:
    """The weights do not match what ``settings`` (where the model's settings come from) say;
    for an export, ``architecture`` names the HF class the weights were mapped to, which may
    be the wrong one rather than the settings."""
    if architecture is None:
        return InputError(f"the config contradicts the weights: {what}", path=root,
                          hint="pass the matching config (--hf-config) or fix config.json")
    return InputError(f"the weights do not fit {architecture} as {settings} describe them: "
                      f"{what}", path=root,
                      hint="pick the architecture the weights have (--hf-arch), or pass a "
                           "--hf-config that matches them; otherwise use --to safetensors")


def _layer_items(rule: ArchRule, features: set[str], layers: int, experts: int):
    """``(layer, map, expert)`` for every layer tensor (expert 0 for non-expert maps)."""
    for i in range(layers):
        for m in rule.layer_maps(features):
            for e in range(experts if m.expert else 1):
                yield i, m, e


def plan_export(meta: CheckpointMeta, args: dict[str, Any], rule: ArchRule, *, vocab: int,
                settings: str | None = None, experts_layout: str = "per-expert"
                ) -> list[Recipe]:
    """HF tensors (names, shapes, dtypes, recipes) for Megatron-Core checkpoint ``meta``.
    ``settings``: where ``args`` came from, for the errors (``"the checkpoint's args"``);
    None: from an HF config.json (``diff`` against an HF directory). ``experts_layout``:
    ``per-expert`` or ``fused`` (where the rule has a fused name)."""
    where = {} if settings is None else {"settings": settings,
                                         "architecture": rule.architecture}
    layers = int(args["num_layers"])
    heads = int(args["num_attention_heads"])
    groups = int(args.get("num_query_groups") or heads) \
        if args.get("group_query_attention", True) else heads
    hd = int(args.get("kv_channels") or int(args["hidden_size"]) // heads)
    geo = Geometry(groups, heads // groups, hd)
    features = {"qkv_bias"} if _layer_src(meta, "self_attention.linear_qkv.bias", 0,
                                          layers) else set()
    if _layer_src(meta, "self_attention.q_layernorm.weight", 0, layers):
        features.add("qk_norm")
    used: set[str] = set()
    out: list[Recipe] = []

    def add(hf_key: str, src: Src, op: str, shape: tuple[int, ...], params=()) -> None:
        used.add(src.key)
        out.append(Recipe(hf_key, meta.tensors[src.key].dtype, shape,
                          (Part((), op, (src,), tuple(params)),)))

    if _layer_src(meta, "mlp.shared_experts.linear_fc1.weight", 0, layers):
        features.add("shared")
    experts = int(args.get("num_experts") or 0)
    for i, m, e in _layer_items(rule, features, layers, experts):
        prefix = rule.layer_prefix.format(i=i)
        if m.expert and m.fused and experts_layout == "fused":
            if e == 0:
                _export_fused(meta, m, i, layers, experts, prefix, add, where)
            continue
        if m.expert:
            name, src = m.mcore, _expert_src(meta, m, i, e, layers)
        else:
            name, src = _find_layer_src(meta, m, i, layers)
        if src is None:
            raise _contradiction(f"no {name} for layer {i}" + (f" expert {e}" if m.expert
                                                                else "")
                                 + f" ({layers} layers)", meta.root, **where)
        shape = _shape(meta, src)
        if m.transform == "qkv":
            rows = groups * (geo.q_per_group + 2) * hd
            if shape[0] != rows:
                raise _contradiction(f"{src.key} has {shape[0]} rows, {groups} query groups "
                                     f"of {geo.q_per_group} heads x {hd} need {rows}",
                                     meta.root, **where)
            for part, hf in enumerate(m.hf):
                n = groups * (geo.q_per_group if part == 0 else 1) * hd
                add(prefix + hf, src, "qkv_split", (n, *shape[1:]),
                    (("part", part),) + geo.params)
        elif m.transform == "glu":
            for half, hf in enumerate(m.hf):
                add(prefix + hf.format(e=e), src, "glu_split", (shape[0] // 2, *shape[1:]),
                    (("half", half),))
        elif m.transform in ("qkv_cat", "qkv_cat_t"):
            if groups != heads:  # c_attn is [q; k; v] over all heads: k/v as many as q
                raise UnsupportedError(
                    f"{rule.architecture} has no grouped-query attention; this checkpoint has "
                    f"{groups} query groups for {heads} heads", path=meta.root,
                    hint="pass --hf-arch llama, mistral or qwen2 if the other weights fit "
                         "those architectures; otherwise use --to safetensors")
            t = int(m.transform == "qkv_cat_t")
            add(prefix + m.hf[0], src, "qkv_to_cat", tuple(reversed(shape)) if t else shape,
                (("transpose", t),) + geo.params)
        elif m.transform == "t":
            add(prefix + m.hf[0], src, "t", tuple(reversed(shape)))
        else:
            add(prefix + m.hf[0].format(e=e), src, "copy", shape)
    for hf_key, key in ((rule.embed, "embedding.word_embeddings.weight"),
                        (rule.lm_head, "output_layer.weight")):
        if key in meta.tensors:
            add(hf_key, Src(key), "rows", (vocab, *meta.tensors[key].shape[1:]),
                (("rows", vocab),))
    if rule.positions and "embedding.position_embeddings.weight" in meta.tensors:
        key = "embedding.position_embeddings.weight"
        add(rule.positions, Src(key), "copy", meta.tensors[key].shape)
    for leaf in ("weight", "bias"):
        key = f"decoder.final_layernorm.{leaf}"
        if key in meta.tensors:
            add(f"{rule.final_norm}.{leaf}", Src(key), "copy", meta.tensors[key].shape)
    refuse_unplaced(meta, used, rule.architecture, export=True)
    return out


def _export_fused(meta: CheckpointMeta, m: LayerMap, i: int, layers: int, experts: int,
                  prefix: str, add, where: dict[str, Any]) -> None:
    """The experts of layer ``i`` as one HF ``[experts, ...]`` tensor (``m.fused``)."""
    key = EXPERTS_STACKED + m.mcore.removeprefix("mlp.experts.")
    t = meta.tensors.get(key)
    if t is None or len(t.shape) < 3 or t.shape[0] != layers or t.shape[1] != experts:
        raise _contradiction(f"no {key} [{layers}, {experts}, ...] to write fused experts "
                             "from", meta.root, **where)
    add(prefix + m.fused, Src(key, (i,)), "copy", tuple(t.shape[1:]))


def plan_import(meta: CheckpointMeta, config: dict[str, Any], rule: ArchRule,
                args: dict[str, Any], *, spec: str = "te") -> list[Recipe]:
    """Megatron-Core tensors (stacked ``decoder.layers.*`` keys, global shapes, the names
    dist checkpoints use) for HF model ``meta`` with ``config.json`` ``config``; ``args`` from
    ``args_from_hf_config``; ``spec``: ``te`` or ``local`` (they differ for MoE norms)."""
    from ckpt_tool.planning.hf_rules import features_of_config

    layers = int(args["num_layers"])
    heads = int(args["num_attention_heads"])
    groups = int(args["num_query_groups"])
    geo = Geometry(groups, heads // groups, int(args["kv_channels"]))
    features = features_of_config(rule, config)
    used: set[str] = set()
    out: list[Recipe] = []

    def hf_tensor(key: str) -> TensorMeta:
        t = meta.tensors.get(key)
        if t is None:
            raise _contradiction(f"no tensor {key} ({layers} layers in config.json)",
                                 meta.root)
        used.add(key)
        return t

    experts = int(args.get("num_experts") or 0)
    for m in rule.layer_maps(features):
        parts, per_layer, dtype = [], None, None
        for i, mm, e in _layer_items(rule, features, layers, experts):
            if mm is not m:
                continue
            prefix = rule.layer_prefix.format(i=i)
            if m.expert and m.fused and prefix + m.fused in meta.tensors:
                if e == 0:  # transformers 5's fused layout: the layer's experts at once
                    t = hf_tensor(prefix + m.fused)
                    if not t.shape or t.shape[0] != experts:
                        raise _contradiction(f"{t.key} is {list(t.shape)}: not {experts} "
                                             "experts", meta.root)
                    dtype, shape = t.dtype, tuple(t.shape[1:])
                    if per_layer is not None and shape != per_layer:
                        raise _contradiction(f"layer {i} {m.mcore} is {list(shape)}, layer "
                                             f"0's is {list(per_layer)}", meta.root)
                    per_layer = shape
                    parts.append(Part((i,), "copy", (Src(t.key),)))
                continue
            ts = [hf_tensor(prefix + h.format(e=e)) for h in m.hf]
            dtype = ts[0].dtype
            if m.transform == "qkv":
                want = [geo.groups * geo.q_per_group * geo.head_dim] + [geo.groups
                                                                        * geo.head_dim] * 2
                got = [t.shape[0] for t in ts]
                if got != want:
                    raise _contradiction(f"layer {i} q/k/v have {got} rows, the config's "
                                         f"heads need {want}", meta.root)
                shape = (sum(got), *ts[0].shape[1:])
                op, params = "qkv_fuse", geo.params
            elif m.transform == "glu":
                shape, op, params = (ts[0].shape[0] * 2, *ts[0].shape[1:]), "glu_fuse", ()
            elif m.transform in ("qkv_cat", "qkv_cat_t"):
                t = int(m.transform == "qkv_cat_t")
                shape = tuple(reversed(ts[0].shape)) if t else ts[0].shape
                rows = geo.groups * (geo.q_per_group + 2) * geo.head_dim
                if shape[0] != rows:
                    raise _contradiction(f"layer {i} {m.hf[0]} holds {shape[0]} q/k/v rows, "
                                         f"the config's heads need {rows}", meta.root)
                op, params = "qkv_from_cat", (("transpose", t),) + geo.params
            elif m.transform == "t":
                shape, op, params = tuple(reversed(ts[0].shape)), "t", ()
            else:
                shape, op, params = ts[0].shape, "copy", ()
            if per_layer is not None and shape != per_layer:
                raise _contradiction(f"layer {i} {m.mcore} is {list(shape)}, layer 0's is "
                                     f"{list(per_layer)}", meta.root)
            per_layer = shape
            parts.append(Part((i, e) if m.expert else (i,), op, tuple(Src(t.key) for t in ts),
                              params))
        if len({len(p.index) for p in parts}) > 1:
            raise _contradiction(f"{m.fused} is fused in some layers, per expert in others",
                                 meta.root)
        if m.expert:
            key = EXPERTS_STACKED + m.mcore.removeprefix("mlp.experts.")
            lead: tuple[int, ...] = (layers, experts)
        else:
            # TE MoE layers keep a separate pre-MLP norm; the local spec saves it under the
            # fused name (its sharded_state_dict_keys_map) like dense layers
            key, lead = "decoder.layers." + _mcore_name(
                m, "moe" if rule.moe and spec == "te" else "te"), (layers,)
        out.append(Recipe(key, str(dtype), (*lead, *per_layer), tuple(parts)))
    padded = int(args["padded_vocab_size"])
    tied = not args["untie_embeddings_and_output_weights"]
    for key, hf_key in (("embedding.word_embeddings.weight", rule.embed),
                        ("output_layer.weight", rule.lm_head)):
        if key == "output_layer.weight" and tied:
            used.add(hf_key)  # transformers may store the tied copy; Megatron does not
            continue
        t = hf_tensor(hf_key)
        if t.shape[0] > padded:
            raise _contradiction(f"{hf_key} has {t.shape[0]} rows, vocab_size is "
                                 f"{args['vocab_size']}", meta.root)
        out.append(Recipe(key, t.dtype, (padded, *t.shape[1:]),
                          (Part((), "rows", (Src(hf_key),), (("rows", padded),)),)))
    if rule.positions:
        t = hf_tensor(rule.positions)
        out.append(Recipe("embedding.position_embeddings.weight", t.dtype, t.shape,
                          (Part((), "copy", (Src(rule.positions),)),)))
    for leaf in ("weight", "bias"):
        hf_key = f"{rule.final_norm}.{leaf}"
        if hf_key in meta.tensors:
            t = hf_tensor(hf_key)
            out.append(Recipe(f"decoder.final_layernorm.{leaf}", t.dtype, t.shape,
                              (Part((), "copy", (Src(hf_key),)),)))
    refuse_unplaced(meta, used, rule.architecture, export=False)
    return out
