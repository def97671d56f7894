"""ckpt: inspect, validate, reshard, convert and diff large-model training checkpoints.

The package is importable without torch: the metadata path (``ckpt inspect``) never needs it.
Tensor-moving code imports torch lazily.
"""

from ckpt_tool._program import exit_on_interrupt as _exit_on_interrupt

_exit_on_interrupt()  # only when this process is the ckpt program: see _program

__version__ = "0.1.0"

__all__ = ["__version__"]
