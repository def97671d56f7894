"""The Checkpointer API (PyTorch's experimental checkpointer, writing ``torch_dist``).

Single-process tests run here; the distributed ones run ``_workers/checkpointer_worker.py``
under torchrun (2 gloo ranks) once and check what it reports and what it wrote: round trips,
snapshot semantics (live tensors mutated once staging is done), failures surfacing at
``write_future`` on every rank with no ``metadata.json``, no leaks over 100 saves, ``close()``
leaving no children, and loads with the real Megatron-Core 0.16.1.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from pathlib import Path

import pytest
import torch

from ckpt_tool import dist_checkpointing as dc
from ckpt_tool.dist_checkpointing._staging import SharedSegment, dumps_staged, loads_staged
from ckpt_tool.dist_checkpointing.checkpointer import (
    PATHS_KEY,
    AsyncCheckpointer,
    CheckpointerConfig,
    CheckpointProcessError,
    CheckpointStagerConfig,
    DefaultStager,
    RankInfo,
    SyncCheckpointer,
    make_async_checkpointer,
    make_sync_checkpointer,
    prepare_state_dict,
    wrap_future,
)
from ckpt_tool.dist_checkpointing.mapping import ShardedTensor
from ckpt_tool.errors import UsageError
from ckpt_tool.ops.validate import validate

sys.path.insert(0, str(Path(__file__).parent / "_workers"))
from launch import torchrun  # noqa: E402


def _state():
    return {"model": {"w": torch.arange(12.0).reshape(3, 4),
                      "b": torch.ones(3, dtype=torch.bfloat16)},
            "optim": {"state": {0: {"exp_avg": torch.full((2,), 0.5)}}, "lr": [0.1, 0.2]},
            "step": 7}


def _incomplete(path) -> list:
    return [f.message for f in validate(path).errors if "not a complete checkpoint" in f.message]


def _children() -> set:
    return {p.pid for p in multiprocessing.active_children()}


def _my_shm_files() -> list:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"ckpt_stage_{os.getpid()}_")]


# -- single process -------------------------------------------------------------------------

def test_plain_tensors_are_replicated_with_one_main_replica_per_key_balanced():
    sd = {"a": torch.zeros(100), "b": {"c": torch.zeros(60), "d": torch.zeros(50)}, "n": 1}
    main = {}
    for rank in (0, 1):
        prepared = prepare_state_dict(sd, RankInfo(rank, 2))
        assert prepared[PATHS_KEY] == {"a": ["a"], "b.c": ["b", "c"], "b.d": ["b", "d"]}
        for sh in (prepared["a"], prepared["b"]["c"], prepared["b"]["d"]):
            assert isinstance(sh, ShardedTensor) and sh.global_shape == sh.local_shape
            if sh.replica_id == 0:
                main.setdefault(sh.key, []).append(rank)
        assert prepared["n"] == 1 and prepare_state_dict(prepared, RankInfo(rank, 2)) is prepared
    assert main == {"a": [0], "b.c": [1], "b.d": [1]}  # 400 bytes vs 240 + 200
    assert sd["a"].__class__ is torch.Tensor  # the caller's dict is not modified
    with pytest.raises(UsageError, match="list"):
        prepare_state_dict({"x": [torch.zeros(1)]}, RankInfo(0, 1))
    with pytest.raises(UsageError, match="a.b"):
        prepare_state_dict({"a.b": torch.zeros(1), "a": {"b": torch.zeros(1)}}, RankInfo(0, 1))


def test_stager_reuses_its_shared_segment_and_ships_references_only():
    stager = DefaultStager(CheckpointStagerConfig(use_async_staging=True))
    live = {"t": torch.arange(1000.0), "u": {"v": torch.ones(10, dtype=torch.int64).t()},
            "sh": ShardedTensor.from_rank_offsets("sh", torch.zeros(4), replica_id=1), "k": [1],
            "empty": torch.zeros(0, 3)}
    staged = stager.stage(live).result()
    first = stager.segment.path
    live["t"].add_(5)
    live["k"].append(2)
    assert torch.equal(staged["t"], torch.arange(1000.0)) and staged["k"] == [1]
    assert staged["sh"].data is None  # another rank's replica: nothing to write here
    payload, segments = dumps_staged(staged)
    assert len(payload) < 1000 and segments == [stager.segment]  # data travel by reference
    attached = {}
    back = loads_staged(payload, lambda p, n: attached.setdefault(p, SharedSegment.attach(p, n)))
    assert torch.equal(back["t"], torch.arange(1000.0)) and list(attached) == [first]
    assert back["empty"].shape == (0, 3)
    stager.stage(live).result()
    assert stager.segment.path == first  # same size: the segment is reused
    stager.stage({"big": torch.zeros(10_000)}).result()
    assert stager.segment.path != first and not os.path.exists(first)
    stager.close()
    assert _my_shm_files() == []


def test_sync_checkpointer_round_trip_partial_and_strict(tmp_path):
    ckpt = str(tmp_path / "c")
    cp = make_sync_checkpointer()
    assert isinstance(cp, SyncCheckpointer) and cp.save(ckpt, _state()) is None
    assert validate(ckpt).errors == []
    everything = cp.load(ckpt, default_map_location="cpu")
    assert torch.equal(everything["model"]["w"], torch.arange(12.0).reshape(3, 4))
    assert torch.equal(everything["optim"]["state"][0]["exp_avg"], torch.full((2,), 0.5))
    assert everything["optim"]["lr"] == [0.1, 0.2] and everything["step"] == 7
    assert PATHS_KEY not in everything
    target = {"model": {"w": torch.zeros(3, 4)}, "step": 0, "new": torch.zeros(1)}
    w = target["model"]["w"]
    partial = cp.load(ckpt, target)
    assert partial["model"]["w"] is w and torch.equal(w, torch.arange(12.0).reshape(3, 4))
    assert partial["step"] == 7 and torch.equal(partial["new"], torch.zeros(1))
    assert set(partial) == {"model", "step", "new"}
    with pytest.raises(RuntimeError, match=r"missing keys: \['new'\]"):
        cp.load(ckpt, target, strict=True)
    assert cp.load(ckpt, {"model": {"w": torch.zeros(3, 4)}}, strict=True)
    cp.close()


def test_async_checkpointer_single_rank_snapshot_reuse_and_close(tmp_path):
    others = _children()
    config = CheckpointerConfig(staging_config=CheckpointStagerConfig(use_async_staging=False))
    cp = make_async_checkpointer(config)
    assert isinstance(cp, AsyncCheckpointer)
    for i in range(3):
        sd = _state()
        sd["step"] = i
        stage_future, write_future = cp.save(str(tmp_path / f"s{i}"), sd)
        assert stage_future.done()  # synchronous staging: done when save() returns
        for t in (sd["model"]["w"], sd["model"]["b"], sd["optim"]["state"][0]["exp_avg"]):
            t.add_(100)
        sd["step"] = -1
    pid = cp._checkpoint_process.pid
    write_future.result()
    for i in range(3):
        loaded = cp.load(str(tmp_path / f"s{i}"))
        assert torch.equal(loaded["model"]["w"], torch.arange(12.0).reshape(3, 4))
        assert torch.equal(loaded["model"]["b"], torch.ones(3, dtype=torch.bfloat16))
        assert loaded["step"] == i and validate(tmp_path / f"s{i}").errors == []
    assert _children() - others == {pid}
    cp.close()
    assert _children() - others == set() and _my_shm_files() == []


def test_async_write_error_surfaces_at_write_future_and_leaves_no_marker(tmp_path):
    ckpt = tmp_path / "c"
    (ckpt / "__0_0.distcp").mkdir(parents=True)  # the write cannot open its data file
    others = _children()
    cp = make_async_checkpointer()
    stage_future, write_future = cp.save(str(ckpt), _state())
    stage_future.result()
    with pytest.raises(CheckpointProcessError, match="IsADirectoryError"):
        write_future.result()
    assert not (ckpt / "metadata.json").exists() and not (ckpt / ".metadata").exists()
    assert _incomplete(ckpt)
    with pytest.raises(CheckpointProcessError):  # save() re-raises the previous failure
        cp.save(str(tmp_path / "next"), _state())
    cp.close()
    assert _children() - others == set() and _my_shm_files() == []


def test_wrap_future_propagates_exceptions():
    from concurrent.futures import Future

    assert wrap_future({"a": 1}).result() is None
    f = Future()
    wrapped = wrap_future(f)
    f.set_exception(ValueError("x"))
    with pytest.raises(ValueError):
        wrapped.result()


# -- torchrun, 2 gloo ranks -----------------------------------------------------------------

def _reports(out: str) -> list:
    decoder = json.JSONDecoder()
    return [decoder.raw_decode(chunk)[0] for chunk in out.split("RESULT ")[1:]
            if chunk.startswith("{")]


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    base = tmp_path_factory.mktemp("checkpointer")
    out = torchrun("checkpointer_worker.py", 2, "--mode", "saves", "--dir", str(base),
                   timeout=600)
    return {(rec.pop("case"), rec.pop("rank")): rec for rec in _reports(out)}


def _check_values(ckpt: str) -> None:
    sys.path.insert(0, str(Path(__file__).parent / "_workers"))
    import checkpointer_worker

    loaded = dc.load_plain_tensors(ckpt)
    for key, value in checkpointer_worker.expected_tensors(2).items():
        assert torch.equal(loaded[key], value), key
    assert validate(ckpt).errors == []


@pytest.mark.multiproc
def test_mp_sync_round_trip_partial_and_strict_load(saves):
    for rank in (0, 1):
        r = saves[("sync", rank)]
        assert r["whole"] and r["in_place"] and r["own_rows"] and r["files"] == []
        assert r["step"] == 3 and r["extra"] == [0.0, 0.0]
        assert "missing keys: ['extra.x']" in r["strict"]
    _check_values(saves[("sync", 0)]["dir"])
    files = sorted(os.listdir(saves[("sync", 0)]["dir"]))
    assert "__0_0.distcp" in files and "__1_0.distcp" in files  # both ranks wrote data


@pytest.mark.multiproc
def test_mp_mutation_after_stage_future_not_in_checkpoint(saves):
    for rank in (0, 1):
        assert saves[("mutate", rank)]["raised"] is None
        assert saves[("mutate", rank)]["files"] == []
    _check_values(saves[("mutate", 0)]["dir"])


@pytest.mark.multiproc
def test_mp_100_saves_leak_nothing_and_close_ends_workers(saves):
    for rank in (0, 1):
        loop = saves[("loop", rank)]
        assert loop["n"] == 100 and loop["raised"] is None and loop["files"] == []
        assert loop["pids"] == 1  # one persistent checkpoint process served every save
        assert loop["after"] == loop["before"]  # children, fds, shm mappings and files
        # the staging segment is mapped (and reused) but its file is gone once attached
        assert loop["before"]["shm_files"] == [] and loop["before"]["shm_maps"] > 0
        assert loop["after"]["zombies"] == []
        closed = saves[("closed", rank)]
        assert closed["children"] == [] and closed["mp_children"] == 0
        assert closed["shm_files"] == [] and closed["shm_maps"] < loop["after"]["shm_maps"]
        assert closed["fds"] < loop["after"]["fds"]


@pytest.mark.multiproc
def test_mp_write_exception_fails_on_every_rank(saves):
    raised = [saves[("raise", r)]["raised"] for r in (0, 1)]
    assert all(m and "IsADirectoryError" in m and "rank 1" in m for m in raised), raised
    assert [saves[("raise", r)]["again"] for r in (0, 1)] == ["CheckpointProcessError"] * 2
    ckpt = Path(saves[("raise", 0)]["dir"])
    assert not (ckpt / "metadata.json").exists() and not (ckpt / ".metadata").exists()
    assert _incomplete(ckpt)


@pytest.mark.multiproc
def test_mp_killed_checkpoint_process_fails_on_every_rank(saves):
    killed = saves[("kill", 1)]
    assert killed["killed"] and f"pid {killed['killed']}" in killed["raised"]
    assert "exit code -9" in killed["raised"]
    assert "rank 0" in saves[("kill", 0)]["raised"]  # its peer's collectives broke
    ckpt = Path(saves[("kill", 0)]["dir"])
    assert not (ckpt / "metadata.json").exists() and _incomplete(ckpt)
    assert (ckpt / "__1_0.distcp").read_bytes() == b"partial"
    for rank in (0, 1):
        assert saves[("kill", rank)]["children"] == [] and saves[("kill", rank)]["shm_files"] == []


@pytest.mark.multiproc
@pytest.mark.interop
def test_mp_real_megatron_core_loads_checkpointer_checkpoints(saves):
    pytest.importorskip("megatron.core")
    dirs = [saves[("sync", 0)]["dir"], saves[("mutate", 0)]["dir"],
            str(Path(saves[("mutate", 0)]["dir"]).parent / "loop1")]
    out = torchrun("checkpointer_worker.py", 2, "--mode", "mcore-load",
                   *[a for d in dirs for a in ("--dir", d)], timeout=600)
    reports = _reports(out)
    assert sorted((r["rank"], r["dir"]) for r in reports) == sorted(
        (rank, d) for rank in (0, 1) for d in dirs)
    assert all(r["errors"] == [] for r in reports), reports
