"""Where a command's time goes, phase by phase: CPU seconds (all threads) and wall seconds.

    python bench/profile_phases.py [--cprofile OUT.prof] -- convert SRC DST --to torch_dist

Runs ``ckpt ARGS`` in this process with the main phases of convert/reshard/validate wrapped
(opening the source's metadata, planning, writing the data files, the ``.metadata`` pickle,
verifying the output, the manifest and the final fsync), and prints for each the calls, the
process CPU seconds spent inside it (user + system of every thread: robust on a busy machine)
and the wall seconds. Phases nest (writing includes the ``.metadata`` pickle); "startup" is
everything before the command body (interpreter, imports, argument parsing). With
``--cprofile`` the main thread is also profiled with its CPU clock (``time.thread_time``).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys
import time

# (module, attribute path, label): the phases, outermost first
PHASES = [
    ("ckpt_tool.ops.convert", "convert", "command body (convert)"),
    ("ckpt_tool.ops.reshard", "reshard", "command body (reshard)"),
    ("ckpt_tool.formats.mcore_dist.reader", "TorchDistReader._sharded", "read .metadata"),
    ("ckpt_tool.ops._optim_unflatten", "UnflattenedOptimizerView.__init__",
     "unflatten dp_reshardable buckets"),
    ("ckpt_tool.ops._optim_derived_order", "derive_bucket_layout",
     "  parameter order off the data"),
    ("ckpt_tool.ops._optim_derived_order", "_Reads._local", "    read weights"),
    ("ckpt_tool.ops._optim_derived_order", "_Reads._slot", "    read main params"),
    ("ckpt_tool.ops._optim_derived_order", "_digest", "    digests"),
    ("ckpt_tool.ops.convert._plan", "plan_convert", "plan (convert)"),
    ("ckpt_tool.planning.reshard", "plan_reshard", "plan (reshard)"),
    ("ckpt_tool.formats.containers.dcp.dcp_torch_free_save", "torch_free_dcp_save", "write data files + .metadata"),
    ("ckpt_tool.formats.containers.dcp.dcp_torch_free_save", "_write_metadata", "  .metadata pickle"),
    ("ckpt_tool.formats.safetensors.writer", "SafetensorsWriter.write", "write safetensors"),
    ("ckpt_tool.ops._output_staging", "verify_output", "verify the output"),
    ("ckpt_tool.ops._output_staging", "_add_manifest", "integrity manifest"),
    ("ckpt_tool.ops._output_staging", "fsync_tree", "fsync of the output tree"),
]


class Clock:
    def __init__(self) -> None:
        self.stats: dict[str, list[float]] = {}
        self.depth: dict[str, int] = {}

    def wrap(self, label: str, fn):
        @functools.wraps(fn)
        def inner(*a, **k):
            if self.depth.get(label):  # recursion: count the outermost call only
                return fn(*a, **k)
            self.depth[label] = 1
            c0, w0 = time.process_time(), time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.depth[label] = 0
                s = self.stats.setdefault(label, [0, 0.0, 0.0])
                s[0] += 1
                s[1] += time.process_time() - c0
                s[2] += time.perf_counter() - w0
        return inner


def install(clock: Clock) -> None:
    for mod_name, attr, label in PHASES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        owner, name = mod, attr
        if "." in attr:
            cls, name = attr.split(".")
            owner = getattr(mod, cls, None)
        fn = getattr(owner, name, None) if owner is not None else None
        if fn is None:
            continue
        wrapped = clock.wrap(label, fn)
        setattr(owner, name, wrapped)
        if owner is mod:  # modules that imported the name directly
            for other in list(sys.modules.values()):
                if getattr(other, "__name__", "").startswith("ckpt_tool") and \
                        getattr(other, name, None) is fn:
                    setattr(other, name, wrapped)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cprofile", metavar="OUT")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    c_start = time.process_time()  # the interpreter's own start-up is before this
    w_start = time.perf_counter()
    clock = Clock()
    from ckpt_tool.cli.app import main as ckpt_main

    install(clock)
    c_ready, w_ready = time.process_time(), time.perf_counter()
    prof = None
    if a.cprofile:
        import cProfile

        prof = cProfile.Profile(time.thread_time)
        prof.enable()
    sys.argv = ["ckpt", *args]
    code = 0
    try:
        ckpt_main()
    except SystemExit as exc:
        code = exc.code or 0
    if prof is not None:
        prof.disable()
        prof.dump_stats(a.cprofile)
    c_end, w_end = time.process_time(), time.perf_counter()
    out = sys.stderr
    print(f"\n{'phase':34s} {'calls':>5s} {'CPU s':>8s} {'wall s':>8s}", file=out)
    print(f"{'imports of the CLI':34s} {1:5d} {c_ready - c_start:8.2f} {w_ready - w_start:8.2f}",
          file=out)
    for _m, _a, label in PHASES:
        if label in clock.stats:
            n, cpu, wall = clock.stats[label]
            print(f"{label:34s} {n:5d} {cpu:8.2f} {wall:8.2f}", file=out)
    print(f"{'total (after interpreter start)':34s} {'':5s} {c_end - c_start:8.2f} "
          f"{w_end - w_start:8.2f}", file=out)
    print(f"exit {code}; {os.getloadavg()[0]:.1f} load", file=out)
    sys.exit(code)


if __name__ == "__main__":
    main()
