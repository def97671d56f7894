"""Run under torchrun (2 gloo ranks) by ``test_dcp_raw_save.py``: ``convert --to torch_dist``,
``reshard`` and ``convert --to dcp`` of a torch_dist fixture, each written twice, through DCP's
save (the raw path refused) and through the raw path; rank 0 prints a JSON verdict comparing
the two.

argv: SRC OUT
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

from ckpt_tool.formats.containers.dcp import dcp_torch_free_save as dcp_raw_save
from ckpt_tool.formats.dcp import writer as dcp_writer
from ckpt_tool.formats.mcore_dist import torch_dist_writer
from ckpt_tool.ops.convert import ConvertOptions
from ckpt_tool.formats.save_dir import locate_source
from ckpt_tool.ops.convert import convert
from ckpt_tool.ops.reshard import ReshardRequest, reshard
from ckpt_tool.parallel import ranks


def _common(d: Path) -> dict | None:
    import torch

    if not (d / "common.pt").is_file():  # a plain DCP checkpoint
        return None
    common = torch.load(d / "common.pt", weights_only=False)
    return {k: vars(v) if k == "args" else v for k, v in common.items()}


def compare(a: Path, b: Path) -> dict:
    a, b = (locate_source(d).checkpoint for d in (a, b))  # (in their save directories)
    names = sorted(p.name for p in a.glob("*.distcp"))
    ma = pickle.loads((a / ".metadata").read_bytes())
    mb = pickle.loads((b / ".metadata").read_bytes())
    ids = (ma.storage_meta.checkpoint_id, mb.storage_meta.checkpoint_id)
    ma.storage_meta = mb.storage_meta  # the staging path and a fresh UUID
    return {
        "files": names, "same_names": names == sorted(p.name for p in b.glob("*.distcp")),
        "same_bytes": all((a / n).read_bytes() == (b / n).read_bytes() for n in names),
        # equal values (torch.save's bytes depend on which strings the process interned)
        "same_common": _common(a) == _common(b),
        "metadata_equal": ma == mb,
        "storage_order": list(ma.storage_data) == list(mb.storage_data),
        "plans": len(ma.all_local_plans) if ma.all_local_plans is not None else None,
        "staged_ids": all(".ckpt-staging-" in i for i in ids),
        "manifest": all((d / "integrity.json").is_file() or (d / "ckpt-manifest.json").is_file()
                        for d in (a, b)),
    }


def main() -> None:
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    r = ranks()
    real = torch_dist_writer.TorchDistWriter._write_raw, dcp_writer.torch_free_write_applies
    saves, torch_free_dcp_save = [], dcp_raw_save.torch_free_dcp_save
    dcp_raw_save.torch_free_dcp_save = lambda d, *a, **k: saves.append(d) or torch_free_dcp_save(d, *a, **k)
    runs = {"convert": lambda d: convert(src, d, ConvertOptions(to="torch_dist")),
            "reshard": lambda d: reshard(src, d, ReshardRequest(tp=1, pp=1)),
            "convert_dcp": lambda d: convert(src, d, ConvertOptions(to="dcp"))}
    verdict = {}
    for name, run in runs.items():
        torch_dist_writer.TorchDistWriter._write_raw = lambda self, req, notes: False
        dcp_writer.torch_free_write_applies = lambda *a: False
        run(out / f"{name}_dcp")
        torch_dist_writer.TorchDistWriter._write_raw, dcp_writer.torch_free_write_applies = real
        before = len(saves)
        run(out / f"{name}_raw")
        raw_taken = r.gather(len(saves) == before + 1)
        if r.is_main:
            verdict[name] = {**compare(out / f"{name}_raw", out / f"{name}_dcp"),
                             "raw_on_every_rank": all(raw_taken)}
    r.barrier()
    if r.is_main:
        print("VERDICT " + json.dumps(verdict))


if __name__ == "__main__":
    main()
