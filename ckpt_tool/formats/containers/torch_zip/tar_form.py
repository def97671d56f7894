"""The oldest form of ``torch.save``, a tar archive, recognized so that it is never loaded.

``torch.load`` still reads it (``torch/serialization.py``, ``legacy_load``): it extracts the
``storages`` and ``tensors`` members into a temporary directory and opens them there, so a
member that is a symlink makes it read any file outside the checkpoint (or block on a FIFO).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["refuse_tar_form"]

_TAR_BLOCK = 512


def refuse_tar_form(path: str | Path, what: str | None = None) -> None:
    """UnsupportedError when the file at ``path`` is the oldest form of ``torch.save``, a tar
    archive (``storages``, ``tensors``, ``pickle`` members): ``torch.load`` extracts its
    members into a temporary directory and opens them there (``torch/serialization.py``,
    ``legacy_load``), following a member that is a symlink to any file outside the
    checkpoint (or a FIFO: the read blocks). It is never handed to ``torch.load``; its first
    block is recognized the way ``tarfile.open`` recognizes a tar header (a valid checksum)."""
    import tarfile

    from ckpt_tool.formats.regular_files import open_regular

    try:
        with open_regular(path) as f:
            block = f.read(_TAR_BLOCK)
    except OSError:
        return  # the read that follows reports it
    if len(block) < _TAR_BLOCK:
        return
    try:
        tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
    except tarfile.HeaderError:
        return
    from ckpt_tool.errors import UnsupportedError

    raise UnsupportedError(
        f"{what + ': ' if what else ''}the tar form of torch.save (the oldest PyTorch "
        "releases) is not read (loading it extracts its members, links included, outside "
        "the checkpoint)",
        path=path, hint="re-save it with a recent torch where it can be trusted: "
        "torch.save(torch.load(f, weights_only=False), f2)")
