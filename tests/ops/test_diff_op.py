"""``ops.diff``: real fixtures against themselves and each other, edited copies, other formats."""

import importlib.util
import io
import math
import shutil
import struct
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "formats"))
from _builders import split_grid, write_mcore_dist  # noqa: E402
from _items import refresh_crcs  # noqa: E402

import ckpt_tool.ops.diff._values as diff_values  # noqa: E402
import ckpt_tool.ops.diff._windows as diff_windows  # noqa: E402
from ckpt_tool.errors import CkptError, UsageError  # noqa: E402
from ckpt_tool.formats.base import open_checkpoint  # noqa: E402
from ckpt_tool.ops.diff import diff, parse_rename  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
MCORE = FIXTURES / "mcore016_gpt_tp2pp2_fp32" / "iter_0000010"
LEGACY = FIXTURES / "megatron_legacy_tp2pp2"
# DCP items are compared with raw ranges through the in-place zip reader when it is there.
RAW_DCP = importlib.util.find_spec("ckpt_tool.formats.containers.torch_zip.torch_zip_read") is not None
ALL = ["mcore016_gpt_tp2pp2_fp32", "mcore016_gpt_tp2pp2_bf16_optim", "dcp_plain",
       "mcore015_zarr_gpt_tp2pp2", "mcore015_gpt_flattened_optim", "megatron_legacy_tp2pp2",
       "megatron_legacy_tp2_release"]


def poke(root: Path, key: str, offsets: tuple, index: tuple, value: float) -> float:
    """Overwrite one fp32 element of a DCP item in place, and the record's CRC-32 with it (an
    intact item holding other values: damage is refused, not compared); ``index`` is inside
    the chunk at ``offsets``. Returns the old value."""
    with open_checkpoint(root) as r:
        chunk = next(c for c in r.metadata().tensors[key].chunks if c.offsets == offsets)
    path = root / chunk.file
    data = bytearray(path.read_bytes())
    item = bytes(data[chunk.byte_offset:chunk.byte_offset + chunk.byte_length])
    info = next(i for i in zipfile.ZipFile(io.BytesIO(item)).infolist()
                if i.filename.endswith("/data/0"))
    n, m = struct.unpack("<HH", item[info.header_offset + 26:info.header_offset + 30])
    flat = sum(i * math.prod(chunk.sizes[d + 1:]) for d, i in enumerate(index))
    at = chunk.byte_offset + info.header_offset + 30 + n + m + 4 * flat
    (old,) = struct.unpack("<f", data[at:at + 4])
    data[at:at + 4] = struct.pack("<f", value)
    path.write_bytes(bytes(data))
    refresh_crcs(path, chunk.byte_offset, chunk.byte_length)
    return old


@pytest.fixture
def mcore_copy(tmp_path):
    return Path(shutil.copytree(MCORE, tmp_path / "copy" / "iter_0000010"))


@pytest.mark.parametrize("name", ALL)
def test_fixture_against_itself(name):
    r = diff(FIXTURES / name, FIXTURES / name)
    assert r.identical, r.to_dict()
    assert r.stats["tensors_compared"] == r.stats["tensors_common"] > 0
    assert r.stats["tensors_equal_bytes"] == r.stats["tensors_common"]  # no tensor decoded


def test_legacy_vs_dist_same_global_tensors():
    """Same model, two formats: the legacy side is seen as Megatron-Core saves that model
    (stacked names, its _extra_state and rng_state objects), so every tensor is compared and
    equal, and every object Megatron-Core saved matches (the rank files' RNG states are the
    states it saved); the common states differ only where the formats do."""
    r = diff(LEGACY, MCORE.parent)
    assert r.notes == ("A (legacy) seen as Megatron-Core saves it, as convert writes it to a "
                       "dist format: stacked layers, _extra_state and rng_state objects",)
    assert r.only_in_a == r.only_in_b == ()
    assert r.stats["tensors_compared"] == 17 and r.values == () and r.dtype_changes == ()
    if RAW_DCP:  # legacy raw ranges against DCP storage records: no tensor decoded
        assert r.stats["tensors_equal_bytes"] == 17
    assert r.shape_changes == ()
    kinds = {c.path: c.kind for c in r.common}
    assert kinds["args.ckpt_format"] == kinds["args.use_dist_ckpt"] == "changed"
    assert {p for p, k in kinds.items() if k == "changed"} == {"args.ckpt_format",
                                                                 "args.use_dist_ckpt"}
    assert {p for p, k in kinds.items() if k == "only_in_b"} == {
        "content_metadata.chained_optim_avoid_prefix", "content_metadata.singleton_local_shards"}
    only_a = {p for p, k in kinds.items() if k == "only_in_a"}
    assert {"args.no_save_optim", "args.no_save_rng"} < only_a
    assert all(p.startswith(("args.", "opt_param_scheduler.")) for p in only_a)
    assert "iteration" not in kinds
    # the final norm's: a TENorm's wherever Transformer Engine is installed (not at this save)
    assert r.objects_only_in_a == ("decoder.final_layernorm._extra_state/shard_0_1",)
    assert r.objects_only_in_b == () and r.objects == ()
    assert not r.identical


def test_modified_values_every_tensor_listed(mcore_copy):
    old1 = poke(mcore_copy, "output_layer.weight", (0, 0), (3, 5), 7.0)
    old2 = poke(mcore_copy, "output_layer.weight", (64, 0), (10, 1), -1.0)
    old3 = poke(mcore_copy, "decoder.layers.mlp.linear_fc1.weight", (2, 64, 0), (0, 1, 2), 0.5)
    r = diff(MCORE, mcore_copy)
    assert not r.identical
    by_key = {v.key: v for v in r.values}
    assert set(by_key) == {"output_layer.weight", "decoder.layers.mlp.linear_fc1.weight"}
    v = by_key["output_layer.weight"]
    assert v.differing == 2 and v.numel == 128 * 64
    assert v.first_index == (3, 5) and v.first_a == old1 and v.first_b == 7.0
    want_abs = max(abs(old1 - 7.0), abs(old2 + 1.0))
    assert v.max_abs_diff == pytest.approx(want_abs)
    assert v.max_rel_diff == pytest.approx(max(abs(old1 - 7.0) / 7.0, abs(old2 + 1.0)))
    w = by_key["decoder.layers.mlp.linear_fc1.weight"]
    assert w.differing == 1 and w.first_index == (2, 65, 2) and w.first_a == old3
    assert r.stats["tensors_equal_bytes"] == 15
    assert diff(MCORE, mcore_copy, atol=10.0).identical  # within tolerance


def test_without_memcmp_the_same_results(mcore_copy, monkeypatch):
    """Where no C library can be called, bytes are compared through read buffers."""
    monkeypatch.setattr(diff_windows, "memcmp", lambda: None)
    monkeypatch.setattr(diff_values, "_MEMCMP", None)
    monkeypatch.setattr(diff_windows, "_BLOCK", 4096)  # several windows per item
    r = diff(MCORE, mcore_copy)
    assert r.identical and r.stats["tensors_equal_bytes"] == 17
    poke(mcore_copy, "output_layer.weight", (64, 0), (63, 63), 3.0)
    (v,) = diff(MCORE, mcore_copy).values
    assert v.key == "output_layer.weight" and v.first_index == (127, 63) and v.differing == 1


def test_keys_only_reads_no_data(mcore_copy):
    for f in mcore_copy.glob("*.distcp"):
        f.write_bytes(b"\0" * f.stat().st_size)
    assert diff(MCORE, mcore_copy, keys_only=True).identical
    with pytest.raises(CkptError):  # the data really is unreadable
        diff(MCORE, mcore_copy)
    for f in mcore_copy.glob("*.distcp"):
        f.unlink()
    r = diff(MCORE, mcore_copy, keys_only=True)
    assert r.identical and r.stats["tensors_compared"] == 0


def test_common_state_iteration(mcore_copy):
    common = torch.load(mcore_copy / "common.pt", weights_only=False)  # our own fixture
    common["iteration"] = 11
    common["args"].lr = 0.5
    torch.save(common, mcore_copy / "common.pt")
    r = diff(MCORE, mcore_copy)
    assert r.values == () and not r.identical
    got = {c.path: (c.kind, c.a, c.b) for c in r.common}
    assert got == {"iteration": ("changed", 10, 11),
                   "args.lr": ("changed", got["args.lr"][1], 0.5)}
    assert got["args.lr"][1] != 0.5
    assert not diff(MCORE, mcore_copy, keys_only=True).identical  # the summary shows it too


def _export(tmp_path: Path) -> dict:
    with open_checkpoint(MCORE) as r:
        return {k: r.read(k) for k in r.metadata().tensors}


def test_safetensors_and_torch_save_exports_are_equal(tmp_path):
    sd = _export(tmp_path)
    save_file(sd, tmp_path / "model.safetensors")
    torch.save(sd, tmp_path / "model.pt")
    for other in ("model.safetensors", "model.pt"):
        r = diff(MCORE, tmp_path / other)
        assert r.identical, r.to_dict()
        assert r.stats["tensors_compared"] == 17
        assert r.stats["tensors_equal_bytes"] == (17 if RAW_DCP else 0)
        assert any("common state not compared" in n for n in r.notes)
    r = diff(tmp_path / "model.safetensors", tmp_path / "model.pt")
    assert r.identical and r.stats["tensors_equal_bytes"] == 17  # raw bytes on both sides
    sd["output_layer.weight"][127, 63] += 1
    save_file(sd, tmp_path / "changed.safetensors")
    (v,) = diff(MCORE, tmp_path / "changed.safetensors").values
    assert v.key == "output_layer.weight" and v.first_index == (127, 63) and v.differing == 1


@pytest.mark.parametrize("block", [4096, 1 << 16])
def test_small_windows_over_runs(tmp_path, monkeypatch, block):
    """Chunks compared against rows of an unchunked tensor, in many small mmap windows."""
    monkeypatch.setattr(diff_windows, "_BLOCK", block)
    sd = _export(tmp_path)
    save_file(sd, tmp_path / "model.safetensors")
    r = diff(tmp_path / "model.safetensors", MCORE)
    assert r.identical and r.stats["tensors_equal_bytes"] == (17 if RAW_DCP else 0)
    sd["decoder.layers.self_attention.linear_proj.weight"][3, 5, 40] = 9.0  # TP rank 1 half
    save_file(sd, tmp_path / "changed.safetensors")
    (v,) = diff(tmp_path / "changed.safetensors", MCORE).values
    assert v.first_index == (3, 5, 40) and v.differing == 1 and v.first_a == 9.0


def test_dtype_change_with_and_without_tolerance(tmp_path):
    g = torch.Generator().manual_seed(0)
    a = {"w": torch.randn(64, 32, generator=g), "b": torch.arange(5.0)}
    save_file(a, tmp_path / "a.safetensors")
    save_file({"w": a["w"].bfloat16(), "b": a["b"]}, tmp_path / "b.safetensors")
    r = diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert [(c.key, c.a, c.b) for c in r.dtype_changes] == [("w", "float32", "bfloat16")]
    (v,) = r.values
    exact = int((a["w"] != a["w"].bfloat16().float()).sum())
    assert v.key == "w" and v.differing == exact > 0 and v.max_rel_diff < 2 ** -8
    assert not r.identical
    tol = diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors", rtol=2 ** -8)
    assert tol.identical and tol.values == () and len(tol.dtype_changes) == 1
    assert not diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors", rtol=2 ** -8,
                    keys_only=True).identical
    assert not diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors", rtol=1e-5).identical


def test_keys_rename_filter(tmp_path):
    def t():
        return torch.ones(4)
    save_file({"module.x": t(), "module.y": t(), "only_a": t()}, tmp_path / "a.safetensors")
    save_file({"x": t(), "y": t(), "only_b": t()}, tmp_path / "b.safetensors")
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    r = diff(a, b)
    assert r.only_in_a == ("module.x", "module.y", "only_a")
    assert r.only_in_b == ("only_b", "x", "y")
    r = diff(a, b, rename=parse_rename(["module.="]))
    assert r.only_in_a == ("only_a",) and r.only_in_b == ("only_b",)
    assert r.stats["tensors_compared"] == 2
    assert diff(a, b, rename=[("module.", "")], filter=r"^[xy]$").identical
    with pytest.raises(UsageError):
        parse_rename(["module."])
    with pytest.raises(UsageError):
        diff(a, b, rename=[("module.", ""), ("only_a", "x")])
    with pytest.raises(UsageError):
        diff(a, b, filter="(")


def test_nan_equal_at_same_position(tmp_path):
    x = torch.tensor([1.0, float("nan"), 0.0, float("inf")])
    save_file({"x": x}, tmp_path / "a.safetensors")
    y = x.clone()
    y.view(torch.int32)[1] = 0x7FC00001  # another NaN bit pattern
    y[2] = -0.0
    save_file({"x": y}, tmp_path / "b.safetensors")
    r = diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert r.identical and r.stats["tensors_equal_bytes"] == 0  # bytes differ, values do not
    y[1] = 2.0
    save_file({"x": y}, tmp_path / "c.safetensors")
    (v,) = diff(tmp_path / "a.safetensors", tmp_path / "c.safetensors").values
    assert v.first_index == (1,) and v.differing == 1 and v.max_abs_diff == math.inf
    assert v.to_dict()["max_abs_diff"] == "inf"


def test_different_chunk_grids_and_small_slabs(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(1)
    t = torch.randn(8, 12, generator=g)
    write_mcore_dist(tmp_path / "a", {"t": ((8, 12), split_grid(t, (2, 1)))})
    u = t.clone()
    u[5, 7] += 1
    u[6, 0] += 2
    write_mcore_dist(tmp_path / "b", {"t": ((8, 12), split_grid(u, (1, 3)))})
    monkeypatch.setattr(diff_values, "PIECE_BYTES", 16)  # slabs of 4 elements
    (v,) = diff(tmp_path / "a", tmp_path / "b").values
    assert v.differing == 2 and v.first_index == (5, 7)
    assert v.max_abs_diff == pytest.approx(2.0, rel=1e-6)
    write_mcore_dist(tmp_path / "c", {"t": ((8, 12), split_grid(t, (4, 2)))})
    r = diff(tmp_path / "a", tmp_path / "c")
    assert r.identical and r.stats["tensors_equal_bytes"] == 0


@pytest.mark.parametrize("name", ["mcore015_zarr_gpt_tp2pp2", "dcp_plain",
                                  "mcore015_gpt_flattened_optim", "megatron_legacy_tp2_release"])
def test_any_format_against_its_safetensors_export(name, tmp_path):
    with open_checkpoint(FIXTURES / name) as r:
        sd = {k: r.read(k).contiguous() for k in r.metadata().tensors}
    save_file(sd, tmp_path / "x.safetensors")
    r = diff(FIXTURES / name, tmp_path / "x.safetensors")
    assert r.identical and r.stats["tensors_compared"] == len(sd), r.to_dict()
    key = max(sd, key=lambda k: sd[k].numel())
    sd[key].view(-1)[-1] += 1
    save_file(sd, tmp_path / "y.safetensors")
    (v,) = diff(FIXTURES / name, tmp_path / "y.safetensors").values
    assert v.key == key and v.differing == 1
    assert v.first_index == tuple(s - 1 for s in sd[key].shape)
