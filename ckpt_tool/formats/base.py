"""The contract every checkpoint format implements, and the registry that detects formats.

Call order for a reader::

    fmt = detect(path)                 # registry: first ``sniff(path)`` that returns True
    reader = fmt.open(path, trust=...) # cheap: resolves the directory, reads nothing big
    meta = reader.metadata()           # CheckpointMeta; metadata only, never tensor bytes
    t = reader.read(key, slices)       # one global tensor, or a hyper-rectangle of it
    obj = reader.read_object(unique_key)
    common = reader.common()           # the full common state (may need torch)
    reader.close()

Readers never modify the checkpoint. Planning (what to read) happens on ``CheckpointMeta``;
readers only move bytes.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ckpt_tool.errors import NotACheckpointError, InputError
from ckpt_tool.model import CheckpointMeta, ObjectMeta, TensorMeta

__all__ = ["Reader", "Format", "register", "formats", "detect", "open_checkpoint"]


class Reader(abc.ABC):
    """Read access to one checkpoint. See the module docstring for the call order."""

    format_name: str = ""

    def __init__(self, path: Path, *, trust: bool = False):
        self.path = Path(path)
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
    (so detection failures can list what was tried and why).
    """

    name: str
    sniff: Callable[[Path], str | None]
    open: Callable[..., Reader]
    description: str = ""


_REGISTRY: dict[str, Format] = {}


def register(fmt: Format) -> Format:
    """Add a format to the registry (later registrations of the same name replace earlier)."""
    _REGISTRY[fmt.name] = fmt
    return fmt


def formats() -> dict[str, Format]:
    """Registered formats in detection order."""
    from ckpt_tool import formats as _pkg  # noqa: F401  (registers the built-in formats)

    return dict(_REGISTRY)


def detect(path: str | Path) -> Format:
    """The format of ``path``; raises NotACheckpointError listing every format tried and why."""
    p = Path(path)
    if not p.exists() and not p.is_symlink():
        raise InputError("no such file or directory", path=p, hint="check the path")
    reasons = []
    for fmt in formats().values():
        why = fmt.sniff(p)
        if why is None:
            return fmt
        reasons.append(f"{fmt.name}: {why}")
    raise NotACheckpointError(
        "not a checkpoint of any known format [" + "; ".join(reasons) + "]", path=p,
        hint="pass a checkpoint directory, an iter_* directory or a training save directory",
    )


def open_checkpoint(path: str | Path, *, trust: bool = False) -> Reader:
    """Detect the format of ``path`` and open a reader on it."""
    return detect(path).open(Path(path), trust=trust)
