"""Fixtures shared by every test directory."""

from __future__ import annotations

import pytest


@pytest.fixture
def raw_saves(monkeypatch) -> list[str]:
    """The directories written through the raw DCP path (``dcp_raw_save.raw_dcp_save``, the one
    call both DCP-format writers reach) during the test, in order: a test asserts that a run
    did not fall back to DCP's save silently."""
    from ckpt_tool.formats import dcp_raw_save

    seen: list[str] = []
    real = dcp_raw_save.raw_dcp_save

    def spy(directory, *args, **kwargs):
        seen.append(str(directory))
        return real(directory, *args, **kwargs)

    monkeypatch.setattr(dcp_raw_save, "raw_dcp_save", spy)
    return seen
