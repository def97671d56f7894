"""No laundering: what ``validate --deep`` flags, ``convert`` and ``reshard`` refuse.

For every case of the bad-input corpus (``_cases.py``) that ``validate --deep`` reports
(exit 1 or 2), ``convert`` (to torch_dist: a target that keeps the common state and the
objects) and ``reshard`` (to the source's layout) must fail with one line, write nothing at
the target and leave no staging behind: a damaged source never becomes a fresh checkpoint
with valid CRCs. The integrity cases (``tags=("integrity",)``: a flipped byte in a record's
data, metadata that contradicts the items) must also be flagged by ``validate --deep``, and
with ``--no-verify`` the CRC cases convert, saying so.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from _cases import BY_ID
from conftest import ROOT, deny
from test_bad_inputs import _run_isolated

from ckpt_tool.cli.app import app

runner = CliRunner()
pytestmark = pytest.mark.interop
INTEGRITY = sorted(k for k, c in BY_ID.items() if "integrity" in c.tags)


def _run(case, argv: list[str], where: Path, monkeypatch, path: Path) -> tuple[int, str]:
    restore = None
    if case.deny is not None:
        victim = (path / case.deny) if case.deny not in (".", "") else path
        if ROOT:
            deny(monkeypatch, victim)
        else:
            restore = (victim, os.stat(victim).st_mode)
            os.chmod(victim, 0)
    try:
        if case.isolate:
            code, _, stderr = _run_isolated(argv, where)
            return code, stderr
        r = runner.invoke(app, argv)
        if r.exception is not None and not isinstance(r.exception, SystemExit):
            raise AssertionError(f"{argv}: {r.exception!r}") from r.exception
        return r.exit_code, r.stderr
    finally:
        if restore:
            os.chmod(*restore)


def _refused(label: str, code: int, stderr: str, out: Path, where: Path) -> None:
    lines = [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("note:")]
    assert code in (1, 2), f"{label} -> {code}\n{stderr}"
    assert len(lines) == 1 and lines[0].startswith("ckpt: error: "), f"{label}\n{stderr}"
    assert "Traceback" not in stderr, label
    assert not out.exists(), f"{label}: wrote {out}"
    left = sorted(p.name for p in where.iterdir() if p.name not in ("stdout", "stderr"))
    assert left == [], f"{label}: left {left}"


@pytest.mark.parametrize("case_id", sorted(BY_ID))
def test_what_validate_deep_flags_convert_and_reshard_refuse(corpus, case_id, tmp_path,
                                                             monkeypatch):
    case = BY_ID[case_id]
    if case.deny is not None and ROOT and case.base == "torch":
        pytest.skip("as root, permissions are simulated in Python; torch.load opens the file "
                    "in C++")
    path = corpus.path(case_id)
    code, stderr = _run(case, ["validate", "--deep", str(path)], tmp_path, monkeypatch, path)
    if case_id in INTEGRITY:
        assert code == 1, f"{case_id}: validate --deep -> {code}\n{stderr}"
    if code == 0:
        pytest.skip("validate --deep finds nothing wrong: nothing to refuse")
    for cmd, argv in (("convert", ["convert", str(path), "OUT", "--to", "torch_dist"]),
                      ("reshard", ["reshard", str(path), "OUT"])):
        if cmd in case.lenient:
            continue  # what the command reads is intact (see Case.lenient)
        where = tmp_path / cmd
        where.mkdir()
        out = where / "out"
        argv = [a if a != "OUT" else str(out) for a in argv]
        code, stderr = _run(case, argv, where, monkeypatch, path)
        _refused(f"{case_id} {cmd}", code, stderr, out, where)


@pytest.mark.parametrize("case_id", [k for k in INTEGRITY if k.endswith("crc")])
def test_no_verify_copies_the_damage_and_says_so(corpus, case_id, tmp_path):
    out = tmp_path / "out"
    r = runner.invoke(app, ["convert", str(corpus.path(case_id)), str(out), "--to",
                            "safetensors", "--no-verify"])
    assert r.exit_code == 0, r.stderr
    assert "note: --no-verify: the source's bytes were not checked" in r.stderr


@pytest.mark.parametrize("target", ["torch_dist", "safetensors", "dcp"])
def test_workers_refuse_damage_too(corpus, tmp_path, target):
    """With ``--workers`` several threads read at once: a damaged item still stops it."""
    out = tmp_path / "out"
    r = runner.invoke(app, ["convert", str(corpus.path("torch_dist/item-data-crc")), str(out),
                            "--to", target, "--workers", "3"])
    _refused(f"--workers 3 --to {target}", r.exit_code, r.stderr, out, tmp_path)
    assert "fails its CRC-32 check" in r.stderr


@pytest.mark.parametrize("case_id", sorted(k for k, c in BY_ID.items() if "outside" in c.tags))
def test_inspect_refuses_what_would_read_outside(corpus, case_id, tmp_path, monkeypatch):
    """``inspect`` too (it may show a checkpoint whose data is damaged, never read a file a
    link inside it points at): one line, exit 2."""
    case = BY_ID[case_id]
    path = corpus.path(case_id)
    code, stderr = _run(case, ["inspect", str(path)], tmp_path, monkeypatch, path)
    _refused(f"{case_id} inspect", code, stderr, tmp_path / "none", tmp_path)
    assert code == 2
