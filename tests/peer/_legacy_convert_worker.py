"""torchrun worker: Megatron-LM's own checkpoint conversion (tag core_v0.16.1),
``--ckpt-convert-format torch_dist``, of a legacy fixture, on CPU/gloo with the real
``megatron.core.dist_checkpointing``::

    CKPT_PEER_IMPL=real torchrun --nproc-per-node 4 _legacy_convert_worker.py LEGACY OUT

LEGACY is ``fixtures/megatron_legacy_tp2pp2`` (the tiny GPT of ``fixtures/_mcore_cpu.py``: 4
layers, hidden 64, GQA 4/2, SwiGLU, biases, LayerNorm, learned positions, untied output layer,
fp32, local layer spec; TP2 PP2). ``initialize_megatron`` with that model's command line and
``--load LEGACY --ckpt-format torch --ckpt-convert-format torch_dist --ckpt-convert-save OUT``,
then ``setup_model_and_optimizer``: Megatron-LM builds the model, ``load_checkpoint`` reads
each rank's legacy file into it (``--no-load-optim --no-load-rng``: the fixture holds a model
only, and its RNG states are CPU stand-ins), saves it with ``save_checkpoint`` as torch_dist
into ``OUT/torch_dist`` and exits, as ``pretrain_gpt.py`` does with those flags.
"""

from __future__ import annotations

import os
import sys

# Megatron-LM's legacy load is a plain torch.load (weights_only by default in torch >= 2.6),
# which refuses the numpy scalar the fixture's args hold, as real ones do: torch's own switch
os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def megatron_argv(legacy: str, out: str) -> list[str]:
    """``pretrain_gpt.py``'s command line for the fixture's model and the conversion. The
    NullTokenizer adds an end-of-document token: ``--vocab-size 127`` pads to the fixture's
    128 rows."""
    return ["pretrain_gpt.py", "--num-layers", "4", "--hidden-size", "64",
            "--ffn-hidden-size", "128", "--num-attention-heads", "4",
            "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16",
            "--seq-length", "32", "--max-position-embeddings", "32",
            "--position-embedding-type", "learned_absolute", "--normalization", "LayerNorm",
            "--swiglu", "--untie-embeddings-and-output-weights", "--vocab-size", "127",
            "--make-vocab-size-divisible-by", "64", "--tokenizer-type", "NullTokenizer",
            "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "3e-4",
            "--train-iters", "100", "--transformer-impl", "local",
            "--use-cpu-initialization", "--no-gradient-accumulation-fusion",
            "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion",
            "--no-bias-dropout-fusion", "--no-persist-layer-norm", "--attention-backend",
            "local", "--spec", "local", "--distributed-backend", "gloo", "--seed", "1234",
            "--load", legacy, "--ckpt-format", "torch", "--no-load-optim",
            "--ckpt-convert-format", "torch_dist", "--ckpt-convert-save", out]


def main(argv: list[str]) -> int:
    legacy, out = argv
    import megatron_plugin  # noqa: F401  (CKPT_PEER_IMPL=real: the real library; CPU patches)

    sys.path.insert(0, os.path.join(REPO, "tests", "peer"))
    from _training_ckpt_worker import gpt_provider, patch_streams

    patch_streams()
    sys.path.insert(0, os.path.join(REPO, "fixtures"))
    import _mcore_cpu

    cpu = _mcore_cpu.optimizer_on_cpu()  # Tensor.type() naming torch.cuda.* (the optimizer)
    cpu.__enter__()
    import megatron.training.arguments as arguments
    import megatron.training.initialize as init
    from megatron.core.enums import ModelType
    from megatron.training.training import setup_model_and_optimizer

    sys.argv = megatron_argv(legacy, out)
    init._compile_dependencies = lambda: None  # GPU kernels and dataset helpers: not on CPU
    # validate_args asks the GPU's architecture at TP > 1 (for a CUDA_DEVICE_MAX_CONNECTIONS
    # advice); one without that requirement answers on a CPU
    arguments.get_device_arch_version = lambda: 10
    init.initialize_megatron(allow_no_cuda=True)
    # the fixture's GPT: learned positions, untied output layer
    provider = gpt_provider(tied=False, position_embedding_type="learned_absolute")
    setup_model_and_optimizer(provider, ModelType.encoder_or_decoder)  # exits
    raise AssertionError("setup_model_and_optimizer returned: no conversion ran")


if __name__ == "__main__":
    from ckpt_tool._torchrun import exit_cleanly

    exit_cleanly(main(sys.argv[1:]))
