"""DeepSeek-V3 FP8 release -> Megatron-Core torch_dist at a production layout -> HF FP8 again,
at the real tensor shapes, against the I/O floor, with peak memory and a bit-level check.

    python bench/bench_deepseek_v3.py [--layers 4 --dense 1 --experts 32] [--tp 2 --pp 2 --ep 8]
        [--cold] [--keep-source] [--set KEY=VALUE ...] [--out results.json]

Builds (unless ``--dir`` names one) a DeepSeek-V3 HF directory with ``make_deepseek_v3_fp8.py``
under ``--work``, then, each job a fresh process measured as ``bench_large.measure`` measures
(wall and CPU seconds, peak anonymous memory of the process tree, peak RSS, ``uptime``):

1. floor of the import: ``cat`` of the HF files, ``dd conv=fsync`` of as many bytes as the
   torch_dist output will hold;
2. ``ckpt convert HF TD --to torch_dist --tp T --pp P --ep E`` (FP8 read dequantized to the
   model's bf16, as Megatron-Core trains it);
3. floor of the export: ``cat`` of the torch_dist files, ``dd`` of the HF bytes;
4. ``ckpt convert TD OUT --to hf --hf-dtype fp8`` (the linear weights quantized again in
   128x128 blocks);
5. the check: every tensor of the source against the output (CRC-32 of each tensor's bytes,
   every byte read; scale grids compared value by value).

``--cold`` evicts the files a job reads from the page cache first (``posix_fadvise
DONTNEED`` on those files only: the machine is shared, its whole cache is left alone). The
source is digested before the import and deleted after it unless ``--keep-source``: the disk
then holds at most two of the three checkpoints (``--disk-budget-gb`` is checked against that).
Everything under ``--work`` is deleted at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import shutil
import struct
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import make_deepseek_v3_fp8 as gen  # noqa: E402
from bench_large import ckpt, measure, uptime  # noqa: E402

try:
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover
    from zlib import crc32


def files_under(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file())


def du(d: Path) -> int:
    return sum(p.stat().st_size for p in files_under(d))


def evict(d: Path) -> None:
    """Drop the page-cache pages of the files under ``d`` (clean pages only: ours are fsynced)."""
    for p in files_under(d):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def st_tensors(d: Path):
    """``(name, dtype, shape, file, start, stop)`` of every tensor of an HF directory."""
    for f in sorted(d.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            head = json.loads(fh.read(n))
        for name, t in head.items():
            if name != "__metadata__":
                a, b = t["data_offsets"]
                yield name, t["dtype"], tuple(t["shape"]), f, 8 + n + a, 8 + n + b


def _bytes(f: Path, start: int, stop: int) -> bytes:
    with open(f, "rb") as fh:
        fh.seek(start)
        return fh.read(stop - start)


def digest(d: Path) -> dict:
    """Per tensor: dtype, shape, CRC-32 of its bytes; scale grids and the FP8 weights with
    partial blocks (a few MB) kept whole."""
    out: dict = {}
    maps: dict = {}
    for name, dtype, shape, f, a, b in st_tensors(d):
        if f not in maps:
            for m in maps.values():
                m.close()
            maps = {f: mmap.mmap(os.open(f, os.O_RDONLY), 0, access=mmap.ACCESS_READ)}
        view = memoryview(maps[f])[a:b]
        rec = {"dtype": dtype, "shape": shape, "crc": crc32(view), "nbytes": b - a}
        partial = dtype == "F8_E4M3" and any(s % gen.BLOCK for s in shape)
        if name.endswith("_scale_inv") or partial:
            rec["data"] = bytes(view)
        view.release()
        out[name] = rec
    for m in maps.values():
        m.close()
    return out


def compare(src: dict, out: dict) -> dict:
    """What came back: bit-exact FP8 weights and other tensors, scale grids (exact or the
    largest relative difference), FP8 weights returned unquantized (checked against their
    dequantized values)."""
    import numpy as np
    import torch

    res = {"fp8_exact": 0, "fp8_differ": [], "scales_exact": 0, "scales_total": 0,
           "scale_max_rel": 0.0, "other_exact": 0, "other_differ": [], "missing": [],
           "unquantized": [], "unquantized_ok": 0, "extra": sorted(set(out) - set(src))}
    for name, s in src.items():
        o = out.get(name)
        if name.endswith("_scale_inv"):
            if o is None:
                if name.replace("_scale_inv", "") in out and out[
                        name.replace("_scale_inv", "")]["dtype"] != "F8_E4M3":
                    continue  # its weight came back unquantized (below)
                res["missing"].append(name)
                continue
            a = np.frombuffer(s["data"], np.float32)
            b = np.frombuffer(o["data"], np.float32)
            res["scales_total"] += a.size
            res["scales_exact"] += int((a == b).sum())
            res["scale_max_rel"] = max(res["scale_max_rel"],
                                       float(np.max(np.abs(b / a - 1.0))))
            continue
        if o is None:
            res["missing"].append(name)
        elif s["dtype"] == "F8_E4M3" and o["dtype"] != "F8_E4M3":
            res["unquantized"].append(name)
            w = torch.frombuffer(bytearray(s["data"]), dtype=torch.float8_e4m3fn).view(
                *s["shape"]).float()
            sc = torch.frombuffer(bytearray(src[name[:-len("weight")] + "weight_scale_inv"][
                "data"]), dtype=torch.float32).view(*[-(-n // gen.BLOCK) for n in s["shape"]])
            full = sc.repeat_interleave(gen.BLOCK, 0).repeat_interleave(gen.BLOCK, 1)
            want = (w * full[:w.shape[0], :w.shape[1]]).to(torch.bfloat16)
            got = torch.frombuffer(bytearray(o["data"]), dtype=torch.bfloat16).view(*s["shape"])
            res["unquantized_ok"] += int(torch.equal(want.view(torch.int16),
                                                     got.view(torch.int16)))
        elif (s["dtype"], s["shape"], s["crc"]) == (o["dtype"], o["shape"], o["crc"]):
            res["fp8_exact" if s["dtype"] == "F8_E4M3" else "other_exact"] += 1
        else:
            res["fp8_differ" if s["dtype"] == "F8_E4M3" else "other_differ"].append(name)
    return res


def digest_out(d: Path, src: dict) -> dict:
    """``digest`` of the output, keeping whole the tensors ``compare`` needs."""
    out = digest(d)
    for name, dtype, shape, f, a, b in st_tensors(d):
        s = src.get(name)
        if s is not None and s["dtype"] == "F8_E4M3" and dtype != "F8_E4M3":
            out[name]["data"] = _bytes(f, a, b)
    return out


def torch_dist_bytes(c: dict) -> int:
    """Data bytes of the import: FP8 weights as bf16, scale grids gone, the rest as stored."""
    n = 0
    for name, dtype, shape in gen.tensors(c):
        if name.endswith("_scale_inv"):
            continue
        n += math.prod(shape) * 2 if dtype == "F8_E4M3" else gen.nbytes(dtype, shape)
    return n


def dd(target: Path, nbytes: int, log: list, label: str) -> None:
    count = max(1, nbytes // (16 << 20))
    measure(label, ["dd", "if=/dev/zero", f"of={target}", "bs=16M", f"count={count}",
                    "conv=fsync", "status=none"], log=log)
    target.unlink(missing_ok=True)


def cat(d: Path, log: list, label: str) -> None:
    measure(label, ["sh", "-c", 'cat "$@" > /dev/null', "cat",
                    *map(str, files_under(d))], log=log)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, help="an existing DeepSeek-V3 FP8 HF directory")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dense", type=int, default=1)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--mtp", action="store_true")
    ap.add_argument("--pow2-scales", action="store_true",
                    help="power-of-two scales (DeepSeek-V3.1's ue8m0): the round trip is then "
                    "exact for the scales too")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config.json fields for the generator (small shapes)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--keep-source", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep --work at the end")
    ap.add_argument("--disk-budget-gb", type=float, default=30.0)
    ap.add_argument("--work", type=Path, default=HERE / "out" / "dsv3")
    ap.add_argument("--out", type=Path, help="write the records here (JSON)")
    a = ap.parse_args()

    over = {k: gen._value(v) for k, v in (s.split("=", 1) for s in a.set)}
    if a.dir:
        src = a.dir
        config = json.loads((src / "config.json").read_text())
    else:
        src = a.work / "hf"
        config = gen.make_config(a.layers, a.dense, a.experts, a.mtp, over)
    hf_bytes = sum(gen.nbytes(d, s) for _, d, s in gen.tensors(config))
    td_bytes = torch_dist_bytes(config)
    peak = max(hf_bytes + td_bytes, td_bytes + hf_bytes) if not a.keep_source \
        else 2 * hf_bytes + td_bytes
    free = shutil.disk_usage(a.work.parent if a.work.parent.exists() else "/").free
    print(f"machine: {os.cpu_count()} CPUs, "
          f"{os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB; "
          f"{uptime()}")
    print(f"plan: HF {hf_bytes / 1e9:.2f} GB, torch_dist ~{td_bytes / 1e9:.2f} GB; at most "
          f"{peak / 1e9:.1f} GB on disk at once (budget {a.disk_budget_gb:g} GB, "
          f"{free / 1e9:.0f} GB free)", flush=True)
    if peak > a.disk_budget_gb * 1e9 or peak > free - 5e9:
        sys.exit("not enough disk: fewer --layers or --experts")
    a.work.mkdir(parents=True, exist_ok=True)
    if not a.dir and not (src / "model.safetensors.index.json").exists():
        shutil.rmtree(src, ignore_errors=True)
        gen.write(src, config, pow2_scales=a.pow2_scales)
    td, out = a.work / "td", a.work / "out"
    for d in (td, out):
        shutil.rmtree(d, ignore_errors=True)
    log: list[dict] = []
    nbytes = du(src)
    print(f"source: {src} ({nbytes / 1e9:.2f} GB, {len(list(src.glob('*.safetensors')))} "
          f"shards, {sum(1 for _ in st_tensors(src))} tensors)", flush=True)
    src_digest = digest(src)
    c = ckpt()

    if a.cold:
        evict(src)
    cat(src, log, "floor: cat of the HF files")
    dd(a.work / "floor.bin", td_bytes, log, f"floor: dd of {td_bytes / 1e9:.1f} GB, fsync")
    if a.cold:
        evict(src)
    measure(f"ckpt convert --to torch_dist --tp {a.tp} --pp {a.pp} --ep {a.ep}",
            c + ["convert", str(src), str(td), "--to", "torch_dist", "--tp", str(a.tp),
                 "--pp", str(a.pp), "--ep", str(a.ep)], log=log)
    if log[-1]["rc"]:
        sys.exit("the import failed")
    td_real = du(td)
    if not a.keep_source and not a.dir:
        shutil.rmtree(src)
    if a.cold:
        evict(td)
    cat(td, log, "floor: cat of the torch_dist files")
    dd(a.work / "floor.bin", nbytes, log, f"floor: dd of {nbytes / 1e9:.1f} GB, fsync")
    if a.cold:
        evict(td)
    measure("ckpt convert --to hf --hf-dtype fp8",
            c + ["convert", str(td), str(out), "--to", "hf", "--hf-dtype", "fp8"], log=log)
    if log[-1]["rc"]:
        sys.exit("the export failed")
    out_bytes = du(out)
    res = compare(src_digest, digest_out(out, src_digest))
    cfg_out = json.loads((out / "config.json").read_text())
    fields = ("architectures", "hidden_size", "intermediate_size", "moe_intermediate_size",
              "num_hidden_layers", "first_k_dense_replace", "n_routed_experts",
              "n_shared_experts", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
              "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "vocab_size", "n_group",
              "topk_group", "num_experts_per_tok", "routed_scaling_factor")
    res["config_differs"] = [f for f in fields if cfg_out.get(f) != config.get(f)]

    def rec(label: str) -> dict:
        return next(r for r in log if r["job"].startswith(label))

    imp, exp = rec("ckpt convert --to torch_dist"), rec("ckpt convert --to hf")
    floor_imp = rec("floor: cat of the HF")["wall_s"] + log[1]["wall_s"]
    floor_exp = rec("floor: cat of the torch_dist")["wall_s"] + log[3]["wall_s"]
    gb = nbytes / 1e9
    print(f"\nHF {gb:.2f} GB -> torch_dist {td_real / 1e9:.2f} GB -> HF {out_bytes / 1e9:.2f} GB")
    for what, r, floor in (("import", imp, floor_imp), ("export", exp, floor_exp)):
        print(f"{what}: {r['wall_s'] / gb:.1f} s/GB wall ({r['cpu_s'] / gb:.1f} CPU s/GB), "
              f"floor {floor / gb:.1f} s/GB: {r['wall_s'] / floor:.2f}x the floor; peak anon "
              f"{r['peak_anon_mb']} MB, peak RSS {r['peak_rss_mb']} MB")
    print("check: " + json.dumps({k: (v if not isinstance(v, list) else
                                      (len(v), v[:4])) for k, v in res.items()}))
    full = gen.make_config(61, 3, 256, True)
    full_gb = sum(gen.nbytes(d, s) for _, d, s in gen.tensors(full)) / 1e9
    print(f"61-layer DeepSeek-V3 with MTP: {full_gb:.1f} GB: import ~"
          f"{imp['wall_s'] / gb * full_gb / 3600:.1f} h, export ~"
          f"{exp['wall_s'] / gb * full_gb / 3600:.1f} h at these rates (one process)")
    if a.out:
        a.out.write_text(json.dumps({
            "config": {k: config[k] for k in ("num_hidden_layers", "first_k_dense_replace",
                                               "n_routed_experts", "hidden_size")},
            "hf_bytes": nbytes, "torch_dist_bytes": td_real, "out_bytes": out_bytes,
            "layout": {"tp": a.tp, "pp": a.pp, "ep": a.ep}, "cold": a.cold,
            "check": res, "records": log}, indent=1, default=str) + "\n")
        print(f"wrote {a.out}")
    if not a.keep:
        shutil.rmtree(a.work, ignore_errors=True)


if __name__ == "__main__":
    main()
