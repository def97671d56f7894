"""Megatron-LM's own training code (tag core_v0.16.1) checkpoints with ours in place of
``megatron.core.dist_checkpointing``, and the checkpoints cross-load with the real one.

``_training_ckpt_worker.py`` (2 gloo ranks, CPU) builds a tiny GPT (2 layers, hidden 64) with
``megatron.training``'s ``initialize_megatron`` and ``setup_model_and_optimizer`` (Float16Module,
DDP, DistributedOptimizer, bf16), takes a ``train_step``, ``save_checkpoint``s it (torch_dist,
Megatron-LM's default ``dp_reshardable`` optimizer sharding, fully parallel save; sync and,
for ours, also ``--async-save`` through Megatron-LM's persistent worker), then a fresh
model and optimizer from another seed ``load_checkpoint`` it and must hold the same iteration,
parameters, optimizer and scheduler state and give exactly the same losses for the next two
steps as the run that went on without the save. Three runs: the real library saves; ours saves
(sync and async), loads its own and the real one's; the real library loads both of ours.
Skipped, saying why, when Megatron-LM's files are neither cached nor fetchable
(``fetch_megatron.py``) or the packages ``megatron.training`` imports are missing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import fetch_megatron  # noqa: E402
from _megatron_lm import run_worker  # noqa: E402

pytestmark = [pytest.mark.interop, pytest.mark.multiproc]
WORKER = HERE / "_training_ckpt_worker.py"
NPROC = 2


def _run(root: Path, impl: str, *args: str) -> str:
    return run_worker(root, impl, WORKER, NPROC, *args)


def _oks(out: str, what: str) -> int:
    return sum(f"rank {r}: OK {what}" in out for r in range(NPROC))


def test_megatron_lm_training_checkpoints_on_ours_and_cross_loads(tmp_path: Path) -> None:
    root = fetch_megatron.ensure_or_skip()
    real_dir, ours_dir, async_dir = (str(tmp_path / d) for d in ("real", "ours", "ours_async"))
    out = _run(root, "real", "--save", real_dir)
    assert _oks(out, "dist_checkpointing is megatron.core.dist_checkpointing") == NPROC
    assert _oks(out, f"saved {real_dir} (sync)") == NPROC, out[-3000:]
    # ours: save_checkpoint (sync, and async through Megatron-LM's persistent worker), then
    # load_checkpoint of its own and of the real library's save (--ckpt-fully-parallel-load)
    out = _run(root, "ours", "--save", ours_dir, "--save-async", async_dir, "--load", ours_dir,
               "--load-fully-parallel", real_dir)
    assert _oks(out, "dist_checkpointing is ckpt_tool.dist_checkpointing") == NPROC, out[-3000:]
    assert _oks(out, f"saved {ours_dir} (sync)") == NPROC, out[-3000:]
    assert _oks(out, f"saved {async_dir} (async)") == NPROC, out[-3000:]
    assert _oks(out, f"loaded {ours_dir} (plain, iteration 1") == NPROC, out[-3000:]
    assert _oks(out, f"loaded {real_dir} (fully parallel, iteration 1") == NPROC, out[-3000:]
    # the drop-in promise the other way: the real library resumes from our checkpoints
    out = _run(root, "real", "--load", ours_dir, "--load", async_dir)
    assert _oks(out, "dist_checkpointing is megatron.core.dist_checkpointing") == NPROC
    assert _oks(out, f"loaded {ours_dir} (plain, iteration 1") == NPROC, out[-3000:]
    assert _oks(out, f"loaded {async_dir} (plain, iteration 1") == NPROC, out[-3000:]
