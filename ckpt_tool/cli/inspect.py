"""``ckpt inspect PATH``: a checkpoint's tensors, objects and common state (metadata only)."""

from __future__ import annotations

from typing import Any

from ckpt_tool.cli._errors import handle_errors
from ckpt_tool.cli._options import CheckpointPath, JsonFlag, TrustFlag
from ckpt_tool.cli._output import human_bytes, print_json, stdout


@handle_errors
def inspect(path: CheckpointPath, json_: JsonFlag = False, trust: TrustFlag = False) -> None:
    """Show a checkpoint's tensors, objects and common state (metadata only).

    Example: ckpt inspect checkpoints/gpt/iter_0000010 --json
    """
    from ckpt_tool.ops.inspect import inspect as run_inspect

    result = run_inspect(path, trust=trust)
    if json_:
        print_json(result.to_dict())
    else:
        render(result)


def _shape(shape: Any) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _kv(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={_kv(v)}" for k, v in value.items())
    if isinstance(value, list):
        return "[" + ", ".join(_kv(v) for v in value) + "]"
    return str(value)


def render(result: Any) -> None:
    """Rich rendering of an InspectResult for people (stdout)."""
    from rich.table import Table
    from rich.text import Text

    meta, ex = result.meta, result.meta.extras
    title = Text(f"{meta.format}", style="bold cyan")
    title.append(f"  {meta.root}", style="default")
    stdout.print(title)
    backend = [f"{k}={ex[k]}" for k in ("sharded_backend", "sharded_backend_version",
                                        "common_backend", "common_backend_version",
                                        "dcp_version") if ex.get(k) is not None]
    if backend:
        stdout.print("backend: " + ", ".join(backend), highlight=False)
    files = [f"{k}={ex[k]}" for k in ("data_files", "chunk_files", "object_files")
             if ex.get(k) is not None]
    if files:
        stdout.print("files: " + ", ".join(files), highlight=False)
    _render_common(meta.common)
    if "optimizer_sharding" in ex:  # Megatron-Core formats only
        opt = ex["optimizer_sharding"]
        stdout.print("optimizer sharding: " + (f"{opt['type']} ({opt['source']})" if opt
                                               else "no optimizer state"), highlight=False)

    table = Table(title=f"{len(meta.tensors)} tensors", title_justify="left", expand=False)
    for col, just in (("key", "left"), ("dtype", "left"), ("shape", "left"),
                      ("chunks", "right"), ("split", "left"), ("bytes", "right")):
        table.add_column(col, justify=just, overflow="fold")
    for key in sorted(meta.tensors):
        t = meta.tensors[key]
        shape = _shape(t.shape)
        if t.stored_shape is not None:
            shape += f" (stored {_shape(t.stored_shape)})"
        table.add_row(key, t.dtype, shape, str(len(t.chunks)), result.splits.get(key, ""),
                      human_bytes(t.nbytes))
    stdout.print(table)

    if meta.objects:
        objs = Table(title=f"{len(meta.objects)} sharded objects", title_justify="left")
        for col in ("unique key", "file", "bytes"):
            objs.add_column(col, overflow="fold")
        for o in meta.objects:
            size = "" if o.byte_length is None else human_bytes(o.byte_length)
            objs.add_row(o.unique_key, o.file or "", size)
        stdout.print(objs)

    totals = Table(title="totals per dtype", title_justify="left")
    for col, just in (("dtype", "left"), ("tensors", "right"), ("elements", "right"),
                      ("bytes", "right")):
        totals.add_column(col, justify=just)
    for dtype, row in result.totals.items():
        totals.add_row(dtype, str(row["tensors"]), f"{row['numel']:,}", human_bytes(row["nbytes"]))
    totals.add_row("all", str(len(meta.tensors)),
                   f"{sum(r['numel'] for r in result.totals.values()):,}",
                   human_bytes(meta.total_bytes), style="bold")
    stdout.print(totals)


def _render_common(common: dict[str, Any]) -> None:
    if not common:
        stdout.print("common state: none found", highlight=False)
        return
    lines = []
    for k in ("iteration", "checkpoint_version", "num_floating_point_operations_so_far"):
        if k in common:
            lines.append(f"{k}: {common[k]}")
    for k in ("parallel", "model", "training", "content_metadata", "values"):
        if common.get(k):
            lines.append(f"{k}: {_kv(common[k])}")
    if common.get("keys"):
        lines.append("common keys: " + ", ".join(common["keys"]))
    from rich.markup import escape

    stdout.print(escape("\n".join(lines)), highlight=False)
