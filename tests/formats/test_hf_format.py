"""The ``hf`` format: HF model directories with safetensors (single, sharded + index) or
``pytorch_model*.bin`` (+ index, through the allowlisting unpickler); bad directories give one
clear line and exit 2 with nothing written; dtype kept through HF -> torch_dist -> HF."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckpt_tool.cli.app import app
from ckpt_tool.errors import CorruptCheckpointError
from ckpt_tool.formats.base import detect, open_checkpoint

runner = CliRunner()
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8,
          "intermediate_size": 12, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_key_value_heads": 1, "vocab_size": 10, "max_position_embeddings": 16,
          "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "dtype": "bfloat16"}
_CODES = {torch.bfloat16: "BF16", torch.float32: "F32"}


def llama_state(dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (10, 8), "lm_head.weight": (10, 8),
              "model.norm.weight": (8,)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (8, 8), p + "self_attn.k_proj.weight": (4, 8),
                       p + "self_attn.v_proj.weight": (4, 8), p + "self_attn.o_proj.weight": (8, 8),
                       p + "mlp.gate_proj.weight": (12, 8), p + "mlp.up_proj.weight": (12, 8),
                       p + "mlp.down_proj.weight": (8, 12), p + "input_layernorm.weight": (8,),
                       p + "post_attention_layernorm.weight": (8,)})
    return {k: torch.randn(s, generator=g).to(dtype) for k, s in shapes.items()}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    header, pos, blobs = {}, 0, []
    for k, t in tensors.items():
        b = t.contiguous().view(torch.uint8).numpy().tobytes()
        header[k] = {"dtype": _CODES[t.dtype], "shape": list(t.shape),
                     "data_offsets": [pos, pos + len(b)]}
        pos += len(b)
        blobs.append(b)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def hf_dir(root: Path, kind: str, state: dict | None = None) -> Path:
    state = state or llama_state()
    root.mkdir()
    (root / "config.json").write_text(json.dumps(CONFIG))
    keys = sorted(state)
    halves = (keys[: len(keys) // 2], keys[len(keys) // 2:])
    if kind == "safetensors":
        write_safetensors(root / "model.safetensors", state)
    elif kind == "sharded":
        names = [f"model-0000{i + 1}-of-00002.safetensors" for i in range(2)]
        for name, part in zip(names, halves):
            write_safetensors(root / name, {k: state[k] for k in part})
        (root / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {k: n for n, p in zip(names, halves) for k in p}}))
    else:
        names = [f"pytorch_model-0000{i + 1}-of-00002.bin" for i in range(2)]
        for name, part in zip(names, halves):
            torch.save({k: state[k] for k in part}, root / name)
        (root / "pytorch_model.bin.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {k: n for n, p in zip(names, halves) for k in p}}))
    return root


@pytest.mark.parametrize("kind", ["safetensors", "sharded", "bin"])
def test_reads_every_weight_layout(tmp_path, kind):
    state = llama_state()
    d = hf_dir(tmp_path / "m", kind, state)
    assert detect(d).name == "hf"
    with open_checkpoint(d) as r:
        meta = r.metadata()
        assert meta.common["architecture"] == "LlamaForCausalLM"
        assert meta.extras["config"] == CONFIG
        for k, t in state.items():
            assert torch.equal(r.read(k), t) and meta.tensors[k].dtype == "bfloat16"
        assert torch.equal(r.read("lm_head.weight", (slice(2, 5),)), state["lm_head.weight"][2:5])
    result = runner.invoke(app, ["inspect", str(d)])
    assert result.exit_code == 0 and "architecture: LlamaForCausalLM" in result.stdout
    assert runner.invoke(app, ["validate", str(d)]).exit_code == 0


def test_bf16_stays_bf16_through_torch_dist_and_back(tmp_path):
    d = hf_dir(tmp_path / "m", "safetensors")
    for argv in (["convert", str(d), str(tmp_path / "mc"), "--to", "torch_dist", "--pp", "2"],
                 ["convert", str(tmp_path / "mc"), str(tmp_path / "back"), "--to", "hf"]):
        result = runner.invoke(app, argv + ["--no-progress"])
        assert result.exit_code == 0, result.output
    mc = open_checkpoint(tmp_path / "mc")
    assert {t.dtype for t in mc.metadata().tensors.values()} == {"bfloat16"}
    assert mc.common()["args"].bf16 is True and mc.common()["args"].padded_vocab_size == 128
    assert mc.common()["args"].pipeline_model_parallel_size == 2
    with open_checkpoint(d) as a, open_checkpoint(tmp_path / "back") as b:
        assert a.metadata().tensors.keys() == b.metadata().tensors.keys()
        for k in a.metadata().tensors:
            assert torch.equal(a.read(k), b.read(k)), k
    assert json.loads((tmp_path / "back" / "config.json").read_text())["torch_dtype"] == \
        "bfloat16"


def _fails(argv: list[str], *want: str) -> None:
    result = runner.invoke(app, argv + (["--no-progress"] if argv[0] == "convert" else []))
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and all(w in lines[0] for w in want), result.output


def test_bad_directories_one_line_exit_2_nothing_written(tmp_path):
    d = hf_dir(tmp_path / "bin", "bin")
    (d / "pytorch_model-00002-of-00002.bin").unlink()
    with pytest.raises(CorruptCheckpointError, match="names pytorch_model-00002-of-00002.bin, "
                                                     "which is missing"):
        open_checkpoint(d).metadata()
    out = tmp_path / "out"
    _fails(["convert", str(d), str(out), "--to", "torch_dist"], "which is missing")
    s = hf_dir(tmp_path / "st", "sharded")
    (s / "model-00001-of-00002.safetensors").unlink()
    _fails(["inspect", str(s)], "model-00001-of-00002.safetensors, which is missing")
    odd = hf_dir(tmp_path / "falcon", "safetensors")
    (odd / "config.json").write_text(json.dumps({**CONFIG, "architectures": ["FalconForCausalLM"],
                                                 "model_type": "falcon"}))
    _fails(["convert", str(odd), str(out), "--to", "torch_dist"],
           "no conversion rule for HF architecture FalconForCausalLM")
    bad = hf_dir(tmp_path / "bad", "safetensors")
    (bad / "config.json").write_text(json.dumps({**CONFIG, "num_key_value_heads": 2}))
    _fails(["convert", str(bad), str(out), "--to", "torch_dist"],
           "the config contradicts the weights")
    _fails(["convert", str(hf_dir(tmp_path / "ok", "safetensors")), str(out), "--to",
            "torch_dist", "--tp", "4"], "--tp 4 does not divide")
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if "out" in p.name] == []
