"""Pickling objects of classes we do not import: references written as pickle opcodes.

A DCP ``.metadata`` file is a pickle of ``torch.distributed.checkpoint.metadata.Metadata``
whose parts are torch classes, ``torch.Size`` and torch dtypes, all stored *by reference*
(module and name). Python's pickler checks every reference by importing its module, so
writing such a file the usual way needs torch imported (seconds of CPU). Here the references
are plain values and the pickler writes their opcodes without looking them up:

* :class:`Ref` ``("torch", "bfloat16")`` -> ``STACK_GLOBAL`` (what pickle writes for a class,
  a function or a torch dtype);
* :class:`Instance` ``(cls, state)`` -> ``cls`` ``()`` ``NEWOBJ`` then ``state`` ``BUILD``: what
  ``object.__reduce_ex__`` gives for an instance of a plain class or a dataclass (``state``:
  its ``__dict__``, or what its ``__getstate__`` returns);
* :class:`Call` ``(func, args)`` -> ``func`` ``args`` ``REDUCE`` (``torch.Size((2, 3))``, an enum
  member ``WriteItemType(2)``).

Everything else (dicts, lists, tuples, strings, numbers, None) is pickled as usual. The result
loads with ``pickle.loads`` wherever the referenced classes import, into the same objects the
real classes would have pickled to. Nothing here imports torch.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Any

__all__ = ["Ref", "Instance", "Call", "dumps"]


@dataclass(frozen=True, eq=False)
class Ref:
    """A module-level name (class, function, constant) stored by reference."""

    module: str
    name: str


@dataclass(eq=False)
class Instance:
    """An instance of ``cls`` rebuilt by ``cls.__new__(cls)`` and ``BUILD`` of ``state``
    (None: no state)."""

    cls: Ref
    state: Any = None


@dataclass(eq=False)
class Call:
    """The value of ``func(*args)`` at load time."""

    func: Ref
    args: tuple = ()


class _Pickler(pickle._Pickler):  # the pure-Python pickler: its dispatch table is open
    dispatch = dict(pickle._Pickler.dispatch)

    def _save_ref(self, obj: Ref) -> None:
        if self.proto < 4:
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode("utf-8"))
        else:
            self.save(obj.module)
            self.save(obj.name)
            self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)

    def _save_instance(self, obj: Instance) -> None:
        self.save(obj.cls)
        self.write(pickle.EMPTY_TUPLE + pickle.NEWOBJ)
        self.memoize(obj)
        if obj.state is not None:
            self.save(obj.state)
            self.write(pickle.BUILD)

    def _save_call(self, obj: Call) -> None:
        self.save(obj.func)
        self.save(tuple(obj.args))
        self.write(pickle.REDUCE)
        self.memoize(obj)

    dispatch[Ref] = _save_ref
    dispatch[Instance] = _save_instance
    dispatch[Call] = _save_call


def dumps(obj: Any, protocol: int = 4) -> bytes:
    """The pickle of ``obj`` (with :class:`Ref`/:class:`Instance`/:class:`Call` parts),
    protocol 2 to 5; 4 is what ``torch.distributed.checkpoint`` writes ``.metadata`` with."""
    if protocol < 2:
        raise ValueError("references to classes need pickle protocol 2 or later")
    buf = io.BytesIO()
    _Pickler(buf, protocol=protocol).dump(obj)
    return buf.getvalue()
