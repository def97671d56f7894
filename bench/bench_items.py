"""Per-item costs at the item counts of a 671B-class checkpoint with its optimizer state.

    python bench/bench_items.py [--items 30000 60000 120000 240000] [--tp 2 --ep 64]
                                [--to-tp 4 --to-ep 32] [--out bench/out/items.json]

Builds (cached under ``bench/out/items_<layers>l``) a synthetic Megatron-Core ``torch_dist``
checkpoint of DeepSeek-V3's real tensor shapes (hidden 7168, MLA q/kv ranks 1536/512 with 128
heads of 128 + 64 rope dims, the first 3 layers dense (FFN 18432), the others MoE of 256 routed
SwiGLU experts of 2048 and one shared expert of 2048, a sigmoid router with an expert bias,
vocab 129,280, one MTP layer), keyed and chunked as Megatron-Core 0.16 stores it (per-layer
keys, ``mlp.experts.experts.*`` with the SwiGLU halves stored apart,
``fixtures/mcore016_deepseek_tp2ep2_distopt`` scaled up), at ``--tp``/``--ep`` (expert TP 1):
bf16 weights plus the DistributedOptimizer's fp32 ``param``/``exp_avg``/``exp_avg_sq`` in the
``fully_reshardable`` form (``optimizer.state.<state>.<key>``, the weights' chunks), the
``_extra_state`` objects, ``common.pt`` (the fixture's, with DeepSeek-V3's ``args``) and a
``.metadata`` written by ``dcp_torch_free_metadata`` (with ``all_local_plans``, as Megatron-Core
>= 0.11). The data files are sparse: each has the size its items need, and only the bytes
items (the ``_extra_state`` payloads, read by ``validate``) are written. The item count is set
by the layer count: 61 layers is DeepSeek-V3; more layers than 61 keep its shapes.

Each job runs in a fresh process; CPU seconds (user + system) and peak RSS from ``wait4``, and
in-process the CPU seconds of the measured phase alone:

* ``inspect``: ``ckpt inspect --json``;
* ``validate``: ``ops.validate.validate`` with every data file given as ``proven`` (the
  metadata-level checks: storage ranges, coverage, overlaps, common state, object pickles;
  no CRC pass over the data);
* ``plan``: ``ckpt reshard --check --tp TO_TP --ep TO_EP`` (open, source checks, plan), and
  ``planning.reshard.plan_reshard`` alone;
* ``write``: the output's ``.metadata`` (``planned_items`` + ``rank_plans`` + file assignment +
  ``metadata_pickle`` + the write), from the plan's target metadata, as
  ``dcp_torch_free_save`` writes it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIXTURE = HERE.parent / "fixtures" / "mcore016_deepseek_tp2ep2_distopt" / "iter_0000010"
REPO = HERE.parent

# DeepSeek-V3 (HF config.json of deepseek-ai/DeepSeek-V3)
H, VOCAB, Q_RANK, KV_RANK, HEADS, QK, ROPE, VD = 7168, 129280, 1536, 512, 128, 128, 64, 128
FFN, MOE_FFN, SHARED_FFN, EXPERTS, DENSE = 18432, 2048, 2048, 256, 3
STATES = ("param", "exp_avg", "exp_avg_sq")


# -- the tensors ------------------------------------------------------------------------------

def _tensors(layers: int, tp: int, ep: int, etp: int, mtp: int = 1):
    """``{key: (dtype, shape, [(offsets, sizes, writer)])}`` of the model (bf16; the routers'
    expert bias fp32), and the ``_extra_state`` objects ``[(key, writer)]``. ``writer``: the
    rank that stores the chunk (expert grid ``ep x etp``; dense chunks on their tp rank)."""
    out: dict[str, tuple[str, tuple[int, ...], list]] = {}
    objects: list[tuple[str, int]] = []

    def repl(key, shape, dtype="bfloat16"):
        out[key] = (dtype, shape, [((0,) * len(shape), shape, 0)])

    def split(key, shape, dim, halves=1, extra=True):
        n = shape[dim] // halves // tp
        boxes = []
        for h in range(halves):
            for t in range(tp):
                off = [0] * len(shape)
                size = list(shape)
                off[dim], size[dim] = h * (shape[dim] // halves) + t * n, n
                boxes.append((tuple(off), tuple(size), t))
        out[key] = ("bfloat16", shape, boxes)
        if extra:
            objects.append((key.rsplit(".", 1)[0] + "._extra_state/shard_0_1", 0))

    def experts(p):
        n = MOE_FFN // etp
        fc1, fc2 = [], []
        for g in range(EXPERTS):
            e = g // (EXPERTS // ep)
            for t in range(etp):
                w = e * etp + t
                fc1 += [((g, h * MOE_FFN + t * n, 0), (1, n, H), w) for h in range(2)]
                fc2.append(((g, 0, t * n), (1, H, n), w))
        out[p + "experts.experts.linear_fc1.weight"] = ("bfloat16", (EXPERTS, 2 * MOE_FFN, H), fc1)
        out[p + "experts.experts.linear_fc2.weight"] = ("bfloat16", (EXPERTS, H, MOE_FFN), fc2)
        for e in range(ep):
            objects.extend((f"{p}experts.experts.linear_{x}._extra_state/shard_{e}_{ep}", e * etp)
                           for x in ("fc1", "fc2"))

    def layer(p, moe):
        repl(p + "input_layernorm.weight", (H,))
        a = p + "self_attention."
        split(a + "linear_q_down_proj.weight", (Q_RANK, H), 0)
        repl(a + "q_layernorm.weight", (Q_RANK,))
        split(a + "linear_q_up_proj.weight", (HEADS * (QK + ROPE), Q_RANK), 0)
        split(a + "linear_kv_down_proj.weight", (KV_RANK + ROPE, H), 0)
        repl(a + "kv_layernorm.weight", (KV_RANK,))
        split(a + "linear_kv_up_proj.weight", (HEADS * (QK + VD), KV_RANK), 0)
        split(a + "linear_proj.weight", (H, HEADS * VD), 1)
        repl(p + "pre_mlp_layernorm.weight", (H,))
        m = p + "mlp."
        if not moe:
            split(m + "linear_fc1.weight", (2 * FFN, H), 0, halves=2)
            split(m + "linear_fc2.weight", (H, FFN), 1)
            return
        repl(m + "router.weight", (EXPERTS, H))
        repl(m + "router.expert_bias", (EXPERTS,), "float32")
        experts(m)
        split(m + "shared_experts.linear_fc1.weight", (2 * SHARED_FFN, H), 0, halves=2)
        split(m + "shared_experts.linear_fc2.weight", (H, SHARED_FFN), 1)

    split("embedding.word_embeddings.weight", (VOCAB, H), 0, extra=False)
    for n in range(layers):
        layer(f"decoder.layers.{n}.", n >= DENSE)
    repl("decoder.final_layernorm.weight", (H,))
    for n in range(mtp):
        p = f"mtp.layers.{n}."
        for norm in ("enorm", "hnorm", "final_layernorm"):
            repl(p + norm + ".weight", (H,))
        split(p + "eh_proj.weight", (H, 2 * H), 0)
        layer(p + "transformer_layer.", True)
    split("output_layer.weight", (VOCAB, H), 0, extra=False)
    return out, objects


def _with_optimizer(model: dict) -> dict:
    """The fully_reshardable DistributedOptimizer state: every parameter's chunks again, fp32,
    under ``optimizer.state.<state>.<key>`` (buffers such as the expert bias have none)."""
    out = dict(model)
    for key, (dtype, shape, boxes) in model.items():
        if key.endswith("expert_bias"):
            continue
        for s in STATES:
            out[f"optimizer.state.{s}.{key}"] = ("float32", shape, boxes)
    return out


def item_count(layers: int, tp: int, ep: int, etp: int = 1) -> int:
    model, objects = _tensors(layers, tp, ep, etp)
    tensors = _with_optimizer(model)
    return sum(len(b) for _, _, b in tensors.values()) + len(objects)


def layers_for(items: int, tp: int, ep: int) -> int:
    n = DENSE + 1
    while item_count(n, tp, ep) < items:
        n += max(1, (items - item_count(n, tp, ep)) // (item_count(n + 1, tp, ep) - item_count(n, tp, ep)))
    return n


# -- the checkpoint ---------------------------------------------------------------------------

def _common(layers: int, tp: int, ep: int) -> dict:
    import torch

    common = torch.load(FIXTURE / "common.pt", weights_only=False)
    a = common["args"]
    for k, v in dict(
            num_layers=layers, encoder_num_layers=layers, hidden_size=H, ffn_hidden_size=FFN,
            num_attention_heads=HEADS, vocab_size=VOCAB, padded_vocab_size=VOCAB,
            make_vocab_size_divisible_by=128, tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=1, expert_model_parallel_size=ep,
            expert_tensor_parallel_size=1, num_experts=EXPERTS, q_lora_rank=Q_RANK,
            kv_lora_rank=KV_RANK, qk_head_dim=QK, qk_pos_emb_head_dim=ROPE, v_head_dim=VD,
            moe_layer_freq=[0] * DENSE + [1] * (layers - DENSE), moe_ffn_hidden_size=MOE_FFN,
            moe_shared_expert_intermediate_size=SHARED_FFN, moe_shared_expert_gate=False,
            moe_router_topk=8, moe_router_num_groups=8, moe_router_group_topk=4,
            world_size=tp * ep, data_parallel_size=ep, seq_length=4096,
            max_position_embeddings=4096, dist_ckpt_optim_fully_reshardable=True).items():
        setattr(a, k, v)
    groups = [{"is_expert_parallel": False, "default_config": True, "wd_mult": wd,
               "lr_mult": 1.0, "is_decoupled_lr": False, "max_lr": 3e-4, "min_lr": 3e-5,
               "lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
               "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
               "differentiable": False, "fused": None, "decoupled_weight_decay": True,
               "step": 2.0} for wd in (1.0, 0.0)]
    common["optimizer"] = {i: {"optimizer": {"param_groups": [dict(g, is_expert_parallel=expert)
                                                              for g in groups]},
                               "param_state_sharding_type": "fully_reshardable"}
                           for i, expert in ((0, False), (1, True))}
    meta = dict(common.get("content_metadata") or {})
    meta["distrib_optim_sharding_type"] = "fully_reshardable"
    common["content_metadata"] = meta
    return common


def _extra_state_payload() -> bytes:
    """A real ``_extra_state`` payload from the fixture (what Megatron-Core stored)."""
    from ckpt_tool.formats.containers.dcp.dcp_metadata import read_dcp_metadata_torch_free

    md = read_dcp_metadata_torch_free(FIXTURE)
    for idx, info in md.storage_data.items():
        if "_extra_state" in idx.fqn:
            with open(FIXTURE / info.relative_path, "rb") as f:
                f.seek(info.offset)
                return f.read(info.length)
    raise SystemExit("no _extra_state item in the fixture")


def build(root: Path, layers: int, tp: int, ep: int) -> dict:
    """The synthetic checkpoint at ``root`` (kept when complete); its counts."""
    import torch

    from ckpt_tool.formats.containers.dcp.dcp_torch_free_metadata import (PlannedItem,
                                                                          metadata_pickle)
    from ckpt_tool.formats.containers.torch_zip.torch_zip_write import TensorArchive

    done = root / "built.json"
    if done.exists():
        return json.loads(done.read_text())
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    model, objects = _tensors(layers, tp, ep, 1)
    tensors = _with_optimizer(model)
    payload = _extra_state_payload()
    per_writer: dict[int, list] = {}
    for key, (dtype, shape, boxes) in tensors.items():
        for off, size, w in boxes:
            per_writer.setdefault(w, []).append(PlannedItem(key, off, size, dtype, shape))
    for key, w in objects:
        per_writer.setdefault(w, []).append(PlannedItem(key))
    plans = [per_writer[w] for w in sorted(per_writer)]
    items = [i for plan in plans for i in plan]
    archives: dict = {}
    written, file_sizes, object_at = [], {}, []
    for w, plan in zip(sorted(per_writer), plans):
        for n in range(2):  # two files per rank (Megatron-Core's default thread count)
            name, pos = f"__{w}_{n}.distcp", 0
            for item in plan[n::2]:
                if item.is_bytes:
                    length = len(payload)
                    object_at.append((name, pos))
                else:
                    k = (item.dtype, item.sizes)
                    if k not in archives:
                        a = TensorArchive(item.dtype, item.sizes, item.nbytes)
                        archives[k] = len(a.head()) + item.nbytes + len(a.tail(0))
                    length = archives[k]
                written.append((item, name, pos, length))
                pos += length
            if pos:
                file_sizes[name] = pos
    (root / ".metadata").write_bytes(metadata_pickle(
        items, written, checkpoint_id=str(root), save_id=str(uuid.uuid4()), planner_data=None,
        keep_local_plans=True, plans=plans))
    for name, size in file_sizes.items():
        with open(root / name, "wb") as f:
            f.truncate(size)  # sparse: no data blocks
    for name, pos in object_at:
        with open(root / name, "r+b") as f:
            f.seek(pos)
            f.write(payload)
    torch.save(_common(layers, tp, ep), root / "common.pt")
    (root / "metadata.json").write_text(json.dumps({
        "sharded_backend": "torch_dist", "sharded_backend_version": 1,
        "common_backend": "torch", "common_backend_version": 1}))
    info = {"layers": layers, "tp": tp, "ep": ep, "items": len(items),
            "tensor_items": len(items) - len(objects), "objects": len(objects),
            "tensors": len(tensors), "files": len(file_sizes),
            "bytes": sum(file_sizes.values()),
            "metadata_bytes": (root / ".metadata").stat().st_size}
    done.write_text(json.dumps(info))
    return info


# -- the jobs (each in a fresh process) -------------------------------------------------------

def _peak_mb() -> float:
    """This process's peak RSS (``VmHWM``: reset by ``exec``, unlike ``ru_maxrss``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def job(name: str, root: str, to_tp: int, to_ep: int) -> dict:
    """One job in this process; its measured phase's CPU seconds, wall seconds, peak RSS."""
    out: dict = {}

    def phase(label, fn):
        c0, t0, r0 = time.process_time(), time.perf_counter(), _peak_mb()
        value = fn()
        out[label] = {"cpu_s": round(time.process_time() - c0, 3),
                      "wall_s": round(time.perf_counter() - t0, 3),
                      "peak_rss_mb_before": round(r0, 1), "peak_rss_mb": round(_peak_mb(), 1)}
        return value

    if name == "validate":
        from ckpt_tool.ops.validate import validate

        files = frozenset(p.name for p in Path(root).glob("*.distcp"))
        r = phase("validate", lambda: validate(root, proven=files))
        out["findings"] = [f.to_dict() for f in r.findings][:5]
        out["ok"] = r.ok
        return out
    from ckpt_tool.formats.base import open_checkpoint
    from ckpt_tool.planning.reshard import plan_reshard, ReshardOptions
    from ckpt_tool.planning.sizes import Layout

    reader = phase("open", lambda: open_checkpoint(root))
    meta = phase("metadata", reader.metadata)
    common = phase("common", lambda: reader.common_torch_free_exact() or reader.common())
    plan = phase("plan_reshard", lambda: plan_reshard(
        meta, Layout(tp=to_tp, pp=1, ep=to_ep), None, ReshardOptions(), common=common))
    out["plan_ok"] = plan.ok
    out["problems"] = [str(p)[:200] for p in plan.problems][:5]
    if name == "write" and plan.ok:
        from ckpt_tool.formats.containers.dcp.dcp_torch_free_metadata import (
            assign_files, metadata_pickle, planned_items, rank_plans)

        target = plan.target_meta

        def write():
            chunk_files = {(k, tuple(c.offsets)): c.file for k, t in target.tensors.items()
                           for c in t.chunks if c.file}
            file_of = (lambda i: chunk_files.get((i.fqn, i.offsets))) if chunk_files else None
            items = planned_items(list(target.tensors.values()),
                                  [o.unique_key for o in target.objects])
            plans = rank_plans(items, 1, file_of)
            jobs = assign_files(plans[0], 64, file_of=file_of)
            written, pos = [], {}
            for fname, file_items in jobs:
                for i in file_items:
                    n = i.nbytes or 1000
                    written.append((i, fname, pos.get(fname, 0), n))
                    pos[fname] = pos.get(fname, 0) + n
            data = metadata_pickle(items, written, checkpoint_id=root, save_id="x",
                                   keep_local_plans=True, plans=plans)
            path = Path(root).parent / (Path(root).name + ".out.metadata")
            path.write_bytes(data)
            size = path.stat().st_size
            path.unlink()
            return len(items), size

        out["output_items"], out["output_metadata_bytes"] = phase("write_metadata", write)
    return out


def run_child(argv: list[str]) -> dict:
    """``argv`` in a fresh process: wall, CPU (user + system) and peak RSS from ``wait4``."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    import threading

    bufs = {"out": b"", "err": b""}

    def drain(stream, k):
        bufs[k] = stream.read()

    threads = [threading.Thread(target=drain, args=(proc.stdout, "out")),
               threading.Thread(target=drain, args=(proc.stderr, "err"))]
    for t in threads:
        t.start()
    _, status, usage = os.wait4(proc.pid, 0)
    for t in threads:
        t.join()
    rc = os.waitstatus_to_exitcode(status)
    return {"wall_s": round(time.perf_counter() - t0, 2),
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
            "peak_rss_mb": round(usage.ru_maxrss / 1024, 1), "rc": rc,
            "stdout": bufs["out"], "stderr": bufs["err"].decode(errors="replace")[-1500:]}


def load() -> float:
    return os.getloadavg()[0]


#: The job the per-item costs are weighed against: 8 TB (a 671B-class checkpoint with its fp32
#: optimizer state) read and written at the floor of docs/performance.md's 20 GB rows (``cat``
#: 53.6 s + ``dd conv=fsync`` 40.6 s for 20.3 GB: 0.216 GB/s of checkpoint moved).
FLOOR_GB_PER_S, JOB_BYTES = 20.3 / (53.6 + 40.6), 8e12


def table(path: Path) -> None:
    """The markdown rows of a results file: CPU s, peak RSS and share of the job per job."""
    job_s = JOB_BYTES / 1e9 / FLOOR_GB_PER_S
    print(f"job at the floor: {job_s:,.0f} s")
    print("| source items (layers) | output items | `inspect` | `validate` | `reshard --check` "
          "(`plan_reshard`) | `.metadata` write | load |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in json.loads(path.read_text()):
        c = r["checkpoint"]
        cell = {}
        for j in ("inspect", "validate", "plan", "write"):
            x = r.get(j)
            if x is None:
                cell[j] = "–"
                continue
            ph = x.get("phases") or {}
            if j == "write":
                w = ph.get("write_metadata", {})
                cpu, rss = w.get("cpu_s", 0), w.get("peak_rss_mb", 0) - w.get("peak_rss_mb_before", 0)
                cell[j] = f"{cpu:.1f} s, +{rss:.0f} MB, {100 * cpu / job_s:.2f}%"
                cell["out"] = f"{ph.get('output_items', 0):,}"
                cell["plan_reshard"] = ph.get("plan_reshard", {}).get("cpu_s")
                continue
            cell[j] = f"{x['cpu_s']:.1f} s, {x['peak_rss_mb']:.0f} MB, {100 * x['cpu_s'] / job_s:.2f}%"
        loads = "/".join(str(r[j]["load"]) for j in ("inspect", "validate", "plan", "write") if j in r)
        print(f"| {c['items']:,} ({c['layers']}) | {cell.get('out', '–')} | {cell['inspect']} | "
              f"{cell['validate']} | {cell['plan']} ({cell.get('plan_reshard')} s) | "
              f"{cell['write']} | {loads} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, nargs="+", default=[30000, 60000, 120000, 240000])
    ap.add_argument("--layers", type=int, nargs="*", help="layer counts instead of --items")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=64)
    ap.add_argument("--to-tp", type=int, default=4)
    ap.add_argument("--to-ep", type=int, default=32)
    ap.add_argument("--jobs", nargs="+", default=["inspect", "validate", "plan", "write"])
    ap.add_argument("--out", type=Path, default=HERE / "out" / "items.json")
    ap.add_argument("--job", nargs=2, metavar=("NAME", "DIR"), help=argparse.SUPPRESS)
    ap.add_argument("--build", nargs=2, metavar=("LAYERS", "DIR"), help=argparse.SUPPRESS)
    ap.add_argument("--table", type=Path, help="print a results file as markdown rows")
    a = ap.parse_args()
    if a.table:
        table(a.table)
        return
    if a.job:
        print(json.dumps(job(a.job[0], a.job[1], a.to_tp, a.to_ep)))
        return
    if a.build:
        print(json.dumps(build(Path(a.build[1]), int(a.build[0]), a.tp, a.ep)))
        return
    sys.path.insert(0, str(REPO))
    layer_counts = a.layers or json.loads(subprocess.run(  # (in a child: see below)
        [sys.executable, "-c", "import json, sys; sys.path.insert(0, sys.argv[1]); "
         "from bench_items import layers_for; print(json.dumps([layers_for(int(n), "
         f"{a.tp}, {a.ep}) for n in sys.argv[2:]]))", str(HERE), *map(str, a.items)],
        check=True, capture_output=True, text=True).stdout)
    results = []
    for layers in layer_counts:
        root = HERE / "out" / f"items_{layers}l_tp{a.tp}ep{a.ep}"
        t0 = time.perf_counter()
        # built in a child: this process stays small, so that the ``ru_maxrss`` its later
        # children inherit through fork is not theirs
        made = run_child([sys.executable, str(Path(__file__).resolve()), "--build",
                          str(layers), str(root), "--tp", str(a.tp), "--ep", str(a.ep)])
        if made["rc"]:
            sys.exit(made["stderr"])
        info = json.loads(made["stdout"])
        print(f"{root.name}: {info} (built/checked in {time.perf_counter() - t0:.1f} s)",
              flush=True)
        row = {"checkpoint": info}
        for name in a.jobs:
            before = load()
            if name == "inspect":
                argv = [sys.executable, "-m", "ckpt_tool", "inspect", "--json", str(root)]
            elif name == "plan":
                argv = [sys.executable, "-m", "ckpt_tool", "reshard", str(root), "--check",
                        "--tp", str(a.to_tp), "--ep", str(a.to_ep)]
            else:
                argv = [sys.executable, str(Path(__file__).resolve()), "--job", name,
                        str(root), "--to-tp", str(a.to_tp), "--to-ep", str(a.to_ep)]
            r = run_child(argv)
            r["load"] = round(max(before, load()), 1)
            if name in ("validate", "write"):
                try:
                    r["phases"] = json.loads(r["stdout"])
                except ValueError:
                    r["phases"] = None
            r.pop("stdout")
            if r["rc"] not in (0, 1):
                print(f"  {name} failed ({r['rc']}): {r['stderr']}", file=sys.stderr)
            print(f"  {name}: {json.dumps({k: v for k, v in r.items() if k != 'stderr'})}",
                  flush=True)
            row[name] = r
        results.append(row)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
