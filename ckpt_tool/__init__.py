"""ckpt: inspect, validate, reshard, convert and diff large-model training checkpoints.

The package is importable without torch: the metadata path (``ckpt inspect``) never needs it.
Tensor-moving code imports torch lazily.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
