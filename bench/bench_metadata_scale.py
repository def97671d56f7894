"""Metadata-heavy checkpoint: ``ckpt inspect``/``validate``/``validate --deep`` at 5,000 tensors in 500 files.

    python bench/bench_metadata_scale.py [--dir bench/out/scale_5000t_500f] [--repeat 3]
                                         [--mb 500 --files 50]

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
  >= 70% of cat's MB/s), cat and ours interleaved, best of ``--repeat``, page cache warm.
  Reported end to end, and -- because a fresh process pays the torch import that ``cat`` does
  not -- also in-process, after imports: ``validate(deep=True)`` as a whole, and its read phase
  alone (``ops.validate._integrity_pass.scan_archives(deep=True)``: the one pass that CRCs every zip record
  and counts NaN/Inf of every tensor in place).

``--mb N`` adds a second, bandwidth-bound case: a plain PyTorch DCP checkpoint of about N MB in
``--files`` files (default 50; fp32 and bf16 tensors of ~1-5 MB, written by ``dcp.save``,
cached under bench/out/), so per-tensor overhead (the 5,000-tensor case) and bandwidth are
both measured. ``--skip-metadata`` skips the inspect/validate timings.

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

    torch.cuda.synchronize = lambda *a, **k: None  # docs/formats.md §8: CPU-only save
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
from pathlib import Path
from ckpt_tool.ops.inspect import inspect
from ckpt_tool.ops.validate import _file_sizes, validate
from ckpt_tool.ops.validate._integrity_pass import scan_archives
d = sys.argv[1]
meta = inspect(d).meta
base = Path(meta.root)
sizes = _file_sizes(base, meta)
out = {}
def best(k, dt):
    out[k] = min(out.get(k, dt), dt)
for _ in range(2):
    for deep in (False, True):
        t0 = time.perf_counter(); r = validate(d, deep=deep); best('deep' if deep else 'shallow', time.perf_counter() - t0)
        assert r.ok, [f.to_dict() for f in r.errors]
    t0 = time.perf_counter(); f, counted = scan_archives(base, meta, sizes, {}, set(), deep=True)
    best('scan', time.perf_counter() - t0)
    assert not f and len(counted) == len(meta.tensors), (f[:3], len(counted))
out['tensors_read'] = r.stats.get('tensors_read')
print(json.dumps(out))
"""


def in_process(ckpt: Path, cat: list[str], repeat: int) -> tuple[dict, float]:
    """Best in-process timings and the best cat time, runs interleaved (cat, ours, cat, ...)."""
    best: dict = {}
    cat_best = float("inf")
    for _ in range(repeat):
        cat_best = min(cat_best, run("cat (all files)", cat).seconds)
        res = subprocess.run([sys.executable, "-c", IN_PROCESS, str(ckpt)], check=True,
                             capture_output=True, text=True)
        got = json.loads(res.stdout.strip().splitlines()[-1])
        for k in ("shallow", "deep", "scan"):
            best[k] = min(best.get(k, got[k]), got[k])
        best["tensors_read"] = got["tensors_read"]
    return best, cat_best


def deep_vs_cat(ckpt: Path, ckpt_bin: str, repeat: int) -> None:
    files = sorted(str(p) for p in ckpt.rglob("*") if p.is_file())
    mb = sum(os.path.getsize(f) for f in files) / 1e6
    cat = ["sh", "-c", 'cat "$@" > /dev/null', "cat", *files]
    run("warm page cache", cat)
    c = d = None
    for _ in range(repeat):  # interleaved: both see the same page cache and machine load
        rc = run("cat (all files)", cat)
        rd = run("ckpt validate --deep", [ckpt_bin, "validate", "--deep", str(ckpt)])
        c = rc if c is None or rc.seconds < c.seconds else c
        d = rd if d is None or rd.seconds < d.seconds else d
    report(f"validate --deep vs cat on {ckpt.name} ({mb:.0f} MB, {len(files)} files; end to end, "
           "imports included)", [c, d], "cat (all files)")
    print(f"{'MB/s end to end':44s} cat {mb / c.seconds:8.0f}   --deep {mb / d.seconds:8.0f}   "
          f"--deep/cat {c.seconds / d.seconds:6.1%}")

    ip, cat_s = in_process(ckpt, cat, repeat)
    print(f"in-process, after imports (best of {repeat} x 2): validate {ip['shallow']:.3f} s, "
          f"validate(deep=True) {ip['deep']:.3f} s, read pass {ip['scan']:.3f} s, cat "
          f"{cat_s:.3f} s, {ip['tensors_read']} tensors read")
    print(f"{'MB/s in-process':44s} cat {mb / cat_s:8.0f}   deep total {mb / ip['deep']:8.0f}"
          f" ({cat_s / ip['deep']:.1%} of cat)   read pass (CRC + NaN/Inf) "
          f"{mb / ip['scan']:8.0f} ({cat_s / ip['scan']:.1%} of cat)")


# -- the bandwidth case: a plain DCP checkpoint of --mb MB in --files files -------------------

def build_dcp(out: Path, mb: int, files: int) -> None:
    """About ``mb`` MB of fp32/bf16 tensors (1-5 MB each) in ``files`` ``.distcp`` files."""
    if (out / ".metadata").exists():
        return
    code = f"""
import shutil, torch, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
g = torch.Generator().manual_seed(7)
sd, total, i = {{}}, 0, 0
while total < {mb} * 10**6:
    rows = 256 * (1 + i % 5)
    t = torch.randn(rows, 1024, generator=g)
    if i % 3 == 2:
        t = t.bfloat16()
    sd[f"layers.{{i}}.weight"] = t
    total += t.numel() * t.element_size()
    i += 1
shutil.rmtree({str(out)!r}, ignore_errors=True)
dcp.save(sd, storage_writer=FileSystemWriter({str(out)!r}, thread_count={files}), no_dist=True)
print(len(sd), "tensors")
"""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-W", "ignore", "-c", code], check=True,
                   env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    print(f"built {out} in {time.perf_counter() - t0:.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--also-deep", type=Path, nargs="*", metavar="DIR",
                    help="also compare validate --deep with cat on these checkpoints "
                         "(e.g. bench/out/synthetic_500mb from bench_inspect.py: few, big tensors)")
    ap.add_argument("--mb", type=int, default=0,
                    help="also build and measure a plain DCP checkpoint of about MB megabytes")
    ap.add_argument("--files", type=int, default=50, help="files of the --mb checkpoint")
    ap.add_argument("--skip-metadata", action="store_true",
                    help="skip the inspect/validate timings of the 5,000-tensor checkpoint")
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
    if not a.skip_metadata:
        meta = [
            run("megatron-core load_tensors_metadata", python_cmd(
                PATCH + f"from megatron.core.dist_checkpointing import load_tensors_metadata "
                f"as f; m = f({str(ckpt)!r}); assert len(m) == {LAYERS * 10}, len(m)"),
                repeat=a.repeat),
            run("ckpt inspect --json", [ckpt_bin, "inspect", "--json", str(ckpt)],
                repeat=a.repeat),
            run("ckpt validate", [ckpt_bin, "validate", str(ckpt)], repeat=a.repeat),
        ]
        report("metadata at 5,000 tensors / 500 files (end to end, imports included; goal "
               "< 1.5 s)", meta, "megatron-core load_tensors_metadata")

    deep_vs_cat(ckpt, ckpt_bin, a.repeat)
    if a.mb:
        big = HERE / "out" / f"dcp_{a.mb}mb_{a.files}f"
        build_dcp(big, a.mb, a.files)
        deep_vs_cat(big, ckpt_bin, a.repeat)
    for other in a.also_deep or ():
        deep_vs_cat(other, ckpt_bin, a.repeat)
    print(f"load after: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")


if __name__ == "__main__":
    main()
