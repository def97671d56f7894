"""Megatron-LM's own training code (tag core_v0.16.1) resumes the DeepSeek-V3-shaped
checkpoint the real Megatron-Core 0.16.1 wrote (``fixtures/mcore016_deepseek_tp2ep2_distopt``:
Multi-Latent Attention with q/kv low-rank projections, a dense layer then MoE layers with a
sigmoid router, expert bias, group routing and a gated shared expert, one Multi-Token-Prediction
layer; TP2 EP2, the chained DistributedOptimizer in ``dp_reshardable`` buckets) after
``ckpt reshard`` to another layout, as a user does it: ``ckpt reshard FIXTURE OUT --tp T --ep E
--json`` runs as a command; a job started with ``initialize_megatron`` on the model's flags
(``--multi-latent-attention``, ``--q-lora-rank``, ``--num-experts``, ``--moe-layer-freq``,
``--moe-router-score-function sigmoid``, ``--moe-router-enable-expert-bias``,
``--mtp-num-layers``, ... as the fixture's stored args hold them) plus the flags of the resume
recipe the command printed builds the model and optimizer with ``setup_model_and_optimizer``
and ``load_checkpoint``s OUT at Megatron-LM's default strictness (``_deepseek_resume_worker.py``,
which names the CPU stand-ins its model provider substitutes). On every rank: iteration 10;
every bf16 parameter, fp32 main param, ``exp_avg`` and ``exp_avg_sq`` bit-identical to the
fixture's expected per-parameter state; the routers' ``expert_bias`` as saved; then one
``train_step`` with a finite loss and gradient norm.

Layouts: TP1 EP1 on 2 ranks (the experts join the dense optimizer; dense and expert DP 2) and
TP2 EP1 on 2 ranks (dense DP 1, expert DP 2; the recipe's expert TP is 2, the source's 1).

Skipped, saying why, when Megatron-LM's files are neither cached nor fetchable
(``fetch_megatron.py``) or the packages ``megatron.training`` imports are missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
import fetch_megatron  # noqa: E402
from _megatron_lm import run_worker  # noqa: E402

pytestmark = [pytest.mark.interop, pytest.mark.multiproc, pytest.mark.slow]
WORKER = HERE / "_deepseek_resume_worker.py"
FIXTURE = REPO / "fixtures" / "mcore016_deepseek_tp2ep2_distopt"


def _ckpt(*args: str) -> subprocess.CompletedProcess:
    """``ckpt ARGS`` as a user runs it (this checkout's)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-m", "ckpt_tool", *args], capture_output=True,
                          text=True, env=env, timeout=900)


@pytest.mark.parametrize("new_layout,nproc", [
    (["--tp", "1", "--ep", "1"], 2),
    (["--tp", "2", "--ep", "1"], 2),
], ids=["tp1-ep1", "tp2-ep1"])
def test_megatron_lm_resumes_the_resharded_deepseek_checkpoint(tmp_path: Path, new_layout: list,
                                                               nproc: int) -> None:
    root = fetch_megatron.ensure_or_skip()
    out = tmp_path / "resharded"
    done = _ckpt("reshard", str(FIXTURE), str(out), *new_layout, "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout)
    assert doc["container"] == {"kind": "save_dir", "iteration_dir": "iter_0000010",
                                "tracker": "10", "framework": "megatron_lm"}
    flags = doc["resume"]["megatron_lm"]
    tp, ep = new_layout[1], new_layout[3]
    assert flags[:2] == ["--load", str(out)], flags
    assert flags[flags.index("--tensor-model-parallel-size") + 1] == tp, flags
    assert flags[flags.index("--expert-model-parallel-size") + 1] == ep, flags
    if tp != "2":  # the rng states are kept by (pp, tp): a TP change drops them
        assert "--no-load-rng" in flags, flags
    # a fresh Megatron-LM job with the model's flags and the recipe's
    log = run_worker(root, "real", WORKER, nproc, "--megatron-args", json.dumps(flags), "--step",
                     timeout=900)
    for rank in range(nproc):
        assert f"rank {rank}: OK resumed {out} at iteration 10: 81 parameters, 3 buffers" in log, \
            log[-3000:]
        assert f"rank {rank}: OK train_step 10: loss " in log, log[-3000:]
