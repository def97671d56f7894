"""The metadata of a Megatron-LM legacy checkpoint, gathered from its rank files (torch-free).

:class:`RankFileScan` loads torch-free every ``mp_rank_*/model_optim_rng.pt`` (tensor placeholders,
``common_state.load_torch_free``), places each rank's tensors in the TP=1/PP=1 model by
the rules of ``legacy.layout``, maps the optimizer state to the parameters where
``legacy.optim`` can, and merges the per-rank pieces (``legacy.pieces``) into global tensors
whose chunks point at byte ranges inside the zips. What it finds wrong (missing or unreadable
rank files, copies that disagree) goes to ``problems``; see :mod:`.reader` for the format.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckpt_tool.errors import CorruptCheckpointError
from ckpt_tool.formats.legacy import layout as L
from ckpt_tool.formats.legacy import optim as _O
from ckpt_tool.formats.legacy import pieces as P
from ckpt_tool.model import CheckpointMeta, ObjectMeta, TensorMeta

__all__ = ["RankFileScan", "rank_dirs", "MODEL_FILE", "DISTRIB_OPTIM_FILE", "OPTIM_PREFIX",
           "supply_swiglu", "LAYOUT_ARGS"]

MODEL_FILE = "model_optim_rng.pt"
DISTRIB_OPTIM_FILE = "distrib_optim.pt"
_OBJECT_KEYS = ("optimizer", "opt_param_scheduler", "rng_state")
OPTIM_PREFIX = "optimizer.state."
# the ``args`` fields that decide where each rank's tensors go in the merged model
LAYOUT_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
               "expert_model_parallel_size", "expert_tensor_parallel_size", "swiglu",
               "num_layers", "num_experts", "virtual_pipeline_model_parallel_size",
               "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
SWIGLU_FLAG = "--swiglu/--no-swiglu"
_supplied: dict[str, Any] = {}


def supply_swiglu(value: bool | None) -> None:
    """What the user says (``--swiglu``/``--no-swiglu``) about whether ``linear_fc1`` is a
    gated pair, for rank files whose ``args`` do not say it (None: nothing supplied)."""
    if value is None:
        _supplied.pop("swiglu", None)
    else:
        _supplied["swiglu"] = bool(value)


class _Args:
    """The layout fields of the rank files' ``args``, agreed by all of them."""

    def __init__(self, values: dict[str, Any]):
        self.__dict__.update(values)


def _layout_args(present: dict[str, Any], root: Path) -> tuple[Any, list[str]]:
    """(the ``args`` the layout is read from, the rank files without ``args``). Every rank
    file that has ``args`` must agree on the layout fields (CorruptCheckpointError naming
    the two files and the field otherwise); the layout is the agreed one, with what the
    user supplied for what no rank file says."""
    with_args = {n: s["args"] for n, s in sorted(present.items())
                 if isinstance(s, dict) and s.get("args") is not None}
    without = sorted(n for n in present if n not in with_args)
    if not with_args:
        return (_Args(dict(_supplied)) if _supplied else None), without
    names = list(with_args)
    agreed = {}
    for field in LAYOUT_ARGS:
        first = _get(with_args[names[0]], field)
        for n in names[1:]:
            other = _get(with_args[n], field)
            if other != first:
                raise CorruptCheckpointError(
                    f"the rank files disagree on args.{field}: {first!r} in "
                    f"{names[0]}/{MODEL_FILE}, {other!r} in {n}/{MODEL_FILE}", path=root,
                    hint="the rank files come from different runs: restore the checkpoint")
        agreed[field] = first
    base = with_args[names[0]]
    supplied = {k: v for k, v in _supplied.items() if agreed.get(k) is None}
    if not supplied:
        return base, without
    return _Args({**getattr(base, "__dict__", {}), **agreed, **supplied}), without


def rank_dirs(root: Path) -> list[str]:
    """Names of the ``mp_rank_*`` directories under ``root`` (sorted)."""
    try:
        return sorted(d.name for d in root.iterdir()
                      if d.is_dir() and L.RANK_DIR_RE.match(d.name))
    except OSError:
        return []


def _get(args: Any, name: str) -> Any:
    return getattr(args, name, None) if args is not None else None


class RankFileScan:
    """One pass over the rank files under ``root``: :meth:`metadata`, then ``sources`` (global
    key -> chunk sources, for reads) and ``torch_free`` (rank dir -> torch-free loaded
    ``model_optim_rng.pt``); problems found are appended to ``problems``."""

    def __init__(self, root: Path, *, trust: bool, problems: list[dict[str, Any]]):
        self.root = root
        self.trust = trust
        self.problems = problems
        self.sources: dict[str, P.Sources] = {}
        self.torch_free: dict[str, Any] = {}

    def metadata(self, format_name: str) -> CheckpointMeta:
        """Every merged global tensor (model, and optimizer state where its mapping to the
        parameters is exact), the rank files' objects and the args summary."""
        from ckpt_tool.formats.common_state import jsonable, load_torch_free, summarize_common

        present: dict[str, Any] = {}
        unreadable: list[str] = []
        for name in rank_dirs(self.root):
            if (self.root / name / MODEL_FILE).is_file():
                try:
                    present[name] = load_torch_free(self.root / name / MODEL_FILE,
                                                          trust=self.trust)
                except CorruptCheckpointError as exc:  # reported; the other ranks still load
                    unreadable.append(f"{name}/{MODEL_FILE}")
                    self.problems.append({"message": f"unreadable rank file: {exc.message}",
                                          "file": f"{name}/{MODEL_FILE}"})
        if not present:
            raise CorruptCheckpointError(f"no {MODEL_FILE} in any mp_rank_* directory",
                                         path=self.root)
        self.torch_free = present
        first = present[sorted(present)[0]]
        args, without_args = _layout_args(present, self.root)
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

        swiglu = self._swiglu(args, without_args, present, tp_size)
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
            tm, self.sources[gk], problems = P.merge_pieces(gk, pieces[gk], tp_size, swiglu,
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
        return CheckpointMeta(format=format_name, root=str(self.root), tensors=tensors,
                              objects=tuple(objects), common=common, extras=extras,
                              version=None if version is None else str(version))

    def _swiglu(self, args: Any, without_args: list[str], present: dict[str, Any],
                tp_size: int) -> bool:
        """Whether ``linear_fc1`` is a gated (SwiGLU) pair, from what the rank files say. It
        decides how TP shards of ``linear_fc1`` merge (gate and up halves of each shard, or
        plain rows), which nothing in the tensors shows: a rank file without ``args`` (or
        ``args`` without ``swiglu``) when it matters is CorruptCheckpointError naming the
        flag that supplies it."""
        value = _get(args, "swiglu")
        fc1 = tp_size > 1 and any(
            str(k).endswith(("linear_fc1.weight", "linear_fc1.bias"))
            for state in present.values() if isinstance(state, dict)
            for mk in L.model_keys(state) if isinstance(state.get(mk), dict)
            for k in state[mk])
        if not fc1:
            return bool(value)
        if without_args and "swiglu" not in _supplied:
            files = ", ".join(f"{n}/{MODEL_FILE}" for n in without_args[:3])
            more = f" and {len(without_args) - 3} more" if len(without_args) > 3 else ""
            raise CorruptCheckpointError(
                f"{files}{more} has no args: whether linear_fc1 is a gated (SwiGLU) pair, "
                "which decides how its TP shards merge, is not taken from another rank file "
                "or guessed", path=self.root,
                hint=f"restore the rank file, or say it with {SWIGLU_FLAG}")
        if value is None:
            raise CorruptCheckpointError(
                "the rank files' args do not say whether linear_fc1 is a gated (SwiGLU) pair "
                "(args.swiglu), which decides how its TP shards merge", path=self.root,
                hint=f"say it with {SWIGLU_FLAG}")
        return bool(value)

    def _zip(self, rel: str) -> Any:
        from ckpt_tool.formats.containers.torch_zip.torch_save_files import (
            zip_storages as _zip_info,
        )

        return _zip_info(self.root / rel)

    def _optimizer_pieces(self, name: str, state: Any, chunk_params: list[list[_O.Param]],
                          to_global: dict[str, str], args: Any, tp: int, pp: int,
                          storages: Any, pieces: dict[str, list[P.Piece]]) -> str | None:
        """Add the optimizer state tensors of one rank; returns why they stay objects."""
        from ckpt_tool.formats.common_state import load_torch_free

        dist = self.root / name / DISTRIB_OPTIM_FILE
        optim = state.get("optimizer") if isinstance(state, dict) else None
        if dist.is_file():
            rel = f"{name}/{DISTRIB_OPTIM_FILE}"
            try:
                obj = load_torch_free(dist, trust=self.trust)
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
