"""Megatron-Core compatible distributed checkpointing.

A drop-in for ``megatron.core.dist_checkpointing``: the same names and semantics, so a training
script can switch ``from megatron.core import dist_checkpointing`` to
``from ckpt_tool import dist_checkpointing`` and keep its checkpoints. Works on CPU (gloo or a
single process); CUDA is never required.

Typical use::

    from ckpt_tool import dist_checkpointing
    from ckpt_tool.dist_checkpointing import ShardedTensor

    sharded = {"w": ShardedTensor.from_rank_offsets("w", weight, (0, tp_rank, tp_size))}
    dist_checkpointing.save(sharded, ckpt_dir)
    loaded = dist_checkpointing.load(sharded, ckpt_dir)
"""

from ckpt_tool._torchrun import register_exit_teardown

from . import core, dict_utils, mapping, optimizer, serialization, utils, validation
from .core import check_is_distributed_checkpoint
from .mapping import LocalNonpersistentObject, ShardedObject, ShardedTensor
from .serialization import (
    load,
    load_common_state_dict,
    load_content_metadata,
    load_plain_tensors,
    load_tensors_metadata,
    remove_sharded_tensors,
    save,
)

# A script that ends without destroy_process_group must not die in SIGABRT at exit: an exit
# handler lets gloo's worker threads finish with our collectives' tensors first
# (tests/dist_checkpointing/test_exit_clean.py runs such scripts)
register_exit_teardown()

__all__ = [
    "check_is_distributed_checkpoint",
    "LocalNonpersistentObject",
    "ShardedObject",
    "ShardedTensor",
    "load",
    "load_common_state_dict",
    "load_content_metadata",
    "load_plain_tensors",
    "load_tensors_metadata",
    "remove_sharded_tensors",
    "save",
    "core",
    "dict_utils",
    "mapping",
    "optimizer",
    "serialization",
    "utils",
    "validation",
]
