"""The tokenizer files Megatron-LM keeps inside a torch_dist checkpoint (docs/formats.md,
"Megatron-LM main": ``megatron/training/checkpointing.py`` ``save_tokenizer_assets``).

Megatron-LM's main branch (after 0.19; ``--save-tokenizer-assets``, on by default) writes, on
rank 0 after the checkpoint is finalized (after ``metadata.json`` and ``integrity.json``), a
``tokenizer/`` directory into the iteration directory of a torch_dist checkpoint (iteration >
0): for ``HuggingFaceTokenizer``/``MultimodalTokenizer`` what the HF tokenizer's
``save_pretrained`` writes (``tokenizer_config.json``, ``tokenizer.json``, …); for the
file-based tokenizers copies of their files under fixed names (``vocab.txt`` for BERT
WordPiece, ``vocab.json`` + ``merges.txt`` for ``GPT2BPETokenizer``, ``tokenizer.model`` for
the SentencePiece ones, ``tokenizer.json`` for ``TikTokenizer``: tiktoken's, not HF's format);
nothing for ``NullTokenizer``. Megatron-Core's own ``integrity.json`` never lists them (it lists
the directory's top-level files, and is written first).

Megatron-Bridge keeps the same directory name in its iteration directories. Here: what a
checkpoint directory holds there (local directories; nothing is unpickled) and whether it is an
HF tokenizer (``tokenizer_config.json``, which only ``save_pretrained`` writes).
"""

from __future__ import annotations

import os
from pathlib import Path

from ckpt_tool.storage import is_remote

__all__ = ["TOKENIZER_DIR", "tokenizer_assets", "is_hf_tokenizer"]

TOKENIZER_DIR = "tokenizer"
_HF_MARK = "tokenizer_config.json"


def tokenizer_assets(checkpoint_dir: str | Path) -> list[tuple[str, int]]:
    """``[(name relative to tokenizer/, size)]`` of the regular files under the checkpoint's
    ``tokenizer/`` directory, sorted; empty when there is none (or on an object store). A
    FIFO, socket or device there is refused (InputError), never read."""
    if is_remote(checkpoint_dir):
        return []
    root = Path(checkpoint_dir) / TOKENIZER_DIR
    if not root.is_dir():
        return []
    from ckpt_tool.formats.regular_files import check_tree

    check_tree(root)
    out = []
    for dirpath, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            path = Path(dirpath) / name
            if path.is_file():
                out.append((path.relative_to(root).as_posix(), path.stat().st_size))
    return out


def is_hf_tokenizer(names: list[str] | tuple[str, ...]) -> bool:
    """Whether the assets are an HF tokenizer's ``save_pretrained`` files (which HF's
    ``AutoTokenizer`` loads from beside ``config.json``)."""
    return _HF_MARK in names
