"""``torchrun -n 2 ckpt convert`` against one process on a real ~500 MB torch_dist checkpoint.

    python bench/bench_torchrun.py [--size-mb 500] [--to torch_dist]

Both write the same target format; the outputs are then compared with ``ckpt diff`` (identical
tensors required). Fresh processes, imports included, page cache warm.

Also printed, to show where the time goes:

* the launcher floor: ``torchrun -n 2 -m ckpt_tool --help`` (torchrun's agent importing torch and
  starting two workers that do nothing) -- a cost the one-process run never pays;
* the command's own time (``seconds`` of ``--json``: after imports and, under torchrun, after the
  rendezvous, up to rank 0's end including the final barrier and verification), best of
  ``--repeat``, for one process and for two ranks.
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
from _harness import report, run  # noqa: E402
from bench_inspect import build  # noqa: E402

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=500)
    ap.add_argument("--dir", type=Path)
    ap.add_argument("--to", default="torch_dist")
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    ckpt = a.dir or HERE / "out" / f"synthetic_{a.size_mb}mb"
    build(ckpt, a.size_mb)
    work = HERE / "out" / "torchrun_work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ckpt_bin = shutil.which("ckpt") or "ckpt"
    torchrun = shutil.which("torchrun") or "torchrun"
    env = {"CUDA_VISIBLE_DEVICES": ""}
    runs = [
        run("ckpt convert (1 process)", ["sh", "-c",
            f"rm -rf {work}/one && {ckpt_bin} convert {ckpt} {work}/one --to {a.to}"],
            repeat=a.repeat, env=env),
        run("torchrun -n 2 ckpt convert", ["sh", "-c",
            f"rm -rf {work}/two && {torchrun} --standalone --nproc-per-node 2 -m ckpt_tool "
            f"convert {ckpt} {work}/two --to {a.to}"], repeat=a.repeat, env=env),
    ]
    runs.append(run("torchrun -n 2 launcher floor (--help)", [torchrun, "--standalone",
                    "--nproc-per-node", "2", "-m", "ckpt_tool", "--help"],
                    repeat=a.repeat, env=env))
    report(f"convert --to {a.to} (end to end, imports included)", runs,
           "ckpt convert (1 process)")
    inside = {}
    for label, launch, out in (("1 process", [ckpt_bin], work / "one"),
                               ("torchrun -n 2", [torchrun, "--standalone", "--nproc-per-node",
                                                  "2", "-m", "ckpt_tool"], work / "two")):
        best = None
        for _ in range(a.repeat):
            shutil.rmtree(out, ignore_errors=True)
            done = subprocess.run([*launch, "convert", str(ckpt), str(out), "--to", a.to,
                                   "--json"], capture_output=True, text=True,
                                  env={**os.environ, **env}, check=True)
            seconds = json.loads(done.stdout)["seconds"]
            best = seconds if best is None else min(best, seconds)
        inside[label] = best
    print(f"command's own time (--json seconds): 1 process {inside['1 process']:.2f} s, "
          f"torchrun -n 2 {inside['torchrun -n 2']:.2f} s "
          f"({inside['1 process'] / inside['torchrun -n 2']:.2f}x)")
    same = subprocess.run([ckpt_bin, "diff", str(work / "one"), str(work / "two")],
                          capture_output=True, text=True)
    print(f"outputs identical: {same.returncode == 0} ({same.stderr.strip().splitlines()[-1]})")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
