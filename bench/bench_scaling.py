"""Writing speed and scaling of convert/reshard: ``--workers N`` and ``torchrun -n N`` against the disk.

    python bench/bench_scaling.py [--size-mb 500] [--build-ranks 2] [--counts 1 2 4 8]
                                  [--targets torch_dist safetensors dcp reshard] [--repeat 3]

One command prints everything (meant to be cheap to run on a bigger machine):

1. builds a GPT-shaped torch_dist checkpoint of ``--size-mb`` with the REAL Megatron-Core writer
   (``make_synthetic.py`` under ``torchrun -n --build-ranks``: TP = build ranks, stacked layers,
   one DCP item per layer and rank), unless it exists;
2. the disk floor: the same number of bytes written with ``os.write`` in 16 MiB blocks and
   fsynced, by 1..N threads into as many files (dd-like), as MB/s;
3. for each target (``convert --to torch_dist|safetensors|dcp``, ``reshard --tp 2*build
   ranks``) and each count N: ``--workers N`` in one process and ``torchrun -n N``; every
   configuration ``--repeat`` times, alternating (round robin over all configurations), in
   fresh processes with the page cache warm. Printed: the median of the command's own time
   (``--json`` ``seconds``: after Python start-up, imports of the command included), the median
   wall time, the speed-up over N=1, MB/s of output, and the peak RSS of the largest process
   (``wait4``: the largest rank under torchrun).

Every output is fsynced and verified, as users run the commands. ``uptime`` is printed before
and after: on a shared machine the load is part of the result.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def build(out: Path, size_mb: int, ranks: int, hidden: int | None) -> None:
    if (out / "metadata.json").exists():
        return
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    extra = ["--hidden", str(hidden)] if hidden else []
    subprocess.run([shutil.which("torchrun") or "torchrun", "--nproc-per-node", str(ranks),
                    "--master-port", "29641", str(HERE / "make_synthetic.py"), str(out),
                    "--size-mb", str(size_mb), *extra],
                   check=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})


def disk_floor(work: Path, nbytes: int, streams: int) -> float:
    """MB/s of writing ``nbytes`` in 16 MiB blocks with fsync, over ``streams`` threads."""
    block = os.urandom(16 << 20)
    share = nbytes // streams

    def one(i: int) -> None:
        fd = os.open(work / f"floor{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left = share
            while left > 0:
                left -= os.write(fd, memoryview(block)[:min(left, len(block))])
            os.fsync(fd)
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    for i in range(streams):
        os.unlink(work / f"floor{i}")
    return nbytes / dt / 1e6


def run_once(argv: list[str], out: Path, code: str | None) -> tuple[float, float, float, float]:
    """(command's own seconds, wall seconds, peak RSS MB of the largest process, CPU
    seconds of the whole process tree: less sensitive to a loaded machine); ``code``:
    the checkout to import ``ckpt_tool`` from (PYTHONPATH), None: as installed."""
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    if code:
        env["PYTHONPATH"] = code
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    stdout = proc.stdout.read()
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"failed: {' '.join(argv)}\n{stderr.decode(errors='replace')[-3000:]}")
    doc = json.loads(stdout.decode()) if stdout.strip() else {}
    shutil.rmtree(out, ignore_errors=True)
    return (float(doc.get("seconds", wall)), wall, usage.ru_maxrss / 1024,
            usage.ru_utime + usage.ru_stime)


def command(target: str, src: Path, out: Path, n: int, ranks: bool, tp: int) -> list[str]:
    ckpt = [shutil.which("ckpt") or "ckpt"]
    if ranks:
        ckpt = [shutil.which("torchrun") or "torchrun", "--standalone", "--nproc-per-node",
                str(n), "-m", "ckpt_tool"]
    if target == "reshard":
        args = ["reshard", str(src), str(out), "--tp", str(tp)]
    else:
        args = ["convert", str(src), str(out), "--to", target]
    if not ranks:
        args += ["--workers", str(n)]
    return ckpt + args + ["--json"]


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=500)
    ap.add_argument("--build-ranks", type=int, default=2, help="TP of the built checkpoint")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--dir", type=Path, help="an existing torch_dist checkpoint instead")
    ap.add_argument("--work", type=Path, default=HERE / "out" / "scaling_work")
    ap.add_argument("--counts", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--targets", nargs="+",
                    default=["torch_dist", "safetensors", "dcp", "reshard"])
    ap.add_argument("--modes", nargs="+", default=["workers", "torchrun"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--compare-with", metavar="CHECKOUT",
                    help="also time the ckpt_tool of this checkout (e.g. the main branch), "
                    "alternating with this one: the before/after of a change")
    a = ap.parse_args()
    print(f"machine: {os.cpu_count()} CPUs; {uptime()}")
    src = a.dir or HERE / "out" / f"synthetic_{a.size_mb}mb_tp{a.build_ranks}"
    build(src, a.size_mb, a.build_ranks, a.hidden)
    files = [p for p in src.iterdir() if p.is_file()]
    nbytes = sum(p.stat().st_size for p in files)
    items = json.loads(subprocess.run([shutil.which("ckpt") or "ckpt", "inspect", "--json",
                                       str(src)], capture_output=True, text=True,
                                      check=True).stdout)
    chunks = sum(int(t.get("chunks", 0)) for t in items["tensors"].values())
    print(f"source: {src} ({nbytes / 2**20:.0f} MiB, {len(files)} files, "
          f"{len(items['tensors'])} tensors, {chunks} chunks)")
    shutil.rmtree(a.work, ignore_errors=True)
    a.work.mkdir(parents=True)
    for _ in range(1):  # page cache warm
        subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)

    imp = [run_once([sys.executable, "-c", "import torch.distributed.checkpoint"],
                    a.work / "none", None) for _ in range(a.repeat)]
    print(f"import torch + torch.distributed.checkpoint: {statistics.median(r[1] for r in imp):.2f}"
          f" s wall, {statistics.median(r[3] for r in imp):.2f} s CPU (safetensors targets "
          "never import torch; torch_dist/dcp/reshard do)")
    print("\ndisk floor (os.write 16 MiB blocks + fsync, same bytes, N files on N threads):")
    floors = {}
    for n in a.counts:
        floors[n] = statistics.median(disk_floor(a.work, nbytes, n) for _ in range(a.repeat))
        print(f"  N={n}: {floors[n]:8.0f} MB/s  ({nbytes / floors[n] / 1e6:.2f} s)")

    here = str(HERE.parent)
    codes = [("this", here)] + ([("other", a.compare_with)] if a.compare_with else [])
    configs = [(t, m, n, c) for t in a.targets for m in a.modes for n in a.counts
               for c, _ in codes]
    times: dict[tuple, list[tuple[float, float, float]]] = {c: [] for c in configs}
    for rep in range(a.repeat):  # round robin: every configuration sees the same load
        for c in configs:
            t, m, n, code = c
            argv = command(t, src, a.work / "out", n, m == "torchrun", 2 * a.build_ranks)
            times[c].append(run_once(argv, a.work / "out", dict(codes)[code]))
        print(f"  round {rep + 1}/{a.repeat} done; {uptime()}", flush=True)

    print(f"\n{'code':5s} {'target':12s} {'mode':9s} {'N':>2s} {'own s':>7s} {'wall s':>7s} "
          f"{'speed-up':>8s} {'MB/s':>7s} {'floor MB/s':>10s} {'peak RSS MB':>11s} "
          f"{'CPU s':>6s}")
    med = {}
    for code, _ in codes:
        for t in a.targets:
            for m in a.modes:
                base = None
                for n in a.counts:
                    runs = times[(t, m, n, code)]
                    own = statistics.median(r[0] for r in runs)
                    wall = statistics.median(r[1] for r in runs)
                    rss = max(r[2] for r in runs)
                    cpu = statistics.median(r[3] for r in runs)
                    med[(t, m, n, code)] = own
                    base = base or own
                    print(f"{code:5s} {t:12s} {m:9s} {n:2d} {own:7.2f} {wall:7.2f} "
                          f"{base / own:7.2f}x {nbytes / own / 1e6:7.0f} {floors[n]:10.0f} "
                          f"{rss:11.0f} {cpu:6.2f}")
    for code, _ in codes:
        for m in a.modes:
            for n in a.counts:
                k = ("torch_dist", m, n, code), ("safetensors", m, n, code)
                if k[0] in med and k[1] in med:
                    print(f"{code}: --to torch_dist / --to safetensors ({m}, N={n}): "
                          f"{med[k[0]] / med[k[1]]:.2f}x")
    print(f"\n{uptime()}")
    shutil.rmtree(a.work, ignore_errors=True)


if __name__ == "__main__":
    main()
