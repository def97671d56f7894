"""torchrun worker: the REAL Megatron-Core builds the tiny GPT (bf16, DDP, DistributedOptimizer)
at a layout, resumes from a checkpoint as Megatron-LM does, and checks on every rank that each
fp32 main parameter the optimizer now holds rounds exactly to the bf16 model parameter it
loaded (mixed-precision training keeps model = bf16(main)), and that the Adam moments are not a
fresh optimizer's.

    torchrun --nproc-per-node N _distopt_consistency_worker.py TP PP CKPT
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

    tp, pp, ckpt = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    R.sizes_from_checkpoint(ckpt)
    H.patch_cuda_for_cpu()
    H.init_parallel(tp, pp)
    gpt, _model, optimizer = R.build(tp, pp, "distopt")
    R.load_as_megatron_lm(ckpt, gpt, optimizer)
    bad, n, moments = [], 0, 0
    for opt in optimizer.chained_optimizers:
        for model_param, (gi, go) in opt.model_param_group_index_map.items():
            main = opt.optimizer.param_groups[gi]["params"][go]
            rng = opt._get_model_param_range_map(model_param)["param"]
            n += 1
            if not torch.equal(main.detach().bfloat16(),
                               model_param.detach().view(-1)[rng.start:rng.end]):
                bad.append(opt._param_name(model_param))
            moments += int(opt.optimizer.state[main]["exp_avg"].abs().sum() > 0)
    rank = torch.distributed.get_rank()
    if bad or not n or moments == 0:
        print(f"rank {rank}: {len(bad)} of {n} main params do not round to their model params "
              f"{bad[:4]}; {moments} with trained moments", file=sys.stderr)
        return 1
    print(f"rank {rank}: OK {n} main params consistent, {moments} with trained moments")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    from ckpt_tool._torchrun import exit_cleanly

    exit_cleanly(main())
