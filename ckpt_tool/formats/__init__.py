"""Checkpoint formats: one module per format, all registered here in detection order.

Importing this package registers the built-in formats (see ``base.register``).
"""

from ckpt_tool.formats.base import Format, Reader, detect, formats, open_checkpoint, register

__all__ = ["Format", "Reader", "detect", "formats", "open_checkpoint", "register"]

# Built-in formats register themselves on import; keep this list in detection order.
from ckpt_tool.formats.mcore_dist import reader as _mcore_dist  # noqa: E402,F401
from ckpt_tool.formats.dcp import reader as _dcp  # noqa: E402,F401
from ckpt_tool.formats.hf import reader as _hf  # noqa: E402,F401  (before safetensors)
from ckpt_tool.formats.safetensors import reader as _safetensors  # noqa: E402,F401
from ckpt_tool.formats.legacy import reader as _megatron_legacy  # noqa: E402,F401
from ckpt_tool.formats.torch_save import reader as _torch_save  # noqa: E402,F401
