"""Our save/load under torchrun (2 gloo ranks): resharding between TP and PP."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "_workers"))
from launch import torchrun  # noqa: E402

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("mp") / "ckpt"
    torchrun("dist_worker.py", 2, "--lib", "ours", "--op", "save", "--layout", "tp2pp1",
             "--dir", str(path))
    return path


def test_load_same_layout(ckpt):
    torchrun("dist_worker.py", 2, "--lib", "ours", "--op", "load", "--layout", "tp2pp1",
             "--dir", str(ckpt))


def test_load_tp_to_pp(ckpt):
    torchrun("dist_worker.py", 2, "--lib", "ours", "--op", "load", "--layout", "tp1pp2",
             "--no-objects", "--dir", str(ckpt))
