"""Pickling objects of classes we do not import: references written as pickle opcodes.

A DCP ``.metadata`` file is a pickle of ``torch.distributed.checkpoint.metadata.Metadata``
whose parts are torch classes, ``torch.Size`` and torch dtypes, all stored *by reference*
(module and name). Python's pickler checks every reference by importing its module, so
writing such a file the usual way needs torch imported (seconds of CPU). Here:

* :func:`ref` ``("torch", "bfloat16")`` is a stand-in (a class of that module and name) for
  the referenced object, usable as a value, as a callable (:class:`Call`) or as the class of
  an :func:`instance`;
* :func:`instance` ``(cls, state)`` -> ``cls`` ``()`` ``NEWOBJ`` then ``state`` ``BUILD``: what
  ``object.__reduce_ex__`` gives for an instance of a plain class or a dataclass (``state``:
  its ``__dict__``, or what its ``__getstate__`` returns; None: no state);
* :class:`Call` ``(func, args)`` -> ``func`` ``args`` ``REDUCE`` (``torch.Size((2, 3))``, an enum
  member ``WriteItemType(2)``).

:func:`dumps` writes each reference once (``STACK_GLOBAL``, kept in the pickle's memo) ahead
of the object, then pickles the object with Python's C pickler with its memo primed with the
stand-ins, so every use of a reference is a memo lookup and no module is imported. The result
loads with ``pickle.loads`` wherever the referenced names import, into the same objects the
real classes would have pickled to. Nothing here imports torch.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import struct
from typing import Any, Sequence

__all__ = ["ref", "instance", "Call", "dumps"]


class _StandIn:
    """Base of the reference stand-ins; an instance of one pickles as ``NEWOBJ`` + state."""

    __slots__ = ("_state",)

    def __reduce_ex__(self, protocol: int) -> tuple:
        return copyreg.__newobj__, (type(self),), self._state


def ref(module: str, name: str) -> type:
    """A stand-in for ``module.name`` (pickled as that reference by :func:`dumps`)."""
    return type(name, (_StandIn,), {"__slots__": (), "__module__": module, "__qualname__": name,
                                    "__ref__": (module, name)})


def instance(cls: type, state: Any = None) -> Any:
    """An instance of the stand-in ``cls`` that unpickles as ``cls.__new__(cls)`` with
    ``state`` applied (``BUILD``)."""
    obj = object.__new__(cls)
    obj._state = state
    return obj


class Call:
    """The value of ``func(*args)`` at load time (``func``: a :func:`ref`)."""

    __slots__ = ("func", "args")

    def __init__(self, func: type, args: tuple = ()):
        self.func, self.args = func, tuple(args)

    def __reduce__(self) -> tuple:
        return self.func, self.args


def _short(s: str) -> bytes:
    raw = s.encode("utf-8")
    if len(raw) < 256:
        return pickle.SHORT_BINUNICODE + bytes((len(raw),)) + raw
    return pickle.BINUNICODE + struct.pack("<I", len(raw)) + raw


def dumps(obj: Any, refs: Sequence[type], protocol: int = 4) -> bytes:
    """The pickle of ``obj``, whose references are among ``refs`` (:func:`ref` stand-ins);
    protocol 4 or 5 (4 is what ``torch.distributed.checkpoint`` writes ``.metadata`` with)."""
    if protocol < 4:
        raise ValueError("the references are written with pickle protocol 4 or later")
    refs = list(dict.fromkeys(refs))
    head = bytearray(pickle.PROTO + bytes((protocol,)))
    for r in refs:  # memo slots 0..n-1, in this order
        module, name = r.__ref__
        head += _short(module) + _short(name) + pickle.STACK_GLOBAL + pickle.MEMOIZE + pickle.POP
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=protocol)
    pickler.memo = {id(r): (n, r) for n, r in enumerate(refs)}
    pickler.dump(obj)
    body = buf.getvalue()
    assert body[:2] == pickle.PROTO + bytes((protocol,))
    return bytes(head) + body[2:]
