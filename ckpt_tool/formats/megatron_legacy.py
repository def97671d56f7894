"""Megatron-LM legacy checkpoints (``--ckpt-format torch``): one ``torch.save`` file per
model-parallel rank, ``<iter>/mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt``.

The reader presents ONE logical checkpoint: tensors named and shaped as the TP=1/PP=1 model's
state dict holds them (``decoder.layers.{global layer}.…``, TP-merged shapes; module names such
as ``input_layernorm``/``pre_mlp_layernorm`` are kept). The split rules live in
``_legacy_layout``. SwiGLU ``linear_fc1`` (each rank ``[W_r; V_r]``) becomes the canonical
``[W_0; …; W_{tp-1}; V_0; …; V_{tp-1}]``, 2 chunks per rank. ``_extra_state`` entries that are
None are skipped.

Metadata is torch-free: each rank file's ``data.pkl`` is unpickled with tensor placeholders
(``_common.load_torch_save_light``) and every chunk points at its storage's byte range inside
the zip (layout ``raw``). Optimizer state (the ``optimizer`` key, ``distrib_optim.pt``),
``rng_state`` and ``opt_param_scheduler`` are listed as objects, not tensors (for now).
A missing rank file does not stop ``metadata()``: it is listed in ``extras["missing_rank_files"]``
(the affected tensors then lack chunks) and in :attr:`LegacyReader.problems` for ``validate``.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ckpt_tool.errors import CorruptCheckpointError, InputError
from ckpt_tool.formats import _legacy_layout as L
from ckpt_tool.formats._resolve import resolve_checkpoint_dir
from ckpt_tool.formats.base import Format, Reader, register
from ckpt_tool.model import CheckpointMeta, ChunkRef, ObjectMeta, TensorMeta, dtype_itemsize

__all__ = ["LegacyReader", "LEGACY", "rank_dirs"]

MODEL_FILE = "model_optim_rng.pt"
DISTRIB_OPTIM_FILE = "distrib_optim.pt"
_OBJECT_KEYS = ("optimizer", "opt_param_scheduler", "rng_state")
_LRU_FILES = 4


def rank_dirs(root: Path) -> list[str]:
    """Names of the ``mp_rank_*`` directories under ``root`` (sorted)."""
    try:
        return sorted(d.name for d in root.iterdir()
                      if d.is_dir() and L.RANK_DIR_RE.match(d.name))
    except OSError:
        return []


def sniff(path: Path) -> str | None:
    """A directory (save dir, ``iter_*`` or ``release``) holding ``mp_rank_*`` directories."""
    try:
        d = resolve_checkpoint_dir(path)
    except (InputError, OSError) as exc:
        return getattr(exc, "message", None) or str(exc)
    if not d.is_dir():
        return "not a directory"
    for marker in ("metadata.json", ".metadata"):
        if (d / marker).exists():
            return f"has {marker} (a dist/DCP checkpoint, not per-rank torch.save files)"
    names = rank_dirs(d)
    if not names:
        return "no mp_rank_* directories"
    if not any((d / n / MODEL_FILE).is_file() or (d / n / DISTRIB_OPTIM_FILE).is_file()
               for n in names):
        return f"mp_rank_* directories without {MODEL_FILE}"
    return None


def _get(args: Any, name: str) -> Any:
    return getattr(args, name, None) if args is not None else None


class LegacyReader(Reader):
    """Reader for a Megatron-LM legacy checkpoint directory (see the module docstring)."""

    format_name = "legacy"

    def __init__(self, path: Path, *, trust: bool = False):
        super().__init__(path, trust=trust)
        self.root = resolve_checkpoint_dir(path)
        why = sniff(self.root)
        if why is not None:
            raise InputError(f"not a Megatron-LM legacy checkpoint: {why}", path=self.root)
        self._meta: CheckpointMeta | None = None
        # global key -> {chunk: (file, local model key, (row start, row stop) or None)}
        self._sources: dict[str, dict[ChunkRef, tuple[str, str, tuple[int, int] | None]]] = {}
        self._files: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.problems: list[dict[str, Any]] = []

    # -- metadata ---------------------------------------------------------------------------

    def metadata(self) -> CheckpointMeta:
        """Every merged global tensor, the rank files' objects and the args summary."""
        if self._meta is not None:
            return self._meta
        from ckpt_tool.formats._common import jsonable, load_torch_save_light, summarize_common
        from ckpt_tool.formats._torch_stubs import TensorPlaceholder
        from ckpt_tool.formats.torch_save import TorchSaveReader, _zip_info

        present: dict[str, Any] = {}
        unreadable: list[str] = []
        for name in rank_dirs(self.root):
            if (self.root / name / MODEL_FILE).is_file():
                try:
                    present[name] = load_torch_save_light(self.root / name / MODEL_FILE,
                                                          trust=self.trust)
                except CorruptCheckpointError as exc:  # reported; the other ranks still load
                    unreadable.append(f"{name}/{MODEL_FILE}")
                    self.problems.append({"message": f"unreadable rank file: {exc.message}",
                                          "file": f"{name}/{MODEL_FILE}"})
        if not present:
            raise CorruptCheckpointError(f"no {MODEL_FILE} in any mp_rank_* directory",
                                         path=self.root)
        first = present[sorted(present)[0]]
        args = first.get("args") if isinstance(first, dict) else None
        tp_size = _get(args, "tensor_model_parallel_size")
        pp_size = _get(args, "pipeline_model_parallel_size")
        ep_size = _get(args, "expert_model_parallel_size") or 1
        ranks = {}
        for name in present:
            parsed = L.parse_rank_dir(name, pp_size)
            if parsed is not None:
                ranks[name] = parsed
        tp_size = tp_size or 1 + max(r[0] for r in ranks.values())
        pp_size = pp_size or 1 + max(r[1] for r in ranks.values())
        ep_size = max(ep_size, 1 + max(r[2] for r in ranks.values()))
        expected = [L.rank_dir_name(t, p, e, pp_size, ep_size) for p in range(pp_size)
                    for t in range(tp_size) for e in range(ep_size)]
        missing = [f"{n}/{MODEL_FILE}" for n in expected
                   if n not in present and f"{n}/{MODEL_FILE}" not in unreadable]
        for f in missing:
            self.problems.append({"message": f"rank file {f} is missing (TP={tp_size} "
                                  f"PP={pp_size} EP={ep_size} from args)", "file": f})

        swiglu = bool(_get(args, "swiglu"))
        vpp = _get(args, "virtual_pipeline_model_parallel_size")
        num_layers = _get(args, "num_layers")
        model_keys = sorted((k for k in first if isinstance(k, str) and k.startswith("model")
                             and k[5:].isdigit()), key=lambda k: int(k[5:])) \
            if "model" not in first else ["model"]
        offsets = self._stage_offsets(present, ranks, args, num_layers, pp_size)

        # global key -> list of (tp, file, local key, placeholder)
        pieces: dict[str, list[tuple[int, str, str, Any]]] = {}
        objects: list[ObjectMeta] = []
        zips: dict[str, Any] = {}
        for name in sorted(present):
            tp, pp, ep = ranks.get(name, (0, 0, 0))
            state, rel = present[name], f"{name}/{MODEL_FILE}"
            zips[rel] = _zip_info(self.root / rel)
            for mk in model_keys:
                sd = state.get(mk)
                if not isinstance(sd, dict):
                    continue
                if mk == "model":
                    layer_off = offsets[pp]
                elif not num_layers:
                    raise CorruptCheckpointError(
                        "virtual pipeline (model0..N keys) but no args.num_layers to place the "
                        "layers", path=self.root / rel)
                else:
                    layer_off = L.virtual_layer_offset(num_layers, pp_size, vpp or len(model_keys),
                                                       pp, int(mk[5:]))
                n_local_experts = _get(args, "num_experts")
                expert_off = ep * (n_local_experts // ep_size) if n_local_experts else 0
                for k, v in sd.items():
                    if v is None:
                        continue
                    if not isinstance(v, TensorPlaceholder):
                        continue
                    gk = L.globalize_key(str(k), layer_off, expert_off)
                    pieces.setdefault(gk, []).append((tp, rel, f"{mk}\0{k}", v))
            for ok in _OBJECT_KEYS:
                if ok in state:
                    objects.append(ObjectMeta(key=ok, unique_key=f"{ok}/{name}", file=rel))
            if (self.root / name / DISTRIB_OPTIM_FILE).is_file():
                objects.append(ObjectMeta(key="distrib_optim",
                                          unique_key=f"distrib_optim/{name}",
                                          file=f"{name}/{DISTRIB_OPTIM_FILE}"))

        tensors: dict[str, TensorMeta] = {}
        unknown: list[str] = []
        for gk in sorted(pieces):
            tm = self._merge(gk, pieces[gk], tp_size, swiglu, zips, TorchSaveReader)
            if tm is None:
                unknown.append(gk)
            else:
                tensors[gk] = tm

        common = summarize_common(first) if isinstance(first, dict) else {}
        extras = {
            "tp": tp_size, "pp": pp_size, "ep": ep_size,
            "rank_files": sorted(f"{n}/{MODEL_FILE}" for n in present),
            "missing_rank_files": missing,
            "unreadable_rank_files": unreadable,
            "distrib_optim_files": sorted(o.file for o in objects if o.key == "distrib_optim"),
            "virtual_pipeline": model_keys if model_keys != ["model"] else None,
            "unmerged": unknown,
            "optimizer_state": "listed as objects (not tensors) for now",
        }
        if isinstance(first, dict) and "args" in first:
            extras["args"] = jsonable(first["args"])
        version = first.get("checkpoint_version") if isinstance(first, dict) else None
        self._meta = CheckpointMeta(format=self.format_name, root=str(self.root),
                                    tensors=tensors, objects=tuple(objects), common=common,
                                    extras=extras,
                                    version=None if version is None else str(version))
        return self._meta

    def _stage_offsets(self, present: dict[str, Any], ranks: dict[str, tuple[int, int, int]],
                       args: Any, num_layers: int | None, pp_size: int) -> list[int]:
        """Global index of each stage's first layer: from args, else from the layers found."""
        if num_layers:
            try:
                return L.stage_layer_offsets(
                    int(num_layers), pp_size, _get(args, "decoder_first_pipeline_num_layers"),
                    _get(args, "decoder_last_pipeline_num_layers"))
            except ValueError as exc:
                self.problems.append({"message": f"args: {exc}", "file": None})
        counts = [0] * pp_size
        for name, state in present.items():
            pp = ranks.get(name, (0, 0, 0))[1]
            sd = state.get("model") if isinstance(state, dict) else None
            for k in (sd or {}):
                m = L.LAYER_RE.match(str(k))
                if m is not None and pp < pp_size:
                    counts[pp] = max(counts[pp], int(m.group(2)) + 1)
        out, acc = [], 0
        for c in counts:
            out.append(acc)
            acc += c
        return out

    def _merge(self, gk: str, parts: list[tuple[int, str, str, Any]], tp_size: int,
               swiglu: bool, zips: dict[str, Any], tsr: Any) -> TensorMeta | None:
        """One global TensorMeta from the TP pieces of ``gk``; None when unknown and
        inconsistent across ranks."""
        kind, dim = L.split_rule(gk, swiglu=swiglu)
        by_tp: dict[int, tuple[str, str, Any]] = {}
        for tp, rel, lk, t in parts:
            by_tp.setdefault(tp, (rel, lk, t))
        p0 = by_tp[min(by_tp)][2]
        dtype, lshape = p0.dtype, tuple(int(s) for s in p0.shape)
        for tp, (rel, lk, t) in sorted(by_tp.items()):
            if t.dtype != dtype or tuple(t.shape) != lshape:
                self.problems.append({
                    "message": f"TP rank {tp} holds {t.dtype}{list(t.shape)}, TP rank "
                    f"{min(by_tp)} {dtype}{list(lshape)}", "key": gk, "file": rel})
        sources: dict[ChunkRef, tuple[str, str, tuple[int, int] | None]] = {}

        def raw(rel: str, lk: str, t: Any) -> ChunkRef:
            prefix, storages, byteorder = zips[rel]
            # torch_save's byte-range rule for one placeholder (its ``self`` needs only .path)
            c = tsr._chunk(SimpleNamespace(path=self.root / rel), lk.replace("\0", "."), t,
                           tuple(int(s) for s in t.shape), storages, byteorder)
            if c is None:
                shape = tuple(int(s) for s in t.shape)
                c = ChunkRef(offsets=(0,) * len(shape), sizes=shape, layout="torch_save")
            return dataclasses.replace(c, file=rel)

        if kind == L.REPLICATED or tp_size == 1 or not lshape:
            if kind != L.REPLICATED and tp_size > 1 and not lshape:
                return None
            rel, lk, t = by_tp[min(by_tp)]
            c = raw(rel, lk, t)
            sources[c] = (rel, lk, None)
            self._sources[gk] = sources
            return TensorMeta(key=gk, dtype=dtype, shape=lshape, chunks=(c,), origin=kind)
        gshape = list(lshape)
        gshape[dim] *= tp_size
        chunks = []
        for tp, (rel, lk, t) in sorted(by_tp.items()):
            if tuple(t.shape) != lshape:
                continue
            c = raw(rel, lk, t)
            if kind == L.GLU:
                half = lshape[0] // 2
                row_bytes = dtype_itemsize(dtype) * (c.numel // max(lshape[0], 1))
                for i, start in enumerate((tp * half, tp_size * half + tp * half)):
                    sizes = (half, *lshape[1:])
                    cc = dataclasses.replace(
                        c, offsets=(start,) + (0,) * (len(lshape) - 1), sizes=sizes,
                        byte_offset=None if c.byte_offset is None
                        else c.byte_offset + i * half * row_bytes,
                        byte_length=None if c.byte_length is None else half * row_bytes)
                    sources[cc] = (rel, lk, (i * half, (i + 1) * half))
                    chunks.append(cc)
            else:
                off = [0] * len(lshape)
                off[dim] = tp * lshape[dim]
                cc = dataclasses.replace(c, offsets=tuple(off))
                sources[cc] = (rel, lk, None)
                chunks.append(cc)
        self._sources[gk] = sources
        return TensorMeta(key=gk, dtype=dtype, shape=tuple(gshape), chunks=tuple(chunks),
                          origin=kind)

    # -- reads ------------------------------------------------------------------------------

    def _load_file(self, rel: str) -> dict[str, Any]:
        if rel in self._files:
            self._files.move_to_end(rel)
            return self._files[rel]
        import pickle
        import zipfile

        import torch

        path = self.root / rel
        if not path.is_file():
            raise CorruptCheckpointError(f"rank file {rel} is missing", path=self.root)
        try:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except pickle.UnpicklingError:
            from ckpt_tool.formats._pickle import load_torch_file

            state = load_torch_file(path, trust=self.trust)
        except (RuntimeError, EOFError, zipfile.BadZipFile) as exc:
            raise CorruptCheckpointError(f"cannot load {rel} ({exc})", path=self.root) from None
        self._files[rel] = state
        while len(self._files) > _LRU_FILES:
            self._files.popitem(last=False)
        return state

    def read(self, key: str, slices: tuple[slice, ...] | None = None) -> Any:
        """The merged global tensor ``key`` (or ``slices`` of it); loads only the rank files
        holding the requested region."""
        from ckpt_tool.formats._dcp_io import assemble

        meta = self._tensor_meta(key)
        sources = self._sources[key]

        def load(chunk: ChunkRef) -> Any:
            rel, lk, rows = sources[chunk]
            mk, k = lk.split("\0", 1)
            t = self._load_file(rel)[mk][k]
            return t if rows is None else t[rows[0]:rows[1]]

        return assemble(meta, slices, load)

    def read_object(self, unique_key: str) -> Any:
        """``optimizer/<rank dir>``, ``rng_state/…``, ``opt_param_scheduler/…`` or the whole
        ``distrib_optim/<rank dir>`` file."""
        o = self._object_meta(unique_key)
        if o.key == "distrib_optim":
            from ckpt_tool.formats._pickle import load_torch_file

            return load_torch_file(self.root / str(o.file), trust=self.trust)
        return self._load_file(str(o.file))[o.key]

    def common(self) -> dict[str, Any]:
        """The first rank file's state without the model and optimizer (loaded with torch)."""
        rel = self.metadata().extras["rank_files"][0]
        state = self._load_file(rel)
        return {k: v for k, v in state.items()
                if not (str(k).startswith("model") or k == "optimizer")}

    def close(self) -> None:
        """Drop the cached rank files."""
        self._files.clear()


LEGACY = register(Format(
    name="legacy", sniff=sniff, open=LegacyReader,
    description="Megatron-LM legacy checkpoint (--ckpt-format torch): mp_rank_*/model_optim_rng.pt"))
