"""The bad-input corpus (tests/reliability/_cases.py) through every command.

For each damaged copy of a real checkpoint, ``inspect``, ``validate``, ``validate --deep``,
``convert`` and ``reshard --tp 1`` (to a fresh directory) and ``diff`` (against the intact
original) must give ONE clear line on stderr (``note:`` lines aside), the documented exit
code, no traceback, no internal error, no hang, bounded memory, nothing at the output,
nothing run from a pickle, nothing read or written outside the checkpoint. A case is *broken* when the real loaders reject it (see
``_oracle.py``) or it must be rejected whatever they say (code in a pickle, paths outside the
checkpoint, unreadable files): then no command may report success.

Cases that could hang or allocate run as a subprocess with a timeout and an address-space
limit, and their peak RSS is checked; the rest run in-process (CliRunner) for speed.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from _cases import BY_ID, MARKER
from conftest import ROOT, deny

from ckpt_tool.cli.app import app

runner = CliRunner()
pytestmark = pytest.mark.interop  # the real loaders (Megatron-Core) are the oracle
COMMANDS = ["inspect", "validate", "validate-deep", "convert", "diff", "reshard"]
# exit codes each command may give on a damaged input: never a crash code, never 130
ALLOWED = {"inspect": {0, 2}, "validate": {0, 1, 2}, "validate-deep": {0, 1, 2},
           "convert": {0, 1, 2}, "diff": {0, 1, 2}, "reshard": {0, 1, 2}}
LIMIT_AS = 6 << 30  # address space of an isolated command
MAX_RSS_KB = 1536 << 10  # its peak resident memory (torch itself is ~0.4 GB)
# Defects the corpus found that are not fixed yet (strict: the test fails once they are)
KNOWN: dict[tuple[str, str], str] = {}
TIMEOUT = 300  # only a hang gets near this, even on a loaded machine


def _argv(cmd: str, path: Path, out: Path, intact: Path) -> list[str]:
    return {"inspect": ["inspect", str(path)],
            "validate": ["validate", str(path)],
            "validate-deep": ["validate", "--deep", str(path)],
            "convert": ["convert", str(path), str(out), "--to", "safetensors"],
            "diff": ["diff", str(intact), str(path)],
            "reshard": ["reshard", str(path), str(out), "--tp", "1"]}[cmd]


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT_AS, LIMIT_AS))


def _run_isolated(argv: list[str], where: Path) -> tuple[int, str, str]:
    """``python -m ckpt_tool argv`` with a timeout and RLIMIT_AS; asserts the peak RSS."""
    so, se = where / "stdout", where / "stderr"
    with open(so, "wb") as out, open(se, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "ckpt_tool", *argv], stdout=out,
                                stderr=err, stdin=subprocess.DEVNULL, preexec_fn=_limit,
                                start_new_session=True)
    killed = []
    timer = threading.Timer(TIMEOUT, lambda: (killed.append(1),
                                              os.killpg(proc.pid, signal.SIGKILL)))
    timer.start()
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert not killed, f"{argv} hung (killed after {TIMEOUT} s)"
    assert usage.ru_maxrss < MAX_RSS_KB, f"{argv}: peak RSS {usage.ru_maxrss >> 10} MiB"
    return proc.returncode, so.read_text(errors="replace"), se.read_text(errors="replace")


def _record(case_id, cmd, code, stderr, broken) -> None:
    """``CKPT_CORPUS_LOG=FILE``: one JSON line per run (the README's figures come from it)."""
    log = os.environ.get("CKPT_CORPUS_LOG")
    if log:
        import json

        last = (stderr.strip().splitlines() or [""])[-1][:300]
        with open(log, "a") as f:
            f.write(json.dumps([case_id, cmd, code, broken, last]) + "\n")


def _broken(case, case_id, verdicts) -> bool:
    return case.must_reject or verdicts.get(case_id, "ok") != "ok"


def _outside_state(cdir: Path) -> dict:
    """Every file beside the checkpoint copy (outside it), with its size and mtime."""
    out = {}
    for p in sorted(cdir.rglob("*")):
        if "ck" in p.relative_to(cdir).parts[:1] or not p.is_file() and not p.is_fifo():
            continue
        st = os.lstat(p)
        out[str(p)] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.mark.parametrize("cmd", COMMANDS)
@pytest.mark.parametrize("case_id", sorted(BY_ID))
def test_command_on_bad_input(corpus, verdicts, case_id, cmd, tmp_path, monkeypatch, request):
    case = BY_ID[case_id]
    if case.deny is not None and ROOT and case.base == "torch" and cmd != "inspect":
        pytest.skip("as root, permissions are simulated in Python; torch.load opens the file "
                    "in C++ (real permissions are tested when not root)")
    if (case_id, cmd) in KNOWN:
        request.applymarker(pytest.mark.xfail(reason=KNOWN[case_id, cmd], strict=True))
    path = corpus.path(case_id)
    cdir = corpus.case_dir(case_id)
    before = _outside_state(cdir)
    out = tmp_path / "converted"
    argv = _argv(cmd, path, out, corpus.intact(case.base))
    restore = None
    if case.deny is not None:  # "" is the checkpoint file itself
        victim = (path / case.deny) if case.deny not in (".", "") else path
        if ROOT:
            deny(monkeypatch, victim)
        else:
            restore = (victim, os.stat(victim).st_mode)
            os.chmod(victim, 0)
    try:
        if case.isolate:
            code, stdout, stderr = _run_isolated(argv, tmp_path)
        else:
            r = runner.invoke(app, argv)
            code, stdout, stderr = r.exit_code, r.stdout, r.stderr
            if r.exception is not None and not isinstance(r.exception, SystemExit):
                raise AssertionError(f"{argv}: {r.exception!r}") from r.exception
    finally:
        if restore:
            os.chmod(*restore)
    label = f"{case_id} {cmd} -> {code}\n{stderr}"
    _record(case_id, cmd, code, stderr, _broken(case, case_id, verdicts))
    assert "Traceback" not in stdout + stderr, label
    assert "internal error" not in stderr, label  # a bad input is the input's error, never ours
    assert code in ALLOWED[cmd], label
    lines = [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("note:")]
    if code != 0:
        assert len(lines) == 1, label
        if code == 2:
            assert lines[0].startswith("ckpt: error: "), label
    if _broken(case, case_id, verdicts) and cmd != "inspect" and cmd not in case.lenient:
        assert code != 0, f"{label}\nreal loaders: {verdicts.get(case_id, 'not asked')}"
    if cmd in ("convert", "reshard") and code != 0:
        assert not out.exists() and set(os.listdir(tmp_path)) <= {"stdout", "stderr"}, \
            (label, os.listdir(tmp_path))
    assert not (cdir / MARKER).exists(), f"{label}: a pickle ran"
    assert _outside_state(cdir) == before, f"{label}: something outside the checkpoint changed"
