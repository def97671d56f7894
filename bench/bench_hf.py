"""``ckpt convert`` to and from Hugging Face directories against reading the bytes, on ~2 GB.

    python bench/bench_hf.py [--layers 8] [--dir bench/out/hf_llama] [--repeat 1]

Builds the inputs with the REAL writers unless they exist:

* an HF Llama directory (fp32, GQA, untied; ~2 GB with 8 layers of hidden 2048) by
  transformers' ``LlamaForCausalLM(config).save_pretrained`` (500 MB shards + index);
* a Megatron-Core torch_dist checkpoint of the same model by the real Megatron-Core
  ``dist_checkpointing.save`` (the tensors of our import, loaded with Megatron-Core's
  ``load_plain_tensors``, saved with ``args``), so the export reads what Megatron-Core wrote.

Then times, each in a fresh process (imports included, page cache warm), with peak RSS:

* ``cat`` of the files (the I/O floor) and ``ckpt validate --deep`` (our read of every tensor);
* import: ``ckpt convert HF --to torch_dist``; export: ``ckpt convert MCORE --to hf`` (both
  with the final validation, as users run them);
* the peer where cheap: transformers ``from_pretrained`` + ``save_pretrained`` (HF -> HF:
  what loading and saving the model costs there; Megatron-Bridge needs GPUs and is not
  installed);
* ``python -c "import torch"``: subtracted from peak RSS to get the memory the job held.

Peak RSS (``wait4``) counts the file-backed pages of mapped files (page cache, clean and
reclaimable) with the anonymous memory; the peak ``RssAnon`` (sampled) is what the job held.
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
from _harness import python_cmd, report, run  # noqa: E402
from bench_inspect import PATCH, PG  # noqa: E402

HERE = Path(__file__).resolve().parent

BUILD_HF = """
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers={layers},
                  num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                  max_position_embeddings=2048, tie_word_embeddings=False)
LlamaForCausalLM(cfg).save_pretrained({out!r}, max_shard_size="500MB")
"""

# Megatron-Core's own writer: the tensors of a torch_dist checkpoint (our import) as global
# ShardedTensors, with the checkpoint's common state (args, iteration)
RESAVE = PATCH + PG + """
import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
src, out = {src!r}, {out!r}
plain = dist_checkpointing.load_plain_tensors(src)
common = torch.load(src + "/common.pt", weights_only=False)
sd = {{k: ShardedTensor.from_rank_offsets(k, t.contiguous(), replica_id=0)
       for k, t in plain.items() if isinstance(t, torch.Tensor)}}
sd.update(common)
import os; os.makedirs(out)
dist_checkpointing.save(sd, out)
"""

PEER = """
import torch
from transformers import AutoModelForCausalLM
AutoModelForCausalLM.from_pretrained({src!r}, dtype=torch.float32).save_pretrained(
    {out!r}, max_shard_size="5GB")
"""


def _files(d: Path) -> list[str]:
    return sorted(str(p) for p in d.iterdir() if p.is_file())


def _gib(paths: list[str]) -> float:
    return sum(os.path.getsize(p) for p in paths) / 2**30


def build(root: Path, layers: int, ckpt: str) -> tuple[Path, Path]:
    hf, mc = root / "hf", root / "mcore"
    if not (hf / "config.json").exists():
        shutil.rmtree(hf, ignore_errors=True)
        subprocess.run([sys.executable, "-c", BUILD_HF.format(layers=layers, out=str(hf))],
                       check=True)
    if not (mc / "metadata.json").exists():
        shutil.rmtree(mc, ignore_errors=True)
        ours = root / "mcore_ours"
        if not (ours / "metadata.json").exists():
            shutil.rmtree(ours, ignore_errors=True)
            subprocess.run([ckpt, "convert", str(hf), str(ours), "--to", "torch_dist",
                            "--no-progress"], check=True)
        subprocess.run(python_cmd(RESAVE.format(src=str(ours), out=str(mc))), check=True,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
        shutil.rmtree(ours)
    return hf, mc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dir", type=Path, default=HERE / "out" / "hf_llama")
    ap.add_argument("--repeat", type=int, default=1)
    a = ap.parse_args()
    ckpt = shutil.which("ckpt") or "ckpt"
    hf, mc = build(a.dir, a.layers, ckpt)
    work = a.dir / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    hf_files, mc_files = _files(hf), _files(mc)
    meta = json.loads(subprocess.run([ckpt, "inspect", "--json", str(hf)], check=True,
                                     capture_output=True, text=True).stdout)
    largest = max(t["nbytes"] for t in meta["tensors"].values()) / 2**20
    print(f"HF input: {hf} ({_gib(hf_files):.2f} GiB, {len(hf_files)} files; transformers "
          f"save_pretrained)\nMegatron input: {mc} ({_gib(mc_files):.2f} GiB, {len(mc_files)} "
          f"files; Megatron-Core save)\nlargest tensor {largest:.0f} MiB; {os.cpu_count()} CPUs")
    r = a.repeat
    base = run("import torch", python_cmd("import torch"), repeat=r)
    imp = [
        run("cat HF files (I/O floor)", ["sh", "-c", 'cat "$@" > /dev/null', "cat", *hf_files],
            repeat=r),
        run("ckpt validate --deep HF (read all)", [ckpt, "validate", "--deep", str(hf)],
            repeat=r),
        run("ckpt convert HF --to torch_dist", ["sh", "-c", f"rm -rf {work}/mc && {ckpt} "
            f"convert {hf} {work}/mc --to torch_dist --no-progress"], repeat=r),
        run("transformers from_pretrained+save_pretrained", python_cmd(
            PEER.format(src=str(hf), out=str(work / "peer"))), repeat=r,
            env={"CUDA_VISIBLE_DEVICES": ""}),
    ]
    exp = [
        run("cat Megatron files (I/O floor)", ["sh", "-c", 'cat "$@" > /dev/null', "cat",
                                               *mc_files], repeat=r),
        run("ckpt validate --deep Megatron (read all)", [ckpt, "validate", "--deep", str(mc)],
            repeat=r),
        run("ckpt convert Megatron --to hf", ["sh", "-c", f"rm -rf {work}/hf && {ckpt} "
            f"convert {mc} {work}/hf --to hf --no-progress"], repeat=r),
    ]
    report("HF -> Megatron-Core (import)", [base, *imp], imp[0].label)
    report("Megatron-Core -> HF (export)", [base, *exp], exp[0].label)
    print()
    for runs, ours in ((imp, imp[2]), (exp, exp[2])):
        cat, read_all = runs[0], runs[1]
        held = ours.peak_rss_mb - base.peak_rss_mb
        anon = ours.peak_anon_mb - base.peak_anon_mb
        print(f"{ours.label}: {ours.seconds:.1f} s = {ours.seconds / cat.seconds:.1f}x cat, "
              f"{ours.seconds / read_all.seconds:.2f}x our read of all tensors; peak RSS "
              f"{ours.peak_rss_mb:.0f} MB ({held:.0f} MB above import torch = "
              f"{held / largest:.1f}x the largest tensor; file-backed pages included); peak "
              f"anonymous {ours.peak_anon_mb:.0f} MB ({anon:.0f} MB above import torch = "
              f"{anon / largest:.1f}x)")
    peer = imp[3]
    print(f"{peer.label}: {peer.seconds:.1f} s, peak RSS {peer.peak_rss_mb:.0f} MB "
          f"(ours: import {imp[2].seconds / peer.seconds:.2f}x its time)")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
