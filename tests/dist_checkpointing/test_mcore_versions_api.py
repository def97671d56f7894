"""The library API on checkpoints the real Megatron-Core 0.14 and 0.19 wrote (``fixtures/``):
0.19 keeps its common state in the ``common_state`` object and has no ``common.pt``, which
``load_common_state_dict``, ``load`` (so ``load_plain_tensors``, ``load_content_metadata``)
read as 0.19's own ``load_common_state_dict`` does (``common.pt`` first when there is one).
Tensor values are compared with the ground truth the generating run recorded
(``expected/optim.safetensors``); ``tests/interop/test_mcore_versions.py`` compares with 0.19's
own API where its sources can be had."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from ckpt_tool import dist_checkpointing as dc
from ckpt_tool.dist_checkpointing.core import CheckpointingException
from ckpt_tool.dist_checkpointing.validation import StrictHandling

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
FIX = Path(__file__).resolve().parents[2] / "fixtures"
MCORE019 = FIX / "mcore019_gpt_tp2dp2_distopt_buckets"
MCORE014 = FIX / "mcore014_gpt_tp2dp2_distopt_flattened"


def _iter(fixture: Path) -> Path:
    return next(fixture.glob("iter_*"))


# The local spec's norms, saved under the linear they precede (fixtures/README.md)
_NORMS = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
          ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"))


def _expected_model(fixture: Path) -> dict[str, torch.Tensor]:
    """The model the generating run held, under the checkpoint's keys: its fp32 main parameters
    rounded to bf16 (what the DistributedOptimizer copies into the model after a step);
    ``decoder.layers.<i>.X`` of the TP1 model is layer ``i`` of the stacked
    ``decoder.layers.X``."""
    from safetensors.torch import load_file

    stacked: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for key, value in load_file(fixture / "expected" / "optim.safetensors").items():
        if not key.startswith("fp32_param."):
            continue
        name, value = key[len("fp32_param."):], value.to(torch.bfloat16)
        m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
        if m:
            rest = m.group(2)
            for module, saved_as in _NORMS:
                if rest.startswith(module):
                    rest = saved_as + rest[len(module):]
            stacked.setdefault(f"decoder.layers.{rest}", {})[int(m.group(1))] = value
        else:
            out[name] = value
    out.update({k: torch.stack([v[i] for i in sorted(v)]) for k, v in stacked.items()})
    return out


def test_load_common_state_dict_reads_the_019_common_state_object():
    common = dc.load_common_state_dict(_iter(MCORE019))
    assert common["args"].tensor_model_parallel_size == 2
    assert common["iteration"] == 10
    assert common["content_metadata"]["distrib_optim_sharding_type"] == "dp_reshardable"
    assert dc.load_content_metadata(_iter(MCORE019))["distrib_optim_sharding_type"] == \
        "dp_reshardable"


@pytest.mark.parametrize("fixture", [MCORE019, MCORE014])
def test_load_plain_tensors_gives_the_model_the_generating_run_recorded(fixture):
    plain = dc.load_plain_tensors(_iter(fixture))
    assert plain["iteration"] == 10  # the common state, merged as Megatron-Core does
    expected = _expected_model(fixture)
    assert len(expected) == 16
    for key, value in expected.items():
        assert plain[key].dtype == value.dtype and torch.equal(plain[key], value), key
    metadata = dc.load_tensors_metadata(_iter(fixture))
    assert set(expected) <= set(metadata)


def test_strict_load_does_not_count_the_common_state_object_as_missing():
    """Megatron-Core's ``missing`` keys are the checkpoint's keys the request leaves out: the
    common state, loaded as such, is not one of them (0.19 drops it from the check too)."""
    d = _iter(MCORE019)
    request = {k: v for k, v in dc.load_tensors_metadata(d).items()
               if not k.startswith("optimizer.")}
    state, missing, unexpected = dc.load(request, d, validate_access_integrity=False,
                                         strict=StrictHandling.RETURN_ALL)
    assert not unexpected and state["iteration"] == 10
    assert "common_state" not in missing
    assert "rng_state" in missing  # what the request left out is reported


def test_common_pt_wins_over_the_common_state_object(tmp_path):
    from ckpt_tool.formats.containers.torch_zip.torch_save_object import save_object

    both = tmp_path / "both"
    shutil.copytree(_iter(MCORE019), both)
    common = dc.load_common_state_dict(both)
    common["iteration"] = 11
    save_object(common, both / "common.pt")
    assert dc.load_common_state_dict(both)["iteration"] == 11


def test_no_common_state_at_all(tmp_path):
    d = tmp_path / "014"
    shutil.copytree(_iter(MCORE014), d)
    (d / "common.pt").unlink()
    with pytest.raises(CheckpointingException, match="common.pt does not exist"):
        dc.load_common_state_dict(d)
