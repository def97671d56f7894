"""A checkpoint whose path is not UTF-8 (a Linux file name is bytes; ``\\xff`` is no UTF-8)
goes through every command, and what ``convert`` and ``reshard`` write from it loads in the
real loaders (``_oracle.py``): a path written into an output's metadata (the safetensors
header's ``source``) reads ``\\xNN``, never an encoder's internal error."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _cases import FIXTURE_BASES

pytestmark = pytest.mark.interop  # the real loaders are the oracle
ORACLE = Path(__file__).with_name("_oracle.py")
NAME = os.fsdecode(b"ck-\xff\xfe")  # what Python makes of the bytes: lone surrogates
SHOWN = "ck-\\xff\\xfe"  # how the name reads in an output's metadata
OUTPUTS = {"safetensors": ("safetensors", "model.safetensors"), "torch": ("torch", "model.pt"),
           "torch_dist": ("torch_dist", ""), "dcp": ("dcp", ""), "legacy": ("legacy", "")}


def _ok(argv: list[str]) -> str:
    """``ckpt ARGV`` in a strict UTF-8 locale's terminal (what a name that is not UTF-8 meets
    there: an encoder that refuses lone surrogates); it must succeed."""
    env = dict(os.environ, PYTHONIOENCODING="utf-8:strict", PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-m", "ckpt_tool", *argv], env=env,
                       capture_output=True, timeout=600)
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 0 and "internal error" not in err, (argv, err[-3000:])
    return r.stdout.decode(errors="surrogateescape")


def test_every_command_on_a_path_that_is_not_utf8(tmp_path):
    src = tmp_path / NAME / "iter_0000010"
    shutil.copytree(FIXTURE_BASES["torch_dist"], src)
    assert str(src) in _ok(["inspect", str(src)])  # the name as its bytes
    for argv in (["inspect", str(src), "--json"],
                 ["validate", str(src)], ["validate", "--deep", str(src), "--json"],
                 ["diff", str(FIXTURE_BASES["torch_dist"]), str(src)]):
        _ok(argv)
    todo = []
    for to, (base, inside) in OUTPUTS.items():
        out = tmp_path / f"{NAME}-{to}"
        _ok(["convert", str(src), str(out), "--to", to])
        todo.append([to, base, str(out / inside) if inside else str(out)])
    single = tmp_path / f"{NAME}.safetensors"  # one file whose own name is not UTF-8 either
    _ok(["convert", str(src), str(single), "--to", "safetensors"])
    _ok(["validate", str(single)])
    todo.append(["single-file", "safetensors", str(single)])
    resharded = tmp_path / f"{NAME}-tp1"
    _ok(["reshard", str(src), str(resharded), "--tp", "1"])
    todo.append(["reshard", "torch_dist", str(resharded)])

    # the loaders get each output under a UTF-8 name (a link): safetensors cannot open a
    # path that is not UTF-8 at all; what is checked is what ckpt wrote inside
    from ckpt_tool.formats.save_dir import resolve_checkpoint_dir

    links = tmp_path / "as-utf8"
    links.mkdir()
    for entry in todo:  # (a dist output is a save directory: the loader gets its checkpoint)
        link = links / entry[0]
        os.symlink(resolve_checkpoint_dir(entry[2]) if entry[1] == "torch_dist" else entry[2],
                   link)
        entry[2] = str(link)
    from safetensors import safe_open

    with safe_open(str(links / "single-file"), "pt") as f:  # the header is valid UTF-8 JSON
        assert f.metadata()["source"].endswith(f"{SHOWN}/iter_0000010")
    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps(todo))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, str(ORACLE), str(cases), str(tmp_path / "out.json")],
                       env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-4000:]
    verdicts = json.loads((tmp_path / "out.json").read_text())
    assert verdicts == {k: "ok" for k, _, _ in todo}, verdicts


@pytest.mark.parametrize("argv", [["inspect"], ["validate"], ["validate", "--deep"],
                                  ["convert", "--to", "safetensors"], ["diff"]])
def test_intact_cases_succeed(corpus, argv, tmp_path):
    """The corpus's intact cases (``tags=("intact",)``: a symlink to ``/`` nothing references
    beside the files) are what they were: every command succeeds on them."""
    from typer.testing import CliRunner

    from _cases import BY_ID
    from ckpt_tool.cli.app import app

    for case_id in sorted(k for k, c in BY_ID.items() if "intact" in c.tags):
        path = str(corpus.path(case_id))
        full = [argv[0], path, *argv[1:]]
        if argv[0] == "convert":
            full = ["convert", path, str(tmp_path / case_id.replace("/", "-")), *argv[1:]]
        elif argv[0] == "diff":
            full = ["diff", str(corpus.intact(BY_ID[case_id].base)), path]
        r = CliRunner().invoke(app, full)
        assert r.exit_code == 0, (case_id, full, r.stderr)


def test_a_layout_no_rank_file_says_is_supplied_by_the_flag(corpus, tmp_path):
    """A rank file without ``args`` is refused (the layout is never guessed); with the flag
    the error names, the conversion equals the intact checkpoint's."""
    from typer.testing import CliRunner

    from ckpt_tool.cli.app import app

    path = str(corpus.path("legacy/first-rank-without-args"))
    run = CliRunner().invoke
    r = run(app, ["convert", path, str(tmp_path / "a"), "--to", "torch_dist"])
    assert r.exit_code == 2 and "--swiglu/--no-swiglu" in r.stderr, r.stderr
    r = run(app, ["validate", path])
    assert r.exit_code == 1 and "has no args" in r.stdout + r.stderr
    r = run(app, ["convert", path, str(tmp_path / "a"), "--to", "torch_dist", "--swiglu"])
    assert r.exit_code == 0, r.stderr
    r = run(app, ["convert", str(corpus.intact("legacy")), str(tmp_path / "b"), "--to",
                  "torch_dist"])
    assert r.exit_code == 0, r.stderr
    r = run(app, ["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json"])
    import json

    report = json.loads(r.stdout)
    assert report["values"] == [] and report["stats"]["tensors_equal_bytes"] == \
        report["stats"]["tensors_common"] > 0, report["stats"]


def test_a_hugging_face_cache_snapshot_links_into_its_blobs(tmp_path):
    """The one layout whose files are links out of the directory named: a Hugging Face hub
    cache snapshot (``<repo>/snapshots/<rev>/*`` -> ``<repo>/blobs/<hash>``) reads as it is;
    a link out of the repository directory is refused."""
    from safetensors.torch import save_file
    import torch
    from typer.testing import CliRunner

    from ckpt_tool.cli.app import app

    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    save_file({"w": torch.ones(2, 2)}, str(repo / "blobs" / "f00d"))
    os.symlink("../../blobs/f00d", snap / "model.safetensors")
    r = CliRunner().invoke(app, ["validate", str(snap)])
    assert r.exit_code == 0, r.stdout + r.stderr
    os.rename(repo / "blobs" / "f00d", tmp_path / "f00d")
    os.unlink(snap / "model.safetensors")
    os.symlink(tmp_path / "f00d", snap / "model.safetensors")
    r = CliRunner().invoke(app, ["validate", str(snap)])
    assert r.exit_code == 2 and "outside the checkpoint" in r.stderr, r.stdout + r.stderr
