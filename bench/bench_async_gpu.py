"""How long an async save of CUDA tensors blocks training: ours in every mode, the real
Megatron-Core, PyTorch DCP and the pinned-copy floor, in one run (needs a GPU).

    python bench/bench_async_gpu.py [--size-gb 4] [--saves 4] [--modes floor,ours-fork,...]

One rank (NCCL for CUDA collectives, gloo for CPU ones), ``--size-gb`` of bf16 CUDA tensors in
64 MiB pieces. Each mode runs in a fresh process; per save it times what the training loop
waits for (``save`` + ``schedule_async_request``, ``AsyncCheckpointer.save``,
``dcp.async_save``, or for the floor a non-blocking copy into pinned buffers allocated once
plus one synchronize), then updates every tensor in place (training goes on), then waits for
the write (``maybe_finalize_async_calls(blocking=True)`` / the write future) and records the
time from the start of the save until the checkpoint is complete. Every checkpoint is read back
and must hold the values of its save time. The last one is then loaded onto the GPU by the
same library that wrote it (timed). Peak pinned memory is our staging segment over the
staged bytes. Figures go to stdout (a table with ratios to the floor) and ``--json`` (rewritten
after each mode). With ``--budget-s`` no mode starts once that many seconds have passed; a
mode that fails or runs past ``--timeout`` is reported and the others go on.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODES = ["floor", "ours-checkpointer", "ours-fork", "ours-fork-cached", "ours-persistent",
         "ours-persistent-cached", "mcore-fork", "mcore-persistent", "dcp"]
PIECE = (8192, 4096)  # 64 MiB of bf16


def _tensors(size_gb: float, device: str):
    import torch

    n = max(1, int(size_gb * 1024 / 64))
    return [torch.full(PIECE, float(k % 64), dtype=torch.bfloat16, device=device)
            for k in range(n)]


def _check(plain: dict, save: int, n: int) -> None:
    """Every piece holds ``k % 64 + save`` (bf16 is exact for these small integers)."""
    assert len([k for k in plain if k.startswith("t")]) == n, sorted(plain)[:5]
    for k in range(n):
        t = plain[f"t{k}"].reshape(-1)[::4099]  # a sample: each piece is one constant
        want = float(k % 64 + save)
        if not (float(t.min()) == want == float(t.max())):
            raise AssertionError(f"save {save} piece {k}: {float(t.min())}..{float(t.max())} "
                                 f"!= {want}")


def child(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if a.device == "cuda":
        torch.cuda.set_device(0)
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
    else:  # a smoke run of this script without a GPU (the figures mean nothing then)
        torch.cuda.synchronize = lambda *args, **kwargs: None
        torch.cuda.current_device = lambda: "cpu"
        dist.init_process_group("gloo", rank=0, world_size=1)
    mode = a.child
    tensors = _tensors(a.size_gb, a.device)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    blocking, written, pinned = [], [], None
    work = Path(a.work) / mode
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)

    def update():
        for t in tensors:
            t.add_(1)
        torch.cuda.synchronize()

    def verify(path: Path, save: int) -> None:
        if mode == "dcp":
            import torch.distributed.checkpoint as dcp

            plain = {f"t{k}": torch.empty(t.shape, dtype=t.dtype) for k, t in enumerate(tensors)}
            dcp.load(plain, checkpoint_id=str(path))
        else:
            from ckpt_tool import dist_checkpointing as ours_dc

            plain = ours_dc.load_plain_tensors(str(path))
        _check(plain, save, len(tensors))

    load_s = None
    if mode == "floor":
        host = [torch.empty_like(t, device="cpu", pin_memory=a.device == "cuda")
                for t in tensors]
        for s in range(a.saves):
            t0 = time.perf_counter()
            for h, t in zip(host, tensors):
                h.copy_(t, non_blocking=True)
            torch.cuda.synchronize()
            blocking.append(time.perf_counter() - t0)
            update()
            assert float(host[-1][0, 0]) == float((len(tensors) - 1) % 64 + s)
    elif mode == "ours-checkpointer":
        from ckpt_tool.dist_checkpointing.checkpointer import (
            CheckpointerConfig, CheckpointStagerConfig, make_async_checkpointer)

        cp = make_async_checkpointer(CheckpointerConfig(
            staging_config=CheckpointStagerConfig(use_async_staging=False)))
        sd = {f"t{k}": t for k, t in enumerate(tensors)}
        for s in range(a.saves):
            path = work / f"s{s}"
            t0 = time.perf_counter()
            _, write_future = cp.save(str(path), sd)
            blocking.append(time.perf_counter() - t0)
            update()
            write_future.result()
            written.append(time.perf_counter() - t0)
            verify(path, s)
            if s < a.saves - 1:
                shutil.rmtree(path)
        cp.close()
    elif mode.startswith(("ours-", "mcore-")):
        if mode.startswith("ours-"):
            from ckpt_tool import dist_checkpointing as dc
            from ckpt_tool.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
            from ckpt_tool.dist_checkpointing.strategies.torch import (
                TorchDistSaveShardedStrategy)
        else:
            from megatron.core import dist_checkpointing as dc
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
            from megatron.core.dist_checkpointing.strategies.torch import (
                TorchDistSaveShardedStrategy)
        queue = AsyncCallsQueue(persistent="persistent" in mode)
        strategy = TorchDistSaveShardedStrategy("torch_dist", 1,
                                                cached_metadata=mode.endswith("-cached"))
        ShardedTensor = dc.ShardedTensor
        for s in range(a.saves):
            path = work / f"s{s}"
            path.mkdir()
            sd = {f"t{k}": ShardedTensor.from_rank_offsets(f"t{k}", t)
                  for k, t in enumerate(tensors)}
            t0 = time.perf_counter()
            request = dc.save(sd, str(path), sharded_strategy=strategy, async_sharded_save=True)
            queue.schedule_async_request(request)
            blocking.append(time.perf_counter() - t0)
            update()
            queue.maybe_finalize_async_calls(blocking=True)
            written.append(time.perf_counter() - t0)
            if mode.startswith("ours-") and pinned is None:
                from ckpt_tool.dist_checkpointing._staging_pool import staging_pool

                free = staging_pool()._free
                pinned = {"segment_bytes": sum(x.nbytes for x in free),
                          "pinned": all(x.pinned for x in free)}
            verify(path, s)
            if s < a.saves - 1:
                shutil.rmtree(path)
        template = {f"t{k}": ShardedTensor.from_rank_offsets(f"t{k}", torch.empty_like(t))
                    for k, t in enumerate(tensors)}
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loaded = dc.load(template, str(work / f"s{a.saves - 1}"))
        torch.cuda.synchronize()
        load_s = time.perf_counter() - t0
        assert loaded["t0"].device.type == a.device and float(loaded["t0"][0, 0]) == float(a.saves - 1)
        del loaded, template
        queue.close()
    elif mode == "dcp":
        import torch.distributed.checkpoint as dcp

        sd = {f"t{k}": t for k, t in enumerate(tensors)}
        for s in range(a.saves):
            path = work / f"s{s}"
            t0 = time.perf_counter()
            future = dcp.async_save(sd, checkpoint_id=str(path))
            blocking.append(time.perf_counter() - t0)
            update()
            future.result()
            written.append(time.perf_counter() - t0)
            verify(path, s)
            if s < a.saves - 1:
                shutil.rmtree(path)
        target = {k: torch.empty_like(t) for k, t in sd.items()}
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dcp.load(target, checkpoint_id=str(work / f"s{a.saves - 1}"))
        torch.cuda.synchronize()
        load_s = time.perf_counter() - t0
    shutil.rmtree(work, ignore_errors=True)
    out = {"mode": mode, "bytes": nbytes, "blocking": blocking, "written": written,
           "load": load_s, "pinned": pinned,
           "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def _later(values: list) -> str:
    rest = values[1:] or values
    if not rest:
        return "-"
    return f"{min(rest):.3f}-{max(rest):.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=4.0)
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--work", default=str(HERE / "out" / "async_gpu_work"))
    ap.add_argument("--json", default=str(HERE / "out" / "async_gpu.json"))
    ap.add_argument("--timeout", type=float, default=240, help="seconds per mode")
    ap.add_argument("--budget-s", type=float, help="start no mode after this many seconds")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a)
        return
    results = []
    start = time.perf_counter()
    os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
    for mode in a.modes.split(","):
        if a.budget_s is not None and time.perf_counter() - start > a.budget_s:
            print(f"{mode}: not started (budget of {a.budget_s:.0f} s spent)", file=sys.stderr)
            continue
        if mode == "mcore-persistent" and a.device != "cuda":
            print(f"{mode}: skipped (its spawned worker calls torch.cuda.set_device; the CPU "
                  "smoke run cannot patch that)", file=sys.stderr)
            continue
        if mode.startswith("mcore-"):
            try:
                import megatron.core.dist_checkpointing  # noqa: F401
            except Exception as e:  # noqa: BLE001 - the peer is optional
                print(f"{mode}: skipped (megatron-core not importable: {e})", file=sys.stderr)
                continue
        argv = [sys.executable, __file__, "--child", mode, "--size-gb", str(a.size_gb),
                "--saves", str(a.saves), "--work", a.work, "--device", a.device]
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True,  # its writer processes too, on timeout
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                    [str(ROOT), os.environ.get("PYTHONPATH", "")])})
        try:
            stdout, stderr = proc.communicate(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            shutil.rmtree(Path(a.work) / mode, ignore_errors=True)
            print(f"{mode}: timed out after {a.timeout:.0f} s", file=sys.stderr, flush=True)
            continue
        lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(f"{mode}: failed ({proc.returncode}):\n{stderr[-3000:]}", file=sys.stderr,
                  flush=True)
            continue
        r = json.loads(lines[-1][len("RESULT "):])
        r["process_s"] = time.perf_counter() - t0
        results.append(r)
        Path(a.json).write_text(json.dumps(results, indent=1))
        print(f"{mode}: done in {r['process_s']:.0f} s", file=sys.stderr, flush=True)
    Path(a.json).write_text(json.dumps(results, indent=1))
    floor = next((statistics.median(r["blocking"]) for r in results if r["mode"] == "floor"),
                 None)
    gib = results[0]["bytes"] / 2**30 if results else a.size_gb
    print(f"\nasync save of {gib:.1f} GiB bf16 {a.device} tensors, 1 rank, {a.saves} saves; seconds")
    print(f"{'mode':24s} {'1st save':>9s} {'later saves':>13s} {'x floor':>8s} "
          f"{'until written':>14s} {'load to GPU':>11s} {'pinned/staged':>13s} {'RSS MB':>7s}")
    for r in results:
        b = r["blocking"]
        later = statistics.median(b[1:] or b)
        ratio = f"{later / floor:8.2f}" if floor else "       -"
        w = r["written"]
        pin = (f"{r['pinned']['segment_bytes'] / r['bytes']:13.2f}" if r.get("pinned")
               else f"{'-':>13s}")
        load = f"{r['load']:11.2f}" if r.get("load") is not None else f"{'-':>11s}"
        print(f"{r['mode']:24s} {b[0]:9.3f} {_later(b):>13s} {ratio} "
              f"{(_later(w) if w else '-'):>14s} {load} {pin} {r['rss_mb']:7.0f}")


if __name__ == "__main__":
    main()
