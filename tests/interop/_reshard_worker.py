"""torchrun worker: the REAL Megatron-Core builds the tiny GPT at a target layout and loads
checkpoints into it; every parameter must equal what it loads from the reference checkpoint.

    torchrun --nproc-per-node N _reshard_worker.py TP PP REFERENCE CKPT [CKPT ...]

REFERENCE is a dist checkpoint Megatron-Core itself can load at any layout (the source of the
reshard, e.g. ``fixtures/mcore016_gpt_tp2pp2_fp32``).
"""

from __future__ import annotations

import os
import sys

# Megatron-Core 0.16.1 torch.loads common.pt with torch's default weights_only=True, which
# refuses Megatron-LM's args Namespace; Megatron-LM allowlists it, bare MCore needs this.
os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "fixtures"))


def main() -> int:
    import torch

    import _mcore_cpu as H

    tp, pp = int(sys.argv[1]), int(sys.argv[2])
    H.patch_cuda_for_cpu()
    H.init_parallel(tp, pp)
    from megatron.core import dist_checkpointing as dc

    def load(ckpt: str) -> dict:
        """As Megatron-LM loads: the model's complete sharded state dict (``_extra_state``
        objects included) at its default strictness, then a strict ``load_state_dict``."""
        model = H.build_gpt(tp, pp, params_dtype=torch.float32,
                            position_embedding_type="learned_absolute")
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        state = dc.load({"model": model.sharded_state_dict()}, ckpt,
                        strict="assume_ok_unexpected")
        model.load_state_dict(state["model"], strict=True)
        return {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}

    want = load(sys.argv[3])
    errors = [f"reference: {k} not loaded" for k, v in want.items()
              if v.is_floating_point() and torch.isnan(v).any()]
    for ckpt in sys.argv[4:]:
        got = load(ckpt)
        for k, v in want.items():
            if k not in got or got[k].shape != v.shape or not torch.equal(got[k], v):
                errors.append(f"{os.path.basename(ckpt)}: {k}")
    rank = torch.distributed.get_rank()
    if errors:
        print(f"rank {rank}: {len(errors)} parameters differ: {errors[:5]}", file=sys.stderr)
        return 1
    print(f"rank {rank}: OK {len(want)} parameters x {len(sys.argv) - 4} checkpoints")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    from ckpt_tool._torchrun import exit_cleanly

    exit_cleanly(main())
