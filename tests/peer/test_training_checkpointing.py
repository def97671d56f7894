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

A resume at another layout, as a user does it: the real library trains a few steps at layout A
(fp32, DDP + DistributedOptimizer) and ``save_checkpoint``s them (torch_dist, Megatron-LM's
default ``dp_reshardable`` optimizer state), ``ckpt reshard SAVE_DIR OUT --tp .. --pp ..
--json`` runs as a command, and a fresh job at layout B started with the flags of the printed
resume recipe (``--load OUT``, the new sizes, ``--no-load-rng``) ``load_checkpoint``s it and
trains on: iteration, losses and updated parameters as those of the job resumed from the
source at layout A.

Skipped, saying why, when Megatron-LM's files are neither cached nor fetchable
(``fetch_megatron.py``) or the packages ``megatron.training`` imports are missing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
import fetch_megatron  # noqa: E402

pytestmark = [pytest.mark.interop, pytest.mark.multiproc]
WORKER = HERE / "_training_ckpt_worker.py"
NPROC = 2


def _run(root: Path, impl: str, *args: str, timeout: float = 900, nproc: int = NPROC) -> str:
    """The worker on ``nproc`` ranks with ``impl``'s dist_checkpointing; fails on rc != 0."""
    env = dict(os.environ, CKPT_PEER_IMPL=impl, CKPT_PEER_ROOT=str(root), CUDA_VISIBLE_DEVICES="",
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_DEVICE_MAX_CONNECTIONS="1",
               PYTHONPATH=os.pathsep.join([str(HERE), str(REPO), str(root)]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(WORKER), *args]
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{impl} {args} timed out after {timeout}s:\n{out[-6000:]}") from None
    assert proc.returncode == 0, f"{impl} {args} failed ({proc.returncode}):\n{out[-6000:]}"
    return out


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


def _result(prefix: Path, nproc: int) -> dict:
    """The ranks' ``--resume-and-step`` results as one: the iteration, the loss and gradient
    norm of each step, and every parameter assembled whole from the ranks' shards."""
    import torch

    ranks = [torch.load(f"{prefix}.rank{r}", weights_only=False) for r in range(nproc)]
    assert len({r["iteration"] for r in ranks}) == 1, [r["iteration"] for r in ranks]
    losses = {tuple(r["losses"]) for r in ranks if r["losses"][0] is not None}
    assert len(losses) == 1, losses  # every last-stage rank reports the same
    return {"iteration": ranks[0]["iteration"], "losses": losses.pop(),
            "grad_norms": ranks[0]["grad_norms"],
            "loaded": _assemble([s for r in ranks for s in r["loaded"]]),
            "params": _assemble([s for r in ranks for s in r["shards"]])}


def _assemble(shards: list) -> dict:
    """Whole tensors from ``(key, global shape, global offset, prepended axes, data)``."""
    import torch

    params: dict[str, torch.Tensor] = {}
    for key, shape, offset, prepended, data in shards:
        full = params.setdefault(key, torch.full(shape, float("nan"), dtype=data.dtype))
        assert full.shape == shape, (key, full.shape, shape)
        data = data.reshape((1,) * prepended + tuple(data.shape))
        full[tuple(slice(o, o + n) for o, n in zip(offset, data.shape))] = data
    assert not [k for k, t in params.items() if t.isnan().any()], "parameters not covered"
    return params


def _ckpt(*args: str) -> subprocess.CompletedProcess:
    """``ckpt ARGS`` as a user runs it (this checkout's)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-m", "ckpt_tool", *args], capture_output=True,
                          text=True, env=env, timeout=900)


UNTIED = ["--untie-embeddings-and-output-weights"]


@pytest.mark.parametrize("model,layout_a,new_layout,nproc_b", [
    ([], ["--tensor-model-parallel-size", "2"], ["--tp", "1", "--pp", "1"], 1),
    ([], ["--pipeline-model-parallel-size", "2"], ["--tp", "1", "--pp", "1"], 1),
    (UNTIED, ["--pipeline-model-parallel-size", "2"], ["--tp", "1", "--pp", "1"], 1),
    ([], ["--pipeline-model-parallel-size", "2"], ["--tp", "2", "--pp", "1"], 2),
    ([], ["--tensor-model-parallel-size", "2"], ["--tp", "1", "--pp", "2"], 2),
], ids=["tp2-to-tp1", "pp2-to-pp1", "untied-pp2-to-pp1", "pp2-to-tp2", "tp2-to-pp2"])
def test_megatron_lm_resumes_from_reshard_at_the_new_layout(tmp_path: Path, model: list,
                                                            layout_a: list, new_layout: list,
                                                            nproc_b: int) -> None:
    root = fetch_megatron.ensure_or_skip()
    save, out = tmp_path / "save", tmp_path / "resharded"
    log = _run(root, "real", "--megatron-args",
               json.dumps([*model, *layout_a, "--load", str(save)]), "--train-and-save", str(save),
               "--resume-and-step", str(tmp_path / "a"))
    assert _oks(log, f"resumed {save} at iteration 2") == NPROC, log[-3000:]
    done = _ckpt("reshard", str(save), str(out), *new_layout, "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout)
    assert doc["container"] == {"kind": "save_dir", "iteration_dir": "iter_0000002",
                                "tracker": "2"}
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "2"
    flags = doc["resume"]["megatron_lm"]  # the recipe, as it is printed
    assert flags[:2] == ["--load", str(out)] and "--no-load-rng" in flags, flags
    log = _run(root, "real", "--megatron-args", json.dumps([*model, *flags]),
               "--resume-and-step", str(tmp_path / "b"), nproc=nproc_b)
    assert _oks(log, f"resumed {out} at iteration 2") == nproc_b, log[-3000:]
    a, b = _result(tmp_path / "a", NPROC), _result(tmp_path / "b", nproc_b)
    assert a["iteration"] == b["iteration"] == 2
    import torch

    print("losses", a["losses"], b["losses"], "norms", a["grad_norms"], b["grad_norms"])
    assert set(a["params"]) == set(b["params"])
    for k in sorted(a["loaded"]):
        x, y = a["loaded"][k], b["loaded"][k]
        if not (x.shape == y.shape and torch.equal(x, y)):
            print("LOADED DIFFERS", k, tuple(x.shape), tuple(y.shape))
    for k in sorted(a["params"]):
        d = (a["params"][k] - b["params"][k]).abs()
        print(k, float(d.max()), float((d / a["params"][k].abs().clamp_min(1e-30)).max()),
              float(a["params"][k].abs().max()))
