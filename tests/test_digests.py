"""Digests computed while a file is written (ckpt_tool.digests) and their use by the manifest."""

from __future__ import annotations

import hashlib
import os
import zlib

from ckpt_tool import digests
from ckpt_tool.integrity_manifest import build_manifest


def _write_following(path, chunks, algorithm):
    with open(path, "wb") as f:
        follower = digests.FollowingDigest(path, algorithm)
        for c in chunks:
            f.write(c)
            f.flush()
            follower.advance(f.tell())
    return follower.finish(os.path.getsize(path))


def test_following_digest_equals_the_digest_of_the_file(tmp_path):
    chunks = [os.urandom(n) for n in (0, 1, 5000, (8 << 20) + 3, 17)]
    whole = b"".join(chunks)
    assert _write_following(tmp_path / "a", chunks, "sha256") == (
        len(whole), hashlib.sha256(whole).hexdigest())
    assert _write_following(tmp_path / "b", chunks, "crc32") == (
        len(whole), f"{zlib.crc32(whole):08x}")


def test_the_manifest_uses_noted_digests_only_for_unchanged_files(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "x").write_bytes(b"hello")
    digests.note(root / "x", "crc32", 5, "deadbeef")  # a (wrong) digest the manifest trusts
    assert build_manifest(root, algorithm="crc32")["files"]["x"] == "deadbeef"
    assert build_manifest(root, algorithm="sha256")["files"]["x"] == \
        hashlib.sha256(b"hello").hexdigest()  # noted for another algorithm: read
    (root / "x").write_bytes(b"hellO")
    os.utime(root / "x", ns=(1, 1))  # the file changed since: read again
    assert build_manifest(root, algorithm="crc32")["files"]["x"] == f"{zlib.crc32(b'hellO'):08x}"
    digests.note(root / "x", "crc32", 5, "00000000")
    taken = digests.take(root)
    assert list(taken) == [str(root / "x")]
    assert digests.noted(root / "x", "crc32") is None
    digests.give(taken)
    assert digests.noted(root / "x", "crc32") == (5, "00000000")
    digests.take(root)


def test_an_abandoned_follower_notes_nothing(tmp_path):
    path = tmp_path / "a"
    path.write_bytes(b"x" * 100)
    follower = digests.FollowingDigest(path, "sha256")
    follower.advance(50)
    follower.abandon()
    assert digests.noted(path, "sha256") is None


def test_a_digested_file_starts_its_write_back_as_it_grows(tmp_path, monkeypatch):
    """``sync``: the write-back of each further window is started while the file is written
    (``sync_file_range``), contiguous from the start; the digest and the bytes stay right,
    also through ``writev``. Without ``sync`` none is started."""
    from ckpt_tool import writeback

    started: list[tuple[int, int, int]] = []
    monkeypatch.setattr(writeback, "_SYNC_FILE_RANGE",
                        lambda fd, off, n, flags: started.append((off, n, flags)))
    piece = os.urandom(1 << 20)
    path = tmp_path / "f"
    with digests.digested_file(path, "sha256", sync=True) as f:
        for n in range(40):
            if n % 2:
                f.write(piece)
            else:
                f.writev([b"head", piece, b"tail"])
            f.advanced()
    data = path.read_bytes()
    assert digests.noted(path, "sha256") == (len(data), hashlib.sha256(data).hexdigest())
    assert data[:4] == b"head" and data[4:4 + len(piece)] == piece
    assert len(started) >= 2 and started[0][0] == 0
    assert all(a[0] + a[1] == b[0] for a, b in zip(started, started[1:]))  # contiguous
    assert all(n >= writeback.WINDOW and flags == 2 for _, n, flags in started)
    started.clear()
    with digests.digested_file(tmp_path / "g", "sha256", sync=False) as f:
        for _ in range(40):
            f.write(piece)
            f.advanced()
    assert started == []
