"""Write a large DeepSeek-V3-shaped checkpoint with DistributedOptimizer state in Megatron-LM's
default ``dp_reshardable`` buckets, using the REAL Megatron-Core (CPU, gloo).

    CUDA_VISIBLE_DEVICES= torchrun --nproc-per-node 8 bench/make_deepseek_optim.py OUT \\
        [--moe-layers 6] [--hidden 1024] [--experts 64] [--moe-ffn 256] ...

What a Megatron-LM job training a DeepSeek-V3-shaped GPT with ``--bf16
--use-distributed-optimizer --overlap-grad-reduce`` saves by default (``iter_0000010/`` +
tracker): the model of ``fixtures/_mcore_mla.py`` at production-like widths (Multi-Latent
Attention with low-rank q/kv projections, a dense first layer, then MoE layers of ``--experts``
routed SwiGLU experts with a sigmoid, group-limited router and a gated shared expert, one
Multi-Token-Prediction layer, untied output), TP2 for the dense layers and EP = world size
(ETP1) for the experts; bf16 weights and the chained (dense + expert) DistributedOptimizer's
fp32 ``param``, ``exp_avg``, ``exp_avg_sq`` in its DDP buckets (default bucket size:
``max(40M, 1M x DP)`` elements), ``dp_reshardable``.

How it reaches several GB on a small machine while staying the real stack:

* the model is Megatron-Core's ``GPTModel`` built by ``_mcore_mla.build`` (its CPU stand-ins)
  on the ``meta`` device; ``Float16Module`` + ``DistributedDataParallel`` +
  ``get_megatron_optimizer`` (the real chained DistributedOptimizer) are built over it with
  their buffers on ``meta`` too (``torch.cuda.current_device()`` answers ``meta`` meanwhile),
  so the buckets, the parameters' ranges in them and the padding are Megatron-Core's own;
* the Adam state (``exp_avg``, ``exp_avg_sq``, ``step``) is set as one optimizer step leaves
  it, on ``meta``; the model's and the optimizer's real ``sharded_state_dict`` give every key,
  shape, offset and replica id;
* then every tensor's data becomes a read-only view of a "pool" file (normal values) in the
  page cache: each model parameter views the bf16 pool at an offset drawn from its TP1/EP1 name
  (and TP rank where split); its fp32 main parameter views the fp32 pool at the same element
  offset, and the fp32 pool holds exactly the bf16 pool's values (bf16 values widened), so the
  main parameter cast to bf16 equals the weight, as DistributedOptimizer keeps it after every
  step; ``exp_avg`` views other offsets, ``exp_avg_sq`` a pool of squares (never negative);
* ``megatron.core.dist_checkpointing.save`` (``torch_dist``) writes it, with Megatron-LM's
  common state (``args``, ``iteration``, ``content_metadata``, ...).

Rank 0 prints the totals.
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "fixtures"))

POOL_ELEMENTS = 96 << 20  # one pool of this many values, as bf16 and widened to fp32
ALIGN = 64  # elements


def make_pools(bf16_path: str, fp32_path: str, square_path: str, seed: int) -> None:
    """The bf16 pool (normal values * 0.02), the fp32 pool of the same values widened, and a
    pool of fp32 squares (``exp_avg_sq`` is never negative)."""
    import numpy as np

    paths = (bf16_path, fp32_path, square_path)
    if all(os.path.exists(p) for p in paths) and \
            os.path.getsize(square_path) == 4 * POOL_ELEMENTS:
        return
    rng = np.random.default_rng(seed)
    tmp = f".tmp{os.getpid()}"
    with open(bf16_path + tmp, "wb") as fb, open(fp32_path + tmp, "wb") as ff, \
            open(square_path + tmp, "wb") as fs:
        left = POOL_ELEMENTS
        while left:
            n = min(left, 16 << 20)
            v = (rng.standard_normal(n, dtype=np.float32) * 0.02).astype(np.float32)
            upper = (v.view(np.uint32) >> 16).astype(np.uint16)  # bf16 (truncated)
            fb.write(upper.tobytes())
            ff.write((upper.astype(np.uint32) << 16).tobytes())  # the same value in fp32
            fs.write((v * v * 0.01).astype(np.float32).tobytes())
            left -= n
    for p in paths:
        os.replace(p + tmp, p)


class Pool:
    """Read-only views of a pool file of ``POOL_ELEMENTS`` values."""

    def __init__(self, path: str, dtype):
        self.fd = os.open(path, os.O_RDONLY)
        self.map = mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ)
        self.dtype = dtype

    def view(self, start: int, shape) -> object:
        import math
        import warnings

        import torch

        n = math.prod(shape)
        if start + n > POOL_ELEMENTS:
            raise SystemExit(f"{n} values at {start}: beyond the pool")
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a read-only buffer: never written to
            return torch.frombuffer(self.map, dtype=self.dtype, count=n,
                                    offset=start * itemsize).view(*shape)


def offset(name: str, numel: int) -> int:
    """An element offset of the pool drawn from ``name``, room for ``numel`` values."""
    span = POOL_ELEMENTS - numel
    if span < 0:
        raise SystemExit(f"{name}: {numel} values, more than the pool holds")
    return ((zlib.crc32(name.encode()) * 7919) % (span // ALIGN + 1)) * ALIGN


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--moe-layers", type=int, default=6, help="MoE layers after the dense one")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--ffn", type=int, default=3072, help="the dense layer's SwiGLU width")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--moe-ffn", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--pool-dir", default=os.path.join(HERE, "out", "pool"))
    a = ap.parse_args()

    import torch

    import _mcore_cpu as H

    H.patch_cuda_for_cpu()
    import _mcore_mla as D
    import _mcore_resume as R
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    torch.distributed.init_process_group("gloo")
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    ps.initialize_model_parallel(tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=1,
                                 expert_model_parallel_size=world, expert_tensor_parallel_size=1)
    os.makedirs(a.pool_dir, exist_ok=True)
    paths = (os.path.join(a.pool_dir, "paired_bf16.pool"),
             os.path.join(a.pool_dir, "paired_fp32.pool"),
             os.path.join(a.pool_dir, "square_fp32.pool"))
    if rank == 0:
        make_pools(*paths, seed=4321)
    torch.distributed.barrier()
    bf16_pool, fp32_pool = Pool(paths[0], torch.bfloat16), Pool(paths[1], torch.float32)
    pools = {"param": fp32_pool, "exp_avg": fp32_pool, "exp_avg_sq": Pool(paths[2], torch.float32)}

    layers = 1 + a.moe_layers
    heads, q_lora, kv_lora, qk_head, qk_pos, v_head = a.heads, 384, 256, 64, 32, 64
    groups, group_topk, topk = 8, 4, 8
    shape = dict(num_layers=layers, hidden_size=a.hidden, num_attention_heads=heads,
                 ffn_hidden_size=a.ffn, q_lora_rank=q_lora, kv_lora_rank=kv_lora,
                 qk_head_dim=qk_head, qk_pos_emb_head_dim=qk_pos, v_head_dim=v_head,
                 num_moe_experts=a.experts, moe_layer_freq=[0] + [1] * a.moe_layers,
                 moe_ffn_hidden_size=a.moe_ffn, moe_shared_expert_intermediate_size=a.moe_ffn,
                 moe_router_topk=topk, moe_router_num_groups=groups,
                 moe_router_group_topk=group_topk, perform_initialization=False)
    with torch.device("meta"):
        gpt = D.build(a.tp, 1, world, torch.bfloat16, vocab=a.vocab, seq=4096, **shape)
    tp_rank = ps.get_tensor_model_parallel_rank()
    names = {}  # param -> the name its pool offset is drawn from (equal on replicas)
    for n, p in gpt.named_parameters():
        split = bool(getattr(p, "tensor_model_parallel", False))
        names[p] = D.global_name(gpt, n) + (f"@tp{tp_rank}" if split else "")

    # the real DDP and chained DistributedOptimizer, their buffers on meta
    current = torch.cuda.current_device
    torch.cuda.current_device = lambda: "meta"
    try:
        with H.optimizer_on_cpu():
            cpu_type = torch.Tensor.type  # torch.cuda.* names (optimizer_on_cpu) of meta too

            def meta_type(self, *args, **kwargs):
                t = cpu_type(self, *args, **kwargs)
                return t.replace("torch.cuda.meta.", "torch.cuda.") if isinstance(t, str) else t

            torch.Tensor.type = meta_type
            model = Float16Module(gpt.config, gpt)
            ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=True,
                use_distributed_optimizer=True, check_for_nan_in_grad=False)
            model = DistributedDataParallel(gpt.config, ddp_config, model)
            opt_config = OptimizerConfig(
                optimizer="adam", lr=3.0e-4, min_lr=3.0e-5, weight_decay=0.1, adam_beta1=0.9,
                adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0, bf16=True,
                params_dtype=torch.bfloat16, use_distributed_optimizer=True)
            optimizer = get_megatron_optimizer(opt_config, [model])
            torch.Tensor.type = cpu_type
    finally:
        torch.cuda.current_device = current
    for o in optimizer.chained_optimizers:  # the Adam state one step leaves
        for group in o.optimizer.param_groups:
            for main in group["params"]:
                o.optimizer.state[main] = {"step": torch.tensor(10.0),
                                           "exp_avg": torch.empty_like(main),
                                           "exp_avg_sq": torch.empty_like(main)}

    # the weights: every parameter replaced by a view of the bf16 pool
    for module in gpt.modules():
        for n, p in list(module._parameters.items()):
            if p is None:
                continue
            view = bf16_pool.view(offset(names[p], p.numel()), tuple(p.shape))
            new = torch.nn.Parameter(view, requires_grad=False)
            new.__dict__.update(p.__dict__)
            module._parameters[n] = new

    metadata = dict(R.MEGATRON_LM_METADATA)  # dp_reshardable, as Megatron-LM 0.16 saves
    model_sd = gpt.sharded_state_dict(metadata=dict(metadata))
    with H.optimizer_on_cpu():
        optim_sd = optimizer.sharded_state_dict(model_sd, is_loading=False,
                                                metadata=dict(metadata))

    # the optimizer state: main params at their weights' offsets (cast to bf16: the weights)
    for i, o in enumerate(optimizer.chained_optimizers):
        param_state = optim_sd[i]["param_state"] if len(optimizer.chained_optimizers) > 1 \
            else optim_sd["param_state"]
        for gbuf_idx, gbuf_range_maps in enumerate(o.gbuf_ranges):
            for dtype, bucket_maps in gbuf_range_maps.items():
                for b, bucket_map in enumerate(bucket_maps):
                    entries = param_state[gbuf_idx][dtype][b]
                    params = iter(bucket_map["param_map"].items())
                    for entry in entries:
                        if getattr(entry["padding"], "obj", entry["padding"]):
                            for k in ("param", "exp_avg", "exp_avg_sq"):
                                entry[k].data = pools[k].view(0, tuple(entry[k].local_shape))
                            continue
                        p, ranges = next(params)
                        r = ranges["param"]
                        base = offset(names[p], p.numel())
                        entry["param"].data = fp32_pool.view(base + r.start, (r.size,))
                        for k in ("exp_avg", "exp_avg_sq"):
                            entry[k].data = pools[k].view(
                                offset(f"{names[p]}/{k}", p.numel()) + r.start, (r.size,))
                    assert next(params, None) is None

    dp = ps.get_data_parallel_world_size()
    args = D.args(a.tp, 1, dp, world, torch.bfloat16, use_distributed_optimizer=True,
                  overlap_grad_reduce=True, ddp_bucket_size=None,
                  ddp_pad_buckets_for_high_nccl_busbw=False,
                  num_layers=layers, encoder_num_layers=layers, hidden_size=a.hidden,
                  ffn_hidden_size=a.ffn, num_attention_heads=heads, num_query_groups=heads,
                  kv_channels=a.hidden // heads, seq_length=4096, max_position_embeddings=4096,
                  vocab_size=a.vocab, padded_vocab_size=a.vocab, q_lora_rank=q_lora,
                  kv_lora_rank=kv_lora, qk_head_dim=qk_head, qk_pos_emb_head_dim=qk_pos,
                  v_head_dim=v_head, num_experts=a.experts,
                  moe_layer_freq=[0] + [1] * a.moe_layers, moe_ffn_hidden_size=a.moe_ffn,
                  moe_shared_expert_intermediate_size=a.moe_ffn, moe_router_topk=topk,
                  moe_router_num_groups=groups, moe_router_group_topk=group_topk)
    state_dict = H.megatron_state_dict(args, model_sd)
    state_dict["optimizer"] = optim_sd
    state_dict["opt_param_scheduler"] = H.opt_param_scheduler_state(args.lr)
    apply_factories(state_dict)
    nbytes = 0
    for sh in nested_values(state_dict):
        if not isinstance(sh, ShardedTensor):
            continue
        if sh.data.device.type == "meta":  # buffers (the routers' expert bias)
            sh.data = (fp32_pool if sh.dtype == torch.float32 else bf16_pool).view(
                offset(f"{sh.key}/{sh.global_offset}", sh.data.numel()), tuple(sh.local_shape))
        replica = sh.replica_id if isinstance(sh.replica_id, tuple) else (sh.replica_id,)
        if all(r == 0 for r in replica):
            nbytes += sh.data.numel() * sh.data.element_size()
    total = torch.tensor([nbytes])
    torch.distributed.all_reduce(total)
    H.save_megatron_checkpoint(a.out, state_dict, get_default_save_sharded_strategy("torch_dist"),
                               content_metadata=metadata)
    if rank == 0:
        print(f"wrote {a.out}: DeepSeek-V3-shaped GPT (MLA, 1 dense + {a.moe_layers} MoE layers, "
              f"{a.experts} experts of width {a.moe_ffn}, shared expert, 1 MTP layer), hidden "
              f"{a.hidden}, vocab {a.vocab}, TP{a.tp} EP{world} DP{dp}; "
              f"{int(total) / 1e9:.2f} GB of tensors (bf16 weights + fp32 param, exp_avg, "
              "exp_avg_sq in dp_reshardable buckets)", file=sys.stderr)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
