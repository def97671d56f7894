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


@pytest.mark.multiproc
def test_main_resumes_a_dropped_extra_state_checkpoint_resharded(tmp_path, monkeypatch):
    """``--ckpt-drop-redundant-extra-state`` (``megatron/training/checkpointing.py``
    ``_localize_redundant_extra_states``): every ``_extra_state`` ShardedObject whose payload
    holds no delayed-scaling FP8 state (the local spec's are all ``None``) is saved as nothing;
    on disk the checkpoint is the same without those objects (here: 0.19's fixture converted
    without them, as main's save leaves them out: ``megatron.training`` of main needs Python
    3.12). Every command reads it; the reshard keeps that form; main resumes from it with the
    flag (the same localization on its load request) bit-identically, and refuses it without
    the flag (the objects it asks for are missing)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist_checkpointing"
                           / "_workers"))
    from launch import torchrun, torchrun_outcome

    from ckpt_tool.ops.inspect import inspect
    from ckpt_tool.ops.validate import validate

    source_or_skip(monkeypatch)
    dropped = tmp_path / "dropped"
    convert(MCORE019, dropped, ConvertOptions(to="torch_dist", exclude="_extra_state"))
    assert not [o for o in inspect(dropped).meta.objects if o.key.endswith("_extra_state")]
    assert not validate(dropped).findings
    out = tmp_path / "out"
    reshard(dropped, out, ReshardRequest(tp=1, pp=2))
    assert not validate(out).findings
    assert not [o for o in inspect(out).meta.objects if "_extra_state" in o.key]
    convert(dropped, tmp_path / "legacy", ConvertOptions(to="legacy"))
    ckpt = str(locate_source(out).checkpoint)
    worker = str(Path(__file__).resolve().parent / "_moe_resume_worker.py")
    log = torchrun(worker, 2, "1", "2", "1", ckpt, MCORE019.name,
                   "--drop-redundant-extra-state", timeout=900)
    assert log.count(": OK ") == 2 and "(megatron-core 0.20" in log, log[-3000:]
    code, log, _cmd = torchrun_outcome(worker, 2, "1", "2", "1", ckpt, MCORE019.name,
                                       timeout=900)
    assert code != 0 and "Missing key in checkpoint state_dict" in log and "_extra_state" in log
