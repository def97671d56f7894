"""Ask the real Megatron-Core what a checkpoint holds (run with torchrun, 1 rank).

    torchrun --standalone --nproc-per-node 1 mcore_inspect.py CKPT OUT.pt

Writes ``{"plain": load_plain_tensors, "meta": {key: (dtype, shape)}, "common":
load_common_state_dict, "objects": {unique_key: value}}`` with ``torch.save``.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# MCore's common.pt loader calls plain torch.load, which (torch >= 2.6, weights_only) refuses
# Megatron-LM's `args` Namespace; Megatron-LM allowlists it at startup, we trust our fixtures.
os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dist_worker import import_lib  # noqa: E402
from plainify import plainify  # noqa: E402


def main() -> int:
    ckpt, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    lib, _ = import_lib("mcore")
    meta = {k: (v.dtype, tuple(v.global_shape)) for k, v in lib.load_tensors_metadata(ckpt).items()}
    common = lib.load_common_state_dict(ckpt)
    plain = lib.load_plain_tensors(ckpt)
    plain = {k: v for k, v in plain.items() if k in meta}
    # every ShardedObject, loaded one by one (objects cannot be loaded "plain")
    sharded = lib.serialization.load_sharded_metadata(ckpt)
    objects = {}
    for key, sh in sharded.items():
        if isinstance(sh, lib.ShardedObject):
            objects[key] = lib.load({"o": sh}, ckpt, validate_access_integrity=False)["o"]
    torch.save({"plain": plain, "meta": meta, "common": plainify(common),
                "objects": plainify(objects)}, out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from ckpt_tool._torchrun import exit_cleanly

    exit_cleanly(main())
