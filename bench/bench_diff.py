"""``ckpt diff A A_copy`` against ``cat`` of both inputs on a real ~500 MB torch_dist checkpoint.

    python bench/bench_diff.py [--size-mb 500] [--dir bench/out/synthetic_500mb] [--repeat 3]

Builds the checkpoint with the REAL Megatron-Core writer (``make_synthetic.py`` under torchrun,
as ``bench_inspect.py`` does) unless it exists, copies it next to itself, byte-compiles
``ckpt_tool`` (as ``pip install`` does: an editable checkout under ``PYTHONDONTWRITEBYTECODE=1``
would otherwise compile ~30 modules from source on every start, ~40 ms), then times, each in
a fresh process (imports included, page cache warm):

* ``cat A/* B/* > /dev/null``: the I/O floor, both inputs;
* ``ckpt diff --json A B``: every value compared;
* ``ckpt diff --keys-only A B``: the fixed cost (start-up, both metadata, common state);
* ``ops.diff.diff(A, B)`` timed inside one process after the imports (what the comparison
  itself costs, metadata included).

Prints peak RSS and the throughput ratios ``t(cat) / t(diff)`` end to end and in-process (the
goal: at least 0.70).
"""

from __future__ import annotations

import argparse
import compileall
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _harness import report, run  # noqa: E402
from bench_inspect import build  # noqa: E402

HERE = Path(__file__).resolve().parent


def _in_process(a: Path, b: Path) -> float:
    """Seconds of ``diff(a, b)`` in a fresh process whose imports are already done."""
    code = ("import time; from ckpt_tool.ops.diff import diff; import ckpt_tool.formats; "
            f"t = time.perf_counter(); r = diff({str(a)!r}, {str(b)!r}); "
            "print(time.perf_counter() - t); assert r.identical")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout
    return float(out.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=500)
    ap.add_argument("--dir", type=Path)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    ckpt = a.dir or HERE / "out" / f"synthetic_{a.size_mb}mb"
    build(ckpt, a.size_mb)
    copy = ckpt.parent / (ckpt.name + "_copy")
    if not (copy / "metadata.json").exists():
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(ckpt, copy)
    compileall.compile_dir(HERE.parent / "ckpt_tool", quiet=1)
    files = sorted(str(p) for d in (ckpt, copy) for p in d.iterdir() if p.is_file())
    size = sum(os.path.getsize(f) for f in files)
    print(f"inputs: {ckpt} and {copy} ({size / 2**20:.0f} MiB together, {len(files)} files)")

    ckpt_bin = shutil.which("ckpt") or "ckpt"
    runs = [
        run("cat A/* B/* (I/O floor)", ["sh", "-c", 'cat "$@" > /dev/null', "cat", *files],
            repeat=a.repeat),
        run("ckpt diff --keys-only (fixed cost)",
            [ckpt_bin, "diff", "--keys-only", "--json", str(ckpt), str(copy)], repeat=a.repeat),
        run("ckpt diff (all values)", [ckpt_bin, "diff", "--json", str(ckpt), str(copy)],
            repeat=a.repeat),
    ]
    report("ckpt diff A A_copy (end to end, imports included)", runs, "cat A/* B/* (I/O floor)")
    cat, keys, full = (r.seconds for r in runs)
    inproc = min(_in_process(ckpt, copy) for _ in range(a.repeat))
    print(f"\nthroughput: cat {size / cat / 2**30:.2f} GiB/s; ckpt diff end to end "
          f"{size / full / 2**30:.2f} GiB/s (ratio {cat / full:.2f}); in-process "
          f"{size / inproc / 2**30:.2f} GiB/s in {inproc:.3f} s (ratio {cat / inproc:.2f}); "
          "goal >= 0.70")
    print(f"peak RSS: ckpt diff {runs[2].peak_rss_mb:.0f} MB, --keys-only "
          f"{runs[1].peak_rss_mb:.0f} MB, cat {runs[0].peak_rss_mb:.0f} MB")


if __name__ == "__main__":
    main()
