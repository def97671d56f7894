"""Every command on a production-sized checkpoint, against the I/O floor and the peers.

    python bench/bench_large.py --size-gb 20 [--jobs floor ours peers] [--out results.json]
    python bench/bench_large.py --size-gb 5 --jobs curve --out curve_5.json
    python bench/bench_large.py --plot docs/performance_growth.png curve_*.json

Builds (unless it exists) ``bench/out/moe_<size>gb``: a MoE GPT with bf16 weights and the
DistributedOptimizer's fp32 state written by the real Megatron-Core
(``make_moe_optim.py`` under ``torchrun -n 8``: TP2, EP8). Then runs each job once, in a
fresh process, and records wall seconds, CPU seconds (user + system of the whole process
tree: what a busy machine distorts least), the peak RSS of its largest process and the peak
anonymous memory of the tree (``RssAnon`` sampled every 20 ms: what the job holds, file
pages of mapped checkpoint files excluded), with ``uptime`` before and after:

* ``floor``: ``cat`` of the checkpoint's files (reading) and ``dd`` of as many bytes with
  ``conv=fsync`` (writing);
* ``ours``: ``inspect --json``, ``validate --deep``, ``convert --to safetensors / hf /
  torch_dist``, ``diff`` of the source against its torch_dist conversion, ``reshard --tp 4
  --ep 4`` (optimizer state included);
* ``peers`` (each under ``RLIMIT_DATA`` = ``--peer-cap-gb``, so a peer that materialises the
  checkpoint dies alone instead of taking the machine): Megatron-Core ``load_plain_tensors`` +
  ``torch.save``, PyTorch DCP ``dcp_to_torch_save``;
* ``curve``: ``convert --to safetensors``, ``--to torch_dist`` and ``reshard`` only;
* ``dist``: ``convert --to torch_dist`` and ``reshard`` only (with ``validate``:
  ``validate --deep`` too).

``--reshard "--tp 1 --ep 8"``: the reshard job's target (default ``--tp 4 --ep 4``).
``--dir``: an existing checkpoint instead of building one (``make_deepseek_optim.py``'s
DeepSeek-V3-shaped one with ``dp_reshardable`` optimizer state, for example).

``--cold``: before every job, the page cache is emptied (``sync``, then
``/proc/sys/vm/drop_caches``) where the process may; where it may not, each file of the
source is evicted with ``posix_fadvise(DONTNEED)`` instead; each record says which
(``"cold"``). ``--code DIR``: run ``ckpt`` from that checkout (``PYTHONPATH``), to time
another version of the code in the same run (``"code"`` in each record).

Outputs go to ``--work`` and are deleted after each job (the disk holds the input and one
output). ``--out`` writes the records as JSON; ``--plot`` draws time per GB and peak memory
against size from such files (matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _harness import _tree_anon_kib  # noqa: E402

PATCH = ("import torch; torch.cuda.synchronize=lambda *a,**k: None; "
         "torch.cuda.current_device=lambda: 'cpu'; ")
PG = ("import torch.distributed as d; d.init_process_group('gloo', "
      "init_method='tcp://127.0.0.1:29657', rank=0, world_size=1); ")
# Megatron-LM's args hold numpy scalars (init_method_std): torch.load(weights_only=True) of
# common.pt refuses them unless allowed, as a user of load_plain_tensors would allow them
NUMPY_OK = ("import numpy as np; torch.serialization.add_safe_globals([np._core.multiarray.scalar, "
            "np.dtype, type(np.dtype(np.float64))]); ")


COLD: list[Path] | None = None  # the files to evict before each job (``--cold``)
CODE: Path | None = None  # ``--code``


def make_cold(files: list[Path]) -> str:
    """Empty the page cache (see the module docstring); how it was done."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "drop_caches"
    except OSError:
        for p in files:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "fadvise DONTNEED of the source (drop_caches not permitted)"


def uptime() -> str:
    return os.popen("uptime").read().strip()


def ckpt() -> list[str]:
    exe = shutil.which("ckpt")
    return [exe] if exe else [sys.executable, "-m", "ckpt_tool"]


def build(size_gb: float, ranks: int) -> Path:
    out = HERE / "out" / f"moe_{size_gb:g}gb"
    if not (out / "latest_checkpointed_iteration.txt").exists():
        shutil.rmtree(out, ignore_errors=True)
        subprocess.run(["torchrun", "--nproc-per-node", str(ranks), "--master-port", "29667",
                        str(HERE / "make_moe_optim.py"), str(out), "--size-gb", str(size_gb)],
                       check=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    return next(out.glob("iter_*"))


def measure(label: str, argv: list[str], *, cap: int | None = None,
            timeout: float | None = None, log: list | None = None) -> dict:
    """Run ``argv``; its record (see the module docstring). ``cap``: RLIMIT_DATA in bytes."""

    def limit() -> None:
        if cap:
            resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))

    cold = make_cold(COLD) if COLD is not None else None
    before = uptime()
    t0 = time.perf_counter()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    if CODE is not None:
        env["PYTHONPATH"] = str(CODE)
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=limit, start_new_session=True, env=env)
    err = bytearray()
    fd = proc.stderr.fileno()
    os.set_blocking(fd, False)

    def drain() -> None:
        while True:
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                return
            if not chunk:
                return
            err.extend(chunk)
            del err[:-20000]

    anon, killed = 0, False
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        drain()
        if pid:
            break
        anon = max(anon, _tree_anon_kib(proc.pid))
        if timeout and time.perf_counter() - t0 > timeout:
            os.killpg(proc.pid, 9)
            killed = True
        time.sleep(0.02)
    wall = time.perf_counter() - t0
    proc.stderr.close()
    rc = os.waitstatus_to_exitcode(status)
    rec = {"job": label, "argv": argv, "rc": rc, "wall_s": round(wall, 2),
           "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
           "peak_rss_mb": round(usage.ru_maxrss / 1024), "peak_anon_mb": round(anon / 1024),
           "cap_gb": cap / 1e9 if cap else None, "timed_out": killed,
           "uptime_before": before, "uptime_after": uptime(), "cold": cold,
           "code": str(CODE) if CODE else None}
    if rc != 0:
        rec["error"] = err.decode(errors="replace").strip().splitlines()[-3:]
    print(f"{label:44s} rc={rc:<3d} {wall:8.1f} s wall {rec['cpu_s']:8.1f} s CPU "
          f"{rec['peak_anon_mb']:7d} MB anon {rec['peak_rss_mb']:7d} MB RSS  "
          f"[{before.split('load average:')[-1].strip()}]", flush=True)
    if rc != 0:
        print("   " + " | ".join(rec["error"]), flush=True)
    if log is not None:
        log.append(rec)
    return rec


def files_of(src: Path) -> list[Path]:
    return sorted(p for p in src.iterdir() if p.is_file())


def run_floor(src: Path, work: Path, nbytes: int, log: list) -> None:
    files = [str(p) for p in files_of(src)]
    measure("floor: cat (read)", ["sh", "-c", 'cat "$@" > /dev/null', "cat", *files], log=log)
    count = max(1, nbytes // (16 << 20))
    target = work / "floor.bin"
    measure("floor: dd write + fsync", ["dd", "if=/dev/zero", f"of={target}", "bs=16M",
                                        f"count={count}", "conv=fsync", "status=none"], log=log)
    target.unlink(missing_ok=True)


def run_ours(src: Path, work: Path, log: list, *, curve_only: bool = False,
             workers: int = 1, dist_only: bool = False, validate: bool = False,
             reshard: str = "--tp 4 --ep 4") -> None:
    c = ckpt()
    out = work / "out"
    w = ["--workers", str(workers)] if workers > 1 else []

    def job(label: str, args: list[str], *, keep: bool = False) -> dict:
        shutil.rmtree(out, ignore_errors=True)
        rec = measure(label, c + args, log=log)
        if not keep:
            shutil.rmtree(out, ignore_errors=True)
        return rec

    if not curve_only:
        job("ckpt inspect --json", ["inspect", "--json", str(src)])
    if not curve_only or validate:
        job("ckpt validate --deep", ["validate", "--deep", str(src)])
    if not dist_only:
        job("ckpt convert --to safetensors", ["convert", str(src), str(out), "--to",
                                              "safetensors", *w])
    if not curve_only:
        job("ckpt convert --to hf", ["convert", str(src), str(out), "--to", "hf"])
    job("ckpt convert --to torch_dist", ["convert", str(src), str(out), "--to", "torch_dist",
                                         *w], keep=not curve_only)
    if not curve_only:
        measure("ckpt diff (source vs its conversion)", c + ["diff", str(src), str(out)],
                log=log)
        shutil.rmtree(out, ignore_errors=True)
    job(f"ckpt reshard {reshard} (with optimizer)",
        ["reshard", str(src), str(out), *reshard.split(), *w])


def run_peers(src: Path, work: Path, log: list, cap: int, timeout: float | None) -> None:
    out = work / "peer.pt"
    py = [sys.executable, "-c"]
    jobs = [
        ("Megatron-Core load_plain_tensors + torch.save",
         PATCH + PG + NUMPY_OK + "from megatron.core.dist_checkpointing import "
         "load_plain_tensors as f; "
         f"torch.save(f({str(src)!r}), {str(out)!r})"),
        ("PyTorch DCP dcp_to_torch_save",
         "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as f; "
         f"f({str(src)!r}, {str(out)!r})"),
    ]
    for label, code in jobs:
        out.unlink(missing_ok=True)
        measure(label, py + [code], cap=cap, timeout=timeout, log=log)
        out.unlink(missing_ok=True)


def plot(png: Path, results: list[Path]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[float, float, float]]] = {}
    for path in results:
        doc = json.loads(path.read_text())
        gb = doc["nbytes"] / 1e9
        for rec in doc["records"]:
            if rec["rc"] == 0 and rec["job"].startswith("ckpt "):
                series.setdefault(rec["job"], []).append(
                    (gb, rec["cpu_s"] / gb, rec["peak_anon_mb"]))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for job, pts in sorted(series.items()):
        if len(pts) < 2:
            continue
        pts.sort()
        xs = [p[0] for p in pts]
        a1.plot(xs, [p[1] for p in pts], "o-", label=job.removeprefix("ckpt "))
        a2.plot(xs, [p[2] for p in pts], "o-", label=job.removeprefix("ckpt "))
    a1.set(xlabel="checkpoint size (GB)", ylabel="CPU seconds per GB", ylim=(0, None),
           title="time per GB (CPU, all threads)")
    a2.set(xlabel="checkpoint size (GB)", ylabel="peak anonymous memory (MB)", ylim=(0, None),
           title="peak memory")
    a1.legend(fontsize=8)
    a1.grid(alpha=0.3)
    a2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=20)
    ap.add_argument("--dir", type=Path, help="an existing checkpoint instead of building one")
    ap.add_argument("--build-ranks", type=int, default=8)
    ap.add_argument("--jobs", nargs="+", default=["floor", "ours", "peers"],
                    choices=["floor", "ours", "peers", "curve", "dist", "validate"])
    ap.add_argument("--reshard", default="--tp 4 --ep 4", help="the reshard job's target")
    ap.add_argument("--cold", action="store_true", help="empty the page cache before each job")
    ap.add_argument("--code", type=Path, help="run ckpt from this checkout")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--peer-cap-gb", type=float, default=8.0)
    ap.add_argument("--peer-timeout", type=float)
    ap.add_argument("--work", type=Path, default=HERE / "out" / "large_work")
    ap.add_argument("--out", type=Path, help="write the records here (JSON)")
    ap.add_argument("--plot", type=Path, help="draw the growth curve from the JSON files given")
    ap.add_argument("results", nargs="*", type=Path)
    a = ap.parse_args()
    if a.plot:
        plot(a.plot, a.results)
        return
    global COLD, CODE
    src = a.dir or build(a.size_gb, a.build_ranks)
    CODE = a.code.resolve() if a.code else None
    if a.cold:
        COLD = files_of(src)
    nbytes = sum(p.stat().st_size for p in files_of(src))
    meta = json.loads(subprocess.run(ckpt() + ["inspect", "--json", str(src)], check=True,
                                     capture_output=True, text=True).stdout)
    chunks = sum(int(t.get("chunks", 0)) for t in meta["tensors"].values())
    largest = max(int(t["nbytes"]) for t in meta["tensors"].values())
    print(f"machine: {os.cpu_count()} CPUs, {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB; {uptime()}")
    print(f"source: {src} ({nbytes / 1e9:.2f} GB, {len(files_of(src))} files, "
          f"{len(meta['tensors'])} tensors, {chunks} chunks, largest tensor "
          f"{largest / 2**20:.0f} MiB)", flush=True)
    a.work.mkdir(parents=True, exist_ok=True)
    log: list[dict] = []
    if "floor" in a.jobs:
        run_floor(src, a.work, nbytes, log)
    if {"ours", "curve", "dist", "validate"} & set(a.jobs):
        run_ours(src, a.work, log, curve_only="ours" not in a.jobs, workers=a.workers,
                 dist_only=not {"ours", "curve"} & set(a.jobs),
                 validate="validate" in a.jobs, reshard=a.reshard)
    if "peers" in a.jobs:
        run_peers(src, a.work, log, int(a.peer_cap_gb * 1e9), a.peer_timeout)
    shutil.rmtree(a.work, ignore_errors=True)
    if a.out:
        a.out.write_text(json.dumps({"source": str(src), "nbytes": nbytes, "chunks": chunks,
                                     "largest_tensor": largest, "cpus": os.cpu_count(),
                                     "records": log}, indent=1) + "\n")
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
