"""``convert`` between Megatron-Core GPT checkpoints and Hugging Face model directories.

* ``--to hf`` from a Megatron-Core dist (torch_dist, zarr) or Megatron-LM legacy checkpoint:
  ``config.json`` from the checkpoint's ``args`` (``--hf-config FILE`` fills what they lack,
  ``--hf-arch NAME`` picks the architecture), the model weights renamed and transformed by the
  architecture's rules, as safetensors (sharded with an index above ``--max-shard-size``).
* ``--to torch_dist`` / ``--to legacy`` from an HF directory: stacked ``decoder.layers.*``
  tensors as Megatron-Core saves them, ``args`` derived from ``config.json`` (``--tp``/``--pp``
  recorded, ``--local-spec`` picks the local layer spec's norm names; default the TE spec);
  torch_dist also holds the model's ``_extra_state`` objects as that spec saves them
  (:mod:`ckpt_tool.planning.extra_state`).

Planning is pure (``planning.hf_plan``); ``_hf_source.HfSource`` computes each target piece
from its sources when the writer asks, so memory stays near one layer's tensor; the output is
staged, validated and renamed into place as every convert. Under torchrun (``ckpt --nproc N``)
each rank writes its share of the output files (whole safetensors shards for ``--to hf``, its
DCP items or rank files for torch_dist/legacy) and rank 0 the index and ``config.json``.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ckpt_tool.errors import UsageError
from ckpt_tool.formats.base import Reader, open_checkpoint
from ckpt_tool.formats.writer import WriteRequest, WriterOptions, writer_for
from ckpt_tool.model import CheckpointMeta, ChunkRef, FormatKind, TensorMeta
from ckpt_tool.ops._extra_state import ExtraStates
from ckpt_tool.ops._framework_files import carry_tokenizer_to_hf
from ckpt_tool.ops._hf_source import HfSource
from ckpt_tool.ops.convert._plan import left_behind
from ckpt_tool.ops.validate import UNVERIFIED_NOTE, check_source
from ckpt_tool.ops.manifest_checks import check_source_manifest
from ckpt_tool.ops._output_staging import check_output_target, staged_output_ranks, verify_output
from ckpt_tool.parallel import JobProgress
from ckpt_tool.parallel import ranks as current_ranks
from ckpt_tool.planning.extra_state import LOCAL, TE
from ckpt_tool.ops.convert._hf_layered import export_layered, import_layered, namespace
from ckpt_tool.planning.hf_extras import gpt2_token_ids
from ckpt_tool.planning.hf_families import Family
from ckpt_tool.planning.hf_layered import EXPERT_LAYOUTS
from ckpt_tool.planning.hf_plan import Recipe, plan_export, plan_import
from ckpt_tool.planning.hf_rules import (args_from_hf_config, guess_arch, hf_config_from_args,
                                         moe_layers_check, rule_for_config, rule_named)
from ckpt_tool.planning.source_layout import args_of
from ckpt_tool.storage import as_path

__all__ = ["convert_hf", "is_hf_conversion", "load_hf_config"]


def is_hf_conversion(source_format: str, to: str) -> bool:
    """True when ``convert`` goes through the architecture rules: an export to an HF
    directory, or an HF directory imported into what Megatron-LM resumes from."""
    return FormatKind(to).hf_directory or (FormatKind(source_format).hf_directory
                                           and writer_for(to).megatron_resume_target)


def load_hf_config(path: str | Path | None) -> dict[str, Any]:
    """An ``--hf-config`` file (a config.json, or the directory holding one)."""
    if path is None:
        return {}
    from ckpt_tool.formats.hf.reader import read_config

    return read_config(Path(path))


def _export(reader: Reader, meta: CheckpointMeta, options: Any
            ) -> tuple[list[Recipe], dict[str, Any], dict[str, Any]]:
    if not meta.kind.megatron:
        raise UsageError(f"--to hf reads Megatron-Core or Megatron-LM checkpoints, not "
                         f"{meta.format}", hint="convert it to torch_dist first")
    base = load_hf_config(options.hf_config)
    args = args_of(meta, reader.common())
    if options.hf_arch:
        rule = rule_named(options.hf_arch)
    elif base.get("architectures") or base.get("model_type"):
        rule = rule_for_config(base)
    else:
        rule = rule_named(guess_arch(args))
    if not args.get("num_layers"):
        if not base:
            raise UsageError("the checkpoint has no Megatron-LM args to derive config.json "
                             "from", hint="pass --hf-config config.json")
        args = {**args_from_hf_config(base, rule), **{k: v for k, v in args.items()
                                                       if v is not None}}
    vocab = int(base.get("vocab_size") or args.get("vocab_size")
                or args.get("padded_vocab_size"))
    settings = "--hf-config and the checkpoint's args" if base else "the checkpoint's args"
    if isinstance(rule, Family):
        recipes, config = export_layered(meta, args, rule, base, options, vocab=vocab,
                                         settings=settings)
        gen = {k: base[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
               if base.get(k) is not None}
        return recipes, {}, {"hf_config": config, "notes": [],
                             "generation_config": gen and {**gen, "_from_model_config": True}}
    if options.hf_experts is not None and not rule.moe:
        raise UsageError(f"--hf-experts: {rule.architecture} has no routed experts",
                         hint="leave --hf-experts out")
    layout = options.hf_experts or args.get("hf_experts") or "per-expert"
    if layout not in EXPERT_LAYOUTS:
        raise UsageError(f"--hf-experts {layout!r} is not one of {', '.join(EXPERT_LAYOUTS)}",
                         hint="per-expert (transformers' save_pretrained default) or fused")
    if layout == "fused" and not any(m.fused for m in rule.layers):
        if options.hf_experts:
            raise UsageError(f"--hf-experts fused: the {rule.name} rule writes its experts "
                             "per expert only", hint="leave --hf-experts out")
        layout = "per-expert"
    recipes = plan_export(meta, args, rule, vocab=vocab, settings=settings,
                          experts_layout=layout)
    dtype = next((r.dtype for r in recipes if r.key == rule.embed), recipes[0].dtype)
    notes = []
    if rule.name == "gpt2" and not {"bos_token_id", "eos_token_id"} & base.keys():
        ids, note = gpt2_token_ids(args, vocab)  # else GPT2Config's default, 50256, applies
        base = {**base, **ids}
        notes += [note] if note else []
    config = hf_config_from_args(args, rule, vocab=vocab, dtype=dtype, base=base)
    gen = {k: base[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
           if base.get(k) is not None}
    extra = {"hf_config": config, "generation_config": gen and {**gen,
                                                                "_from_model_config": True},
             "notes": notes}
    return recipes, {}, extra


def _record_ep(args: dict[str, Any], ep: int) -> int:
    """Record expert-parallel size ``ep`` in ``args``; the data-parallel size it needs (EP x
    ETP divides TP x DP in Megatron-Core)."""
    import math

    experts = int(args.get("num_experts") or 0)
    if ep > 1 and not experts:
        raise UsageError(f"--ep {ep}: the model has no routed experts", hint="leave --ep out")
    if experts % ep:
        raise UsageError(f"--ep {ep} does not divide the {experts} routed experts",
                         hint="pick an EP size that divides the expert count")
    args["expert_model_parallel_size"] = ep
    tp = int(args["tensor_model_parallel_size"])
    span = ep * int(args.get("expert_tensor_parallel_size") or tp)
    return span // math.gcd(span, tp)


def _import(reader: Reader, meta: CheckpointMeta, options: Any, tp: int, pp: int, ep: int = 1
            ) -> tuple[list[Recipe], dict[str, Any], dict[str, Any]]:
    import argparse

    from ckpt_tool.formats.containers.torch_zip.torch_zip_read import torch_dtype

    config = dict(reader.common()["config"])
    config.update(load_hf_config(options.hf_config))
    rule = rule_named(options.hf_arch) if options.hf_arch else rule_for_config(config)
    if isinstance(rule, Family):
        recipes, args, notes = import_layered(meta, config, rule, options, tp, pp)
        dp = _record_ep(args, ep)
        common = {"args": namespace(args, tp, pp, dp), "checkpoint_version": 3.0,
                  "iteration": 0}
        return recipes, common, {"source_common_summary": {"parallel": {
            "tp": tp, "pp": pp, "ep": ep, "dp": dp}}, "local_spec": options.local_spec,
            "notes": notes}
    moe_layers_check(config, rule)
    args = args_from_hf_config(config, rule, tp=tp, pp=pp, local_spec=options.local_spec)
    heads = args["num_attention_heads"]
    for what, n in (("attention heads", heads), ("query groups", args["num_query_groups"])):
        if n % tp:
            raise UsageError(f"--tp {tp} does not divide the {n} {what}",
                             hint="pick a TP size that divides heads and query groups")
    if args["num_layers"] % pp:
        raise UsageError(f"--pp {pp} does not divide the {args['num_layers']} layers",
                         hint="pick a PP size that divides the layer count")
    # dist checkpoints name the norms as TE does (the local spec's sharded_state_dict_keys_map
    # maps them); the legacy writer renames them back for --local-spec
    recipes = plan_import(meta, config, rule, args,
                          spec="local" if options.local_spec else "te")
    if any(k.endswith(".mlp.experts.gate_up_proj") for k in meta.tensors):
        args["hf_experts"] = "fused"  # an export writes the experts as the source had them
    dp = _record_ep(args, ep)
    ns = argparse.Namespace(**{**args, "params_dtype": torch_dtype(args["params_dtype"]),
                               "world_size": tp * pp * dp, "data_parallel_size": dp})
    common = {"args": ns, "checkpoint_version": 3.0, "iteration": 0}
    extra = {"source_common_summary": {"parallel": {"tp": tp, "pp": pp, "ep": ep, "dp": dp}},
             "local_spec": options.local_spec}
    return recipes, common, extra


HF_DTYPES = ("bf16", "fp8")


def _hf_dtype_recipes(recipes: list[Recipe], hf_dtype: str) -> list[Recipe]:
    """``--hf-dtype bf16``: every floating tensor in bfloat16; ``fp8``: the tensors kept
    unquantized as stored (the quantized ones are read in their stored dtype)."""
    if hf_dtype not in HF_DTYPES:
        raise UsageError(f"--hf-dtype {hf_dtype!r} is not one of {', '.join(HF_DTYPES)}",
                         hint="bf16 (unquantized) or fp8 (block-scaled, 128x128)")
    if hf_dtype == "fp8":
        return recipes
    return [replace(r, dtype="bfloat16") if r.dtype in ("float32", "float16", "float64")
            else r for r in recipes]


def _fp8_export(recipes: list[Recipe], target: CheckpointMeta, source: Any,
                extra: dict[str, Any]) -> tuple[CheckpointMeta, Any]:
    from ckpt_tool.formats.hf.quant_view import Fp8Blocks
    from ckpt_tool.ops._hf_fp8_export import Fp8Source, plan_fp8

    scheme = Fp8Blocks()
    tensors, quantized, qconfig = plan_fp8(recipes, target.tensors, scheme)
    extra["hf_config"] = {**extra["hf_config"], "quantization_config": qconfig}
    if not quantized:
        extra["notes"] = [*extra.get("notes", ()), "--hf-dtype fp8: no linear weight divides "
                          f"into whole {scheme.block[0]}x{scheme.block[1]} blocks; nothing "
                          "was quantized"]
    return replace(target, tensors=tensors), Fp8Source(source, quantized, scheme)


def _target(recipes: list[Recipe], to: str, max_memory: int | None = None) -> CheckpointMeta:
    """The output's tensors: a chunk per layer of a stacked tensor; an untiled tensor of a
    dist target cut into row chunks of at most ``max_memory`` bytes (default 256 MiB), so
    that an embedding is written a slab at a time."""
    from ckpt_tool.formats.write_pieces import DEFAULT_MAX_MEMORY
    from ckpt_tool.ops.convert._plan import split_rows

    tensors = {}
    for r in recipes:
        whole = ChunkRef(offsets=(0,) * len(r.shape), sizes=r.shape)
        if not FormatKind(to).hf_directory and any(p.index for p in r.parts):
            lead = len(r.parts[0].index)
            chunks = tuple(ChunkRef(offsets=(*p.index, *(0,) * (len(r.shape) - lead)),
                                    sizes=(*(1,) * lead, *r.shape[lead:])) for p in r.parts)
        elif FormatKind(to).megatron_dist:
            chunks = tuple(split_rows(whole, r.dtype, max_memory or DEFAULT_MAX_MEMORY))
        else:
            chunks = (whole,)
        tensors[r.key] = TensorMeta(key=r.key, dtype=r.dtype, shape=r.shape, chunks=chunks)
    return CheckpointMeta(format=to, root="", tensors=tensors)


def convert_hf(src: str | Path, dst: str | Path, options: Any, *, trust: bool = False,
               overwrite: bool = False, verify: bool = True, tp: int | None = None,
               pp: int | None = None, max_shard_size: int | None = None,
               progress: Any = None, verify_source: bool = True,
               ep: int | None = None) -> dict[str, Any]:
    """Convert between a Megatron checkpoint and an HF directory (see the module doc);
    returns the fields of ``ops.convert.ConvertResult``."""
    start = time.perf_counter()
    if options.filter or options.exclude or options.rename:
        raise UsageError("--filter, --exclude and --rename do not apply to an HF conversion: "
                         "the architecture rules place every tensor, and one left out would "
                         "change the model", hint="--to safetensors keeps a subset of the "
                         "tensors under their own names")
    r = current_ranks()
    out = check_output_target(dst, sources=(src,), overwrite=overwrite)
    with open_checkpoint(src, trust=trust, verify=verify_source) as reader:
        meta = reader.metadata()
        check_source(meta)
        if verify_source:
            check_source_manifest(as_path(src), as_path(meta.root), r)
        if FormatKind(options.to).hf_directory:
            if tp is not None or pp is not None or ep is not None:
                raise UsageError("--tp/--pp/--ep do not apply with --to hf",
                                 hint="an HF directory has no parallel layout")
            recipes, common, extra = _export(reader, meta, options)
            if options.hf_dtype is not None:
                recipes = _hf_dtype_recipes(recipes, options.hf_dtype)
        else:
            if (ep or 1) > 1 and not FormatKind(options.to).megatron_dist:
                raise UsageError(f"--ep applies with --to torch_dist, not --to {options.to}",
                                 hint="import with --to torch_dist, or leave --ep out")
            recipes, common, extra = _import(reader, meta, options, tp or 1, pp or 1, ep or 1)
        target = _target(recipes, options.to, options.max_memory)
        extra_states = None
        if FormatKind(options.to).megatron_dist:  # the model's _extra_state objects, as saved
            extra_states = ExtraStates(target.tensors, LOCAL if options.local_spec else TE)
            target = replace(target, objects=extra_states.objects)
        source: Any = HfSource(reader, {r.key: r for r in recipes})
        if options.hf_dtype == "fp8":  # the linear weights block-scaled, as FP8 releases
            target, source = _fp8_export(recipes, target, source, extra)
        if progress is not None:
            progress.start(target.total_bytes, len(target.tensors))
        job = JobProgress(progress, r)
        request = WriteRequest(meta=target, source=source, common=common,
                               objects=extra_states.payload if extra_states else lambda k: None,
                               progress=lambda n: job.update(n, source.tensors_done),
                               ranks=r if r.world > 1 else None,
                               source_description=f"ckpt convert from {meta.format} "
                                                  f"checkpoint {meta.root}")
        wopts = WriterOptions(max_shard_size=max_shard_size or WriterOptions.max_shard_size,
                              max_memory=options.max_memory, tp=tp or 1, pp=pp or 1,
                              extra=extra)
        notes: list[str] = list(extra.pop("notes", ())) + ([] if verify_source
                                                            else [UNVERIFIED_NOTE])
        writer_cls = writer_for(options.to)
        with staged_output_ranks(out, r, overwrite=overwrite, notes=notes) as staging:
            writer = writer_cls(staging, wopts)
            if r.is_main or writer_cls.supports_ranks:
                notes += writer.write(request)
            if r.is_main and FormatKind(options.to).hf_directory:  # Megatron-LM's tokenizer/
                notes += carry_tokenizer_to_hf(as_path(meta.root), staging)
            r.barrier()
            job.catch_up(source.tensors_done)
            if verify:
                verify_output(staging, trust=trust, what="converted", ranks=r,
                              level=verify)
    tensors, objects = writer.written(target)
    used = {s.key for r in recipes for p in r.parts for s in p.sources}
    # an export keeps the model's weights and a config.json made from the args; an import
    # keeps everything an HF directory holds
    left = (left_behind(meta, used, 0, []) if FormatKind(options.to).hf_directory else {})
    return dict(
        source=str(meta.root), source_format=meta.format, target=str(out), format=options.to,
        tensors=tensors, objects=objects, nbytes=target.total_bytes,
        seconds=time.perf_counter() - start, verified=bool(verify),
        largest_piece=source.largest_piece, notes=notes, source_verified=verify_source,
        left_behind=left)
