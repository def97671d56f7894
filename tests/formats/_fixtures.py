"""The bundled checkpoints of ``fixtures/`` for the format tests: a test skips, saying which,
where one is missing (a checkout without them)."""

from __future__ import annotations

from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


def fixture(name: str) -> Path:
    """``fixtures/<name>``; skips the calling test when it is missing or empty."""
    p = FIXTURES / name
    if not p.is_dir() or not any(p.iterdir()):
        pytest.skip(f"fixture {name} is missing")
    return p
