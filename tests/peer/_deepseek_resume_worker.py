"""torchrun worker: Megatron-LM's own training code (tag core_v0.16.1) resumes the
DeepSeek-V3-shaped checkpoint (``fixtures/mcore016_deepseek_tp2ep2_distopt``, or what
``ckpt reshard`` made of it) on CPU/gloo, with the real ``megatron.core.dist_checkpointing``::

    CKPT_PEER_IMPL=real torchrun --nproc-per-node N _deepseek_resume_worker.py \\
        --megatron-args '["--load", "DIR", "--tensor-model-parallel-size", "1", ...]' [--step]

``initialize_megatron`` parses :func:`megatron_argv` (the model and training flags the
fixture's stored ``args`` hold, under Megatron-LM's own names) plus ``--megatron-args`` (a
resume recipe's flags); ``setup_model_and_optimizer`` builds ``DDP(Float16Module(GPTModel))``
and the chained DistributedOptimizer (dense + expert) with :func:`model_provider`, and
``load_checkpoint`` loads what ``--load`` names at Megatron-LM's default strictness. Then, on
every rank: the iteration is the fixture's (10); every bf16 parameter equals the fixture's
expected fp32 main parameter rounded to bf16; every fp32 main param, ``exp_avg`` and
``exp_avg_sq`` slice the optimizers hold (each chained optimizer's own ``gbuf_ranges``) is
bit-identical to ``expected/optim.safetensors``; the routers' ``expert_bias`` buffers equal
``expected/buffers.safetensors``. ``--step`` then takes one ``megatron.training.training
.train_step`` (LM + MTP + aux loss, ``finalize_model_grads``: gradient sync and the routers'
expert-bias update) and checks its loss and gradient norm are finite. Prints ``rank R: OK ...``.

The model provider is ``gpt_builders.gpt_builder``'s path for ``--num-experts`` with
``--transformer-impl local`` and ``--mtp-num-layers`` (the decoder block spec, the MTP block
spec from the last layer's spec), with the CPU stand-ins of ``fixtures/_mcore_mla.py``
substituted in the specs, each named there: ``MLADotProductAttention`` for the local core
attention, which in 0.16.1 does not take MLA's k/v channels (Megatron-LM issue 1589, pull
request 6564), ``SequenceParallelRMSNorm`` for Transformer Engine's ``TENorm`` (the local
``WrappedTorchNorm`` refuses sequence parallelism, which MoE with TP > 1 requires), and the
``HAVE_TE``/``te_general_gemm`` flags of a machine without Transformer Engine.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys

# The fixture's stored args hold a numpy float (init_method_std), as real Megatron-LM args
# can; Megatron-Core 0.16.1 reads common.pt with torch.load's default, which on torch >= 2.6
# refuses numpy scalars: a Megatron-LM 0.16 job on such a torch runs with this set
# (docs/library.md)
os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
FIXTURE = os.path.join(REPO, "fixtures", "mcore016_deepseek_tp2ep2_distopt")
SEED = 4321  # not the fixture's: every value checked must come from the checkpoint
ITERATION = 10


def megatron_argv(extra: list[str]) -> list[str]:
    """``pretrain_gpt.py``'s command line for the fixture's model: its stored ``args`` as
    Megatron-LM flags (architecture; optimizer and scheduler, which ``load_checkpoint`` checks
    the stored scheduler against), the CPU/gloo run's flags, then ``extra``. The scheduler's
    flags are those its stored state was made with (``OptimizerParamScheduler.load_state_dict``
    asserts each equal): global batch 2 (its step counts are per sample: warmup 2 and decay 100
    iterations of 2), minimum learning rate ``lr / 10`` as computed (the stored args round it
    to 3e-5)."""
    model = [
        "--num-layers", "3", "--hidden-size", "64", "--ffn-hidden-size", "64",
        "--num-attention-heads", "4", "--kv-channels", "16", "--seq-length", "16",
        "--max-position-embeddings", "16", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
        "--position-embedding-type", "rope", "--rotary-base", "10000", "--disable-bias-linear",
        "--qk-layernorm", "--swiglu", "--untie-embeddings-and-output-weights",
        # Multi-Latent Attention
        "--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "32",
        "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16",
        "--rope-type", "rope", "--rotary-scaling-factor", "1.0", "--mscale", "1.0",
        "--mscale-all-dim", "0.0",
        # mixture of experts: a dense first layer, then MoE layers
        "--num-experts", "4", "--moe-layer-freq", "[0,1,1]", "--moe-ffn-hidden-size", "16",
        "--moe-shared-expert-intermediate-size", "16", "--moe-shared-expert-gate",
        "--moe-router-topk", "2", "--moe-router-score-function", "sigmoid",
        "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "1e-3",
        "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
        "--moe-router-topk-scaling-factor", "2.5", "--moe-router-load-balancing-type",
        "seq_aux_loss", "--moe-aux-loss-coeff", "1e-4", "--moe-token-dispatcher-type", "allgather",
        # multi-token prediction
        "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.1",
        # vocabulary: NullTokenizer adds an end-of-document id (127 + 1 = the stored 128)
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "127",
        "--make-vocab-size-divisible-by", "64",
        # parallelism the stored args hold (Megatron-LM turns sequence parallelism off at TP 1)
        "--sequence-parallel",
        # optimizer and scheduler
        "--bf16", "--use-distributed-optimizer", "--optimizer", "adam", "--adam-beta1", "0.9",
        "--adam-beta2", "0.95", "--adam-eps", "1e-8", "--weight-decay", "0.1",
        "--clip-grad", "1.0", "--lr", "3e-4", "--min-lr", repr(3e-4 / 10),
        "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--lr-decay-iters", "100",
        "--train-iters", "100",
        "--micro-batch-size", "1", "--global-batch-size", "2",
    ]
    cpu = [
        "--transformer-impl", "local", "--use-cpu-initialization",
        "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
        "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
        "--no-persist-layer-norm", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--ckpt-format", "torch_dist", "--seed", str(SEED), "--distributed-backend", "gloo",
        "--save-interval", "1000",
    ]
    return ["pretrain_gpt.py", *model, *cpu, *extra]


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None,
                   pg_collection=None):
    """``gpt_builders.gpt_builder`` for this run (local specs, MoE block spec, MTP block spec
    from the last decoder layer's spec) with the stand-ins of the module docstring."""
    import _mcore_mla as D
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_decoder_layer_specs,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    D._no_te_gemm()  # HAVE_TE / te_general_gemm: a machine without Transformer Engine
    config = config or core_transformer_config_from_args(args)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                      normalization=args.normalization,
                                      qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage)
    last = get_gpt_decoder_layer_specs(config, use_transformer_engine=False,
                                       normalization=args.normalization,
                                       qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage)[-1]
    mtp_spec = get_gpt_mtp_block_spec(config, last, use_transformer_engine=False,
                                      vp_stage=vp_stage)
    attention = D._attention_class()
    for s in (spec, mtp_spec):
        D._replace_in_spec(s, DotProductAttention, attention)
        D._replace_in_spec(s, WrappedTorchNorm, D.SequenceParallelRMSNorm)
    return GPTModel(config=config, transformer_layer_spec=spec,
                    vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings,
                    pre_process=pre_process, post_process=post_process, parallel_output=True,
                    share_embeddings_and_output_weights=(
                        not args.untie_embeddings_and_output_weights),
                    position_embedding_type=args.position_embedding_type,
                    rotary_percent=args.rotary_percent, rotary_base=args.rotary_base,
                    rope_scaling=args.use_rope_scaling, mtp_block_spec=mtp_spec,
                    vp_stage=vp_stage, pg_collection=pg_collection)


def tp_local(p, full, tp_rank: int, glu: bool):
    """The part of the TP1 tensor ``full`` that ``p`` holds on tensor-parallel rank
    ``tp_rank``, by Megatron-Core's own attributes (``tensor_model_parallel``,
    ``partition_dim``); a gated ``linear_fc1`` holds its rank's part of each GLU half."""
    import torch

    if not getattr(p, "tensor_model_parallel", False) or p.shape == full.shape:
        return full
    dim, n = p.partition_dim, p.shape[p.partition_dim]
    if glu:
        halves = full.chunk(2, dim=dim)
        return torch.cat([h.narrow(dim, tp_rank * n // 2, n // 2) for h in halves], dim=dim)
    return full.narrow(dim, tp_rank * n, n)


def differences(gpt, optimizer) -> tuple[list[str], int, int]:
    """Where this rank's loaded state differs from the fixture's expected state: (the
    differences, the optimizer elements compared, the buffers compared)."""
    import _mcore_mla as D
    import torch
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    full = load_file(os.path.join(FIXTURE, "expected", "optim.safetensors"))
    names = {p: D.global_name(gpt, n) for n, p in gpt.named_parameters()}
    expected = {}
    for p, name in names.items():
        expert = not getattr(p, "allreduce", True)
        rank = (ps.get_expert_tensor_parallel_rank() if expert
                else ps.get_tensor_model_parallel_rank())
        glu = re.search(r"linear_fc1\.weight$", name) is not None
        for s in ("fp32_param", "exp_avg", "exp_avg_sq"):
            expected[f"{s}.{name}"] = tp_local(p, full[f"{s}.{name}"], rank, glu).contiguous()
    errors = []
    for p, name in names.items():
        want = expected[f"fp32_param.{name}"]
        if p.dtype != torch.bfloat16 or p.shape != want.shape \
                or not torch.equal(p.detach(), want.to(p.dtype)):
            errors.append(f"model {name}")
    buffers = D.persistent_buffers(gpt)
    saved = load_file(os.path.join(FIXTURE, "expected", "buffers.safetensors"))
    if sorted(saved) != sorted(buffers):
        errors.append(f"buffers {sorted(saved)} != {sorted(buffers)}")
    for name, b in buffers.items():
        if name in saved and (b.dtype != saved[name].dtype or not torch.equal(b, saved[name])):
            errors.append(f"buffer {name}")
    checked = 0
    for o in optimizer.chained_optimizers:
        for gbuf_range_maps in o.gbuf_ranges:
            for maps in gbuf_range_maps.values():
                for bucket_map in maps:
                    for model_param, prm in bucket_map["param_map"].items():
                        r = prm["param"]
                        got = o._get_main_param_and_optimizer_states(model_param)
                        for k in ("param", "exp_avg", "exp_avg_sq"):
                            key = f"{'fp32_param' if k == 'param' else k}.{names[model_param]}"
                            want = expected[key].reshape(-1)[r.start:r.end]
                            g = got[k].detach().reshape(-1)
                            if g.dtype != torch.float32 or not torch.equal(g, want):
                                errors.append(f"optimizer {key}[{r.start}:{r.end}]")
                            checked += g.numel()
    return errors, checked, len(buffers)


def forward_step(data_iterator, model):
    """``pretrain_gpt.forward_step``'s contract (tokens, labels, a loss mask for the LM and
    MTP losses; the summed loss, the token count and the logged values)."""
    import torch

    tokens = next(data_iterator)
    ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    position_ids = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    loss_mask = torch.ones_like(labels, dtype=torch.float)
    output = model(ids, position_ids, None, labels=labels, loss_mask=loss_mask)

    def loss_func(output_tensor):
        loss = (output_tensor.float().view(-1) * loss_mask.view(-1)).sum()
        count = loss_mask.sum().to(torch.int)
        return loss, count, {"lm loss": torch.stack([loss.detach(), count.float()])}

    return output, loss_func


def one_step(model, optimizer, scheduler, iteration: int) -> tuple[float, float]:
    """One ``megatron.training.training.train_step`` with the model config ``train()`` sets
    up (loss scaling, ``finalize_model_grads``); returns (the loss, the gradient norm)."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron.core.utils import get_model_config
    from megatron.training import get_args, training

    args = get_args()
    config = get_model_config(model[0])
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    m, mbs = get_num_microbatches(), args.micro_batch_size
    g = torch.Generator().manual_seed(1000 + iteration)
    tokens = torch.randint(0, 128, (ps.get_data_parallel_world_size() * m * mbs,
                                    args.seq_length + 1), generator=g)
    mine = tokens[ps.get_data_parallel_rank() * m * mbs:][:m * mbs]
    batches = [mine[i * mbs:(i + 1) * mbs] for i in range(m)]
    out = training.train_step(forward_step, RerunDataIterator(iter(batches)), model, optimizer,
                              scheduler, config, get_forward_backward_func(),
                              iteration=iteration)
    assert not out[1], f"step {iteration} skipped"
    return float(out[0]["lm loss"]), float(out[5])


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--megatron-args", type=json.loads, default=[],
                        help="JSON list added to Megatron-LM's command line")
    parser.add_argument("--step", action="store_true", help="then take one train_step")
    opts = parser.parse_args(argv)
    import megatron_plugin  # noqa: F401 (the real dist_checkpointing or ours; CPU patches)

    sys.path.insert(0, os.path.join(REPO, "fixtures"))
    import _mcore_cpu
    import _mcore_resume
    import _training_ckpt_worker as W
    import torch

    W.patch_streams()
    W._PATCHES.append(_mcore_cpu.optimizer_on_cpu())  # kept: its exit would undo them
    W._PATCHES[-1].__enter__()
    W.initialize(SEED, [], argv=megatron_argv(opts.megatron_args))
    from megatron.core.utils import unwrap_model
    from megatron.training import get_args
    from megatron.training.checkpointing import load_checkpoint

    load = get_args().load  # (as parsed: setting up a model clears it)
    model, optimizer, scheduler = W.setup(SEED, model_provider)
    W.fresh_optimizer_states(optimizer)
    # torch Adam's per-parameter 'step' (FusedAdam keeps it in the param groups): the CPU
    # stand-ins the GPT resume uses (_mcore_resume, _training_ckpt_worker)
    _mcore_resume._keep_torch_adam_step()
    get_args().load = load
    iteration, _flops = load_checkpoint(model, optimizer, scheduler)
    W.adam_steps_from_groups(optimizer)
    rank = torch.distributed.get_rank()
    assert iteration == ITERATION, f"rank {rank}: iteration {iteration} loaded"
    gpt = unwrap_model(model)[0]
    errors, checked, nbuffers = differences(gpt, optimizer)
    assert not errors and checked, f"rank {rank}: {len(errors)} differences: {errors[:6]}"
    nparams = sum(1 for _ in gpt.parameters())
    print(f"rank {rank}: OK resumed {load} at iteration {iteration}: {nparams} parameters, "
          f"{nbuffers} buffers, {len(optimizer.chained_optimizers)} optimizers, {checked} "
          f"optimizer elements bit-identical", flush=True)
    if opts.step:
        loss, norm = one_step(model, optimizer, scheduler, iteration)
        assert math.isfinite(loss) and math.isfinite(norm), (loss, norm)
        print(f"rank {rank}: OK train_step {iteration}: loss {loss} grad norm {norm}",
              flush=True)
    torch.distributed.barrier()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    from ckpt_tool._torchrun import exit_cleanly

    exit_cleanly(main(sys.argv[1:]))
