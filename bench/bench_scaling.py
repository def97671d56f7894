"""Writing speed and scaling of convert/reshard: ``--workers N`` and ``torchrun -n N`` against the disk.

    python bench/bench_scaling.py [--size-mb 500] [--build-ranks 2] [--counts 1 2 4 8]
                                  [--targets torch_dist safetensors dcp reshard] [--repeat 3]
                                  [--budget-s S] [--floor-mb MB] [--run-timeout S]

One command prints everything (meant to be cheap to run on a bigger machine):

1. builds a GPT-shaped torch_dist checkpoint of ``--size-mb`` with the REAL Megatron-Core writer
   (``make_synthetic.py`` under ``torchrun -n --build-ranks``: TP = build ranks, stacked layers,
   one DCP item per layer and rank), unless it exists;
2. the disk floor: the same number of bytes (or ``--floor-mb``) written with ``os.write`` in
   16 MiB blocks and fsynced, by 1..N threads into as many files (dd-like), as MB/s;
3. for each target (``convert --to torch_dist|safetensors|dcp``, ``reshard --tp 2*build
   ranks``) and each count N: ``--workers N`` in one process and ``torchrun -n N``; every
   configuration ``--repeat`` times, alternating (round robin over all configurations), in
   fresh processes with the page cache warm. Printed: the median of the command's own time
   (``--json`` ``seconds``: after Python start-up, imports of the command included), the median
   wall time, the speed-up over N=1, MB/s of output, and the peak RSS of the largest process
   (``wait4``: the largest rank under torchrun).

Every output is fsynced and verified, as users run the commands. ``uptime`` is printed before
and after: on a shared machine the load is part of the result. Each run is printed as it ends;
with ``--budget-s`` no run starts once that many seconds have passed since the start (the
build included) and the table holds what ran; a failed or timed-out run is reported and
skipped, the others go on. ``ckpt`` and ``torchrun`` are taken from ``PATH``, else run as
``python -m ckpt_tool`` / ``python -m torch.distributed.run``.
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


def _ckpt() -> list[str]:
    exe = shutil.which("ckpt")
    return [exe] if exe else [sys.executable, "-m", "ckpt_tool"]


def _torchrun() -> list[str]:
    exe = shutil.which("torchrun")
    return [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]


def build(out: Path, size_mb: int, ranks: int, hidden: int | None) -> None:
    if (out / "metadata.json").exists():
        return
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    extra = ["--hidden", str(hidden)] if hidden else []
    subprocess.run([*_torchrun(), "--nproc-per-node", str(ranks),
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


def run_once(argv: list[str], out: Path, code: str | None,
             timeout: float | None = None) -> tuple[float, float, float, float, int] | None:
    """(command's own seconds, wall seconds, peak RSS MB of the largest process, CPU
    seconds of the whole process tree: less sensitive to a loaded machine, its context
    switches: voluntary ones count the waits for the GIL, locks and I/O), or None when the
    command failed or ran past ``timeout`` (said on stderr); ``code``: the checkout to import
    ``ckpt_tool`` from (first on PYTHONPATH), None: as installed."""
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    if code:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (code, os.environ.get("PYTHONPATH")) if p)
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            start_new_session=True)
    got: dict[str, bytes] = {}
    readers = [threading.Thread(target=lambda k, f: got.__setitem__(k, f.read()), args=(k, f))
               for k, f in (("out", proc.stdout), ("err", proc.stderr))]
    for r in readers:
        r.start()
    while True:  # wait4 (not Popen.wait): the rusage of the whole tree
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if timeout is not None and time.perf_counter() - t0 > timeout:
            os.killpg(proc.pid, 9)  # torchrun's ranks too
            os.wait4(proc.pid, 0)
            proc.returncode = -9
            for r in readers:
                r.join()
            shutil.rmtree(out, ignore_errors=True)
            print(f"timed out after {timeout:.0f} s: {' '.join(argv)}", file=sys.stderr,
                  flush=True)
            return None
        time.sleep(0.01)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    for r in readers:
        r.join()
    stdout, stderr = got["out"], got["err"]
    shutil.rmtree(out, ignore_errors=True)
    if os.waitstatus_to_exitcode(status) != 0:
        print(f"failed ({os.waitstatus_to_exitcode(status)}): {' '.join(argv)}\n"
              f"{stderr.decode(errors='replace')[-3000:]}", file=sys.stderr, flush=True)
        return None
    doc = json.loads(stdout.decode()) if stdout.strip() else {}
    return (float(doc.get("seconds", wall)), wall, usage.ru_maxrss / 1024,
            usage.ru_utime + usage.ru_stime, usage.ru_nvcsw + usage.ru_nivcsw)


def command(target: str, src: Path, out: Path, n: int, ranks: bool, tp: int) -> list[str]:
    ckpt = _ckpt()
    if ranks:
        ckpt = [*_torchrun(), "--standalone", "--nproc-per-node", str(n), "-m", "ckpt_tool"]
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
    ap.add_argument("--budget-s", type=float, help="start no run after this many seconds "
                    "(counted from the start, the build included); the table holds what ran")
    ap.add_argument("--run-timeout", type=float, help="seconds before a run is killed")
    ap.add_argument("--floor-mb", type=int, help="MB each disk-floor run writes (default: the "
                    "source's size)")
    ap.add_argument("--compare-with", metavar="CHECKOUT",
                    help="also time the ckpt_tool of this checkout (e.g. the main branch), "
                    "alternating with this one: the before/after of a change")
    a = ap.parse_args()
    start = time.perf_counter()
    print(f"machine: {os.cpu_count()} CPUs; {uptime()}")
    src = a.dir or HERE / "out" / f"synthetic_{a.size_mb}mb_tp{a.build_ranks}"
    build(src, a.size_mb, a.build_ranks, a.hidden)
    files = [p for p in src.iterdir() if p.is_file()]
    nbytes = sum(p.stat().st_size for p in files)
    items = json.loads(subprocess.run([*_ckpt(), "inspect", "--json", str(src)],
                                      capture_output=True, text=True, check=True).stdout)
    chunks = sum(int(t.get("chunks", 0)) for t in items["tensors"].values())
    print(f"source: {src} ({nbytes / 2**20:.0f} MiB, {len(files)} files, "
          f"{len(items['tensors'])} tensors, {chunks} chunks; ready after "
          f"{time.perf_counter() - start:.0f} s)", flush=True)
    shutil.rmtree(a.work, ignore_errors=True)
    a.work.mkdir(parents=True)
    for _ in range(1):  # page cache warm
        subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)

    imp = [r for r in (run_once([sys.executable, "-c", "import torch.distributed.checkpoint"],
                                a.work / "none", None) for _ in range(a.repeat)) if r]
    if imp:
        print(f"import torch + torch.distributed.checkpoint: "
              f"{statistics.median(r[1] for r in imp):.2f} s wall, "
              f"{statistics.median(r[3] for r in imp):.2f} s CPU (the command's own time "
              "includes it where torch is imported: torchrun ranks, DCP's save path)")
    floor_bytes = a.floor_mb * 10**6 if a.floor_mb else nbytes
    print(f"\ndisk floor (os.write 16 MiB blocks + fsync, {floor_bytes / 1e6:.0f} MB, N files on "
          "N threads):")
    floors = {}
    for n in a.counts:
        floors[n] = statistics.median(disk_floor(a.work, floor_bytes, n)
                                      for _ in range(a.repeat))
        print(f"  N={n}: {floors[n]:8.0f} MB/s  ({floor_bytes / floors[n] / 1e6:.2f} s)",
              flush=True)

    here = str(HERE.parent)
    codes = [("this", here)] + ([("other", a.compare_with)] if a.compare_with else [])
    configs = [(t, m, n, c) for t in a.targets for m in a.modes for n in a.counts
               for c, _ in codes]
    times: dict[tuple, list[tuple[float, float, float, float, int]]] = {c: [] for c in configs}
    left_out = 0
    for rep in range(a.repeat):  # round robin: every configuration sees the same load
        for c in configs:
            if a.budget_s is not None and time.perf_counter() - start > a.budget_s:
                left_out += 1
                continue
            t, m, n, code = c
            argv = command(t, src, a.work / "out", n, m == "torchrun", 2 * a.build_ranks)
            r = run_once(argv, a.work / "out", dict(codes)[code], a.run_timeout)
            if r:
                times[c].append(r)
                print(f"  {code} {t} {m} N={n}: own {r[0]:.2f} s, wall {r[1]:.2f} s, "
                      f"{r[2]:.0f} MB, CPU {r[3]:.2f} s, {r[4]} context switches", flush=True)
        print(f"  round {rep + 1}/{a.repeat} done; {uptime()}", flush=True)
    if left_out:
        print(f"budget of {a.budget_s:.0f} s spent: {left_out} of {len(configs) * a.repeat} "
              "runs not started", flush=True)

    print(f"\n{'code':5s} {'target':12s} {'mode':9s} {'N':>2s} {'own s':>7s} {'wall s':>7s} "
          f"{'speed-up':>8s} {'MB/s':>7s} {'floor MB/s':>10s} {'peak RSS MB':>11s} "
          f"{'CPU s':>6s} {'ctx sw':>8s}")
    med = {}
    for code, _ in codes:
        for t in a.targets:
            for m in a.modes:
                base = None
                for n in a.counts:
                    runs = times[(t, m, n, code)]
                    if not runs:
                        print(f"{code:5s} {t:12s} {m:9s} {n:2d} {'not run (or failed)':>30s}")
                        continue
                    own = statistics.median(r[0] for r in runs)
                    wall = statistics.median(r[1] for r in runs)
                    rss = max(r[2] for r in runs)
                    cpu = statistics.median(r[3] for r in runs)
                    csw = statistics.median(r[4] for r in runs)
                    med[(t, m, n, code)] = own
                    base = base or own
                    print(f"{code:5s} {t:12s} {m:9s} {n:2d} {own:7.2f} {wall:7.2f} "
                          f"{base / own:7.2f}x {nbytes / own / 1e6:7.0f} {floors[n]:10.0f} "
                          f"{rss:11.0f} {cpu:6.2f} {csw:8.0f}")
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
