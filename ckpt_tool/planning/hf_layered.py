"""Per-tensor recipes between a Megatron-Core GPT whose layers differ (dense, then MoE; MTP
layers) and an HF directory, from a family table (:mod:`ckpt_tool.planning.hf_families`).

Pure, as :mod:`ckpt_tool.planning.hf_plan`, whose ``Recipe``/``Part``/``Src`` it returns:
Megatron-Core keys are per layer (``decoder.layers.{i}.*``, ``mtp.layers.{j}.*``), routed
experts one ``[experts, ...]`` tensor per layer. Every source tensor must be placed by a rule:
one left over is refused by name; a shape that contradicts config.json is an error.
"""

from __future__ import annotations

from typing import Any

from ckpt_tool.errors import InputError
from ckpt_tool.model import CheckpointMeta, TensorMeta
from ckpt_tool.planning.hf_families import Entry, Family
from ckpt_tool.planning.hf_plan import (Geometry, Part, Recipe, Src, _contradiction,
                                        refuse_unplaced)

__all__ = ["plan_layered_import", "plan_layered_export", "mtp_layers_in", "EXPERT_LAYOUTS"]

EXPERT_LAYOUTS = ("per-expert", "fused")
# a fused-experts entry's op -> (the import's transform, params); the export's inverse
FUSED_IMPORT = {"copy": ("copy", ()), "swap_last": ("swap_last", ()),
                "glu_interleaved": ("glu_deinterleave", (("t", 0),)),
                "glu_interleaved_t": ("glu_deinterleave", (("t", 1),))}
FUSED_EXPORT = {"copy": ("copy", ()), "swap_last": ("swap_last", ()),
                "glu_interleaved": ("glu_interleave", (("t", 0),)),
                "glu_interleaved_t": ("glu_interleave", (("t", 1),))}
_SPECS = ("local", "te")


def mtp_layers_in(meta: CheckpointMeta, family: Family, layers: int) -> int:
    """How many MTP layers the HF weights hold after the ``layers`` decoder layers."""
    j = 0
    while any(k.startswith(family.layer_prefix.format(i=layers + j)) for k in meta.tensors):
        j += 1
    return j


def _blocks(layers: int, mtp: int, kinds: list[str]):
    """``(HF prefix, Megatron layer prefix, Megatron MTP prefix or None, kind)`` per layer."""
    for i in range(layers):
        yield i, f"decoder.layers.{i}.", None, kinds[i]
    for j in range(mtp):
        yield layers + j, f"mtp.layers.{j}.transformer_layer.", f"mtp.layers.{j}.", kinds[-1]


def kinds_of(args: dict[str, Any]) -> list[str]:
    layers = int(args["num_layers"])
    freq = args.get("moe_layer_freq", 1) if args.get("num_experts") else 0
    if isinstance(freq, (list, tuple)):
        return ["moe" if f else "dense" for f in freq]
    return ["moe" if freq and i % int(freq) == 0 else "dense" for i in range(layers)]


def _geometry(args: dict[str, Any]) -> Geometry:
    """The query groups of a ``qkv`` entry (Megatron-Core's ``linear_qkv`` rows per group)."""
    heads = int(args["num_attention_heads"])
    groups = int(args.get("num_query_groups") or heads) if args.get(
        "group_query_attention", True) else heads
    hd = int(args.get("kv_channels") or int(args["hidden_size"]) // heads)
    return Geometry(groups, heads // groups, hd)


def _entries(family: Family, kind: str, features: set[str]) -> list[Entry]:
    rows = family.attention + (family.moe if kind == "moe" else family.dense)
    return [e for e in rows if not e.when or e.when in features]


def plan_layered_import(meta: CheckpointMeta, config: dict[str, Any], family: Family,
                        args: dict[str, Any], *, spec: str = "te") -> tuple[list[Recipe],
                                                                              list[str]]:
    """Megatron-Core tensors (per-layer keys, global shapes) for HF model ``meta``; and notes
    (HF tensors Megatron-Core keeps once: the MTP layer's copies of the embedding/head)."""
    layers, mtp = int(args["num_layers"]), int(args.get("mtp_num_layers") or 0)
    features = family.features(config)
    shapes = family.expected_shapes(config)
    experts = int(args.get("num_experts") or 0)
    used: set[str] = set()
    out: list[Recipe] = []
    notes: list[str] = []

    def hf(key: str) -> TensorMeta:
        t = meta.tensors.get(key)
        if t is None:
            raise _contradiction(f"no tensor {key} ({layers} layers, {mtp} MTP layers)",
                                 meta.root)
        used.add(key)
        return t

    def add(key: str, ts: list[TensorMeta], op: str, params=(), shape=None) -> None:
        shape = shape or (tuple(ts[0].shape) if op != "glu_fuse"
                          else (ts[0].shape[0] * 2, *ts[0].shape[1:]))
        out.append(Recipe(key, ts[0].dtype, tuple(shape),
                          (Part((), op, tuple(Src(t.key) for t in ts), tuple(params)),)))

    for n, mp, mtp_prefix, kind in _blocks(layers, mtp, kinds_of(args)):
        hp = family.layer_prefix.format(i=n)
        for e in _entries(family, kind, features):
            ts = [hf(hp + h) for h in e.hf]
            for h, t in zip(e.hf, ts):
                want = shapes.get(h)
                if want is not None and tuple(t.shape) != want:
                    raise _contradiction(f"{t.key} is {list(t.shape)}, the config's sizes give "
                                         f"{list(want)}", meta.root)
            if e.op == "glu":
                add(mp + e.name(spec), ts, "glu_fuse")
            elif e.op == "qkv":
                add(mp + e.name(spec), ts, "qkv_fuse", _geometry(args).params,
                    (sum(t.shape[0] for t in ts), *ts[0].shape[1:]))
            elif e.op in ("rope_q", "rope_kv") and family.rope_params(config, e.op):
                add(mp + e.name(spec), ts, "rope_rows", family.rope_params(config, e.op))
            else:
                add(mp + e.name(spec), ts, "copy")
        if kind == "moe":
            out.extend(_import_experts(meta, family, hp, mp, experts, hf))
        if mtp_prefix is not None:
            for e in family.mtp:
                add(mtp_prefix + e.name(spec), [hf(hp + e.hf[0])], "copy")
            for leaf, _ in family.mtp_shared:
                if hp + leaf in meta.tensors:
                    used.add(hp + leaf)
                    notes.append(f"{hp + leaf} not imported: Megatron-Core's MTP layer uses the "
                                 "model's own embedding and output layer")
    out.extend(_import_ends(meta, family, args, hf, used))
    refuse_unplaced(meta, used, family.architecture, export=False)
    return out, notes


def _import_experts(meta: CheckpointMeta, family: Family, hp: str, mp: str, experts: int,
                    hf) -> list[Recipe]:
    fused = not family.experts or all(hp + e.hf[0] in meta.tensors
                                      for e in family.experts_fused)
    out = []
    if fused:
        for e in family.experts_fused:
            t = hf(hp + e.hf[0])
            if not t.shape or t.shape[0] != experts:
                raise _contradiction(f"{t.key} is {list(t.shape)}: not {experts} experts",
                                     meta.root)
            op, params = FUSED_IMPORT[e.op]
            shape = tuple(t.shape)
            if op == "swap_last" or dict(params).get("t"):
                shape = (*shape[:-2], shape[-1], shape[-2])
            out.append(Recipe(mp + e.mcore, t.dtype, shape,
                              (Part((), op, (Src(t.key),), params),)))
        return out
    for e in family.experts:
        parts, shape, dtype = [], None, None
        for x in range(experts):
            ts = [hf(hp + h.format(e=x)) for h in e.hf]
            one = (ts[0].shape[0] * 2, *ts[0].shape[1:]) if e.op == "glu" else tuple(
                ts[0].shape)
            if shape is not None and one != shape:
                raise _contradiction(f"{ts[0].key} is {list(ts[0].shape)}, expert 0's differs",
                                     meta.root)
            shape, dtype = one, ts[0].dtype
            parts.append(Part((x,), "glu_fuse" if e.op == "glu" else "copy",
                              tuple(Src(t.key) for t in ts)))
        out.append(Recipe(mp + e.mcore, dtype, (experts, *shape), tuple(parts)))
    return out


def _import_ends(meta: CheckpointMeta, family: Family, args: dict[str, Any], hf,
                 used: set[str]) -> list[Recipe]:
    out = []
    padded = int(args["padded_vocab_size"])
    tied = not args["untie_embeddings_and_output_weights"]
    for key, hf_key in (("embedding.word_embeddings.weight", family.embed),
                        ("output_layer.weight", family.lm_head)):
        if key == "output_layer.weight" and tied:
            used.add(hf_key)
            continue
        t = hf(hf_key)
        if t.shape[0] > padded:
            raise _contradiction(f"{hf_key} has {t.shape[0]} rows, vocab_size is "
                                 f"{args['vocab_size']}", meta.root)
        out.append(Recipe(key, t.dtype, (padded, *t.shape[1:]),
                          (Part((), "rows", (Src(hf_key),), (("rows", padded),)),)))
    t = hf(family.final_norm)
    out.append(Recipe("decoder.final_layernorm.weight", t.dtype, tuple(t.shape),
                      (Part((), "copy", (Src(t.key),)),)))
    return out


def _find(meta: CheckpointMeta, prefix: str, e: Entry) -> str | None:
    for spec in _SPECS:
        if prefix + e.name(spec) in meta.tensors:
            return prefix + e.name(spec)
    return None


def plan_layered_export(meta: CheckpointMeta, args: dict[str, Any], family: Family, *,
                        vocab: int, experts_layout: str = "per-expert",
                        settings: str | None = None) -> list[Recipe]:
    """HF tensors for Megatron-Core checkpoint ``meta`` (per-layer keys) of ``family``;
    ``experts_layout``: ``per-expert`` (what transformers' save_pretrained writes by default)
    or ``fused`` (``[experts, ...]`` tensors, transformers 5's own layout)."""
    where = {} if settings is None else {"settings": settings,
                                         "architecture": family.architecture}
    layers = int(args["num_layers"])
    mtp = int(args.get("mtp_num_layers") or 0)
    features = {"q_lora" if args.get("q_lora_rank") else "q_full"}
    used: set[str] = set()
    out: list[Recipe] = []

    def add(hf_key: str, src: Src, op: str, shape, params=()) -> None:
        used.add(src.key)
        out.append(Recipe(hf_key, meta.tensors[src.key].dtype, tuple(shape),
                          (Part((), op, (src,), tuple(params)),)))

    for n, mp, mtp_prefix, kind in _blocks(layers, mtp, kinds_of(args)):
        hp = family.layer_prefix.format(i=n)
        rows = family.attention + (family.moe if kind == "moe" else family.dense)
        # q_lora / q_full follow the args; other optional tensors are there or not
        present = {e.when for e in rows if e.when and _find(meta, mp, e) is not None}
        for e in _entries(family, kind, features | (present - {"q_lora", "q_full"})):
            key = _find(meta, mp, e)
            if key is None:
                raise _contradiction(f"no {mp + e.mcore} ({layers} layers, {kind})", meta.root,
                                     **where)
            shape = tuple(meta.tensors[key].shape)
            if e.op == "glu":
                for half, h in enumerate(e.hf):
                    add(hp + h, Src(key), "glu_split", (shape[0] // 2, *shape[1:]),
                        (("half", half),))
            elif e.op == "qkv":
                geo = _geometry(args)
                if shape[0] != geo.groups * (geo.q_per_group + 2) * geo.head_dim:
                    raise _contradiction(f"{key} has {shape[0]} rows, {geo.groups} query "
                                         f"groups of {geo.q_per_group} heads x {geo.head_dim} "
                                         "need another count", meta.root, **where)
                for part, h in enumerate(e.hf):
                    n = geo.groups * (geo.q_per_group if part == 0 else 1) * geo.head_dim
                    add(hp + h, Src(key), "qkv_split", (n, *shape[1:]),
                        (("part", part),) + geo.params)
            else:
                add(hp + e.hf[0], Src(key), "copy", shape)
        if kind == "moe":
            if "expert_bias" not in present and any(e.when == "expert_bias" for e in
                                                    family.moe):  # no expert bias: routing on the scores alone
                key = mp + "mlp.router.weight"
                out.append(Recipe(hp + "mlp.gate.e_score_correction_bias", "float32",
                                  (meta.tensors[key].shape[0],),
                                  (Part((), "zeros_rows", (Src(key),)),)))
            _export_experts(meta, family, hp, mp, experts_layout, add, where)
        if mtp_prefix is not None:
            for e in family.mtp:
                key = _find(meta, mtp_prefix, e)
                if key is None:
                    raise _contradiction(f"no {mtp_prefix + e.mcore}", meta.root, **where)
                add(hp + e.hf[0], Src(key), "copy", meta.tensors[key].shape)
            for leaf, key in family.mtp_shared:  # as DeepSeek's releases hold them
                key = key if key in meta.tensors else "embedding.word_embeddings.weight"
                add(hp + leaf, Src(key), "rows", (vocab, *meta.tensors[key].shape[1:]),
                    (("rows", vocab),))
    for hf_key, key in ((family.embed, "embedding.word_embeddings.weight"),
                        (family.lm_head, "output_layer.weight")):
        if key in meta.tensors:
            add(hf_key, Src(key), "rows", (vocab, *meta.tensors[key].shape[1:]),
                (("rows", vocab),))
    key = "decoder.final_layernorm.weight"
    if key not in meta.tensors:
        raise _contradiction("no decoder.final_layernorm.weight", meta.root, **where)
    add(family.final_norm, Src(key), "copy", meta.tensors[key].shape)
    refuse_unplaced(meta, used, family.architecture, export=True)
    return out


def _export_experts(meta: CheckpointMeta, family: Family, hp: str, mp: str, layout: str,
                    add, where: dict[str, Any]) -> None:
    if layout not in EXPERT_LAYOUTS:
        raise InputError(f"unknown expert layout {layout!r}", hint="per-expert or fused")
    if not family.experts:  # the family's HF experts are fused only
        layout = "fused"
    for e, fused in zip(family.experts or family.experts_fused, family.experts_fused):
        key = mp + e.mcore
        if key not in meta.tensors:
            raise _contradiction(f"no {key}", meta.root, **where)
        shape = tuple(meta.tensors[key].shape)
        if layout == "fused":
            op, params = FUSED_EXPORT[fused.op]
            if op == "swap_last" or dict(params).get("t"):
                shape = (*shape[:-2], shape[-1], shape[-2])
            add(hp + fused.hf[0], Src(key), op, shape, params)
            continue
        for x in range(shape[0]):
            if e.op == "glu":
                for half, h in enumerate(e.hf):
                    add(hp + h.format(e=x), Src(key, (x,)), "glu_split",
                        (shape[1] // 2, *shape[2:]), (("half", half),))
            else:
                add(hp + e.hf[0].format(e=x), Src(key, (x,)), "copy", shape[1:])
