"""Peer harness: CPU stand-ins for the ``torch.cuda`` calls of Megatron-LM's tests and of
Megatron-Core, shared by the pytest plugin (every rank) and ``sitecustomize`` (the processes
Megatron-Core spawns)."""

import contextlib

import torch

_seed = [0]
_ORIG_TYPE = torch.Tensor.type


def _cuda_type_name(self, dtype=None, non_blocking=False, **kwargs):
    """``Tensor.type()`` (no argument) names the ``torch.cuda.*`` type, as on a GPU: Megatron-Core's
    mixed-precision and distributed optimizers accept only parameters whose type() is one of
    ``torch.cuda.{Half,BFloat16,Float}Tensor``. Conversions (``type(dtype)``) are unchanged."""
    if dtype is None and not kwargs:
        name = _ORIG_TYPE(self)
        return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
    return _ORIG_TYPE(self, dtype, non_blocking, **kwargs)


class CpuStream:
    """A CUDA stream's stand-in: everything runs in order on the CPU, so waits are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


def patch_cuda_calls() -> None:
    """Device selection, synchronisation, streams and memory statistics become no-ops, the CUDA
    RNG a CPU generator's state, ``Tensor.cuda()`` the tensor itself, ``Tensor.type()`` the
    ``torch.cuda.*`` name (``get_model`` builds DDP on a side stream; the optimizers check the
    parameters' type names)."""
    cuda = torch.cuda
    cuda.set_device = lambda *a, **k: None
    cuda.current_device = lambda: "cpu"
    cuda.device_count = lambda: 1
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    cuda.manual_seed = cuda.manual_seed_all = lambda seed: _seed.__setitem__(0, int(seed))
    state = lambda *a, **k: torch.Generator().manual_seed(_seed[0]).get_state()  # noqa: E731
    cuda.get_rng_state = cuda.random.get_rng_state = state
    cuda.set_rng_state = cuda.random.set_rng_state = lambda *a, **k: None
    cuda.get_rng_state_all = lambda: [state()]
    cuda.set_rng_state_all = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self
    # Megatron-LM's get_model (the tests' setup_model_and_optimizer) builds DDP on a side stream
    cuda.Stream = CpuStream
    cuda.current_stream = cuda.default_stream = lambda *a, **k: CpuStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.Tensor.type = _cuda_type_name
