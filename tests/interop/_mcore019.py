"""Megatron-Core 0.19 for the tests: the package index serves megatron-core up to 0.16.1, so
0.19 runs from Megatron-LM's ``megatron/core`` at tag ``core_v0.19.0`` on PYTHONPATH (the
cache of ``tests/peer/fetch_megatron.py --tag core_v0.19.0``), with torch 2.13 CPU and
``triton`` installed (0.19 imports it with its MoE modules). :func:`source_or_skip` gives the
source directory or skips the test saying what is missing; the torchrun workers find it in
``$CKPT_MEGATRON_SRC`` (``fixtures/_mcore_cpu.megatron_core_from_source``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

TAG = "core_v0.19.0"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "peer"))
import fetch_megatron  # noqa: E402


def source_or_skip(monkeypatch: pytest.MonkeyPatch) -> Path:
    """The directory holding ``megatron/core`` of 0.19, exported as ``$CKPT_MEGATRON_SRC`` for
    the workers; skips when it or ``triton`` cannot be had (CI cannot reach GitHub)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (Megatron-Core 0.19 imports it with its MoE "
                    "modules; pip install triton)")
    try:
        root = fetch_megatron.ensure(tag=TAG, timeout=30)
    except fetch_megatron.FetchError as exc:
        pytest.skip(f"Megatron-LM {TAG} unavailable: {exc}")
    monkeypatch.setenv("CKPT_MEGATRON_SRC", str(root))
    return root
