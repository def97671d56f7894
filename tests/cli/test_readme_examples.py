"""The README's examples run as printed: every ``ckpt`` command of its ``bash`` blocks (and of
``docs/*.md``'s) runs in a fresh directory holding ``fixtures/``, each block's commands in
order, and exits 0. Each ``convert fixtures/<F> <DST> --to hf`` of them writes a model that
transformers loads with no key missing, unexpected or mismatched, and whose logits are the ones
the real Megatron-Core computed when it wrote ``<F>`` (``<F>/expected/logits.safetensors``).
The test fails when the README drifts from what the tool and its fixtures do."""

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


def _run(cmd: str, cwd: Path) -> subprocess.CompletedProcess:
    argv = shlex.split(cmd, comments=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "ckpt_tool", *argv[1:]], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> list[tuple[str, Path]]:
    """Every README command run (each block in a directory of its own); the commands with
    the directory they ran in."""
    done = []
    for where, cmds in readme_blocks():
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
