"""The training configuration frameworks keep beside a dist checkpoint without Megatron-LM
``args``: Megatron-Bridge's ``run_config.yaml`` (the fixture's, written in Bridge 0.3.1's layout
from the real Megatron-Core config objects of the run) and NeMo 2's ``context/``."""

from __future__ import annotations

import json
from pathlib import Path

from ckpt_tool.formats.base import open_checkpoint
from ckpt_tool.formats.mcore_dist.training_config import (bridge_run_config_for,
                                                          from_nemo_context, nemo_io_for,
                                                          training_config)

FIX = Path(__file__).resolve().parents[2] / "fixtures"


def test_megatron_bridge_run_config_gives_the_layout_and_the_ddp_buckets():
    meta = open_checkpoint(FIX / "mcore016_gpt_tp2dp2_distopt_bridge").metadata()
    assert "args" not in meta.common
    found = meta.extras["training_config"]
    assert found["source"] == "Megatron-Bridge run_config.yaml"
    args = found["args"]
    assert {k: args[k] for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                 "num_layers", "hidden_size", "transformer_impl",
                                 "untie_embeddings_and_output_weights", "overlap_grad_reduce",
                                 "ddp_bucket_size", "ddp_pad_buckets_for_high_nccl_busbw")} == {
        "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1, "num_layers": 2,
        "hidden_size": 48, "transformer_impl": "local",
        "untie_embeddings_and_output_weights": True, "overlap_grad_reduce": True,
        "ddp_bucket_size": 6000, "ddp_pad_buckets_for_high_nccl_busbw": False}
    assert "data_parallel_size" not in args  # Bridge does not save it


def test_a_checkpoint_without_configuration_has_none():
    meta = open_checkpoint(FIX / "mcore016_gpt_tp2dp2_distopt_noargs" / "dp_reshardable"
                           ).metadata()
    assert "training_config" not in meta.extras and "args" not in meta.common


def test_nemo2_context_beside_the_weights(tmp_path):
    """NeMo 2: ``<ckpt>/weights`` holds the dist checkpoint, ``<ckpt>/context`` the model config
    with its defaults (``model.yaml``, under ``config``) and the trainer's construction
    arguments (``io.json``, a fiddle graph whose leaves carry their paths). Written here in
    those shapes (NeMo is not installed)."""
    weights, context = tmp_path / "weights", tmp_path / "context"
    weights.mkdir()
    context.mkdir()
    (context / "model.yaml").write_text(
        "_target_: nemo.collections.llm.gpt.model.llama.LlamaModel\n"
        "config:\n  _target_: nemo.collections.llm.gpt.model.llama.Llama32Config1B\n"
        "  num_layers: 16\n  hidden_size: 2048\n  share_embeddings_and_output_weights: true\n"
        "  transformer_layer_spec:\n"
        "    _target_: nemo.collections.llm.gpt.model.base.default_layer_spec\n"
        "    _call_: false\n")
    leaf = {"type": "leaf", "value": 4, "paths": ["<root>.trainer.strategy.tensor_model_parallel_size"]}
    ddp = {"type": "leaf", "value": 5000, "paths": ["<root>.trainer.strategy.ddp.bucket_size"]}
    (context / "io.json").write_text(json.dumps({"objects": {"strategy_1": {"items": [
        ["Attr(name='tensor_model_parallel_size')", leaf], ["Attr(name='ddp')", ddp]]}}}))
    found = training_config(weights)
    assert found["source"] == "NeMo context/model.yaml and io.json"
    assert found["args"] == {"num_layers": 16, "hidden_size": 2048,
                             "untie_embeddings_and_output_weights": False,
                             "transformer_impl": "transformer_engine",
                             "tensor_model_parallel_size": 4}  # no DDP settings taken
    assert training_config(tmp_path) is None


def test_the_bridge_run_config_of_an_output_says_its_sizes_and_what_it_holds():
    config = {"model": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
                        "expert_tensor_parallel_size": 2, "hidden_size": 48},
              "checkpoint": {"save_rng": True, "save_optim": True}, "ddp": {"bucket_size": 6000}}
    layout = {"tp": 1, "pp": 2, "ep": 1, "etp": 1, "vpp": None, "first_stage_layers": None,
              "last_stage_layers": None}
    new, changed = bridge_run_config_for(config, layout, has_rng=False, has_optimizer=True)
    assert new["model"] == {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2,
                            "expert_tensor_parallel_size": 1, "hidden_size": 48}
    assert new["checkpoint"] == {"save_rng": False, "save_optim": True}
    assert new["ddp"] == config["ddp"] and config["model"]["tensor_model_parallel_size"] == 2
    assert changed == ["model.tensor_model_parallel_size=1",
                       "model.pipeline_model_parallel_size=2",
                       "model.expert_tensor_parallel_size=1", "checkpoint.save_rng=False"]
    # fields the file does not hold stay out; no layout: only what the output holds
    assert bridge_run_config_for(config, None, True, False)[1] == ["checkpoint.save_optim=False"]


def test_the_nemo_context_of_an_output_gives_the_strategy_its_sizes():
    graph = json.loads((FIX / "nemo2_mcore016_gpt_tp2dp2_distopt" / "checkpoints"
                        / "default--val_loss=0.00-step=1-consumed_samples=4.0-last" / "context"
                        / "io.json").read_text())
    layout = {"tp": 2, "pp": 1, "ep": 1, "etp": 2, "vpp": None, "first_stage_layers": None,
              "last_stage_layers": None}
    assert nemo_io_for(graph, layout) == (graph, [])  # the sizes it has: nothing to do
    new, changed = nemo_io_for(graph, {**layout, "tp": 1, "etp": 1, "pp": 2, "vpp": 2})
    assert changed == ["trainer.strategy.tensor_model_parallel_size=1",
                       "trainer.strategy.pipeline_model_parallel_size=2",
                       "trainer.strategy.virtual_pipeline_model_parallel_size=2"]
    args = from_nemo_context({}, new)
    assert (args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"],
            args["virtual_pipeline_model_parallel_size"]) == (1, 2, 2)
    assert from_nemo_context({}, graph)["tensor_model_parallel_size"] == 2  # a copy changed
    assert nemo_io_for({"objects": {}}, layout) == ({"objects": {}}, [])  # no strategy
