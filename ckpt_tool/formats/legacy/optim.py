"""Pure rules mapping Megatron-LM legacy optimizer state back to parameters (no I/O, no torch).

Two layouts (docs/formats.md section 4):

* Non-distributed optimizer (``optimizer`` in ``model_optim_rng.pt``): a torch optimizer
  ``state_dict`` whose ``state`` is keyed by parameter index. Megatron-Core numbers the
  parameters group by group (``param_groups[i]["params"]``); each group holds, in
  ``named_parameters`` order over the model chunks, the parameters whose group attributes
  (``wd_mult``, ``is_expert_parallel``, ``is_decoupled_lr``) match. :func:`assign_param_ids`
  rebuilds that numbering from the rank's parameter list and the saved groups.
* Distributed optimizer (``distrib_optim.pt``, ``save_parameter_state``): per grad buffer one
  flat fp32 tensor per state (``param``, ``exp_avg``, ``exp_avg_sq``) holding every bucket's
  unpadded range back to back. :func:`buffer_slots` rebuilds where each parameter sits: the
  buffer takes the parameters in reverse order, each start padded to 64 elements, a new
  bucket once a bucket reaches ``bucket_size`` elements.

A parameter is ``(key, shape, dtype)`` with the rank-local model key.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

__all__ = ["Param", "MAIN_PARAM", "is_expert_param", "no_weight_decay", "assign_param_ids",
           "ddp_bucket_size", "buffer_groups", "buffer_slots", "nondist_locations",
           "distrib_locations", "optimizer_skeleton"]

Param = tuple[str, tuple[int, ...], str]
_PARAM_ALIGN = 64  # Megatron-Core pads each parameter's start to 64 elements (dist. optimizer)
# Name of the fp32 main parameter copy: Megatron-Core's sharded name for the Float16Optimizer
# and the dp_reshardable / fully_sharded_model_space distributed optimizer formats
# (fully_reshardable dist checkpoints call it ``param``).
MAIN_PARAM = "fp32_param"


def is_expert_param(key: str) -> bool:
    """Routed-expert parameters (``allreduce=False``); shared experts and the router are not."""
    return ".mlp.experts." in key


def no_weight_decay(key: str, shape: Sequence[int], apply_wd_to_qk_layernorm: bool) -> bool:
    """Megatron-Core's standard override: biases and 1-D parameters get ``wd_mult`` 0."""
    skip = len(shape) == 1 or key.endswith(".bias")
    if apply_wd_to_qk_layernorm and ("q_layernorm." in key or "k_layernorm." in key):
        return False
    return skip


def _is_embedding_or_output(key: str) -> bool:
    return key.endswith(("embedding.word_embeddings.weight", "output_layer.weight",
                         "embedding.position_embeddings.weight"))


def _group_matches(group: dict[str, Any], key: str, shape: Sequence[int], args: Any) -> bool:
    wd = 0.0 if no_weight_decay(key, shape, bool(getattr(args, "apply_wd_to_qk_layernorm",
                                                         False))) else 1.0
    if float(group.get("wd_mult", 1.0)) != wd:
        return False
    if bool(group.get("is_expert_parallel", False)) != is_expert_param(key):
        return False
    decoupled = getattr(args, "decoupled_lr", None) is not None and _is_embedding_or_output(key)
    return bool(group.get("is_decoupled_lr", False)) == decoupled


def assign_param_ids(params: Sequence[Param], param_groups: Sequence[dict[str, Any]],
                     args: Any) -> tuple[dict[int, Param], str | None]:
    """``{param index: param}`` for one torch optimizer ``state_dict``, or ``({}, why)`` when
    the saved groups cannot be matched exactly (count or attribute mismatch).

    ``params`` is every trainable parameter of the rank in ``named_parameters`` order over the
    model chunks; parameters matching no group belong to another chained optimizer.
    """
    out: dict[int, Param] = {}
    taken: set[int] = set()
    for gi, group in enumerate(param_groups):
        ids = list(group.get("params") or [])
        members = [i for i, (k, s, _) in enumerate(params)
                   if i not in taken and _group_matches(group, k, s, args)]
        if len(members) != len(ids):
            return {}, (f"param group {gi} lists {len(ids)} parameters, the model has "
                        f"{len(members)} matching its attributes")
        for pid, i in zip(ids, members):
            out[int(pid)] = params[i]
            taken.add(i)
    return out, None


def ddp_bucket_size(args: Any, *, pp_rank: int, chunk: int) -> int | None:
    """The grad bucket size Megatron-LM gives DDP for one model chunk (None: one bucket)."""
    if not getattr(args, "overlap_grad_reduce", False):
        return None
    if pp_rank > 0 or chunk > 0 or getattr(args, "overlap_param_gather_with_optimizer_step",
                                           False):
        return None
    size = getattr(args, "ddp_bucket_size", None)
    if size is None:
        dp = int(getattr(args, "data_parallel_size", None) or 1)
        size = max(40_000_000, 1_000_000 * dp)
    return int(size)


def buffer_groups(chunk_params: Sequence[Sequence[Param]], *, expert: bool
                  ) -> list[tuple[int, str, list[Param]]]:
    """The grad buffers one DistributedOptimizer owns, in ``gbuf_idx`` order:
    ``(chunk index, param dtype, params)`` per model chunk and param dtype (first seen first)."""
    out = []
    for ci, params in enumerate(chunk_params):
        by_dtype: dict[str, list[Param]] = {}
        for p in params:
            if is_expert_param(p[0]) == expert:
                by_dtype.setdefault(p[2], []).append(p)
        out.extend((ci, dt, ps) for dt, ps in by_dtype.items())
    return out


def buffer_slots(params: Sequence[Param], bucket_size: int | None,
                 shared_embedding: Sequence[str] = ()) -> tuple[dict[str, int], int]:
    """``({param key: start in the coalesced world tensor}, numel_unpadded)`` of one buffer.

    Bucket-end padding is dropped by ``save_parameter_state`` (each bucket contributes its
    unpadded range), the 64-element start padding inside a bucket is kept. Bucket ends are
    multiples of 128 elements, so the result does not depend on the data-parallel size.
    """
    def pad(n: int, d: int) -> int:
        return int(math.ceil(n / d) * d)

    starts: dict[str, tuple[int, int]] = {}  # key -> (absolute start, bucket id)
    bucket_starts, unpadded = [0], []
    start, n_in_bucket = 0, 0
    for key, shape, _ in reversed(params):
        numel = math.prod(shape)
        start = pad(start, _PARAM_ALIGN)
        own_bucket = key in shared_embedding
        if own_bucket and n_in_bucket:
            unpadded.append(start - bucket_starts[-1])
            start = pad(start, 128)
            bucket_starts.append(start)
            n_in_bucket = 0
        end = start + numel
        starts[key] = (start, len(bucket_starts) - 1)
        n_in_bucket += 1
        if (bucket_size is not None and end - bucket_starts[-1] >= bucket_size) or own_bucket:
            unpadded.append(end - bucket_starts[-1])
            start = pad(end, 128)
            bucket_starts.append(start)
            n_in_bucket = 0
        else:
            start = end
    if n_in_bucket:
        unpadded.append(end - bucket_starts[-1])
    before = [sum(unpadded[:i]) for i in range(len(unpadded))]
    return ({k: before[b] + s - bucket_starts[b] for k, (s, b) in starts.items()},
            sum(unpadded))


# -- locating the state tensors in the loaded objects ----------------------------------------
# A location is ``(state name, local param key, path, flat start or None)``: ``path`` walks the
# loaded object from the file's top level (an ``("#", i)`` step takes the i-th dict value:
# buffer dicts are keyed by torch dtype tuples); ``flat start`` slices a coalesced 1-D tensor.

Location = tuple[str, str, tuple[Any, ...], "int | None"]


def _dtype(x: Any) -> str:
    return str(getattr(x, "dtype", x)).replace("torch.", "")


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in getattr(x, "shape", ()))


def nondist_locations(optim: Any, chunk_params: Sequence[Sequence[Param]], args: Any
                      ) -> tuple[list[Location], str | None]:
    """Where each parameter's ``exp_avg``/``exp_avg_sq`` (and, for Float16Optimizer, the fp32
    main copy ``fp32_param``) lives in a non-distributed optimizer ``state_dict``."""
    params = [p for ps in chunk_params for p in ps]
    subs = optim if isinstance(optim, list) else [optim]
    out: list[Location] = []
    for si, sub in enumerate(subs):
        sub_base: tuple[Any, ...] = ("optimizer",) + ((si,) if isinstance(optim, list) else ())
        base = sub_base
        if not isinstance(sub, dict):
            return [], f"optimizer state {si} is a {type(sub).__name__}"
        inner, fp32_groups = sub, None
        if "state" not in sub and isinstance(sub.get("optimizer"), dict):
            inner, base = sub["optimizer"], base + ("optimizer",)
            fp32_groups = sub.get("fp32_from_fp16_params")
        state, groups = inner.get("state"), inner.get("param_groups")
        if not isinstance(state, dict) or not isinstance(groups, list):
            return [], "no per-parameter state (a distributed optimizer keeps it in distrib_optim.pt)"
        ids, why = assign_param_ids(params, groups, args)
        if why:
            return [], why
        for pid, (key, shape, _) in ids.items():
            entry = state.get(pid)
            if not isinstance(entry, dict):
                continue  # no state yet (parameter never stepped)
            for name in ("exp_avg", "exp_avg_sq"):
                t = entry.get(name)
                if t is None:
                    continue
                if _shape(t) != tuple(shape):
                    return [], f"{name} of parameter {pid} has shape {_shape(t)}, {key} {shape}"
                out.append((name, key, base + ("state", pid, name), None))
        if fp32_groups is not None:
            if len(fp32_groups) != len(groups):
                return [], "fp32_from_fp16_params does not have one list per param group"
            for gi, (group, mains) in enumerate(zip(groups, fp32_groups)):
                half = [ids[int(p)] for p in group["params"]
                        if ids[int(p)][2] in ("bfloat16", "float16")]
                if len(half) != len(mains):
                    return [], (f"param group {gi}: {len(mains)} fp32 main params for "
                                f"{len(half)} half-precision parameters")
                for j, ((key, shape, _), t) in enumerate(zip(half, mains)):
                    if _shape(t) != tuple(shape):
                        return [], f"fp32 main param {gi}/{j} has shape {_shape(t)}, {key} {shape}"
                    out.append((MAIN_PARAM, key,
                                sub_base + ("fp32_from_fp16_params", gi, j), None))
    return out, None


def distrib_locations(state: Any, chunk_params: Sequence[Sequence[Param]], args: Any,
                      pp_rank: int) -> tuple[list[Location], str | None]:
    """Where each parameter's ``param`` (named ``fp32_param``), ``exp_avg``, ``exp_avg_sq``
    lives in a ``distrib_optim.pt`` written by ``save_parameter_state`` (coalesced buckets)."""
    subs = state if isinstance(state, list) else [state]
    if len(subs) > 2:
        return [], f"{len(subs)} chained optimizer states (expected dense [+ expert])"
    shared = () if getattr(args, "untie_embeddings_and_output_weights", True) or \
        int(getattr(args, "pipeline_model_parallel_size", 1) or 1) == 1 else \
        tuple(p[0] for ps in chunk_params for p in ps if _is_embedding_or_output(p[0])
              and "position_embeddings" not in p[0])
    out: list[Location] = []
    for si, sub in enumerate(subs):
        base: tuple[Any, ...] = (si,) if isinstance(state, list) else ()
        if sub is None:
            continue
        if not isinstance(sub, dict) or not sub.get("buckets_coalesced"):
            return [], "not the coalesced-bucket layout of save_parameter_state (older Megatron)"
        buffers = buffer_groups(chunk_params, expert=si == 1)
        stored = sorted(k for k in sub if isinstance(k, int))
        if stored != list(range(len(buffers))):
            return [], f"{len(stored)} grad buffers stored, the model gives {len(buffers)}"
        for gi, (chunk, dtype, params) in enumerate(buffers):
            by_dtype = sub[gi]
            if not isinstance(by_dtype, dict) or len(by_dtype) != 1:
                return [], f"grad buffer {gi}: expected one (param dtype, grad dtype) entry"
            dkey = next(iter(by_dtype))
            world = by_dtype[dkey]
            pdtype = _dtype(dkey[0]) if isinstance(dkey, tuple) and dkey else _dtype(dkey)
            if pdtype != dtype:
                return [], f"grad buffer {gi} holds {pdtype} params, the model gives {dtype}"
            slots, numel = buffer_slots(
                params, ddp_bucket_size(args, pp_rank=pp_rank, chunk=chunk), shared)
            if world.get("numel_unpadded") != numel:
                return [], (f"grad buffer {gi}: numel_unpadded {world.get('numel_unpadded')}, "
                            f"the bucket layout rebuilt from the model and args gives {numel}")
            for name in ("param", "exp_avg", "exp_avg_sq"):
                t = world.get(name)
                if t is None or _shape(t) != (numel,):
                    return [], f"grad buffer {gi}: {name} is not a 1-D tensor of {numel}"
                for key, _, _ in params:
                    out.append((MAIN_PARAM if name == "param" else name, key,
                                base + (gi, ("#", 0), name), slots[key]))
    return out, None


def optimizer_skeleton(optim: Any) -> Any:
    """The optimizer state without its per-parameter tensors (param groups, grad scaler, ...):
    ``state`` and ``fp32_from_fp16_params`` become a one-line summary."""
    if isinstance(optim, list):
        return [optimizer_skeleton(o) for o in optim]
    if not isinstance(optim, dict):
        return optim
    out: dict[Any, Any] = {}
    for k, v in optim.items():
        if k == "state" and isinstance(v, dict):
            out[k] = f"<per-parameter state of {len(v)} parameters: optimizer.state.* tensors>"
        elif k == "fp32_from_fp16_params" and isinstance(v, list):
            out[k] = (f"<{sum(len(g) for g in v if isinstance(g, list))} fp32 main params: "
                      "optimizer.state.fp32_param.* tensors>")
        else:
            out[k] = optimizer_skeleton(v)
    return out
