"""Metadata-heavy checkpoint: ``ckpt inspect``/``validate``/``validate --deep`` at 5,000 tensors in 500 files.

    python bench/bench_metadata_scale.py [--dir bench/out/scale_5000t_500f] [--repeat 3]

Builds (once, cached) a torch_dist checkpoint with the REAL Megatron-Core writer under torchrun
(gloo, CPU): ``--ranks`` ranks (default 2), each saving with
``TorchDistSaveShardedStrategy('torch_dist', 1, thread_count=500 // ranks)`` so Megatron-Core
writes 500 ``__R_T.distcp`` files in all. 500 layers x 10 small GPT-named tensors = 5,000 tensors
(weights and column biases TP-split across the ranks, norms and row biases replicated), about
135 MB of fp32 -- the point is the count of tensors, chunks and files, not bytes.

Then times, each in a fresh process (imports included), best of ``--repeat``, page cache warm:

* ``ckpt inspect --json`` and ``ckpt validate`` vs Megatron-Core ``load_tensors_metadata``
  (goal: each of ours under 1.5 s);
* ``ckpt validate --deep`` vs ``cat`` of every file of the checkpoint (goal: --deep reads at
  >= 70% of cat's MB/s). Reported end to end, and -- because a fresh process pays the torch
  import that ``cat`` does not -- also in-process, after imports: deep minus shallow validate is
  the read phase.

Run the writer alone (what ``build`` does)::

    CUDA_VISIBLE_DEVICES= torchrun --nproc-per-node 2 bench/bench_metadata_scale.py --write OUT
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _harness import python_cmd, report, run  # noqa: E402

HERE = Path(__file__).resolve().parent
PATCH = "import torch; torch.cuda.synchronize=lambda *a,**k: None; torch.cuda.current_device=lambda: 'cpu'; "
LAYERS, FILES = 500, 500
HIDDEN, FFN = 64, 256


# -- writer (runs under torchrun) ------------------------------------------------------------

def write(out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.synchronize = lambda *a, **k: None  # FORMATS.md §8: CPU-only save
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    dist.init_process_group("gloo")
    rank, tp = dist.get_rank(), dist.get_world_size()
    assert FILES % tp == 0 and HIDDEN % tp == 0
    gen = torch.Generator().manual_seed(4321 + rank)
    h, f = HIDDEN, FFN

    def split(key, local, axis):  # TP-split along ``axis``
        return ShardedTensor.from_rank_offsets(key, torch.randn(*local, generator=gen),
                                               (axis, rank, tp))

    def repl(key, shape):  # replicated: rank 0 writes it
        return ShardedTensor.from_rank_offsets(key, torch.randn(*shape, generator=gen),
                                               replica_id=rank)

    sd = {}
    for i in range(LAYERS):
        p = f"decoder.layers.{i}."
        for st in (
            split(p + "self_attention.linear_qkv.weight", (3 * h // tp, h), 0),
            split(p + "self_attention.linear_qkv.bias", (3 * h // tp,), 0),
            repl(p + "self_attention.linear_qkv.layer_norm_weight", (h,)),
            repl(p + "self_attention.linear_qkv.layer_norm_bias", (h,)),
            split(p + "self_attention.linear_proj.weight", (h, h // tp), 1),
            repl(p + "self_attention.linear_proj.bias", (h,)),
            split(p + "mlp.linear_fc1.weight", (2 * f // tp, h), 0),
            split(p + "mlp.linear_fc1.bias", (2 * f // tp,), 0),
            repl(p + "mlp.linear_fc1.layer_norm_weight", (h,)),
            split(p + "mlp.linear_fc2.weight", (h, f // tp), 1),
        ):
            sd[st.key] = st
    sd["iteration"] = 100
    sd["checkpoint_version"] = 3.0
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=FILES // tp)
    if rank == 0:
        os.makedirs(out, exist_ok=True)
    dist.barrier()
    t0 = time.perf_counter()
    dist_checkpointing.save(sd, out, sharded_strategy=strategy)
    dist.barrier()
    if rank == 0:
        print(f"wrote {out}: {len(sd) - 2} tensors, tp {tp}, {time.perf_counter() - t0:.1f} s save",
              file=sys.stderr)
    dist.destroy_process_group()


def build(out: Path, ranks: int) -> None:
    if (out / "metadata.json").exists():
        return
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    subprocess.run(
        ["torchrun", "--nproc-per-node", str(ranks), "--master-port", "29641",
         str(Path(__file__).resolve()), "--write", str(out)],
        check=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    print(f"built in {time.perf_counter() - t0:.1f} s (torchrun, imports included)")


# -- timing ----------------------------------------------------------------------------------

IN_PROCESS = """
import json, sys, time
import torch
from ckpt_tool.ops.validate import validate
d = sys.argv[1]
out = {}
for deep in (False, True, False, True):
    t0 = time.perf_counter(); r = validate(d, deep=deep); dt = time.perf_counter() - t0
    assert r.ok, [f.to_dict() for f in r.errors]
    k = 'deep' if deep else 'shallow'
    out[k] = min(out.get(k, dt), dt)
out['tensors_read'] = r.stats.get('tensors_read')
print(json.dumps(out))
"""


def in_process(ckpt: Path, repeat: int) -> dict:
    best: dict = {}
    for _ in range(repeat):
        res = subprocess.run([sys.executable, "-c", IN_PROCESS, str(ckpt)], check=True,
                             capture_output=True, text=True)
        got = json.loads(res.stdout.strip().splitlines()[-1])
        for k in ("shallow", "deep"):
            best[k] = min(best.get(k, got[k]), got[k])
        best["tensors_read"] = got["tensors_read"]
    return best


def deep_vs_cat(ckpt: Path, ckpt_bin: str, repeat: int) -> None:
    files = sorted(str(p) for p in ckpt.iterdir() if p.is_file())
    mb = sum(os.path.getsize(f) for f in files) / 1e6
    cat = ["sh", "-c", 'cat "$@" > /dev/null', "cat", *files]
    run("warm page cache", cat)
    deep = [
        run("cat (all files)", cat, repeat=repeat),
        run("ckpt validate --deep", [ckpt_bin, "validate", "--deep", str(ckpt)], repeat=repeat),
    ]
    report(f"validate --deep vs cat on {ckpt.name} ({mb:.0f} MB, {len(files)} files; end to end, "
           "imports included)", deep, "cat (all files)")
    c, d = deep
    print(f"{'MB/s end to end':44s} cat {mb / c.seconds:8.0f}   --deep {mb / d.seconds:8.0f}   "
          f"--deep/cat {c.seconds / d.seconds:6.1%}")

    ip = in_process(ckpt, repeat)
    read_phase = max(1e-9, ip["deep"] - ip["shallow"])
    print(f"in-process, after imports (best of {repeat} x 2): validate {ip['shallow']:.3f} s, "
          f"validate(deep=True) {ip['deep']:.3f} s, {ip['tensors_read']} tensors read")
    print(f"{'MB/s in-process':44s} cat {mb / c.seconds:8.0f}   deep total {mb / ip['deep']:8.0f}"
          f" ({c.seconds / ip['deep']:.1%} of cat)   read phase (deep - shallow) "
          f"{mb / read_phase:8.0f} ({c.seconds / read_phase:.1%} of cat)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--also-deep", type=Path, nargs="*", metavar="DIR",
                    help="also compare validate --deep with cat on these checkpoints "
                         "(e.g. bench/out/synthetic_500mb from bench_inspect.py: few, big tensors)")
    ap.add_argument("--write", metavar="OUT", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.write:
        return write(a.write)

    ckpt = a.dir or HERE / "out" / "scale_5000t_500f"
    build(ckpt, a.ranks)
    files = sorted(str(p) for p in ckpt.iterdir() if p.is_file())
    n_distcp = sum(f.endswith(".distcp") for f in files)
    size = sum(os.path.getsize(f) for f in files)
    mb = size / 1e6
    print(f"checkpoint: {ckpt} ({mb:.1f} MB, {len(files)} files, {n_distcp} .distcp)")
    print(f"load: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f} "
          f"(1/5/15 min), {os.cpu_count()} CPUs")

    ckpt_bin = shutil.which("ckpt") or "ckpt"
    cat = ["sh", "-c", 'cat "$@" > /dev/null', "cat", *files]
    run("warm page cache", cat)
    meta = [
        run("megatron-core load_tensors_metadata", python_cmd(
            PATCH + f"from megatron.core.dist_checkpointing import load_tensors_metadata as f; "
            f"m = f({str(ckpt)!r}); assert len(m) == {LAYERS * 10}, len(m)"),
            repeat=a.repeat),
        run("ckpt inspect --json", [ckpt_bin, "inspect", "--json", str(ckpt)], repeat=a.repeat),
        run("ckpt validate", [ckpt_bin, "validate", str(ckpt)], repeat=a.repeat),
    ]
    report("metadata at 5,000 tensors / 500 files (end to end, imports included; goal < 1.5 s)",
           meta, "megatron-core load_tensors_metadata")

    deep_vs_cat(ckpt, ckpt_bin, a.repeat)
    for other in a.also_deep or ():
        deep_vs_cat(other, ckpt_bin, a.repeat)
    print(f"load after: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")


if __name__ == "__main__":
    main()
