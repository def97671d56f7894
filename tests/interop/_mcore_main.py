"""Megatron-LM's main branch (the next release) for the tests: ``megatron/core`` and
``megatron/training/checkpointing.py`` at the commit docs/formats.md ("Megatron-LM main") was
read at, from the cache of ``tests/peer/fetch_megatron.py --tag <COMMIT>`` (offline with
``CKPT_PEER_MEGATRON_GIT=<a Megatron-LM clone holding it>``). Its ``megatron/core`` imports and
runs on CPU with torch 2.13 (like 0.19's, ``_mcore019.py``); its ``megatron.training`` needs
Python 3.12 (``typing.override`` in ``megatron/training/models/hybrid.py``), so the tests take
single functions from ``checkpointing.py`` (:func:`training_functions`), never the package."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "peer"))
import fetch_megatron  # noqa: E402


def source_or_skip(monkeypatch: pytest.MonkeyPatch | None = None) -> Path:
    """The directory holding main's ``megatron/core`` (exported as ``$CKPT_MEGATRON_SRC``
    when ``monkeypatch`` is given); skips saying what is missing (CI cannot reach GitHub)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (Megatron-Core imports it with its MoE modules)")
    try:
        root = fetch_megatron.ensure(tag=COMMIT, timeout=30)
    except fetch_megatron.FetchError as exc:
        pytest.skip(f"Megatron-LM main ({COMMIT[:10]}) unavailable: {exc}")
    if monkeypatch is not None:
        monkeypatch.setenv("CKPT_MEGATRON_SRC", str(root))
    return root


def training_functions(root: Path, names: tuple[str, ...], namespace: dict[str, Any]
                       ) -> dict[str, Any]:
    """The top-level definitions ``names`` (functions and constants) of main's
    ``megatron/training/checkpointing.py``, executed from that file as they are, in
    ``namespace`` (what they use of the module's imports)."""
    path = root / "megatron" / "training" / "checkpointing.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    wanted = []
    for node in tree.body:
        name = getattr(node, "name", None)
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            name = getattr(node.targets[0], "id", None)
        if name in names:
            wanted.append(node)
    found = {getattr(n, "name", None) or n.targets[0].id for n in wanted}
    missing = set(names) - found
    assert not missing, f"{path} has no {sorted(missing)} any more"
    code = compile(ast.Module(body=wanted, type_ignores=[]), str(path), "exec")
    exec(code, namespace)  # noqa: S102 (Megatron-LM's own source, at a pinned commit)
    return {n: namespace[n] for n in names}
