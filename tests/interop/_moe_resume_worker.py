"""torchrun worker: the REAL Megatron-Core builds the tiny (MoE or dense) GPT of FIXTURE (default
``mcore016_moe_ep2_distopt_buckets``; bf16, DDP, the chained DistributedOptimizer) at
a target layout and resumes from CKPT exactly as Megatron-LM does
(``_mcore_resume.load_as_megatron_lm``). On every rank, every fp32 main parameter, ``exp_avg``
and ``exp_avg_sq`` slice the optimizers hold (each chained optimizer's own ``gbuf_ranges``) must
be bit-identical to the fixture's expected per-parameter state, and every bf16 model parameter
must equal its expected main parameter rounded to bf16.

    torchrun --nproc-per-node N _moe_resume_worker.py TP PP EP CKPT [FIXTURE] [--verify-integrity]
        [--model-only] [--drop-redundant-extra-state]

FIXTURE's ``generate.py`` provides ``init(tp, pp, ep)`` and ``build(tp, pp, ep)`` (no virtual
pipeline at the target), optionally ``load(ckpt, gpt, model, optimizer)`` (a framework's own
resume, e.g. NeMo 2's; default Megatron-LM's) and ``tp_local(p, full, default)`` (this rank's
part of a parameter whose TP split is not one contiguous block, e.g. Mamba's ``in_proj``;
``default`` is :func:`tp_local`), and its ``expected/optim.safetensors`` the per-parameter state.
The Megatron-Core is the installed one, or with ``$CKPT_MEGATRON_SRC`` the ``megatron/core``
source tree it names (0.19's: ``fixtures/_mcore_cpu.megatron_core_from_source``);
``--verify-integrity`` loads as Megatron-LM 0.18+'s ``--verify-integrity`` does (``integrity.json``
checked first). ``--model-only``: CKPT holds no optimizer state (``reshard --drop-optimizer``);
the model loads alone (Megatron-LM's ``--no-load-optim``) and only its parameters are compared.
``--drop-redundant-extra-state``: the load request as Megatron-LM main's
``--ckpt-drop-redundant-extra-state`` makes it (``$CKPT_MEGATRON_SRC``: main's source).
A generate.py with ``buffer_names(gpt)`` ({TP1 name: buffer}, e.g. the routers' ``expert_bias``)
has its saved buffers compared with ``expected/buffers.safetensors`` too.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys

os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VERIFY_INTEGRITY = "--verify-integrity" in sys.argv
MODEL_ONLY = "--model-only" in sys.argv
DROP_EXTRA_STATE = "--drop-redundant-extra-state" in sys.argv
ARGS = [a for a in sys.argv if a not in ("--verify-integrity", "--model-only",
                                         "--drop-redundant-extra-state")]
FIXTURE = os.path.join(REPO, "fixtures", ARGS[5] if len(ARGS) > 5
                       else "mcore016_moe_ep2_distopt_buckets")
sys.path.insert(0, os.path.join(REPO, "fixtures"))


def _generator():
    spec = importlib.util.spec_from_file_location("moe_fixture",
                                                  os.path.join(FIXTURE, "generate.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tp_local(p, full):
    """The part of the TP1 tensor ``full`` that tensor-parallel rank r holds of ``p``, by
    Megatron-Core's own attributes (``tensor_model_parallel``, ``partition_dim``); a gated
    ``linear_fc1`` (``weight``/``bias``, grouped experts' ``weight{k}``/``bias{k}``) holds its
    rank's part of each GLU half."""
    import torch

    if not getattr(p, "tensor_model_parallel", False) or p.shape == full.shape:
        return full
    dim = p.partition_dim
    n = p.shape[dim]
    tp = full.shape[dim] // n
    r = p._tp_rank
    if p._glu:
        halves = full.chunk(2, dim=dim)
        return torch.cat([h.narrow(dim, r * n // 2, n // 2) for h in halves], dim=dim)
    assert tp * n == full.shape[dim]
    return full.narrow(dim, r * n, n)


def _drop_redundant_extra_state():
    """Megatron-LM main's ``--ckpt-drop-redundant-extra-state`` on the load request: its
    ``_localize_redundant_extra_states`` from ``megatron/training/checkpointing.py`` of
    ``$CKPT_MEGATRON_SRC`` (``_mcore_main.training_functions``)."""
    from pathlib import Path

    import torch
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedObject

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _mcore_main import training_functions

    names = ("_FP8_PERSISTENT_EXTRA_STATE_MARKERS", "_fp8_extra_state_is_persistent",
             "_localize_redundant_extra_states")
    found = training_functions(Path(os.environ["CKPT_MEGATRON_SRC"]), names, {
        "torch": torch, "ShardedObject": ShardedObject,
        "LocalNonpersistentObject": LocalNonpersistentObject,
        "dict_list_map_inplace": dict_list_map_inplace})
    return found["_localize_redundant_extra_states"]


def main() -> int:
    import _mcore_cpu as H

    if os.environ.get(H.MEGATRON_SRC_ENV):
        H.megatron_core_from_source("core_v0.19.0")
    import torch
    from safetensors.torch import load_file

    import _mcore_resume as R

    tp, pp, ep, ckpt = int(ARGS[1]), int(ARGS[2]), int(ARGS[3]), ARGS[4]
    gen = _generator()
    gen.init(tp, pp, ep)
    gpt, _model, optimizer, names = gen.build(tp, pp, ep)
    buffers = gen.buffer_names(gpt) if hasattr(gen, "buffer_names") else {}
    with torch.no_grad():
        for p in gpt.parameters():
            p.fill_(float("nan"))
        for b in buffers.values():
            b.fill_(float("nan"))
    hook = _drop_redundant_extra_state() if DROP_EXTRA_STATE else None
    if MODEL_ONLY:
        optimizer = None
        R.load_as_megatron_lm(ckpt, gpt, None, verify_integrity=VERIFY_INTEGRITY,
                              request_hook=hook)
    elif hasattr(gen, "load"):  # the framework's own resume (NeMo 2: the wrapped model's keys)
        gen.load(ckpt, gpt, _model, optimizer)
    else:
        R.load_as_megatron_lm(ckpt, gpt, optimizer, verify_integrity=VERIFY_INTEGRITY,
                              request_hook=hook)
    from megatron.core import parallel_state as ps

    for p, name in names.items():
        expert = not getattr(p, "allreduce", True)
        p._tp_rank = (ps.get_expert_tensor_parallel_rank() if expert
                      else ps.get_tensor_model_parallel_rank())
        p._glu = re.search(r"linear_fc1\.(weight|bias)\d*$", name) is not None
        p._name = name
    full = load_file(os.path.join(FIXTURE, "expected", "optim.safetensors"))
    if hasattr(gen, "tp_local"):
        def local(p, t):
            return gen.tp_local(p, t, tp_local)
    else:
        local = tp_local
    expected = {f"{s}.{name}": local(p, full[f"{s}.{name}"]).contiguous()
                for p, name in names.items() for s in ("fp32_param", "exp_avg", "exp_avg_sq")}
    errors: list[str] = []
    for p, name in names.items():
        want = expected[f"fp32_param.{name}"]
        if p.shape != want.shape or not torch.equal(p.detach(), want.to(p.dtype)):
            errors.append(f"model {name}")
    if buffers:
        want_buffers = load_file(os.path.join(FIXTURE, "expected", "buffers.safetensors"))
        assert sorted(want_buffers) == sorted(buffers), (sorted(want_buffers), sorted(buffers))
        for name, b in buffers.items():
            if b.dtype != want_buffers[name].dtype or not torch.equal(b, want_buffers[name]):
                errors.append(f"buffer {name}")
    checked = 0
    chained = optimizer.chained_optimizers if optimizer is not None else []
    for o in chained:
        for gbuf_range_maps in o.gbuf_ranges:
            for maps in gbuf_range_maps.values():
                for bucket_map in maps:
                    for model_param, prm in bucket_map["param_map"].items():
                        r = prm["param"]
                        got = o._get_main_param_and_optimizer_states(model_param)
                        for k in ("param", "exp_avg", "exp_avg_sq"):
                            key = f"{'fp32_param' if k == 'param' else k}.{names[model_param]}"
                            want = expected[key].reshape(-1)[r.start:r.end]
                            g = got[k].detach().reshape(-1)
                            if g.dtype != torch.float32 or not torch.equal(g, want):
                                errors.append(f"optimizer {key}[{r.start}:{r.end}]")
                            checked += g.numel()
    rank = torch.distributed.get_rank()
    if errors or not (checked or MODEL_ONLY):
        print(f"rank {rank}: {len(errors)} differences: {errors[:6]}", file=sys.stderr)
        return 1
    from megatron.core import package_info

    print(f"rank {rank}: OK {len(names)} parameters, {len(buffers)} buffers, "
          f"{len(chained)} optimizers, {checked} "
          f"optimizer elements bit-identical (megatron-core {package_info.__version__})")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    from ckpt_tool._torchrun import exit_cleanly

    exit_cleanly(main())
