"""Fault injection: ``kill -9`` of ``convert``, ``reshard`` and the library's async save at
every named moment of a write (``ckpt_tool._pause_points``), and a failing run after a kill.

Each trial starts a job that holds at one point, waits until it is there (a marker file: an
event, so a busy machine changes nothing but the wait), and kills its whole process group
(the async save's writer included). After every kill: the source is byte-identical; what is
at the target is exactly what that moment leaves (nothing; the old output, whole; the new
one, whole and equal to an uninterrupted run's; an incomplete library save that says so);
what the killed run left beside the target is reported by ``validate`` and ``inspect`` on it
(a parked previous output with the command that restores it); and a rerun puts back or
reclaims it and succeeds. ``--overwrite`` trials replace an older complete output, with the
atomic exchange of the two and, on a file system without one, by parking the old output.

The runs are forked from one pre-imported process (``_fault_zygote.py``), so each trial costs
the run's own work, not torch's import. ``CKPT_FAULTS_REPORT=PATH`` writes the outcomes
(docs/reliability.md's figures) as JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpt_tool.cli.app import app
from ckpt_tool.errors import InputError
from ckpt_tool.leftovers import OLD_MARK, STAGING_MARK, leftovers, parked_previous, \
    restore_command
from ckpt_tool.ops.diff import diff
from ckpt_tool.ops.validate import validate

runner = CliRunner()
SRC = Path(__file__).resolve().parents[2] / "fixtures" / "mcore016_gpt_tp2pp2_fp32"
ZYGOTE = Path(__file__).with_name("_fault_zygote.py")

JOBS = {  # name -> ckpt arguments after SRC DST (None: the library's async save)
    "convert-safetensors": ["convert", "--to", "safetensors"],
    "convert-torch_dist": ["convert", "--to", "torch_dist"],
    "convert-dcp": ["convert", "--to", "dcp"],
    "convert-legacy": ["convert", "--to", "legacy"],
    "reshard-tp1": ["reshard", "--tp", "1"],
    "async-save": None,
}
CLI_JOBS = [j for j, argv in JOBS.items() if argv is not None]


@dataclass(frozen=True)
class Trial:
    job: str
    point: str
    overwrite: bool = False  # an older complete output is being replaced
    no_exchange: bool = False  # the file system cannot exchange two paths atomically

    @property
    def id(self) -> str:
        return "-".join([self.job, self.point] + ["overwrite"] * self.overwrite
                        + ["parking"] * self.no_exchange)


def _trials() -> list[Trial]:
    out = []
    for job in CLI_JOBS:  # in the middle of each writer's work, fresh and replacing
        out += [Trial(job, "writing"), Trial(job, "writing", overwrite=True)]
    staging_points = [("staging", False, False), ("fsynced", False, False),
                      ("renamed", False, False), ("fsynced", True, False),
                      ("renamed", True, False), ("between-renames", True, True),
                      ("renamed", True, True)]
    for i, (point, overwrite, no_exchange) in enumerate(staging_points):  # shared code: spread
        out.append(Trial(CLI_JOBS[i % len(CLI_JOBS)], point, overwrite, no_exchange))
    out += [Trial("async-save", "save-file-written"), Trial("async-save", "save-finalize")]
    return out


TRIALS = _trials()
OUTCOMES: Counter = Counter()


def _tree_hash(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(p.relative_to(root).as_posix().encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


class Zygote:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(ZYGOTE)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)

    def ask(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the zygote died"
        return json.loads(line)

    def start(self, job: str, dst: Path, log: Path, overwrite: bool = False,
              **extra) -> int:
        if JOBS[job] is None:
            return self.ask(save=str(dst), log=str(log), **extra)["pid"]
        cmd, *opts = JOBS[job]
        argv = [cmd, str(SRC), str(dst), *opts, "--no-progress"]
        return self.ask(argv=argv + (["--overwrite"] if overwrite else []), log=str(log),
                        **extra)["pid"]

    def wait(self, pid: int) -> int:
        return self.ask(wait=pid)["status"]

    def poll(self, pid: int) -> int | None:
        return self.ask(poll=pid)["status"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()
    if os.environ.get("CKPT_FAULTS_REPORT"):
        Path(os.environ["CKPT_FAULTS_REPORT"]).write_text(json.dumps(
            {"trials": sum(OUTCOMES.values()), "outcomes": dict(OUTCOMES)}, indent=1))


@pytest.fixture(scope="module")
def refs(zygote, tmp_path_factory):
    """What an uninterrupted run of each job writes, and the source's hash before any trial."""
    where = tmp_path_factory.mktemp("refs")
    before = _tree_hash(SRC)
    out = {}
    for job in JOBS:
        out[job] = where / job
        _run(zygote, job, out[job], where / f"{job}.log")
    return out, before


def _run(z: Zygote, job: str, dst: Path, log: Path, overwrite: bool = False) -> None:
    status = z.wait(z.start(job, dst, log, overwrite))
    assert status == 0, log.read_text()


def _wait_for(z: Zygote, pid: int, pause: Path, point: str, log: Path) -> None:
    """Until the job holds at ``point`` (its marker file exists). The deadline only keeps a
    broken build from hanging the suite: nothing is asserted about how long it took."""
    mark = re.compile(rf"^{re.escape(point)}\.\d+$")
    deadline = time.monotonic() + 900
    while not any(mark.match(n) for n in os.listdir(pause)):
        status = z.poll(pid)
        assert status is None, f"the job ended ({status}) before {point}: {log.read_text()}"
        assert time.monotonic() < deadline, f"the job never reached {point}"
        time.sleep(0.01)


def _forget(pid: int) -> None:
    """What a killed async save cannot clean up itself: its shared-memory staging segments and
    its results file (named after its pid)."""
    import glob
    import tempfile

    for f in glob.glob(f"/dev/shm/ckpt_stage_{pid}_*") + glob.glob(
            os.path.join(tempfile.gettempdir(), f"ckpt_async_{pid}_*")):
        try:
            os.unlink(f)
        except OSError:
            pass


def _at_target(job: str, dst: Path, ref: Path) -> str:
    """What is at the target after a kill (each outcome checked as it is named)."""
    if not dst.exists():
        return "no target"
    try:
        r = validate(dst)
    except InputError as exc:  # an async save killed before any file: nothing to mistake
        assert job == "async-save", exc
        return "incomplete save, reported"
    if job == "async-save" and not r.ok:  # the library saves in place: incomplete, and says so
        assert any("not a complete checkpoint" in f.message for f in r.errors), r.findings
        return "incomplete save, reported"
    assert r.ok, (job, r.findings)
    assert diff(dst, ref).identical, job
    return "complete, equal"


# what each moment leaves: (at the target, beside it)
EXPECTED = {
    ("staging", False, False): ("no target", "staging"),
    ("writing", False, False): ("no target", "staging"),
    ("fsynced", False, False): ("no target", "staging"),
    ("renamed", False, False): ("complete, equal", None),
    ("writing", True, False): ("complete, equal", "staging"),  # the old output, whole
    ("fsynced", True, False): ("complete, equal", "staging"),
    ("renamed", True, False): ("complete, equal", "staging"),  # the new one; the old in staging
    ("between-renames", True, True): ("no target", "parked"),
    ("renamed", True, True): ("complete, equal", None),  # the parked old one deleted
    ("save-file-written", False, False): ("incomplete save, reported", None),
    ("save-finalize", False, False): ("incomplete save, reported", None),
}


def _check_reported(dst: Path, left: list[Path]) -> None:
    names = [p.name for p in left]
    parked = parked_previous(dst)
    for cmd in ("validate", "inspect"):
        res = runner.invoke(app, [cmd, str(dst)])
        text = " ".join(res.output.split())
        if parked is not None:  # the previous output, and how to put it back
            assert res.exit_code == 2, text
            assert "previous checkpoint" in text and restore_command(parked, dst) in text, text
        elif not dst.exists():
            assert res.exit_code == 2 and "interrupted write left" in text, text
            assert names[0] in text, text
        else:
            assert "Traceback" not in text and any(n in text for n in names), (cmd, text)


@pytest.mark.parametrize("trial", TRIALS, ids=[t.id for t in TRIALS])
def test_kill_9_at_each_moment_of_a_write(zygote, refs, tmp_path, trial):
    ref = refs[0][trial.job]
    dst = tmp_path / "target"
    if trial.overwrite:
        shutil.copytree(ref, dst)
    pause = tmp_path / "pause"
    pause.mkdir()
    log = tmp_path / "killed.log"
    pid = zygote.start(trial.job, dst, log, trial.overwrite, no_exchange=trial.no_exchange,
                       env={"CKPT_PAUSE_AT": trial.point, "CKPT_PAUSE_DIR": str(pause)})
    _wait_for(zygote, pid, pause, trial.point, log)
    os.killpg(pid, signal.SIGKILL)
    assert zygote.wait(pid) == -signal.SIGKILL
    _forget(pid)
    assert _tree_hash(SRC) == refs[1], "the source changed"
    found = _at_target(trial.job, dst, ref)
    left = leftovers(dst)
    beside = None if not left else "parked" if any(OLD_MARK in p.name for p in left) \
        else "staging" if all(STAGING_MARK in p.name for p in left) else "other"
    assert (found, beside) == EXPECTED[trial.point, trial.overwrite, trial.no_exchange]
    if beside == "parked" and found == "no target":  # the previous output is intact
        parked = parked_previous(dst)
        assert parked is not None and diff(parked, ref).identical
    if left:
        _check_reported(dst, left)
    # the rerun (the same command): puts back or reclaims what the killed run left, writes
    rerun = tmp_path / "rerun.log"
    _run(zygote, trial.job, dst, rerun, overwrite=trial.overwrite or dst.exists())
    if left:
        text = rerun.read_text()
        assert ("restored the previous output" in text) == (found == "no target"
                                                            and beside == "parked"), text
        assert "reclaimed" in text or "restored" in text, text
    assert leftovers(dst) == [] and not [n for n in os.listdir(tmp_path)
                                         if n.startswith(f".{dst.name}.")]
    assert validate(dst).ok and diff(dst, ref).identical
    done = "restored" if beside == "parked" and found == "no target" else "reclaimed"
    OUTCOMES[f"{trial.point}{' --overwrite' if trial.overwrite else ''}"
             f"{' (parking)' if trial.no_exchange else ''}: {found}"
             + (f", {beside} reported and {done}" if beside else "")] += 1


def test_a_failing_run_after_a_kill_keeps_the_previous_output(zygote, refs, tmp_path):
    """Killed between the renames of ``--overwrite`` (the old output parked, the target
    missing), then a run for that target fails (a damaged source): the previous output is put
    back (or still parked), never deleted; the rerun with a good source replaces it."""
    job = "convert-torch_dist"
    ref = refs[0][job]
    dst = tmp_path / "target"
    shutil.copytree(ref, dst)
    pause = tmp_path / "pause"
    pause.mkdir()
    pid = zygote.start(job, dst, tmp_path / "killed.log", True, no_exchange=True,
                       env={"CKPT_PAUSE_AT": "between-renames", "CKPT_PAUSE_DIR": str(pause)})
    _wait_for(zygote, pid, pause, "between-renames", tmp_path / "killed.log")
    os.killpg(pid, signal.SIGKILL)
    zygote.wait(pid)
    assert not dst.exists() and parked_previous(dst) is not None
    bad = tmp_path / "bad"  # a source whose data file is cut short: the run fails while writing
    shutil.copytree(SRC / "iter_0000010", bad)
    data = bad / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    res = subprocess.run([sys.executable, "-m", "ckpt_tool", "convert", str(bad), str(dst),
                          "--to", "torch_dist", "--overwrite"], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr
    kept = dst if dst.exists() else parked_previous(dst)
    assert kept is not None and diff(kept, ref).identical, res.stderr
    _run(zygote, job, dst, tmp_path / "rerun.log", overwrite=True)
    assert leftovers(dst) == [] and validate(dst).ok and diff(dst, ref).identical
