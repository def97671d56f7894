"""What the resume workers compare with a fixture's ground truth: the part of a TP1 tensor that
a tensor-parallel rank holds, and every slice of fp32 main parameter, ``exp_avg`` and
``exp_avg_sq`` a resumed DistributedOptimizer holds (each chained optimizer's own
``gbuf_ranges``) against the fixture's per-parameter ``{fp32_param,exp_avg,exp_avg_sq}.<name>``.
Runs inside the torchrun workers, after the real Megatron-Core has resumed."""

from __future__ import annotations

from typing import Any, Callable


def tp_local(p: Any, full: Any, tp_rank: int, glu: bool) -> Any:
    """The part of the TP1 tensor ``full`` that tensor-parallel rank ``tp_rank`` holds of ``p``,
    by Megatron-Core's own attributes (``tensor_model_parallel``, ``partition_dim``); a gated
    ``linear_fc1`` (``glu``) holds its rank's part of each GLU half."""
    import torch

    if not getattr(p, "tensor_model_parallel", False) or p.shape == full.shape:
        return full
    dim = p.partition_dim
    n = p.shape[dim]
    if glu:
        halves = full.chunk(2, dim=dim)
        return torch.cat([h.narrow(dim, tp_rank * n // 2, n // 2) for h in halves], dim=dim)
    assert full.shape[dim] % n == 0
    return full.narrow(dim, tp_rank * n, n)


def compare_optimizer(optimizer: Any, names: dict[Any, str],
                      expected: Callable[[str, Any], Any]) -> tuple[list[str], int]:
    """``(differences, elements checked)``: every fp32 main parameter, ``exp_avg`` and
    ``exp_avg_sq`` slice that ``optimizer``'s DistributedOptimizers hold, against
    ``expected(key, param)`` (the rank's local tensor of ``{fp32_param,exp_avg,exp_avg_sq}.
    <name>``)."""
    import torch

    errors: list[str] = []
    checked = 0
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        for gbuf_range_maps in o.gbuf_ranges:
            for maps in gbuf_range_maps.values():
                for bucket_map in maps:
                    for model_param, prm in bucket_map["param_map"].items():
                        r = prm["param"]
                        got = o._get_main_param_and_optimizer_states(model_param)
                        for k in ("param", "exp_avg", "exp_avg_sq"):
                            key = f"{'fp32_param' if k == 'param' else k}.{names[model_param]}"
                            want = expected(key, model_param).reshape(-1)[r.start:r.end]
                            g = got[k].detach().reshape(-1)
                            if g.dtype != torch.float32 or not torch.equal(g, want):
                                errors.append(f"optimizer {key}[{r.start}:{r.end}]")
                            checked += g.numel()
    return errors, checked
