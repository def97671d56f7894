"""Megatron-Bridge and NeMo 2 containers through ``reshard``/``convert``: the output keeps the
source's container with the framework's files beside the checkpoint, saying what the output
holds (Bridge: ``run_config.yaml`` with the new sizes and ``save_rng``/``save_optim``,
``train_state.pt`` and ``latest_train_state.pt``; NeMo: ``weights/`` + ``context/``, io.json's
strategy sizes), and a recipe in the framework's words (docs/resume.md). The fixtures were
written by the real Megatron-Core 0.16.1 in each framework's layout; the real Megatron-Core
resuming from these outputs: tests/interop/test_resume_distopt_without_args.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml
from typer.testing import CliRunner

from ckpt_tool.cli.app import app
from ckpt_tool.formats.base import open_checkpoint
from ckpt_tool.formats.save_dir import LATEST_FILE
from ckpt_tool.formats.containers.torch_zip.torch_zip_read import zip_records

runner = CliRunner()
FIX = Path(__file__).resolve().parents[2] / "fixtures"
BRIDGE = FIX / "mcore016_gpt_tp2dp2_distopt_bridge"
NEMO = (FIX / "nemo2_mcore016_gpt_tp2dp2_distopt" / "checkpoints"
        / "default--val_loss=0.00-step=1-consumed_samples=4.0-last")


def _run(*argv: object) -> object:
    return runner.invoke(app, [str(a) for a in argv])


def _ok(*argv: object) -> object:
    result = _run(*argv)
    assert result.exit_code == 0, result.output
    return result


def _refused(*argv: object, code: int = 2) -> str:
    result = _run(*argv)
    assert result.exit_code == code, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def _strategy_sizes(context: Path) -> dict[str, object]:
    graph = json.loads((context / "io.json").read_text())
    node = next(n for n in graph["objects"].values()
                if "<root>.trainer.strategy" in (n.get("paths") or []))
    names = next(i[1] for i in node["metadata"]["items"] if "argument_names" in i[0])
    assert [n for _i, n in names["items"]] == [i[0][len("Attr(name='"):-2] for i in node["items"]]
    return {i[0][len("Attr(name='"):-2]: i[1].get("value") for i in node["items"]
            if i[1].get("type") == "leaf"}


def test_a_bridge_save_directory_gives_one_with_bridges_files(tmp_path):
    out = tmp_path / "tp1"
    doc = json.loads(_ok("reshard", BRIDGE, out, "--tp", "1", "--json").stdout)
    it = out / "iter_0000010"
    assert sorted(p.name for p in out.iterdir()) == [
        "iter_0000010", LATEST_FILE, "latest_train_state.pt"]
    assert (out / LATEST_FILE).read_text() == "10"
    src_state = (BRIDGE / "iter_0000010" / "train_state.pt").read_bytes()
    assert (it / "train_state.pt").read_bytes() == src_state  # step, consumed samples
    assert (out / "latest_train_state.pt").read_bytes() == src_state  # Bridge's tracker
    src = yaml.safe_load((BRIDGE / "iter_0000010" / "run_config.yaml").read_text())
    new = yaml.safe_load((it / "run_config.yaml").read_text())
    assert (new["model"]["tensor_model_parallel_size"],
            new["model"]["expert_tensor_parallel_size"]) == (1, 1)
    assert new["checkpoint"]["save_rng"] is False  # the rng states of the old (pp, tp) dropped
    assert new["checkpoint"]["save_optim"] is True
    for section in ("model", "checkpoint"):  # nothing else changed
        for k in src[section]:
            if k not in ("tensor_model_parallel_size", "expert_tensor_parallel_size",
                         "save_rng"):
                assert new[section][k] == src[section][k], (section, k)
    assert {k: v for k, v in new.items() if k not in ("model", "checkpoint")} == \
        {k: v for k, v in src.items() if k not in ("model", "checkpoint")}
    common = open_checkpoint(it).common()
    assert "args" not in common  # Bridge reads run_config.yaml (args only without it)
    # the recipe speaks Bridge's configuration
    resume = doc["resume"]
    assert doc["container"]["framework"] == resume["framework"] == "megatron_bridge"
    assert resume["megatron_lm"] == []
    assert resume["overrides"] == [f"checkpoint.load={out}", "model.tensor_model_parallel_size=1",
                                   "model.pipeline_model_parallel_size=1"]
    assert any("save_rng: false" in n for n in resume["notes"])
    # and the resharded output is a Bridge save directory again
    again = json.loads(_ok("reshard", out, tmp_path / "tp2", "--tp", "2", "--json").stdout)
    assert again["container"]["framework"] == "megatron_bridge"
    assert yaml.safe_load((tmp_path / "tp2" / "iter_0000010" / "run_config.yaml").read_text()
                          )["model"]["tensor_model_parallel_size"] == 2


def test_a_bridge_iteration_directory_and_a_convert(tmp_path):
    doc = json.loads(_ok("reshard", BRIDGE / "iter_0000010", tmp_path / "it", "--tp", "1",
                         "--json").stdout)
    assert sorted(p.name for p in (tmp_path / "it").iterdir()) == ["iter_0000010"]
    assert (tmp_path / "it" / "iter_0000010" / "train_state.pt").is_file()
    assert doc["resume"]["overrides"][:2] == [f"checkpoint.load={tmp_path / 'it'}",
                                              "checkpoint.ckpt_step=10"]
    # convert keeps the layout: run_config.yaml as it was but for what the output holds
    doc = json.loads(_ok("convert", BRIDGE, tmp_path / "c", "--to", "torch_dist",
                         "--json").stdout)
    new = yaml.safe_load((tmp_path / "c" / "iter_0000010" / "run_config.yaml").read_text())
    assert new == yaml.safe_load((BRIDGE / "iter_0000010" / "run_config.yaml").read_text())
    assert doc["resume"]["overrides"] == [f"checkpoint.load={tmp_path / 'c'}"]
    # --drop-optimizer: Bridge is told by run_config.yaml
    _ok("reshard", BRIDGE, tmp_path / "noopt", "--tp", "1", "--drop-optimizer")
    new = yaml.safe_load((tmp_path / "noopt" / "iter_0000010" / "run_config.yaml").read_text())
    assert new["checkpoint"]["save_optim"] is False


def test_a_damaged_train_state_is_refused_before_anything_is_written(tmp_path):
    save = Path(shutil.copytree(BRIDGE, tmp_path / "save"))
    state = save / "iter_0000010" / "train_state.pt"
    data = bytearray(state.read_bytes())
    step = next(r for r in zip_records(bytes(data)) if r.name.endswith("/data/0"))
    data[step.start] ^= 0xFF  # the step's bytes, no longer what the zip's CRC says
    state.write_bytes(bytes(data))
    # exit 1, as for every CRC mismatch: the bytes are damaged, the file is readable
    line = _refused("reshard", save, tmp_path / "out", "--tp", "1", code=1)
    assert "train_state.pt" in line and "CRC-32" in line
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if "staging" in p.name]


def test_a_nemo_checkpoint_directory_gives_one(tmp_path):
    # inspect and validate read NeMo's checkpoint directory (its weights/)
    meta = open_checkpoint(NEMO).metadata()
    assert meta.extras["training_config"]["args"]["tensor_model_parallel_size"] == 2
    assert next(iter(meta.tensors)).startswith("module.")
    _ok("validate", NEMO)
    # its DDP buckets are nowhere in it: refused in one line, naming the flag
    assert "--ddp-bucket-size" in _refused("reshard", NEMO, tmp_path / "no", "--tp", "1")
    out = tmp_path / "tp1pp2"
    doc = json.loads(_ok("reshard", NEMO, out, "--tp", "1", "--pp", "2", "--ddp-bucket-size",
                         "0", "--json").stdout)
    assert sorted(p.name for p in out.iterdir()) == ["context", "weights"]
    assert (out / "weights" / "metadata.json").is_file()
    assert (out / "context" / "model.yaml").read_bytes() == \
        (NEMO / "context" / "model.yaml").read_bytes()
    assert _strategy_sizes(NEMO / "context")["tensor_model_parallel_size"] == 2
    sizes = _strategy_sizes(out / "context")
    assert (sizes["tensor_model_parallel_size"], sizes["pipeline_model_parallel_size"]) == (1, 2)
    common = open_checkpoint(out).common()
    src_common = open_checkpoint(NEMO).common()
    for key in ("loops", "global_step", "lr_schedulers", "MockDataModule", "callbacks"):
        assert repr(common[key]) == repr(src_common[key]), key  # Lightning's state, as it was
    assert "args" not in common
    assert isinstance(common["optimizer"], list)  # NeMo's list of one optimizer
    resume = doc["resume"]
    assert doc["container"] == {"kind": "nemo", "iteration_dir": None, "tracker": None,
                                "framework": "nemo2"}
    assert resume["framework"] == "nemo2" and resume["megatron_lm"] == []
    assert resume["overrides"] == [f"resume.resume_from_path={out}",
                                   "trainer.strategy.tensor_model_parallel_size=1",
                                   "trainer.strategy.pipeline_model_parallel_size=2"]
    assert resume["dist_checkpointing"].startswith(f"d = '{out / 'weights'}'")
    # its weights/ named directly: the same container; DST named weights/: refused
    again = json.loads(_ok("convert", NEMO / "weights", tmp_path / "c", "--to", "torch_dist",
                           "--json").stdout)
    assert again["container"]["kind"] == "nemo"
    assert (tmp_path / "c" / "context" / "io.json").read_bytes() == \
        (NEMO / "context" / "io.json").read_bytes()  # nothing to update
    (tmp_path / "x").mkdir()
    assert "weights/" in _refused("convert", NEMO, tmp_path / "x" / "weights", "--to",
                                  "torch_dist")
