"""The contract every checkpoint format implements, and the registry that detects formats.

Call order for a reader::

    fmt = detect(path)                 # registry: first ``sniff(path)`` that returns True
    reader = fmt.open(path, trust=...) # cheap: resolves the directory, reads nothing big
    meta = reader.metadata()           # CheckpointMeta; metadata only, never tensor bytes
    t = reader.read(key, slices)       # one global tensor, or a hyper-rectangle of it
    obj = reader.read_object(unique_key)
    common = reader.common()           # the full common state (may need torch)
    reader.close()

Besides these, :class:`Reader` declares every optional capability the commands use, each with
a default that means "this format cannot" (see its docstring): ``ops`` calls them, and never
asks a reader what it has or which format it is (what a format's name says about its storage:
``CheckpointMeta.kind``).

Readers never modify the checkpoint. Planning (what to read) happens on ``CheckpointMeta``;
readers only move bytes.
"""

from __future__ import annotations

import abc
import errno
import importlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from ckpt_tool.errors import InputError, NotACheckpointError
from ckpt_tool.model import CheckpointMeta, ChunkRef, ObjectMeta, TensorMeta
from ckpt_tool.storage import as_path, is_remote

__all__ = ["Reader", "Format", "register", "formats", "detect", "open_checkpoint",
           "check_readable", "os_input_error"]


class Reader(abc.ABC):
    """Read access to one checkpoint.

    Call order (the module docstring has the core of it)::

        reader = fmt.open(path, trust=...)
        meta = reader.metadata()                 # first: every call below may rely on it
        reader.problems                          # what metadata() read past (validate)
        reader.objects_with_transforms()         # objects that are no plain archives (validate)
        reader.read(key, slices) / reader.read_object(unique_key)
        reader.read_object_torch_free(unique_key)  # pickles checked without torch (validate)
        reader.check_stored(chunks) / reader.check_common()  # callers reading bytes themselves
        reader.common_torch_free()               # inspect --common, without torch
        reader.common_torch_free_exact()         # reshard: the common state re-pickled exactly
        reader.common_file(), reader.stored_object_bytes(key)  # convert: copied as stored
        reader.object_item_torch_free(key)       # reshard: an object's item made without torch
        reader.common_for_target(common, layout) # reshard: the common state at the target
        reader.objects_in_common(), reader.common()
        reader.close()

    ``sharded_metadata()`` stands in for ``metadata()`` when that fails on the common state
    (``validate`` still checks the sharded data). Every optional capability has a default here
    that means "not in this format" (None, ``()``, ``frozenset()``, the argument unchanged, or
    the plain call it refines), so callers never probe a reader for it.
    """

    format_name: str = ""
    #: Check every byte read against what the checkpoint records about it (zip CRC-32s)
    #: before handing it out; False only on the user's explicit request (``--no-verify``).
    verify: bool = True
    #: What :meth:`metadata` read past without failing (a missing rank file, rank copies that
    #: disagree), ``{"message", "key", "file"}`` each: ``validate`` reports every one.
    problems: Sequence[dict[str, Any]] = ()

    def __init__(self, path: Path, *, trust: bool = False):
        self.path = as_path(path)
        self.trust = trust

    @abc.abstractmethod
    def metadata(self) -> CheckpointMeta:
        """The checkpoint mapped into the metadata model, without reading tensor data."""

    def _tensor_meta(self, key: str) -> TensorMeta:
        """The metadata of tensor ``key``; InputError naming the checkpoint when absent."""
        try:
            return self.metadata().tensors[key]
        except KeyError:
            raise InputError(f"no tensor {key!r} in the checkpoint",
                             path=getattr(self, "root", self.path)) from None

    def _object_meta(self, unique_key: str) -> ObjectMeta:
        """The metadata of stored object ``unique_key``; InputError when absent."""
        for o in self.metadata().objects:
            if o.unique_key == unique_key:
                return o
        raise InputError(f"no object {unique_key!r} in the checkpoint",
                         path=getattr(self, "root", self.path))

    def read(self, key: str, slices: tuple[slice, ...] | None = None) -> Any:
        """The global tensor ``key`` (a torch.Tensor), or only ``slices`` of it."""
        raise NotImplementedError(f"{type(self).__name__}.read")

    def read_object(self, unique_key: str) -> Any:
        """A stored non-tensor object (ShardedObject payload)."""
        raise NotImplementedError(f"{type(self).__name__}.read_object")

    def common(self) -> dict[str, Any]:
        """The full common state (non-sharded values), loaded through the safe unpickler."""
        return {}

    def stored_archives(self, chunks: Iterable[ChunkRef]) -> list[tuple[Path, int | None,
                                                                         int | None]]:
        """The ``torch.save`` archives that store ``chunks``: ``(file, offset, length)`` of
        each (offset None: the whole file), in the order of ``chunks``, each once; none for
        formats without such archives."""
        return []

    def check_stored(self, chunks: Iterable[ChunkRef]) -> None:
        """Check the stored bytes of ``chunks`` against what the checkpoint records about
        them (the CRC-32s of the zip records of :meth:`stored_archives`), once each, for a
        caller that reads those bytes on its own (``diff`` compares them in place);
        IntegrityError on a mismatch. Nothing to do when :attr:`verify` is off."""
        from ckpt_tool.formats.containers.torch_zip.archive_check import check_many

        if self.verify:
            check_many(self.stored_archives(chunks))

    def check_common(self) -> None:
        """Check the stored bytes the common state comes from (as :meth:`check_stored`), for a
        caller that takes it from the metadata's summary instead of :meth:`common` (which
        checks them itself)."""

    def read_object_torch_free(self, unique_key: str) -> Any:
        """:meth:`read_object` without importing torch where the format can (tensors as
        placeholders, through the same allowlisting unpickler: what ``validate`` checks
        pickles with); by default :meth:`read_object` itself."""
        return self.read_object(unique_key)

    def common_torch_free(self) -> dict[str, Any] | None:
        """The full common state without importing torch, tensors as placeholders (for
        showing it: ``inspect --common``); None where the format has no such loader (the
        metadata's summary is then what there is)."""
        return None

    def common_torch_free_exact(self) -> dict[str, Any] | None:
        """:meth:`common` without importing torch, when it holds no more of torch than dtypes
        (these as ``torch_save_object.TorchRef``): ``torch.save`` of it gives the bytes
        ``torch.save`` of :meth:`common` gives. None otherwise, or where the format cannot
        tell."""
        return None

    def common_file(self) -> Path | None:
        """The checkpoint's own ``torch.save`` file of exactly :meth:`common`, when a writer
        of the same form may copy it as it is (its CRC-32s checked first); None otherwise."""
        return None

    def stored_object_bytes(self, unique_key: str) -> bytes | None:
        """The stored bytes of object ``unique_key`` when a writer of the same form may copy
        them as they are (a ``torch.save([payload])`` item that loads without torch); None
        otherwise."""
        return None

    def object_item_torch_free(self, unique_key: str) -> bytes | None:
        """``torch.save([read_object(unique_key)])``'s bytes (what a torch_dist writer stores
        for the object), made without torch; None where that needs torch."""
        return None

    def objects_with_transforms(self) -> frozenset[str]:
        """The stored objects whose bytes pass stream transforms (DCP
        ``transform_descriptors``): no plain ``torch.save`` archives, so left out of the
        archive checks. Known once :meth:`metadata` has run."""
        return frozenset()

    def sharded_metadata(self) -> tuple[dict[str, TensorMeta], list[ObjectMeta],
                                        dict[str, Any]] | None:
        """The tensors, objects and facts of the sharded data alone, without reading the
        common state (``validate`` checks the sharded data of a checkpoint whose common state
        is unreadable); None where the format keeps no common state apart."""
        return None

    def common_for_target(self, common: dict[str, Any], target: Any) -> dict[str, Any]:
        """The common state to write at the ``target`` layout (``planning`` sizes), for a
        reader whose common state holds per-layout entries (a ChainedOptimizer's, seen in
        model space); by default ``common`` unchanged."""
        return common

    def objects_in_common(self) -> frozenset[str]:
        """The stored objects (unique keys) that are pieces of :meth:`common` rather than
        objects of their own (a format that keeps its common state as stored items, e.g. DCP's
        bytes items): compared and converted as the common state, not again as objects."""
        return frozenset()

    def close(self) -> None:
        """Release open files and maps."""

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class Format:
    """A registered format: its name, how to recognise it and how to open it.

    ``sniff(path)`` returns ``None`` on a match or a short reason why the path is not this format
    (so detection failures can list what was tried and why). ``remote``: its reader reads
    object-store locations (``ckpt_tool.storage.ObjectPath``) as well as local paths.
    """

    name: str
    sniff: Callable[[Path], str | None]
    open: Callable[..., Reader]
    description: str = ""
    remote: bool = False


_REGISTRY: dict[str, Format] = {}


def register(fmt: Format) -> Format:
    """Add a format to the registry (later registrations of the same name replace earlier)."""
    _REGISTRY[fmt.name] = fmt
    return fmt


def formats() -> dict[str, Format]:
    """Registered formats in detection order."""
    importlib.import_module("ckpt_tool.formats")  # its __init__ registers the built-in formats

    return dict(_REGISTRY)


def os_input_error(exc: OSError, path: str | Path) -> InputError:
    """An OSError met while reading ``path`` as one clear InputError (loop, permission, ...)."""
    p = Path(exc.filename) if getattr(exc, "filename", None) else Path(path)
    if exc.errno == errno.ELOOP:
        return InputError("symlink loop (the link points back at itself through other links)",
                          path=p, hint="fix or remove the symlink")
    if exc.errno == errno.ENOENT:
        if os.path.islink(p):
            return InputError(f"broken symlink (points at {os.readlink(p)}, which does not "
                              "exist)", path=p, hint="fix or remove the symlink")
        from ckpt_tool.leftovers import (describe_leftovers, leftovers, parked_previous,
                                         restore_command)

        parked = parked_previous(p)
        if parked is not None:
            return InputError(
                "no checkpoint here: an interrupted write that was replacing it left the "
                f"previous checkpoint in {parked.parent.name}/{parked.name}", path=p,
                hint=f"restore it with: {restore_command(parked, p)} ; the next run "
                "writing this path also restores it first")
        left = leftovers(p)
        if left:
            return InputError(f"no checkpoint here, but an interrupted write left "
                              f"{describe_leftovers(left)} beside it", path=p,
                              hint="rerun the command that writes it (the rerun reclaims "
                              "them), or delete them")
        return InputError("no such file or directory", path=p, hint="check the path")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return InputError("permission denied", path=p,
                          hint="check the permissions: read, and execute on directories")
    return InputError(f"cannot read ({exc.strerror or exc})", path=p)


_MARKERS = ("metadata.json", ".metadata", "common.pt", "latest_checkpointed_iteration.txt")


def _interrupted_write(p: Any) -> InputError | None:
    """An object-store location that holds only what an unfinished write left (its run
    marker is beside it: ``ckpt_tool.storage.writing``), as one clear error; else None."""
    from ckpt_tool.leftovers import describe_leftovers, leftovers

    left = leftovers(p)
    if not left:
        return None
    return InputError(f"no checkpoint here, but an unfinished write left "
                      f"{describe_leftovers(left)}", path=p,
                      hint="rerun the command that writes it (the rerun reclaims them), or "
                           "delete them")


def check_readable(path: str | Path) -> None:
    """InputError naming the problem when ``path`` cannot be read at all: missing, a symlink
    loop or broken symlink (the path or a marker file in it), no permission, not a regular
    file (a FIFO, socket or device: ``regular_files``); on an object store: neither an object
    nor a prefix with objects under it."""
    from ckpt_tool.formats.regular_files import check_regular, open_regular

    p = as_path(path)
    if is_remote(p):
        if not p.exists():
            raise _interrupted_write(p) or InputError(
                "no such object or prefix", path=p,
                hint="check the URL (the bucket, the prefix) and the endpoint")
        return
    try:
        st = os.stat(p)
        if stat.S_ISDIR(st.st_mode):
            with os.scandir(p) as it:
                next(it, None)
            for name in _MARKERS:
                if os.path.islink(p / name):
                    os.stat(p / name)
                check_regular(p / name)  # read before the checkpoint's tree is checked
        elif stat.S_ISREG(st.st_mode):
            with open_regular(p) as f:
                f.read(1)
        else:  # a FIFO, socket or device: opening it could block
            check_regular(p)
            raise InputError("not a regular file or directory", path=p,
                             hint="pass a checkpoint directory or file")
    except OSError as exc:
        raise os_input_error(exc, p) from None


def detect(path: str | Path) -> Format:
    """The format of ``path``; raises NotACheckpointError listing every format tried and why,
    or an InputError when the path cannot be read at all (missing, symlink loop, permission,
    a tracker file with garbage content)."""
    from ckpt_tool.formats.regular_files import check_tree
    from ckpt_tool.formats.save_dir import resolve_checkpoint_dir

    p = as_path(path)
    check_readable(p)
    remote = is_remote(p)
    reasons = []
    try:
        try:
            root = resolve_checkpoint_dir(p)  # a bad tracker: one clear error, not one per format
        except NotACheckpointError:
            raise
        except InputError as exc:
            raise NotACheckpointError(exc.message, path=exc.path, hint=exc.hint) from None
        if root.is_dir():  # no FIFO, socket or device in it: before any format reads a file
            check_tree(root)
        for fmt in formats().values():
            if remote and not fmt.remote:
                reasons.append(f"{fmt.name}: not read from object stores (copy it to a local "
                               "disk)")
                continue
            why = fmt.sniff(p)
            if why is None:
                return fmt
            reasons.append(f"{fmt.name}: {why}")
    except OSError as exc:
        raise os_input_error(exc, p) from None
    if remote and (left := _interrupted_write(p)) is not None:
        raise left
    raise NotACheckpointError(
        "not a checkpoint of any known format [" + "; ".join(reasons) + "]", path=p,
        hint="pass a checkpoint directory, an iter_* directory or a training save directory",
    )


def open_checkpoint(path: str | Path, *, trust: bool = False, verify: bool = True) -> Reader:
    """Detect the format of ``path`` and open a reader on it (``verify``: see
    :attr:`Reader.verify`)."""
    reader = detect(path).open(as_path(path), trust=trust)
    reader.verify = verify
    return reader
