"""The one exception hierarchy of ckpt_tool.

Every error a user can cause derives from :class:`CkptError`. Each carries the *what* (message),
the *where* (``path``) and the *how to fix* (``hint``); the CLI turns it into one line on stderr
and an exit code (see ``ckpt_tool.cli._errors``).
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "CkptError",
    "UsageError",
    "InputError",
    "NotACheckpointError",
    "CorruptCheckpointError",
    "IntegrityError",
    "UnsafePickleError",
    "UnsupportedError",
    "OutputError",
    "FindingsError",
    "plural",
]


def plural(n: int, noun: str, plural_form: str | None = None) -> str:
    """``plural(1, "tensor")`` -> ``"1 tensor"``, ``plural(2, "tensor")`` -> ``"2 tensors"``
    (for the counts in messages: "1 finding", "1 file")."""
    return f"{n} {noun if n == 1 else plural_form or noun + 's'}"


class CkptError(Exception):
    """Base of every ckpt_tool error. ``exit_code`` is what the CLI exits with."""

    exit_code = 2

    def __init__(self, message: str, *, path: str | Path | None = None, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.path = None if path is None else str(path)
        self.hint = hint

    def one_line(self) -> str:
        """``what: where (how to fix)`` on a single line."""
        text = self.message if self.path is None else f"{self.path}: {self.message}"
        if self.hint:
            text += f" ({self.hint})"
        return " ".join(text.split())

    def __str__(self) -> str:
        return self.one_line()


class UsageError(CkptError):
    """The command was called wrongly (bad option values, conflicting options)."""


class InputError(CkptError):
    """An input could not be read at all: missing, unreadable, a file where a dir was expected."""


class NotACheckpointError(InputError):
    """The path exists but no known checkpoint format matches it."""


class CorruptCheckpointError(InputError):
    """The path is a checkpoint of a known format but its metadata is truncated or garbage."""


class IntegrityError(CorruptCheckpointError):
    """Stored bytes contradict what the checkpoint records about them (a zip record's CRC-32,
    a manifest's digest, the dtype or size an item holds): using them would pass the damage
    on into what is written or compared. Exit 1, as a finding of ``validate``."""

    exit_code = 1


class UnsafePickleError(InputError):
    """A pickle references a global outside the allowlist; ``--trust`` opts into a full unpickle."""


class UnsupportedError(CkptError):
    """A valid request the tool does not (yet) support, or a command not built yet."""


class OutputError(CkptError):
    """The output could not be written (no space left on its file system, a file size limit);
    nothing that looks complete was left at the target."""


class FindingsError(CkptError):
    """The operation ran and found problems (invalid checkpoint, differences): exit 1."""

    exit_code = 1


class CheckpointingException(CkptError):
    """Raised for any invalid save/load request or inconsistent checkpoint content.

    Megatron-Core's exception, under its own import path
    (``ckpt_tool.dist_checkpointing.core``, which re-exports it); it also belongs to ckpt_tool's
    own error hierarchy so the CLI reports it like every other error.
    """

    def __init__(self, message: object = "", *args: object, **kwargs):
        super().__init__(str(message), **kwargs)
        # keep `e.args` like a plain Exception would (MCore callers sometimes inspect it)
        self.args = (message, *args)
