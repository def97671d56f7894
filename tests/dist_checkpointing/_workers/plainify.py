"""Reduce unpickled checkpoint values to plain data, so values unpickled by Megatron-Core
(real megatron classes) and by our allowlisting loader (stand-ins) can be compared."""

from __future__ import annotations

import argparse
import enum

import numpy as np
import torch


def plainify(x):
    """Containers recurse; tensors/arrays/primitives stay; objects → (qualname, args, fields)."""
    if isinstance(x, dict):
        return {k: plainify(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)) and type(x) in (list, tuple):
        return type(x)(plainify(v) for v in x)
    if isinstance(x, (torch.Tensor, np.ndarray, np.generic, str, bytes, int, float, bool,
                      type(None), torch.dtype, torch.device)):
        return x
    stand_in = getattr(type(x), "__stand_in_for__", None)
    if stand_in is not None:
        fields = x.fields() if hasattr(type(x), "fields") else dict(x.__dict__)
        args = fields.pop("_args", ())
        return ("obj", stand_in, plainify(tuple(args)), plainify(fields))
    qual = f"{type(x).__module__}.{type(x).__qualname__}"
    if isinstance(x, enum.Enum):
        return ("obj", qual, plainify((x.value,)), {})
    if isinstance(x, argparse.Namespace) or hasattr(x, "__dict__"):
        return ("obj", qual, (), plainify(dict(vars(x))))
    return ("repr", qual, repr(x))
