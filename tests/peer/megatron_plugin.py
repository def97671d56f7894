"""pytest plugin that runs Megatron-LM's own dist_checkpointing tests on CPU/gloo.

Loaded with ``-p megatron_plugin`` by ``run_peer.py`` (one pytest per torchrun rank, in the
cache directory of ``fetch_megatron.py``). The test files are not changed; this plugin is
the harness that replaces the parts of Megatron-LM's test setup that need a GPU:

* ``CKPT_PEER_IMPL=ours`` (default) maps ``megatron.core.dist_checkpointing`` and its 20
  submodules to ``ckpt_tool.dist_checkpointing`` in ``sys.modules`` before anything imports
  them, so Megatron-Core's models and optimizers, ``megatron.training`` and the tests all use
  ours; ``CKPT_PEER_IMPL=real`` leaves the installed package in place (the baseline).
* CUDA on CPU: ``device='cuda'`` in factory functions and ``.to()`` becomes CPU,
  ``Tensor.cuda()`` is the tensor itself, the ``torch.cuda`` calls the tests and MCore make
  (device selection, synchronisation, memory statistics, RNG) are no-ops or CPU stand-ins,
  and process groups asked for ``nccl`` get ``gloo``.
* the fixtures of Megatron-LM's ``tests/unit_tests/conftest.py`` that these tests use
  (``tmp_path_dist_ckpt``, the final barrier) — that file itself downloads data sets and is not
  fetched.
* each rank writes its outcomes to ``$CKPT_PEER_OUT/rank<N>.json`` for ``run_peer.py``.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from cuda_on_cpu import patch_cuda_calls

IMPL = os.environ.get("CKPT_PEER_IMPL", "ours")
# The modules of megatron.core.dist_checkpointing (0.16.1), all mirrored by ours.
SUBMODULES = ["", ".mapping", ".serialization", ".core", ".dict_utils", ".utils", ".optimizer",
              ".strategies", ".strategies.base", ".strategies.torch",
              ".strategies.async_utils", ".strategies.state_dict_saver",
              ".strategies.filesystem_async", ".strategies.fully_parallel",
              ".strategies.common", ".strategies.cached_metadata_filesystem_reader",
              ".strategies.checkpointable", ".exchange_utils", ".state_dict_utils",
              ".tensor_aware_state_dict", ".validation"]


def map_to_ours() -> None:
    """Make ``megatron.core.dist_checkpointing[.x]`` be ``ckpt_tool.dist_checkpointing[.x]``."""
    if any(n.startswith("megatron.core.dist_checkpointing") for n in sys.modules):
        raise RuntimeError("megatron.core.dist_checkpointing was imported before the mapping")
    for suffix in SUBMODULES:
        sys.modules["megatron.core.dist_checkpointing" + suffix] = importlib.import_module(
            "ckpt_tool.dist_checkpointing" + suffix)
    import megatron.core

    megatron.core.dist_checkpointing = sys.modules["megatron.core.dist_checkpointing"]


# ------------------------------------------------------------------------------ CPU patches
def _cpu(device):
    if device is None:
        return None
    if isinstance(device, int):
        return "cpu"
    text = str(device)
    return "cpu" if text.startswith("cuda") else device


class _CudaToCpu(torch.overrides.TorchFunctionMode):
    """Turns ``device='cuda'`` into CPU in factory functions, ``.to`` and ``.new_*``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1 and not isinstance(args[1], torch.Tensor):
            if not isinstance(args[1], torch.dtype):
                args = (args[0], _cpu(args[1])) + tuple(args[2:])
        return func(*args, **kwargs)


_MODE = _CudaToCpu()
# Process groups made through torch.distributed.new_group since the last
# destroy_model_parallel (see release_groups).
_CREATED_GROUPS: list = []


def release_groups() -> int:
    """Destroy the process groups created since the last call; return how many.

    Megatron-Core's ``destroy_model_parallel`` only forgets its groups, and each gloo group
    keeps its worker threads and sockets: Megatron-LM's tests build a new set of
    model-parallel groups per test, so a whole file ends with hundreds of live groups and
    ~800 threads per rank. Destroying a gloo group is local (no collective), and every rank
    calls this at the same points (``destroy_model_parallel``), after the test's last use.
    """
    groups, _CREATED_GROUPS[:] = list(_CREATED_GROUPS), []
    released = 0
    pg_map = dist.distributed_c10d._world.pg_map
    for group in groups:
        if dist.is_initialized() and group in pg_map:
            dist.destroy_process_group(group)
            released += 1
    return released


def patch_destroy_model_parallel() -> None:
    """``parallel_state.destroy_model_parallel`` also releases the groups (see above)."""
    import megatron.core.parallel_state as ps

    original = ps.destroy_model_parallel

    def destroy_model_parallel(*args, **kwargs):
        result = original(*args, **kwargs)
        release_groups()
        return result

    destroy_model_parallel.__wrapped__ = original
    ps.destroy_model_parallel = destroy_model_parallel


def patch_cuda() -> None:
    """Stand-ins for the CUDA calls of the tests and of Megatron-Core on a CPU-only host."""
    patch_cuda_calls()
    _MODE.__enter__()

    init = dist.init_process_group
    new_group = dist.new_group

    def init_process_group(backend=None, *args, **kwargs):
        return init("gloo", *args, **kwargs)

    def new_group_gloo(*args, **kwargs):
        if kwargs.get("backend") in ("nccl", "NCCL", None) or "backend" in kwargs:
            kwargs["backend"] = "gloo"
        group = new_group(*args, **kwargs)
        if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
            _CREATED_GROUPS.append(group)
        return group

    dist.init_process_group = init_process_group
    dist.new_group = new_group_gloo


def patch_fused_adam() -> None:
    """Without Apex/Transformer Engine, Megatron-Core builds torch's AdamW, which refuses the
    ``lr=None`` of a default ``OptimizerConfig`` (Megatron-LM's optimizer tests leave the learning
    rate to the scheduler); the GPU's FusedAdam takes it. A stand-in with FusedAdam's signature
    (``adam_w_mode``) that builds torch's AdamW/Adam with the same arguments, the learning rate
    ``None`` where it was given as ``None``. The distributed optimizer then treats it as FusedAdam
    too: the Adam ``step`` is not per-parameter state (Megatron-LM's tests build Adam moments
    without one). Applied in pytest runs only (``pytest_configure``), not to the training worker
    of ``test_training_checkpointing.py``, which steps the optimizer."""
    import megatron.core.optimizer as mcore_optimizer
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer

    if not mcore_optimizer.USING_PYTORCH_OPTIMIZER:
        return
    distrib_optimizer.HAVE_APEX_OR_TE = distrib_optimizer.USING_APEX_OPTIMIZER = True

    def without_step(base):
        class FusedAdamOnCpu(base):
            def __setstate__(self, state):
                """FusedAdam's load takes per-parameter state without ``step`` (it keeps the
                step per group); torch's wants one: lent for the check, taken back after."""
                lent = [s for s in state.get("state", {}).values()
                        if isinstance(s, dict) and s and "step" not in s]
                for s in lent:
                    s["step"] = torch.tensor(0.0)
                super().__setstate__(state)
                for s in lent:
                    s.pop("step", None)

        FusedAdamOnCpu.__name__ = base.__name__
        return FusedAdamOnCpu

    def fused_adam_on_cpu(params, lr=None, adam_w_mode=True, **kwargs):
        cls = without_step(torch.optim.AdamW if adam_w_mode else torch.optim.Adam)
        optimizer = cls(params, lr=0.0 if lr is None else lr, **kwargs)
        if lr is None:
            optimizer.defaults["lr"] = None
            for group in optimizer.param_groups:
                group["lr"] = None if group["lr"] == 0.0 else group["lr"]
        return optimizer

    mcore_optimizer.Adam = fused_adam_on_cpu
    mcore_optimizer.USING_PYTORCH_OPTIMIZER = False


_BIK = "megatron.core.transformer.custom_layers.batch_invariant_kernels"


def stub_triton_kernels() -> None:
    """Without triton (CPU torch), MCore's batch-invariant Triton kernels cannot import, yet
    ``megatron.training.initialize`` imports them; a stand-in with the mode switches (off)."""
    try:
        import triton  # noqa: F401
        return
    except ImportError:
        pass
    import contextlib
    import types

    mod = types.ModuleType(_BIK, "CPU stand-in (peer harness): no Triton kernels")
    mod.is_batch_invariant_mode_enabled = lambda: False
    mod.enable_batch_invariant_mode = mod.disable_batch_invariant_mode = lambda *a, **k: None
    mod.set_batch_invariant_mode = lambda *a, **k: contextlib.nullcontext()
    sys.modules[_BIK] = mod


def _patch_utils() -> None:
    """Megatron-LM's test helper picks a GPU per rank and nccl; here gloo on CPU."""
    from tests.unit_tests.test_utilities import Utils

    def initialize_distributed():
        for var in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
            os.environ.pop(var, None)
        if not dist.is_initialized() and Utils.rank >= 0:
            dist.init_process_group("gloo", world_size=Utils.world_size, rank=Utils.rank)
            dist.barrier()
        Utils.inited = True

    Utils.initialize_distributed = staticmethod(initialize_distributed)


# ------------------------------------------------------------------------------ set-up
_ROOT = Path(os.environ.get("CKPT_PEER_ROOT", os.getcwd()))
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))
stub_triton_kernels()
patch_cuda()
if IMPL == "ours":
    map_to_ours()
elif IMPL != "real":
    raise RuntimeError(f"CKPT_PEER_IMPL must be 'ours' or 'real', not {IMPL!r}")
if not os.environ.get("CKPT_PEER_NO_PSUTIL_PATCH"):
    try:  # without psutil MCore's async writer processes die (docs/formats.md §8)
        import psutil  # noqa: F401
    except ImportError:
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        filesystem_async._process_memory = lambda: 0
_patch_utils()
patch_destroy_model_parallel()
# Our switch for ShardedObjects holding io.BytesIO (refused by the allowlist by default):
# torch's own add_safe_globals, honoured by ckpt_tool's unpickler (docs/testing.md, peer suite).
if IMPL == "ours":
    import io

    torch.serialization.add_safe_globals([io.BytesIO])


def pytest_configure(config):
    patch_fused_adam()


@pytest.fixture(scope="session")
def tmp_path_dist_ckpt(tmp_path_factory) -> Path:
    """The directory all ranks save into (as Megatron-LM's conftest: above each basetemp)."""
    from tests.unit_tests.dist_checkpointing import TempNamedDir
    from tests.unit_tests.test_utilities import Utils

    tmp_dir = tmp_path_factory.mktemp("ignored", numbered=False).parent.parent / "tmp_dist_ckpt"
    if Utils.rank == 0:
        with TempNamedDir(tmp_dir, sync=False):
            yield tmp_dir
    else:
        yield tmp_dir


@pytest.fixture(scope="session", autouse=True)
def _final_barrier():
    yield
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


_OUTCOMES: dict[str, str] = {}


def _write_outcomes() -> None:
    """This rank's outcomes so far, to ``$CKPT_PEER_OUT/rank<N>.json`` (rewritten after each
    test, so a run killed on a timeout still tells what passed, and which test hung)."""
    out = os.environ.get("CKPT_PEER_OUT")
    if out:
        rank = os.environ.get("RANK", "0")
        Path(out).mkdir(parents=True, exist_ok=True)
        tmp = Path(out, f"rank{rank}.json.tmp")
        tmp.write_text(json.dumps(_OUTCOMES, indent=1, sort_keys=True))
        os.replace(tmp, Path(out, f"rank{rank}.json"))


def pytest_runtest_logstart(nodeid, location):
    """A test that never reports (it hung and the run was killed) counts as failed."""
    _OUTCOMES.setdefault(nodeid, "failed")
    _write_outcomes()


def pytest_runtest_logfinish(nodeid, location):
    _write_outcomes()


def pytest_runtest_logreport(report):
    """One outcome per test id: failed in any phase wins, then skipped, then passed."""
    outcome = report.outcome
    if hasattr(report, "wasxfail"):
        outcome = "xfailed" if report.skipped else "xpassed"
    # setup replaces the provisional "failed" of logstart; later phases can only make it worse
    prev = None if report.when == "setup" else _OUTCOMES.get(report.nodeid)
    if prev == "failed" or (prev is not None and outcome == "passed"):
        return
    _OUTCOMES[report.nodeid] = outcome


def pytest_collectreport(report):
    """A test file that cannot be imported counts as one failed entry under its own id."""
    if report.failed:
        _OUTCOMES[report.nodeid] = "failed"


def pytest_sessionfinish(session, exitstatus):
    _write_outcomes()
