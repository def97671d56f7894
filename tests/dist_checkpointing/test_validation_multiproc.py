"""validate_sharding_integrity / determine_global_metadata across two real gloo ranks."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.distributed as dist

from ckpt_tool.dist_checkpointing import validation
from ckpt_tool.dist_checkpointing.mapping import (
    CheckpointingException,
    ShardedObject,
    ShardedTensor,
)
from ckpt_tool.dist_checkpointing.validation import (
    determine_global_metadata,
    validate_sharding_integrity,
)


def _multiproc_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    warnings: list = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger(validation.__name__).addHandler(handler)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        good = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), (0, rank, world)),
                "o": ShardedObject("o", rank, (world,), (rank,))}
        _, global_meta = determine_global_metadata(good)
        validate_sharding_integrity(global_meta, common_state_dict={"iteration": 7 + rank})
        bad = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), (0, 0, world))}
        try:
            validate_sharding_integrity(determine_global_metadata(bad)[1])
            verdict = "passed"
        except CheckpointingException:
            verdict = "raised"
        result = {"keys": [[x.key for x in r] for r in global_meta],
                  "offsets": [[list(x.global_offset) for x in r] for r in global_meta],
                  "bad": verdict, "warnings": warnings}
    finally:
        dist.destroy_process_group()
    with open(f"{out_dir}/{rank}.json", "w") as f:
        json.dump(result, f)


@pytest.mark.multiproc
def test_multiproc_two_gloo_ranks(tmp_path):
    """Metadata is gathered from both ranks; only rank 0 validates; common state is compared."""
    import torch.multiprocessing as mp

    mp.spawn(_multiproc_worker, args=(2, str(tmp_path / "pg"), str(tmp_path)), nprocs=2,
             join=True)
    r0, r1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1))
    assert r0["keys"] == r1["keys"] == [["w", "o"], ["w", "o"]]
    assert r0["offsets"] == [[[0, 0], [0]], [[2, 0], [1]]]
    assert (r0["bad"], r1["bad"]) == ("raised", "passed")  # rank 1 leaves the check to rank 0
    assert r0["warnings"] == []
    assert any("differs from rank 0" in w for w in r1["warnings"])
