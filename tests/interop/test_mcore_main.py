"""What Megatron-LM's main branch (the next release) reads of our outputs, with its own code
(``_mcore_main.py``: ``megatron/core`` at the commit docs/formats.md cites, run from source).

The common state: main loads the 0.19 ``common_state`` object with
``torch.load(weights_only=True)`` and ``common.pt`` with ``torch.load``'s default (the same
since torch 2.6), Megatron-Core's safe globals registered and nothing else allowed
(``_weights_only_worker.py``). The fixtures' ``args`` hold a ``numpy.float64``, as real
Megatron-LM args can, which that load refuses; what ``reshard`` and ``convert`` write loads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_tool.formats.save_dir import locate_source
from ckpt_tool.ops.convert import ConvertOptions, convert
from ckpt_tool.ops.reshard import ReshardRequest, reshard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _mcore_main import source_or_skip  # noqa: E402

pytestmark = [pytest.mark.interop]
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
MCORE019 = FIXTURES / "mcore019_gpt_tp2dp2_distopt_buckets"
MCORE016 = FIXTURES / "mcore016_gpt_tp2dp2_distopt_buckets"
WORKER = Path(__file__).resolve().parent / "_weights_only_worker.py"


def _load_as_main(root: Path, *dirs: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"}
    env["CKPT_MEGATRON_SRC"] = str(root)
    return subprocess.run([sys.executable, str(WORKER), *map(str, dirs)], env=env,
                          capture_output=True, text=True, timeout=600)


def test_main_loads_the_common_state_we_write_weights_only(tmp_path):
    root = source_or_skip()
    outs = []
    for name, src, make in [
        ("r019", MCORE019, lambda s, o: reshard(s, o, ReshardRequest(tp=1))),
        ("c019", MCORE019, lambda s, o: convert(s, o, ConvertOptions(to="torch_dist"))),
        ("r016", MCORE016, lambda s, o: reshard(s, o, ReshardRequest(tp=1, pp=2))),
    ]:
        out = tmp_path / name
        make(src, out)
        outs.append(locate_source(out).checkpoint)
    assert not (outs[0] / "common.pt").exists() and not (outs[1] / "common.pt").exists()
    assert (outs[2] / "common.pt").is_file()
    done = _load_as_main(root, *outs)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("OK ") == 3, done.stdout + done.stderr[-2000:]
    assert "'args'" in done.stdout


def test_the_sources_themselves_are_refused_by_that_load():
    """Why the outputs' numpy scalars become Python scalars: the load refuses the sources."""
    root = source_or_skip()
    for src in (MCORE019, MCORE016):
        done = _load_as_main(root, next(src.glob("iter_*")))
        assert done.returncode != 0 and "numpy" in done.stderr and "scalar" in done.stderr, \
            done.stdout + done.stderr[-2000:]
