"""Every public name of the real Megatron-Core ``dist_checkpointing`` modules exists in ours."""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys

import pytest

if importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)
pytestmark = pytest.mark.interop

MODULES = ["", ".mapping", ".serialization", ".core", ".dict_utils", ".utils", ".optimizer",
           ".strategies", ".strategies.base", ".strategies.torch",
           ".strategies.async_utils", ".strategies.state_dict_saver",
           ".strategies.filesystem_async", ".strategies.fully_parallel", ".strategies.common",
           ".strategies.cached_metadata_filesystem_reader", ".strategies.checkpointable",
           ".exchange_utils", ".state_dict_utils", ".tensor_aware_state_dict", ".validation"]

_LIST_MCORE = """
import importlib, json, sys, warnings
warnings.simplefilter("ignore")
out = {}
for suffix in json.loads(sys.argv[1]):
    name = "megatron.core.dist_checkpointing" + suffix
    try:
        mod = importlib.import_module(name)
    except Exception as exc:  # a backend MCore cannot import here (e.g. zarr missing)
        out[suffix] = "unimportable: " + repr(exc)
        continue
    out[suffix] = sorted(
        n for n in dir(mod) if not n.startswith("_")
        and (getattr(getattr(mod, n), "__module__", "") or "").startswith(
            "megatron.core.dist_checkpointing"))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def mcore_names() -> dict:
    done = subprocess.run([sys.executable, "-c", _LIST_MCORE, json.dumps(MODULES)],
                          capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("suffix", MODULES)
def test_public_names_match_megatron_core(mcore_names: dict, suffix: str) -> None:
    theirs = mcore_names[suffix]
    if isinstance(theirs, str):
        pytest.skip(theirs)
    ours = importlib.import_module("ckpt_tool.dist_checkpointing" + suffix)
    missing = [n for n in theirs if not hasattr(ours, n)]
    assert not missing, f"ckpt_tool.dist_checkpointing{suffix} lacks {missing}"
