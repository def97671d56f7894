"""Megatron-LM legacy checkpoints (``--ckpt-format torch``): one ``torch.save`` file per
model-parallel rank, ``<iter>/mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt``.

The reader presents ONE logical checkpoint: tensors named and shaped as the TP=1/PP=1 model's
state dict holds them (``decoder.layers.{global layer}.…``, TP-merged shapes; module names such
as ``input_layernorm``/``pre_mlp_layernorm`` are kept). The split rules live in
``legacy.layout``. SwiGLU ``linear_fc1`` (each rank ``[W_r; V_r]``) becomes the canonical
``[W_0; …; W_{tp-1}; V_0; …; V_{tp-1}]``, 2 chunks per rank. ``_extra_state`` entries that are
None are skipped.

Virtual pipeline files hold ``model0..N`` (chunk ``v`` of stage ``p`` holds global layers from
``legacy.layout.virtual_layer_offset``); expert-parallel files (``mp_rank_TT_PPP_EEE``) hold
local experts ``mlp.experts.local_experts.{k}``, global expert ``ep * num_experts / EP + k``.

Optimizer state becomes tensors named like Megatron-Core's sharded optimizer state,
``optimizer.state.{exp_avg,exp_avg_sq,fp32_param}.<global param key>`` (TP-merged like the
parameter), when its mapping to the parameters can be rebuilt from the checkpoint alone
(``legacy.optim``): the non-distributed optimizer ``state_dict`` in ``model_optim_rng.pt``
(param groups matched to the rank's parameters), or ``distrib_optim.pt`` from
``save_parameter_state`` (grad-buffer layout rebuilt from the model and ``args``, checked
against the stored ``numel_unpadded``). Otherwise the reason is in
``extras["optimizer_state_not_mapped"]`` and the state stays an object. ``optimizer``,
``distrib_optim``, ``rng_state`` and ``opt_param_scheduler`` are always listed as objects too.

Metadata is torch-free (gathered by :mod:`.metadata`): each rank file's ``data.pkl`` is
unpickled with tensor placeholders (``common_state.load_torch_free``) and every chunk
points at its storage's byte range inside the zip (layout ``raw``; a slice of a
``distrib_optim.pt`` flat buffer included). Reads load (mmap) only the files holding the
requested region.
A missing rank file does not stop ``metadata()``: it is listed in ``extras["missing_rank_files"]``
(the affected tensors then lack chunks), in :meth:`LegacyReader.rank_files` and in
:attr:`LegacyReader.problems` (with dtype/shape disagreements between rank copies) for
``validate``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

from ckpt_tool.errors import CorruptCheckpointError, InputError
from ckpt_tool.formats.base import Format, Reader, register
from ckpt_tool.formats.containers.torch_zip.tar_form import refuse_tar_form
from ckpt_tool.formats.containers.torch_zip.torch_save_files import mmap_safe
from ckpt_tool.formats.legacy import layout as L
from ckpt_tool.formats.legacy import optim as _O
from ckpt_tool.formats.legacy import pieces as P
from ckpt_tool.formats.legacy.metadata import (DISTRIB_OPTIM_FILE, MODEL_FILE, RankFileScan,
                                               rank_dirs)
from ckpt_tool.formats.save_dir import resolve_checkpoint_dir
from ckpt_tool.model import CheckpointMeta, ChunkRef

__all__ = ["LegacyReader", "LEGACY"]

_LRU_FILES = 4


def sniff(path: Path) -> str | None:
    """A directory (save dir, ``iter_*`` or ``release``) holding ``mp_rank_*`` directories."""
    try:
        d = resolve_checkpoint_dir(path)
    except (InputError, OSError) as exc:
        return getattr(exc, "message", None) or str(exc)
    if not d.is_dir():
        return "not a directory"
    for marker in ("metadata.json", ".metadata"):
        if (d / marker).exists():
            return f"has {marker} (a dist/DCP checkpoint, not per-rank torch.save files)"
    names = rank_dirs(d)
    if not names:
        return "no mp_rank_* directories"
    if not any((d / n / MODEL_FILE).is_file() or (d / n / DISTRIB_OPTIM_FILE).is_file()
               for n in names):
        return f"mp_rank_* directories without {MODEL_FILE}"
    return None


class LegacyReader(Reader):
    """Reader for a Megatron-LM legacy checkpoint directory (see the module docstring)."""

    format_name = "legacy"

    def __init__(self, path: Path, *, trust: bool = False):
        super().__init__(path, trust=trust)
        self.root = resolve_checkpoint_dir(path)
        why = sniff(self.root)
        if why is not None:
            raise InputError(f"not a Megatron-LM legacy checkpoint: {why}", path=self.root)
        self._meta: CheckpointMeta | None = None
        self._sources: dict[str, P.Sources] = {}  # global key -> chunk sources
        self._files: OrderedDict[str, Any] = OrderedDict()
        self._torch_free: dict[str, Any] = {}  # rank dir -> model_optim_rng.pt loaded torch-free
        self.problems: list[dict[str, Any]] = []

    # -- metadata ---------------------------------------------------------------------------

    def rank_files(self) -> dict[str, list[str]]:
        """``{"expected": [...], "present": [...], "missing": [...], "unreadable": [...],
        "distrib_optim": [...]}``: the per-rank files (relative paths) the TP×PP×EP layout
        from ``args`` calls for, and what was found (for ``validate``)."""
        e = self.metadata().extras
        present = list(e["rank_files"])
        return {"expected": sorted(present + e["missing_rank_files"] + e["unreadable_rank_files"]),
                "present": present, "missing": list(e["missing_rank_files"]),
                "unreadable": list(e["unreadable_rank_files"]),
                "distrib_optim": list(e["distrib_optim_files"])}

    def metadata(self) -> CheckpointMeta:
        """Every merged global tensor (model, and optimizer state where its mapping to the
        parameters is exact), the rank files' objects and the args summary."""
        if self._meta is None:
            scan = RankFileScan(self.root, trust=self.trust, problems=self.problems)
            meta = scan.metadata(self.format_name)
            self._sources, self._torch_free = scan.sources, scan.torch_free
            self._meta = meta
        return self._meta

    # -- reads ------------------------------------------------------------------------------

    def _load_file(self, rel: str) -> Any:
        if rel in self._files:
            self._files.move_to_end(rel)
            return self._files[rel]
        import pickle
        import zipfile

        import torch

        path = self.root / rel
        if not path.is_file():
            raise CorruptCheckpointError(f"rank file {rel} is missing", path=self.root)
        refuse_tar_form(path, f"rank file {rel}")
        if self.verify:  # torch.load does not check the CRCs: every record's first
            from ckpt_tool.formats.containers.torch_zip.archive_check import check_file

            check_file(path, f"rank file {rel}")
        try:
            state = torch.load(path, map_location="cpu", mmap=mmap_safe(path),
                           weights_only=True)
        except pickle.UnpicklingError:
            from ckpt_tool.formats.containers.pickle.safe_pickle import load_torch_file

            state = load_torch_file(path, trust=self.trust, verify=False)
        except (RuntimeError, EOFError, zipfile.BadZipFile) as exc:
            raise CorruptCheckpointError(f"cannot load {rel} ({exc})", path=self.root) from None
        self._files[rel] = state
        while len(self._files) > _LRU_FILES:
            self._files.popitem(last=False)
        return state

    def stored_archives(self, chunks: Any) -> list[tuple[Path, int | None, int | None]]:
        """The rank files holding ``chunks``, whole (see :meth:`Reader.stored_archives`)."""
        files = dict.fromkeys(c.file for c in chunks if c.file)
        return [(self.root / f, None, None) for f in files]

    def read(self, key: str, slices: tuple[slice, ...] | None = None) -> Any:
        """The merged global tensor ``key`` (or ``slices`` of it); loads (mmap) only the rank
        files holding the requested region."""
        from ckpt_tool.formats.containers.dcp.dcp_items import assemble

        meta = self._tensor_meta(key)
        sources = self._sources[key]

        def load(chunk: ChunkRef) -> Any:
            p, rows = sources[chunk]
            t = P.walk(self._load_file(p.rel), p.path)
            if p.flat is not None:
                t = t[p.flat:p.flat + math.prod(p.shape)].view(p.shape)
            return t if rows is None else t[rows[0]:rows[1]]

        return assemble(meta, slices, load)

    def read_object(self, unique_key: str) -> Any:
        """``optimizer/<rank dir>``, ``rng_state/…``, ``opt_param_scheduler/…`` or the whole
        ``distrib_optim/<rank dir>`` file."""
        o = self._object_meta(unique_key)
        if o.key == "distrib_optim":
            return self._load_file(str(o.file))
        return self._load_file(str(o.file))[o.key]

    def _common_state(self, load: Callable[[str], Any]) -> dict[str, Any]:
        """The common state: the first rank file's top level without the model (``args`` as a
        dict), the optimizer without its tensors, and the per-rank values (``rng_state``)
        keyed by rank directory."""
        meta = self.metadata()
        files = meta.extras["rank_files"]
        first = load(files[0])
        out: dict[str, Any] = {}
        for k, v in first.items():
            if L.is_model_key(k):
                continue
            if k == "args" and hasattr(v, "__dict__"):
                v = dict(vars(v))
            elif k == "optimizer":
                v = _O.optimizer_skeleton(v)
            out[str(k)] = v
        if "rng_state" in first:
            out["rng_state"] = {f.split("/")[0]: load(f).get("rng_state") for f in files}
        return out

    def common(self) -> dict[str, Any]:
        """The full common state (see ``_common_state``), loaded with torch (mmap)."""
        return self._common_state(self._load_file)

    def common_torch_free(self) -> dict[str, Any] | None:
        """The same as :meth:`common`, torch-free (tensors as placeholders): for
        ``ckpt inspect --common``."""
        self.metadata()
        return self._common_state(lambda rel: self._torch_free[rel.split("/")[0]])

    def close(self) -> None:
        """Drop the cached rank files."""
        self._files.clear()


LEGACY = register(Format(
    name="legacy", sniff=sniff, open=LegacyReader,
    description="Megatron-LM legacy checkpoint (--ckpt-format torch): mp_rank_*/model_optim_rng.pt"))
