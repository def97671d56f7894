"""Megatron-LM legacy optimizer state as tensors (``optimizer.state.{fp32_param,exp_avg,
exp_avg_sq}.<param key>``), checked against the real Megatron-Core optimizers' per-parameter
state saved next to the fixtures (``expected/optim_*.safetensors``):

* ``megatron_legacy_distopt_tp2dp2``: ``distrib_optim.pt`` from the real
  ``DistributedOptimizer.save_parameter_state()`` (TP=2, DP=2, several grad buckets);
* ``megatron_legacy_fp16opt_pp2``: the non-distributed ``Float16OptimizerWithFloat16Params``
  ``state_dict`` inside ``model_optim_rng.pt`` (PP=2);
* ``megatron_legacy_moe_distopt``: MoE, PP=2 x VPP=2, EP=2, a chained dense + expert
  ``DistributedOptimizer`` (``distrib_optim.pt`` = ``[dense or None, expert]``);
* ``megatron_legacy_moe_fp32opt``: MoE, fp32, EP=2 (``mp_rank_00_{ep:03d}``), a chained dense
  + expert ``FP32Optimizer`` (``optimizer`` = a list of two torch Adam ``state_dict``s).
"""

import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from ckpt_tool.formats import open_checkpoint
from ckpt_tool.formats.legacy import optim as O

FIX = Path(__file__).resolve().parents[2] / "fixtures"
DISTOPT = FIX / "megatron_legacy_distopt_tp2dp2"
FP16OPT = FIX / "megatron_legacy_fp16opt_pp2"
MOE = FIX / "megatron_legacy_moe_distopt"
MOE_FP32 = FIX / "megatron_legacy_moe_fp32opt"
STATES = ("fp32_param", "exp_avg", "exp_avg_sq")


def _tp_merge(key: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The TP=1 tensor from TP-local ones (docs/formats.md §5, stated independently)."""
    if len(shards) == 1:
        return shards[0]
    if key.endswith(("linear_fc1.weight", "linear_fc1.bias")):  # SwiGLU [W_r; V_r] per rank
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    if key.endswith(("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight",
                     "output_layer.weight")):
        return torch.cat(shards, 0)
    if key.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return torch.cat(shards, 1)
    assert all(torch.equal(s, shards[0]) for s in shards), key
    return shards[0]


def _expected_distopt() -> dict[str, torch.Tensor]:
    per_tp = [load_file(DISTOPT / "expected" / f"optim_tp{r}.safetensors") for r in (0, 1)]
    return {f"optimizer.state.{k}": _tp_merge(k, [e[k] for e in per_tp]) for k in per_tp[0]}


def _expected_fp16opt() -> dict[str, torch.Tensor]:
    out = {}
    for pp in (0, 1):  # 2 layers, one per stage
        for k, v in load_file(FP16OPT / "expected" / f"optim_tp0_pp{pp}.safetensors").items():
            k = re.sub(r"decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m[1]) + pp}.", k)
            out[f"optimizer.state.{k}"] = v
    return out


def _expected_moe(fix: Path = MOE) -> dict[str, torch.Tensor]:
    """Keys are already the TP1/PP1 names; dense params appear in both EP ranks' files."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted((fix / "expected").glob("optim_*ep*.safetensors")):
        for k, v in load_file(f).items():
            key = f"optimizer.state.{k}"
            assert key not in out or torch.equal(out[key], v), k
            out[key] = v
    return out


CASES = {"distopt": (DISTOPT, _expected_distopt, 28, STATES),
         "fp16opt": (FP16OPT, _expected_fp16opt, 28, STATES),
         "moe_distopt": (MOE, _expected_moe, 72, STATES),
         "moe_fp32opt": (MOE_FP32, lambda: _expected_moe(MOE_FP32), 72, STATES[1:])}


@pytest.mark.parametrize("case", sorted(CASES))
def test_optimizer_tensors_equal_real_optimizer_state(case):
    fix, expected_fn, n_params, states = CASES[case]
    expected = expected_fn()
    with open_checkpoint(fix) as r:
        meta = r.metadata()
        model_keys = [k for k in meta.tensors if not k.startswith("optimizer.")]
        opt_keys = {k for k in meta.tensors if k.startswith("optimizer.")}
        assert len(model_keys) == n_params
        assert opt_keys == {f"optimizer.state.{s}.{k}" for s in states for k in model_keys}
        assert opt_keys == set(expected)
        assert meta.extras["optimizer_state_not_mapped"] == {}
        for k in sorted(opt_keys):
            t = meta.tensors[k]
            got = r.read(k)
            assert t.dtype == "float32" and got.shape == t.shape, k
            assert torch.equal(got, expected[k]), k


@pytest.mark.parametrize("case", ["distopt", "fp16opt", "moe_distopt"])
def test_fp32_main_params_round_to_the_bf16_model(case):
    with open_checkpoint(CASES[case][0]) as r:
        checked = 0
        for k, t in r.metadata().tensors.items():
            if not k.startswith("optimizer.") and t.dtype == "bfloat16":
                main = r.read(f"optimizer.state.fp32_param.{k}")
                assert torch.equal(main.to(torch.bfloat16), r.read(k)), k
                checked += 1
        assert checked == CASES[case][2]


def test_moe_dense_and_expert_states_come_from_their_optimizers():
    with open_checkpoint(MOE) as r:
        t = r.metadata().tensors
        # dense: gathered on dense-DP rank 0 (EP rank 0's files); experts: each EP rank's own
        dense = t["optimizer.state.exp_avg.decoder.layers.3.self_attention.linear_qkv.weight"]
        assert [c.file for c in dense.chunks] == ["mp_rank_00_001_000/distrib_optim.pt"]
        for e in range(4):
            ex = t[f"optimizer.state.fp32_param.decoder.layers.2.mlp.experts.local_experts.{e}"
                   ".linear_fc2.weight"]
            assert [c.file for c in ex.chunks] == [f"mp_rank_00_000_00{e // 2}/distrib_optim.pt"]
        assert r.read_object("distrib_optim/mp_rank_00_000_001")[0] is None


def test_distopt_reads_are_lazy_and_byte_ranges_exact():
    with open_checkpoint(DISTOPT) as r:
        meta = r.metadata()
        k = "optimizer.state.exp_avg.decoder.layers.1.mlp.linear_fc1.weight"
        t = meta.tensors[k]
        assert len(t.chunks) == 4 and all(c.file.endswith("distrib_optim.pt") for c in t.chunks)
        part = r.read(k, (slice(0, 10), slice(None)))  # rows of TP rank 0 only
        assert list(r._files) == ["mp_rank_00/distrib_optim.pt"]
        full = r.read(k)
        assert torch.equal(part, full[:10])
        for c in t.chunks:
            raw = (DISTOPT / "iter_0000010" / c.file).read_bytes()[
                c.byte_offset:c.byte_offset + c.byte_length]
            piece = torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(c.sizes)
            sl = tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))
            assert torch.equal(full[sl], piece)


def test_wrong_bucket_size_keeps_optimizer_as_objects(tmp_path):
    """A layout that cannot be rebuilt exactly is not guessed: the state stays objects."""
    broken = tmp_path / "ckpt"
    shutil.copytree(DISTOPT, broken, ignore=shutil.ignore_patterns("expected"))
    for f in (broken / "iter_0000010").glob("mp_rank_*/model_optim_rng.pt"):
        state = torch.load(f, weights_only=False)
        state["args"].ddp_bucket_size = 5000
        torch.save(state, f)
    with open_checkpoint(broken) as r:
        meta = r.metadata()
        assert not any(k.startswith("optimizer.") for k in meta.tensors)
        why = meta.extras["optimizer_state_not_mapped"]
        assert set(why) == {"mp_rank_00", "mp_rank_01"}
        assert "numel_unpadded" in why["mp_rank_00"]
        assert {o.unique_key for o in meta.objects} >= {"distrib_optim/mp_rank_00",
                                                         "optimizer/mp_rank_01"}
        assert r.read_object("distrib_optim/mp_rank_01")["buckets_coalesced"] is True


def test_param_group_mismatch_keeps_optimizer_as_objects(tmp_path):
    broken = tmp_path / "ckpt"
    shutil.copytree(FP16OPT, broken, ignore=shutil.ignore_patterns("expected"))
    f = broken / "iter_0000010" / "mp_rank_00_001" / "model_optim_rng.pt"
    state = torch.load(f, weights_only=False)
    groups = state["optimizer"]["optimizer"]["param_groups"]
    groups[0]["params"], groups[1]["params"] = groups[0]["params"][:-1], \
        groups[0]["params"][-1:] + groups[1]["params"]
    torch.save(state, f)
    with open_checkpoint(broken) as r:
        meta = r.metadata()
        assert "mp_rank_00_001" in meta.extras["optimizer_state_not_mapped"]
        assert "mp_rank_00_000" not in meta.extras["optimizer_state_not_mapped"]
        assert not any(k.startswith("optimizer.") and ".layers.1." in k for k in meta.tensors)


def test_buffer_slots_rules():
    params = [("a", (100,), "bfloat16"), ("b", (10, 3), "bfloat16"), ("c", (64,), "bfloat16")]
    # reverse order, starts padded to 64: c at 0, b at 64, a at 128 (one bucket)
    assert O.buffer_slots(params, None) == ({"c": 0, "b": 64, "a": 128}, 228)
    # bucket of >= 90 elements closes after b (64 + 30 = 94): a starts the next bucket, and the
    # coalesced tensor keeps only each bucket's unpadded range
    assert O.buffer_slots(params, 90) == ({"c": 0, "b": 64, "a": 94}, 194)


def test_common_state_in_full():
    with open_checkpoint(FIX / "megatron_legacy_tp2pp2") as r:
        c = r.common()
    assert c["args"]["tensor_model_parallel_size"] == 2 and c["args"]["ckpt_format"] == "torch"
    assert c["iteration"] == 10 and c["checkpoint_version"] == 3.0
    assert sorted(c["rng_state"]) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000",
                                      "mp_rank_01_001"]
    assert isinstance(c["rng_state"]["mp_rank_01_001"][0]["torch_rng_state"], torch.Tensor)
    assert "model" not in c and c["opt_param_scheduler"]["max_lr"] == 3.0e-4
    with open_checkpoint(FP16OPT) as r:
        opt = r.common()["optimizer"]
    assert opt["optimizer"]["param_groups"][1]["wd_mult"] == 0.0
    assert "fp32 main params" in opt["fp32_from_fp16_params"]


def test_cli_inspect_common_prints_args_in_full():
    import json

    from ckpt_tool.cli.app import app

    res = CliRunner().invoke(app, ["inspect", str(FIX / "megatron_legacy_tp2pp2"), "--common",
                                   "--json"])
    assert res.exit_code == 0, res.output
    common = json.loads(res.stdout)["common"]
    assert common["args"]["num_query_groups"] == 2 and common["args"]["lr"] == 3.0e-4
    assert len(common["args"]) > 60
    assert set(common["rng_state"]) == {"mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000",
                                        "mp_rank_01_001"}
    res = CliRunner().invoke(app, ["inspect", str(FIX / "megatron_legacy_tp2pp2"), "--common"])
    assert res.exit_code == 0 and "untie_embeddings_and_output_weights" in res.stdout


@pytest.mark.parametrize("fix", [
    DISTOPT, MOE, MOE_FP32, FIX / "megatron_legacy_moe_vpp",
    FP16OPT,
], ids=lambda p: p.name)
def test_metadata_is_torch_free_with_raw_chunks(fix):
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from ckpt_tool.formats import open_checkpoint\n"
        f"m = open_checkpoint({str(fix)!r}).metadata()\n"
        "assert all(c.layout == 'raw' for t in m.tensors.values() for c in t.chunks)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
