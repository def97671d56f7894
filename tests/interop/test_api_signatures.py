"""Signatures and module-level names of ours match the real Megatron-Core 0.16.1 ones.

For each of the 21 modules of ``megatron.core.dist_checkpointing``: every public function and
class defined there exists in ours with a compatible ``inspect.signature`` (same parameter
names, order and kinds, same defaults; ours may add trailing parameters that have defaults,
e.g. ``trust``, and give defaults where MCore has none), every public method of those classes
too; and the module-level names that Megatron-LM's code and tests import from these modules,
private ones and re-exports included (``PRIVATE_AND_REEXPORTED``; found in Megatron-LM
``core_v0.16.1`` with ``git grep``), exist in ours. Needs only the installed megatron-core.
"""

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

BASE = "megatron.core.dist_checkpointing"
MODULES = ["", ".mapping", ".serialization", ".core", ".dict_utils", ".utils", ".optimizer",
           ".strategies", ".strategies.base", ".strategies.torch",
           ".strategies.async_utils", ".strategies.state_dict_saver",
           ".strategies.filesystem_async", ".strategies.fully_parallel", ".strategies.common",
           ".strategies.cached_metadata_filesystem_reader", ".strategies.checkpointable",
           ".exchange_utils", ".state_dict_utils", ".tensor_aware_state_dict", ".validation"]

# Names that are private or defined outside dist_checkpointing in MCore but that Megatron-LM
# (training code or tests, tag core_v0.16.1) imports or patches from these modules, plus the
# re-exports and flags of the same kind (issue 18).
PRIVATE_AND_REEXPORTED = {
    ".serialization": ["MultiStorageClientFeature", "log_single_rank"],
    ".core": ["MultiStorageClientFeature"],
    ".optimizer": ["log_single_rank", "to_local_if_dtensor"],
    ".strategies.torch": ["HAVE_DTENSOR", "HAVE_TE", "MSC_PREFIX", "MultiStorageClientFeature",
                          "get_torch_version", "is_torch_min_version",
                          "_get_filesystem_reader", "_replace_sharded_keys_with_state_dict_keys",
                          "_replace_state_dict_keys_with_sharded_keys", "_restore_dict_types",
                          "_unwrap_pyt_sharded_tensor"],
    ".strategies.async_utils": ["_disable_gc", "log_single_rank"],
    ".strategies.filesystem_async": ["HAVE_PSUTIL", "_results_queue", "_get_write_results_queue",
                                     "_process_memory", "_disable_gc"],
    ".strategies.fully_parallel": ["get_pg_rank", "get_pg_size", "_sharded_tensor_shard_id"],
    ".strategies.common": ["MultiStorageClientFeature"],
    ".strategies.state_dict_saver": ["_DistWrapper"],
    ".exchange_utils": ["HAVE_TE_FLOAT8TENSOR", "_get_empty_tensor_for_exchange", "get_pg_rank",
                        "get_pg_size", "log_single_rank", "_sharded_tensor_shard_id"],
    ".utils": ["_ShardId", "_sharded_object_id", "_sharded_tensor_shard_id",
               "_clean_metadata_for_serialization"],
    ".state_dict_utils": ["_clean_metadata_for_serialization"],
    ".tensor_aware_state_dict": ["_sharded_tensor_shard_id"],
    ".validation": ["MultiStorageClientFeature", "_compute_shards_access",
                    "_validate_objects_for_key", "_validate_sharding_for_key"],
}

# Run in a fresh interpreter: importing megatron.core here would slow down every other test.
_DUMP = """
import importlib, inspect, json, sys, warnings
warnings.simplefilter("ignore")
base = sys.argv[1]
mcore = base.startswith("megatron.")

def params(obj):
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    out = []
    for p in sig.parameters.values():
        d = p.default
        if d is inspect.Parameter.empty:
            default = None
        elif isinstance(d, (bool, int, float, str, type(None))):
            default = "=" + repr(d)
        else:
            default = "=<" + type(d).__name__ + ">"
        out.append([p.name, p.kind.name, default])
    return out

out = {}
for suffix in json.loads(sys.argv[2]):
    mod = importlib.import_module(base + suffix)
    entries = {}
    for name in dir(mod):
        if name.startswith("__"):
            continue
        obj = getattr(mod, name)
        here = getattr(obj, "__module__", None) == base + suffix
        entry = {"here": here}
        if callable(obj):
            if inspect.isclass(obj):
                entry["methods"] = {}
                for m in dir(obj):
                    if m.startswith("_") and m != "__init__":
                        continue
                    if mcore and here and m not in vars(obj) and m != "__init__":
                        continue  # compare what MCore's class itself defines
                    raw = inspect.getattr_static(obj, m)
                    if isinstance(raw, property):
                        entry["methods"][m] = "property"
                    elif callable(getattr(obj, m, None)):
                        entry["methods"][m] = params(getattr(obj, m))
            else:
                entry["sig"] = params(obj)
        entries[name] = entry
    out[suffix] = entries
print(json.dumps(out))
"""


def _dump(base: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _DUMP, base, json.dumps(MODULES)],
                          capture_output=True, text=True, timeout=900, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def real() -> dict:
    return _dump(BASE)


@pytest.fixture(scope="module")
def ours() -> dict:
    return _dump("ckpt_tool.dist_checkpointing")


_OBJECT_INIT = [["self", "POSITIONAL_ONLY", None], ["args", "VAR_POSITIONAL", None],
                ["kwargs", "VAR_KEYWORD", None]]


def compatible(theirs, mine) -> str:
    """'' when ``mine`` accepts every call ``theirs`` accepts the same way, else why not.

    ``self``'s kind is not compared; MCore classes without an ``__init__`` of their own
    (``object``'s) accept anything ours accepts; a property of ours stands for a method of
    theirs that takes only ``self`` (``can_handle_sharded_objects``).
    """
    if theirs is None or theirs == _OBJECT_INIT:
        return ""
    if mine == "property" or theirs == "property":
        ok = mine == theirs or [p[0] for p in theirs] == ["self"]
        return "" if ok else f"{theirs} is {mine} in ours"
    if mine is None:
        return "ours has no signature"
    norm = [[n, "SELF" if n == "self" else k, d] for n, k, d in theirs]
    mine = [[n, "SELF" if n == "self" else k, d] for n, k, d in mine]
    their_kw = norm[-1] if norm and norm[-1][1] == "VAR_KEYWORD" else None
    mine_kw = mine[-1] if mine and mine[-1][1] == "VAR_KEYWORD" else None
    if their_kw and not mine_kw:
        return "ours lacks **kwargs"
    norm = norm[:-1] if their_kw else norm
    rest = mine[:-1] if mine_kw else mine
    # ours = theirs in order, plus defaulted extras (keyword-only ones anywhere after theirs)
    i = 0
    for n1, k1, d1 in norm:
        while i < len(rest) and rest[i][0] != n1 and rest[i][1] == "KEYWORD_ONLY" \
                and rest[i][2] is not None and k1 == "KEYWORD_ONLY":
            i += 1
        if i >= len(rest):
            return f"ours has fewer parameters: {rest} vs {norm}"
        n2, k2, d2 = rest[i]
        if (n1, k1) != (n2, k2):
            return f"parameter {n1} ({k1}) is {n2} ({k2}) in ours"
        if d1 is not None and d1 != d2:
            return f"default of {n1} is {d1} in MCore, {d2} in ours"
        i += 1
    for name, kind, default in rest[i:]:
        if default is None and kind != "VAR_POSITIONAL":
            return f"ours adds {name} without a default"
    return ""


def test_compatible_rules() -> None:
    a = [["x", "POSITIONAL_OR_KEYWORD", None]]
    assert compatible(a, a) == ""
    assert compatible(a, a + [["trust", "KEYWORD_ONLY", "=False"]]) == ""
    assert "without a default" in compatible(a, a + [["y", "POSITIONAL_OR_KEYWORD", None]])
    assert "is y" in compatible(a, [["y", "POSITIONAL_OR_KEYWORD", None]])
    assert "fewer" in compatible(a + a, a)
    assert "default" in compatible([["x", "POSITIONAL_OR_KEYWORD", "=1"]],
                                   [["x", "POSITIONAL_OR_KEYWORD", "=2"]])
    kw = [["self", "POSITIONAL_OR_KEYWORD", None], ["args", "VAR_POSITIONAL", None],
          ["a", "KEYWORD_ONLY", "=<tuple>"], ["kwargs", "VAR_KEYWORD", None]]
    assert compatible(kw, kw[:3] + [["trust", "KEYWORD_ONLY", "=False"]] + kw[3:]) == ""
    assert "**kwargs" in compatible(kw, kw[:3])
    assert compatible(_OBJECT_INIT, [["self", "POSITIONAL_OR_KEYWORD", None]]) == ""
    assert compatible([["self", "POSITIONAL_OR_KEYWORD", None]], "property") == ""


@pytest.mark.parametrize("suffix", MODULES)
def test_signatures_match_megatron_core(real: dict, ours: dict, suffix: str) -> None:
    problems = []
    for name, entry in sorted(real[suffix].items()):
        if name.startswith("_") or not entry["here"]:
            continue
        mine = ours[suffix].get(name)
        if mine is None:
            problems.append(f"{name}: missing")
            continue
        if "sig" in entry:
            why = compatible(entry["sig"], mine.get("sig"))
            if why:
                problems.append(f"{name}{why and ': ' + why}")
        for method, sig in sorted(entry.get("methods", {}).items()):
            if method not in mine.get("methods", {}) and sig == _OBJECT_INIT:
                continue
            if method not in mine.get("methods", {}):
                problems.append(f"{name}.{method}: missing")
                continue
            why = compatible(sig, mine["methods"][method])
            if why:
                problems.append(f"{name}.{method}: {why}")
    assert not problems, f"ckpt_tool.dist_checkpointing{suffix}:\n" + "\n".join(problems)


@pytest.mark.parametrize("suffix", sorted(PRIVATE_AND_REEXPORTED))
def test_private_and_reexported_names(real: dict, ours: dict, suffix: str) -> None:
    wanted = PRIVATE_AND_REEXPORTED[suffix]
    assert all(n in real[suffix] for n in wanted), "the list names what MCore 0.16.1 has"
    missing = [n for n in wanted if n not in ours[suffix]]
    assert not missing, f"ckpt_tool.dist_checkpointing{suffix} lacks {missing}"
    for name in wanted:  # callables keep MCore's parameters
        if "sig" in real[suffix][name]:
            why = compatible(real[suffix][name]["sig"], ours[suffix][name].get("sig"))
            assert not why, f"{suffix}.{name}: {why}"
