"""Tables never cut a key: on a real terminal 80 and 100 columns wide (a pseudo-terminal, so Rich
measures it as in a shell) every key of ``inspect``, ``diff`` and ``validate`` appears whole on
one line; through a pipe the tables are plain columns aligned with spaces, one line per row."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_tool.formats import open_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from _terminal import run_on_terminal  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
OPTIM = REPO / "fixtures" / "mcore016_gpt_tp2pp2_bf16_optim"
BOX = set("┃│┏┓┗┛━─┡┩╇┳┻╋")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _terminal_text(argv: list[str], columns: int) -> tuple[int, str]:
    code, text = run_on_terminal(argv, columns=columns, stderr_too=False)  # stdout's tables
    return code, ANSI.sub("", text)


def _whole_on_a_line(keys, text: str) -> list[str]:
    """The keys that appear nowhere in ``text`` as one piece (a word of their own)."""
    words = set(re.findall(r"[\w.:/\[\]-]+", text))
    return [k for k in keys if k not in words]


@pytest.mark.parametrize("columns", [80, 100])
def test_inspect_keys_are_never_cut_on_a_terminal(columns):
    code, text = _terminal_text(["inspect", str(OPTIM)], columns)
    assert code == 0, text
    keys = list(open_checkpoint(OPTIM).metadata().tensors)
    assert len(keys) == 64
    assert not _whole_on_a_line(keys, text), text
    # the terminal's own wrapping cuts nothing either: every longer line is one key alone (or
    # the title: the format and the checkpoint's path)
    title, *lines = text.splitlines()
    assert all(len(line) <= columns or line in keys for line in lines), text


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    out = tmp_path_factory.mktemp("tables") / "tp4"
    subprocess.run([sys.executable, "-m", "ckpt_tool", "reshard", str(OPTIM), str(out),
                    "--tp", "4", "-q"], check=True, cwd=REPO)
    return out


@pytest.mark.parametrize("columns", [80, 100])
def test_diff_keys_are_never_cut_on_a_terminal(resharded, columns):
    code, text = _terminal_text(["diff", str(OPTIM), str(resharded)], columns)
    assert code == 1, text
    wide = ["optimizer.state.exp_avg_sq.embedding.word_embeddings.weight",
            "args.expert_tensor_parallel_size", "rng_state/shard_0.1_2.2"]
    assert not _whole_on_a_line(wide, text), text


def test_validate_findings_keep_names_whole(tmp_path):
    bad = tmp_path / "ckpt"
    shutil.copytree(OPTIM, bad)
    for f in sorted((bad / "iter_0000010").glob("*.distcp"))[:3]:
        f.write_bytes(f.read_bytes()[:100])
    code, text = _terminal_text(["validate", str(bad)], 80)
    assert code == 1, text
    named = ["__0_0.distcp", "__0_1.distcp", "__1_0.distcp",  # files, and keys in messages
             "decoder.layers.self_attention.linear_proj._extra_state/shard_0_4"]
    assert not _whole_on_a_line(named, text), text


def test_piped_tables_are_plain_aligned_columns():
    res = subprocess.run([sys.executable, "-m", "ckpt_tool", "inspect", str(OPTIM)], cwd=REPO,
                         capture_output=True, text=True, check=True)
    lines = res.stdout.splitlines()
    assert not BOX & set(res.stdout)
    start = lines.index("64 tensors")
    header, rows = lines[start + 1], lines[start + 2:start + 66]
    assert header.split() == ["key", "dtype", "shape", "chunks", "split", "bytes"]
    at = header.index("dtype")
    for row in rows:  # one line a row, the columns line up under the header
        key = row.split()[0]
        assert row[at - 2:at] == "  " and row[at] != " ", row
        assert key in open_checkpoint(OPTIM).metadata().tensors
    assert rows[0].startswith("decoder.final_layernorm.bias ")
