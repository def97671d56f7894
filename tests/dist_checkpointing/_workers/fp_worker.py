"""torchrun worker: fully-parallel save/load of the ``layouts`` model replicated over DP ranks.

    torchrun --nproc-per-node 2 fp_worker.py --lib ours --dir CKPT --out OUT
        --async-dir ASYNC_CKPT
        save CKPT with our FullyParallelSaveStrategyWrapper (and ASYNC_CKPT with the same
        wrapper, cached distribution, through async_save), then load CKPT with our
        FullyParallelLoadStrategyWrapper once per exchange algorithm; every load is checked
        against the ground truth and the data files each rank read go to OUT/reads_<rank>.json.
    torchrun --nproc-per-node 2 fp_worker.py --lib mcore --dir CKPT --mcore-dir CKPT2
        load CKPT with the real Megatron-Core (checked), then save the same state dict to CKPT2
        with Megatron-Core's own FullyParallelSaveStrategyWrapper.
    torchrun --nproc-per-node 4 fp_worker.py --lib ours --tp2dp2 --dir CKPT
        TP2 x DP2: save with the wrapper over each DP group, load (checked) over the DP
        groups and over the world, with several exchange algorithms.

Except for ``--tp2dp2`` the layout is ``tp1pp1``, i.e. pure data parallelism: both ranks hold
replicas of every tensor and only rank 0 holds main replicas before the wrapper redistributes
them.
Exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch.distributed as dist  # noqa: E402

import layouts  # noqa: E402
from dist_worker import compare, expected_state, import_lib  # noqa: E402

ALGOS = ("broadcast", "gather_rounds", "gather_object")


def build(mapping, layout, empty: bool) -> dict:
    sd = layouts.build_sharded_state_dict(mapping, layout, True, empty=empty)
    if not empty:
        sd.update(layouts.common_state())
    return sd


def check_loaded(loaded, mapping, layout) -> list:
    target = layouts.build_sharded_state_dict(mapping, layout, True, empty=True)
    truth = expected_state(layouts.build_sharded_state_dict(mapping, layout, True))
    for key in ("rng_state", "extra"):
        truth[key] = layouts.expected_object(target[key].key, layout)
    return compare(loaded, truth) + compare(loaded, layouts.common_state())


def record_reads() -> list:
    """Patch our DCP reader so every data file read is appended to the returned list."""
    from ckpt_tool.dist_checkpointing.strategies._dcp_planner import SafeFileSystemReader

    reads: list = []
    original = SafeFileSystemReader.read_data

    def read_data(self, plan, planner):
        reads.extend(self.storage_data[item.storage_index].relative_path
                     for item in plan.items)
        return original(self, plan, planner)

    SafeFileSystemReader.read_data = read_data
    return reads


def run_ours(args, rank: int, layout) -> list:
    from ckpt_tool.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from ckpt_tool.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
        FullyParallelSaveStrategyWrapper,
    )
    from ckpt_tool.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    lib, mapping = import_lib("ours")
    wrapper = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(),
                                               do_cache_distribution=True)
    lib.save(build(mapping, layout, empty=False), args.dir, sharded_strategy=wrapper)
    # the same wrapper again, asynchronously: the cached distribution, the async base path
    request = lib.save(build(mapping, layout, empty=False), args.async_dir,
                       sharded_strategy=wrapper, async_sharded_save=True)
    request.execute_sync()

    reads = record_reads()
    reads_by_algo, errors = {}, []
    for algo in ALGOS:
        del reads[:]
        loader = FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy(),
                                                  exchange_algo=algo)
        loaded = lib.load(build(mapping, layout, empty=True), args.dir, sharded_strategy=loader)
        errors += [f"{algo}: {e}" for e in check_loaded(loaded, mapping, layout)]
        reads_by_algo[algo] = sorted(set(reads))
    with open(os.path.join(args.out, f"reads_{rank}.json"), "w") as f:
        json.dump(reads_by_algo, f)
    return errors


def run_tp2dp2(args, rank: int, world: int) -> list:
    """TP2 x DP2 on 4 ranks: save spread over each DP group, load over DP groups and world."""
    from ckpt_tool.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from ckpt_tool.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
        FullyParallelSaveStrategyWrapper,
    )
    from ckpt_tool.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    lib, mapping = import_lib("ours")
    layout = layouts.parse_layout("tp2pp1", rank, world)
    dp_groups = [dist.new_group([r for r in range(world) if r % layout.tp == t])
                 for t in range(layout.tp)]  # every rank creates every group, same order
    dp_group = dp_groups[layout.tp_rank]
    wrapper = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(), dp_group)
    lib.save(build(mapping, layout, empty=False), args.dir, sharded_strategy=wrapper)
    errors = []
    for group, algo in ((dp_group, "broadcast"), (dp_group, "gather_rounds"),
                        (None, "broadcast"), (None, "gather_object")):
        loader = FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy(), group,
                                                  exchange_algo=algo)
        loaded = lib.load(build(mapping, layout, empty=True), args.dir, sharded_strategy=loader)
        name = f"{'dp' if group else 'world'}/{algo}"
        errors += [f"{name}: {e}" for e in check_loaded(loaded, mapping, layout)]
    return errors


def run_mcore(args, layout) -> list:
    lib, mapping = import_lib("mcore")
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    errors = check_loaded(lib.load(build(mapping, layout, empty=True), args.dir), mapping, layout)
    wrapper = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy())
    os.makedirs(args.mcore_dir, exist_ok=True)  # Megatron-Core does not create it
    dist.barrier()
    lib.save(build(mapping, layout, empty=False), args.mcore_dir, sharded_strategy=wrapper)
    return errors


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--lib", choices=["mcore", "ours"], required=True)
    p.add_argument("--tp2dp2", action="store_true", help="(ours, 4 ranks) the TP2 x DP2 run")
    p.add_argument("--dir", required=True)
    p.add_argument("--out", help="(ours) folder for reads_<rank>.json")
    p.add_argument("--async-dir", help="(ours) where the async fully-parallel save goes")
    p.add_argument("--mcore-dir", help="(mcore) where Megatron-Core's fully-parallel save goes")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = layouts.parse_layout("tp1pp1", rank, world)
    if args.tp2dp2:
        errors = run_tp2dp2(args, rank, world)
    elif args.lib == "ours":
        errors = run_ours(args, rank, layout)
    else:
        errors = run_mcore(args, layout)
    if errors:
        print(f"rank {rank}: " + "; ".join(errors), file=sys.stderr)
        return 1
    print(f"rank {rank}: OK")
    return 0


if __name__ == "__main__":
    from ckpt_tool._torchrun import exit_cleanly

    exit_cleanly(main())
