"""From what a user types to the checkpoint directory: save dir -> iter_* dir -> checkpoint.

Megatron-LM training writes ``<save>/latest_checkpointed_iteration.txt`` (an integer or
``release``) next to ``<save>/iter_0000100/`` (7 digits) or ``<save>/release/``. Every format
that lives in a directory resolves its input through :func:`resolve_checkpoint_dir`.
"""

from __future__ import annotations

from pathlib import Path

from ckpt_tool.errors import InputError, NotACheckpointError

__all__ = ["LATEST_FILE", "resolve_checkpoint_dir", "iteration_dir_name", "read_latest"]

LATEST_FILE = "latest_checkpointed_iteration.txt"
_METADATA_FILES = ("metadata.json", ".metadata")


def iteration_dir_name(iteration: int | str) -> str:
    """``10`` -> ``"iter_0000010"``; ``"release"`` -> ``"release"``."""
    if iteration == "release":
        return "release"
    return f"iter_{int(iteration):07d}"


def read_latest(save_dir: Path) -> str:
    """The content of ``latest_checkpointed_iteration.txt``: digits or ``release``."""
    f = save_dir / LATEST_FILE
    try:
        text = f.read_text(encoding="utf-8", errors="replace").strip()
    except OSError as exc:
        raise InputError(f"cannot read {LATEST_FILE} ({exc.strerror})", path=save_dir) from None
    if text != "release" and not text.isdigit():
        raise InputError(f"{LATEST_FILE} holds {text[:40]!r}, not an iteration number or "
                         "'release'", path=save_dir)
    return text


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """The checkpoint directory that ``path`` designates.

    Accepts a checkpoint directory, a file inside it (``metadata.json``, ``.metadata``), or a
    training save directory (follows ``latest_checkpointed_iteration.txt``). Raises InputError
    when the path is missing or the save directory points at a missing iteration.
    """
    p = Path(path)
    if not p.exists():
        raise InputError("no such file or directory", path=p, hint="check the path")
    if p.is_file():
        if p.name in _METADATA_FILES or p.name == LATEST_FILE:
            p = p.parent
        elif p.suffix == ".distcp":
            raise _data_file_error(p)
        else:
            return p
    if p.is_dir() and not any((p / m).exists() for m in _METADATA_FILES) \
            and (p / LATEST_FILE).is_file():
        latest = read_latest(p)
        target = p / iteration_dir_name(latest)
        if not target.is_dir():
            raise InputError(
                f"{LATEST_FILE} names iteration {latest} but {target.name}/ is missing", path=p,
                hint=f"pass one of the iter_* directories explicitly: {_list_iters(p)}")
        return target
    return p


def _list_iters(save_dir: Path) -> str:
    names = sorted(x.name for x in save_dir.iterdir()
                   if x.is_dir() and (x.name.startswith("iter_") or x.name == "release"))
    return ", ".join(names[-5:]) if names else "none found"


def _data_file_error(p: Path) -> NotACheckpointError:
    """A ``*.distcp`` file alone: one data file of a DCP-based checkpoint (a sequence of
    ``torch.save`` items that only the directory's ``.metadata`` describes), not a checkpoint."""
    d = p.parent
    tail = "the .metadata beside it describes its items"
    if (d / "metadata.json").is_file():
        kind = "a Megatron-Core torch_dist checkpoint"
    elif (d / ".metadata").is_file() or any(d.glob("*.metadata")):
        kind = "a PyTorch DCP checkpoint"
    else:
        kind = "a DCP/torch_dist checkpoint"
        tail = "its directory has no .metadata to describe its items: an interrupted save?"
    return NotACheckpointError(f"one data file of {kind}, not a checkpoint by itself: {tail}",
                               path=p, hint=f"pass the checkpoint directory: {d}")
