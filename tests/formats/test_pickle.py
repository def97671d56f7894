"""The allowlisting unpickler: common.pt as Megatron-LM writes it loads without megatron;
anything outside the allowlist is refused by name; trust=True opts out."""

import argparse
import dataclasses
import enum
import io
import os
import pathlib
import pickle
import signal
import sys
import types

import numpy as np
import pytest
import torch

from _builders import fake_module
from ckpt_tool.errors import CorruptCheckpointError, InputError, UnsafePickleError
from ckpt_tool.formats.common_state import jsonable, load_torch_free, summarize_common
from ckpt_tool.formats.containers.pickle.safe_pickle import StandIn, load_torch_file, safe_loads


@pytest.fixture(autouse=True)
def _only_our_allowlist():
    """These tests are about the allowlist alone: importing the real megatron.core (earlier
    tests in the same process do) registers its classes with
    ``torch.serialization.add_safe_globals``, the switch the unpickler also honours."""
    before = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    yield
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(before)

ENUMS = "megatron.core.transformer.enums"
OPT = "megatron.core.optimizer.optimizer_config"


class AttnBackend(enum.Enum):
    flash = 1
    auto = 5


@dataclasses.dataclass
class OptimizerConfig:
    lr: float = 1e-3
    optimizer: str = "adam"


def _megatron_common(path):
    """A common.pt shaped like Megatron-LM's, pickled while fake megatron modules exist."""
    with fake_module(ENUMS, AttnBackend=AttnBackend), fake_module(OPT, OptimizerConfig=OptimizerConfig):
        args = argparse.Namespace(
            tensor_model_parallel_size=2, pipeline_model_parallel_size=2, world_size=8,
            num_layers=4, hidden_size=64, attention_backend=AttnBackend.auto,
            optimizer_config=OptimizerConfig(lr=3e-4), save=pathlib.PosixPath("/ckpt"),
            params_dtype=torch.bfloat16, seed=np.int64(1234), loss_scale=np.float32(1.5),
            exit_signal=signal.SIGTERM)  # Megatron-LM's default, in every real common.pt
        torch.save({"args": args, "iteration": 10, "checkpoint_version": 3.0,
                    "rng": np.random.RandomState(0).get_state(), "t": torch.arange(4),
                    "content_metadata": {"distrib_optim_sharding_type": "dp_reshardable"}}, path)


@pytest.fixture
def common_pt(tmp_path):
    p = tmp_path / "common.pt"
    _megatron_common(p)
    return p


def test_load_torch_file_megatron_common_without_megatron(common_pt):
    before = {m for m in sys.modules if m.startswith("megatron")}
    state = load_torch_file(common_pt)
    assert {m for m in sys.modules if m.startswith("megatron")} == before
    args = state["args"]
    assert isinstance(args, argparse.Namespace)
    assert args.tensor_model_parallel_size == 2 and args.params_dtype is torch.bfloat16
    assert isinstance(args.attention_backend, StandIn)
    assert args.attention_backend.fields()["_args"] == (5,)
    assert f"{ENUMS}.AttnBackend" in repr(args.attention_backend)
    assert args.optimizer_config.lr == 3e-4 and args.optimizer_config.optimizer == "adam"
    assert repr(args.optimizer_config).startswith(f"{OPT}.OptimizerConfig(")
    assert args.save == pathlib.PosixPath("/ckpt") and args.seed == 1234
    assert args.exit_signal is signal.SIGTERM
    assert torch.equal(state["t"], torch.arange(4))


def test_light_load_matches_and_imports_no_torch(common_pt):
    state = load_torch_free(common_pt)
    assert state["args"].hidden_size == 64
    assert repr(state["t"]) == "<tensor int64 [4]>"
    s = summarize_common(state)
    assert s["iteration"] == 10 and s["checkpoint_version"] == 3.0
    assert s["parallel"] == {"tp": 2, "pp": 2, "world_size": 8, "dp": 2}
    assert s["model"]["params_dtype"] == "bfloat16"
    assert s["content_metadata"]["distrib_optim_sharding_type"] == "dp_reshardable"
    j = jsonable(state)
    assert j["args"]["optimizer_config"]["__class__"] == f"{OPT}.OptimizerConfig"
    assert j["t"] == {"tensor": "int64", "shape": [4]}


def test_forbidden_global_is_named(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    p = tmp_path / "evil.pt"
    torch.save({"x": Evil()}, p)
    for load in (load_torch_file, load_torch_free):
        with pytest.raises(UnsafePickleError) as e:
            load(p)
        assert "posix.system" in str(e.value) and "--trust" in str(e.value)


def test_trust_allows_non_allowlisted_globals():
    data = pickle.dumps(types.SimpleNamespace(a=1))
    with pytest.raises(UnsafePickleError, match="types.SimpleNamespace"):
        safe_loads(data)
    assert safe_loads(data, trust=True).a == 1
    buf = io.BytesIO()
    torch.save({"ns": types.SimpleNamespace(b=2)}, buf)
    with pytest.raises(UnsafePickleError):
        load_torch_file(io.BytesIO(buf.getvalue()))
    assert load_torch_file(io.BytesIO(buf.getvalue()), trust=True)["ns"].b == 2


@pytest.mark.parametrize("cut", [0, 10, 200])
def test_truncated_or_garbage(tmp_path, common_pt, cut):
    p = tmp_path / "bad.pt"
    p.write_bytes(common_pt.read_bytes()[:cut] if cut else b"\x00garbage" * 10)
    for load in (load_torch_file, load_torch_free):
        with pytest.raises(CorruptCheckpointError):
            load(p)
    with pytest.raises(CorruptCheckpointError):
        safe_loads(b"\x80\x04garbage")


def test_missing_file(tmp_path):
    with pytest.raises(InputError):
        load_torch_file(tmp_path / "nope.pt")


def test_stand_ins_are_written_back_as_what_they_stand_for(common_pt, tmp_path):
    """A common state read without megatron (its enums and config dataclasses as stand-ins)
    is written again by ``torch_save_file`` as the same globals, fields and values: it loads
    where megatron imports into the original objects, and without it into stand-ins again."""
    from ckpt_tool.formats.write_guard import torch_save_file

    state = load_torch_file(common_pt)
    state["args"].tensor_model_parallel_size = 1  # what reshard changes
    torch_save_file(state, tmp_path / "again.pt")
    with fake_module(ENUMS, AttnBackend=AttnBackend), \
            fake_module(OPT, OptimizerConfig=OptimizerConfig):
        real = torch.load(tmp_path / "again.pt", weights_only=False)
    args = real["args"]
    assert args.attention_backend is AttnBackend.auto
    assert args.optimizer_config == OptimizerConfig(lr=3e-4)
    assert args.tensor_model_parallel_size == 1 and args.params_dtype is torch.bfloat16
    assert torch.equal(real["t"], torch.arange(4))
    again = load_torch_file(tmp_path / "again.pt")
    assert again["args"].attention_backend.fields()["_args"] == (5,)
    assert repr(again["args"].optimizer_config) == repr(state["args"].optimizer_config)


def test_megatron_lm_exit_signal_is_allowed():
    """Megatron-LM 0.16 saves ``args.exit_signal`` (``signal.SIGTERM`` by default)."""
    import signal

    data = pickle.dumps(argparse.Namespace(exit_signal=signal.SIGTERM), protocol=2)
    assert safe_loads(data).exit_signal is signal.SIGTERM
