"""Host staging of async saves: one (pinned) segment reused across saves, released on close.

Each test runs on the CPU and, where CUDA is present, on the GPU (``cuda`` marker): the values
of save time must be what is written although the live tensors change (or are freed) right
after ``save`` returns, every mode must reuse the same segment, and nothing may be left behind.
"""

from __future__ import annotations

import io
import os

import pytest
import torch

from ckpt_tool import dist_checkpointing as dc
from ckpt_tool.dist_checkpointing import _staging_pool
from ckpt_tool.dist_checkpointing._staging import SEGMENT_PREFIX, _shm_dir
from ckpt_tool.dist_checkpointing._staging_pool import (
    StagingPool,
    exact_storage,
    staged_nbytes,
    staging_pool,
)
from ckpt_tool.dist_checkpointing.mapping import ShardedTensor
from ckpt_tool.dist_checkpointing.strategies import async_utils
from ckpt_tool.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]


def _state(device: str, i: int, rows: int = 256) -> dict:
    return {"w": ShardedTensor.from_rank_offsets(
                "w", torch.full((rows, 1024), float(i), device=device)),
            "b": ShardedTensor.from_rank_offsets(
                "b", torch.arange(rows, dtype=torch.bfloat16, device=device) + i),
            "step": i}


def _my_shm_files() -> list:
    prefix = f"{SEGMENT_PREFIX}{os.getpid()}_"
    return sorted(n for n in os.listdir(_shm_dir()) if n.startswith(prefix))


@pytest.fixture(autouse=True)
def fresh_pool(monkeypatch):
    _staging_pool.release_staging_memory()
    monkeypatch.setattr(_staging_pool, "_POOL", None)
    yield
    _staging_pool.release_staging_memory()


@pytest.mark.parametrize("persistent", [False, True], ids=["fork", "persistent"])
@pytest.mark.parametrize("device", DEVICES)
def test_saves_reuse_one_segment_and_keep_the_values_of_save_time(tmp_path, device, persistent):
    queue = AsyncCallsQueue(persistent=persistent)
    segments = set()
    for i in range(20):
        sd = _state(device, i)
        request = dc.save(sd, str(tmp_path / f"c{i}"), async_sharded_save=True)
        sd["w"].data.add_(1000)  # right after save returned, before the write started
        sd["b"].data.zero_()
        queue.schedule_async_request(request)
        del sd, request
        if device == "cuda":
            torch.cuda.empty_cache()  # the device memory is gone: the write must not need it
        queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
        pool = staging_pool()
        assert pool.leased == 0 and len(pool._free) == 1
        segments.add(id(pool._free[0]))
        assert pool._free[0].pinned == (device == "cuda")
    assert len(segments) == 1
    assert len(_my_shm_files()) <= 1
    queue.close()
    assert staging_pool()._free == [] and _my_shm_files() == []
    for i in (0, 7, 19):
        loaded = dc.load_plain_tensors(str(tmp_path / f"c{i}"))
        assert torch.equal(loaded["w"], torch.full((256, 1024), float(i)))
        assert torch.equal(loaded["b"], torch.arange(256, dtype=torch.bfloat16) + i)


@pytest.mark.parametrize("device", DEVICES)
def test_overlapping_saves_hold_their_own_segments(tmp_path, device):
    queue = AsyncCallsQueue()
    for i in range(2):  # the second save is scheduled before the first is finalized
        sd = _state(device, i)
        queue.schedule_async_request(dc.save(sd, str(tmp_path / f"c{i}"),
                                             async_sharded_save=True))
        sd["w"].data.fill_(-1)
    assert staging_pool().leased == 2
    queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    assert staging_pool().leased == 0 and len(staging_pool()._free) == 1  # the extra one went
    queue.close()
    for i in range(2):
        assert torch.equal(dc.load_plain_tensors(str(tmp_path / f"c{i}"))["w"],
                           torch.full((256, 1024), float(i)))


def test_a_larger_state_replaces_the_segment_releasing_the_old_one_first():
    pool = StagingPool(pin=False)
    small = pool.lease(1 << 20)
    first = small.segment
    small.release()
    assert pool._free == [first]
    big = pool.lease(4 << 20)
    assert first.base is None and pool._free == []  # released before the new one was made
    grown = big.segment
    assert (4 << 20) <= grown.nbytes <= int((4 << 20) * 1.05)
    big.release()
    again = pool.lease(2 << 20)  # fits in the free one: reused
    assert again.segment is grown
    again.release()
    again.release()  # idempotent
    assert pool.leased == 0
    pool.release_free()
    assert pool._free == []


def test_copy_in_aligns_and_keeps_dtypes_shapes_and_empty_tensors():
    pool = StagingPool(pin=False)
    tensors = [torch.arange(3, dtype=torch.int8), torch.randn(5, 7).t(),  # not contiguous
               torch.empty(0, 4), torch.ones(2, dtype=torch.bfloat16)]
    lease = pool.lease(staged_nbytes(tensors))
    host = lease.copy_in(tensors)
    for src, dst in zip(tensors, host):
        assert dst.dtype == src.dtype and dst.shape == src.shape and torch.equal(dst, src)
        assert dst.data_ptr() % 64 == 0 or dst.numel() == 0
    lease.release()
    pool.release_free()


def test_exact_storage_makes_torch_save_write_only_the_view():
    pool = StagingPool(pin=False)
    lease = pool.lease(8 << 20)
    (view,) = lease.copy_in([torch.arange(10.0)])
    assert view.untyped_storage().nbytes() > 40
    exact = exact_storage(view)
    assert exact.data_ptr() == view.data_ptr() and exact.untyped_storage().nbytes() == 40
    buf = io.BytesIO()
    torch.save(exact, buf)
    assert buf.tell() < 4096  # not the 8 MiB segment
    assert torch.equal(torch.load(io.BytesIO(buf.getvalue())), torch.arange(10.0))
    lease.release()
    pool.release_free()


def test_persistent_worker_gets_references_not_copies(tmp_path):
    sd = _state("cpu", 3, rows=2048)  # 8 MiB
    request = dc.save(sd, str(tmp_path / "c"), async_sharded_save=True)
    payload = async_utils._dumps_request(request._replace(
        async_fn_args=tuple(request.staged_args()), preload_fn=None, finalize_fns=[]))
    assert len(payload) < 64 << 10
    staging_pool().release_free()
    request.finalize_fns.clear()


def test_segments_of_dead_processes_are_reclaimed():
    dead = os.path.join(_shm_dir(), f"{SEGMENT_PREFIX}999999999_deadbeef0000")
    mine = os.path.join(_shm_dir(), f"{SEGMENT_PREFIX}{os.getpid()}_keepme000000")
    for p in (dead, mine):
        open(p, "wb").close()
    try:
        staging_pool()
        assert not os.path.exists(dead) and os.path.exists(mine)
    finally:
        for p in (dead, mine):
            if os.path.exists(p):
                os.unlink(p)


@pytest.mark.parametrize("device", DEVICES)
def test_async_checkpointer_stages_device_tensors_pinned_and_reuses_the_segment(tmp_path, device):
    from ckpt_tool.dist_checkpointing.checkpointer import (
        CheckpointerConfig,
        CheckpointStagerConfig,
        make_async_checkpointer,
    )

    cp = make_async_checkpointer(CheckpointerConfig(
        staging_config=CheckpointStagerConfig(use_async_staging=False)))
    try:
        segments = set()
        for i in range(3):
            sd = {"w": torch.full((64, 256), float(i), device=device),
                  "b": torch.arange(8, dtype=torch.bfloat16, device=device) + i}
            _, write_future = cp.save(str(tmp_path / f"c{i}"), sd)
            sd["w"].add_(100)
            del sd
            write_future.result()
            segment = cp._checkpoint_stager.segment
            segments.add(id(segment))
            assert segment.pinned == (device == "cuda")
        assert len(segments) == 1
        for i in range(3):
            loaded = cp.load(str(tmp_path / f"c{i}"))
            assert torch.equal(loaded["w"].cpu(), torch.full((64, 256), float(i)))
            assert torch.equal(loaded["b"].cpu(), torch.arange(8, dtype=torch.bfloat16) + i)
    finally:
        cp.close()
