"""Ask the REAL loaders whether each damaged checkpoint loads (run as a script, 1 process).

    python _oracle.py CASES.json OUT.json

CASES.json: ``[[case_id, base, path], ...]``. OUT.json: ``{case_id: "ok" | "error: ..."}``.
Each case runs in a forked child (torch and Megatron-Core imported once, before): a loader that
aborts the process (``std::bad_alloc`` on a TB shape) is that case's "error".
Loaders: Megatron-Core 0.16 ``load_tensors_metadata`` / ``load_common_state_dict`` /
``load_plain_tensors`` / ShardedObject loads (torch_dist, on a 1-rank gloo group); tensorstore
with the spec Megatron-Core 0.15 used + ``torch.load`` of common.pt and object files (zarr; the
installed Megatron-Core no longer has that backend); ``dcp_to_torch_save`` (DCP);
``torch.load`` of every rank file the tracker names (legacy); ``torch.load(weights_only=True)``
(torch.save); ``safetensors.safe_open`` + ``get_tensor`` of every key (safetensors, and every
shard an index names, as transformers does). It must not import ckpt_tool.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import tempfile
import traceback
from pathlib import Path

# the fixtures' common.pt holds argparse.Namespace: Megatron-LM allowlists it at startup
os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))  # a TB allocation fails, fast
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist_checkpointing" / "_workers"))

import torch  # noqa: E402


def _torch_dist(path: Path) -> None:
    from dist_worker import import_lib

    lib, _ = import_lib("mcore")
    ck = str(path)
    lib.load_tensors_metadata(ck)
    lib.load_common_state_dict(ck)
    lib.load_plain_tensors(ck)
    for key, sh in lib.serialization.load_sharded_metadata(ck).items():
        if isinstance(sh, lib.ShardedObject):
            lib.load({"o": sh}, ck, validate_access_integrity=False)


def _zarr(path: Path) -> None:
    import ml_dtypes  # noqa: F401  (registers bfloat16 as MCore 0.15 did via tensorstore)
    import tensorstore as ts

    cfg = json.loads((path / "metadata.json").read_text())
    if cfg["sharded_backend"] != "zarr":
        raise ValueError(f"backend {cfg['sharded_backend']}")
    torch.load(path / "common.pt", weights_only=False)
    for entry in sorted(path.iterdir()):
        if not entry.is_dir() or entry.name.endswith(".sync"):
            continue
        if (entry / ".zarray").exists() or not any(entry.glob("*.pt")):
            spec = {"driver": "zarr", "metadata_key": ".zarray",
                    "kvstore": {"driver": "file", "path": str(entry)}}
            arr = ts.open(spec, open=True).result()
            arr.read().result()
        for obj in entry.glob("*.pt"):
            torch.load(obj, weights_only=False)


def _dcp(path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(path), os.path.join(tmp, "out.pt"))


def _legacy(path: Path) -> None:
    text = (path / "latest_checkpointed_iteration.txt").read_text().strip()
    it = "release" if text == "release" else f"iter_{int(text):07d}"
    files = sorted((path / it).glob("mp_rank_*/model_optim_rng.pt"))
    if not files:
        raise FileNotFoundError(path / it)
    for f in files:
        torch.load(f, weights_only=False, map_location="cpu")


def _torch(path: Path) -> None:
    torch.load(path, weights_only=True)


def _safetensors(path: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        for k in f.keys():
            f.get_tensor(k)


def _st_index(path: Path) -> None:
    from safetensors import safe_open

    index = json.loads((path / "model.safetensors.index.json").read_text())
    by_file: dict[str, list[str]] = {}
    for key, name in index["weight_map"].items():
        by_file.setdefault(name, []).append(key)
    for name, keys in by_file.items():
        with safe_open(str(path / name), "pt") as f:
            for k in keys:
                f.get_tensor(k)


LOADERS = {"torch_dist": _torch_dist, "zarr": _zarr, "dcp": _dcp, "legacy": _legacy,
           "torch": _torch, "safetensors": _safetensors, "st_index": _st_index,
           "torch_dist_bf16": _torch_dist, "torch_dist_flat": _torch_dist}


def _one(base: str, path: str, store: str) -> str:
    """The verdict on one case, in a forked child (a loader that aborts kills only it)."""
    import torch.distributed as dist

    signal.alarm(600)  # a hang guard: a busy machine must not turn a slow load into a verdict
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        LOADERS[base](Path(path))
        return "ok"
    except BaseException as e:  # noqa: BLE001 - any failure is the loader's verdict
        if os.environ.get("ORACLE_DEBUG"):
            traceback.print_exc()
        return f"error: {type(e).__name__}: {str(e)[:300]}"


def _alarm(*_):
    raise TimeoutError("the real loader did not finish in 600 s")


def main() -> int:
    cases, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    import torch.distributed  # noqa: F401  (imported once, before the forks)
    from dist_worker import import_lib

    import_lib("mcore")
    signal.signal(signal.SIGALRM, _alarm)
    verdicts = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (case_id, base, path) in enumerate(cases):
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                verdict = _one(base, path, f"{tmp}/store{i}")
                os.write(w, verdict.encode()[:4000])
                os._exit(0)
            os.close(w)
            with os.fdopen(r, "rb") as f:
                text = f.read().decode(errors="replace")
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            verdicts[case_id] = text if text else f"error: the loader crashed the process ({code})"
    out.write_text(json.dumps(verdicts, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
