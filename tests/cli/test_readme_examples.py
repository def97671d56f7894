"""The README's examples run as printed: every ``ckpt`` command of its ``bash`` blocks and of
its ``console`` blocks (``$ ckpt …``), and its library snippet, run in one fresh directory
holding ``fixtures/``, in the order a reader meets them: the README, then docs/commands.md,
then docs/resume.md (a later example may read what an earlier one wrote; none may collide with
one before it); the other ``docs/*.md`` run as before, each ``bash`` block in a directory of
its own. Every command exits 0. Each ``convert fixtures/<F> <DST> --to hf`` of them writes a
model that transformers loads with no key missing, unexpected or mismatched, and whose logits
are the ones the real Megatron-Core computed when it wrote ``<F>``
(``<F>/expected/logits.safetensors``). The docs say the same things: the count of target
formats is the writers', and every ``fixtures/…`` path they and ``--help`` name exists. The
test fails when the docs drift from what the tool and its fixtures do."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "fixtures"
# the fixtures the README's HF examples must keep exporting (so the test cannot pass empty)
HF_FIXTURES = {"mcore016_llama_tp2pp2_distopt", "mcore016_mixtral_ep2"}


def readme_blocks() -> list[tuple[str, list[str]]]:
    """``(where, [command, ...])`` for each ``bash`` block with ``ckpt`` commands: its lines
    (and the parts of ``&&`` chains) that start with ``ckpt ``; and, per document, its
    ``console`` blocks (a command and what it printed) as one sequence: their ``$ ckpt ``
    lines in order (a later example may read what an earlier one wrote)."""
    out = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = doc.read_text(encoding="utf-8")
        for n, block in enumerate(re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S)):
            cmds = [part.strip() for line in block.splitlines()
                    if line.strip() and not line.lstrip().startswith("#")
                    for part in line.split("&&") if part.strip().startswith("ckpt ")]
            if cmds:
                out.append((f"{doc.name} block {n + 1}", cmds))
        shown = [line[2:].strip()
                 for block in re.findall(r"^```console\n(.*?)^```", text, re.M | re.S)
                 for line in block.splitlines() if line.startswith("$ ckpt ")]
        if shown:
            out.append((f"{doc.name} console examples", shown))
    return out


# read in this order, in one directory (what a new user does)
IN_ORDER = [REPO / "README.md", REPO / "docs" / "commands.md", REPO / "docs" / "resume.md"]


def steps_in_order(doc: Path) -> list[tuple[str, str]]:
    """``(kind, text)`` for each example of ``doc`` in the order it shows them: ``("ckpt",
    command)`` for the ``ckpt`` commands of ``bash`` blocks and the ``$ ckpt`` lines of
    ``console`` blocks, ``("python", code)`` for a ``python`` block of the library's
    commands (``from ckpt_tool.ops…``: one that needs a model or a process group is read,
    not run)."""
    out = []
    text = doc.read_text(encoding="utf-8")
    for kind, block in re.findall(r"^```(bash|console|python)\n(.*?)^```", text, re.M | re.S):
        if kind == "python":
            if "from ckpt_tool.ops" in block:
                out.append(("python", block))
            continue
        for line in block.splitlines():
            if kind == "console":
                if line.startswith("$ ckpt "):
                    out.append(("ckpt", line[2:].strip()))
            elif line.strip() and not line.lstrip().startswith("#"):
                out += [("ckpt", part.strip()) for part in line.split("&&")
                        if part.strip().startswith("ckpt ")]
    return out


def _run(cmd: str, cwd: Path) -> subprocess.CompletedProcess:
    argv = shlex.split(cmd, comments=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "ckpt_tool", *argv[1:]], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> list[tuple[str, Path]]:
    """Every example run: the README's, docs/commands.md's and docs/resume.md's in one
    directory, in order; each other doc's ``bash`` block in a directory of its own. The
    commands with the directory they ran in."""
    done = []
    cwd = tmp_path_factory.mktemp("in_order")
    (cwd / "fixtures").symlink_to(FIX)
    for doc in IN_ORDER:
        for kind, text in steps_in_order(doc):
            if kind == "python":
                res = subprocess.run([sys.executable, "-c", text], cwd=cwd, text=True,
                                     capture_output=True, timeout=900,
                                     env={**os.environ, "PYTHONPATH": str(REPO)})
                assert res.returncode == 0, f"{doc.name}: python block:\n{res.stderr}"
                continue
            res = _run(text, cwd)
            assert res.returncode == 0, \
                f"{doc.name}: `{text}` exited {res.returncode}:\n{res.stderr}"
            assert "Traceback" not in res.stderr, res.stderr
            done.append((text, cwd))
    for where, cmds in readme_blocks():
        if any(where.startswith(doc.name + " ") for doc in IN_ORDER):
            continue
        cwd = tmp_path_factory.mktemp(re.sub(r"\W+", "_", where))
        (cwd / "fixtures").symlink_to(FIX)
        for cmd in cmds:
            res = _run(cmd, cwd)
            assert res.returncode == 0, f"{where}: `{cmd}` exited {res.returncode}:\n{res.stderr}"
            assert "Traceback" not in res.stderr, res.stderr
            done.append((cmd, cwd))
    return done


def test_every_readme_command_runs_as_printed(ran):
    assert any(cmd.startswith("ckpt inspect fixtures/") for cmd, _ in ran)
    assert any(kind == "python" for kind, _ in steps_in_order(REPO / "README.md"))
    shown = {where for where, _ in readme_blocks() if where.endswith("console examples")}
    assert "README.md console examples" in shown, "the README shows no command with its output"


def _hf_exports(ran) -> dict[str, Path]:
    """``{fixture name: the HF directory the README exports it to}``."""
    out = {}
    for cmd, cwd in ran:
        argv = shlex.split(cmd)
        if argv[:2] == ["ckpt", "convert"] and "--to" in argv \
                and argv[argv.index("--to") + 1] == "hf" and argv[2].startswith("fixtures/"):
            out[Path(argv[2]).name] = cwd / argv[3]
    return out


@pytest.mark.parametrize("fixture", sorted(HF_FIXTURES))
def test_readme_hf_exports_load_in_transformers_with_megatrons_logits(ran, fixture):
    transformers = pytest.importorskip("transformers")
    import torch
    from safetensors.torch import load_file

    exports = _hf_exports(ran)
    assert fixture in exports, f"the README no longer exports {fixture} to HF: {exports}"
    expected = load_file(FIX / fixture / "expected" / "logits.safetensors")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        exports[fixture], dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # missing, unexpected, mismatched keys, errors
    with torch.no_grad():
        got = model.eval()(expected["tokens"]).logits
    torch.testing.assert_close(got, expected["logits"], rtol=1e-4, atol=1e-5)


def _help_texts() -> str:
    from typer.testing import CliRunner

    from ckpt_tool.cli.app import app

    runner = CliRunner()
    return "".join(runner.invoke(app, [cmd, "--help"]).stdout
                   for cmd in ("inspect", "validate", "reshard", "convert", "diff"))


def test_the_docs_and_help_name_fixtures_that_exist_and_the_same_format_count():
    from ckpt_tool.formats.writer import WRITERS

    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    texts = {d.name: d.read_text(encoding="utf-8") for d in docs}
    texts["--help"] = _help_texts()
    missing = {(where, m) for where, text in texts.items()
               for m in re.findall(r"(?<![\w/.])fixtures/([\w.-]+)", text)
               if not (FIX / m).exists() and not m.endswith("_")}  # (``mcore014_*``)
    assert not missing, sorted(missing)
    assert "checkpoints/gpt" not in texts["--help"]
    words = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven",
             8: "eight", 9: "nine"}
    counts = {(where, n) for where, text in texts.items()
              for n in re.findall(r"(\w+) formats out", text)}
    assert counts and {n for _, n in counts} == {words[len(WRITERS)]}, counts
