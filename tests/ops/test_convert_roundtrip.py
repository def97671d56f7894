"""Round trips through every writer are bit-exact; each output reads in the real library."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpt_tool.formats import open_checkpoint
from ckpt_tool.ops.convert import ConvertOptions
from ckpt_tool.ops.convert import convert

FIX = Path(__file__).resolve().parents[2] / "fixtures"
BF16_OPTIM = FIX / "mcore016_gpt_tp2pp2_bf16_optim"


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with open_checkpoint(path) as r:
        return {k: r.read(k).clone() for k in r.metadata().tensors}


def _assert_bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
                      extra_ok: bool = False) -> None:
    if extra_ok:  # plain DCP stores tensors of the common state as tensor items too
        assert set(a) <= set(b)
    else:
        assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8)), k


def test_dist_zarr_dcp_safetensors_dist_round_trip(tmp_path):
    """torch_dist -> zarr -> dcp -> safetensors -> torch_dist: the source's tensors, bit for bit
    (bf16 model weights and fp32 optimizer state)."""
    chain = ["zarr", "dcp", "safetensors", "torch_dist"]
    src = BF16_OPTIM
    for i, fmt in enumerate(chain):
        dst = tmp_path / f"{i}_{fmt}"
        result = convert(src, dst, ConvertOptions(to=fmt))
        assert result.verified and open_checkpoint(dst).metadata().format == fmt
        src = dst
    _assert_bit_equal(_tensors(BF16_OPTIM), _tensors(src))


@pytest.mark.parametrize("fmt", ["torch_dist", "zarr", "dcp", "torch", "safetensors"])
def test_every_fixture_converts_to_every_format(tmp_path, fmt):
    fixtures = ["mcore016_gpt_tp2pp2_fp32", "mcore015_zarr_gpt_tp2pp2",
                "mcore015_gpt_flattened_optim", "dcp_plain", "megatron_legacy_tp2pp2"]
    for name in fixtures:
        dst = tmp_path / name / ("model.pt" if fmt == "torch" else "out")
        dst.parent.mkdir()
        convert(FIX / name, dst, ConvertOptions(to=fmt))
        # legacy files -> a Megatron-Core dist checkpoint: its stacked names, i.e. the same
        # model as the real library saved it (tests/ops/test_legacy_to_dist.py)
        want = "mcore016_gpt_tp2pp2_fp32" if name.startswith("megatron_legacy") and fmt in (
            "torch_dist", "zarr") else name
        _assert_bit_equal(_tensors(FIX / want), _tensors(dst), extra_ok=fmt == "dcp")


def test_dtype_cast_and_model_only(tmp_path):
    dst = tmp_path / "out"
    convert(BF16_OPTIM, dst, ConvertOptions(to="safetensors", dtype="fp32", model_only=True))
    src = _tensors(BF16_OPTIM)
    got = _tensors(dst)
    assert set(got) == {k for k in src if not k.startswith("optimizer.")}
    for k, v in got.items():
        assert v.dtype == torch.float32 and torch.equal(v, src[k].float()), k


def test_real_libraries_read_the_outputs(tmp_path):
    import safetensors.torch
    import torch.distributed.checkpoint as dcp

    src = _tensors(FIX / "mcore016_gpt_tp2pp2_fp32")
    convert(FIX / "mcore016_gpt_tp2pp2_fp32", tmp_path / "st", ConvertOptions(to="safetensors"))
    files = sorted((tmp_path / "st").glob("*.safetensors"))
    loaded = {}
    for f in files:
        loaded.update(safetensors.torch.load_file(f))
    _assert_bit_equal(src, loaded)

    convert(FIX / "mcore016_gpt_tp2pp2_fp32", tmp_path / "m.pt", ConvertOptions(to="torch"))
    plain = torch.load(tmp_path / "m.pt", weights_only=True, mmap=True)
    _assert_bit_equal(src, {k: v for k, v in plain.items() if torch.is_tensor(v)})

    convert(FIX / "mcore016_gpt_tp2pp2_fp32", tmp_path / "dcp", ConvertOptions(to="dcp"))
    target = {k: torch.empty_like(v) for k, v in src.items()}
    dcp.load(target, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    _assert_bit_equal(src, target)


def test_dist_to_safetensors_moves_bytes_without_torch(tmp_path):
    """A byte-moving conversion never imports torch (a second saved; the output is the same)."""
    import subprocess
    import sys

    code = ("import sys\nfrom ckpt_tool.ops.convert import convert\n"
            "from ckpt_tool.ops.convert import ConvertOptions\n"
            f"convert({str(BF16_OPTIM)!r}, {str(tmp_path / 'st')!r}, "
            "ConvertOptions(to='safetensors'))\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
    _assert_bit_equal(_tensors(BF16_OPTIM), _tensors(tmp_path / "st"))
