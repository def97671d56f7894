"""``ckpt convert --to safetensors`` against today's paths, on a real ~500 MB torch_dist checkpoint.

    python bench/bench_convert.py [--size-mb 500] [--dir bench/out/synthetic_500mb]

Builds the checkpoint with the REAL Megatron-Core writer (``make_synthetic.py`` under torchrun)
unless it exists, then times, each in a fresh process (imports included, page cache warm):

* ``cat`` of the files (the I/O floor)
* ``ckpt convert --to safetensors`` (with its final validation, as users run it)
* Megatron-Core ``load_plain_tensors`` followed by ``torch.save`` of the result
* PyTorch DCP ``dcp_to_torch_save``
* ``python -c "import torch"``: subtracted from peak RSS to get the memory the job itself held
* convert with and without the CRC-32 check of the source (``verify_source``), alternating in
  one process: the check's cost (goal: at most +10%)

and checks the issue's bar: convert >= 3x faster than both peers; peak RSS minus the RSS of
``import torch`` at most 2x the largest tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _harness import python_cmd, report, run  # noqa: E402
from bench_inspect import PATCH, PG, build  # noqa: E402

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=500)
    ap.add_argument("--dir", type=Path)
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    ckpt = a.dir or HERE / "out" / f"synthetic_{a.size_mb}mb"
    build(ckpt, a.size_mb)
    files = sorted(str(p) for p in ckpt.iterdir() if p.is_file())
    size = sum(os.path.getsize(f) for f in files)
    ckpt_bin = shutil.which("ckpt") or "ckpt"
    meta = json.loads(subprocess.run([ckpt_bin, "inspect", "--json", str(ckpt)], check=True,
                                     capture_output=True, text=True).stdout)
    largest = max(t["nbytes"] for t in meta["tensors"].values())
    print(f"checkpoint: {ckpt} ({size / 2**20:.0f} MiB, {len(files)} files, "
          f"largest tensor {largest / 2**20:.1f} MiB)")
    work = HERE / "out" / "convert_work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    st_out, mc_out, dcp_out = work / "st", work / "mcore.pt", work / "dcp.pt"

    runs = [
        run("cat (I/O floor)", ["sh", "-c", 'cat "$@" > /dev/null', "cat", *files],
            repeat=a.repeat),
        run("import torch", python_cmd("import torch"), repeat=a.repeat),
        run("ckpt convert --to safetensors", ["sh", "-c",
            f"rm -rf {st_out} && {ckpt_bin} convert {ckpt} {st_out} --to safetensors"],
            repeat=a.repeat),
        run("megatron-core load_plain_tensors+torch.save", python_cmd(
            PATCH + PG + "import torch; from megatron.core.dist_checkpointing import "
            f"load_plain_tensors as f; torch.save(f({str(ckpt)!r}), {str(mc_out)!r})"),
            repeat=a.repeat),
        run("torch dcp_to_torch_save", python_cmd(
            "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as f; "
            f"f({str(ckpt)!r}, {str(dcp_out)!r})"), repeat=a.repeat),
    ]
    report("convert to one-file formats (end to end, imports included)", runs,
           "megatron-core load_plain_tensors+torch.save")
    by = {r.label: r for r in runs}
    ours = by["ckpt convert --to safetensors"]
    torch_rss = by["import torch"].peak_rss_mb
    held = ours.peak_rss_mb - torch_rss
    for peer in ("megatron-core load_plain_tensors+torch.save", "torch dcp_to_torch_save"):
        print(f"speed-up vs {peer}: {by[peer].seconds / ours.seconds:.2f}x (goal >= 3x)")
    print(f"peak RSS minus import torch: {held:.1f} MB = {held * 2**20 / largest:.2f}x the "
          f"largest tensor (goal <= 2x)")
    print(f"cat throughput share: {by['cat (I/O floor)'].seconds / ours.seconds:.0%}")
    _in_process(ckpt, work, a.repeat + 1)
    shutil.rmtree(work, ignore_errors=True)


def _timed(setup: str, job: str, repeat: int) -> float:
    """Best time of ``job`` in one process after ``setup`` (imports excluded)."""
    code = (setup + "\nimport time\nbest = 1e9\n"
            f"for _ in range({repeat}):\n"
            "    t = time.perf_counter()\n" + "".join(f"    {line}\n" for line in
                                                   job.splitlines()) +
            "    best = min(best, time.perf_counter() - t)\nprint(best)\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    return float(out.stdout.strip().splitlines()[-1])


def _in_process(ckpt: Path, work: Path, repeat: int) -> None:
    """The job alone: every peer already imported (torch, megatron.core, ckpt_tool)."""
    st, pt = work / "st_inproc", work / "inproc.pt"
    ours = _timed(
        "import shutil, torch\nfrom ckpt_tool.ops.convert import convert\n"
        "from ckpt_tool.ops.convert import ConvertOptions",
        f"shutil.rmtree({str(st)!r}, ignore_errors=True)\n"
        f"convert({str(ckpt)!r}, {str(st)!r}, ConvertOptions(to='safetensors'))", repeat)
    dcp = _timed("from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as f",
                 f"f({str(ckpt)!r}, {str(pt)!r})", repeat)
    mcore = _timed(PATCH + PG + "from megatron.core.dist_checkpointing import "
                   "load_plain_tensors as f",
                   f"torch.save(f({str(ckpt)!r}), {str(pt)!r})", repeat)
    print("\nthe job alone, in one process after imports (best of "
          f"{repeat}): ckpt convert (incl. validation) {ours:.3f} s, "
          f"dcp_to_torch_save {dcp:.3f} s ({dcp / ours:.2f}x), "
          f"megatron-core load_plain_tensors+torch.save {mcore:.3f} s ({mcore / ours:.2f}x)")
    _crc_cost(ckpt, work, repeat)


def _crc_cost(ckpt: Path, work: Path, repeat: int) -> None:
    """What checking the source's CRC-32s while reading costs a convert: the same convert
    with and without it (``verify_source``), alternating in one process (so that the page
    cache and the machine's load treat both alike), best of ``repeat`` each, in wall time and
    in the process's CPU time (less sensitive to other jobs on a busy machine); the output is
    validated in both."""
    out = work / "crc_cost"
    code = (
        "import json, shutil, time\nfrom ckpt_tool.ops.convert import convert\n"
        "from ckpt_tool.ops.convert import ConvertOptions\n"
        "import ckpt_tool.formats.containers.torch_zip.archive_check as ac\n"
        "best = {}\n"
        f"for to in ('safetensors', 'torch_dist'):\n"
        f"    for i in range({repeat} * 2 + 1):\n"
        "        check = i % 2 == 1\n"
        "        ac._checked.clear()  # each run checks every item afresh\n"
        f"        shutil.rmtree({str(out)!r}, ignore_errors=True)\n"
        "        t, c = time.perf_counter(), time.process_time()\n"
        f"        convert({str(ckpt)!r}, {str(out)!r}, ConvertOptions(to=to), "
        "verify_source=check)\n"
        "        dt, dc = time.perf_counter() - t, time.process_time() - c\n"
        "        if i:  # the first run warms the page cache\n"
        "            w, p = best.get((to, check), (1e9, 1e9))\n"
        "            best[to, check] = (min(w, dt), min(p, dc))\n"
        "print(json.dumps([[to, check, *s] for (to, check), s in best.items()]))\n")
    res = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    best = {(to, check): (w, c) for to, check, w, c in
            json.loads(res.stdout.strip().splitlines()[-1])}
    shutil.rmtree(out, ignore_errors=True)
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(f"CRC-32 check of the source (best of {repeat}, load average {load}; goal <= +10%):")
    for to in ("safetensors", "torch_dist"):
        (w1, c1), (w0, c0) = best[to, True], best[to, False]
        print(f"  convert --to {to}: wall {w1:.3f} s with, {w0:.3f} s without "
              f"({(w1 / w0 - 1) * 100:+.1f}%); CPU {c1:.3f} s with, {c0:.3f} s without "
              f"({(c1 / c0 - 1) * 100:+.1f}%)")


if __name__ == "__main__":
    main()
