"""``validate``: per-item checks of DCP / Megatron-Core dist checkpoints.

Items sharing bytes (:func:`check_overlaps`): DCP writes each item as its own archive, back
to back; two items whose byte ranges overlap mean the metadata is damaged or crafted.

Objects' pickles (:func:`check_object_pickles`): every stored object's pickle goes through the
allowlisting unpickler.

The integrity pass checks the zip records of object items (CRC, layout) but does not unpickle
them; a payload that names ``os.system`` would pass it, and any loader that unpickles without
an allowlist (Megatron-Core's ``load``, ``torch.load(weights_only=False)``) would run it. Here
each object of a Megatron-Core dist or DCP checkpoint is loaded through the reader (the safe
unpickler: nothing runs) and a refused global is an error finding. Objects bigger than
``_SMALL_BYTES`` are only loaded with ``deep`` (a plain validate stays cheap)."""

from __future__ import annotations

import os
from typing import Any

from ckpt_tool.errors import CkptError, UnsafePickleError
from ckpt_tool.model import CheckpointMeta
from ckpt_tool.ops.validate._checks import error
from ckpt_tool.model import Finding

__all__ = ["check_object_pickles", "check_overlaps"]

_SMALL_BYTES = 64 << 20


def check_object_pickles(reader: Any, meta: CheckpointMeta, so_far: list[Finding], *,
                         deep: bool, trust: bool, stats: dict[str, int]) -> list[Finding]:
    """Error findings for objects whose pickle the allowlist refuses (skipped with ``trust``:
    the caller opted into running them; objects already reported broken are not reread)."""
    if trust or not (meta.kind.megatron_dist or meta.kind.dcp_files):
        return []
    broken = {(f.key, f.file) for f in so_far if f.severity == "error"}
    broken_files = {f.file for f in so_far if f.severity == "error" and f.key is None}
    out: list[Finding] = []
    checked = 0
    # torch-free where the reader can (tensors as placeholders: the allowlist is the same)
    load = reader.read_object_torch_free
    for o in meta.objects:
        if (o.unique_key, o.file) in broken or (o.key, o.file) in broken \
                or o.file in broken_files:
            continue
        if not deep and (o.byte_length or 0) > _SMALL_BYTES:
            continue
        checked += 1
        try:
            load(o.unique_key)
        except UnsafePickleError as exc:
            out.append(error(f"object {o.unique_key}: its pickle would run code: "
                             f"{exc.message}", key=o.unique_key, file=o.file))
        except CkptError as exc:  # Megatron-Core objects are always torch.save archives
            elsewhere = getattr(exc, "path", None)
            if elsewhere is not None and os.path.basename(str(elsewhere)) != \
                    os.path.basename(o.file or ""):
                continue  # another file's damage (a broken common.pt), reported on its own
            if not meta.kind.plain_dcp:  # (DCP bytes items may be raw BytesIO: not pickles)
                out.append(error(f"object {o.unique_key}: unreadable: {exc.message}",
                                 key=o.unique_key, file=o.file))
        except Exception:  # noqa: BLE001 - damage is the integrity pass's to report
            continue
    stats["objects_unpickled"] = checked
    return out


def check_overlaps(meta: CheckpointMeta) -> list[Finding]:
    """Overlapping byte ranges of items in one file (one finding per file; DCP formats)."""
    if not meta.kind.dcp_files:
        return []
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for key, t in meta.tensors.items():
        for c in t.chunks:
            if c.file and c.byte_offset is not None and c.byte_length:
                by_file.setdefault(c.file, []).append((c.byte_offset, c.byte_length, key))
    for o in meta.objects:
        if o.file and o.byte_offset is not None and o.byte_length:
            by_file.setdefault(o.file, []).append((o.byte_offset, o.byte_length, o.unique_key))
    out = []
    for file, items in sorted(by_file.items()):
        items.sort()
        for (a_off, a_len, a_key), (b_off, b_len, b_key) in zip(items, items[1:]):
            if b_off < a_off + a_len:
                out.append(error(f"items overlap: {b_key} at bytes [{b_off}, {b_off + b_len}) "
                                 f"and {a_key} at [{a_off}, {a_off + a_len})", key=b_key,
                                 file=file))
                break
    return out
