"""Everything a command prints for people fits the terminal: on a pseudo-terminal 60, 80 and
120 columns wide, every command's success and failure output is folded between words (a line
longer than the terminal is one word alone: a path, a key), continuation lines are indented
under their label, no word of the piped output is cut, and the resume recipe copied from the
terminal gives back the same flags and the same Python statements as ``--json`` names. Piped,
the same messages are single lines."""

from __future__ import annotations

import ast
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _terminal import run_on_terminal  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "fixtures"
OPTIM = FIX / "mcore016_gpt_tp2pp2_bf16_optim"
FP32 = FIX / "mcore016_gpt_tp2pp2_fp32"
DCP = FIX / "dcp_plain"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
WIDTHS = (60, 80, 120)

# (name, argv with {tmp} for a fresh directory and {bad} for a damaged copy, exit code)
CASES = [
    ("inspect ok", ["inspect", str(FP32)], 0),
    ("inspect missing", ["inspect", "{tmp}/a-checkpoint-directory-that-is-not-there"], 2),
    ("validate ok", ["validate", str(OPTIM), "--expect-tp", "2"], 0),
    ("validate bad", ["validate", "{bad}"], 1),
    ("reshard ok", ["reshard", str(OPTIM), "{tmp}/tp1", "--tp", "1", "--pp", "1"], 0),
    ("reshard infeasible", ["reshard", str(OPTIM), "{tmp}/tp3", "--tp", "3"], 1),
    ("convert ok", ["convert", str(FP32), "{tmp}/dist", "--to", "torch_dist"], 0),
    ("convert exists", ["convert", str(FP32), str(DCP), "--to", "torch_dist"], 2),
    ("diff ok", ["diff", str(DCP), str(DCP)], 0),
    ("diff different", ["diff", str(OPTIM), str(FP32)], 1),
]


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    out = tmp_path_factory.mktemp("bad") / "ckpt"
    shutil.copytree(OPTIM, out)
    for f in sorted((out / "iter_0000010").glob("*.distcp"))[:2]:
        f.write_bytes(f.read_bytes()[:100])
    return out


def _argv(argv, tmp, bad):
    return [a.format(tmp=tmp, bad=bad) for a in argv] + ["--no-progress"] * (
        argv[0] in ("validate", "reshard", "convert", "diff"))


def _screen(text: str) -> list[str]:
    """The lines as the terminal shows them (colours dropped, a redrawn line's last form)."""
    return [line.split("\r")[-1] for line in ANSI.sub("", text).split("\n")]


def _piped(argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckpt_tool", *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def _recipe_blocks(lines: list[str]) -> tuple[list[str], str]:
    """The Megatron-LM flags and the dist_checkpointing code, as copied from the screen."""
    flags, code, into = [], [], None
    for line in lines:
        if line.startswith("resume with Megatron-LM"):
            into = flags
        elif line.startswith("resume with dist_checkpointing"):
            into = code
        elif into is not None and line.startswith("    "):
            into.append(line[4:])
        else:
            into = None
    joined = " ".join(f[:-2] if f.endswith(" \\") else f for f in flags)
    return shlex.split(joined), "\n".join(code)


@pytest.mark.parametrize("name,argv,code", CASES, ids=[c[0] for c in CASES])
def test_output_fits_the_terminal_and_cuts_no_word(tmp_path, bad, name, argv, code):
    (tmp_path / "piped").mkdir()
    piped = _piped(_argv(argv, tmp_path / "piped", bad))
    assert piped.returncode == code, piped.stderr
    words = set((piped.stdout + piped.stderr).split())
    for columns in WIDTHS:
        shutil.rmtree(tmp_path / "term", ignore_errors=True)
        (tmp_path / "term").mkdir()
        got, text = run_on_terminal(_argv(argv, tmp_path / "term", bad), columns=columns)
        assert got == code, text
        lines = _screen(text)
        # (a word alone may be wider: a path, with a shell continuation or a bracket)
        long = [line for line in lines if len(line) > columns
                and " " in line.strip().removesuffix(" \\")]
        assert not long, "\n".join(lines)
        seen = set(" ".join(lines).split())
        # every word of a message is whole on the terminal (the paths of the two runs
        # differ, the recipe is laid out for copying, tables are drawn in boxes)
        said = {w for line in piped.stderr.splitlines() if not line.startswith("resume with")
                for w in line.split() if "/piped/" not in w and "/term/" not in w
                and not re.fullmatch(r"[\d.]+", w)}  # (seconds taken differ too)
        assert said <= seen, sorted(said - seen)
        assert words  # (the piped run printed something)


def test_notes_continue_under_their_label(tmp_path):
    got, text = run_on_terminal(["reshard", str(OPTIM), str(tmp_path / "o"), "--tp", "1",
                                 "--pp", "1", "--no-progress"], columns=60)
    assert got == 0, text
    lines = _screen(text)
    notes = [i for i, line in enumerate(lines) if line.startswith("note: ")]
    assert notes, text
    for i in notes:  # each note's next line is a continuation under its text, or a new field
        nxt = lines[i + 1]
        assert nxt.startswith(" " * 6) or re.match(r"\S", nxt), text
    assert any(lines[i + 1].startswith(" " * 6) for i in notes)  # (a note did continue)
    got, text = run_on_terminal(["inspect", str(FP32)], columns=60)
    lines = _screen(text)
    at = next(i for i, line in enumerate(lines) if line.startswith("backend: "))
    assert lines[at + 1].startswith(" " * len("backend: ")) and lines[at + 1][9] != " "


@pytest.mark.parametrize("columns", WIDTHS)
@pytest.mark.parametrize("command", ["reshard", "convert"])
def test_the_resume_recipe_copies_whole_at_any_width(tmp_path, command, columns):
    extra = ["--tp", "1", "--pp", "1"] if command == "reshard" else ["--to", "torch_dist"]
    src = OPTIM if command == "reshard" else FP32
    done = _piped([command, str(src), str(tmp_path / "j"), *extra, "--json", "-q"])
    assert done.returncode == 0, done.stderr
    recipe = json.loads(done.stdout)["resume"]
    got, text = run_on_terminal([command, str(src), str(tmp_path / "t"), *extra,
                                 "--no-progress"], columns=columns)
    assert got == 0, text
    flags, code = _recipe_blocks(_screen(text))
    want = [str(tmp_path / "t") if a == str(tmp_path / "j") else a
            for a in recipe["megatron_lm"]]
    assert flags == want and "--load" in flags
    one_line = recipe["dist_checkpointing"].replace(str(tmp_path / "j"), str(tmp_path / "t"))
    assert ast.dump(ast.parse(code)) == ast.dump(ast.parse(one_line))


def test_piped_messages_are_single_lines(tmp_path):
    res = _piped(["reshard", str(OPTIM), str(tmp_path / "o"), "--tp", "1", "--pp", "1"])
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    assert any(len(line) > 120 for line in lines)  # nothing folded
    assert any(line.startswith("resume with Megatron-LM: --load ") for line in lines)
