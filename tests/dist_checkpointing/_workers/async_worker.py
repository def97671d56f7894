"""torchrun worker for the async-save tests; prints one ``RESULT {json}`` line per rank and case.

    torchrun --nproc-per-node 2 async_worker.py --mode {temporal,persistent} --dir BASE
    torchrun --nproc-per-node 2 async_worker.py --mode mcore-load --dir CKPT [--dir CKPT ...]

The save modes run, under BASE: ``mutate`` (async save of the ``layouts`` model, every live
tensor changed right after ``save()`` returns and again after scheduling), ``raise`` (rank 1's
data file cannot be opened), ``kill`` (rank 1's writer SIGKILLed mid-write), then
mode-specific cases (``cached`` + ``loop`` for temporal; ``reuse`` + ``loop`` for persistent).
``mcore-load`` loads each CKPT with the real Megatron-Core and checks the ground truth.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

SLOW_ENV = "CKPT_TEST_SLOW_ASYNC_WRITE"


def install_slow_write() -> None:
    """Make this process's bucket writes start a file, then hang (to be killed mid-write)."""
    from ckpt_tool.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    def slow(transform_list, local_proc_idx, write_bucket, results_queue, count_queue,
             use_fsync, **kwargs):
        with open(write_bucket[0], "wb") as f:
            f.write(b"partial")
            f.flush()
        time.sleep(300)
        raise AssertionError("the writer should have been killed")

    FileSystemWriterAsync.write_preloaded_data = staticmethod(slow)


if os.environ.get(SLOW_ENV) == "1":  # a spawned persistent worker imports this module
    install_slow_write()


def report(case: str, **facts) -> None:
    line = "RESULT " + json.dumps({"rank": dist.get_rank(), "case": case, **facts}) + "\n"
    sys.stdout.write(line)
    sys.stdout.flush()


def sharded_tensors(sd):
    from ckpt_tool.dist_checkpointing.dict_utils import nested_values
    from ckpt_tool.dist_checkpointing.mapping import ShardedTensor

    return [v for v in nested_values(sd) if isinstance(v, ShardedTensor)]


def layouts_state(lib_mapping, rank: int):
    import layouts

    layout = layouts.parse_layout("tp2pp1", rank, dist.get_world_size())
    sd = layouts.build_sharded_state_dict(lib_mapping, layout, True)
    sd.update(layouts.common_state())
    return sd


def async_save(queue, sd, ckpt: str, **kw):
    from ckpt_tool import dist_checkpointing as dc

    request = dc.save(sd, ckpt, async_sharded_save=True, **kw)
    return request


def finalize_outcome(queue) -> dict:
    from ckpt_tool.dist_checkpointing.core import CheckpointingException

    try:
        done = queue.maybe_finalize_async_calls(blocking=True)
        return {"raised": None, "finalized": done}
    except CheckpointingException as e:
        return {"raised": str(e), "finalized": []}


def case_mutate(queue, base: str) -> None:
    from ckpt_tool.dist_checkpointing import mapping

    ckpt = os.path.join(base, "mutate")
    sd = layouts_state(mapping, dist.get_rank())
    request = async_save(queue, sd, ckpt)
    for sh in sharded_tensors(sd):  # staging is done: nothing of this may reach the files
        sh.data.add_(1000)
    queue.schedule_async_request(request)
    for sh in sharded_tensors(sd):
        sh.data.mul_(-3)
    report("mutate", **finalize_outcome(queue), dir=ckpt)


def worker_pid(queue) -> int:
    if queue.persistent:
        return queue.persistent_caller.process.pid
    return queue.async_calls[-1].async_caller.process.pid


def case_raise(queue, base: str) -> None:
    from ckpt_tool.dist_checkpointing import mapping

    ckpt = os.path.join(base, "raise")
    request = async_save(queue, layouts_state(mapping, dist.get_rank()), ckpt)
    if dist.get_rank() == 1:
        os.mkdir(os.path.join(ckpt, "__1_0.distcp"))  # opening the data file fails
    queue.schedule_async_request(request)
    report("raise", **finalize_outcome(queue), dir=ckpt)


def case_kill(queue, base: str) -> None:
    from ckpt_tool.dist_checkpointing import mapping
    from ckpt_tool.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    ckpt = os.path.join(base, "kill")
    rank = dist.get_rank()
    original = FileSystemWriterAsync.__dict__["write_preloaded_data"]
    request = async_save(queue, layouts_state(mapping, rank), ckpt)
    if rank == 1:
        os.environ[SLOW_ENV] = "1"
        install_slow_write()
        if queue.persistent and queue.persistent_caller is not None:
            queue.persistent_caller.close()  # a new worker imports the slow write
    queue.schedule_async_request(request)
    killed = None
    if rank == 1:
        pid = worker_pid(queue)
        started = os.path.join(ckpt, "__1_0.distcp")
        deadline = time.monotonic() + 120
        while not (os.path.exists(started) and os.path.getsize(started)):
            if time.monotonic() > deadline:
                raise AssertionError("the slow writer never started")
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        killed = pid
        del os.environ[SLOW_ENV]
        FileSystemWriterAsync.write_preloaded_data = original
    report("kill", **finalize_outcome(queue), dir=ckpt, killed=killed)
    if queue.persistent:  # the next save gets a fresh worker and succeeds (and stays)
        ckpt2 = os.path.join(base, "after_kill")
        queue.schedule_async_request(async_save(queue, layouts_state(mapping, rank), ckpt2))
        report("after_kill", **finalize_outcome(queue), dir=ckpt2)


def case_cached(base: str) -> None:
    """Four saves with ``cached_metadata``; counts object collectives of planning."""
    from torch.distributed.checkpoint.utils import _DistWrapper

    from ckpt_tool import dist_checkpointing as dc
    from ckpt_tool.dist_checkpointing.mapping import ShardedTensor
    from ckpt_tool.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    counts = {"n": 0}
    for name in ("gather_object", "scatter_object", "all_gather_object", "broadcast_object"):
        orig = getattr(_DistWrapper, name)

        def counted(self, *a, _orig=orig, **k):
            counts["n"] += 1
            return _orig(self, *a, **k)
        setattr(_DistWrapper, name, counted)

    rank, world = dist.get_rank(), dist.get_world_size()
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True)
    planning, reused, dirs = [], [], []
    for i in range(4):
        sd = {"w": ShardedTensor.from_rank_offsets(
            "w", torch.full((2, 3), float(10 * i + rank)), (0, rank, world))}
        if i == 3:  # a changed structure must be planned afresh
            sd["extra"] = ShardedTensor.from_rank_offsets(
                "extra", torch.full((2,), float(i + rank)), (0, rank, world))
        ckpt = os.path.join(base, f"cached{i}")
        counts["n"] = 0
        request = dc.save(sd, ckpt, sharded_strategy=strategy, async_sharded_save=True)
        planning.append(counts["n"])
        reused.append(bool(strategy.validated_cache_reuse))
        request.execute_sync()
        dirs.append(ckpt)
    report("cached", planning_collectives=planning, reused=reused, dirs=dirs)


def process_facts() -> dict:
    """Children (zombies included, the multiprocessing resource tracker excluded), open fds,
    shared-memory mappings and leftover result files of this process."""
    import multiprocessing
    from multiprocessing import resource_tracker

    me = os.getpid()
    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == me and int(entry) != tracker:
            # the pid, and "Z" for zombies only: R/S flip between snapshots of a live worker
            children.append(f"{entry}:Z" if fields[0] == "Z" else entry)
    with open("/proc/self/maps") as f:
        shm_maps = sum(1 for line in f if "/dev/shm" in line or "torch_" in line)
    leftovers = [n for n in os.listdir(tempfile.gettempdir())
                 if n.startswith(f"ckpt_async_{me}_")]
    return {"children": children, "mp_children": len(multiprocessing.active_children()),
            "fds": len(os.listdir("/proc/self/fd")), "shm_maps": shm_maps,
            "result_files": leftovers}


def case_loop(queue, base: str, n: int = 100) -> None:
    """``n`` saves of tiny tensors, finalized as training would (non-blocking each step)."""
    from ckpt_tool import dist_checkpointing as dc
    from ckpt_tool.dist_checkpointing.mapping import ShardedTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    before = None
    start = time.monotonic()
    for i in range(n):
        if i == 5:
            queue.maybe_finalize_async_calls(blocking=True)
            before = process_facts()
        t = torch.full((4,), float(i + 10 * rank))
        sd = {"t": ShardedTensor.from_rank_offsets("t", t, (0, rank, world)), "i": i}
        queue.schedule_async_request(async_save(queue, sd, os.path.join(base, f"loop{i % 2}"),
                                                validate_access_integrity=False))
        t.fill_(-1)
        queue.maybe_finalize_async_calls(blocking=False)
    queue.maybe_finalize_async_calls(blocking=True)
    after = process_facts()
    last = dc.load_plain_tensors(os.path.join(base, f"loop{(n - 1) % 2}"))["t"]
    report("loop", before=before, after=after, last=last.tolist(), n=n,
           seconds=round(time.monotonic() - start, 1))


def case_reuse(queue, base: str) -> None:
    """Three saves on the persistent worker: one process serves them all."""
    from ckpt_tool.dist_checkpointing import mapping

    pids, outcomes = [], []
    for i in range(3):
        sd = layouts_state(mapping, dist.get_rank())
        queue.schedule_async_request(async_save(queue, sd, os.path.join(base, f"reuse{i}")))
        for sh in sharded_tensors(sd):
            sh.data.zero_()
        pids.append(queue.persistent_caller.process.pid)
        outcomes.append(finalize_outcome(queue))
    report("reuse", pids=pids, outcomes=outcomes,
           dirs=[os.path.join(base, f"reuse{i}") for i in range(3)])


def run_saves(mode: str, base: str) -> None:
    from ckpt_tool.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    queue = AsyncCallsQueue(persistent=(mode == "persistent"))
    case_kill(queue, base)  # first: rank 1's first worker is the one to kill
    case_mutate(queue, base)
    case_raise(queue, base)
    if mode == "persistent":
        case_reuse(queue, base)
    else:
        case_cached(base)
    case_loop(queue, base)
    queue.close()
    report("closed", unfinalized=queue.get_num_unfinalized_calls(), **process_facts())


def mcore_load(dirs) -> None:
    import dist_worker
    import layouts

    lib, mapping = dist_worker.import_lib("mcore")
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = layouts.parse_layout("tp2pp1", rank, world)
    for ckpt in dirs:
        target = layouts.build_sharded_state_dict(mapping, layout, True, empty=True)
        truth = dist_worker.expected_state(layouts.build_sharded_state_dict(mapping, layout))
        for key in ("rng_state", "extra"):
            truth[key] = layouts.expected_object(target[key].key, layout)
        loaded = lib.load(target, ckpt)
        errors = dist_worker.compare(loaded, truth) + dist_worker.compare(
            loaded, layouts.common_state())
        report("mcore_load", dir=ckpt, errors=errors)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["temporal", "persistent", "mcore-load"], required=True)
    p.add_argument("--dir", action="append", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    if args.mode == "mcore-load":
        mcore_load(args.dir)
    else:
        if dist.get_rank() == 0:
            os.makedirs(args.dir[0], exist_ok=True)
        dist.barrier()
        run_saves(args.mode, args.dir[0])
    return 0


if __name__ == "__main__":
    from ckpt_tool._torchrun import exit_cleanly

    exit_cleanly(main())
