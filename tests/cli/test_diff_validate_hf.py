"""``ckpt diff`` / ``ckpt validate`` on Hugging Face model directories.

``diff`` between a Megatron checkpoint and an HF directory maps names and shapes through the
export rules: a faithful export (and the source of an import) diffs clean both ways, what HF
cannot hold is a note ("not comparable"), a changed tensor is reported under its HF name with
the Megatron tensor it comes from. The GPT-2 pair is a bf16 TP2 PP2 torch_dist import of a
GPT-2 directory (one key/value head per query head) and its export; the checkpoints the real
Megatron-Core 0.16.1 wrote all have grouped-query attention, which GPT-2 cannot hold: their
``--to hf --hf-arch gpt2`` is refused, and ``diff`` compares them with a GPT-2 directory by the
names as stored."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

from ckpt_tool.cli.app import app

sys.path.insert(0, str(Path(__file__).parent))
from _hf_dirs import gpt2_dir, llama_config, llama_dir  # noqa: E402

runner = CliRunner()
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
MCORE = FIXTURES / "mcore016_gpt_tp2pp2_bf16_optim" / "iter_0000010"
LLAMA = llama_config()


def ckpt(*argv, code: int = 0):
    result = runner.invoke(app, [str(a) for a in argv])
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    return result


def editable_copy(src: Path, dst: Path) -> None:
    """A copy of an export to edit: without its manifest (``ckpt`` refuses a source whose
    files no longer match their manifest; an intended edit drops or rewrites it)."""
    shutil.copytree(src, dst)
    (dst / "ckpt-manifest.json").unlink()


def diff_json(a, b, code: int) -> dict:
    return json.loads(ckpt("diff", a, b, "--json", "--no-progress", code=code).stdout)


def rewrite(path: Path, key: str, change) -> None:
    """Rewrite safetensors file ``path`` with ``change`` applied to tensor ``key``."""
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    change(tensors[key])
    save_file(tensors, str(path), metadata=meta)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    """A torch_dist GPT-2 checkpoint (bf16, TP2 PP2, hidden 32, 4 layers) and its HF export."""
    root = tmp_path_factory.mktemp("gpt2")
    src = gpt2_dir(root / "src", hidden=32, layers=4, vocab=100, dtype="bfloat16")
    ckpt("convert", src, root / "mc", "--to", "torch_dist", "--tp", "2", "--pp", "2",
         "--no-progress")
    out = ckpt("convert", root / "mc", root / "hf", "--to", "hf", "--hf-arch", "gpt2",
               "--no-progress").output
    # the import's args name the HuggingFaceTokenizer, not GPT-2's: ids unknown, not 50256
    assert "bos/eos token ids unknown (tokenizer: HuggingFaceTokenizer, vocab_size 100)" in out
    cfg = json.loads((root / "hf" / "config.json").read_text())
    assert cfg["bos_token_id"] is None and cfg["eos_token_id"] is None
    assert not (root / "hf" / "generation_config.json").exists()
    return root / "mc", root / "hf"


def test_megatron_checkpoint_and_its_hf_export_diff_clean_both_ways(pair):
    mc, export = pair
    for a, b, me in ((mc, export, "A"), (export, mc, "B")):
        doc = diff_json(a, b, 0)
        assert doc["identical"] and not doc["only_in_a"] and not doc["only_in_b"]
        assert doc["stats"]["tensors_compared"] == doc["stats"]["tensors_common"] == 52
        notes = "\n".join(doc["notes"])
        assert f"padded vocab rows not comparable: {me}'s embedding.word_embeddings.weight " \
               f"has 256 rows, {'AB'[me == 'A']} (hf) holds vocab_size 100" in notes
        assert "common state not comparable" in notes and "args" in notes
        assert not doc["common"]


def test_a_changed_tensor_is_reported_under_both_names(pair, tmp_path):
    mc, export = pair
    changed = tmp_path / "hf"
    editable_copy(export, changed)
    key = "transformer.h.1.attn.c_attn.weight"
    rewrite(changed / "model.safetensors", key, lambda t: t[3].add_(1.0))
    doc = diff_json(mc, changed, 1)
    assert [v["key"] for v in doc["values"]] == [key]
    assert doc["values"][0]["differing"] == 96 and doc["values"][0]["first_index"] == [3, 0]
    assert doc["mapped_from"] == {
        key: "decoder.layers.self_attention.linear_qkv.weight[1] (q/k/v regrouped, transposed)"}
    text = ckpt("diff", mc, changed, "--no-progress", code=1).output
    assert f"first: {key}[3, 0]" in text and "(A: decoder.layers.self_attention.linear_qkv" \
        ".weight[1]" in text
    # a tensor the export lacks is only in A, under its HF name
    with safe_open(str(changed / "model.safetensors"), "pt") as f:
        kept = {k: f.get_tensor(k) for k in f.keys() if k != "transformer.ln_f.bias"}
    save_file(kept, str(changed / "model.safetensors"), metadata={"format": "pt"})
    doc = diff_json(mc, changed, 1)
    assert doc["only_in_a"] == ["transformer.ln_f.bias"]
    assert doc["mapped_from"]["transformer.ln_f.bias"] == "decoder.final_layernorm.bias"


def test_config_json_is_compared_with_the_args(pair, tmp_path):
    mc, export = pair
    edited = tmp_path / "hf"
    editable_copy(export, edited)
    cfg = json.loads((edited / "config.json").read_text())
    assert cfg["n_head"] == 4 and cfg["layer_norm_epsilon"] == 1e-5
    (edited / "config.json").write_text(json.dumps({**cfg, "n_head": 8,
                                                    "layer_norm_epsilon": 1e-6}))
    for a, b, swap in ((mc, edited, False), (edited, mc, True)):
        doc = diff_json(a, b, 1)
        assert doc["stats"]["tensors_compared"] == 52 and not doc["values"]
        want = [("args.num_attention_heads / config.json n_head", 4, 8),
                ("args.norm_epsilon / config.json layer_norm_epsilon", 1e-5, 1e-6)]
        assert [(c["path"], *((c["b"], c["a"]) if swap else (c["a"], c["b"])))
                for c in doc["common"]] == want
        assert {c["kind"] for c in doc["common"]} == {"changed"}
    text = ckpt("diff", mc, edited, "--no-progress", code=1).output
    assert "2 common-state differences" in text and "config.json n_head" in text


def test_gpt2_export_of_grouped_query_attention_is_refused(tmp_path):
    """Megatron-Core's checkpoints here have 2 query groups for 4 heads: GPT-2's c_attn holds
    as many k/v heads as q heads, so transformers could not load the export."""
    out = tmp_path / "hf"
    result = ckpt("convert", MCORE, out, "--to", "hf", "--hf-arch", "gpt2", "--no-progress",
                  code=2)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr
    assert "GPT2LMHeadModel has no grouped-query attention; this checkpoint has 2 query " \
           "groups for 4 heads (pass --hf-arch llama, mistral or qwen2 if the other weights " \
           "fit those architectures; otherwise use --to safetensors)" in lines[0]
    assert list(tmp_path.iterdir()) == []  # nothing written, no staging left


def _llama_dir(root: Path) -> Path:
    return llama_dir(root)


def test_hf_model_and_its_torch_dist_import(tmp_path):
    hf = _llama_dir(tmp_path / "hf")
    mc = tmp_path / "mc"
    ckpt("convert", hf, mc, "--to", "torch_dist", "--pp", "2", "--no-progress")
    doc = diff_json(hf, mc, 0)
    assert doc["stats"]["tensors_common"] == 21 and doc["identical"]
    assert ("padded vocab rows not comparable: B's embedding.word_embeddings.weight has 128 "
            "rows, A (hf) holds vocab_size 10; rows 10-127 not compared") in doc["notes"]
    assert any(n.startswith("common state not comparable: A (hf) holds config.json, B "
                            "(torch_dist) holds args") for n in doc["notes"])
    # the up half of layer 1's linear_fc1 changed in the HF model
    key = "model.layers.1.mlp.up_proj.weight"
    shard = json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"][key]
    rewrite(hf / shard, key, lambda t: t[0].mul_(2))
    doc = diff_json(mc, hf, 1)
    assert [v["key"] for v in doc["values"]] == [key]
    assert doc["mapped_from"] == {key: "decoder.layers.mlp.linear_fc1.weight[1] (up half)"}


def test_names_the_rules_cannot_map_are_compared_as_stored(pair, tmp_path):
    mc, export = pair
    wrong = tmp_path / "hf"
    editable_copy(export, wrong)
    (wrong / "config.json").write_text(json.dumps(LLAMA))  # a GPT-2 model called Llama
    doc = diff_json(mc, wrong, 1)
    assert any(n.startswith("names not mapped through the Hugging Face rules (") for n in
               doc["notes"]), doc["notes"]
    assert "transformer.h.0.attn.c_attn.weight" in doc["only_in_b"]
    assert "decoder.layers.self_attention.linear_qkv.weight" in doc["only_in_a"]
    # Megatron-Core's grouped-query checkpoint against a GPT-2 directory: no GPT-2 view of it
    doc = diff_json(MCORE, export, 1)
    assert any("names not mapped through the Hugging Face rules" in n and "GPT2LMHeadModel "
               "has no grouped-query attention" in n for n in doc["notes"]), doc["notes"]
    assert "transformer.h.0.attn.c_attn.weight" in doc["only_in_b"]


@pytest.mark.parametrize("kind", ["sharded", "bin"])
def test_validate_hf_directories(tmp_path, kind):
    d = _llama_dir(tmp_path / "hf")
    if kind == "bin":  # the same model as pytorch_model-*.bin + index
        index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
        for name in sorted(set(index.values())):
            with safe_open(str(d / name), "pt") as f:
                torch.save({k: f.get_tensor(k) for k in f.keys()},
                           d / name.replace("model-", "pytorch_model-").replace(
                               ".safetensors", ".bin"))
            (d / name).unlink()
        (d / "model.safetensors.index.json").unlink()
        (d / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {
            k: v.replace("model-", "pytorch_model-").replace(".safetensors", ".bin")
            for k, v in index.items()}}))
    first = sorted(p for p in d.iterdir() if p.name.endswith((".bin", ".safetensors")))[0]
    for deep in ([], ["--deep"]):
        doc = json.loads(ckpt("validate", d, "--json", *deep).stdout)
        assert doc["ok"] and doc["format"] == "hf" and doc["stats"]["tensors"] == 21
        assert doc["stats"]["files"] == 2
    assert json.loads(ckpt("validate", d, "--deep", "--json").stdout)["stats"][
        "tensors_read"] == 21
    # a NaN is found by --deep (a warning)
    if kind == "sharded":
        rewrite(first, "lm_head.weight", lambda t: t[0].fill_(float("nan")))
        doc = json.loads(ckpt("validate", d, "--deep", "--json").stdout)
        assert doc["nonfinite"] == {"lm_head.weight": {"nan": 8, "inf": 0, "elements": 80}}
    # a truncated shard, then a missing one: a finding naming it, exit 1
    first.write_bytes(first.read_bytes()[:-16])
    doc = json.loads(ckpt("validate", d, "--json", code=1).stdout)
    assert first.name in json.dumps(doc["findings"])
    first.unlink()
    doc = json.loads(ckpt("validate", d, "--json", code=1).stdout)
    assert f"names {first.name}, which is missing" in doc["findings"][0]["message"]
