"""Megatron-LM's ``tokenizer/`` assets (main branch, ``save_tokenizer_assets``): a torch_dist
iteration directory laid out as main writes it — the checkpoint saved with
``--verify-integrity`` (``fixtures/mcore019_*``: Megatron-Core's ``integrity.json`` of the
top-level files), then ``tokenizer/`` with what the HF tokenizer's ``save_pretrained`` writes
(the call Megatron-Core's ``HuggingFaceTokenizer.save_pretrained`` makes), or a
``GPT2BPETokenizer``'s ``vocab.json`` + ``merges.txt``. ``inspect`` lists them, ``validate``
takes them as they are, ``reshard`` and ``convert`` keep them (checked by the output's
manifest), ``convert --to hf`` puts an HF tokenizer beside ``config.json``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ckpt_tool.formats.save_dir import locate_source
from ckpt_tool.ops.convert import ConvertOptions, convert
from ckpt_tool.ops.inspect import inspect
from ckpt_tool.ops.reshard import ReshardRequest, reshard
from ckpt_tool.ops.validate import validate

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


def _hf_tokenizer(where: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "a": 1, "b": 2},
                                                           unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>") \
        .save_pretrained(str(where))


def _as_main_writes(tmp_path: Path, fixture: str, hf: bool = True) -> Path:
    save = tmp_path / "save"
    shutil.copytree(FIXTURES / fixture, save,
                    ignore=shutil.ignore_patterns("expected", "generate.py", "VERSIONS.txt"))
    it = next(save.glob("iter_*"))
    if hf:
        _hf_tokenizer(it / "tokenizer")
    else:  # GPT2BPETokenizer: its --vocab-file and --merge-file under fixed names
        (it / "tokenizer").mkdir()
        (it / "tokenizer" / "vocab.json").write_text('{"a": 0, "b": 1}')
        (it / "tokenizer" / "merges.txt").write_text("#version: 0.2\na b\n")
    return save


def _assets(checkpoint: Path) -> dict[str, bytes]:
    root = checkpoint / "tokenizer"
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))}


def test_inspect_lists_them_and_validate_takes_them_as_they_are(tmp_path):
    save = _as_main_writes(tmp_path, "mcore019_gpt_tp2dp2_distopt_buckets")
    listed = inspect(save).meta.extras["tokenizer_assets"]
    assert [a["name"] for a in listed] == sorted(_assets(next(save.glob("iter_*"))))
    result = validate(save)
    assert not result.findings, result.findings


@pytest.mark.parametrize("how", ["reshard", "convert"])
def test_reshard_and_convert_keep_them_under_the_manifest(tmp_path, how):
    save = _as_main_writes(tmp_path, "mcore019_gpt_tp2dp2_distopt_buckets")
    out = tmp_path / "out"
    if how == "reshard":
        notes = reshard(save, out, ReshardRequest(tp=1)).notes
    else:
        notes = convert(save, out, ConvertOptions(to="torch_dist")).notes
    assert any("carried the tokenizer/ assets" in n for n in notes), notes
    theirs, ours = next(save.glob("iter_*")), locate_source(out).checkpoint
    assert _assets(ours) == _assets(theirs)
    manifest = json.loads((ours / "integrity.json").read_text())
    for name, data in _assets(ours).items():
        assert manifest["sizes"][f"tokenizer/{name}"] == len(data)
    assert inspect(out).meta.extras["tokenizer_assets"]
    assert not validate(out).findings
    (ours / "tokenizer" / "tokenizer.json").write_text("{}")  # changed after it was written
    errors = [f for f in validate(out).findings if f.severity == "error"]
    assert errors and errors[0].file == "tokenizer/tokenizer.json", errors


def test_convert_to_hf_puts_an_hf_tokenizer_beside_config_json(tmp_path):
    transformers = pytest.importorskip("transformers")
    save = _as_main_writes(tmp_path, "mcore016_llama_tp2pp2_distopt")
    out = tmp_path / "hf"
    notes = convert(save, out, ConvertOptions(to="hf")).notes
    assert any("beside config.json" in n for n in notes), notes
    assert (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file()
    manifest = json.loads((out / "ckpt-manifest.json").read_text())
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(manifest["files"])
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok("a b")["input_ids"] == [1, 2]
    assert not validate(out).findings


def test_convert_to_hf_leaves_out_files_hf_would_not_load(tmp_path):
    save = _as_main_writes(tmp_path, "mcore016_llama_tp2pp2_distopt", hf=False)
    out = tmp_path / "hf"
    notes = convert(save, out, ConvertOptions(to="hf")).notes
    assert any("left out tokenizer/" in n and "not an HF tokenizer" in n for n in notes), notes
    assert not (out / "vocab.json").exists()
