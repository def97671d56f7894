"""``ckpt diff`` between a Megatron checkpoint and an HF directory checks a conversion: each
tensor's cosine similarity and largest errors (``--json`` and the table), the first tensor that
disagrees (a swapped or transposed projection stands out; rounding does not), and ``--plot``
(matplotlib optional: one line, exit 2, when it is missing)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from ckpt_tool.cli.app import app

sys.path.insert(0, str(Path(__file__).parent))
from _hf_dirs import llama_dir  # noqa: E402

runner = CliRunner()


def ckpt(*argv, code: int = 0):
    result = runner.invoke(app, [str(a) for a in argv])
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    return result


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A Llama directory (one safetensors file, 3 layers) and its torch_dist import."""
    tmp = tmp_path_factory.mktemp("sim")
    hf = llama_dir(tmp / "hf", shards=1, layers=3, hidden=16, heads=2, kv=1)
    ckpt("convert", hf, tmp / "mc", "--to", "torch_dist", "--no-progress")
    return tmp, hf, tmp / "mc"


def _edited(hf: Path, dst: Path, change) -> Path:
    shutil.copytree(hf, dst)
    (dst / "model.safetensors.index.json").unlink()  # one file: no index needed
    f = next(dst.glob("*.safetensors"))
    t = load_file(str(f))
    change(t)
    f.unlink()
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _diff(mc, hf, code):
    return json.loads(ckpt("diff", mc, hf, "--json", "--no-progress", code=code).stdout)


def test_faithful_conversion_is_similar_everywhere(pair):
    tmp, hf, mc = pair
    doc = _diff(mc, hf, 0)
    sims = doc["similarity"]
    assert len(sims) == len(load_file(str(next(hf.glob("*.safetensors"))))) == 3 * 9 + 3
    assert all(s["cosine"] == 1.0 and s["max_rel_error"] == 0 for s in sims)
    assert doc["first_disagreeing"] is None
    keys = [s["key"] for s in sims]  # model order: layer 2 before layer 10 would be
    assert keys.index("model.layers.0.mlp.up_proj.weight") < keys.index(
        "model.layers.1.input_layernorm.weight")
    out = ckpt("diff", mc, hf, "--no-progress").output
    assert "similarity (30)" in out


def test_swapped_projections_stand_out(pair, tmp_path):
    tmp, hf, mc = pair
    p = "model.layers.1.self_attn."

    def swap(t):
        t[p + "q_proj.weight"], t[p + "o_proj.weight"] = t[p + "o_proj.weight"], \
            t[p + "q_proj.weight"]
    bad = _edited(hf, tmp_path / "swapped", swap)
    doc = _diff(mc, bad, 1)
    by = {s["key"]: s for s in doc["similarity"]}
    assert doc["first_disagreeing"] == p + "o_proj.weight"  # model order: o before q
    for k in ("q_proj", "o_proj"):
        assert by[p + k + ".weight"]["cosine"] < 0.5
    assert all(s["cosine"] == 1.0 for k, s in by.items() if not k.startswith(p))
    res = ckpt("diff", mc, bad, "--no-progress", code=1)
    verdict = [x for x in res.output.splitlines() if x.startswith("DIFFERENT")]
    assert len(verdict) == 1 and f"first that disagrees: {p}o_proj.weight" in verdict[0]
    assert "linear_proj.weight[1]" in verdict[0]  # with the Megatron tensor it comes from


def test_transposed_projection_stands_out_and_rounding_does_not(pair, tmp_path):
    tmp, hf, mc = pair
    key = "model.layers.2.self_attn.o_proj.weight"
    bad = _edited(hf, tmp_path / "t", lambda t: t.__setitem__(key, t[key].t().contiguous()))
    doc = _diff(mc, bad, 1)
    assert doc["first_disagreeing"] == key
    g = torch.Generator().manual_seed(0)
    noisy_key = "model.layers.0.mlp.down_proj.weight"

    def noise(t):  # relative noise of 2^-5, coarser than e4m3's rounding
        t[noisy_key] = t[noisy_key] * (1 + 2 ** -5 * torch.randn(t[noisy_key].shape,
                                                                  generator=g))
    doc = _diff(mc, _edited(hf, tmp_path / "n", noise), 1)
    by = {s["key"]: s for s in doc["similarity"]}
    assert 0.99 < by[noisy_key]["cosine"] < 1.0 and 0 < by[noisy_key]["max_rel_error"] < 0.2
    assert doc["first_disagreeing"] is None
    assert [v["key"] for v in doc["values"]] == [noisy_key]


def test_plot_without_matplotlib_is_one_line_exit_2(pair, tmp_path, monkeypatch):
    tmp, hf, mc = pair
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    res = ckpt("diff", mc, hf, "--plot", tmp_path / "s.png", "--no-progress", code=2)
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert len(lines) == 1 and "--plot needs matplotlib" in lines[0], lines
    assert not (tmp_path / "s.png").exists()


def test_plot_draws_the_per_layer_similarity(pair, tmp_path):
    pytest.importorskip("matplotlib")
    tmp, hf, mc = pair
    png = tmp_path / "s.png"
    ckpt("diff", mc, hf, "--plot", png, "--no-progress")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
