"""torchrun worker for the checkpointer tests; prints one ``RESULT {json}`` line per rank and case.

    torchrun --nproc-per-node 2 checkpointer_worker.py --mode saves --dir BASE
    torchrun --nproc-per-node 2 checkpointer_worker.py --mode mcore-load --dir CKPT [...]

``saves`` runs, under BASE: ``sync`` (SyncCheckpointer round trip, partial and strict loads),
``mutate`` (async save, every live tensor changed once ``stage_future`` is done), ``loop``
(100 async saves on the same checkpointer, process facts before/after, then ``closed``),
``raise`` (rank 1's data file cannot be opened) and ``kill`` (rank 1's checkpoint process
SIGKILLed mid-write). ``mcore-load`` loads each CKPT with the real Megatron-Core.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def report(case: str, **facts) -> None:
    line = "RESULT " + json.dumps({"rank": dist.get_rank(), "case": case, **facts}) + "\n"
    sys.stdout.write(line)
    sys.stdout.flush()


def replicated_state() -> dict:
    """Identical on every rank: the ground truth of the plain (replicated) part."""
    g = torch.Generator().manual_seed(1234)
    return {"model": {"emb": torch.randn(16, 8, generator=g),
                      "layers": {0: {"w": torch.randn(8, 8, generator=g).to(torch.bfloat16)},
                                 1: {"w": torch.randn(8, 8, generator=g).to(torch.bfloat16)}}},
            "opt": {"step_t": torch.arange(5, dtype=torch.int64)},
            "step": 3, "note": "hello", "lrs": [0.1, 0.01]}


def state(rank: int, world: int) -> dict:
    """The replicated part plus one ShardedTensor of which each rank holds a row block."""
    from ckpt_tool.dist_checkpointing.mapping import ShardedTensor

    sd = replicated_state()
    sd["model"]["shard"] = ShardedTensor.from_rank_offsets(
        "model.shard", torch.full((2, 3), float(rank + 1)), (0, rank, world))
    return sd


def expected_tensors(world: int) -> dict:
    """Every tensor key of a saved checkpoint and its global value."""
    r = replicated_state()
    return {"model.emb": r["model"]["emb"], "model.layers.0.w": r["model"]["layers"][0]["w"],
            "model.layers.1.w": r["model"]["layers"][1]["w"], "opt.step_t": r["opt"]["step_t"],
            "model.shard": torch.cat([torch.full((2, 3), float(k + 1)) for k in range(world)])}


def live_tensors(sd: dict) -> list:
    from ckpt_tool.dist_checkpointing.mapping import ShardedTensor

    out = []
    for v in sd.values():
        if isinstance(v, dict):
            out += live_tensors(v)
        elif isinstance(v, ShardedTensor):
            out.append(v.data)
        elif isinstance(v, torch.Tensor):
            out.append(v)
    return out


def mutate(sd: dict) -> None:
    for t in live_tensors(sd):
        t.add_(100) if t.dtype != torch.bool else t.logical_not_()


def check_files(ckpt: str) -> list:
    """Differences between the plain tensors in ``ckpt`` (our reader) and the ground truth."""
    from ckpt_tool import dist_checkpointing as dc

    loaded = dc.load_plain_tensors(ckpt)
    errors = []
    for key, value in expected_tensors(dist.get_world_size()).items():
        if key not in loaded or not torch.equal(loaded[key], value):
            errors.append(key)
    return errors


def outcome(future) -> dict:
    try:
        future.result()
        return {"raised": None}
    except Exception as e:
        return {"raised": f"{type(e).__name__}: {e}"}


def case_sync(base: str) -> None:
    from ckpt_tool.dist_checkpointing.checkpointer import make_sync_checkpointer

    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = os.path.join(base, "sync")
    cp = make_sync_checkpointer()
    assert cp.save(ckpt, state(rank, world)) is None
    full = cp.load(ckpt)  # no target: everything, at its dict paths
    truth = replicated_state()
    whole = (torch.equal(full["model"]["emb"], truth["model"]["emb"])
             and torch.equal(full["model"]["layers"][1]["w"], truth["model"]["layers"][1]["w"])
             and torch.equal(full["model"]["shard"], expected_tensors(world)["model.shard"])
             and full["step"] == 3 and full["lrs"] == [0.1, 0.01] and full["note"] == "hello")
    target = state(rank, world)
    for t in live_tensors(target):
        t.zero_()
    emb = target["model"]["emb"]
    target["extra"] = {"x": torch.zeros(2)}
    target["step"] = -1
    partial = cp.load(ckpt, target)
    in_place = partial["model"]["emb"] is emb and torch.equal(emb, truth["model"]["emb"])
    own_rows = torch.equal(partial["model"]["shard"], torch.full((2, 3), float(rank + 1)))
    try:
        cp.load(ckpt, target, strict=True)
        strict = None
    except RuntimeError as e:
        strict = str(e)
    cp.close()
    report("sync", dir=ckpt, whole=bool(whole), in_place=bool(in_place), own_rows=own_rows,
           step=partial["step"], extra=partial["extra"]["x"].tolist(), strict=strict,
           files=check_files(ckpt))


def process_facts() -> dict:
    """Child pids (and zombies), fds, shared-memory mappings and staging files of this process."""
    import async_worker

    facts = async_worker.process_facts()
    states = [(c.split(":") + [""])[:2] for c in facts.pop("children")]  # "pid[:Z]"
    facts["children"] = sorted(int(pid) for pid, _ in states)
    facts["zombies"] = sorted(int(pid) for pid, state in states if state == "Z")
    facts["shm_files"] = sorted(n for n in os.listdir("/dev/shm")
                                if n.startswith(f"ckpt_stage_{os.getpid()}_"))
    facts.pop("result_files")
    return facts


def case_mutate_and_loop(base: str, n: int = 100) -> None:
    from ckpt_tool.dist_checkpointing.checkpointer import make_async_checkpointer

    rank, world = dist.get_rank(), dist.get_world_size()
    cp = make_async_checkpointer()
    ckpt = os.path.join(base, "mutate")
    sd = state(rank, world)
    stage_future, write_future = cp.save(ckpt, sd)
    stage_future.result()
    mutate(sd)  # staging is done: nothing of this may reach the files
    res = outcome(write_future)
    mutate(sd)
    report("mutate", dir=ckpt, **res, files=check_files(ckpt),
           pid=cp._checkpoint_process.pid)

    before, pids = None, set()
    for i in range(n):
        if i == 5:
            cp._write_future.result()
            before = process_facts()
        sd = state(rank, world)
        stage_future, write_future = cp.save(os.path.join(base, f"loop{i % 2}"), sd)
        stage_future.result()
        mutate(sd)
        pids.add(cp._checkpoint_process.pid)
    res = outcome(write_future)
    after = process_facts()
    report("loop", n=n, before=before, after=after, pids=len(pids), **res,
           files=check_files(os.path.join(base, f"loop{(n - 1) % 2}")))
    cp.close()
    report("closed", **process_facts())


def case_raise(base: str) -> None:
    from ckpt_tool.dist_checkpointing.checkpointer import make_async_checkpointer

    rank, world = dist.get_rank(), dist.get_world_size()
    cp = make_async_checkpointer()
    ckpt = os.path.join(base, "raise")
    if rank == 1:
        os.makedirs(os.path.join(ckpt, "__1_0.distcp"))  # the write cannot open its data file
    dist.barrier()
    _, write_future = cp.save(ckpt, state(rank, world))
    res = outcome(write_future)
    again = outcome_of_save(cp, ckpt)
    cp.close()
    report("raise", dir=ckpt, **res, again=again)


def outcome_of_save(cp, ckpt: str) -> str:
    """What the next save says after a failed write (it must re-raise, not write)."""
    try:
        cp.save(ckpt + "_next", {"x": torch.zeros(1)})
        return "no error"
    except Exception as e:
        return type(e).__name__


def install_slow_write(marker: str) -> None:
    """Runs in rank 1's checkpoint process: its data write starts a file, then hangs."""
    from ckpt_tool.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    def slow(transform_list, local_proc_idx, write_bucket, results_queue, count_queue,
             use_fsync, **kwargs):
        with open(write_bucket[0], "wb") as f:
            f.write(b"partial")
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(300)
        raise AssertionError("the checkpoint process should have been killed")

    FileSystemWriterAsync.write_preloaded_data = staticmethod(slow)


def case_kill(base: str) -> None:
    from ckpt_tool.dist_checkpointing.checkpointer import make_async_checkpointer

    rank, world = dist.get_rank(), dist.get_world_size()
    marker = os.path.join(base, "kill_started")
    if rank == 1:
        cp = make_async_checkpointer(subprocess_init_fn=install_slow_write,
                                     subprocess_init_args=(marker,))
    else:
        cp = make_async_checkpointer()
    ckpt = os.path.join(base, "kill")
    _, write_future = cp.save(ckpt, state(rank, world))
    killed = None
    if rank == 1:
        deadline = time.monotonic() + 120
        while not os.path.exists(marker):
            if time.monotonic() > deadline:
                raise AssertionError("the slow write never started")
            time.sleep(0.05)
        killed = cp._checkpoint_process.pid
        os.kill(killed, signal.SIGKILL)
    res = outcome(write_future)
    cp.close()
    report("kill", dir=ckpt, **res, killed=killed, **process_facts())


def mcore_load(dirs) -> None:
    import dist_worker

    lib, _ = dist_worker.import_lib("mcore")
    for ckpt in dirs:
        loaded = lib.load_plain_tensors(ckpt)
        errors = [key for key, value in expected_tensors(dist.get_world_size()).items()
                  if key not in loaded or not torch.equal(loaded[key], value)]
        common = lib.load_common_state_dict(ckpt)
        if common.get("step") != 3:
            errors.append("step")
        report("mcore_load", dir=ckpt, errors=errors)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["saves", "mcore-load"], required=True)
    p.add_argument("--dir", action="append", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    if args.mode == "mcore-load":
        mcore_load(args.dir)
        return 0
    base = args.dir[0]
    if dist.get_rank() == 0:
        os.makedirs(base, exist_ok=True)
    dist.barrier()
    case_sync(base)
    case_mutate_and_loop(base)
    case_raise(base)
    case_kill(base)
    return 0


if __name__ == "__main__":
    from ckpt_tool._torchrun import exit_cleanly

    exit_cleanly(main())
