"""Writing checkpoints to an S3-compatible server (moto, on 127.0.0.1): the order readers
rely on, dropped connections, killed runs and their leftovers, the library's save/load."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpt_tool.cli.app import app

from _s3 import FIXTURES, needs_server

needs_server()

runner = CliRunner()
GPT = FIXTURES / "mcore016_gpt_tp2pp2_fp32"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def puts(monkeypatch):
    """The keys uploaded (``Store.put_file``), in the order the uploads finished."""
    from ckpt_tool.storage.s3 import Store

    seen: list[str] = []
    real = Store.put_file

    def spy(self, key, path, size):
        real(self, key, path, size)
        seen.append(key)

    monkeypatch.setattr(Store, "put_file", spy)
    return seen


def _ok(args: list[str]) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return result.output


def test_outputs_go_up_data_first_and_their_markers_last(s3, puts):
    # (a save directory in: a save directory out, its tracker file the very last object)
    it = GPT / "iter_0000010"
    for src, to, name, last in (
            (it, "torch_dist", "td", "iter_0000010/metadata.json"),
            (it, "dcp", "d", ".metadata"),  # (plain DCP: no container)
            (GPT, "torch_dist", "sd", "latest_checkpointed_iteration.txt"),
            (GPT, "legacy", "leg", "latest_checkpointed_iteration.txt")):
        puts.clear()
        _ok(["convert", str(src), s3.url(name), "--to", to])
        assert puts[-1] == f"{name}/{last}", puts
        data = [i for i, k in enumerate(puts) if not k.rsplit("/", 1)[-1].endswith(
            (".json", ".metadata", ".txt"))]
        markers = [i for i, k in enumerate(puts) if k.endswith((".metadata", "metadata.json",
                                                                "iteration.txt"))]
        assert data and max(data) < min(markers), puts
        assert not s3.keys(f".{name}.ckpt-writing") and not s3.uploads()
        assert json.loads(runner.invoke(app, ["validate", s3.url(name), "--deep", "--json"])
                          .stdout)["ok"] if to != "legacy" else True
    # what came back is what went up
    for name in ("td", "d", "sd"):
        _ok(["diff", s3.url(name), str(GPT)])
    assert "sd/iter_0000010/metadata.json" in s3.keys("sd/")


def test_reshard_and_single_files_to_the_server(s3, tmp_path):
    src = s3.upload(GPT, "gpt")
    _ok(["reshard", src, s3.url("tp1"), "--tp", "1", "--pp", "1"])
    doc = json.loads(runner.invoke(app, ["validate", s3.url("tp1"), "--deep", "--json"]).stdout)
    assert doc["ok"] and doc["format"] == "torch_dist"
    _ok(["reshard", str(GPT), str(tmp_path / "tp1"), "--tp", "1", "--pp", "1"])
    _ok(["diff", s3.url("tp1"), str(tmp_path / "tp1")])
    _ok(["convert", src, s3.url("m/model.safetensors"), "--to", "safetensors"])
    assert s3.keys("m/") == ["m/model.safetensors", "m/model.safetensors.ckpt-manifest.json"]


def test_an_existing_output_is_refused_then_replaced_with_overwrite(s3):
    _ok(["convert", str(GPT), s3.url("out"), "--to", "dcp"])
    before = s3.keys("out/")
    result = runner.invoke(app, ["convert", str(GPT), s3.url("out"), "--to", "torch_dist"])
    assert result.exit_code == 2 and "already exists" in result.output
    assert s3.keys("out/") == before
    _ok(["convert", str(GPT), s3.url("out"), "--to", "torch_dist", "--overwrite"])
    after = s3.keys("out/")
    assert "out/iter_0000010/metadata.json" in after and json.loads(runner.invoke(
        app, ["inspect", s3.url("out"), "--json"]).stdout)["format"] == "torch_dist"


def test_an_upload_cut_once_is_retried(s3):
    s3.proxy.cut_up_once(200 << 10)  # somewhere in the data files
    _ok(["convert", str(GPT), s3.url("out"), "--to", "dcp"])
    assert s3.proxy.cuts == 1
    _ok(["diff", s3.url("out"), str(GPT)])


def test_uploads_that_always_break_leave_nothing_visible(s3):
    s3.proxy.cut_big_requests(16 << 10)  # every data file's PUT breaks mid-body
    result = runner.invoke(app, ["convert", str(GPT), s3.url("out"), "--to", "torch_dist"])
    assert result.exit_code == 2, result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("ckpt: error:") and "connection" in last, result.output
    assert s3.proxy.cuts > 0
    assert s3.keys() == [] and s3.uploads() == []  # not a half checkpoint, no run marker


_KILLED = textwrap.dedent("""\
    import os, sys, time
    from ckpt_tool.storage import s3
    ready = sys.argv[1]
    real = s3.Store.put_file
    def put_file(self, key, path, size):
        if key.endswith(".distcp"):  # an upload left open, as a kill mid-multipart leaves it
            c = self.client
            up = c.create_multipart_upload(Bucket=self.spec.bucket, Key=key)["UploadId"]
            c.upload_part(Bucket=self.spec.bucket, Key=key, UploadId=up, PartNumber=1,
                          Body=b"x" * 1024)
            open(ready, "w").close()
            time.sleep(600)
        real(self, key, path, size)
    s3.Store.put_file = put_file
    from ckpt_tool.cli.app import main
    sys.argv = ["ckpt"] + sys.argv[2:]
    main()
    """)


def test_a_killed_run_is_reported_then_reclaimed(s3, tmp_path):
    ready = tmp_path / "ready"
    script = tmp_path / "killed.py"
    script.write_text(_KILLED)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, str(script), str(ready), "convert", str(GPT),
                             s3.url("out"), "--to", "torch_dist"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        for _ in range(1200):  # the run reaches its first data upload (bounded wait)
            if ready.exists() or proc.poll() is not None:
                break
            time.sleep(0.25)
        assert ready.exists(), proc.stderr.read().decode() if proc.poll() is not None else \
            "the run never reached its upload"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert s3.keys(".out.ckpt-writing") and s3.uploads("out/")
    assert not [k for k in s3.keys("out/") if k.endswith(("metadata.json", "iteration.txt"))]
    for cmd, code in (("inspect", 2), ("validate", 1)):
        result = runner.invoke(app, [cmd, s3.url("out")])
        assert result.exit_code == code, result.output
        assert "unfinished write left" in result.output and "open multipart upload" in \
            result.output, result.output
    result = runner.invoke(app, ["convert", str(GPT), s3.url("out"), "--to", "torch_dist"])
    assert result.exit_code == 0, result.output
    assert "reclaimed" in result.output and "multipart" in result.output
    assert s3.uploads() == [] and not s3.keys(".out.ckpt-writing")
    _ok(["diff", s3.url("out"), str(GPT)])


def test_a_live_run_holds_the_target(s3):
    from ckpt_tool.storage import as_path
    from ckpt_tool.storage.writing import run_marker

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        marker = run_marker(as_path(s3.url("out")))
        s3.client.put_object(Bucket=s3.bucket, Key=marker.key, Body=json.dumps(
            {"host": socket.gethostname(), "pid": sleeper.pid, "started": time.time(),
             "heartbeat": time.time()}).encode())
        result = runner.invoke(app, ["convert", str(GPT), s3.url("out"), "--to", "dcp"])
        assert result.exit_code == 2 and f"pid {sleeper.pid}" in result.output, result.output
    finally:
        sleeper.kill()
        sleeper.wait(timeout=60)
    _ok(["convert", str(GPT), s3.url("out"), "--to", "dcp"])  # its run is gone: taken over


def test_the_library_saves_and_loads_s3_and_msc(s3, tmp_path, monkeypatch):
    import torch

    from ckpt_tool import dist_checkpointing as dc
    from ckpt_tool.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    def state():
        return {"w": ShardedTensor.from_rank_offsets("w", torch.arange(12.).reshape(3, 4)),
                "o": ShardedObject("o", {"a": 1}, (1,), (0,)), "iteration": 7}

    cfg = tmp_path / "msc.yaml"
    cfg.write_text(f"profiles:\n  p:\n    storage_provider:\n      type: s3\n      options:\n"
                   f"        base_path: {s3.bucket}/msc\n")
    monkeypatch.setenv("MSC_CONFIG", str(cfg))
    for url in (s3.url("lib"), "msc://p/lib"):
        dc.save(state(), url)
        loaded = dc.load(state(), url)
        assert torch.equal(loaded["w"], torch.arange(12.).reshape(3, 4))
        assert loaded["o"] == {"a": 1} and loaded["iteration"] == 7
        assert set(dc.load_tensors_metadata(url)) == {"w"}
        assert torch.equal(dc.load_plain_tensors(url)["w"], loaded["w"])
        doc = json.loads(runner.invoke(app, ["validate", url, "--deep", "--json"]).stdout)
        assert doc["ok"] and doc["stats"]["manifest_files"] >= 3, doc
    assert "msc/lib/metadata.json" in s3.keys("msc/") and not s3.keys(".lib.ckpt-writing")
    dc.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}, s3.url("lib"))
    assert torch.equal(dc.load_plain_tensors(s3.url("lib"))["w"], torch.ones(2))


def _big_checkpoint(path: Path) -> None:
    import torch

    from ckpt_tool import dist_checkpointing as dc
    from ckpt_tool.dist_checkpointing.mapping import ShardedTensor

    t = torch.arange(5 << 20, dtype=torch.float32)  # 20 MiB: a multipart upload below
    dc.save({"big": ShardedTensor.from_rank_offsets("big", t)}, str(path))


def test_multipart_uploads_complete_or_are_aborted(s3, tmp_path, monkeypatch):
    from ckpt_tool.storage import s3 as s3_module

    _big_checkpoint(tmp_path / "big")
    monkeypatch.setattr(s3_module, "MULTIPART", 1 << 20)
    _ok(["convert", str(tmp_path / "big"), s3.url("ok"), "--to", "torch_dist"])
    assert json.loads(runner.invoke(app, ["validate", s3.url("ok"), "--deep", "--json"])
                      .stdout)["ok"]
    s3.proxy.cut_big_requests(2 << 20)  # every part breaks mid-body
    result = runner.invoke(app, ["convert", str(tmp_path / "big"), s3.url("cut"), "--to",
                                 "torch_dist"])
    assert result.exit_code == 2 and s3.proxy.cuts > 0, result.output
    assert s3.keys("cut/") == [] and s3.uploads() == [] and not s3.keys(".cut.ckpt-writing")


@pytest.mark.multiproc
def test_the_library_saves_and_loads_under_torchrun(s3):
    """2 gloo ranks save to the server, each from its own spool; both reshard on load."""
    sys.path.insert(0, str(ROOT / "tests" / "dist_checkpointing" / "_workers"))
    from launch import torchrun

    url = s3.url("mp")
    torchrun("dist_worker.py", 2, "--lib", "ours", "--op", "save", "--layout", "tp2pp1",
             "--dir", url)
    keys = set(s3.keys("mp/"))
    assert {"mp/metadata.json", "mp/.metadata", "mp/common.pt", "mp/integrity.json"} <= keys
    assert any(k.startswith("mp/__1_") for k in keys)  # rank 1's data, from its own spool
    assert not s3.keys(".mp.ckpt-writing") and s3.uploads() == []
    torchrun("dist_worker.py", 2, "--lib", "ours", "--op", "load", "--layout", "tp2pp1",
             "--dir", url)
    torchrun("dist_worker.py", 2, "--lib", "ours", "--op", "load", "--layout", "tp1pp2",
             "--no-objects", "--dir", url)  # (objects are keyed by the layout that saved)
    doc = json.loads(runner.invoke(app, ["validate", url, "--deep", "--json"]).stdout)
    assert doc["ok"], doc["findings"]
