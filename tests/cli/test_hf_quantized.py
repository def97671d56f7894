"""Quantized Hugging Face releases: block-scaled FP8 and MXFP4, read dequantized everywhere an
HF directory is a source, and ``convert --to hf --hf-dtype fp8``.

The FP8 release is written by transformers' own quantizer (``Fp8Quantize``, the op
``save_pretrained`` runs for ``FineGrainedFP8Config``) from a tiny Qwen3 built by
transformers; our dequantization is compared bit for bit with transformers' dequantization
functions (``Fp8Dequantize._dequantize_one``, ``_dequantize_fp8_weight`` for partial blocks,
``mxfp4.convert_moe_packed_tensors``). The export is loaded back by transformers (on CPU it
dequantizes; it needs ``accelerate``)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from ckpt_tool.cli.app import app
from ckpt_tool.formats.base import open_checkpoint

transformers = pytest.importorskip("transformers")
fp8_ops = pytest.importorskip("transformers.integrations.finegrained_fp8")
mxfp4_ops = pytest.importorskip("transformers.integrations.mxfp4")

sys.path.insert(0, str(Path(__file__).parent))
runner = CliRunner()
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [128, 128]}


def ckpt(*argv, code: int = 0):
    result = runner.invoke(app, [str(a) for a in argv])
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    return result


def _qwen3(root: Path) -> Path:
    """A tiny bf16 Qwen3 as transformers saves it: q/o/MLP projections divide into 128x128
    blocks, k/v (64 rows) do not."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=64, vocab_size=256, tie_word_embeddings=False,
        max_position_embeddings=64)
    transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(root)
    return root


def _quantize_release(src: Path, dst: Path) -> Path:
    """``src`` quantized as an FP8 release, by transformers' ``Fp8Quantize`` (it leaves the
    projections that do not divide into blocks unquantized, as its loader expects)."""
    op = fp8_ops.Fp8Quantize(SimpleNamespace(quantization_config=SimpleNamespace(
        weight_block_size=(128, 128), scale_fmt="float")))
    out = {}
    for k, v in load_file(str(src / "model.safetensors")).items():
        out.update(op._quantize_one(k, v) if k.endswith("_proj.weight") else {k: v})
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    skipped = ["lm_head"] + [k[:-len(".weight")] for k, v in out.items()
                             if k.endswith("_proj.weight") and v.dtype != torch.float8_e4m3fn]
    config["quantization_config"] = {**FP8_CONFIG, "modules_to_not_convert": skipped}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hfq")
    bf16 = _qwen3(tmp / "bf16")
    return SimpleNamespace(tmp=tmp, bf16=bf16, fp8=_quantize_release(bf16, tmp / "fp8"))


def _edited(src: Path, dst: Path, change=None, config=None) -> Path:
    shutil.copytree(src, dst)
    if change is not None:
        tensors = load_file(str(dst / "model.safetensors"))
        change(tensors)
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if config is not None:
        c = json.loads((dst / "config.json").read_text())
        c["quantization_config"] = config
        (dst / "config.json").write_text(json.dumps(c))
    return dst


def test_fp8_release_reads_as_transformers_dequantizes_it_bit_exact(dirs, monkeypatch):
    stored = load_file(str(dirs.fp8 / "model.safetensors"))
    deq = fp8_ops.Fp8Dequantize(None)
    with open_checkpoint(dirs.fp8) as r:
        meta = r.metadata()
        assert meta.extras["quantization"] == {"method": "fp8", "block": [128, 128],
                                               "quantized_tensors": 10, "dtype": "bfloat16"}
        assert not [k for k in meta.tensors if k.endswith("_scale_inv")]
        checked = 0
        for key, t in meta.tensors.items():
            assert t.dtype == "bfloat16", key
            if stored[key].dtype != torch.float8_e4m3fn:
                assert torch.equal(r.read(key), stored[key]), key
                continue
            want = deq._dequantize_one(stored[key], stored[key + "_scale_inv"],
                                       output_dtype=torch.bfloat16)
            got = r.read(key)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), key
            sl = (slice(100, 200), slice(50, 250))  # a region across blocks
            assert torch.equal(r.read(key, sl), want[sl]), key
            checked += 1
        assert checked == 10
        # a slab at a time: the same values with slabs of 128 rows
        monkeypatch.setattr("ckpt_tool.formats.hf.quant_view._SLAB_ELEMS", 128 * 8)
        key = "model.layers.1.mlp.down_proj.weight"
        want = deq._dequantize_one(stored[key], stored[key + "_scale_inv"],
                                   output_dtype=torch.bfloat16)
        assert torch.equal(r.read(key), want)


def test_fp8_partial_blocks_match_transformers_dequantization(tmp_path):
    """DeepSeek-V3's ``kv_a_proj_with_mqa`` has 576 rows: its last row block is partial.
    transformers' load-time op refuses it; its ``_dequantize_fp8_weight`` (float32) and ours
    agree bit for bit."""
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(576, 200, generator=g) * 3).to(torch.float8_e4m3fn)
    s = torch.rand(5, 2, generator=g) * 1e-3
    d = tmp_path / "ds"
    d.mkdir()
    save_file({"a.kv.weight": w, "a.kv.weight_scale_inv": s, "a.norm.weight": torch.ones(4)},
              str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"model_type": "x", "torch_dtype": "bfloat16",
                                               "quantization_config": FP8_CONFIG}))
    want = fp8_ops._dequantize_fp8_weight(w, s, [128, 128], torch.float32).to(torch.bfloat16)
    with open_checkpoint(d) as r:
        assert r.metadata().tensors["a.kv.weight"].shape == (576, 200)
        assert torch.equal(r.read("a.kv.weight"), want)
        sl = (slice(500, 576), slice(120, 200))
        assert torch.equal(r.read("a.kv.weight", sl), want[sl])


def _mxfp4_dir(root: Path) -> tuple[Path, dict]:
    """GPT-OSS's stored form: experts' ``*_blocks``/``*_scales``, the rest unquantized."""
    g = torch.Generator().manual_seed(4)
    tensors = {"model.layers.0.mlp.experts.gate_up_proj_blocks":
               torch.randint(0, 256, (2, 64, 2, 16), generator=g, dtype=torch.uint8),
               "model.layers.0.mlp.experts.down_proj_blocks":
               torch.randint(0, 256, (2, 32, 1, 16), generator=g, dtype=torch.uint8),
               "model.layers.0.mlp.experts.gate_up_proj_bias": torch.randn(2, 64).bfloat16()}
    tensors["model.layers.0.mlp.experts.gate_up_proj_scales"] = torch.randint(
        110, 140, (2, 64, 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(110, 140, (2, 32, 1), generator=g, dtype=torch.uint8)
    scales[0, 0, 0], scales[1, 0, 0] = 0, 254  # the extremes of e8m0
    tensors["model.layers.0.mlp.experts.down_proj_scales"] = scales
    root.mkdir()
    save_file(tensors, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps({
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "torch_dtype": "bfloat16", "quantization_config": {
            "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}}))
    return root, tensors


def test_mxfp4_release_reads_as_transformers_dequantizes_it_bit_exact(tmp_path):
    d, stored = _mxfp4_dir(tmp_path / "oss")
    with open_checkpoint(d) as r:
        meta = r.metadata()
        assert sorted(meta.tensors) == ["model.layers.0.mlp.experts.down_proj",
                                        "model.layers.0.mlp.experts.gate_up_proj",
                                        "model.layers.0.mlp.experts.gate_up_proj_bias"]
        for proj in ("gate_up_proj", "down_proj"):
            key = f"model.layers.0.mlp.experts.{proj}"
            want = mxfp4_ops.convert_moe_packed_tensors(
                stored[key + "_blocks"], stored[key + "_scales"], dtype=torch.bfloat16)
            assert meta.tensors[key].shape == tuple(want.shape)  # [experts, in, out]
            assert torch.equal(r.read(key).view(torch.int16), want.view(torch.int16)), key
            sl = (slice(1, 2), slice(5, 30), slice(3, 17))
            assert torch.equal(r.read(key, sl), want[sl]), key
    out = tmp_path / "oss.safetensors"
    ckpt("convert", d, out, "--to", "safetensors", "--no-progress")
    got = load_file(str(out))
    assert torch.equal(got["model.layers.0.mlp.experts.down_proj"],
                       mxfp4_ops.convert_moe_packed_tensors(
                           stored["model.layers.0.mlp.experts.down_proj_blocks"],
                           stored["model.layers.0.mlp.experts.down_proj_scales"],
                           dtype=torch.bfloat16))


def test_fp8_release_imports_inspects_validates_and_diffs(dirs):
    mc = dirs.tmp / "mc"
    ckpt("convert", dirs.fp8, mc, "--to", "torch_dist", "--no-progress")
    ckpt("validate", dirs.fp8)
    ckpt("validate", dirs.fp8, "--deep")
    doc = json.loads(ckpt("inspect", dirs.fp8, "--json").stdout)
    assert doc["extras"]["quantization"]["method"] == "fp8"
    assert "fp8" in doc["common"]["quantization"]
    stored = load_file(str(dirs.fp8 / "model.safetensors"))
    deq = fp8_ops.Fp8Dequantize(None)
    with open_checkpoint(mc) as r:
        qkv = r.read("decoder.layers.self_attention.linear_qkv.weight")
        assert qkv.dtype == torch.bfloat16
        q = deq._dequantize_one(stored["model.layers.1.self_attn.q_proj.weight"],
                                stored["model.layers.1.self_attn.q_proj.weight_scale_inv"],
                                output_dtype=torch.bfloat16)
        assert torch.equal(qkv[1, :256], q)  # one query group: [q heads, k, v]
    ckpt("diff", mc, dirs.fp8, "--no-progress")  # the import is the release, dequantized


@pytest.mark.parametrize("config,words", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "'gptq'"),
    ({"quant_method": "awq", "bits": 4}, "'awq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "NVFP4"),
    ({**FP8_CONFIG, "scale_fmt": "ue8m0"}, "ue8m0"),
    ({**FP8_CONFIG, "activation_scheme": "static"}, "static"),
], ids=["gptq", "awq", "bitsandbytes", "nvfp4", "ue8m0", "static"])
def test_unknown_quantization_is_one_line_exit_2_nothing_written(dirs, tmp_path, config,
                                                                 words):
    src = _edited(dirs.fp8, tmp_path / "src", config=config)
    for argv in (("convert", src, tmp_path / "out", "--to", "torch_dist"),
                 ("convert", src, tmp_path / "out", "--to", "safetensors"),
                 ("inspect", src)):
        res = ckpt(*argv, "--no-progress" if argv[0] == "convert" else "--json", code=2)
        lines = [x for x in res.output.splitlines() if x.strip()]
        assert len(lines) == 1 and words in lines[0] and "not supported" in lines[0], lines
        assert not (tmp_path / "out").exists()


def _drop(key):
    return lambda t: t.pop(key)


def _reshape(key):
    return lambda t: t.__setitem__(key, t[key][:1])


@pytest.mark.parametrize("change,words", [
    (_drop("model.layers.0.self_attn.o_proj.weight_scale_inv"), "has no scale tensor"),
    (_reshape("model.layers.1.mlp.down_proj.weight_scale_inv"), "in 128x128 blocks needs"),
    (_drop("model.layers.0.self_attn.q_proj.weight"), "has no FP8 weight"),
], ids=["missing", "wrong-shape", "orphan"])
def test_bad_scales_are_one_line_exit_2_nothing_written(dirs, tmp_path, change, words):
    src = _edited(dirs.fp8, tmp_path / "src", change=change)
    for to in ("torch_dist", "safetensors"):
        res = ckpt("convert", src, tmp_path / "out", "--to", to, "--no-progress", code=2)
        lines = [x for x in res.output.splitlines() if x.strip()]
        assert len(lines) == 1 and words in lines[0], lines
        assert not (tmp_path / "out").exists()
    res = ckpt("validate", src, code=1)  # validate reports it as a finding
    assert words in res.output


def test_hf_dtype_is_refused_where_it_does_not_apply(dirs, tmp_path):
    res = ckpt("convert", dirs.fp8, tmp_path / "o", "--to", "torch_dist", "--hf-dtype", "fp8",
               code=2)
    assert "--hf-dtype applies with --to hf" in res.output
    mc = dirs.tmp / "mc_dtype"
    ckpt("convert", dirs.bf16, mc, "--to", "torch_dist", "--no-progress")
    res = ckpt("convert", mc, tmp_path / "o", "--to", "hf", "--hf-dtype", "fp4", code=2)
    assert "--hf-dtype 'fp4' is not one of bf16, fp8" in res.output
    assert not (tmp_path / "o").exists()


def test_fp8_export_is_the_release_and_transformers_loads_it(dirs):
    """HF FP8 release -> torch_dist -> ``--to hf --hf-dtype fp8``: the same tensors, byte for
    byte (the re-quantization of the dequantized release gives the release back), the same
    quantization_config and size; transformers loads it (dequantizing on CPU) and gives the
    release's logits exactly. Against the bf16 model the FP8 weights are off by at most 2^-4
    of each value (e4m3 keeps 3 mantissa bits); the logits' relative L2 error is asserted
    below that, 2^-4 (the errors of independent weights do not add up in one direction:
    measured 0.044)."""
    pytest.importorskip("accelerate")  # transformers' FP8 loader needs it
    mc, back = dirs.tmp / "mc_export", dirs.tmp / "back"
    ckpt("convert", dirs.fp8, mc, "--to", "torch_dist", "--no-progress")
    ckpt("convert", mc, back, "--to", "hf", "--hf-dtype", "fp8", "--no-progress")
    src, out = load_file(str(dirs.fp8 / "model.safetensors")), \
        load_file(str(back / "model.safetensors"))
    assert out.keys() == src.keys()
    for k in src:
        assert out[k].dtype == src[k].dtype, k
        assert torch.equal(out[k].view(torch.uint8), src[k].view(torch.uint8)), k
    config = json.loads((back / "config.json").read_text())
    assert config["quantization_config"] == json.loads(
        (dirs.fp8 / "config.json").read_text())["quantization_config"]
    assert abs((back / "model.safetensors").stat().st_size
               - (dirs.fp8 / "model.safetensors").stat().st_size) < 4096

    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))

    def logits(d):
        m = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
        with torch.no_grad():
            return m(ids).logits.float()

    ref, release, ours = logits(dirs.bf16), logits(dirs.fp8), logits(back)
    assert torch.equal(ours, release)
    err = float((ours - ref).norm() / ref.norm())
    assert 0 < err < 2 ** -4, err


def test_fp8_whole_block_arithmetic_is_the_per_element_one():
    """The whole-block path (table lookup, broadcast scales) gives the bytes of the
    per-element formula of the module docstring; the caller's float32 input is not changed."""
    from ckpt_tool.formats.hf.quant_codecs import dequantize_fp8, expand_scales, quantize_fp8

    torch.manual_seed(0)
    for shape in [(256, 384), (3, 128, 256)]:
        raw = torch.randint(0, 256, shape, dtype=torch.uint8)
        raw[(raw & 0x7F) == 0x7F] = 0
        w = raw.view(torch.float8_e4m3fn)
        s = torch.rand(*shape[:-2], shape[-2] // 128, shape[-1] // 128) * 1e-3
        rows, cols = (0, shape[-2]), (0, shape[-1])
        for dtype, view in ((torch.bfloat16, torch.int16), (torch.float32, torch.int32)):
            want = (w.to(torch.float32) * expand_scales(s, (128, 128), rows, cols)).to(dtype)
            assert torch.equal(dequantize_fp8(w, s, (128, 128), dtype).view(view),
                               want.view(view))
        x = torch.randn(shape) * 0.02
        x[..., :128, :128] = 0  # an all-zero block: scale 1
        before = x.clone()
        q, inv = quantize_fp8(x, (128, 128))
        assert torch.equal(x, before)
        amax = x.abs().reshape(*shape[:-2], shape[-2] // 128, 128, shape[-1] // 128,
                               128).amax(dim=(-3, -1))
        scale = torch.where(amax > 0, 448.0 / torch.where(amax > 0, amax, 1.0),
                            torch.ones_like(amax))
        full = expand_scales(scale, (128, 128), rows, cols)
        want_q = torch.clamp(x * full, -448.0, 448.0).to(torch.float8_e4m3fn)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(inv, (1.0 / scale).to(torch.float32))


def test_fp8_release_round_trip_through_torch_dist_in_row_chunks(dirs):
    """Release -> torch_dist (--pp 2, the embedding in row chunks under --max-memory) -> FP8
    export: the quantized weights come back byte for byte (each block's amax is 448 in a
    release, so requantizing the bf16 values finds the same codes), the rest as stored."""
    mc, back = dirs.tmp / "mc_rows", dirs.tmp / "fp8_back"
    ckpt("convert", dirs.fp8, mc, "--to", "torch_dist", "--pp", "2", "--max-memory", "64KiB",
         "--no-progress")
    doc = json.loads(ckpt("inspect", mc, "--json").stdout)
    assert doc["tensors"]["embedding.word_embeddings.weight"]["chunks"] == 2  # 128 KiB
    assert doc["common"]["parallel"]["pp"] == 2
    ckpt("convert", mc, back, "--to", "hf", "--hf-dtype", "fp8", "--no-progress")
    src, got = load_file(str(dirs.fp8 / "model.safetensors")), {}
    for f in back.glob("*.safetensors"):
        got.update(load_file(str(f)))
    exact = 0
    for k, v in src.items():
        if v.dtype == torch.float8_e4m3fn:
            assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k
            exact += 1
        elif not k.endswith("_scale_inv"):
            assert torch.equal(got[k], v), k
    assert exact > 0


def test_ep_is_recorded_from_an_hf_directory_and_checked(dirs, tmp_path):
    out = ckpt("convert", dirs.fp8, tmp_path / "a", "--to", "torch_dist", "--ep", "2",
               code=2).output
    assert "no routed experts" in out and not (tmp_path / "a").exists()
    out = ckpt("convert", dirs.fp8, tmp_path / "b", "--to", "hf", "--ep", "2", code=2).output
    assert "--ep" in out
