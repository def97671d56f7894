"""The contract every checkpoint writer implements, and the registry of writers.

The planner decides *what* goes where (a target ``CheckpointMeta`` whose tensors carry the
target chunk grid); a writer only moves bytes. Writers *pull* tensor data from a
``TensorSource`` one chunk (or one slab of a chunk) at a time, so peak memory stays near the
largest piece they ask for, never the checkpoint.

Call order (done by ``ckpt_tool.ops.convert`` and the reshard executor, never by users)::

    with staged_output(dst, overwrite=...) as staging:   # ops/_output_staging.py: atomic rename at end
        writer = writer_for("safetensors")(staging, WriterOptions(...))
        notes = writer.write(request)                     # WriteRequest below; returns notes
    # only now does ``dst`` exist

A writer is given an existing, empty directory (``staging``) and writes the whole checkpoint
into it (for single-file formats, one file inside it named ``WriterOptions.file_name``); it
never renames, fsyncs or removes anything outside that directory. It must call
``request.progress(nbytes)`` after each piece of tensor data it has written. What the target
format cannot hold is not an error: the writer returns one note per dropped thing (e.g.
``"dropped 4 ShardedObjects (rng_state/...): safetensors holds tensors only"``).
"""

from __future__ import annotations

import abc
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from ckpt_tool.errors import plural
from ckpt_tool.model import CheckpointMeta

__all__ = ["TensorSource", "WriteRequest", "WriterOptions", "Writer", "WRITERS", "writer_for",
           "dropped_objects_note"]


class TensorSource(Protocol):
    """Where a writer pulls tensor bytes from (the executor wraps a Reader, applying renames,
    dtype casts and resharding)."""

    def read(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Any:
        """The hyper-rectangle ``offsets``/``sizes`` of target tensor ``key`` as a contiguous
        CPU ``torch.Tensor`` of the target dtype. Any rectangle inside the global shape may be
        asked for; asking for a chunk of the target grid is the cheap case."""


@dataclass
class WriteRequest:
    """Everything a writer needs.

    ``meta.tensors``: target keys, dtypes, global shapes and chunk grid (``ChunkRef.offsets`` /
    ``sizes``; ``file``/``byte_*`` are ignored and decided by the writer). ``meta.objects``: the
    ShardedObjects to store (``unique_key`` as Megatron-Core spells it); their payloads come from
    ``objects(unique_key)``. ``common``: the full common state (``{}`` when none), e.g.
    Megatron-LM's ``args``, ``iteration``, ``checkpoint_version``. ``meta.common`` is its
    JSON-safe summary. ``source`` describes where the data came from, for formats that have a
    place to record it (e.g. safetensors ``__metadata__``).
    """

    meta: CheckpointMeta
    source: TensorSource
    common: dict[str, Any] = field(default_factory=dict)
    objects: Callable[[str], Any] = lambda unique_key: None
    progress: Callable[[int], None] = lambda nbytes: None
    source_description: str | None = None
    ranks: Any = None  # ckpt_tool.parallel.Ranks under torchrun; None in a single process
    #: Pass-through of stored bytes, for a writer of the source's own container format (e.g.
    #: torch_dist -> torch_dist) that can skip (de)serializing, and so importing torch:
    #: ``common_file``, the source's ``torch.save`` file of exactly the common state (then
    #: ``common`` may be left empty and ``common_loader`` loads it: see :meth:`full_common`);
    #: ``raw_object(unique_key)``, a ShardedObject's stored bytes item (``torch.save([payload])``)
    #: or None.
    common_file: Path | None = None
    common_loader: Callable[[], dict[str, Any]] | None = None
    raw_object: Callable[[str], bytes | None] = lambda unique_key: None

    def full_common(self) -> dict[str, Any]:
        """``common``, loaded by ``common_loader`` first when one is set."""
        if self.common_loader is not None:
            self.common, self.common_loader = self.common_loader(), None
        return self.common


@dataclass(frozen=True)
class WriterOptions:
    """Per-format knobs. ``max_shard_size``: bytes per safetensors shard (HF default 5 GB).
    ``file_name``: the file single-file writers create inside the directory.
    ``max_memory``: bytes a writer may hold at once (it then pulls slabs of big chunks)."""

    max_shard_size: int = 5 * 10**9
    file_name: str | None = None
    max_memory: int | None = None
    tp: int | None = None
    pp: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Writer(abc.ABC):
    """Writes one checkpoint into an empty directory. See the module docstring.

    What the commands need to know about a target format before writing is declared here,
    each with a default that means "this format does not", and set by each writer class;
    ``ops`` asks ``writer_for(name)`` for them and never tests a target format's name (what a
    name says about storage, shared with readers: ``model.FormatKind``)::

        cls = writer_for(to)
        cls.file_suffixes, cls.default_file_name    # DST as one file; what validate then reads
        cls.keeps_common                            # "full" / "scalars" / "none"
        cls.chunked, cls.keeps_source_grid          # the chunk grid the plan gives it
        cls.takes_raw_bytes, cls.takes_stored_bytes # torch-free source, pass-through items
        cls.writes_torch_free(meta, options)        # the whole write without torch
        cls.shards_by_size, cls.optimizer_beside    # max_shard_size; optimizer files apart
        cls.takes_layout, cls.makes_save_directory, cls.megatron_resume_target
        cls.supports_ranks                          # every rank of a torchrun job writes
    """

    format_name: str = ""
    #: True when ``write`` runs on every rank of a torchrun job and each rank writes only its
    #: share (``request.ranks``); otherwise only rank 0 calls ``write``.
    supports_ranks: bool = False
    #: The suffixes (lower case, with the dot) of a DST that names one file of this format:
    #: the writer then writes that one file (``WriterOptions.file_name``) into its directory.
    #: Empty: the format is a directory.
    file_suffixes: tuple[str, ...] = ()
    #: The one file that is the checkpoint when no ``file_name`` is given (what validating
    #: the output reads); None: the directory is the checkpoint.
    default_file_name: str | None = None
    #: What of the request's common state the format keeps: ``"full"`` (all of it: the
    #: source must carry a sound one), ``"scalars"`` (only the int/float/str/bool values of
    #: its JSON-safe summary, ``meta.common``, which the caller passes as ``common``) or
    #: ``"none"`` (weights only; a source without a common state converts as well).
    keeps_common: str = "full"
    #: Stores each tensor as the chunks the plan gives it (``meta.tensors[k].chunks``): the
    #: planner splits a chunk bigger than ``max_memory`` along its first axis.
    chunked: bool = False
    #: Is given the source's chunk grid (when it tiles the tensor), so each piece pulled is
    #: one source chunk read once: the chunked formats store it, others pull a whole tensor
    #: piece by piece along it; False: one chunk per tensor (the writer streams slabs).
    keeps_source_grid: bool = False
    #: ``write`` takes the raw element bytes (numpy arrays) of a torch-free source
    #: (``ops._torch_free_source.TorchFreeSource``) as well as torch tensors.
    takes_raw_bytes: bool = False
    #: ``write`` uses ``WriteRequest``'s pass-through of stored bytes (``common_file``,
    #: ``common_loader``, ``raw_object``): the common state and objects copied as stored.
    takes_stored_bytes: bool = False
    #: Splits its files at ``WriterOptions.max_shard_size`` bytes (a DST naming one file
    #: asks for a single shard).
    shards_by_size: bool = False
    #: Keeps optimizer state in files of its own beside the model's: a DST naming one file
    #: then holds the model's weights only.
    optimizer_beside: bool = False
    #: Writes at the tensor/pipeline-parallel layout ``WriterOptions.tp``/``pp`` (one file
    #: per model-parallel rank); the others write global tensors with no layout of their own.
    takes_layout: bool = False
    #: Writes the whole training save directory itself (iteration directory, tracker file,
    #: ``WriterOptions.extra["iteration_dir"]``) into the directory it is given, rather than
    #: into the container the caller makes.
    makes_save_directory: bool = False
    #: A format today's Megatron-LM resumes training from at a layout of its own (Megatron-Core
    #: 0.16 and later no longer load ``zarr``): what ``reshard`` writes and an HF directory is
    #: imported into.
    megatron_resume_target: bool = False

    @classmethod
    def writes_torch_free(cls, meta: CheckpointMeta, options: WriterOptions, *,
                          common_alone: bool = False) -> bool:
        """True when ``write`` of target ``meta`` imports no torch given a torch-free source
        and common state (``TorchRef`` values); ``common_alone``: and the common state given
        is written as given (no object moves into it). By default False."""
        return False

    def __init__(self, directory: Path, options: WriterOptions | None = None):
        self.directory = Path(directory)
        self.options = options or WriterOptions()
        #: Set by ``write`` when the output holds fewer of the request's tensors or objects
        #: than it was given (what the format has no place for); None: all of them.
        self.tensors_written: int | None = None
        self.objects_written: int | None = None

    @abc.abstractmethod
    def write(self, request: WriteRequest) -> list[str]:
        """Write everything in ``request``; return notes on what the format could not hold."""

    def written(self, meta: CheckpointMeta) -> tuple[int, int]:
        """``(tensors, objects)`` of the request's ``meta`` that the output holds (after
        ``write``)."""
        return (len(meta.tensors) if self.tensors_written is None else self.tensors_written,
                len(meta.objects) if self.objects_written is None else self.objects_written)


def dropped_objects_note(request: WriteRequest, why: str) -> list[str]:
    """The note a writer returns when its format has no place for ShardedObjects."""
    objects = request.meta.objects
    if not objects:
        return []
    shown = ", ".join(o.unique_key for o in objects[:3]) + (", ..." if len(objects) > 3 else "")
    return [f"dropped {plural(len(objects), 'ShardedObject')} ({shown}): {why}"]


# Target format name -> "module:Class"; imported lazily so `ckpt inspect` never pays for them.
WRITERS: dict[str, str] = {
    "torch_dist": "ckpt_tool.formats.mcore_dist.torch_dist_writer:TorchDistWriter",
    "dcp": "ckpt_tool.formats.dcp.writer:DcpWriter",
    "zarr": "ckpt_tool.formats.mcore_dist.zarr_writer:ZarrWriter",
    "legacy": "ckpt_tool.formats.legacy.writer:LegacyWriter",
    "torch": "ckpt_tool.formats.torch_save.writer:TorchSaveWriter",
    "safetensors": "ckpt_tool.formats.safetensors.writer:SafetensorsWriter",
    "hf": "ckpt_tool.formats.hf.writer:HfWriter",
}


def writer_for(name: str) -> type[Writer]:
    """The writer class for target format ``name`` (one of ``WRITERS``)."""
    try:
        module, _, cls = WRITERS[name].partition(":")
    except KeyError:
        from ckpt_tool.errors import UsageError

        raise UsageError(f"unknown target format {name!r}",
                         hint="use one of: " + ", ".join(WRITERS)) from None
    return getattr(importlib.import_module(module), cls)
