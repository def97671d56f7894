"""The allowlisting unpickler honours torch.serialization.add_safe_globals (the switch)."""

import io
import pickle

import pytest
import torch

from ckpt_tool.errors import CkptError
from ckpt_tool.formats.containers.pickle.safe_pickle import safe_loads


class _Probe:
    def __init__(self, value=0):
        self.value = value


def test_bytesio_refused_by_default_and_allowed_with_torch_safe_globals() -> None:
    buf = io.BytesIO(b"payload")
    data = pickle.dumps(buf)
    before = list(torch.serialization.get_safe_globals())
    try:
        torch.serialization.clear_safe_globals()
        with pytest.raises(CkptError, match="io.BytesIO|_io.BytesIO"):
            safe_loads(data)
        torch.serialization.add_safe_globals([io.BytesIO])
        assert safe_loads(data).getvalue() == b"payload"
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


def test_added_class_and_named_entry() -> None:
    data = pickle.dumps(_Probe(3))
    before = list(torch.serialization.get_safe_globals())
    try:
        torch.serialization.clear_safe_globals()
        with pytest.raises(CkptError):
            safe_loads(data)
        torch.serialization.add_safe_globals([(_Probe, f"{__name__}._Probe")])
        assert safe_loads(data).value == 3
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)
