"""From what a user types to the checkpoint directory: save dir -> iter_* dir -> checkpoint.

Megatron-LM training writes ``<save>/latest_checkpointed_iteration.txt`` (an integer or
``release``) next to ``<save>/iter_0000100/`` (7 digits) or ``<save>/release/``. Every format
that lives in a directory resolves its input through :func:`resolve_checkpoint_dir`. A save
directory without the tracker file (copied without it, or a save that never finished) resolves
to its latest iteration; :func:`select_iteration` picks another and says what was found.

What a user names is one of four containers (:class:`Container`), which :func:`locate_source`
tells apart: a save directory (the tracker file and an iteration directory inside), an
iteration directory (``iter_0000010/``, ``release/``), a NeMo 2 checkpoint directory
(``weights/`` holding the dist checkpoint, ``context/`` its configuration) or a bare
checkpoint; ``reshard`` and ``convert`` write their output in the source's container
(docs/resume.md). A save or iteration directory whose iteration directory holds Megatron-Bridge's
``run_config.yaml`` is Megatron-Bridge's (``Container.framework``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ckpt_tool.errors import InputError, NotACheckpointError, UsageError
from ckpt_tool.storage import as_path

__all__ = ["LATEST_FILE", "resolve_checkpoint_dir", "iteration_dir_name", "read_latest",
           "iteration_dirs", "select_iteration", "iterations_text", "Container", "SourcePlace",
           "locate_source", "is_iteration_dir_name", "is_nemo_checkpoint_dir", "NEMO_WEIGHTS",
           "NEMO_CONTEXT", "BRIDGE_RUN_CONFIG"]

LATEST_FILE = "latest_checkpointed_iteration.txt"
#: NeMo 2's checkpoint directory: the dist checkpoint in WEIGHTS, the configuration in CONTEXT.
NEMO_WEIGHTS, NEMO_CONTEXT = "weights", "context"
#: Megatron-Bridge's configuration in each iteration directory.
BRIDGE_RUN_CONFIG = "run_config.yaml"
_METADATA_FILES = ("metadata.json", ".metadata")
_ITER_DIR = re.compile(r"iter_([0-9]{1,18})")  # ASCII digits an int64 holds
_MAX_DIGITS = 18


def is_iteration_dir_name(name: str) -> bool:
    """``iter_0000010``, ``release``: the name of an iteration directory of a save directory."""
    return bool(_ITER_DIR.fullmatch(name)) or name == "release"


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
    if text != "release" and not (text.isascii() and text.isdigit()
                                  and len(text) <= _MAX_DIGITS):
        raise InputError(f"{LATEST_FILE} holds {text[:40]!r}"
                         f"{' (' + str(len(text)) + ' characters)' if len(text) > 40 else ''}, "
                         "not an iteration number or 'release'", path=save_dir,
                         hint="write the iteration there (e.g. 1000) or 'release'")
    return text


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """The checkpoint directory that ``path`` designates.

    Accepts a checkpoint directory, a file inside it (``metadata.json``, ``.metadata``), or a
    training save directory (follows ``latest_checkpointed_iteration.txt``). Raises InputError
    when the path is missing or the save directory points at a missing iteration.
    """
    p = as_path(path)
    if not p.exists():
        raise InputError("no such file or directory", path=p, hint="check the path")
    if p.is_file():
        if p.name in _METADATA_FILES or p.name == LATEST_FILE:
            p = p.parent
        elif p.suffix == ".distcp":
            raise _data_file_error(p)
        else:
            return p
    if is_nemo_checkpoint_dir(p):
        return p / NEMO_WEIGHTS
    if p.is_dir() and not any((p / m).exists() for m in _METADATA_FILES) \
            and (p / LATEST_FILE).is_file():
        latest = read_latest(p)
        target = p / iteration_dir_name(latest)
        if not target.is_dir():
            raise InputError(
                f"{LATEST_FILE} names iteration {latest} but {target.name}/ is missing", path=p,
                hint=f"pass one of the iter_* directories explicitly: {_list_iters(p)}")
        return target
    if p.is_dir() and not any((p / m).exists() for m in _METADATA_FILES):
        iters = iteration_dirs(p)  # a save directory without its tracker: the latest
        if iters:
            return iters[-1]
    return p


def is_nemo_checkpoint_dir(p: Path) -> bool:
    """A NeMo 2 checkpoint directory: ``weights/`` holding a dist checkpoint (or DCP) beside
    ``context/``."""
    return p.is_dir() and (p / NEMO_CONTEXT).is_dir() and any(
        (p / NEMO_WEIGHTS / m).is_file() for m in _METADATA_FILES)


def iteration_dirs(save_dir: Path) -> list[Path]:
    """The iteration directories of a training save directory: ``release`` first, then the
    ``iter_*`` ones by number (the last is the latest); empty for any other directory."""
    try:
        found = [x for x in as_path(save_dir).iterdir() if x.is_dir()
                 and (_ITER_DIR.fullmatch(x.name) or x.name == "release")]
    except OSError:
        return []
    return sorted(found, key=lambda x: -1 if x.name == "release" else int(x.name[5:]))


def _iteration_of(d: Path) -> int | str:
    return "release" if d.name == "release" else int(d.name[5:])


def select_iteration(path: str | Path, iteration: int | None = None) -> tuple[Path, str | None]:
    """What to read for ``path`` at ``iteration`` (``--iteration``), and a note for people.

    ``iteration`` None: ``path`` itself (:func:`resolve_checkpoint_dir` follows the tracker
    file, or takes the latest iteration); the note lists the iterations when a save directory
    has no tracker file. ``iteration`` N: the ``iter_*`` directory of N in the save directory
    ``path`` (or ``path`` itself when it is that directory); an InputError lists the
    iterations when N is not there, a UsageError says when ``path`` is no save directory."""
    p = as_path(path)
    iters = iteration_dirs(p) if p.is_dir() else []
    if iteration is None:
        if not iters or (p / LATEST_FILE).is_file() \
                or any((p / m).exists() for m in _METADATA_FILES):
            return p, None
        return p, (f"{p}: no {LATEST_FILE}; iterations: {iterations_text(iters)}; reading the latest, "
                   f"{iters[-1].name} (--iteration N reads another)")
    if _ITER_DIR.fullmatch(p.name) and int(p.name[5:]) == iteration:
        return p, None
    if not iters:
        raise UsageError(f"--iteration {iteration}: {p} is not a training save directory (no "
                         "iter_* directories in it)", hint="pass the save directory")
    for d in iters:
        if _iteration_of(d) == iteration:
            return d, None
    raise InputError(f"no iteration {iteration} here (iterations: {iterations_text(iters)})", path=p,
                     hint="pick one of them with --iteration")


def iterations_text(iters: list[Path], most: int = 12) -> str:
    """``"10, 20, 30"``: the iterations of :func:`iteration_dirs` (at most ``most`` shown)."""
    names = [str(_iteration_of(d)) for d in iters]
    if len(names) > most:
        tail = most - 4
        names = names[:3] + [f"... ({len(names) - 3 - tail} more)"] + names[-tail:]
    return ", ".join(names)


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


@dataclass(frozen=True)
class Container:
    """How a checkpoint sits in a directory: ``save_dir`` (the tracker file naming
    ``iteration_dir``, which holds the checkpoint), ``iteration_dir`` (``iteration_dir`` holds
    it, no tracker file), ``nemo`` (NeMo 2's checkpoint directory: ``weights/`` holds it,
    ``context/`` beside it) or ``bare`` (the directory, or file, is the checkpoint).
    ``framework``: who trained into it, as far as its files say: ``megatron_bridge`` (its
    ``run_config.yaml`` in the iteration directory), ``nemo2``, else ``megatron_lm``."""

    kind: str = "bare"
    iteration_dir: str | None = None  # "iter_0000010" or "release"
    framework: str = "megatron_lm"

    @property
    def inner(self) -> str | None:
        """The checkpoint's directory inside the container (None: the container itself)."""
        return NEMO_WEIGHTS if self.kind == "nemo" else self.iteration_dir

    @property
    def tracker(self) -> str | None:
        """What the tracker file holds (``"10"``, ``"release"``); None without one."""
        if self.kind != "save_dir" or self.iteration_dir is None:
            return None
        return "release" if self.iteration_dir == "release" else str(int(self.iteration_dir[5:]))

    @property
    def iteration(self) -> int | None:
        """The iteration its directory's name says (None: ``release`` or no such directory)."""
        m = _ITER_DIR.fullmatch(self.iteration_dir or "")
        return int(m.group(1)) if m else None

    def checkpoint_in(self, top: Path) -> Path:
        """Where the checkpoint lies when ``top`` is the container."""
        return top / self.inner if self.inner else top

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "iteration_dir": self.iteration_dir, "tracker": self.tracker,
                "framework": self.framework}


@dataclass(frozen=True)
class SourcePlace:
    """A source as a user named it: ``given`` (a directory, never a file of one), the
    checkpoint to read and the container it sits in; ``note``: what people should be told
    (the iteration picked in a save directory without its tracker file)."""

    given: Path
    checkpoint: Path
    container: Container
    note: str | None = None


def locate_source(path: str | Path, iteration: int | None = None) -> SourcePlace:
    """The checkpoint ``path`` (at ``iteration``: ``--iteration``) designates and its container.

    A save directory: its tracker's iteration (InputError, exit 2, when that directory is
    missing), ``iteration``'s, or without a tracker file the latest. An ``iter_*``/``release``
    directory holding a checkpoint: an iteration directory. A NeMo 2 checkpoint directory (or
    its ``weights/``): a NeMo container. Anything else: bare (a missing path too: opening it
    says so). A checkpoint with Megatron-Bridge's ``run_config.yaml`` beside it is Bridge's."""
    p = as_path(path)
    if p.is_file() and (p.name in _METADATA_FILES or p.name == LATEST_FILE):
        p = p.parent
    if p.name == NEMO_WEIGHTS and is_nemo_checkpoint_dir(p.parent):
        p = p.parent  # NeMo's weights/ is read within its checkpoint directory
    if is_nemo_checkpoint_dir(p):
        if iteration is not None:
            raise UsageError(f"--iteration {iteration}: {p} is a NeMo checkpoint directory "
                             "(one checkpoint, no iterations)", hint="leave out --iteration")
        return SourcePlace(p, p / NEMO_WEIGHTS, Container("nemo", framework="nemo2"))
    place = _locate(p, iteration)
    if (place.checkpoint / BRIDGE_RUN_CONFIG).is_file():
        return replace(place, container=replace(place.container, framework="megatron_bridge"))
    return place


def _locate(p: Path, iteration: int | None) -> SourcePlace:
    from ckpt_tool.formats.regular_files import check_regular

    check_regular(p / LATEST_FILE)  # a FIFO there is refused, not read nor taken for absent
    read, note = select_iteration(p, iteration)
    if read != p:  # --iteration N in a save directory
        return SourcePlace(p, read, Container("save_dir", read.name), note)
    if p.is_dir() and not any((p / m).exists() for m in _METADATA_FILES) and (
            (p / LATEST_FILE).is_file() or iteration_dirs(p)):
        read = resolve_checkpoint_dir(p)
        return SourcePlace(p, read, Container("save_dir", read.name), note)
    if p.is_dir() and is_iteration_dir_name(p.name):
        return SourcePlace(p, p, Container("iteration_dir", p.name), note)
    return SourcePlace(p, p, Container(), note)
