"""torchrun worker: the REAL Megatron-Core resumes from a DistributedOptimizer checkpoint at the
layout that wrote it (GPT + DDP with the source's bucket size, Megatron-LM's resume path) and
saves it again in the model-space ``fully_reshardable`` form — the ground truth in model space
of what the source's bucket-space (``dp_reshardable``) state holds.

    torchrun --nproc-per-node N _resave_worker.py TP PP BUCKET_SIZE|0 SOURCE_ITER_DIR OUT_DIR

The GPT takes the sizes of the source's args.
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

    tp, pp, bucket_size = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    src, out = sys.argv[4], sys.argv[5]
    R.sizes_from_checkpoint(src)
    H.patch_cuda_for_cpu()
    H.init_parallel(tp, pp)
    dp = torch.distributed.get_world_size() // (tp * pp)
    gpt, _model, optimizer = R.build(tp, pp, "distopt", bucket_size=bucket_size or None)
    R.load_as_megatron_lm(src, gpt, optimizer)  # Megatron-LM's default strictness
    # Without Apex/TE, loading dp_reshardable leaves each parameter's Adam "step" as the dummy
    # state held (its bucket entry is LocalNonpersistent) and state_dict() then refuses the mixed
    # steps. Steps live in the param groups in every saved form: give every state that one.
    for opt in optimizer.chained_optimizers:
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                state = opt.optimizer.state.get(p)
                if state is not None and "step" in state:
                    state["step"] = torch.tensor(float(group["step"]))
    R.save(out, tp, pp, dp, "distopt", gpt, optimizer,
           metadata={**R.MEGATRON_LM_METADATA, "distrib_optim_sharding_type": "fully_reshardable"})
    print(f"rank {torch.distributed.get_rank()}: OK resaved")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    from ckpt_tool._torchrun import exit_cleanly

    exit_cleanly(main())
