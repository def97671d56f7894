"""torchrun worker: Megatron-LM's own training code (tag core_v0.16.1) trains a tiny GPT with the
distributed optimizer on CPU/gloo and checkpoints it with ``megatron.training.checkpointing``,
on ours or on the real ``megatron.core.dist_checkpointing`` (``CKPT_PEER_IMPL``, mapped by
``megatron_plugin``)::

    CKPT_PEER_IMPL=ours torchrun --nproc-per-node 2 _training_ckpt_worker.py \\
        [--save DIR] [--save-async DIR] [--load DIR] [--load-fully-parallel DIR] ...
    CKPT_PEER_IMPL=real torchrun --nproc-per-node 2 _training_ckpt_worker.py \\
        --megatron-args '["--tensor-model-parallel-size", "2", "--load", "DIR"]' \\
        [--train-and-save DIR] [--resume-and-step RESULT]

Saving: build the model and optimizer with ``megatron.training``'s own
``setup_model_and_optimizer`` (``get_model``: Float16Module + DDP; ``get_megatron_optimizer``:
DistributedOptimizer), take one training step (``train_step``), ``save_checkpoint`` it at
iteration 1 into each DIR (``--save-async``: ``--async-save`` with the persistent worker, then
``maybe_finalize_async_save``), and keep per rank the parameters, optimizer and scheduler state
and the losses of the next two steps of the uninterrupted run in ``DIR/reference_rank<N>.pt``.
Loading: build a fresh model and optimizer from another seed, ``load_checkpoint`` DIR (with
``--ckpt-fully-parallel-load`` for ``--load-fully-parallel``) and check on every rank that the
iteration, every parameter and the optimizer and scheduler state equal the reference and that
the next two steps give exactly the same losses. Prints ``rank R: OK ...`` per check.

A resume at another layout: ``--megatron-args`` (a JSON list) adds to Megatron-LM's command
line (the parallel sizes; a resume's ``--load DIR`` and whatever else its recipe says);
``--train-and-save DIR`` takes ``TRAIN_STEPS`` steps and ``save_checkpoint``s them into DIR;
``--resume-and-step RESULT`` builds a fresh model and optimizer, ``load_checkpoint``s what
``--load`` names and takes ``RESUME_STEPS`` steps, and keeps per rank in ``RESULT.rank<N>``
the iteration loaded, the loss Megatron-LM reports for each step, the gradient norms and the
shards of every parameter, fp32 main param and Adam moment as loaded and after the steps (``sharded_state_dict``
of a ``fully_reshardable`` save: global shapes and offsets, to assemble whole tensors at any
layout). The global batch of a step is the same at every layout
(split over the data-parallel ranks and micro-batches).
"""

from __future__ import annotations

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEED_TRAIN, SEED_FRESH = 1234, 4321
SEQ, MBS, VOCAB = 16, 2, 128
TRAIN_STEPS, RESUME_STEPS = 2, 2


def megatron_argv(seed: int, extra: list[str]) -> list[str]:
    """Megatron-LM's command line of this tiny run (what ``pretrain_gpt.py`` would get)."""
    argv = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64",
            "--num-attention-heads", "4", "--ffn-hidden-size", "128", "--seq-length", str(SEQ),
            "--max-position-embeddings", str(SEQ), "--micro-batch-size", str(MBS),
            "--global-batch-size", str(MBS * 2), "--lr", "1e-3", "--min-lr", "1e-4",
            "--lr-warmup-iters", "1", "--train-iters", "10", "--bf16", "--use-distributed-optimizer",
            "--transformer-impl", "local", "--use-cpu-initialization", "--no-gradient-accumulation-fusion",
            "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
            "--no-rope-fusion", "--no-persist-layer-norm", "--attention-dropout", "0",
            "--hidden-dropout", "0", "--tokenizer-type", "NullTokenizer", "--vocab-size",
            str(VOCAB), "--ckpt-format", "torch_dist", "--seed", str(seed),
            "--distributed-backend", "gloo", "--attention-backend", "local",
            "--spec", "local", "--save-interval", "1000"]
    return argv + extra


def patch_streams() -> None:
    """CUDA streams on a CPU-only host: ``get_model`` builds DDP on a side stream (beyond the
    CUDA calls ``megatron_plugin`` already patches)."""
    import contextlib

    import torch

    class _Stream:
        def wait_stream(self, other):
            pass

        def synchronize(self):
            pass

    torch.cuda.Stream = lambda *a, **k: _Stream()
    torch.cuda.current_stream = lambda *a, **k: _Stream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()


def initialize(seed: int, extra: list[str], argv: list[str] | None = None):
    """``megatron.training.initialize.initialize_megatron`` on CPU/gloo (the args, the global
    variables, torch.distributed and the model-parallel state, the seeds, the rerun state
    machine) with this GPT's command line plus ``extra`` (``argv``: another model's whole command
    line); its last step compiles GPU kernels and the dataset helpers, which a CPU run has
    no use for, so that step is skipped."""
    import megatron.training.arguments as arguments
    import megatron.training.initialize as init

    sys.argv = megatron_argv(seed, extra) if argv is None else argv
    init._compile_dependencies = lambda: None
    # the GPU's compute capability, which validate_args asks for with tensor parallelism (to
    # require CUDA_DEVICE_MAX_CONNECTIONS=1 before Blackwell): a CPU host stands in for a
    # Hopper GPU (9), and the launcher sets the variable as a TP job on one must
    arguments.get_device_arch_version = lambda: 9
    init.initialize_megatron(allow_no_cuda=True)


def gpt_provider(*, tied: bool | None, position_embedding_type: str):
    """A model provider for the GPT of ``pretrain_gpt.py`` with the local
    (non-Transformer-Engine) layer spec, embeddings ``tied`` or not (None: as the run's
    ``--untie-embeddings-and-output-weights`` says)."""

    def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None,
                       pg_collection=None):
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.training import get_args
        from megatron.training.arguments import core_transformer_config_from_args

        args = get_args()
        share = not args.untie_embeddings_and_output_weights if tied is None else tied
        return GPTModel(config=config or core_transformer_config_from_args(args),
                        transformer_layer_spec=get_gpt_layer_local_spec(),
                        vocab_size=args.padded_vocab_size,
                        max_sequence_length=args.max_position_embeddings,
                        pre_process=pre_process, post_process=post_process,
                        share_embeddings_and_output_weights=share,
                        position_embedding_type=position_embedding_type, vp_stage=vp_stage)

    return model_provider


model_provider = gpt_provider(tied=None, position_embedding_type="rope")


def setup(seed: int, provider=None):
    """Model, optimizer and scheduler as ``megatron.training.training.pretrain`` builds them
    (``setup_model_and_optimizer`` without ``--load``) from ``provider`` (default: this GPT's
    ``model_provider``)."""
    import megatron.training.initialize as init
    from megatron.core.enums import ModelType
    from megatron.training import get_args
    from megatron.training.training import setup_model_and_optimizer

    args = get_args()
    args.seed, args.load = seed, None
    init._set_random_seed(seed)
    return setup_model_and_optimizer(provider or model_provider, ModelType.encoder_or_decoder)


def fresh_optimizer_states(optimizer) -> None:
    """A resumed job's optimizer before ``load_checkpoint``. On a GPU, Megatron-LM steps Apex or
    Transformer Engine FusedAdam, whose fresh state already has what
    ``DistributedOptimizer.state_dict`` reads; a CPU run steps torch's Adam, whose state is
    empty until its first step, so Megatron-Core's own initialiser fills it with dummy values
    (which the load then overwrites)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        opt._init_optimizer_states_with_dummy_values()


def unshare_adam_steps(optimizer) -> None:
    """After a load without Apex/TE, Megatron-Core 0.16.1's ``DistributedOptimizer.load_state_dict``
    gives every parameter's torch-Adam state the *same* ``step`` tensor, which torch's Adam
    then increments once per parameter per step (bias corrections go wrong from the second
    step after a resume, with either checkpointing library). FusedAdam on a GPU keeps the step
    in its param groups; here each parameter gets its own copy, as before the save."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in opt.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].clone()


def adam_steps_from_groups(optimizer) -> None:
    """After a load without Apex/TE, each parameter's torch-Adam ``step`` from its param
    group's: Megatron-Core restores the step into the param groups, where FusedAdam on a GPU
    reads it; torch Adam reads a per-parameter ``step``, which a ``dp_reshardable`` load leaves
    at the value the dummy initialisation gave it (a resume after two steps would then take
    its third with the bias corrections of its second). Each parameter gets its own tensor."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in opt.optimizer.param_groups:
            for param in group["params"] if "step" in group else ():
                state = opt.optimizer.state.get(param)
                if state is not None and "step" in state:
                    state["step"] = state["step"].clone().fill_(float(group["step"]))


LOSSES: list = []
_PATCHES: list = []


def batch(step: int):
    """The micro-batches of training step ``step`` on this data-parallel rank: the step's
    global batch (fixed tokens) split over the data-parallel ranks and micro-batches, so that
    every layout trains on the same samples."""
    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    m, dp = get_num_microbatches(), mpu.get_data_parallel_world_size()
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (dp * m * MBS, SEQ + 1), generator=g)
    mine = tokens[mpu.get_data_parallel_rank() * m * MBS:][:m * MBS]
    pos = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)
    return [dict(tokens=mine[i * MBS:(i + 1) * MBS, :-1], labels=mine[i * MBS:(i + 1) * MBS, 1:],
                 position_ids=pos) for i in range(m)]


def forward_step(data_iterator, model):
    """``pretrain_gpt.forward_step``'s contract: the output and a loss function returning
    (summed loss, token count, logged values)."""
    import torch

    data = next(data_iterator)
    output = model(data["tokens"], data["position_ids"], None, labels=data["labels"])

    def loss_func(output_tensor):
        loss = output_tensor.float().sum()
        tokens = torch.tensor(output_tensor.numel(), dtype=torch.int)
        LOSSES.append(loss.detach().clone())
        return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.float()])}

    return output, loss_func


def train_step(model, optimizer, scheduler, iteration: int) -> tuple:
    """One ``megatron.training.training.train_step``; returns what it returns."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron.core.utils import get_model_config
    from megatron.training import training

    LOSSES.clear()
    config = get_model_config(model[0])
    out = training.train_step(forward_step, RerunDataIterator(iter(batch(iteration))), model,
                              optimizer, scheduler, config, get_forward_backward_func(),
                              iteration=iteration)
    skipped = out[1]
    assert not skipped, f"step {iteration} skipped"
    return out


def step(model, optimizer, scheduler, iteration: int):
    """One training step; returns this rank's summed losses of its micro-batches."""
    train_step(model, optimizer, scheduler, iteration)
    return [float(x) for x in LOSSES]


def snapshot(model, optimizer, scheduler):
    """Every model parameter (by name), the optimizer's state dict, the state dicts of the
    torch optimizers it wraps (fp32 main params, Adam moments and steps, learning rates) and
    the scheduler's (tensors cloned)."""
    import copy

    params = {f"{i}.{n}": p.detach().clone() for i, m in enumerate(model)
              for n, p in m.named_parameters()}
    inner = [opt.optimizer.state_dict() for opt in getattr(optimizer, "chained_optimizers",
                                                            [optimizer])]
    for sd in inner:  # without Apex/TE the load also writes the step into the param groups,
        for group in sd["param_groups"]:  # where torch's Adam never reads it
            group.pop("step", None)
    return copy.deepcopy({"params": params, "optimizer": optimizer.state_dict(),
                          "inner": inner, "scheduler": scheduler.state_dict()})


def diff(a, b, path="") -> list:
    """Where two nested structures of tensors and plain values differ (empty: equal)."""
    import torch

    if torch.is_tensor(a) or torch.is_tensor(b):
        ok = torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a, b)
        return [] if ok else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path} keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [d for k in a for d in diff(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path} len {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def do_save(save_dirs: list) -> None:
    """Train one step, save it into each ``(directory, async)`` of ``save_dirs``, then keep the
    reference (state at the save, losses of the next two steps) beside each."""
    import torch

    from megatron.training import get_args
    from megatron.training.async_utils import maybe_finalize_async_save
    from megatron.training.checkpointing import save_checkpoint

    rank = torch.distributed.get_rank()
    model, optimizer, scheduler = setup(SEED_TRAIN)
    step(model, optimizer, scheduler, 0)
    context: dict = {}  # pretrain's checkpointing_context: the save strategy is reused
    for save_dir, is_async in save_dirs:
        get_args().save, get_args().async_save = save_dir, is_async
        save_checkpoint(1, model, optimizer, scheduler, 0, checkpointing_context=context)
        if is_async:  # what the training loop does before it exits
            maybe_finalize_async_save(blocking=True)
    if any(is_async for _d, is_async in save_dirs):
        maybe_finalize_async_save(blocking=True, terminate=True)
    ref = snapshot(model, optimizer, scheduler)
    ref["losses"] = [step(model, optimizer, scheduler, 1), step(model, optimizer, scheduler, 2)]
    for save_dir, is_async in save_dirs:
        assert os.path.exists(os.path.join(save_dir, "latest_checkpointed_iteration.txt"))
        torch.save(ref, os.path.join(save_dir, f"reference_rank{rank}.pt"))
        how = "async" if is_async else "sync"
        print(f"rank {rank}: OK saved {save_dir} ({how})", flush=True)
    torch.distributed.barrier()


def do_load(load_dir: str, fully_parallel: bool = False) -> None:
    import torch

    from megatron.training import get_args
    from megatron.training.checkpointing import load_checkpoint

    rank = torch.distributed.get_rank()
    model, optimizer, scheduler = setup(SEED_FRESH)
    fresh_optimizer_states(optimizer)
    get_args().load = load_dir
    get_args().ckpt_fully_parallel_load = fully_parallel
    iteration, _flops = load_checkpoint(model, optimizer, scheduler)
    unshare_adam_steps(optimizer)
    ref = torch.load(os.path.join(load_dir, f"reference_rank{rank}.pt"), weights_only=False)
    assert iteration == 1, f"rank {rank}: iteration {iteration} restored, not 1"
    got = snapshot(model, optimizer, scheduler)
    bad = diff(ref["params"], got["params"], "params")
    assert not bad, f"rank {rank}: parameters differ after load_checkpoint: {bad[:5]}"
    for part in ("optimizer", "inner", "scheduler"):
        bad = diff(ref[part], got[part], part)
        assert not bad, f"rank {rank}: {part} state differs after load_checkpoint: {bad[:5]}"
    losses = [step(model, optimizer, scheduler, 1), step(model, optimizer, scheduler, 2)]
    assert losses == ref["losses"], f"rank {rank}: losses {losses} != {ref['losses']}"
    how = "fully parallel" if fully_parallel else "plain"
    print(f"rank {rank}: OK loaded {load_dir} ({how}, iteration 1, {len(got['params'])} params, "
          f"losses {losses})", flush=True)


def do_train_and_save(save_dir: str) -> None:
    """``TRAIN_STEPS`` steps from ``SEED_TRAIN``, ``save_checkpoint``ed at that iteration."""
    import torch

    from megatron.training import get_args
    from megatron.training.checkpointing import save_checkpoint

    model, optimizer, scheduler = setup(SEED_TRAIN)
    for i in range(TRAIN_STEPS):
        out = train_step(model, optimizer, scheduler, i)
        print(f"rank {torch.distributed.get_rank()}: step {i} loss {out[0].get('lm loss')} "
              f"grad norm {out[5]}", flush=True)
    get_args().save = save_dir
    save_checkpoint(TRAIN_STEPS, model, optimizer, scheduler, 0, checkpointing_context={})
    print(f"rank {torch.distributed.get_rank()}: OK trained {TRAIN_STEPS} steps, saved "
          f"{save_dir}", flush=True)
    torch.distributed.barrier()


def parameter_shards(model, optimizer) -> list:
    """``(key, global shape, global offset, prepended axes, data)`` of every parameter shard
    this rank holds and of the DistributedOptimizer's fp32 main params and Adam moments, as
    the ``sharded_state_dict``s of a ``fully_reshardable`` save name them (keys and offsets
    independent of the layout); main replicas only (the copy a save writes: not a TP-replicated
    norm's other ranks', not the last pipeline stage's copy of tied embeddings)."""
    import torch
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import is_main_replica
    from megatron.core.utils import unwrap_model

    chunks = unwrap_model(model)
    sd = ({"model": chunks[0].sharded_state_dict()} if len(chunks) == 1 else
          {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)})
    sd["optimizer"] = optimizer.sharded_state_dict(
        sd, is_loading=False, metadata={"distrib_optim_sharding_type": "fully_reshardable"})
    out = []
    for sh in nested_values(sd):
        data = getattr(sh, "data", None)
        if hasattr(sh, "global_offset") and torch.is_tensor(data) and data.numel() \
                and getattr(sh, "flattened_range", None) is None \
                and is_main_replica(sh.replica_id):
            out.append((sh.key, tuple(sh.global_shape), tuple(sh.global_offset),
                        sh.prepend_axis_num, data.detach().clone()))
    return out


def do_resume_and_step(result: str, load: str) -> None:
    """Resume as a training job does (a fresh model and optimizer, ``load_checkpoint`` of what
    ``--load`` named (``load``), with every other flag as given), take ``RESUME_STEPS``
    steps, keep what they did in ``RESULT.rank<N>``."""
    import torch

    from megatron.training import get_args
    from megatron.training.checkpointing import load_checkpoint

    import _mcore_resume

    rank = torch.distributed.get_rank()
    model, optimizer, scheduler = setup(SEED_FRESH)
    fresh_optimizer_states(optimizer)
    # torch Adam's per-parameter 'step', which a fully_reshardable load lacks (FusedAdam keeps
    # it in the param groups): the CPU stand-in of _mcore_resume (see its docstring)
    _mcore_resume._keep_torch_adam_step()
    get_args().load = load
    iteration, _flops = load_checkpoint(model, optimizer, scheduler)
    adam_steps_from_groups(optimizer)
    loaded = parameter_shards(model, optimizer)
    losses, norms = [], []
    for i in range(iteration, iteration + RESUME_STEPS):
        out = train_step(model, optimizer, scheduler, i)
        loss = out[0].get("lm loss")  # (on the last pipeline stage)
        losses.append(None if loss is None else float(loss))
        norms.append(float(out[5]))
    torch.save({"iteration": iteration, "losses": losses, "grad_norms": norms,
                "loaded": loaded, "shards": parameter_shards(model, optimizer)},
               f"{result}.rank{rank}")
    print(f"rank {rank}: OK resumed {load} at iteration {iteration}, losses {losses}",
          flush=True)


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--save", action="append", default=[], type=lambda d: (d, False))
    parser.add_argument("--save-async", action="append", dest="save", type=lambda d: (d, True),
                        help="save with --async-save (Megatron-LM's persistent worker)")
    parser.add_argument("--load", action="append", default=[], type=lambda d: (d, False))
    parser.add_argument("--load-fully-parallel", action="append", dest="load",
                        type=lambda d: (d, True), help="load with --ckpt-fully-parallel-load")
    parser.add_argument("--megatron-args", type=json.loads, default=[],
                        help="JSON list added to Megatron-LM's command line")
    parser.add_argument("--train-and-save", metavar="DIR")
    parser.add_argument("--resume-and-step", metavar="RESULT")
    opts = parser.parse_args(argv)
    import megatron_plugin  # ours or the real one (CKPT_PEER_IMPL); CPU patches

    patch_streams()
    sys.path.insert(0, os.path.join(REPO, "fixtures"))
    import _mcore_cpu  # Tensor.type() naming torch.cuda.* types, as the optimizer checks

    _PATCHES.append(_mcore_cpu.optimizer_on_cpu())  # kept: its exit would undo them
    _PATCHES[-1].__enter__()

    import megatron.training.checkpointing as training_checkpointing

    impl = training_checkpointing.dist_checkpointing.__name__
    want = "ckpt_tool." if megatron_plugin.IMPL == "ours" else "megatron.core."
    assert impl.startswith(want), f"megatron.training.checkpointing uses {impl}"
    print(f"rank {os.environ.get('RANK')}: OK dist_checkpointing is {impl}", flush=True)
    # --async-save: Megatron-LM's persistent async checkpoint worker (a separate process)
    async_save = any(is_async for _d, is_async in opts.save)
    initialize(SEED_TRAIN, (["--async-save", "--use-persistent-ckpt-worker"] if async_save
                            else []) + opts.megatron_args)
    from megatron.training import get_args

    load = get_args().load  # (as parsed: setting up a model clears it)
    if opts.save:
        do_save(opts.save)
    for load_dir, fully_parallel in opts.load:
        do_load(load_dir, fully_parallel)
    if opts.train_and_save:
        do_train_and_save(opts.train_and_save)
    if opts.resume_and_step:
        do_resume_and_step(opts.resume_and_step, load)
    return 0


if __name__ == "__main__":
    from ckpt_tool._torchrun import exit_cleanly

    exit_cleanly(main(sys.argv[1:]))
