"""Reading checkpoints from an S3-compatible server (moto, on 127.0.0.1): what is fetched,
what comes out, and what a dropped connection does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpt_tool.cli.app import app

from _s3 import FIXTURES, needs_server

needs_server()

runner = CliRunner()
GPT = FIXTURES / "mcore016_gpt_tp2pp2_fp32"  # a save directory: tracker + iter_0000010/
DCP = FIXTURES / "dcp_plain"
_METADATA = ("metadata.json", ".metadata", "common.pt", "latest_checkpointed_iteration.txt")
_SLACK = 48 << 10  # listings, response headers: what a metadata read costs beyond the files


def _metadata_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.name in _METADATA)


def _data_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.distcp"))


def _json(args: list[str]) -> dict:
    result = runner.invoke(app, args)
    assert result.exit_code in (0, 1), result.output
    return json.loads(result.stdout)


def test_inspect_and_validate_fetch_only_metadata(s3):
    url = s3.upload(GPT, "gpt")
    assert _data_bytes(GPT) > 4 * _SLACK  # else the bound below proves nothing
    bound = _metadata_bytes(GPT) + _SLACK
    for args in (["inspect", url, "--json"], ["validate", url, "--json"]):
        s3.proxy.reset()
        doc = _json(args)
        assert s3.proxy.down <= bound, (args[0], s3.proxy.down, bound)
    assert doc["ok"] is True and doc["root"] == url + "/iter_0000010"
    local = _json(["inspect", str(GPT), "--json"])
    remote = _json(["inspect", url, "--json"])
    assert remote["tensors"] == local["tensors"] and remote["common"] == local["common"]


def test_validate_deep_reads_everything_and_agrees_with_the_local_run(s3):
    for fixture, key in ((GPT, "gpt"), (DCP, "dcp")):
        url = s3.upload(fixture, key)
        s3.proxy.reset()
        remote = _json(["validate", url, "--deep", "--json"])
        assert s3.proxy.down >= _data_bytes(fixture)
        local = _json(["validate", str(fixture), "--deep", "--json"])
        assert remote["ok"] and remote["findings"] == local["findings"] == []
        for k in ("zip_items_checked", "tensors_read", "tensors", "objects"):
            assert remote["stats"].get(k) == local["stats"].get(k), k
        assert remote["nonfinite"] == local["nonfinite"]


def _damaged_copy(src: Path, dst: Path) -> str:
    """``src`` copied to ``dst`` with one byte of its biggest tensor item flipped (its zip
    record's CRC-32 no longer matches); the damaged file, relative to ``dst``."""
    import shutil

    from ckpt_tool.formats import open_checkpoint

    shutil.copytree(src, dst)
    with open_checkpoint(src) as reader:
        meta = reader.metadata()
        chunk = max((c for t in meta.tensors.values() for c in t.chunks),
                    key=lambda c: c.byte_length)
    rel = (Path(meta.root) / chunk.file).relative_to(src)
    data = bytearray((dst / rel).read_bytes())
    data[chunk.byte_offset + chunk.byte_length // 2] ^= 0xFF  # in the tensor's bytes
    (dst / rel).write_bytes(bytes(data))
    return rel.as_posix()


def test_a_damaged_remote_item_is_found_by_deep(s3, tmp_path):
    file = _damaged_copy(DCP, tmp_path / "dcp")
    url = s3.upload(tmp_path / "dcp", "bad")
    assert _json(["validate", url, "--json"])["ok"]  # metadata only: the bytes are not read
    doc = _json(["validate", url, "--deep", "--json"])
    assert not doc["ok"] and any(x["file"] == file for x in doc["findings"])


def test_a_damaged_remote_item_is_refused_as_a_local_one_is(s3, tmp_path):
    """convert (the torch path and the raw byte-moving one), reshard and diff check every
    item they read from the store against its CRC-32s, as for a local source: exit 1 naming
    the record, nothing written; --no-verify lets the damage through (what was refused)."""
    _damaged_copy(DCP, tmp_path / "dcp")
    _damaged_copy(GPT, tmp_path / "gpt")
    dcp, gpt = s3.upload(tmp_path / "dcp", "dcp"), s3.upload(tmp_path / "gpt", "gpt")
    runs = {"dcp": ["convert", dcp, str(tmp_path / "dcp_out"), "--to", "dcp"],
            "st": ["convert", dcp, str(tmp_path / "st_out"), "--to", "safetensors"],
            "tp1": ["reshard", gpt, str(tmp_path / "tp1_out"), "--tp", "1", "--pp", "1"]}
    for name, args in runs.items():
        result = runner.invoke(app, args)
        assert result.exit_code == 1, (name, result.output)
        assert "fails its CRC-32 check" in result.output, (name, result.output)
        assert not (tmp_path / f"{name}_out").exists(), name
        result = runner.invoke(app, args + ["--no-verify"])
        assert result.exit_code == 0, (name, result.output)
    result = runner.invoke(app, ["diff", gpt, str(GPT)])
    assert result.exit_code == 1 and "fails its CRC-32 check" in result.output, result.output


def test_convert_and_diff_from_the_server_match_the_local_source(s3, tmp_path):
    url = s3.upload(GPT, "gpt")
    for to in ("torch_dist", "dcp", "safetensors"):
        out = tmp_path / to
        result = runner.invoke(app, ["convert", url, str(out), "--to", to])
        assert result.exit_code == 0, result.output
        ref = tmp_path / f"ref_{to}"
        assert runner.invoke(app, ["convert", str(GPT), str(ref), "--to", to]).exit_code == 0
        d = runner.invoke(app, ["diff", str(out), str(ref)])
        assert d.exit_code == 0, d.output
    d = runner.invoke(app, ["diff", url, str(GPT)])
    assert d.exit_code == 0, d.output


def test_a_read_cut_once_is_retried(s3, tmp_path):
    url = s3.upload(GPT, "gpt")
    s3.proxy.cut_down_once(_metadata_bytes(GPT) + 20000)  # somewhere in the data
    result = runner.invoke(app, ["convert", url, str(tmp_path / "out"), "--to", "dcp"])
    assert result.exit_code == 0, result.output
    assert s3.proxy.cuts == 1
    assert runner.invoke(app, ["diff", str(tmp_path / "out"), str(GPT)]).exit_code == 0


def test_reads_that_always_break_are_one_clean_error(s3, tmp_path):
    url = s3.upload(GPT, "gpt")
    s3.proxy.cut_down_after(_metadata_bytes(GPT) + _SLACK)  # the server goes away mid-read
    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", url, str(out), "--to", "dcp"])
    assert result.exit_code == 2, result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("ckpt: error:") and "connection" in last and "Traceback" not in \
        result.output
    assert not out.exists() and not list(tmp_path.glob(".out.ckpt-*"))


def test_msc_profiles_as_megatron_core_names_them(s3, tmp_path, monkeypatch):
    s3.upload(GPT, "runs/gpt")
    cfg = tmp_path / "msc.yaml"
    cfg.write_text(textwrap.dedent(f"""\
        profiles:
          train:
            storage_provider:
              type: s3
              options:
                base_path: {s3.bucket}/runs
                endpoint_url: ${{CKPT_TEST_ENDPOINT}}
                region_name: us-east-1
            credentials_provider:
              type: S3Credentials
              options:
                access_key: ${{CKPT_TEST_KEY}}
                secret_key: testing
          disk:
            storage_provider:
              type: file
              options:
                base_path: {GPT.parent}
        """))
    monkeypatch.setenv("MSC_CONFIG", str(cfg))
    monkeypatch.setenv("CKPT_TEST_ENDPOINT", s3.endpoint)
    monkeypatch.setenv("CKPT_TEST_KEY", "testing")
    for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k)  # only the profile says where and who
    doc = _json(["inspect", "msc://train/gpt", "--json"])
    assert doc["root"] == "msc://train/gpt/iter_0000010"
    assert doc["tensors"] == _json(["inspect", str(GPT), "--json"])["tensors"]
    assert _json(["inspect", f"msc://disk/{GPT.name}", "--json"])["format"] == "torch_dist"
    result = runner.invoke(app, ["inspect", "msc://nosuch/x"])
    assert result.exit_code == 2 and "no multi-storage-client profile 'nosuch'" in result.output


def test_credentials_and_endpoint_from_an_aws_profile(s3, tmp_path, monkeypatch):
    url = s3.upload(DCP, "dcp")
    config, creds = tmp_path / "config", tmp_path / "credentials"
    config.write_text(f"[profile ckpt]\nregion = us-east-1\nendpoint_url = {s3.endpoint}\n")
    creds.write_text("[ckpt]\naws_access_key_id = testing\naws_secret_access_key = testing\n")
    for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
              "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_PROFILE", "ckpt")
    assert _json(["inspect", url, "--json"])["format"] == "dcp"


def test_missing_things_are_one_line_each(s3, monkeypatch):
    s3.upload(DCP, "dcp")
    for url, words in ((s3.url("nothing-here"), "no such object or prefix"),
                       (f"s3://{s3.bucket}-absent/x", "no such bucket")):
        result = runner.invoke(app, ["inspect", url])
        assert result.exit_code == 2, result.output
        assert words in result.output and "Traceback" not in result.output
    from ckpt_tool.storage.s3 import forget_stores

    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k)
    forget_stores()
    result = runner.invoke(app, ["inspect", s3.url("dcp")])
    assert result.exit_code == 2 and "no credentials" in result.output, result.output


def test_local_use_imports_no_object_store_client(tmp_path):
    """``import ckpt_tool`` and a local inspect load nothing of the s3 extra."""
    code = textwrap.dedent(f"""\
        import sys
        import ckpt_tool
        from typer.testing import CliRunner
        from ckpt_tool.cli.app import app
        r = CliRunner().invoke(app, ["inspect", {str(GPT)!r}])
        assert r.exit_code == 0, r.output
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("boto3", "botocore",
                        "s3transfer", "moto"))
        print(loaded)
        """)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("url", ["s3://b/k/x", "s3:/b/k/x"])
def test_urls_and_their_pathlib_spelling(url):
    from ckpt_tool.storage import as_path, is_remote

    p = as_path(Path(url) if url.count("//") == 0 else url)
    assert is_remote(p) and str(p) == "s3://b/k/x" and p.name == "x"
    assert str(p.parent / "y.distcp") == "s3://b/k/y.distcp" and (p / "a").suffix == ""
    assert not is_remote("./s3:/b") and not is_remote(Path("/data/s3:/b"))


def test_sequential_reads_come_from_the_read_ahead_and_are_exact(s3, monkeypatch):
    """Two interleaved sequential streams over an object, ranges straddling the windows'
    ends and the object's end: every byte as stored, most of them from the read-ahead."""
    import random

    from ckpt_tool.storage import as_path, read_ahead
    from ckpt_tool.storage import s3 as s3_module

    blob = random.Random(0).randbytes(5 << 20)
    s3.client.put_object(Bucket=s3.bucket, Key="blob", Body=blob)
    s3_module.forget_stores()
    monkeypatch.setattr(read_ahead, "AHEAD", 1 << 20)
    monkeypatch.setattr(read_ahead, "AHEAD_FROM", 1)
    served = []
    real = read_ahead.ReadAhead.take
    monkeypatch.setattr(read_ahead.ReadAhead, "take",
                        lambda self, *a: served.append(real(self, *a)) or served[-1])
    p = as_path(s3.url("blob"))
    streams = [0, 3 << 20]
    step = 300_000
    while any(s < len(blob) for s in streams):
        for i, at in enumerate(streams):
            if at < len(blob):
                buf = bytearray(step)
                n = p.read_into(at, buf)
                assert bytes(buf[:n]) == blob[at:at + step]
                streams[i] = at + step if at + step < (3 << 20) or i else 1 << 30
    assert sum(1 for x in served if x) > len(served) // 2, served
