"""torchrun worker (2 gloo ranks): MCoreTensorAwareStateDict with ``algo="fully_parallel"``.

Both ranks hold replicas of "r1" and "r2" (replica_id = rank) and their own half of "s".
``from_state_dict`` must leave each replicated tensor's data on exactly one rank (one each,
balanced by bytes), also when the distribution comes from the cache; ``to_state_dict`` must
give every rank all values back with each exchange algorithm. Prints "TASD OK" per rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ckpt_tool.dist_checkpointing import tensor_aware_state_dict as tasd_mod
from ckpt_tool.dist_checkpointing.mapping import ShardedTensor

R1 = torch.arange(6, dtype=torch.float32)
R2 = torch.arange(6, 12, dtype=torch.float32)
S = torch.arange(8, dtype=torch.float32).reshape(2, 4)


def state(rank: int, empty: bool = False) -> dict:
    def data(t):
        return torch.zeros_like(t) if empty else t.clone()
    return {"r1": ShardedTensor.from_rank_offsets("r1", data(R1), replica_id=rank),
            "r2": ShardedTensor.from_rank_offsets("r2", data(R2), replica_id=rank),
            "s": ShardedTensor.from_rank_offsets("s", data(S[rank]), (0, rank, 2))}


def held(tasd) -> set:
    return {sh.key for sh in tasd._sharded_tensors}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tasd_mod.HAVE_NVRX = True  # the class needs nothing from nvidia_resiliency_ext
    cls = tasd_mod.MCoreTensorAwareStateDict
    tasd, distribution = cls.from_state_dict(state(rank), algo="fully_parallel")
    mine = held(tasd)
    everyone = [None, None]
    dist.all_gather_object(everyone, sorted(mine))
    replicated = [k for ranks in everyone for k in ranks if k != "s"]
    assert sorted(replicated) == ["r1", "r2"] and all(len(r) == 2 for r in everyone), everyone

    again, _ = cls.from_state_dict(state(rank), algo="fully_parallel",
                                   cached_metadata=distribution)
    assert held(again) == mine, (held(again), mine)

    tasd.insert_tensors(tasd.pop_tensors())
    for algo in ("broadcast", "gather_rounds", "gather_object"):
        out = tasd.to_state_dict(state(rank, empty=True), algo="fully_parallel",
                                 exchange_algo=algo)
        assert torch.equal(out["r1"], R1) and torch.equal(out["r2"], R2), algo
        assert torch.equal(out["s"], S[rank]), algo
    dist.barrier()
    print(f"rank {rank}: TASD OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
