"""``ckpt convert SRC DST --to FORMAT``: rewrite a checkpoint in another format, streaming."""

from pathlib import Path
from typing import Annotated, List, Optional

import typer

from ckpt_tool.cli._errors import handle_errors
from ckpt_tool.cli._options import (DebugFlag, HfDtypeOption, IterationOption, JsonFlag, MaxMemoryOption,
                                    NoProgressFlag, NoVerifyFlag, OverwriteFlag, QuietFlag,
                                    SourcePath, SwigluOption, TrustFlag, VerifyOption, completer,
                                    parse_size, source_place, verify_level)
from ckpt_tool.cli._output import human_bytes, message, print_json, print_resume
from ckpt_tool.cli._progress import progress_bar
from ckpt_tool.errors import plural


@handle_errors
def convert(
    src: SourcePath,
    dst: Annotated[Path, typer.Argument(metavar="DST", show_default=False,
                                        help="Output directory, or one file: a .safetensors file (--to "
                                        "safetensors) or a .pt/.pth/.bin/.ckpt file (--to "
                                        "torch).")],
    to: Annotated[str, typer.Option(
        "--to", metavar="FORMAT", show_default=False, autocompletion=completer(),
        help="Target format: torch_dist, zarr, dcp, legacy, torch, safetensors or hf.")],
    dtype: Annotated[Optional[str], typer.Option(
        "--dtype", metavar="DTYPE", autocompletion=completer("bf16", "fp16", "fp32"),
        help="Cast floating tensors: bf16, fp16 or fp32.", show_default=False)] = None,
    filter_: Annotated[Optional[str], typer.Option(
        "--filter", metavar="REGEX", help="Keep only keys matching this regex.",
        show_default=False)] = None,
    exclude: Annotated[Optional[str], typer.Option(
        "--exclude", metavar="REGEX", help="Drop keys matching this regex.",
        show_default=False)] = None,
    rename: Annotated[Optional[List[str]], typer.Option(
        "--rename", metavar="OLD=NEW", help="Key prefix mapping (repeatable).",
        show_default=False)] = None,
    model_only: Annotated[bool, typer.Option(
        "--model-only", help="Drop optimizer state.")] = False,
    tp: Annotated[Optional[int], typer.Option(
        "--tp", min=1, metavar="N",
        help="With --to legacy: the source's TP size (reshard changes it); from an HF "
        "directory: the TP size to record.", show_default=False)] = None,
    pp: Annotated[Optional[int], typer.Option(
        "--pp", min=1, metavar="N",
        help="With --to legacy: the source's PP size (reshard changes it); from an HF "
        "directory: the PP size to record.", show_default=False)] = None,
    ep: Annotated[Optional[int], typer.Option(
        "--ep", min=1, metavar="N",
        help="From an HF directory: the expert-parallel size to record (it must divide the "
        "routed experts).", show_default=False)] = None,
    hf_config: Annotated[Optional[Path], typer.Option(
        "--hf-config", metavar="FILE", help="--to hf: a config.json giving what the "
        "checkpoint's args lack (its values win).", show_default=False)] = None,
    hf_arch: Annotated[Optional[str], typer.Option(
        "--hf-arch", metavar="NAME", help="HF architecture rule: llama, qwen2, mixtral, gpt2 "
        "and others (default: from config.json or args).", show_default=False)] = None,
    local_spec: Annotated[bool, typer.Option(
        "--local-spec", help="From an HF directory: norm names of Megatron-Core's local "
        "layer spec (default: the Transformer Engine spec).")] = False,
    hf_dtype: HfDtypeOption = None,
    hf_experts: Annotated[Optional[str], typer.Option(
        "--hf-experts", metavar="LAYOUT", help="--to hf: routed experts per-expert (one "
        "tensor per expert, transformers' save_pretrained default) or fused ([experts, ...] "
        "gate_up_proj/down_proj, transformers 5's own layout). Default: per-expert.",
        show_default=False)] = None,
    max_shard_size: Annotated[Optional[str], typer.Option(
        "--max-shard-size", metavar="SIZE", help="safetensors: largest shard, e.g. 5GB.",
        show_default=False)] = None,
    max_memory: MaxMemoryOption = None,
    workers: Annotated[int, typer.Option(
        "--workers", min=1, metavar="N",
        help="Files written at once by I/O threads (dist targets); peak "
        "memory grows to about this many chunks.")] = 1,
    overwrite: OverwriteFlag = False,
    no_verify: NoVerifyFlag = False,
    verify: VerifyOption = "written",
    json_: JsonFlag = False,
    trust: TrustFlag = False,
    iteration: IterationOption = None,
    quiet: QuietFlag = False,
    no_progress: NoProgressFlag = False,
    swiglu: SwigluOption = None,
    debug: DebugFlag = False,
) -> None:
    """Convert a checkpoint to another format, streaming (peak memory ~ the largest tensor).
    The output appears atomically at DST once written and validated.

    \b
    Examples:
      ckpt convert fixtures/mcore016_gpt_tp2pp2_fp32 gpt-st \\
          --to safetensors --dtype bf16
      ckpt convert fixtures/mcore016_llama_tp2pp2_distopt llama-hf --to hf
      ckpt convert llama-hf llama-mcore --to torch_dist --tp 2
      ckpt convert fixtures/mcore016_llama_tp2pp2_distopt llama-fp8 --to hf \\
          --hf-dtype fp8
    """
    from ckpt_tool.ops.convert import ConvertOptions, parse_rename
    from ckpt_tool.ops.convert import convert as run_convert

    place = source_place(src, iteration)
    options = ConvertOptions(to=to, dtype=dtype, filter=filter_, exclude=exclude,
                             rename=parse_rename(rename or []), model_only=model_only,
                             max_memory=parse_size(max_memory, "--max-memory"),
                             hf_config=str(hf_config) if hf_config else None,
                             hf_arch=hf_arch, local_spec=local_spec, hf_dtype=hf_dtype,
                             hf_experts=hf_experts)
    with progress_bar(f"convert -> {to}", enabled=not (quiet or no_progress)) as bar:
        result = run_convert(place, dst, options, trust=trust, overwrite=overwrite,
                             verify=verify_level(verify, no_verify), verify_source=not no_verify,
                             tp=tp, pp=pp, ep=ep,
                             max_shard_size=parse_size(max_shard_size, "--max-shard-size"),
                             progress=bar, workers=workers)
    for note in result.notes:
        # what was dropped or left out is counted in the one line below (--json: the notes)
        if not (result.left_behind and note.startswith(("dropped ", "left out "))):
            message(f"note: {note}")
    if result.left_behind:
        message("note: left behind (not in the output): " + ", ".join(
            f"{n} {kind}" for kind, n in result.left_behind.items()) + " (--json lists them)")
    if json_:
        print_json(result.to_dict())
    message(f"converted {result.source} ({result.source_format}) -> {result.target} "
            f"({result.format}): {plural(result.tensors, 'tensor')}, "
            f"{plural(result.objects, 'object')}, "
            f"{human_bytes(result.nbytes)} in {result.seconds:.1f} s"
            + ("" if result.verified else " (not verified)"))
    print_resume(result.resume)
