"""``validate``: the metadata against what the checkpoint itself holds (no tensor bytes read).

* a checkpoint without tensors is not a checkpoint to load or convert (an empty shell, or
  metadata that names the wrong backend: read as zarr, a torch_dist directory has no arrays);
* ``metadata.json`` naming one backend over the files of another (zarr over ``.metadata`` and
  ``*.distcp``);
* a Megatron-Core dist checkpoint without its common state (``common.pt``, or the newest
  Megatron-Core's ``common_state`` object): the iteration, ``args``, ... are lost;
* zarr arrays carry no dtype of their own (a chunk is raw bytes): a ``.zarray`` dtype that
  differs from the model's ``params_dtype`` (``args``) while having its size is a relabelling
  the chunk sizes cannot reveal; tensors of another size (an fp32 buffer in a bf16 model) and
  optimizer state are left alone.

The dtype and size of DCP items are compared with the metadata in the integrity pass (each
item's pickled tensor is the ground truth, ``_scan_item``/``_scan_vector``); safetensors and
torch.save headers are read with the data they describe (``check_storage``).
"""

from __future__ import annotations

from pathlib import Path

from ckpt_tool.model import DTYPE_ITEMSIZE, CheckpointMeta, is_optimizer_key
from ckpt_tool.ops.validate._checks import error, warning
from ckpt_tool.model import Finding

__all__ = ["check_meta_against_files", "check_common_state"]


def check_meta_against_files(root: Path, meta: CheckpointMeta) -> list[Finding]:
    """Error findings of the metadata contradicted by the files (see the module doc)."""
    out: list[Finding] = []
    if meta.kind.zarr_arrays and root.is_dir() and (
            (root / ".metadata").is_file() or any(root.glob("*.distcp"))):
        out.append(error("metadata.json names the zarr backend, but the directory holds "
                         "torch_dist data (.metadata, *.distcp): metadata.json is damaged",
                         file="metadata.json"))
    if not meta.tensors and meta.kind.zarr_arrays:  # no arrays: nothing says there were none
        out.append(error(f"no tensors: nothing a loader could restore (read as "
                         f"{meta.format})"))
    elif not meta.tensors:  # the metadata says so: an empty save, valid for its loader
        out.append(warning(f"no tensors: the metadata lists none (an empty save; read as "
                           f"{meta.format})"))
    if meta.kind.zarr_arrays:
        out += _zarr_dtypes(meta)
    return out


def _zarr_dtypes(meta: CheckpointMeta) -> list[Finding]:
    params = (meta.common.get("model") or {}).get("params_dtype")
    size = DTYPE_ITEMSIZE.get(str(params))
    if size is None:
        return []
    return [error(f".zarray says {t.dtype}, the model's params_dtype (args) is {params}, of "
                  "the same size: the chunks cannot tell them apart, the .zarray dtype is "
                  "damaged", key=key, file=f"{key}/.zarray")
            for key, t in sorted(meta.tensors.items())
            if not is_optimizer_key(key) and t.dtype != params
            and DTYPE_ITEMSIZE.get(t.dtype) == size]


def check_common_state(root: Path, meta: CheckpointMeta) -> list[Finding]:
    """Megatron-Core dist checkpoints keep their common state in ``common.pt`` (or, newest
    MCore, in the ``common_state`` object): without either, MCore cannot load them."""
    if not meta.kind.megatron_dist:
        return []
    if (root / "common.pt").is_file() or meta.extras.get("common_object"):
        return []
    return [error("common.pt is missing (and there is no common_state object): the "
                  "non-sharded state (iteration, args, ...) is lost", file="common.pt")]
