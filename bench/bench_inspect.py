"""``ckpt inspect`` and our ``load_plain_tensors`` against Megatron-Core on a real torch_dist checkpoint.

    python bench/bench_inspect.py [--size-mb 500] [--dir bench/out/synthetic_500mb]

Builds the checkpoint with the REAL Megatron-Core writer (``make_synthetic.py`` under torchrun)
unless it exists, then times, each in a fresh process (imports included, page cache warm):

* ``ckpt inspect --json``  vs  ``megatron.core.dist_checkpointing.load_tensors_metadata``
* ``ckpt_tool.dist_checkpointing.load_plain_tensors``  vs  Megatron-Core's, with peak RSS
* ``cat`` of the files (the I/O floor)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _harness import python_cmd, report, run  # noqa: E402

HERE = Path(__file__).resolve().parent
PATCH = "import torch; torch.cuda.synchronize=lambda *a,**k: None; torch.cuda.current_device=lambda: 'cpu'; "
# Megatron-Core's load path calls torch.distributed.get_rank(): it needs a (1-rank) process group.
PG = ("import torch.distributed as d; d.init_process_group('gloo', init_method='tcp://127.0.0.1:29655', "
      "rank=0, world_size=1); ")


def build(out: Path, size_mb: int) -> None:
    if (out / "metadata.json").exists():
        return
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["torchrun", "--nproc-per-node", "2", "--master-port", "29631",
         str(HERE / "make_synthetic.py"), str(out), "--size-mb", str(size_mb)],
        check=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=500)
    ap.add_argument("--dir", type=Path)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    ckpt = a.dir or HERE / "out" / f"synthetic_{a.size_mb}mb"
    build(ckpt, a.size_mb)
    files = sorted(str(p) for p in ckpt.iterdir() if p.is_file())
    size = sum(os.path.getsize(f) for f in files)
    print(f"checkpoint: {ckpt} ({size / 2**20:.0f} MiB, {len(files)} files)")

    ckpt_bin = shutil.which("ckpt") or "ckpt"
    meta = [
        run("megatron-core load_tensors_metadata", python_cmd(
            PATCH + f"from megatron.core.dist_checkpointing import load_tensors_metadata as f; f({str(ckpt)!r})"),
            repeat=a.repeat),
        run("ckpt inspect --json", [ckpt_bin, "inspect", "--json", str(ckpt)], repeat=a.repeat),
    ]
    report("metadata (end to end, imports included)", meta, "megatron-core load_tensors_metadata")

    plain = [
        run("cat (I/O floor)", ["sh", "-c", 'cat "$@" > /dev/null', "cat", *files], repeat=a.repeat),
        run("megatron-core load_plain_tensors", python_cmd(
            PATCH + PG + f"from megatron.core.dist_checkpointing import load_plain_tensors as f; f({str(ckpt)!r})"),
            repeat=a.repeat),
        run("ckpt_tool load_plain_tensors", python_cmd(
            f"from ckpt_tool.dist_checkpointing import load_plain_tensors as f; f({str(ckpt)!r})"),
            repeat=a.repeat),
    ]
    report("load_plain_tensors (end to end, imports included)", plain, "megatron-core load_plain_tensors")


if __name__ == "__main__":
    main()
