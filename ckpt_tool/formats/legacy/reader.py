"""Megatron-LM legacy checkpoints (``--ckpt-format torch``): one ``torch.save`` file per
model-parallel rank, ``<iter>/mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt``.

The reader presents ONE logical checkpoint: tensors named and shaped as the TP=1/PP=1 model's
state dict holds them (``decoder.layers.{global layer}.…``, TP-merged shapes; module names such
as ``input_layernorm``/``pre_mlp_layernorm`` are kept). The split rules live in
``legacy.layout``. SwiGLU ``linear_fc1`` (each rank ``[W_r; V_r]``) becomes the canonical
``[W_0; …; W_{tp-1}; V_0; …; V_{tp-1}]``, 2 chunks per rank. ``_extra_state`` entries that are
None are skipped.

Virtual pipeline files hold ``model0..N`` (chunk ``v`` of stage ``p`` holds global layers from
``legacy.layout.virtual_layer_offset``); expert-parallel files (``mp_rank_TT_PPP_EEE``) hold
local experts ``mlp.experts.local_experts.{k}``, global expert ``ep * num_experts / EP + k``.

Optimizer state becomes tensors named like Megatron-Core's sharded optimizer state,
``optimizer.state.{exp_avg,exp_avg_sq,fp32_param}.<global param key>`` (TP-merged like the
parameter), when its mapping to the parameters can be rebuilt from the checkpoint alone
(``legacy.optim``): the non-distributed optimizer ``state_dict`` in ``model_optim_rng.pt``
(param groups matched to the rank's parameters), or ``distrib_optim.pt`` from
``save_parameter_state`` (grad-buffer layout rebuilt from the model and ``args``, checked
against the stored ``numel_unpadded``). Otherwise the reason is in
``extras["optimizer_state_not_mapped"]`` and the state stays an object. ``optimizer``,
``distrib_optim``, ``rng_state`` and ``opt_param_scheduler`` are always listed as objects too.

Metadata is torch-free: each rank file's ``data.pkl`` is unpickled with tensor placeholders
(``_common.load_torch_save_light``) and every chunk points at its storage's byte range inside
the zip (layout ``raw``; a slice of a ``distrib_optim.pt`` flat buffer included). Reads load
(mmap) only the files holding the requested region.
A missing rank file does not stop ``metadata()``: it is listed in ``extras["missing_rank_files"]``
(the affected tensors then lack chunks), in :meth:`LegacyReader.rank_files` and in
:attr:`LegacyReader.problems` (with dtype/shape disagreements between rank copies) for
``validate``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

from ckpt_tool.errors import CorruptCheckpointError, InputError
from ckpt_tool.formats.legacy import layout as L
from ckpt_tool.formats.legacy import optim as _O
from ckpt_tool.formats.legacy import pieces as P
from ckpt_tool.formats.save_dir import resolve_checkpoint_dir
from ckpt_tool.formats.base import Format, Reader, register
from ckpt_tool.model import CheckpointMeta, ChunkRef, ObjectMeta, TensorMeta

__all__ = ["LegacyReader", "LEGACY", "rank_dirs"]

MODEL_FILE = "model_optim_rng.pt"
DISTRIB_OPTIM_FILE = "distrib_optim.pt"
_OBJECT_KEYS = ("optimizer", "opt_param_scheduler", "rng_state")
_LRU_FILES = 4
OPTIM_PREFIX = "optimizer.state."


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
        self._sources: dict[str, P.Sources] = {}  # global key -> chunk sources
        self._files: OrderedDict[str, Any] = OrderedDict()
        self._light: dict[str, Any] = {}  # rank dir -> light-loaded model_optim_rng.pt
        self.problems: list[dict[str, Any]] = []

    # -- metadata ---------------------------------------------------------------------------

    def rank_files(self) -> dict[str, list[str]]:
        """``{"expected": [...], "present": [...], "missing": [...], "unreadable": [...],
        "distrib_optim": [...]}``: the per-rank files (relative paths) the TP×PP×EP layout
        from ``args`` calls for, and what was found (for ``validate``)."""
        e = self.metadata().extras
        present = list(e["rank_files"])
        return {"expected": sorted(present + e["missing_rank_files"] + e["unreadable_rank_files"]),
                "present": present, "missing": list(e["missing_rank_files"]),
                "unreadable": list(e["unreadable_rank_files"]),
                "distrib_optim": list(e["distrib_optim_files"])}

    def metadata(self) -> CheckpointMeta:
        """Every merged global tensor (model, and optimizer state where its mapping to the
        parameters is exact), the rank files' objects and the args summary."""
        if self._meta is not None:
            return self._meta
        from ckpt_tool.formats.common_state import jsonable, load_torch_save_light, summarize_common

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
        self._light = present
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
        num_layers = _get(args, "num_layers")
        model_keys = L.model_keys(first)
        offsets = self._stage_offsets(present, ranks, args, num_layers, pp_size)
        n_experts = _get(args, "num_experts")

        pieces: dict[str, list[P.Piece]] = {}
        objects: list[ObjectMeta] = []
        optim_status: dict[str, str] = {}
        for name in sorted(present):
            tp, pp, ep = ranks.get(name, (0, 0, 0))
            state, rel = present[name], f"{name}/{MODEL_FILE}"
            storages = self._zip(rel)
            expert_off = ep * (n_experts // ep_size) if n_experts else 0
            chunk_params: list[list[_O.Param]] = []
            to_global: dict[str, str] = {}
            for ci, mk in enumerate(model_keys):
                sd = state.get(mk) if isinstance(state, dict) else None
                params: list[_O.Param] = []
                chunk_params.append(params)
                if not isinstance(sd, dict):
                    continue
                if mk == "model":
                    layer_off = offsets[pp]
                elif not num_layers:
                    raise CorruptCheckpointError(
                        "virtual pipeline (model0..N keys) but no args.num_layers to place the "
                        "layers", path=self.root / rel)
                else:
                    layer_off = L.virtual_layer_offset(
                        num_layers, pp_size, _get(args, "virtual_pipeline_model_parallel_size")
                        or len(model_keys), pp, ci)
                for k, v in sd.items():
                    d = P.describe(v)
                    if d is None or str(k).endswith("_extra_state"):
                        continue
                    gk = L.globalize_key(str(k), layer_off, expert_off)
                    # chunk-qualified local key: VPP chunks repeat local names
                    lk = f"{mk}\0{k}"
                    params.append((lk, d[1], d[0]))
                    to_global[lk] = gk
                    pieces.setdefault(gk, []).append(
                        P.make_piece(self.root, tp, rel, v, (mk, k), storages))
            status = self._optimizer_pieces(name, state, chunk_params, to_global, args, tp, pp,
                                            storages, pieces)
            if status:
                optim_status[name] = status
            for ok in _OBJECT_KEYS:
                if isinstance(state, dict) and ok in state:
                    objects.append(ObjectMeta(key=ok, unique_key=f"{ok}/{name}", file=rel))
            if (self.root / name / DISTRIB_OPTIM_FILE).is_file():
                objects.append(ObjectMeta(key="distrib_optim",
                                          unique_key=f"distrib_optim/{name}",
                                          file=f"{name}/{DISTRIB_OPTIM_FILE}"))

        tensors: dict[str, TensorMeta] = {}
        unknown: list[str] = []
        etp = _get(args, "expert_tensor_parallel_size")
        for gk in sorted(pieces):
            tm, self._sources[gk], problems = P.merge_pieces(gk, pieces[gk], tp_size, swiglu,
                                                             etp)
            self.problems.extend(problems)
            if tm is None:
                unknown.append(gk)
            else:
                tensors[gk] = tm

        common = summarize_common(first) if isinstance(first, dict) else {}
        n_opt = sum(1 for k in tensors if k.startswith(OPTIM_PREFIX))
        extras = {
            "tp": tp_size, "pp": pp_size, "ep": ep_size,
            "rank_files": sorted(f"{n}/{MODEL_FILE}" for n in present),
            "missing_rank_files": missing,
            "unreadable_rank_files": unreadable,
            "distrib_optim_files": sorted(o.file for o in objects if o.key == "distrib_optim"),
            "virtual_pipeline": model_keys if model_keys != ["model"] else None,
            "unmerged": unknown,
            "optimizer_state": (f"{n_opt} tensors ({OPTIM_PREFIX}<state>.<param key>)"
                                if n_opt else "none as tensors"),
            "optimizer_state_not_mapped": optim_status,
        }
        if isinstance(first, dict) and "args" in first:
            extras["args"] = jsonable(first["args"])
        version = first.get("checkpoint_version") if isinstance(first, dict) else None
        self._meta = CheckpointMeta(format=self.format_name, root=str(self.root),
                                    tensors=tensors, objects=tuple(objects), common=common,
                                    extras=extras,
                                    version=None if version is None else str(version))
        return self._meta

    def _zip(self, rel: str) -> Any:
        from ckpt_tool.formats.torch_save_files import zip_storages as _zip_info

        return _zip_info(self.root / rel)

    def _optimizer_pieces(self, name: str, state: Any, chunk_params: list[list[_O.Param]],
                          to_global: dict[str, str], args: Any, tp: int, pp: int,
                          storages: Any, pieces: dict[str, list[P.Piece]]) -> str | None:
        """Add the optimizer state tensors of one rank; returns why they stay objects."""
        from ckpt_tool.formats.common_state import load_torch_save_light

        dist = self.root / name / DISTRIB_OPTIM_FILE
        optim = state.get("optimizer") if isinstance(state, dict) else None
        if dist.is_file():
            rel = f"{name}/{DISTRIB_OPTIM_FILE}"
            try:
                obj = load_torch_save_light(dist, trust=self.trust)
            except CorruptCheckpointError as exc:
                self.problems.append({"message": f"unreadable: {exc.message}", "file": rel})
                return f"{DISTRIB_OPTIM_FILE} unreadable"
            locs, why = _O.distrib_locations(obj, chunk_params, args, pp)
            src, dstor = obj, self._zip(rel)
        elif optim is not None:
            rel, dstor, src = f"{name}/{MODEL_FILE}", storages, state
            locs, why = _O.nondist_locations(optim, chunk_params, args)
        else:
            return None
        if why:
            return why
        shapes = {p[0]: p[1] for ps in chunk_params for p in ps}
        for sname, lk, path, flat in locs:
            t = P.walk(src, path)
            shape = shapes[lk]
            gk = f"{OPTIM_PREFIX}{sname}.{to_global[lk]}"
            pieces.setdefault(gk, []).append(
                P.make_piece(self.root, tp, rel, t, path, dstor, flat,
                             shape if flat is not None else None))
        return None

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

    # -- reads ------------------------------------------------------------------------------

    def _load_file(self, rel: str) -> Any:
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
            from ckpt_tool.formats.safe_pickle import load_torch_file

            state = load_torch_file(path, trust=self.trust)
        except (RuntimeError, EOFError, zipfile.BadZipFile) as exc:
            raise CorruptCheckpointError(f"cannot load {rel} ({exc})", path=self.root) from None
        self._files[rel] = state
        while len(self._files) > _LRU_FILES:
            self._files.popitem(last=False)
        return state

    def read(self, key: str, slices: tuple[slice, ...] | None = None) -> Any:
        """The merged global tensor ``key`` (or ``slices`` of it); loads (mmap) only the rank
        files holding the requested region."""
        from ckpt_tool.formats.dcp_items import assemble

        meta = self._tensor_meta(key)
        sources = self._sources[key]

        def load(chunk: ChunkRef) -> Any:
            p, rows = sources[chunk]
            t = P.walk(self._load_file(p.rel), p.path)
            if p.flat is not None:
                t = t[p.flat:p.flat + math.prod(p.shape)].view(p.shape)
            return t if rows is None else t[rows[0]:rows[1]]

        return assemble(meta, slices, load)

    def read_object(self, unique_key: str) -> Any:
        """``optimizer/<rank dir>``, ``rng_state/…``, ``opt_param_scheduler/…`` or the whole
        ``distrib_optim/<rank dir>`` file."""
        o = self._object_meta(unique_key)
        if o.key == "distrib_optim":
            return self._load_file(str(o.file))
        return self._load_file(str(o.file))[o.key]

    def _common_state(self, load: Callable[[str], Any]) -> dict[str, Any]:
        """The common state: the first rank file's top level without the model (``args`` as a
        dict), the optimizer without its tensors, and the per-rank values (``rng_state``)
        keyed by rank directory."""
        meta = self.metadata()
        files = meta.extras["rank_files"]
        first = load(files[0])
        out: dict[str, Any] = {}
        for k, v in first.items():
            if L.is_model_key(k):
                continue
            if k == "args" and hasattr(v, "__dict__"):
                v = dict(vars(v))
            elif k == "optimizer":
                v = _O.optimizer_skeleton(v)
            out[str(k)] = v
        if "rng_state" in first:
            out["rng_state"] = {f.split("/")[0]: load(f).get("rng_state") for f in files}
        return out

    def common(self) -> dict[str, Any]:
        """The full common state (see ``_common_state``), loaded with torch (mmap)."""
        return self._common_state(self._load_file)

    def _common_light(self, objects: list[ObjectMeta]) -> dict[str, Any]:
        """The same as :meth:`common`, torch-free (tensors as placeholders): for
        ``ckpt inspect --common``."""
        self.metadata()
        return self._common_state(lambda rel: self._light[rel.split("/")[0]])

    def close(self) -> None:
        """Drop the cached rank files."""
        self._files.clear()


LEGACY = register(Format(
    name="legacy", sniff=sniff, open=LegacyReader,
    description="Megatron-LM legacy checkpoint (--ckpt-format torch): mp_rank_*/model_optim_rng.pt"))
