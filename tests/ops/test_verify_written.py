"""The default verification of an output (``verify_output(level="written")``): data files whose
bytes were proven as they were written are not read back, yet a byte changed between the
write and the rename still fails the command with nothing published; ``level="full"`` reads
every byte back; a file that does not hold the bytes written fails the write itself."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import ckpt_tool.ops.convert as convert_op
import ckpt_tool.ops.reshard as reshard_op
import ckpt_tool.ops.validate as validate_op
from ckpt_tool import digests
from ckpt_tool.errors import FindingsError, IntegrityError
from ckpt_tool.ops.convert import ConvertOptions, convert
from ckpt_tool.ops.reshard import ReshardRequest, reshard

FIX = Path(__file__).resolve().parents[2] / "fixtures"
OPTIM = next((FIX / "mcore016_gpt_tp2pp2_bf16_optim").glob("iter_*"))


@pytest.fixture
def seen(monkeypatch):
    """What each validate of the run was told was proven, and what it scanned."""
    calls: list[tuple[frozenset, dict]] = []
    real = validate_op.validate

    def spy(path, **kw):
        result = real(path, **kw)
        calls.append((kw.get("proven", frozenset()), result.stats))
        return result

    monkeypatch.setattr(validate_op, "validate", spy)
    return calls


def _flip_before_verify(monkeypatch, module) -> list[Path]:
    """Flip one byte of the largest data file of the output after it was written, just
    before the verification; returns the file flipped."""
    real = module.verify_output
    flipped: list[Path] = []

    def flip_then_verify(path, **kw):
        victim = max(Path(path).glob("*.distcp"), key=lambda p: p.stat().st_size)
        with open(victim, "r+b") as f:
            f.seek(victim.stat().st_size // 2)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0xFF]))
        flipped.append(victim)
        return real(path, **kw)

    monkeypatch.setattr(module, "verify_output", flip_then_verify)
    return flipped


def test_reshard_output_is_proven_as_written_not_read_back(tmp_path, seen):
    out = tmp_path / "r"
    reshard(OPTIM, out, ReshardRequest(tp=1, pp=1))
    proven, stats = seen[-1]
    data_files = {p.name for p in out.rglob("*.distcp")}
    assert data_files and proven == data_files
    assert stats["files_proven_written"] == len(data_files)
    assert stats["zip_items_checked"] == 0  # no data file read back


def test_full_verification_reads_every_byte_back(tmp_path, seen):
    out = tmp_path / "r"
    reshard(OPTIM, out, ReshardRequest(tp=1, pp=1), verify="full")
    proven, stats = seen[-1]
    assert proven == frozenset()
    assert stats["zip_items_checked"] > 0


@pytest.mark.parametrize("level", [True, "full"])
def test_reshard_flipped_byte_before_rename_fails_and_publishes_nothing(tmp_path, monkeypatch,
                                                                        level):
    flipped = _flip_before_verify(monkeypatch, reshard_op)
    out = tmp_path / "r"
    with pytest.raises(FindingsError, match="does not validate"):
        reshard(OPTIM, out, ReshardRequest(tp=1, pp=1), verify=level)
    assert flipped and not out.exists()
    assert not [p for p in tmp_path.iterdir()]  # no staging left either


def test_convert_flipped_byte_before_rename_fails_and_publishes_nothing(tmp_path, monkeypatch):
    flipped = _flip_before_verify(monkeypatch, convert_op)
    out = tmp_path / "c"
    with pytest.raises(FindingsError, match="does not validate"):
        convert(OPTIM, out, ConvertOptions(to="torch_dist"))
    assert flipped and not out.exists()


def test_a_file_not_holding_the_bytes_written_fails_the_write(tmp_path):
    path = tmp_path / "f.bin"
    with pytest.raises(IntegrityError, match="does not hold the bytes written"):
        with digests.digested_file(path, "sha256") as f:
            f.write(b"a" * 1000)
            f.file.flush()
            fd = os.open(path, os.O_WRONLY)  # another writer changes the file meanwhile
            os.pwrite(fd, b"b", 10)
            os.close(fd)
            f.write(b"c" * 1000)


def test_proven_only_while_unchanged(tmp_path):
    path = tmp_path / "f.bin"
    with digests.digested_file(path, "crc32") as f:
        f.write(b"x" * 5000)
    assert digests.proven_files(tmp_path) == {"f.bin"}
    with open(path, "r+b") as g:
        g.write(b"y")
    assert digests.proven_files(tmp_path) == set()
    digests.take(tmp_path)


def test_bytes_written_around_the_writer_are_not_proven(tmp_path):
    path = tmp_path / "f.bin"
    with digests.digested_file(path, "sha256") as f:
        f.write(b"x" * 100)
        f.file.write(b"y" * 100)  # e.g. torch.save writing into the stream
        f.bypassed()
        f.position += 100
    assert digests.proven_files(tmp_path) == set()
    digests.take(tmp_path)
