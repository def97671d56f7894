"""The real Megatron-Core 0.16.1 hybrid ``MambaModel`` runs its forward on CPU with
``fixtures/_mamba_cpu.py``'s stand-ins (the Mamba-2 scan ``mamba_split_conv1d_scan_combined``
in plain torch) and computes what transformers 5.25's ``NemotronHForCausalLM`` computes with
the same weights (Mamba-2, attention and squared-ReLU MLP layers; transformers' own pure-torch
chunked scan and convolution on the other side): the groundwork of an HF <-> ``MambaModel``
rule, which ``convert`` does not offer yet. A mapping mistake (``in_proj``'s B and C rows
swapped) changes the logits. ``_nemotron_h_worker.py`` runs both models in one rank."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("einops")
pytestmark = [pytest.mark.interop, pytest.mark.multiproc, pytest.mark.slow]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist_checkpointing" / "_workers"))
from launch import torchrun  # noqa: E402

WORKER = Path(__file__).resolve().parent / "_nemotron_h_worker.py"


def _run(tmp_path, *mutation):
    out = tmp_path / "logits.pt"
    torchrun(str(WORKER), 1, str(out), *mutation, timeout=600)
    return torch.load(out)


def test_megatron_mamba_model_gives_nemotron_h_logits(tmp_path):
    got = _run(tmp_path)
    torch.testing.assert_close(got["megatron"], got["hf"], rtol=1e-4, atol=1e-5)


def test_swapped_b_and_c_rows_are_caught(tmp_path):
    got = _run(tmp_path, "swap_bc")
    assert (got["megatron"] - got["hf"]).abs().max() > 1e-2
