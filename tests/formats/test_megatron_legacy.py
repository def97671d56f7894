"""Megatron-LM legacy format (per-rank torch.save files): sniff, merged metadata equal to the
dist fixture's tensors, bit-exact reads against the dist fixture, torch-free metadata,
validate hooks and ``ckpt inspect``."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckpt_tool.formats import detect, open_checkpoint
from ckpt_tool.formats.legacy import layout as L
from ckpt_tool.formats.legacy.reader import sniff

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "fixtures"
DIST = FIX / "mcore016_gpt_tp2pp2_fp32"
LEGACY = [FIX / "megatron_legacy_tp2pp2", FIX / "megatron_legacy_tp2_release"]
RENAMES = {"self_attention.linear_qkv.layer_norm_": "input_layernorm.",
           "mlp.linear_fc1.layer_norm_": "pre_mlp_layernorm."}


def _legacy_name(dist_key: str, layer: int | None) -> str:
    if layer is None:
        return dist_key
    rest = dist_key[len("decoder.layers."):]
    for a, b in RENAMES.items():
        if rest.startswith(a):
            rest = b + rest[len(a):]
    return f"decoder.layers.{layer}.{rest}"


@pytest.fixture(scope="module")
def dist():
    r = open_checkpoint(DIST)
    yield r
    r.close()


def _expected(dist_meta):
    """legacy key -> (dist key, layer index or None, shape)."""
    out = {}
    for k, t in dist_meta.tensors.items():
        if k.startswith("decoder.layers."):
            for i in range(t.shape[0]):
                out[_legacy_name(k, i)] = (k, i, t.shape[1:])
        else:
            out[k] = (k, None, t.shape)
    return out


@pytest.mark.parametrize("variant", ["save", "iter", "tracker_file"])
@pytest.mark.parametrize("fix", LEGACY, ids=lambda p: p.name)
def test_sniff_dir_kinds(fix, variant):
    it = next(d for d in fix.iterdir() if d.is_dir() and (d.name.startswith("iter_")
                                                          or d.name == "release"))
    path = {"save": fix, "iter": it,
            "tracker_file": fix / "latest_checkpointed_iteration.txt"}[variant]
    assert sniff(path) is None
    assert detect(path).name == "legacy"


def test_sniff_rejects_others():
    why = sniff(DIST / "iter_0000010")
    assert why is not None and "metadata.json" in why
    assert sniff(DIST) is not None
    f = LEGACY[0] / "iter_0000010" / "mp_rank_00_000" / "model_optim_rng.pt"
    assert sniff(f) is not None and detect(f).name == "torch"  # one rank file stays torch
    assert "mp_rank" in sniff(LEGACY[0] / "iter_0000010" / "mp_rank_00_000")


@pytest.mark.parametrize("fix", LEGACY, ids=lambda p: p.name)
def test_metadata_matches_dist(fix, dist):
    meta = open_checkpoint(fix).metadata()
    exp = _expected(dist.metadata())
    assert set(meta.tensors) == set(exp)
    for k, t in meta.tensors.items():
        assert t.shape == exp[k][2], k
        assert t.dtype == "float32"
        for c in t.chunks:
            assert c.layout == "raw" and c.byte_offset is not None
            assert c.byte_length == c.numel * 4
    fc1 = meta.tensors["decoder.layers.3.mlp.linear_fc1.weight"]
    assert len(fc1.chunks) == 4  # SwiGLU: 2 chunks per TP rank
    assert [c.offsets[0] for c in fc1.chunks] == [0, 128, 64, 192]
    assert meta.common["iteration"] in (10, 0)
    assert meta.common["parallel"]["tp"] == 2
    assert meta.extras["tp"] == 2 and meta.extras["missing_rank_files"] == []
    assert all(o.key in ("rng_state", "opt_param_scheduler") for o in meta.objects)


@pytest.mark.parametrize("fix", LEGACY, ids=lambda p: p.name)
def test_every_tensor_bit_exact(fix, dist):
    exp = _expected(dist.metadata())
    with open_checkpoint(fix) as r:
        for k in sorted(r.metadata().tensors):
            dk, layer, _ = exp[k]
            want = dist.read(dk, None if layer is None else (slice(layer, layer + 1),))
            if layer is not None:
                want = want[0]
            got = r.read(k)
            assert got.dtype == want.dtype and torch.equal(got, want), k


def test_raw_byte_ranges_hold_the_data(dist):
    fix = LEGACY[0]
    with open_checkpoint(fix) as r:
        meta = r.metadata()
        t = meta.tensors["decoder.layers.2.mlp.linear_fc1.weight"]
        full = r.read(t.key)
        root = Path(meta.root)
        for c in t.chunks:
            raw = (root / c.file).read_bytes()[c.byte_offset:c.byte_offset + c.byte_length]
            piece = torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(c.sizes)
            sl = tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))
            assert torch.equal(full[sl], piece)


def test_sliced_read(dist):
    with open_checkpoint(LEGACY[0]) as r:
        k = "decoder.layers.3.mlp.linear_fc1.weight"
        full = r.read(k)
        part = r.read(k, (slice(100, 150), slice(3, 9)))
        assert torch.equal(part, full[100:150, 3:9])
        emb = r.read("embedding.word_embeddings.weight", (slice(60, 70),))
        assert torch.equal(emb, dist.read("embedding.word_embeddings.weight")[60:70])
        assert r.read_object("rng_state/mp_rank_01_001")[0]["random_rng_state"] is not None


def test_metadata_imports_no_torch():
    code = (
        "import sys\n"
        "from ckpt_tool.formats import open_checkpoint\n"
        f"m = open_checkpoint({str(LEGACY[0])!r}).metadata()\n"
        "assert len(m.tensors) == 53\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_validate_fixtures_and_missing_rank(tmp_path):
    from ckpt_tool.ops.validate import validate

    for fix in LEGACY:
        res = validate(fix)
        assert res.ok and res.format == "legacy", res.findings
    broken = tmp_path / "ckpt"
    shutil.copytree(LEGACY[0], broken, ignore=shutil.ignore_patterns("generate.py"))
    shutil.rmtree(broken / "iter_0000010" / "mp_rank_01_001")
    res = validate(broken)
    assert not res.ok
    assert any("mp_rank_01_001/model_optim_rng.pt" in (f.file or "") and "missing" in f.message
               for f in res.errors), res.findings


def test_validate_replicated_mismatch(tmp_path):
    from ckpt_tool.ops.validate import validate

    src = LEGACY[1]
    broken = tmp_path / "ckpt"
    shutil.copytree(src, broken)
    f = broken / "release" / "mp_rank_01" / "model_optim_rng.pt"
    state = torch.load(f, weights_only=False)
    state["model"]["decoder.final_layernorm.weight"] = torch.zeros(65)
    torch.save(state, f)
    res = validate(broken)
    assert any(f.key == "decoder.final_layernorm.weight" for f in res.errors), res.findings


def test_cli_inspect_json():
    from ckpt_tool.cli.app import app

    res = CliRunner().invoke(app, ["inspect", str(LEGACY[0]), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["format"] == "legacy" and doc["totals"]["tensors"] == 53


def test_layout_rules():
    assert L.parse_rank_dir("mp_rank_01_002") == (1, 2, 0)
    assert L.parse_rank_dir("mp_rank_01") == (1, 0, 0)
    assert L.parse_rank_dir("mp_rank_01_003", pp_size=1) == (1, 0, 3)
    assert L.parse_rank_dir("mp_rank_00_001_002") == (0, 1, 2)
    assert L.rank_dir_name(1, 1, 0, 2, 1) == "mp_rank_01_001"
    assert L.stage_layer_offsets(4, 2) == [0, 2]
    assert L.stage_layer_offsets(10, 4, first=1, last=3) == [0, 1, 4, 7]
    with pytest.raises(ValueError):
        L.stage_layer_offsets(5, 2)
    assert L.virtual_layer_offset(8, 2, 2, pp=1, vp=1) == 6
    assert L.globalize_key("decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight",
                           2, 4) == "decoder.layers.3.mlp.experts.local_experts.4.linear_fc1.weight"
    assert L.split_rule("decoder.layers.0.mlp.linear_fc1.weight", swiglu=True) == (L.GLU, 0)
    assert L.split_rule("decoder.layers.0.self_attention.linear_proj.bias", swiglu=True)[0] \
        == L.REPLICATED


def test_validate_truncated_rank_file(tmp_path):
    from ckpt_tool.ops.validate import validate

    broken = tmp_path / "ckpt"
    shutil.copytree(LEGACY[0], broken)
    f = broken / "iter_0000010" / "mp_rank_00_001" / "model_optim_rng.pt"
    f.write_bytes(f.read_bytes()[:1000])
    res = validate(broken)
    assert any(e.file == "mp_rank_00_001/model_optim_rng.pt" for e in res.errors), res.findings
