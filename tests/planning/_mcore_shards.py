"""Helper process for test_layout_vs_mcore.py (not a test): build the tiny GPT with the real
Megatron-Core 0.16 at each tensor-parallel size for every rank, in one process (torch's
``fake`` process-group backend, no collectives), and print as JSON every ShardedTensor of each
rank's ``sharded_state_dict`` (key, global shape, global offset incl. stacked axes, local
sizes incl. stacked axes, main replica) and the shapes of the rank's own ``state_dict``.

    python tests/planning/_mcore_shards.py TP:HEADS:GROUPS [TP:HEADS:GROUPS ...]
"""

import json
import sys
from pathlib import Path


def _rank_shards(tp, rank, H):
    import torch
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.distributed.init_process_group("fake", rank=rank, world_size=tp, store=FakeStore())
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             create_gloo_process_groups=False)
    try:
        model_parallel_cuda_manual_seed(1234)
        model = H.build_gpt(tp, 1, position_embedding_type="learned_absolute")
        shards = []
        for v in model.sharded_state_dict().values():
            items = v.build() if isinstance(v, ShardedTensorFactory) else v
            for st in items if isinstance(items, list) else [items]:
                if not isinstance(st, ShardedTensor):
                    continue
                rid = st.replica_id if isinstance(st.replica_id, tuple) else (st.replica_id,)
                shards.append([st.key, list(st.global_shape), list(st.global_offset),
                               [1] * st.prepend_axis_num + list(st.local_shape),
                               all(r == 0 for r in rid)])
        local = {k: list(v.shape) for k, v in model.state_dict().items()
                 if isinstance(v, torch.Tensor)}
        return {"shards": shards, "local": local}
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def main():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "fixtures"))
    import _mcore_cpu as H

    H.patch_cuda_for_cpu()
    out = {}
    for spec in sys.argv[1:]:
        tp, heads, groups = (int(a) for a in spec.split(":"))
        H.HEADS, H.QUERY_GROUPS = heads, groups
        out[spec] = {str(r): _rank_shards(tp, r, H) for r in range(tp)}
    print("JSON:" + json.dumps(out))


if __name__ == "__main__":
    main()
