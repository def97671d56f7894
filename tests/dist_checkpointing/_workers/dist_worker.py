"""torchrun worker: save or load the ``layouts`` test model with MCore's library or ours.

    torchrun --nproc-per-node N dist_worker.py --lib {mcore,ours} --op {save,load}
        --layout tp2pp2 --dir CKPT [--no-objects]

``load`` checks every loaded value against the ground truth and exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import layouts  # noqa: E402


def patch_cuda_for_mcore() -> None:
    """docs/formats.md §8: what MCore's torch_dist save needs on a CPU-only machine."""
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"


def import_mcore_light() -> None:
    """Import ``megatron.core.dist_checkpointing`` without running ``megatron/core/__init__``.

    That ``__init__`` pulls in models, fusions and torch.compile (tens of seconds per rank on a
    small machine); the checkpointing package needs none of it.
    """
    import importlib.util
    import types

    if "megatron.core" in sys.modules:
        return
    root = list(importlib.util.find_spec("megatron").submodule_search_locations)[0]
    for name, path in (("megatron", root), ("megatron.core", os.path.join(root, "core"))):
        mod = types.ModuleType(name)
        mod.__path__ = [path]
        sys.modules[name] = mod
    import megatron.core.parallel_state  # noqa: F401  (breaks the utils <-> parallel_state cycle)


def import_lib(name: str):
    if name == "mcore":
        patch_cuda_for_mcore()
        import_mcore_light()
        from megatron.core import dist_checkpointing as lib
        from megatron.core.dist_checkpointing import mapping
    else:
        from ckpt_tool import dist_checkpointing as lib
        from ckpt_tool.dist_checkpointing import mapping
    return lib, mapping


def compare(loaded, expected, path="") -> list:
    """Differences between a loaded state dict and the expected one (nested dicts)."""
    errors = []
    if isinstance(expected, dict):
        for k, v in expected.items():
            if k not in loaded:
                errors.append(f"missing {path}{k}")
            else:
                errors += compare(loaded[k], v, f"{path}{k}.")
    elif isinstance(expected, torch.Tensor):
        if not isinstance(loaded, torch.Tensor):
            errors.append(f"{path}: not a tensor ({type(loaded)})")
        elif loaded.dtype != expected.dtype or loaded.shape != expected.shape:
            errors.append(f"{path}: {loaded.dtype}{tuple(loaded.shape)} != "
                          f"{expected.dtype}{tuple(expected.shape)}")
        elif not torch.equal(loaded, expected):
            errors.append(f"{path}: values differ")
    elif loaded != expected:
        errors.append(f"{path}: {loaded!r} != {expected!r}")
    return errors


def expected_state(sd):
    """The ground-truth local state dict: sharded values replaced by their data."""
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out[k] = expected_state(v)
        else:
            out[k] = v.data
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--lib", choices=["mcore", "ours"], required=True)
    p.add_argument("--op", choices=["save", "load"], required=True)
    p.add_argument("--layout", required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--no-objects", action="store_true")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    lib, mapping = import_lib(args.lib)
    layout = layouts.parse_layout(args.layout, rank, world)
    with_objects = not args.no_objects

    if args.op == "save":
        if rank == 0 and "://" not in args.dir:  # (an s3:// or msc:// URL: no directory)
            os.makedirs(args.dir, exist_ok=True)
        dist.barrier()
        sd = layouts.build_sharded_state_dict(mapping, layout, with_objects)
        sd.update(layouts.common_state())
        lib.save(sd, args.dir)
        return 0

    target = layouts.build_sharded_state_dict(mapping, layout, with_objects, empty=True)
    truth = expected_state(layouts.build_sharded_state_dict(mapping, layout, with_objects))
    for key in ("rng_state", "extra"):
        if key in truth:
            truth[key] = layouts.expected_object(target[key].key, layout)
    loaded = lib.load(target, args.dir)
    errors = compare(loaded, truth)
    errors += compare(loaded, layouts.common_state())
    if errors:
        print(f"rank {rank}: " + "; ".join(errors), file=sys.stderr)
        return 1
    print(f"rank {rank}: OK")
    return 0


if __name__ == "__main__":
    from ckpt_tool._torchrun import exit_cleanly

    exit_cleanly(main())
