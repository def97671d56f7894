"""torchrun worker: the REAL Megatron-Core (the installed one; with ``$CKPT_MEGATRON_SRC``, the
``megatron/core`` source tree it names, e.g. 0.19's) builds the tiny GPT (bf16, DDP, the
DistributedOptimizer) at TP x PP and resumes from CKPT exactly as Megatron-LM does
(``_mcore_resume.load_as_megatron_lm``; ``--verify-integrity``: as with Megatron-LM 0.18+'s
``--verify-integrity``, ``integrity.json`` checked first). On every rank, every bf16 model
parameter and every fp32 main parameter, ``exp_avg`` and ``exp_avg_sq`` slice the optimizer holds
must be bit-identical to the fixture's ground truth ``expected/state.safetensors`` (written by
the run that wrote the fixture: ``_mcore_resume.expected_state``).

    torchrun --nproc-per-node N _version_resume_worker.py TP PP CKPT FIXTURE [--verify-integrity]
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "fixtures"))


def main() -> int:
    import _mcore_cpu as H

    if os.environ.get(H.MEGATRON_SRC_ENV):
        H.megatron_core_from_source("core_v0.19.0")
    import torch
    from safetensors.torch import load_file

    import _mcore_resume as R
    from _expected_state import compare_optimizer, tp_local

    tp, pp, ckpt, fixture = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    H.patch_cuda_for_cpu()
    H.init_parallel(tp, pp)
    from megatron.core import parallel_state as ps

    gpt, _model, optimizer = R.build(tp, pp, "distopt")
    with torch.no_grad():
        for p in gpt.parameters():
            p.fill_(float("nan"))
    R.load_as_megatron_lm(ckpt, gpt, optimizer, verify_integrity="--verify-integrity" in sys.argv)
    names = R.global_names(gpt)
    truth = load_file(os.path.join(fixture, "expected", "state.safetensors"))
    tp_rank = ps.get_tensor_model_parallel_rank()

    def expected(key: str, p) -> torch.Tensor:
        return tp_local(p, truth[key], tp_rank, R.is_glu(key)).contiguous()

    errors: list[str] = []
    for p, name in names.items():
        want = expected(f"model.{name}", p)
        if p.shape != want.shape or p.dtype != want.dtype or not torch.equal(p.detach(), want):
            errors.append(f"model {name}")
    found, checked = compare_optimizer(optimizer, names, expected)
    errors += found
    rank = torch.distributed.get_rank()
    if errors or not checked:
        print(f"rank {rank}: {len(errors)} differences: {errors[:6]}", file=sys.stderr)
        return 1
    from megatron.core import package_info

    print(f"rank {rank}: OK megatron-core {package_info.__version__}: {len(names)} parameters, "
          f"{checked} optimizer elements bit-identical")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    from ckpt_tool._torchrun import exit_cleanly

    exit_cleanly(main())
