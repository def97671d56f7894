"""torchrun helper of bench_reshard_optim.py: a GPT of HIDDEN width with the real
DistributedOptimizer (Adam, one step) saved by Megatron-Core 0.16.1 in Megatron-LM's default
dp_reshardable form, at TP2 DP(world / 2), DDP buckets of BUCKET elements.

    torchrun --nproc-per-node 2 bench/_make_distopt.py OUT HIDDEN LAYERS BUCKET
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "fixtures"))

if __name__ == "__main__":
    import torch

    import _mcore_cpu as H

    out, hidden, layers, bucket = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    H.HIDDEN, H.FFN, H.NUM_LAYERS, H.VOCAB = hidden, 4 * hidden, layers, 1024
    import _mcore_resume as R

    H.patch_cuda_for_cpu()
    H.init_parallel(2, 1)
    dp = torch.distributed.get_world_size() // 2
    gpt, model, optimizer = R.build(2, 1, "distopt", bucket_size=bucket)
    R.train_steps(gpt, model, optimizer, steps=1)
    R.save(out, 2, 1, dp, "distopt", gpt, optimizer,
           args_extra={"overlap_grad_reduce": True, "ddp_bucket_size": bucket})
    torch.distributed.destroy_process_group()
