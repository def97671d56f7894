"""``ckpt convert SRC DST --to FORMAT``: rewrite a checkpoint in another format, streaming."""

from pathlib import Path
from typing import Annotated, List, Optional

import typer

from ckpt_tool.cli._errors import handle_errors
from ckpt_tool.cli._options import (CheckpointPath, JsonFlag, MaxMemoryOption, NoVerifyFlag,
                                    OverwriteFlag, TrustFlag, parse_size)
from ckpt_tool.cli._output import human_bytes, message, print_json
from ckpt_tool.cli._progress import progress_bar


@handle_errors
def convert(
    src: CheckpointPath,
    dst: Annotated[Path, typer.Argument(help="Output directory (or file, for --to torch).",
                                        show_default=False)],
    to: Annotated[str, typer.Option(
        "--to", help="Target format: torch_dist, zarr, dcp, legacy, torch, safetensors.",
        show_default=False)],
    dtype: Annotated[Optional[str], typer.Option(
        "--dtype", help="Cast floating tensors: bf16, fp16 or fp32.", show_default=False)] = None,
    filter_: Annotated[Optional[str], typer.Option(
        "--filter", help="Keep only keys matching this regex.", show_default=False)] = None,
    exclude: Annotated[Optional[str], typer.Option(
        "--exclude", help="Drop keys matching this regex.", show_default=False)] = None,
    rename: Annotated[Optional[List[str]], typer.Option(
        "--rename", help="Prefix mapping OLD=NEW (repeatable).", show_default=False)] = None,
    model_only: Annotated[bool, typer.Option(
        "--model-only", help="Drop optimizer state.")] = False,
    tp: Annotated[Optional[int], typer.Option(
        "--tp", min=1, help="With --to legacy: the source's TP size (reshard changes it).",
        show_default=False)] = None,
    pp: Annotated[Optional[int], typer.Option(
        "--pp", min=1, help="With --to legacy: the source's PP size (reshard changes it).",
        show_default=False)] = None,
    max_shard_size: Annotated[Optional[str], typer.Option(
        "--max-shard-size", help="safetensors: largest shard, e.g. 5GB.",
        show_default=False)] = None,
    max_memory: MaxMemoryOption = None,
    workers: Annotated[int, typer.Option(
        "--workers", min=1, help="Files written at once by I/O threads (dist targets); peak "
        "memory grows to about this many chunks.")] = 1,
    overwrite: OverwriteFlag = False,
    no_verify: NoVerifyFlag = False,
    json_: JsonFlag = False,
    trust: TrustFlag = False,
) -> None:
    """Convert a checkpoint to another format, streaming (peak memory ~ the largest tensor).
    The output appears atomically at DST once written and validated.

    Example: ckpt convert checkpoints/gpt/iter_0001000 gpt-hf --to safetensors --dtype bf16
    """
    from ckpt_tool.ops._convert_plan import ConvertOptions, parse_rename
    from ckpt_tool.ops.convert import convert as run_convert

    options = ConvertOptions(to=to, dtype=dtype, filter=filter_, exclude=exclude,
                             rename=parse_rename(rename or []), model_only=model_only,
                             max_memory=parse_size(max_memory, "--max-memory"))
    with progress_bar(f"convert -> {to}", enabled=True) as bar:
        result = run_convert(src, dst, options, trust=trust, overwrite=overwrite,
                             verify=not no_verify, tp=tp, pp=pp,
                             max_shard_size=parse_size(max_shard_size, "--max-shard-size"),
                             progress=bar, workers=workers)
    for note in result.notes:
        message(f"note: {note}")
    if json_:
        print_json(result.to_dict())
    message(f"converted {result.source} ({result.source_format}) -> {result.target} "
            f"({result.format}): {result.tensors} tensors, {result.objects} objects, "
            f"{human_bytes(result.nbytes)} in {result.seconds:.1f} s"
            + ("" if result.verified else " (not verified)"))
