"""torchrun worker: the REAL Megatron-Core GPTModel with Multi-Latent Attention, dense-then-MoE
layers and MTP (``fixtures/_mcore_mla.py``'s build: Megatron-Core's own local specs, its
documented CPU stand-ins) for the DeepSeek-V3 Hugging Face tests.

    torchrun --nproc-per-node 4 _hf_mla_worker.py SPEC.json

SPEC: ``{"jobs": [job, ...]}``, each at its own ``tp`` and ``ep`` (expert TP 1; the ranks left
over are data-parallel). A job: ``config`` (``MLATransformerConfig`` fields, from the ``args``
a conversion wrote, or for ``save`` the model to save), ``vocab`` (padded), ``vocab_out`` (the
columns written), ``seq``, ``mtp``, ``tokens``, ``mode``, ``ckpt``, ``out``:

* ``load``: every parameter NaN, then ``ckpt`` loaded as Megatron-LM loads: the model's
  complete sharded state dict (``_extra_state`` objects included) through
  ``dist_checkpointing.load`` at Megatron-LM's default strictness (``assume_ok_unexpected``),
  then ``load_state_dict(strict=True)``; fails if a parameter was not loaded;
* ``save``: seeded values (``_mcore_mla.fill``), the routers' ``expert_bias`` buffers seeded
  too (so that a lost bias shows in the logits), saved as Megatron-LM saves (``args`` with
  Megatron-LM's names, ``iteration``, ``model``) with ``dist_checkpointing.save``.

Then the fp32 logits for ``tokens`` (eval mode, gathered over TP), written by rank 0 to ``out``
(with ``mtp``: of the same values in a model without the MTP layer, which Megatron-Core 0.16.1
runs only with labels; it does not change the main logits).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "fixtures"))
BUILD = ARGS = None  # another model's build and args (``_hf_moe_worker.py``); else MLA's


def run_job(job: dict) -> None:
    import torch

    import _mcore_mla as M
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    build = BUILD or M.build
    tp, ep = job["tp"], job["ep"]
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    model = build(tp, 1, ep, torch.float32, parallel_output=False, mtp=job["mtp"],
                    vocab=job["vocab"], seq=job["seq"], **job["config"])
    if job["mode"] == "save":
        M.fill(model, seed=job.get("seed", 0))
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name.endswith("expert_bias"):
                    g = torch.Generator().manual_seed(len(name) + 7)
                    b.copy_(torch.randn(b.shape, generator=g) * 0.3)
        world = torch.distributed.get_world_size()
        args = (ARGS or M.args)(tp, 1, world // tp, ep, torch.float32, **job["args"])
        state = {"args": args, "checkpoint_version": 3.0, "iteration": 10,
                 "model": model.sharded_state_dict()}
        if torch.distributed.get_rank() == 0:
            os.makedirs(job["ckpt"], exist_ok=True)
        torch.distributed.barrier()
        dist_checkpointing.save(state, job["ckpt"])
    else:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, job["ckpt"],
                                         strict="assume_ok_unexpected")
        model.load_state_dict(loaded["model"], strict=True)
        bad = [n for n, p in model.named_parameters() if torch.isnan(p).any()]
        if bad:
            raise RuntimeError(f"{job['name']}: not loaded: {bad}")
    if job["mtp"]:  # Megatron-Core 0.16.1 runs MTP layers only with labels (then returning
        # losses), as _mcore_mla.logits: the same values in a model without them
        ref = build(tp, 1, ep, torch.float32, parallel_output=False, mtp=False,
                      vocab=job["vocab"], seq=job["seq"], **job["config"])
        with torch.no_grad():
            got = dict(model.named_parameters())
            for name, p in ref.named_parameters():
                p.copy_(got[name])
            bufs = dict(model.named_buffers())
            for name, b in ref.named_buffers():
                b.copy_(bufs[name])
        model = ref
    ids = torch.tensor(job["tokens"])
    s = ids.shape[1]
    position_ids = torch.arange(s).unsqueeze(0).expand_as(ids)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    model.eval()
    with torch.no_grad():
        out = model(ids, position_ids, mask)
    if torch.distributed.get_rank() == 0:
        torch.save(out[..., : job["vocab_out"]].float().clone(), job["out"])
    torch.distributed.barrier()


def main() -> int:
    import torch

    import _mcore_cpu as H

    spec = json.loads(open(sys.argv[1]).read())
    H.patch_cuda_for_cpu()
    torch.distributed.init_process_group(backend="gloo")
    for job in spec["jobs"]:
        run_job(job)
        if torch.distributed.get_rank() == 0:
            print("done:", job["name"], flush=True)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
