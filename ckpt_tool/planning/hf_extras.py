"""config.json fields beyond the model's shapes (pure): GPT-2's token ids, Mistral's sliding
window.

**Token ids.** Megatron-LM ``args`` name no token ids, only the tokenizer: Megatron-LM's
``GPT2BPETokenizer`` is GPT-2's vocabulary, whose end-of-document token ``<|endoftext|>`` (id
50256) GPT-2 uses as both ``bos_token_id`` and ``eos_token_id``; the ``NullTokenizer`` of
``--vocab-size V`` ends documents with id ``V``. transformers' ``GPT2Config`` defaults both ids
to 50256 when config.json names none, which is wrong for any other vocabulary: an export whose
ids are unknown writes them as ``null`` and says so in a note.

**Sliding window.** Megatron-Core's ``TransformerConfig.window_size`` (Megatron-LM
``--window-size``, saved in ``args`` as a ``(left, right)`` tuple; ``-1`` = unbounded) lets
query ``i`` attend keys ``i - left`` to ``i + right``: ``left + 1`` keys with ``right = 0``.
transformers' Mistral/Mixtral ``sliding_window`` ``W`` lets it attend keys ``i - W + 1`` to
``i``: ``W`` keys. So ``W = left + 1``, exactly; ``window_attn_skip_freq`` (full attention in
some layers) has no Mistral equivalent.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

__all__ = ["GPT2_EOS", "GPT2_VOCAB", "gpt2_token_ids", "window_from_hf", "sliding_window_of",
           "WINDOW_ARCHS"]

GPT2_EOS = 50256  # <|endoftext|>
GPT2_VOCAB = 50257
WINDOW_ARCHS = ("mistral", "mixtral")  # rules whose config.json has ``sliding_window``


def _is_gpt2_vocab(args: dict[str, Any], vocab: int) -> bool:
    tok = str(args.get("tokenizer_type") or "")
    if tok == "GPT2BPETokenizer":
        return True
    name = PurePosixPath(str(args.get("tokenizer_model") or "")).name
    if tok == "HuggingFaceTokenizer" and name in ("gpt2", "openai-community--gpt2"):
        return True
    return not tok and vocab == GPT2_VOCAB


def gpt2_token_ids(args: dict[str, Any], vocab: int) -> tuple[dict[str, int | None], str | None]:
    """``bos_token_id``/``eos_token_id`` of a GPT-2 export with ``vocab`` rows from Megatron-LM
    ``args``, and a note when they are unknown (then both ``None``)."""
    eod = None
    if _is_gpt2_vocab(args, vocab):
        eod = GPT2_EOS
    elif args.get("tokenizer_type") == "NullTokenizer" and args.get("vocab_size") is not None:
        eod = int(args["vocab_size"])
    if eod is not None and eod < vocab:
        return {"bos_token_id": eod, "eos_token_id": eod}, None
    tok = args.get("tokenizer_type") or "none named"
    return {"bos_token_id": None, "eos_token_id": None}, (
        f"bos/eos token ids unknown (tokenizer: {tok}, vocab_size {vocab}): config.json has "
        "them null and no generation_config.json is written; pass --hf-config with "
        "bos_token_id/eos_token_id to set them")


def window_from_hf(config: dict[str, Any], rule_name: str) -> tuple[int, int] | None:
    """Megatron-LM ``window_size`` for an HF config's ``sliding_window`` (None: no window)."""
    w = config.get("sliding_window") if rule_name in WINDOW_ARCHS else None
    return None if w is None else (int(w) - 1, 0)


def sliding_window_of(args: dict[str, Any], architecture: str) -> int | None:
    """HF ``sliding_window`` for Megatron-LM ``args.window_size`` (None: no window); raises
    UnsupportedError where ``architecture`` cannot hold the window args describe."""
    from ckpt_tool.errors import UnsupportedError

    ws = args.get("window_size")
    if ws is None or int(ws[0]) < 0:
        return None
    left, right = int(ws[0]), int(ws[1])
    if right != 0 or args.get("window_attn_skip_freq"):
        raise UnsupportedError(
            f"window_size ({left}, {right}) with window_attn_skip_freq "
            f"{args.get('window_attn_skip_freq')} has no Hugging Face equivalent (a causal "
            "window in every layer)", hint="export with --to safetensors")
    if architecture not in WINDOW_ARCHS:
        raise UnsupportedError(
            f"this checkpoint has sliding-window attention (window_size ({left}, 0)), which "
            f"the {architecture} architecture has no setting for",
            hint="pass --hf-arch mistral (or mixtral for MoE)")
    return left + 1
