"""``ckpt inspect PATH``: a checkpoint's tensors, objects and common state (metadata only)."""

import sys
from typing import Annotated, Any, Optional

import typer

from ckpt_tool.cli._errors import handle_errors
from ckpt_tool.cli._options import (CheckpointPath, DebugFlag, IterationOption, JsonFlag,
                                    SwigluOption, TrustFlag, at_iteration)
from ckpt_tool.cli._output import (human_bytes, message, print_json, print_text, stdout,
                                   terminal_width)
from ckpt_tool.errors import NotACheckpointError, plural

# The default view lists objects one per row up to this many, then one row per key.
_OBJECTS_IN_FULL = 24


@handle_errors
def inspect(
    path: CheckpointPath,
    json_: JsonFlag = False,
    trust: TrustFlag = False,
    filter_: Annotated[Optional[str], typer.Option(
        "--filter", metavar="REGEX", show_default=False,
        help="Only tensors/objects whose key matches (Python re.search).")] = None,
    tree: Annotated[bool, typer.Option(
        "--tree", help="Group tensors by module prefix, with bytes and tensor counts.")] = False,
    objects: Annotated[bool, typer.Option(
        "--objects", help="List every stored object (unique key, file, size) in full.")] = False,
    common: Annotated[bool, typer.Option(
        "--common", help="Print the full common state (every field, args in full).")] = False,
    iteration: IterationOption = None,
    swiglu: SwigluOption = None,
    debug: DebugFlag = False,
) -> None:
    """Show a checkpoint's tensors, objects and common state (metadata only).

    \b
    Examples:
      ckpt inspect fixtures/mcore016_gpt_tp2pp2_fp32 --json
      ckpt inspect fixtures/mcore016_gpt_tp2pp2_fp32 --tree --filter 'mlp'
      ckpt inspect fixtures
    """
    from ckpt_tool.ops.inspect import compile_filter
    from ckpt_tool.ops.inspect import inspect as run_inspect

    compile_filter(filter_)  # a bad regex is a usage error before any I/O
    path = at_iteration(path, iteration)
    try:
        result = run_inspect(path, trust=trust, pattern=filter_, full_common=common)
    except NotACheckpointError as exc:
        if not _a_plain_folder(path, exc):  # (a damaged checkpoint: its own error)
            raise
        _list_checkpoints(path, json_)  # a folder of checkpoints: what it holds
        return
    if json_:
        print_json(result.to_dict(tree=tree))
    else:
        render(result, tree=tree, all_objects=objects, full_common=common)
    from ckpt_tool.leftovers import describe_leftovers, leftovers

    left = leftovers(path)
    if left:  # e.g. a killed --overwrite run: the old checkpoint is whole, its staging beside
        message(f"note: an interrupted write left {describe_leftovers(left)} beside "
                f"{path} (a rerun of the command that writes it reclaims it)")


# files that make a directory a (perhaps damaged) checkpoint rather than a folder of them
_CHECKPOINT_FILES = ("metadata.json", ".metadata", "common.pt",
                     "latest_checkpointed_iteration.txt", "*.distcp")


def _a_plain_folder(path: Any, exc: Any) -> bool:
    """True when ``path`` is a local directory that no format recognised at all and that
    holds none of a checkpoint's own files: a folder that may hold checkpoints."""
    from ckpt_tool.formats.save_dir import iteration_dirs

    return (path.is_dir() and exc.message.startswith("not a checkpoint of any known format")
            and not iteration_dirs(path)
            and not any(next(path.glob(name), None) for name in _CHECKPOINT_FILES))


def _list_checkpoints(path: Any, json_: bool) -> None:
    """The checkpoints in ``path`` and below, one row each; a short error when there are
    none."""
    from ckpt_tool.errors import NotACheckpointError
    from ckpt_tool.ops.inspect import DEPTH, checkpoints_under

    found = checkpoints_under(path)
    if not found:
        raise NotACheckpointError(f"not a checkpoint, and none in it or {DEPTH} levels below",
                                  path=path,
                                  hint="pass a checkpoint directory, an iter_* directory or "
                                  "a training save directory") from None
    if json_:
        print_json({"path": str(path), "checkpoints": found})
        return
    from ckpt_tool.cli._tables import Column, print_table

    def layout(e: dict[str, Any]) -> str:
        return " ".join(f"{k}{v}" for k, v in (e["layout"] or {}).items())

    def iterations(e: dict[str, Any]) -> str:
        its = e["iterations"] or []
        return ", ".join(its) if len(its) <= 3 else f"{its[0]} ... {its[-1]} ({len(its)})"

    print_table(f"{plural(len(found), 'checkpoint')} in {path}",
                (Column("path", name=True), Column("format"), Column("iterations"),
                 Column("layout"), Column("size", "right"), Column("manifest")),
                [(e["path"], e["format"], iterations(e), layout(e), human_bytes(e["bytes"]),
                  "yes" if e["manifest"] else "") for e in found])
    message(f"note: 'ckpt inspect {path}/PATH' shows one of them")


def _shape(shape: Any) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _kv(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={_kv(v)}" for k, v in value.items())
    if isinstance(value, list):
        return "[" + ", ".join(_kv(v) for v in value) + "]"
    return str(value)


def render(result: Any, *, tree: bool = False, all_objects: bool = False,
           full_common: bool = False) -> None:
    """Rich rendering of an InspectResult for people (stdout)."""
    from rich.text import Text

    meta, ex = result.meta, result.meta.extras
    title = Text(f"{meta.format}", style="bold cyan")
    width = terminal_width(sys.stdout)
    # on a terminal too narrow for both: the path on a line of its own, whole
    wide = width is None or len(meta.format) + 2 + len(str(meta.root)) <= width
    title.append(f"  {meta.root}" if wide else f"\n  {meta.root}", style="default")
    stdout.print(title)
    backend = [f"{k}={ex[k]}" for k in ("sharded_backend", "sharded_backend_version",
                                        "common_backend", "common_backend_version",
                                        "dcp_version") if ex.get(k) is not None]
    if backend:
        print_text("backend: " + ", ".join(backend))
    if ex.get("common_state"):  # Megatron-Core dist checkpoints: where it is kept
        print_text(f"common state: {ex['common_state']}")
    files = [f"{k}={ex[k]}" for k in ("data_files", "chunk_files", "object_files")
             if ex.get(k) is not None]
    if files:
        print_text("files: " + ", ".join(files))
    if ex.get("tokenizer_assets"):  # Megatron-LM's tokenizer/ in the iteration directory
        names = [a["name"] for a in ex["tokenizer_assets"]]
        print_text(f"tokenizer: tokenizer/ ({len(names)} files: {', '.join(names[:6])}"
                   f"{', ...' if len(names) > 6 else ''})")
    if full_common and result.full_common is not None:
        _render_full_common(result.full_common)
    else:
        _render_common(meta.common)
    if result.parts:
        print_text("parts: " + "; ".join(f"{k}: {v}" for k, v in result.parts.items()))
    if "optimizer_sharding" in ex:  # Megatron-Core formats only
        opt = ex["optimizer_sharding"]
        print_text("optimizer sharding: " + (f"{opt['type']} ({opt['source']})" if opt
                                             else "no optimizer state"))

    if tree:
        _render_tree(result)
    else:
        _render_table(result)
    _render_objects(meta, all_objects)
    _render_totals(result)


def _render_table(result: Any) -> None:
    from ckpt_tool.cli._tables import Column, print_table

    meta = result.meta
    rows = []
    for key in sorted(meta.tensors):
        t = meta.tensors[key]
        shape = _shape(t.shape)
        if t.stored_shape is not None:
            shape += f" (stored {_shape(t.stored_shape)})"
        rows.append((key, t.dtype, shape, len(t.chunks), result.splits.get(key, ""),
                     human_bytes(t.nbytes)))
    print_table(plural(len(meta.tensors), "tensor"),
                (Column("key", name=True), Column("dtype"), Column("shape"),
                 Column("chunks", "right"), Column("split"), Column("bytes", "right")), rows)


def _render_tree(result: Any) -> None:
    from rich.markup import escape
    from rich.tree import Tree

    from ckpt_tool.ops.inspect import tensor_tree

    def label(node: dict[str, Any]) -> str:
        name = escape(node["name"])
        if "key" in node:
            return (f"{name}  [dim]{node['dtype']} {_shape(node['shape'])}[/dim]  "
                    f"{escape(node['split'])}  {human_bytes(node['nbytes'])}")
        n = node["tensors"]
        return (f"[bold]{name}[/bold]  ({plural(n, 'tensor')}, "
                f"{human_bytes(node['nbytes'])})")

    def add(parent: Any, node: dict[str, Any]) -> None:
        for child in node["children"]:
            add(parent.add(label(child)), child)

    root = tensor_tree(result.meta, result.splits)
    top = Tree(label({**root, "name": root["name"] or "tensors"}))
    add(top, root)
    stdout.print(top, highlight=False, soft_wrap=False)  # labels wrapped between words


def _render_objects(meta: Any, all_objects: bool) -> None:
    from ckpt_tool.cli._tables import Column, print_table
    from ckpt_tool.ops.inspect import object_groups

    if not meta.objects:
        if all_objects:
            print_text("objects: none")
        return
    if all_objects or len(meta.objects) <= _OBJECTS_IN_FULL:
        print_table(f"{len(meta.objects)} sharded objects",
                    (Column("unique key", name=True), Column("file", name=True),
                     Column("bytes", "right")),
                    [(o.unique_key, o.file or "",
                      "" if o.byte_length is None else human_bytes(o.byte_length))
                     for o in meta.objects])
    else:
        groups = object_groups(meta)
        print_table(f"{plural(len(meta.objects), 'sharded object')} in "
                    f"{plural(len(groups), 'key')} (--objects lists each)",
                    (Column("key", name=True), Column("objects", "right"),
                     Column("bytes", "right")),
                    [(g["key"], g["count"], human_bytes(g["nbytes"])) for g in groups])


def _render_totals(result: Any) -> None:
    from ckpt_tool.cli._tables import Column, print_table

    meta = result.meta
    rows = [(dtype, row["tensors"], f"{row['numel']:,}", human_bytes(row["nbytes"]))
            for dtype, row in result.totals.items()]
    rows.append(("all", len(meta.tensors), f"{sum(r['numel'] for r in result.totals.values()):,}",
                 human_bytes(meta.total_bytes)))
    print_table("totals per dtype", (Column("dtype"), Column("tensors", "right"),
                                     Column("elements", "right"), Column("bytes", "right")),
                rows, last_row_style="bold")


def _render_full_common(common: dict[str, Any]) -> None:
    import json

    print_text("common state (full):")
    print_text(json.dumps(common, indent=2, default=str))


def _render_common(common: dict[str, Any]) -> None:
    if not common:
        print_text("common state: none found")
        return
    lines = []
    for k in ("architecture", "quantization", "iteration", "checkpoint_version",
              "num_floating_point_operations_so_far"):
        if k in common:
            lines.append(f"{k}: {common[k]}")
    for k in ("parallel", "model", "training", "content_metadata", "values"):
        if common.get(k):
            lines.append(f"{k}: {_kv(common[k])}")
    if common.get("keys"):
        lines.append("common keys: " + ", ".join(common["keys"]))
    print_text("\n".join(lines))
