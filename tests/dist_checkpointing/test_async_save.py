"""Asynchronous save (Megatron-Core's ``async_sharded_save`` + ``AsyncCallsQueue``).

Single-process tests run here; the distributed ones run ``_workers/async_worker.py`` under
torchrun (2 gloo ranks) and check what it reports and what it wrote: snapshot semantics (live
tensors mutated right after ``save()`` returns), failures surfacing on every rank with no
``metadata.json``, worker reuse, plan caching, no leaks over 100 saves, and loads with the real
Megatron-Core 0.16.1.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from ckpt_tool import dist_checkpointing as dc
from ckpt_tool.dist_checkpointing import serialization
from ckpt_tool.dist_checkpointing.core import CheckpointingException
from ckpt_tool.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from ckpt_tool.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest
from ckpt_tool.ops.validate import validate

sys.path.insert(0, str(Path(__file__).parent / "_workers"))
import layouts  # noqa: E402
from launch import torchrun  # noqa: E402


def _state():
    return {"a": ShardedTensor.from_rank_offsets("a", torch.arange(6.0).reshape(2, 3)),
            "b": ShardedTensor.from_rank_offsets("b", torch.ones(4, dtype=torch.bfloat16)),
            "obj": ShardedObject("obj", {"k": [1, 2]}, (1,), (0,)),
            "iteration": 7}


def _incomplete(path) -> list:
    return [f.message for f in validate(path).errors if "not a complete checkpoint" in f.message]


# -- single process -------------------------------------------------------------------------

def test_async_request_is_megatron_namedtuple():
    calls = []
    req = AsyncRequest(lambda rank, data, q: calls.append(data), (0, "live", None), [],
                       preload_fn=lambda: "staged")
    assert req._fields == ("async_fn", "async_fn_args", "finalize_fns", "async_fn_kwargs",
                           "preload_fn", "is_frozen", "call_idx")
    req.add_finalize_fn(lambda: calls.append("finalized"))
    frozen = req.freeze()
    assert frozen.is_frozen and not req.is_frozen
    with pytest.raises(RuntimeError):
        frozen.add_finalize_fn(lambda: None)
    frozen.execute_sync()
    assert calls == ["staged", "finalized"]


def test_in_place_updates_after_save_do_not_reach_the_files(tmp_path, monkeypatch):
    order = []
    real_save_config = serialization.save_config

    def recording_save_config(config, ckpt_dir):  # what exists when the marker is written
        order.append(sorted(p.name for p in Path(ckpt_dir).iterdir()))
        real_save_config(config, ckpt_dir)

    monkeypatch.setattr(serialization, "save_config", recording_save_config)
    sd = _state()
    queue = AsyncCallsQueue()
    request = dc.save(sd, str(tmp_path), async_sharded_save=True)
    sd["a"].data.add_(100)
    queue.schedule_async_request(request)
    sd["b"].data.fill_(-5)
    assert not (tmp_path / "metadata.json").exists()
    assert queue.maybe_finalize_async_calls(blocking=True, no_dist=True) == [0]
    queue.close()
    # the integrity manifest is written just before the marker, and lists it
    assert order == [[".metadata", "__0_0.distcp", "__0_1.distcp", "common.pt",
                      "integrity.json"]]
    loaded = dc.load_plain_tensors(str(tmp_path))
    assert torch.equal(loaded["a"], torch.arange(6.0).reshape(2, 3))
    assert torch.equal(loaded["b"], torch.ones(4, dtype=torch.bfloat16))
    assert validate(tmp_path, deep=True).errors == []
    manifest = json.loads((tmp_path / "integrity.json").read_text())
    assert manifest["algorithm"] == "sha256"
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "__0_1.distcp",
                                         "common.pt", "metadata.json"]
    assert manifest["files"]["metadata.json"] == hashlib.sha256(
        (tmp_path / "metadata.json").read_bytes()).hexdigest()


def test_write_error_leaves_no_marker(tmp_path):
    queue = AsyncCallsQueue()
    request = dc.save(_state(), str(tmp_path), async_sharded_save=True)
    (tmp_path / "__0_0.distcp").mkdir()  # the worker cannot open its data file
    queue.schedule_async_request(request)
    with pytest.raises(CheckpointingException, match="IsADirectoryError"):
        queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    queue.close()
    assert not (tmp_path / "metadata.json").exists() and not (tmp_path / ".metadata").exists()
    assert _incomplete(tmp_path)


@pytest.mark.parametrize("hung_starts", [1, 2])
def test_hung_forked_writer_is_replaced_or_fails(tmp_path, monkeypatch, hung_starts):
    from ckpt_tool.dist_checkpointing.strategies import async_utils

    real = async_utils._forked_main
    starts = tmp_path / "starts"
    starts.mkdir()

    def hang_first_starts(ack_fd, fn, args, kwargs):  # like a child deadlocked after fork
        n = len(list(starts.iterdir()))
        (starts / str(n)).touch()
        if n < hung_starts:
            time.sleep(120)
        real(ack_fd, fn, args, kwargs)

    monkeypatch.setattr(async_utils, "_forked_main", hang_first_starts)
    # the library's own wait for a start (_FORK_ACK_S), not a shorter one: a healthy start on
    # a busy machine must not read as hung
    monkeypatch.setattr(async_utils, "_FORK_ATTEMPTS", 2)
    ckpt = tmp_path / "ckpt"
    queue = AsyncCallsQueue()
    queue.schedule_async_request(dc.save(_state(), str(ckpt), async_sharded_save=True))
    if hung_starts < 2:
        assert queue.maybe_finalize_async_calls(blocking=True, no_dist=True) == [0]
        assert torch.equal(dc.load_plain_tensors(str(ckpt))["a"], torch.arange(6.0).reshape(2, 3))
    else:
        with pytest.raises(CheckpointingException, match="could not start"):
            queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
        assert not (ckpt / "metadata.json").exists()
    queue.close()
    assert len(list(starts.iterdir())) == min(hung_starts + 1, 2)
    assert multiprocessing.active_children() == []


def test_async_save_over_complete_checkpoint_drops_old_marker(tmp_path):
    dc.save(_state(), str(tmp_path))
    assert (tmp_path / "metadata.json").exists()
    request = dc.save(_state(), str(tmp_path), async_sharded_save=True)
    assert not (tmp_path / "metadata.json").exists()  # until this save is finalized
    request.execute_sync()
    assert (tmp_path / "metadata.json").exists()


# -- torchrun, 2 gloo ranks -----------------------------------------------------------------

def _reports(out: str) -> list:
    """Every ``RESULT {json}`` record in a torchrun output (ranks' lines may interleave)."""
    decoder = json.JSONDecoder()
    return [decoder.raw_decode(chunk)[0] for chunk in out.split("RESULT ")[1:]
            if chunk.startswith("{")]


def _run(mode: str, base: Path) -> dict:
    out = torchrun("async_worker.py", 2, "--mode", mode, "--dir", str(base), timeout=600)
    return {(rec.pop("case"), rec.pop("rank")): rec for rec in _reports(out)}


@pytest.fixture(scope="module")
def temporal(tmp_path_factory):
    return _run("temporal", tmp_path_factory.mktemp("async_temporal"))


@pytest.fixture(scope="module")
def persistent(tmp_path_factory):
    return _run("persistent", tmp_path_factory.mktemp("async_persistent"))


def _check_layouts_values(ckpt: str) -> None:
    loaded = dc.load_plain_tensors(ckpt)
    truth = layouts.global_tensors()
    assert set(truth) <= set(loaded)
    for key, value in truth.items():
        assert torch.equal(loaded[key], value), key
    assert validate(ckpt).errors == []


def _check_failed_everywhere(results: dict, case: str) -> str:
    raised = [results[(case, r)]["raised"] for r in (0, 1)]
    assert all(raised), raised
    ckpt = Path(results[(case, 0)]["dir"])
    assert not (ckpt / "metadata.json").exists() and not (ckpt / ".metadata").exists()
    assert _incomplete(ckpt)
    return raised[1]


@pytest.mark.multiproc
@pytest.mark.parametrize("mode", ["temporal", "persistent"])
def test_mp_mutation_after_save_not_in_checkpoint(mode, request):
    results = request.getfixturevalue(mode)
    assert [results[("mutate", r)]["raised"] for r in (0, 1)] == [None, None]
    _check_layouts_values(results[("mutate", 0)]["dir"])


@pytest.mark.multiproc
@pytest.mark.parametrize("mode", ["temporal", "persistent"])
def test_mp_write_exception_fails_on_every_rank(mode, request):
    message = _check_failed_everywhere(request.getfixturevalue(mode), "raise")
    assert "rank 1" in message and "IsADirectoryError" in message


@pytest.mark.multiproc
@pytest.mark.parametrize("mode", ["temporal", "persistent"])
def test_mp_killed_worker_fails_on_every_rank(mode, request):
    results = request.getfixturevalue(mode)
    message = _check_failed_everywhere(results, "kill")
    pid = results[("kill", 1)]["killed"]
    assert pid and str(pid) in message and "-9" in message
    assert "rank(s) [1]" in results[("kill", 0)]["raised"]
    # the partial file of the killed writer is there, but nothing vouches for it
    assert (Path(results[("kill", 0)]["dir"]) / "__1_0.distcp").read_bytes() == b"partial"


@pytest.mark.multiproc
def test_mp_persistent_worker_serves_saves_and_recovers(persistent):
    assert [persistent[("after_kill", r)]["raised"] for r in (0, 1)] == [None, None]
    _check_layouts_values(persistent[("after_kill", 0)]["dir"])
    for rank in (0, 1):
        reuse = persistent[("reuse", rank)]
        assert len(set(reuse["pids"])) == 1
        assert all(o["raised"] is None for o in reuse["outcomes"])
    for ckpt in persistent[("reuse", 0)]["dirs"]:
        _check_layouts_values(ckpt)


@pytest.mark.multiproc
def test_mp_cached_structure_skips_planning_collectives(temporal):
    for rank in (0, 1):
        cached = temporal[("cached", rank)]
        # gather + broadcast of plans, again (the plan is validated, as MCore), then none while
        # the structure holds, then a re-plan
        assert cached["planning_collectives"] == [2, 2, 0, 2]
        assert cached["reused"] == [False, True, True, False]
    for i, ckpt in enumerate(temporal[("cached", 0)]["dirs"]):
        loaded = dc.load_plain_tensors(ckpt)
        expected = torch.cat([torch.full((2, 3), float(10 * i + r)) for r in (0, 1)])
        assert torch.equal(loaded["w"], expected)
        assert ("extra" in loaded) == (i == 3)
        assert validate(ckpt).errors == []


@pytest.mark.multiproc
@pytest.mark.parametrize("mode", ["temporal", "persistent"])
def test_mp_100_saves_leak_nothing_and_close_ends_workers(mode, request):
    results = request.getfixturevalue(mode)
    for rank in (0, 1):
        loop = results[("loop", rank)]
        assert loop["n"] == 100
        assert loop["after"] == loop["before"]  # children, fds, shm mappings, result files
        assert loop["after"]["result_files"] == []
        assert loop["last"] == [99.0] * 4 + [109.0] * 4
        closed = results[("closed", rank)]
        assert closed["unfinalized"] == 0
        assert closed["children"] == [] and closed["mp_children"] == 0
        assert closed["shm_maps"] <= loop["before"]["shm_maps"]
        assert closed["result_files"] == []


@pytest.mark.multiproc
@pytest.mark.interop
def test_mp_real_megatron_core_loads_async_checkpoints(temporal, persistent):
    pytest.importorskip("megatron.core")
    dirs = [temporal[("mutate", 0)]["dir"], persistent[("mutate", 0)]["dir"],
            persistent[("reuse", 0)]["dirs"][-1]]
    out = torchrun("async_worker.py", 2, "--mode", "mcore-load",
                   *[a for d in dirs for a in ("--dir", d)], timeout=600)
    reports = _reports(out)
    assert sorted((r["rank"], r["dir"]) for r in reports) == sorted(
        (rank, d) for rank in (0, 1) for d in dirs)
    assert all(r["errors"] == [] for r in reports), reports


class _ForeignRequest(NamedTuple):
    """A request class of another library with AsyncRequest's fields (nvidia-resiliency-ext's
    local checkpoint manager hands Megatron-LM such requests, which it schedules on our queue)."""

    async_fn: Any
    async_fn_args: tuple
    finalize_fns: list
    async_fn_kwargs: dict = {}
    preload_fn: Any = None
    is_frozen: bool = False
    call_idx: int = 0

    def freeze(self):
        return self._replace(is_frozen=True)


def _write_staged(path, staged, suffix):
    Path(path).write_text(staged + suffix)


def _staged_text():
    return "staged"


@pytest.mark.parametrize("persistent", [False, True])
def test_a_request_of_another_class_with_the_same_fields_is_scheduled(tmp_path, persistent):
    target, done = tmp_path / "out.txt", []
    request = _ForeignRequest(_write_staged, (str(target), None, "!"), [lambda: done.append(1)],
                              preload_fn=_staged_text)
    queue = AsyncCallsQueue(persistent=persistent)
    try:
        queue.schedule_async_request(request)
        assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    finally:
        queue.close()
    assert target.read_text() == "staged!" and done == [1]


def _fail(*_):
    raise OSError("disk gone")


def _raise_foreign():
    raise KeyError("the foreign finalize saw the failure")


@pytest.mark.parametrize("foreign", [False, True])
def test_a_failed_write_runs_only_a_foreign_requests_finalize_functions(tmp_path, foreign):
    done = []
    fns = [lambda: done.append(1)]
    kind = _ForeignRequest if foreign else AsyncRequest
    queue = AsyncCallsQueue()
    try:
        queue.schedule_async_request(kind(_fail, (), list(fns)))
        with pytest.raises(CheckpointingException, match="failed on rank"):
            queue.maybe_finalize_async_calls(blocking=True)
        assert done == ([1] if foreign else [])
        queue.schedule_async_request(kind(_fail, (), [_raise_foreign]))
        with pytest.raises(KeyError if foreign else CheckpointingException):
            queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()
