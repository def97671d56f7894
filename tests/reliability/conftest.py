"""Session fixtures of the bad-input corpus: one damaged copy per case (made once, shared by
every command's test), the pristine originals, and the real loaders' verdicts (one subprocess
for the whole corpus)."""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _cases  # noqa: E402

ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


class Corpus:
    """Lazily made copies: ``case_dir(id)/ck`` is the damaged checkpoint."""

    def __init__(self, root: Path):
        self.root = root
        self.pristine = {**_cases.write_pristine(root / "pristine"),
                         **_cases.FIXTURE_BASES}
        self._made: dict[str, Path] = {}

    def intact(self, base: str) -> Path:
        return self.pristine[base]

    def path(self, case_id: str) -> Path:
        """The damaged copy of ``case_id`` (made on first use)."""
        if case_id not in self._made:
            case = _cases.BY_ID[case_id]
            cdir = self.root / ("case-" + case_id.replace("/", "--"))
            src = self.pristine[case.base]
            ck = cdir / "ck"
            if src.is_dir():
                shutil.copytree(src, ck, symlinks=True)
                target = ck
            else:
                ck.mkdir(parents=True)
                target = Path(shutil.copy(src, ck / src.name))
            case.mutate(target)
            self._made[case_id] = target
        return self._made[case_id]

    def case_dir(self, case_id: str) -> Path:
        p = self.path(case_id)
        return next(q for q in (p, *p.parents) if q.name == "ck").parent


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Corpus:
    return Corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def verdicts(corpus, tmp_path_factory) -> dict[str, str]:
    """What the real loaders say about every case they can be asked about."""
    todo = [[cid, c.base, str(corpus.path(cid))] for cid, c in _cases.BY_ID.items() if c.oracle]
    todo += [[f"intact/{b}", b, str(corpus.intact(b))] for b in sorted(corpus.pristine)]
    work = tmp_path_factory.mktemp("oracle")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    (work / "cases.json").write_text(json.dumps(todo))
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("_oracle.py")),
                        str(work / "cases.json"), str(work / "out.json")], env=env,
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads((work / "out.json").read_text())


def deny(monkeypatch, victim: Path) -> None:
    """Root ignores permissions: make every open/scandir of ``victim`` (or below) fail with
    EACCES in-process, as it does for other users on a ``chmod 000`` path."""
    victim = os.path.normpath(str(victim))

    def denied(p):
        try:
            s = os.fspath(p)
        except TypeError:
            return False
        s = os.path.normpath(s.decode() if isinstance(s, bytes) else s)
        return s == victim or s.startswith(victim + os.sep)

    def wrap(fn):
        def inner(p, *a, **k):
            if denied(p):
                raise PermissionError(errno.EACCES, "Permission denied", os.fspath(p))
            return fn(p, *a, **k)
        return inner

    for mod, name in ((builtins, "open"), (io, "open"), (os, "open"), (os, "scandir"),
                      (os, "listdir")):
        monkeypatch.setattr(mod, name, wrap(getattr(mod, name)))
