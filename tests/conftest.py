"""Fixtures shared by every test directory."""

from __future__ import annotations

import os
import sys

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = None


def _known_warnings() -> list[str]:
    """pyproject.toml's ``filterwarnings`` (third-party warnings known to be harmless)."""
    from pathlib import Path

    if tomllib is None:
        return []
    doc = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    found = doc["tool"]["pytest"]["ini_options"].get("filterwarnings", [])
    assert not any("," in w for w in found), "PYTHONWARNINGS separates filters by commas"
    return found


# the same filters for every process a test starts (ckpt commands, torchrun workers, the real
# Megatron-Core): their stderr may reach the terminal between pytest's progress dots
KNOWN_WARNINGS = _known_warnings()
os.environ["PYTHONWARNINGS"] = ",".join(
    [w for w in os.environ.get("PYTHONWARNINGS", "").split(",") if w] + KNOWN_WARNINGS)

# ``-m "not slow"``, the quick run: everything but what starts torchrun jobs or the real
# Megatron-Core (the ``multiproc`` and ``interop`` markers, ``tests/interop``, ``tests/peer``)
# and the files whose tests each take minutes of CPU (memory peaks of 64 MiB models, kill -9
# trials, Ctrl-C and SIGTERM at pause points, exits racing gloo's threads, shared-memory staging).
SLOW_DIRS = {"interop", "peer"}
SLOW_FILES = {"test_convert_memory.py", "test_torch_dist_memory.py", "test_faults.py",
              "test_interrupt.py", "test_hf_streaming.py", "test_exit_clean.py",
              "test_staging_pool.py"}


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        path = item.path
        if (path.parent.name in SLOW_DIRS or path.name in SLOW_FILES
                or item.get_closest_marker("multiproc") or item.get_closest_marker("interop")):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def raw_saves(monkeypatch) -> list[str]:
    """The directories written through the raw DCP path (``dcp_torch_free_save.torch_free_dcp_save``, the one
    call both DCP-format writers reach) during the test, in order: a test asserts that a run
    did not fall back to DCP's save silently."""
    from ckpt_tool.formats.containers.dcp import dcp_torch_free_save as dcp_raw_save

    seen: list[str] = []
    real = dcp_raw_save.torch_free_dcp_save

    def spy(directory, *args, **kwargs):
        seen.append(str(directory))
        return real(directory, *args, **kwargs)

    monkeypatch.setattr(dcp_raw_save, "torch_free_dcp_save", spy)
    return seen
