"""Pieces against the real Megatron-Core 0.16 at tp in (1, 2, 4), with GQA and with
tp > num_query_groups: for every rank, the chunks of each key our pieces give equal the
ShardedTensors MCore's ``sharded_state_dict`` makes (offsets, sizes, main replica), and our
local shapes equal the rank's own ``state_dict`` shapes (what legacy files hold)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_tool.planning.layout import GLU, REPLICATED, rule_for
from ckpt_tool.planning.pieces import rank_pieces

pytestmark = pytest.mark.interop
SPECS = ["1:4:2", "4:4:2", "2:4:1", "4:4:1"]


@pytest.fixture(scope="module")
def mcore_shards():
    pytest.importorskip("megatron.core")
    helper = Path(__file__).with_name("_mcore_shards.py")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(helper), *SPECS], capture_output=True,
                          text=True, timeout=300, env=env,
                          cwd=Path(__file__).resolve().parents[2])
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("JSON:")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][5:])


def _dist_key(state_key: str) -> tuple[str, bool]:
    """The dist key of a module state_dict key, and whether it is a per-layer key."""
    import re

    k = state_key.replace("input_layernorm.", "self_attention.linear_qkv.layer_norm_")
    k = k.replace("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")
    stacked = re.sub(r"(^|\.)layers\.\d+\.", r"\1layers.", k)
    return stacked, stacked != k


@pytest.mark.parametrize("spec", SPECS)
def test_chunks_and_local_shapes_equal_mcores(mcore_shards, spec):
    tp = int(spec.split(":")[0])
    for rank_s, got in mcore_shards[spec].items():
        rank = int(rank_s)
        theirs: dict[str, set] = {}
        shapes: dict[str, tuple] = {}
        for key, gshape, off, sizes, main in got["shards"]:
            theirs.setdefault(key, set()).add((tuple(off), tuple(sizes), main))
            shapes[key] = tuple(gshape)
        assert len(theirs) >= 15
        for key, gshape in shapes.items():
            rule = rule_for(key)
            ours = set()
            for lt in rank_pieces(key, gshape, rule, tp=tp, tp_rank=rank):
                main = rule.kind != REPLICATED or rank == 0
                if rule.kind == GLU:
                    ours |= {(p.global_offsets, p.sizes, main) for p in lt.pieces}
                else:
                    ours.add((lt.pieces[0].global_offsets, lt.local_shape, main))
            assert ours == theirs[key], (spec, rank, key)
        for skey, lshape in got["local"].items():
            if skey.endswith("_extra_state"):
                continue
            dkey, per_layer = _dist_key(skey)
            gshape = shapes[dkey][1:] if per_layer else shapes[dkey]
            (lt,) = rank_pieces(skey, gshape, rule_for(skey), tp=tp, tp_rank=rank)
            assert lt.local_shape == tuple(lshape), (spec, rank, skey)
