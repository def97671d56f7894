"""``ckpt convert`` from an S3-compatible server on 127.0.0.1 against the same from local disk.

    python bench/bench_s3_convert.py [--size-mb 256] [--dir bench/out/synthetic_256mb] [--rounds 3]
                                     [--s3rver node_modules/.bin/s3rver] [--workers N]

Builds a torch_dist checkpoint with the REAL Megatron-Core writer (``make_synthetic.py`` under
torchrun) unless it exists, starts an S3-compatible server as a process of its own on
127.0.0.1 -- ``s3rver`` (npm ``s3rver``: files on disk, ranged GETs served from them) when
``--s3rver`` names it, else moto's (``moto[server]``, which copies a whole object for every
ranged GET: a floor, not a measure, for data files of hundreds of MiB) -- uploads the
checkpoint, then alternates, ``--rounds`` times, ``ckpt convert --to
safetensors --no-verify`` of the local directory and of ``s3://bench/ckpt`` (each in a fresh
process, the page cache warm for the local source; the server keeps its objects in memory).
Alternating keeps a busy, shared machine's load the same for both. Prints each time, the
best of each and the ratio ``local seconds / s3 seconds`` (the s3 rate as a fraction of the
local rate).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_inspect import build  # noqa: E402

HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=256)
    ap.add_argument("--dir", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--s3rver", help="the s3rver executable (npm install s3rver)")
    ap.add_argument("--workers", type=int, default=1, help="convert --workers, both sides")
    a = ap.parse_args()
    src = a.dir or HERE / "out" / f"synthetic_{a.size_mb}mb"
    build(src, a.size_mb)
    port = _free_port()
    store = Path(tempfile.mkdtemp(prefix="ckpt-bench-s3rver-"))
    cmd = [a.s3rver, "-d", str(store), "-a", "127.0.0.1", "-p", str(port), "--silent"] \
        if a.s3rver else [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {**os.environ, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
           "AWS_ACCESS_KEY_ID": "S3RVER", "AWS_SECRET_ACCESS_KEY": "S3RVER",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
           "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
    out = Path(tempfile.mkdtemp(prefix="ckpt-bench-s3-"))
    try:
        import boto3

        for _ in range(200):  # the server is up (bounded wait)
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        c = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"],
                         aws_access_key_id="S3RVER", aws_secret_access_key="S3RVER",
                         region_name="us-east-1")
        c.create_bucket(Bucket="bench")
        for p in sorted(src.rglob("*")):
            if p.is_file():
                c.upload_file(str(p), "bench", f"ckpt/{p.relative_to(src).as_posix()}")
        nbytes = sum(p.stat().st_size for p in src.rglob("*.distcp"))
        times: dict[str, list[float]] = {"local": [], "s3": []}
        for r in range(a.rounds):
            for label, where in (("local", str(src)), ("s3", "s3://bench/ckpt")):
                dst = out / f"{label}{r}.safetensors"
                t0 = time.perf_counter()
                subprocess.run([sys.executable, "-m", "ckpt_tool", "convert", where, str(dst),
                                "--to", "safetensors", "--no-verify", "--quiet", "--workers",
                                str(a.workers)], check=True,
                               env=env)
                times[label].append(time.perf_counter() - t0)
                shutil.rmtree(dst, ignore_errors=True)
                dst.unlink(missing_ok=True)
                for side in out.glob("*.ckpt-manifest.json"):
                    side.unlink()
        load = os.getloadavg()
        print(f"server: {'s3rver' if a.s3rver else 'moto'}; checkpoint: {nbytes / 2**20:.0f} MiB "
              f"of data; --workers {a.workers}; load average {load[0]:.1f}")
        for label, ts in times.items():
            print(f"{label:6s} " + " ".join(f"{t:6.2f}s" for t in ts)
                  + f"  best {min(ts):6.2f}s ({nbytes / 2**20 / min(ts):.0f} MiB/s)")
        ratios = [lo / s for lo, s in zip(times["local"], times["s3"])]
        print("s3 rate / local rate per round: " + " ".join(f"{x:.2f}" for x in ratios)
              + f"; of the best times: {min(times['local']) / min(times['s3']):.2f}")
    finally:
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(store, ignore_errors=True)


if __name__ == "__main__":
    main()
