"""How long ``save()`` blocks training: AsyncCheckpointer vs a synchronous save (~1 GB, 2 ranks).

    python bench/bench_async_save.py [--size-mb 1024] [--saves 3] [--nproc 2]

Runs itself under ``torchrun --nproc-per-node 2`` (gloo, CPU). The state dict is ``--size-mb``
of fp32 tensors replicated on every rank (a DDP-style model state), so each rank writes about
half of it (see ``ckpt_tool.dist_checkpointing._checkpoint_io``). Figures are the maximum over
ranks of, per save:

* sync: ``SyncCheckpointer.save`` (blocking = whole write) and, as a floor, ``dc.save`` with
  the synchronous ``torch_dist`` strategy on the same sharded state dict;
* async (``use_async_staging=False``): ``save()`` blocking time (= staging into shared memory),
  and the time until ``write_future`` is done (the checkpoint is complete);
* async with ``use_async_staging=True``: ``save()`` return time and staging (``stage_future``).

The first async save also maps a fresh staging segment; the later ones reuse it (steady state).
Each save goes to a fresh directory; files are fsynced.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _state(size_mb: int) -> dict:
    import torch

    n = max(1, size_mb // 32)
    layers = {i: {"w": torch.full((16384, 512), float(i)),  # 32 MB
                  "b": torch.full((1024,), float(i))} for i in range(n)}
    return {"model": {"layers": layers}, "step": 1}


def _mutate(sd: dict) -> None:
    for layer in sd["model"]["layers"].values():
        layer["w"].add_(1)


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from ckpt_tool import dist_checkpointing as dc
    from ckpt_tool.dist_checkpointing.checkpointer import (
        CheckpointerConfig,
        CheckpointStagerConfig,
        RankInfo,
        make_async_checkpointer,
        make_sync_checkpointer,
        prepare_state_dict,
    )

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sd = _state(a.size_mb)
    nbytes = sum(t.numel() * t.element_size() for layer in sd["model"]["layers"].values()
                 for t in layer.values())
    results: dict = {"bytes": nbytes, "world": world}

    def worst(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def fresh(name: str) -> str:
        dist.barrier()
        if rank == 0:  # keep one checkpoint on disk at a time
            for old in os.listdir(a.work):
                shutil.rmtree(os.path.join(a.work, old), ignore_errors=True)
        dist.barrier()
        return os.path.join(a.work, name)

    sync = make_sync_checkpointer()
    results["sync_save"], results["dc_save_sync_strategy"] = [], []
    for i in range(a.saves):
        path = fresh(f"sync{i}")
        t0 = time.perf_counter()
        sync.save(path, sd)
        results["sync_save"].append(worst(time.perf_counter() - t0))
        path = fresh(f"dcsync{i}")
        sharded = prepare_state_dict(sd, RankInfo(rank, world))
        t0 = time.perf_counter()
        dc.save(sharded, path)
        results["dc_save_sync_strategy"].append(worst(time.perf_counter() - t0))
    sync.close()

    for label, async_staging in (("async", False), ("async_staging_thread", True)):
        config = CheckpointerConfig(
            staging_config=CheckpointStagerConfig(use_async_staging=async_staging))
        cp = make_async_checkpointer(config)
        blocking, staged, complete = [], [], []
        for i in range(a.saves):
            path = fresh(f"{label}{i}")
            t0 = time.perf_counter()
            stage_future, write_future = cp.save(path, sd)
            blocking.append(worst(time.perf_counter() - t0))
            stage_future.result()
            staged.append(worst(time.perf_counter() - t0))
            _mutate(sd)  # training goes on
            write_future.result()
            complete.append(worst(time.perf_counter() - t0))
        cp.close()
        results[label] = {"save_blocking": blocking, "staged": staged, "complete": complete}
    if rank == 0:
        Path(a.out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def _fmt(values: list) -> str:
    rest = values[1:] or values
    return f"{values[0]:8.3f} {statistics.median(rest):8.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--work", default=str(HERE / "out" / "async_save_work"))
    ap.add_argument("--out", default=str(HERE / "out" / "async_save.json"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return
    from _harness import run

    os.makedirs(a.work, exist_ok=True)
    torchrun = shutil.which("torchrun") or "torchrun"
    r = run(f"torchrun -n {a.nproc}", [torchrun, "--standalone", f"--nproc-per-node={a.nproc}",
                                       __file__, "--worker", "--size-mb", str(a.size_mb),
                                       "--saves", str(a.saves), "--work", a.work,
                                       "--out", a.out],
            env={"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})
    shutil.rmtree(a.work, ignore_errors=True)
    res = json.loads(Path(a.out).read_text())
    sync = statistics.median(res["sync_save"][1:] or res["sync_save"])
    print(f"\nasync save vs sync save: {res['bytes'] / 2**20:.0f} MB state dict replicated on "
          f"{res['world']} ranks (each writes ~1/{res['world']}); seconds, max over ranks")
    print(f"{'what':52s} {'1st save':>8s} {'median of later':>8s}")
    print(f"{'SyncCheckpointer.save (blocks for the whole write)':52s} {_fmt(res['sync_save'])}")
    print(f"{'dc.save, sync torch_dist strategy (blocks)':52s} "
          f"{_fmt(res['dc_save_sync_strategy'])}")
    for label in ("async", "async_staging_thread"):
        r_ = res[label]
        print(f"{label + ': save() blocks':52s} {_fmt(r_['save_blocking'])}")
        print(f"{label + ': staged (stage_future done)':52s} {_fmt(r_['staged'])}")
        print(f"{label + ': checkpoint complete (write_future)':52s} {_fmt(r_['complete'])}")
    blocking = statistics.median(res["async"]["save_blocking"][1:]
                                 or res["async"]["save_blocking"])
    floor = statistics.median(res["dc_save_sync_strategy"][1:] or res["dc_save_sync_strategy"])
    print(f"\nsave() blocking (async, sync staging, steady state) vs sync save: "
          f"{blocking / sync:.1%} of SyncCheckpointer.save, {blocking / floor:.1%} of the "
          f"sync-strategy dc.save (goal <= 20%)")
    print(f"whole run {r.seconds:.1f} s; peak RSS of the largest process {r.peak_rss_mb:.0f} MB")

if __name__ == "__main__":
    main()
