"""The common state as Megatron-Core's ``torch.load(weights_only=True)`` can load it.

Megatron-Core (0.19 and Megatron-LM's main branch, ``dist_checkpointing/serialization.py``
``load_common_state_dict``) unpickles the ``common_state`` object with
``torch.load(..., weights_only=True)``; importing ``megatron.core`` registers its safe globals
(``megatron/core/safe_globals.py`` ``SAFE_GLOBALS``: ``argparse.Namespace``, numpy's array
reconstructor, ``ndarray`` and ``dtype``, its enums, ``OptimizerConfig``, ``RerunState``, ...).
numpy *scalars* are not among them: a ``numpy.float64`` in ``args`` (Megatron-LM args pick
them up from numpy arithmetic) makes the whole common state unloadable that way
(``Unsupported global: numpy._core.multiarray.scalar``).

:func:`weights_only_common` gives the common state with every numpy scalar as the Python
scalar of the same value (``float`` for float16/32/64, ``int``, ``bool``, ``complex``;
``numpy.float64`` is itself a ``float`` subclass, so code reading ``args`` sees no
difference), and the paths of the values it changed. Containers are copied where something in
them changes; everything else is kept as it is. Pure: no I/O, no torch.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["weights_only_common"]

_MAX_DEPTH = 64


def weights_only_common(common: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``(common state, paths changed)``: ``common`` with its numpy scalars as Python scalars
    (``args.init_method_std``, ``optimizer.param_groups[0].lr``, ...)."""
    np = sys.modules.get("numpy")
    if np is None:  # nothing was unpickled as a numpy scalar
        return common, []
    changed: list[str] = []
    out = _plain(common, "", changed, np, 0)
    return out, changed


def _plain(obj: Any, path: str, changed: list[str], np: Any, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        return obj
    if isinstance(obj, np.generic):
        value = _python_scalar(obj, np)
        if value is not obj:
            changed.append(path or "(root)")
        return value
    t = type(obj)
    if t is dict:
        new = {k: _plain(v, _join(path, k), changed, np, depth + 1) for k, v in obj.items()}
        return obj if all(new[k] is obj[k] for k in obj) else new
    if t is list or t is tuple:
        items = [_plain(v, f"{path}[{i}]", changed, np, depth + 1) for i, v in enumerate(obj)]
        return obj if all(a is b for a, b in zip(items, obj)) else t(items)
    if t is argparse.Namespace:
        fields = vars(obj)
        new = {k: _plain(v, _join(path, k), changed, np, depth + 1) for k, v in fields.items()}
        return obj if all(new[k] is fields[k] for k in fields) else argparse.Namespace(**new)
    return obj


def _python_scalar(value: Any, np: Any) -> Any:
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, (np.float16, np.float32, np.float64)):
        return float(value)  # exact: a Python float is a float64
    if isinstance(value, (np.complex64, np.complex128)):
        return complex(value)
    return value  # (longdouble and the like: no Python scalar holds them exactly)


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)
