"""Fault injection (issue 15): ``kill -9`` at random (seeded) moments of ``convert``,
``reshard`` and the library's async save, and a file system that fills up.

After every kill: the source is byte-identical; whatever is at the target either does not
validate (an interrupted library save: no ``metadata.json``) or validates and equals what an
uninterrupted run writes (``diff`` exit 0) — with ``--overwrite`` that is the old output or
the new one, never a mix; what the killed run left beside the target is reported by
``validate`` and ``inspect`` on the target, and a rerun reclaims it and succeeds.

The runs are forked from one pre-imported process (``_fault_zygote.py``), so each kill costs
the run's own work, not torch's import. The kill moments are drawn uniformly over the time an
uninterrupted run of the same job takes (measured here, never asserted on). ``CKPT_FAULTS_
REPORT=PATH`` writes the outcome counts (the README's figures) as JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpt_tool.cli.app import app
from ckpt_tool.errors import InputError
from ckpt_tool.leftovers import leftovers
from ckpt_tool.ops.diff import diff
from ckpt_tool.ops.validate import validate

runner = CliRunner()
SRC = Path(__file__).resolve().parents[2] / "fixtures" / "mcore016_gpt_tp2pp2_fp32"
ZYGOTE = Path(__file__).with_name("_fault_zygote.py")
TRIALS = int(os.environ.get("CKPT_FAULT_TRIALS", "30"))
SEED = 15

JOBS = {  # name -> ckpt arguments after SRC DST (None: the library's async save)
    "convert-safetensors": ["convert", "--to", "safetensors"],
    "convert-torch_dist": ["convert", "--to", "torch_dist"],
    "convert-dcp": ["convert", "--to", "dcp"],
    "convert-legacy": ["convert", "--to", "legacy"],
    "reshard-tp1": ["reshard", "--tp", "1"],
    "async-save": None,
}


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

    def start(self, job: str, dst: Path, log: Path, overwrite: bool = False) -> int:
        if JOBS[job] is None:
            return self.ask(save=str(dst), log=str(log))["pid"]
        cmd, *opts = JOBS[job]
        argv = [cmd, str(SRC), str(dst), *opts, "--no-progress"]
        return self.ask(argv=argv + (["--overwrite"] if overwrite else []), log=str(log))["pid"]

    def wait(self, pid: int) -> int:
        return self.ask(wait=pid)["status"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


def _run(z: Zygote, job: str, dst: Path, log: Path, overwrite: bool = False) -> float:
    t0 = time.monotonic()
    status = z.wait(z.start(job, dst, log, overwrite))
    assert status == 0, log.read_text()
    return time.monotonic() - t0


def _same(a: Path, b: Path) -> bool:
    return diff(a, b).identical


def _check_target(job: str, dst: Path, ref: Path) -> str:
    """The invariant at the target after a kill; returns what was found there."""
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
    assert _same(dst, ref), job
    return "complete, equal"


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


def _check_reported(dst: Path, left: list[Path]) -> None:
    names = [p.name for p in left]
    for cmd in ("validate", "inspect"):
        res = runner.invoke(app, [cmd, str(dst)])
        text = res.output
        if not dst.exists():
            assert res.exit_code == 2 and "interrupted write left" in text, text
            assert names[0] in text, text
        else:
            assert "Traceback" not in text and any(n in text for n in names), (cmd, text)


def test_kill_9_at_random_moments(zygote, tmp_path):
    rng = random.Random(SEED)
    before = _tree_hash(SRC)
    refs, took = {}, {}
    for job in JOBS:  # the uninterrupted runs: the expected outputs and the time to spread over
        refs[job] = tmp_path / f"ref-{job}"
        took[job] = _run(zygote, job, refs[job], tmp_path / f"ref-{job}.log")
    outcomes: Counter = Counter()
    per_job: dict[str, Counter] = {j: Counter() for j in JOBS}
    for i in range(TRIALS):
        job = list(JOBS)[i % len(JOBS)]
        dst = tmp_path / f"t{i}"
        overwrite = JOBS[job] is not None and rng.random() < 0.4
        if overwrite:  # an older complete output is being replaced
            shutil.copytree(refs[job], dst)
        delay = rng.uniform(0.0, took[job])
        pid = zygote.start(job, dst, tmp_path / f"t{i}.log", overwrite)
        time.sleep(delay)
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        status = zygote.wait(pid)
        _forget(pid)
        assert _tree_hash(SRC) == before, f"trial {i}: the source changed"
        found = _check_target(job, dst, refs[job])
        left = leftovers(dst)
        if left:
            _check_reported(dst, left)
        # the rerun: reclaims what the killed run left, and writes the target
        log = tmp_path / f"t{i}.rerun.log"
        if JOBS[job] is None:
            _run(zygote, job, dst, log)
        else:
            _run(zygote, job, dst, log, overwrite=dst.exists())
            if left:
                assert "reclaimed" in log.read_text(), log.read_text()
        assert leftovers(dst) == [] and not [n for n in os.listdir(tmp_path)
                                             if n.startswith(f".{dst.name}.")]
        assert validate(dst).ok and _same(dst, refs[job])
        what = ("killed" if status == -signal.SIGKILL else "finished before the kill") + \
            f", {found}" + (f", {len(left)} leftover(s) reported and reclaimed" if left else "")
        outcomes[what] += 1
        per_job[job][what] += 1
    assert _tree_hash(SRC) == before
    killed = sum(n for k, n in outcomes.items() if k.startswith("killed"))
    assert killed >= TRIALS // 2  # most kills landed while the job ran
    report = {"trials": TRIALS, "seed": SEED, "outcomes": dict(outcomes),
              "per_job": {j: dict(c) for j, c in per_job.items()},
              "uninterrupted_seconds": {j: round(t, 2) for j, t in took.items()}}
    print(json.dumps(report, indent=1))
    if os.environ.get("CKPT_FAULTS_REPORT"):
        Path(os.environ["CKPT_FAULTS_REPORT"]).write_text(json.dumps(report, indent=1))
