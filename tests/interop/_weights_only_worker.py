"""Load the common state of each checkpoint directory given as Megatron-LM's main branch does,
with ``megatron.core`` of ``$CKPT_MEGATRON_SRC`` imported (its ``register_safe_globals``) and
no other global allowed:

* the ``common_state`` object (0.19 and later): its DCP bytes item, read through PyTorch's own
  ``FileSystemReader`` metadata, unpickled with ``torch.load(BytesIO, weights_only=True)`` (the
  call of ``load_common_state_dict`` in ``megatron/core/dist_checkpointing/serialization.py``;
  with torch 2.13 DCP's default planner unpickles the item itself before that call, with
  ``weights_only=False``, so the item's bytes are loaded here as that call loads them); then
  ``load_common_state_dict`` itself;
* ``common.pt``: ``torch.load(path, map_location="cpu")`` as its ``strategies/common.py``
  ``load_common`` does (``weights_only`` defaults to True since torch 2.6).

    python _weights_only_worker.py DIR [DIR ...]     # prints "OK DIR <keys>" per directory
"""

from __future__ import annotations

import io
import os
import sys

os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
os.environ.setdefault("NO_VCS_VERSION", "1")
sys.path.insert(0, os.environ["CKPT_MEGATRON_SRC"])


def _item_bytes(directory: str, unique_key: str) -> bytes:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex

    meta = FileSystemReader(directory).read_metadata()
    info = meta.storage_data[MetadataIndex(unique_key)]
    with open(os.path.join(directory, info.relative_path), "rb") as f:
        f.seek(info.offset)
        return f.read(info.length)


def main() -> int:
    import torch

    import megatron.core  # noqa: F401 (registers Megatron-Core's safe globals)
    from megatron.core.dist_checkpointing import load_common_state_dict

    for d in sys.argv[1:]:
        if os.path.isfile(os.path.join(d, "common.pt")):
            state = torch.load(os.path.join(d, "common.pt"), map_location="cpu")
        else:
            state = torch.load(io.BytesIO(_item_bytes(d, "common_state/shard_0_1")),
                               weights_only=True)[0]
            assert sorted(load_common_state_dict(d)) == sorted(state), d
        print("OK", d, sorted(state), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
