"""torchrun worker: the REAL Megatron-Core GPTModel (local spec, CPU, gloo) for the HF tests.

    torchrun --nproc-per-node N _hf_logits_worker.py SPEC.json

SPEC (written by tests/interop/test_hf_interop.py and test_hf_logits.py) is one job, run at
TP = N, or ``{"jobs": [job, ...]}``, run one after the other in the same processes, each at its
own ``tp`` and ``pp`` (the ranks left over are data-parallel replicas). A job: the model
(``layers``, ``hidden``, ``heads``, ``groups``, ``head_dim``, ``ffn``, ``padded_vocab``,
``vocab``, ``seq``, ``eps``, ``theta``, ``tied``, ``qkv_bias``, ``qk_norm``, ``dtype``, ``arch``;
MoE: ``experts``, ``topk``, ``moe_ffn``, ``shared_ffn``, ``pre_softmax``), ``tokens`` (a batch
of token ids), ``mode`` and ``ckpt``, ``out``:

* ``save``: fill the parameters with seeded values, save a Megatron-LM-shaped state dict
  (``args``, ``iteration``, ``model``) with ``dist_checkpointing.save`` into ``ckpt``;
* ``load``: set every parameter to NaN, load ``ckpt`` as Megatron-LM does: each stage's
  model's complete sharded state dict (its ``_extra_state`` objects included) with
  ``dist_checkpointing.load`` at Megatron-LM's default strictness (``assume_ok_unexpected``:
  every key the model asks for must be in the checkpoint), then
  ``load_state_dict(strict=True)``; fail if any parameter was not loaded;
* ``legacy``: load this rank's Megatron-LM legacy file from ``ckpt`` with
  ``load_state_dict(strict=True)``.

``spec`` ``"te"`` builds the layers from Megatron-Core's Transformer-Engine layer spec over
local stand-in modules (``_te_standin.py``: TE's fused norm names and extra state, no TE
needed), with the final norm a ``TENorm`` stand-in as where TE is installed; otherwise the
local spec, and with ``te_installed`` its final norm that same ``TENorm`` stand-in (what a
local-spec model gets on a machine with Transformer Engine).

Then the logits for ``tokens`` (the first ``vocab`` columns): with ``pp`` > 1 each stage's
GPTModel (``pre_process`` on the first, ``post_process`` on the last) runs its layers and
sends its hidden states to the next stage (``set_input_tensor``, as Megatron's pipeline
schedule does, by plain send/recv over gloo). The first rank of the last stage writes them to
``out``.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "fixtures"))


def moe_config(spec: dict) -> dict:
    """MoE settings (dropless, SequentialMLP) when the spec has ``experts``."""
    if not spec.get("experts"):
        return {}
    shared = spec.get("shared_ffn")
    return dict(num_moe_experts=spec["experts"], moe_router_topk=spec["topk"],
                moe_ffn_hidden_size=spec["moe_ffn"], moe_router_pre_softmax=spec["pre_softmax"],
                moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=bool(shared),
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                moe_token_dispatcher_type="allgather", moe_grouped_gemm=False)


def build(spec: dict, tp: int, pp: int):
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    if spec.get("window"):  # megatron-core 0.16.1 builds the sliding-window mask on "cuda":
        # its own triu/tril run on the CPU (only torch.ones, in that module, drops the device)
        import types

        from megatron.core.transformer import utils as mcore_utils

        def ones(*a, device=None, **k):
            return torch.ones(*a, **k)

        cpu_torch = types.ModuleType("torch")
        cpu_torch.__dict__.update(vars(torch), ones=ones)
        mcore_utils.torch = cpu_torch
    if spec.get("experts"):  # megatron-core 0.16.1 names te_general_gemm only when TE imports
        import importlib

        for name in ("moe_utils", "router"):
            mod = importlib.import_module(f"megatron.core.transformer.moe.{name}")
            if not hasattr(mod, "te_general_gemm"):
                mod.te_general_gemm = None
    dtype = getattr(torch, spec["dtype"])
    gpt2 = spec.get("arch") == "gpt2"  # LayerNorm, biases, exact GELU, learned positions
    norm = "LayerNorm" if gpt2 else "RMSNorm"
    config = TransformerConfig(
        num_layers=spec["layers"], hidden_size=spec["hidden"],
        num_attention_heads=spec["heads"], num_query_groups=spec["groups"],
        kv_channels=spec.get("head_dim") or spec["hidden"] // spec["heads"],
        ffn_hidden_size=spec["ffn"], gated_linear_unit=not gpt2,
        activation_func=F.gelu if gpt2 else F.silu,
        add_bias_linear=gpt2, add_qkv_bias=spec["qkv_bias"], qk_layernorm=spec["qk_norm"],
        normalization=norm, layernorm_epsilon=spec["eps"],
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        use_cpu_initialization=True, params_dtype=dtype,
        pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, hidden_dropout=0.0,
        attention_dropout=0.0, masked_softmax_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        window_size=tuple(spec["window"]) if spec.get("window") else None, **moe_config(spec))
    if spec.get("spec") == "te":  # the real TE spec's layout over local stand-in modules
        from _te_standin import te_layer_spec

        layer_spec = te_layer_spec(spec.get("experts"), spec["qk_norm"])
    else:
        layer_spec = get_gpt_layer_local_spec(num_experts=spec.get("experts"),
                                              normalization=norm, qk_layernorm=spec["qk_norm"])
    import contextlib

    from _te_standin import te_installed

    cuda = torch.Tensor.cuda
    # tied embeddings across pipeline stages: GPTModel all-reduces the output layer's copy of
    # the embedding between the first and last stage after moving it to .cuda()
    torch.Tensor.cuda = lambda self, *a, **k: self
    with_te = spec.get("spec") == "te" or spec.get("te_installed")
    try:
        with te_installed() if with_te else contextlib.nullcontext():
            return _gpt(GPTModel, config, layer_spec, spec, gpt2)
    finally:
        torch.Tensor.cuda = cuda


def _gpt(GPTModel, config, layer_spec, spec: dict, gpt2: bool):
    from megatron.core import parallel_state

    return GPTModel(config=config, transformer_layer_spec=layer_spec,
                    vocab_size=spec["padded_vocab"], max_sequence_length=spec["seq"],
                    parallel_output=False,
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage(),
                    position_embedding_type="learned_absolute" if gpt2 else "rope",
                    rotary_base=spec["theta"],
                    share_embeddings_and_output_weights=spec["tied"])


def save(model, spec: dict, tp: int, pp: int) -> None:
    import torch

    import _mcore_cpu as H
    from megatron.core import dist_checkpointing

    H.fill_deterministic(model, seed=spec.get("seed", 0))
    if spec["tied"] and pp > 1:  # one embedding: the last stage's copy is the first's, as
        from megatron.core import parallel_state as ps  # GPTModel's setup all-reduce makes it

        weight = model.shared_embedding_or_output_weight()
        with torch.no_grad():
            if not ps.is_pipeline_first_stage():
                weight.zero_()
            torch.distributed.all_reduce(weight.data, group=ps.get_embedding_group())
    extra = {}
    if spec.get("experts"):
        extra = dict(num_experts=spec["experts"], moe_router_topk=spec["topk"],
                     moe_ffn_hidden_size=spec["moe_ffn"],
                     moe_shared_expert_intermediate_size=spec.get("shared_ffn"),
                     moe_router_pre_softmax=spec["pre_softmax"], moe_grouped_gemm=False)
    if spec.get("arch") == "gpt2":  # LayerNorm, biases, exact GELU, learned positions
        extra = dict(normalization="LayerNorm", add_bias_linear=True, swiglu=False,
                     position_embedding_type="learned_absolute", openai_gelu=False,
                     use_rotary_position_embeddings=False)
    world = torch.distributed.get_world_size()
    args = H.megatron_args(
        tp, pp, world // (tp * pp), getattr(torch, spec["dtype"]), num_layers=spec["layers"],
        hidden_size=spec["hidden"], ffn_hidden_size=spec["ffn"],
        num_attention_heads=spec["heads"], num_query_groups=spec["groups"],
        kv_channels=spec.get("head_dim") or spec["hidden"] // spec["heads"],
        seq_length=spec["seq"], max_position_embeddings=spec["seq"],
        rotary_base=spec["theta"], norm_epsilon=spec["eps"], add_qkv_bias=spec["qkv_bias"],
        qk_layernorm=spec["qk_norm"], untie_embeddings_and_output_weights=not spec["tied"],
        vocab_size=spec["vocab"], padded_vocab_size=spec["padded_vocab"],
        make_vocab_size_divisible_by=64, **{"normalization": "RMSNorm",
                                            "add_bias_linear": False, **extra},
        transformer_impl="transformer_engine" if spec.get("spec") == "te" else "local")
    state = {"args": args, "checkpoint_version": 3.0, "iteration": 10,
             "model": model.sharded_state_dict()}
    if torch.distributed.get_rank() == 0:
        os.makedirs(spec["ckpt"], exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(state, spec["ckpt"])


def load(model, spec: dict) -> None:
    import torch

    from megatron.core import dist_checkpointing

    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, spec["ckpt"],
                                     strict="assume_ok_unexpected")
    model.load_state_dict(loaded["model"], strict=True)
    bad = [n for n, p in model.named_parameters() if torch.isnan(p).any()]
    if bad:
        raise RuntimeError(f"{spec.get('name', spec['ckpt'])}: not loaded: {bad}")


def load_legacy(model, spec: dict) -> None:
    """Megatron-LM's legacy load: this rank's ``mp_rank_TT[_PPP]/model_optim_rng.pt`` (under
    the iteration the tracker file names), its ``model`` state dict loaded with
    ``load_state_dict(strict=True)``: every key the model has, no key it lacks."""
    import torch

    from megatron.core import parallel_state as ps

    root = spec["ckpt"]
    tracker = open(os.path.join(root, "latest_checkpointed_iteration.txt")).read().strip()
    it_dir = "release" if tracker == "release" else f"iter_{int(tracker):07d}"
    tp, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    rank = f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if ps.get_pipeline_model_parallel_world_size()
                                  > 1 else "")
    state = torch.load(os.path.join(root, it_dir, rank, "model_optim_rng.pt"),
                       map_location="cpu", weights_only=False)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    model.load_state_dict(state["model"], strict=True)


def forward(model, spec: dict):
    """The logits on the last stage (None elsewhere); stages chained by send/recv."""
    import torch

    from megatron.core import parallel_state as ps

    tokens = torch.tensor(spec["tokens"], dtype=torch.long)
    b, s = tokens.shape
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    position_ids = torch.arange(s).unsqueeze(0).expand_as(tokens)
    model.eval()
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            hidden = torch.empty(s, b, spec["hidden"], dtype=getattr(torch, spec["dtype"]))
            torch.distributed.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(tokens, position_ids, mask)
        if not ps.is_pipeline_last_stage():
            torch.distributed.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return None
    return out


def run_job(spec: dict, tp: int, pp: int) -> None:
    import torch

    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    model = build(spec, tp, pp)
    if spec["mode"] == "save":
        save(model, spec, tp, pp)
    elif spec["mode"] == "legacy":
        load_legacy(model, spec)
    else:
        load(model, spec)
    logits = forward(model, spec)
    first = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    if logits is not None and first:
        torch.save(logits[..., : spec["vocab"]].float().clone(), spec["out"])
    torch.distributed.barrier()


def main() -> int:
    import torch

    import _mcore_cpu as H

    spec = json.loads(open(sys.argv[1]).read())
    world = int(os.environ["WORLD_SIZE"])
    jobs = spec["jobs"] if "jobs" in spec else [dict(spec, tp=world, pp=1)]
    H.patch_cuda_for_cpu()
    torch.distributed.init_process_group(backend="gloo")
    for job in jobs:
        run_job(job, job.get("tp", 1), job.get("pp", 1))
        if torch.distributed.get_rank() == 0:
            print("done:", job.get("name", job["ckpt"]), flush=True)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
