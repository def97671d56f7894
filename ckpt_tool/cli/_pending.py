"""Commands that are announced in ``ckpt --help`` but not built yet: they say so and exit 2."""

import typer

from ckpt_tool.cli._errors import handle_errors
from ckpt_tool.errors import UnsupportedError

__all__ = ["register_pending"]

_PENDING = {
    "validate": "Check a checkpoint for completeness and integrity (CI job).",
    "reshard": "Rewrite a checkpoint for another TP/PP/EP layout.",
    "convert": "Convert a checkpoint to another format, streaming.",
    "diff": "Compare two checkpoints of any formats.",
}


def _make(name: str):
    @handle_errors
    def command(
        ctx: typer.Context,
    ) -> None:
        raise UnsupportedError(
            f"'ckpt {name}' is not built yet in this version",
            hint="see README.md for what is available",
        )

    command.__name__ = name
    command.__doc__ = _PENDING[name] + " (not built yet: exits 2)"
    return command


def register_pending(app: typer.Typer, built: set[str]) -> None:
    """Register a placeholder for every pending command not in ``built``."""
    for name in _PENDING:
        if name not in built:
            app.command(
                name,
                context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
            )(_make(name))
