"""``ckpt reshard`` TP2 -> TP4 of a real ~500 MB torch_dist checkpoint against today's path.

    python bench/bench_reshard.py [--size-mb 500] [--dir bench/out/synthetic_500mb]

Today's path: Megatron-Core under torchrun with 4 ranks builds the state dict at TP4, loads the
checkpoint into it (resharding on load) and saves it again (``make_synthetic.py --load-from``).
Ours: ``ckpt reshard SRC DST --tp 4`` in one process (and under ``torchrun -n 2``). Each run is
a fresh process tree, imports included, page cache warm; peak RSS is the largest process's.
"""

from __future__ import annotations

import argparse
import shutil
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
    ap.add_argument("--repeat", type=int, default=1)
    a = ap.parse_args()
    ckpt = a.dir or HERE / "out" / f"synthetic_{a.size_mb}mb"
    build(ckpt, a.size_mb)
    work = HERE / "out" / "reshard_work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ckpt_bin = shutil.which("ckpt") or "ckpt"
    torchrun = shutil.which("torchrun") or "torchrun"
    env = {"CUDA_VISIBLE_DEVICES": "", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
    files = sorted(str(p) for p in ckpt.iterdir() if p.is_file())
    runs = [
        run("cat (I/O floor)", ["sh", "-c", 'cat "$@" > /dev/null', "cat", *files],
            repeat=a.repeat),
        run("megatron-core load at TP4 + save (4 ranks)", ["sh", "-c",
            f"rm -rf {work}/mc && {torchrun} --standalone --nproc-per-node 4 "
            f"{HERE / 'make_synthetic.py'} {work}/mc --size-mb {a.size_mb} --load-from {ckpt}"],
            repeat=a.repeat, env=env),
        run("ckpt reshard --tp 4", ["sh", "-c",
            f"rm -rf {work}/ours && {ckpt_bin} reshard {ckpt} {work}/ours --tp 4"],
            repeat=a.repeat, env=env),
        run("torchrun -n 2 ckpt reshard --tp 4", ["sh", "-c",
            f"rm -rf {work}/ours2 && {torchrun} --standalone --nproc-per-node 2 -m ckpt_tool "
            f"reshard {ckpt} {work}/ours2 --tp 4"], repeat=a.repeat, env=env),
    ]
    report("reshard TP2 -> TP4 (end to end, imports included)", runs,
           "megatron-core load at TP4 + save (4 ranks)")
    print("(peak RSS: the largest single process of the run; Megatron-Core runs 4 of them)")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
