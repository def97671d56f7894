"""torchrun worker (1 rank): what the REAL Megatron-Core of ``$CKPT_MEGATRON_SRC`` (0.19) reads
from each checkpoint directory given, for the library-API tests to compare with ours:
``load_common_state_dict`` and ``load_plain_tensors`` (``torch.save``d to OUT/<n>.pt), or the
``CheckpointingException`` it raises (its message, in OUT/<n>.error).

    torchrun --nproc-per-node 1 _mcore019_api_worker.py OUT CKPT [CKPT ...]
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "fixtures"))


def main() -> int:
    import _mcore_cpu as H

    H.megatron_core_from_source("core_v0.19.0")
    import torch
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing.core import CheckpointingException

    H.patch_cuda_for_cpu()
    torch.distributed.init_process_group(backend="gloo")
    out = sys.argv[1]
    for n, ckpt in enumerate(sys.argv[2:]):
        try:
            found = {"common": dc.load_common_state_dict(ckpt),
                     "plain": dc.load_plain_tensors(ckpt)}
        except CheckpointingException as exc:
            with open(os.path.join(out, f"{n}.error"), "w", encoding="utf-8") as f:
                f.write(str(exc))
            continue
        torch.save(found, os.path.join(out, f"{n}.pt"))
    from megatron.core import package_info

    print(f"rank 0: OK megatron-core {package_info.__version__}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    from ckpt_tool._torchrun import exit_cleanly

    exit_cleanly(main())
