"""``ckpt reshard`` of a checkpoint with DistributedOptimizer state in Megatron-LM's default
``dp_reshardable`` form (unflattened to model space) against the same reshard without it
(``--drop-optimizer``: the model alone), and ``cat`` of the files (the I/O floor).

    python bench/bench_reshard_optim.py [--hidden 1024] [--layers 8]

The input is written by the real Megatron-Core 0.16.1 (2 gloo ranks, TP2, bucketed DDP). Fresh
processes, imports included, page cache warm; best of --repeat; peak RSS of the process.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _harness import report, run  # noqa: E402

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--bucket", type=int, default=4_000_000)
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    src = HERE / "out" / f"distopt_h{a.hidden}_l{a.layers}"
    if not (src / "latest_checkpointed_iteration.txt").exists():
        shutil.rmtree(src, ignore_errors=True)
        subprocess.run(["torchrun", "--standalone", "--nproc-per-node", "2",
                        str(HERE / "_make_distopt.py"), str(src), str(a.hidden), str(a.layers),
                        str(a.bucket)], check=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    it = next(src.glob("iter_*"))
    files = sorted(str(p) for p in it.iterdir() if p.is_file())
    size = sum(os.path.getsize(f) for f in files)
    print(f"checkpoint: {it} ({size / 2**20:.0f} MiB, {len(files)} files)")
    ckpt = shutil.which("ckpt") or "ckpt"
    outs = {name: HERE / "out" / f"reshard_{name}" for name in ("optim", "model")}

    def fresh(name: str) -> list[str]:
        shutil.rmtree(outs[name], ignore_errors=True)
        return [ckpt, "reshard", str(src), str(outs[name]), "--tp", "1"]

    runs = [run("cat of the files (floor)", ["cat", *files], repeat=a.repeat)]
    runs.append(run("ckpt reshard --tp 1 --drop-optimizer (model only)",
                    fresh("model") + ["--drop-optimizer", "--overwrite"], repeat=a.repeat))
    runs.append(run("ckpt reshard --tp 1 (model + dp_reshardable optimizer)",
                    fresh("optim") + ["--overwrite"], repeat=a.repeat))
    report("reshard with the distributed optimizer's bucket state", runs,
           baseline="ckpt reshard --tp 1 --drop-optimizer (model only)")


if __name__ == "__main__":
    main()
