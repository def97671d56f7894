"""The ``ckpt`` command: thin Typer commands over ``ckpt_tool.ops``."""
