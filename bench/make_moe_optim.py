"""Write a large MoE GPT checkpoint with optimizer state using the REAL Megatron-Core (CPU, gloo).

    CUDA_VISIBLE_DEVICES= torchrun --nproc-per-node 8 bench/make_moe_optim.py OUT \\
        --size-gb 20 [--tp 2] [--hidden 1024] [--experts 32] [--moe-ffn 128] ...

What a Megatron-LM job training a MoE GPT with ``--bf16 --use-distributed-optimizer
--dist-ckpt-optim-fully-reshardable`` saves (``iter_0000010/`` + tracker): bf16 weights and
the DistributedOptimizer's fp32 state (``param``, ``exp_avg``, ``exp_avg_sq``) in model space,
14 bytes per parameter, at TP=``--tp`` for the dense layers and EP = world size (ETP=1) for
the experts (every layer MoE, Mixtral's shape: router, ``--experts`` SequentialMLP experts of
SwiGLU width ``--moe-ffn``, top-2; GQA attention, RMSNorm, rope, untied embeddings, no bias).

How it reaches tens of GB on a small machine while staying the real stack:

* the model is Megatron-Core's ``GPTModel`` (local spec) built on the ``meta`` device: its
  real ``sharded_state_dict()`` gives every key, global shape, offset, replica id and the
  SwiGLU factories, without memory;
* the optimizer state is built as ``DistributedOptimizer.sharded_param_state_fully_reshardable``
  builds it: each model ``ShardedTensor``/factory ``replace``\\ d with the key
  ``optimizer.state.<state>.<key>``, fp32 data and the model's replica id; the dense and the
  expert optimizer as a ``ChainedOptimizer`` saves them (``{0: ..., 1: ...}``, no prefix:
  ``chained_optim_avoid_prefix``), ``param_groups`` in the common state;
* Megatron-Core's ``apply_factories`` turns the factories into ShardedTensors, then every
  tensor's data becomes a view of a random "pool" file (normal values, one per dtype) mapped
  read-only: the bytes are in the page cache, not in the process, and differ between tensors
  (each views the pool at an offset drawn from its key);
* ``megatron.core.dist_checkpointing.save`` (``torch_dist``, the default strategy) writes it,
  with Megatron-LM's common state (``args``, ``iteration``, ``content_metadata``, ...).

The layer count follows ``--size-gb`` (unless ``--layers``). Rank 0 prints the totals.
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "fixtures"))

POOL_BYTES = 512 << 20  # per dtype


def dims(a: argparse.Namespace) -> tuple[int, int, int]:
    """(parameters per layer, parameters outside the layers, layers)."""
    h, g, e = a.hidden, a.groups, a.experts
    kv = h // a.heads
    attn = h * (h + 2 * g * kv) + h * h + 2 * h  # qkv, proj, two layer norms
    moe = e * h + e * (2 * a.moe_ffn * h + h * a.moe_ffn)
    per_layer = attn + moe
    fixed = 2 * a.vocab * h + h
    layers = a.layers or max(1, round((a.size_gb * 1e9 / 14 - fixed) / per_layer))
    return per_layer, fixed, layers


def make_pool(path: str, dtype: str, seed: int) -> None:
    import numpy as np

    if os.path.exists(path) and os.path.getsize(path) == POOL_BYTES:
        return
    rng = np.random.default_rng(seed)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        left = POOL_BYTES
        while left:
            n = min(left, 64 << 20)
            v = (rng.standard_normal(n // 4, dtype=np.float32) * 0.02).astype(np.float32)
            if dtype == "bfloat16":  # the upper halves of float32 values: bfloat16 values
                raw = v.view(np.uint32) >> 16
                raw = raw.astype(np.uint16)
                raw = np.concatenate([raw, raw[::-1]])  # two bf16 per fp32 drawn
                f.write(raw.tobytes()[:n])
            else:
                f.write(v.tobytes())
            left -= n
    os.replace(tmp, path)


class Pool:
    """Read-only views of a pool file at offsets drawn from a name."""

    def __init__(self, path: str, dtype):
        self.fd = os.open(path, os.O_RDONLY)
        self.map = mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ)
        self.dtype = dtype

    def view(self, name: str, shape) -> object:
        import math
        import warnings

        import torch

        itemsize = torch.empty((), dtype=self.dtype).element_size()
        n = math.prod(shape)
        span = POOL_BYTES - n * itemsize
        if span < 0:
            raise SystemExit(f"{name}: {n * itemsize} bytes, more than the pool holds")
        offset = (zlib.crc32(name.encode()) * 4096) % (span + 1)
        offset -= offset % 64
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a read-only buffer: never written to
            return torch.frombuffer(self.map, dtype=self.dtype, count=n,
                                    offset=offset).view(*shape)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--size-gb", type=float, default=20.0)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--groups", type=int, default=4, help="query groups (GQA)")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--moe-ffn", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--pool-dir", default=os.path.join(HERE, "out", "pool"))
    a = ap.parse_args()

    import torch
    import torch.nn.functional as F

    import _mcore_cpu as H

    H.patch_cuda_for_cpu()
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    import dataclasses

    torch.distributed.init_process_group("gloo")
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    per_layer, fixed, layers = dims(a)
    ps.initialize_model_parallel(tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=1,
                                 expert_model_parallel_size=world, expert_tensor_parallel_size=1)
    os.makedirs(a.pool_dir, exist_ok=True)
    pools = {"bfloat16": os.path.join(a.pool_dir, "bf16.pool"),
             "float32": os.path.join(a.pool_dir, "fp32.pool")}
    if rank == 0:
        for n, (dt, path) in enumerate(pools.items()):
            make_pool(path, dt, 1234 + n)
    torch.distributed.barrier()
    pool = {torch.bfloat16: Pool(pools["bfloat16"], torch.bfloat16),
            torch.float32: Pool(pools["float32"], torch.float32)}

    config = TransformerConfig(
        num_layers=layers, hidden_size=a.hidden, num_attention_heads=a.heads,
        num_query_groups=a.groups, ffn_hidden_size=4 * a.hidden, gated_linear_unit=True,
        activation_func=F.silu, bias_activation_fusion=False, add_bias_linear=False,
        tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=1,
        expert_model_parallel_size=world, expert_tensor_parallel_size=1,
        num_moe_experts=a.experts, moe_router_topk=2, moe_ffn_hidden_size=a.moe_ffn,
        moe_grouped_gemm=False, normalization="RMSNorm",
        moe_token_dispatcher_type="allgather", use_cpu_initialization=True,
        perform_initialization=False, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, bf16=True, hidden_dropout=0.0, attention_dropout=0.0,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False)
    with torch.device("meta"):
        gpt = GPTModel(config=config,
                       transformer_layer_spec=get_gpt_layer_local_spec(
                           num_experts=a.experts, moe_grouped_gemm=False,
                           normalization="RMSNorm"),
                       vocab_size=a.vocab, max_sequence_length=H.SEQ, pre_process=True,
                       post_process=True, share_embeddings_and_output_weights=False,
                       position_embedding_type="rope")
    gpt = gpt.to(torch.bfloat16)  # Float16Module: every parameter bf16 (layer norms too)
    metadata = {"distrib_optim_sharding_type": "fully_reshardable",
                "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    model_sd = gpt.sharded_state_dict(metadata=dict(metadata))

    # the optimizer state as DistributedOptimizer.sharded_param_state_fully_reshardable
    # builds it from the model's sharded tensors (and factories)
    bases, _ = extract_sharded_tensors_and_factories(model_sd)
    chained: dict[int, dict] = {0: {}, 1: {}}
    for sh in nested_values(bases):
        expert = ".experts." in sh.key
        states = {}
        for state in ("param", "exp_avg", "exp_avg_sq"):
            kw = dict(key=f"optimizer.state.{state}.{sh.key}",
                      data=torch.empty(sh.data.shape, dtype=torch.float32, device="meta"),
                      dtype=torch.float32, replica_id=sh.replica_id)
            if not isinstance(sh, ShardedTensor):
                kw.pop("dtype")
            states[state] = dataclasses.replace(sh, **kw)
        part = chained[1 if expert else 0]
        part[len(part)] = states

    def param_groups(expert: bool) -> list[dict]:
        return [{"is_expert_parallel": expert, "default_config": True, "wd_mult": wd,
                 "lr_mult": 1.0, "is_decoupled_lr": False, "max_lr": 3e-4, "min_lr": 3e-5,
                 "lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
                 "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                 "differentiable": False, "fused": None, "decoupled_weight_decay": True,
                 "step": 10.0} for wd in (1.0, 0.0)]

    optimizer = {i: {"optimizer": {"param_groups": param_groups(i == 1)},
                     "param_state": chained[i], "param_state_sharding_type": "fully_reshardable"}
                 for i in (0, 1)}
    dp = world // a.tp
    args = H.megatron_args(
        a.tp, 1, dp, torch.bfloat16, use_distributed_optimizer=True, add_bias_linear=False,
        num_layers=layers, encoder_num_layers=layers, hidden_size=a.hidden,
        ffn_hidden_size=4 * a.hidden, num_attention_heads=a.heads, num_query_groups=a.groups,
        kv_channels=a.hidden // a.heads, vocab_size=a.vocab, padded_vocab_size=a.vocab,
        num_experts=a.experts, moe_router_topk=2, moe_ffn_hidden_size=a.moe_ffn,
        moe_grouped_gemm=False, moe_token_dispatcher_type="allgather",
        expert_model_parallel_size=world, expert_tensor_parallel_size=1,
        normalization="RMSNorm",
        dist_ckpt_optim_fully_reshardable=True)
    state_dict = H.megatron_state_dict(args, model_sd)
    state_dict["optimizer"] = optimizer
    state_dict["opt_param_scheduler"] = H.opt_param_scheduler_state(args.lr)
    apply_factories(state_dict)  # what save does first; then every tensor gets its data
    nbytes = 0
    for sh in nested_values(state_dict):
        if isinstance(sh, ShardedTensor):
            name = f"{sh.key}/{sh.global_offset}"
            sh.data = pool[sh.dtype].view(name, tuple(sh.local_shape))
            if sh.replica_id == 0 or all(r == 0 for r in sh.replica_id if isinstance(
                    sh.replica_id, tuple)):
                nbytes += sh.data.numel() * sh.data.element_size()
    total = torch.tensor([nbytes])
    torch.distributed.all_reduce(total)
    H.save_megatron_checkpoint(a.out, state_dict, get_default_save_sharded_strategy("torch_dist"),
                               content_metadata=metadata)
    if rank == 0:
        params = layers * per_layer + fixed
        print(f"wrote {a.out}: MoE GPT, {layers} layers, hidden {a.hidden}, {a.experts} experts "
              f"(ffn {a.moe_ffn}), vocab {a.vocab}, TP{a.tp} EP{world}; "
              f"{params / 1e9:.2f} B parameters; {int(total) / 1e9:.2f} GB of tensors "
              "(bf16 weights + fp32 param, exp_avg, exp_avg_sq)", file=sys.stderr)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
