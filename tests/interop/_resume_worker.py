"""torchrun worker: the REAL Megatron-Core builds the tiny GPT (bf16, DDP, the optimizer KIND) at
a target layout and resumes from checkpoints exactly as Megatron-LM does (content metadata ->
``optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=...)`` -> ``load`` ->
``load_state_dict``). Every model parameter and every optimizer tensor (fp32 main params, Adam
moments) must be bit-identical to what it holds after resuming from REFERENCE.

    torchrun --nproc-per-node N _resume_worker.py TP PP KIND REFERENCE CKPT [CKPT ...]

KIND: modelonly | fp16opt | distopt (see fixtures/_mcore_resume.py). REFERENCE is a checkpoint
Megatron-Core itself resumes from at this layout (e.g. the source of the reshard when its
optimizer state is model space).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "fixtures"))


def main() -> int:
    import torch

    import _mcore_cpu as H
    import _mcore_resume as R

    tp, pp, kind = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    R.sizes_from_checkpoint(sys.argv[4])  # the model the reference holds
    H.patch_cuda_for_cpu()
    H.init_parallel(tp, pp)

    def resume(ckpt: str | None):
        gpt, _model, optimizer = R.build(tp, pp, kind)
        with torch.no_grad():
            for p in gpt.parameters():
                p.fill_(float("nan"))
        if ckpt is None:  # what a fresh optimizer holds before any load
            if optimizer is not None:
                with H.optimizer_on_cpu():
                    for opt in optimizer.chained_optimizers:
                        init = getattr(opt, "_init_optimizer_states_with_dummy_values", None)
                        if init is not None:
                            init()
                        else:
                            opt.init_state_fn(opt.optimizer, opt.config)
        else:
            R.load_as_megatron_lm(ckpt, gpt, optimizer)
        model = {k: v.detach().clone() for k, v in gpt.state_dict().items() if torch.is_tensor(v)}
        return model, R.optimizer_tensors(optimizer)

    errors: list[str] = []
    want_model, want_opt = resume(sys.argv[4])
    errors += [f"reference: {k} not loaded" for k, v in want_model.items()
               if v.is_floating_point() and torch.isnan(v).any()]
    if kind != "modelonly":
        _fresh_model, fresh_opt = resume(None)
        if not want_opt:
            errors.append("reference: the optimizer holds no tensors")
        for (k, v), (_k, f) in zip(want_opt, fresh_opt):
            if ".exp_avg" in k and torch.equal(v, f):
                errors.append(f"reference: {k} equals a fresh optimizer's (not loaded)")
    for ckpt in sys.argv[5:]:
        got_model, got_opt = resume(ckpt)
        name = os.path.basename(ckpt.rstrip("/"))
        for k, v in want_model.items():
            if k not in got_model or got_model[k].shape != v.shape or not torch.equal(
                    got_model[k], v):
                errors.append(f"{name}: model {k}")
        if len(got_opt) != len(want_opt):
            errors.append(f"{name}: {len(got_opt)} optimizer tensors, want {len(want_opt)}")
        for (k, v), (gk, g) in zip(want_opt, got_opt):
            if k != gk or g.shape != v.shape or g.dtype != v.dtype or not torch.equal(g, v):
                errors.append(f"{name}: optimizer {k}")
    rank = torch.distributed.get_rank()
    if errors:
        print(f"rank {rank}: {len(errors)} differences: {errors[:6]}", file=sys.stderr)
        return 1
    print(f"rank {rank}: OK {len(want_model)} parameters, {len(want_opt)} optimizer tensors x "
          f"{len(sys.argv) - 5} checkpoints")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    from ckpt_tool._torchrun import exit_cleanly

    exit_cleanly(main())
