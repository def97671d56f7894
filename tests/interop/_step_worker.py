"""torchrun worker: the REAL Megatron-Core resumes the tiny GPT (bf16, DDP, DistributedOptimizer)
from a checkpoint at a layout (pipeline size 1), takes ONE training step on a fixed batch (the
same on every rank) and saves model + optimizer in model space (fully_reshardable). Rank 0
prints the loss of that step.

    torchrun --nproc-per-node N _step_worker.py TP BUCKET_SIZE|0 CKPT OUT
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

    tp, bucket_size, ckpt, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    H.patch_cuda_for_cpu()
    H.init_parallel(tp, 1)
    dp = torch.distributed.get_world_size() // tp
    gpt, model, optimizer = R.build(tp, 1, "distopt", bucket_size=bucket_size or None)
    R.load_as_megatron_lm(ckpt, gpt, optimizer)
    g = torch.Generator().manual_seed(2024)
    seq = gpt.config.hidden_size // 2
    tokens = torch.randint(0, 128, (2, seq + 1), generator=g)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    position_ids = torch.arange(seq).unsqueeze(0).expand(2, seq)
    mask = torch.ones(1, 1, seq, seq).tril() < 0.5
    with H.optimizer_on_cpu():
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = model(inputs, position_ids, mask, labels=labels).float().mean()
        loss.backward()
        model.finish_grad_sync()
        ok, _norm, _zeros = optimizer.step()
        assert ok, "optimizer step skipped"
    R.save(out, tp, 1, dp, "distopt", gpt, optimizer,
           metadata={**R.MEGATRON_LM_METADATA, "distrib_optim_sharding_type": "fully_reshardable"})
    if torch.distributed.get_rank() == 0:
        print(f"LOSS {loss.item()!r}")
    print(f"rank {torch.distributed.get_rank()}: OK stepped")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    from ckpt_tool._torchrun import exit_cleanly

    exit_cleanly(main())
