"""``ObjectPath``: a key of an object store behind the part of ``pathlib.Path`` readers use.

Objects and "directories" (key prefixes ending in ``/``) are told apart by listing the parent
prefix once (cached by the store), so sniffing a checkpoint costs a LIST per directory, not a
request per question. Reads are ranged GETs; :meth:`ObjectPath.open` gives a seekable binary
file (the whole object in memory when it is small, else reads of the ranges asked for, 4 MiB
buffered). There is no ``__fspath__``: code that would hand an object to ``open()`` or
``os.*`` by mistake fails at once instead of reading a local path of the same name.
"""

from __future__ import annotations

import errno
import fnmatch
import io
import os
import stat as stat_
from typing import Any, BinaryIO, Iterator, NamedTuple

from ckpt_tool.storage.locations import StoreSpec

__all__ = ["ObjectPath", "ObjectStat"]

_SMALL = 4 << 20  # objects up to this size are opened as one GET into memory


class ObjectStat(NamedTuple):
    """What ``os.stat`` would say of an object (``S_IFREG``) or a prefix (``S_IFDIR``)."""

    st_mode: int
    st_size: int
    st_mtime: float

    @property
    def st_mtime_ns(self) -> int:
        return int(self.st_mtime * 1e9)


class ObjectPath:
    """The object (or prefix) ``key`` of the store ``spec``; see the module docstring."""

    is_object_path = True
    __slots__ = ("spec", "key")

    def __init__(self, spec: StoreSpec, key: str = ""):
        self.spec = spec
        self.key = key.strip("/")

    @property
    def store(self) -> Any:
        from ckpt_tool.storage.s3 import store_for

        return store_for(self.spec)

    # -- pure path ------------------------------------------------------------------------
    def __str__(self) -> str:
        return self.spec.url_root + self.key

    def __repr__(self) -> str:
        return f"ObjectPath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectPath) and (self.spec, self.key) == (other.spec, other.key)

    def __hash__(self) -> int:
        return hash((self.spec, self.key))

    def __lt__(self, other: "ObjectPath") -> bool:
        return str(self) < str(other)

    def __truediv__(self, other: Any) -> "ObjectPath":
        parts = [p for p in str(other).replace("\\", "/").split("/") if p not in ("", ".")]
        if ".." in parts:
            raise ValueError(f"'..' in an object key: {other}")
        return ObjectPath(self.spec, "/".join([self.key] + parts if self.key else parts))

    def joinpath(self, *others: Any) -> "ObjectPath":
        p = self
        for o in others:
            p = p / o
        return p

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def parent(self) -> "ObjectPath":
        return ObjectPath(self.spec, self.key.rsplit("/", 1)[0] if "/" in self.key else "")

    @property
    def parents(self) -> list["ObjectPath"]:
        out, p = [], self
        while p.key:
            p = p.parent
            out.append(p)
        return out

    @property
    def suffix(self) -> str:
        name = self.name
        i = name.rfind(".")
        return name[i:] if 0 < i < len(name) - 1 else ""

    @property
    def stem(self) -> str:
        return self.name[:-len(self.suffix)] if self.suffix else self.name

    @property
    def parts(self) -> tuple[str, ...]:
        return (self.spec.url_root,) + tuple(p for p in self.key.split("/") if p)

    def with_name(self, name: str) -> "ObjectPath":
        return self.parent / name

    def relative_to(self, other: "ObjectPath") -> str:
        if other.spec != self.spec or not (self.key + "/").startswith(
                other.key + "/" if other.key else ""):
            raise ValueError(f"{self} is not under {other}")
        return self.key[len(other.key):].lstrip("/")

    def as_posix(self) -> str:
        return str(self)

    def resolve(self, strict: bool = False) -> "ObjectPath":
        return self

    absolute = resolve

    def is_absolute(self) -> bool:
        return True

    def is_symlink(self) -> bool:
        return False

    # -- what is there --------------------------------------------------------------------
    def stat(self) -> ObjectStat:
        """``S_IFREG`` with the object's size, ``S_IFDIR`` for a prefix with objects under
        it; FileNotFoundError when neither."""
        store = self.store
        if not self.key:
            return ObjectStat(stat_.S_IFDIR | 0o755, 0, 0.0)
        name = self.name
        listing = store.listing(self.parent.key, looking_for=name)
        if name in listing.files:
            size, mtime = listing.files[name]
            return ObjectStat(stat_.S_IFREG | 0o644, size, mtime)
        if name in listing.dirs:
            return ObjectStat(stat_.S_IFDIR | 0o755, 0, 0.0)
        raise FileNotFoundError(errno.ENOENT, "no such object or prefix", str(self))

    lstat = stat

    def exists(self) -> bool:
        try:
            self.stat()
        except FileNotFoundError:
            return False
        return True

    def is_file(self) -> bool:
        try:
            return stat_.S_ISREG(self.stat().st_mode)
        except FileNotFoundError:
            return False

    def is_dir(self) -> bool:
        try:
            return stat_.S_ISDIR(self.stat().st_mode)
        except FileNotFoundError:
            return False

    def iterdir(self) -> Iterator["ObjectPath"]:
        listing = self.store.listing(self.key)
        for name in sorted(set(listing.files) | listing.dirs):
            yield self / name

    def glob(self, pattern: str) -> Iterator["ObjectPath"]:
        """Children matching ``pattern`` (one level; ``*/name`` two)."""
        head, _, rest = pattern.partition("/")
        for child in self.iterdir():
            if fnmatch.fnmatchcase(child.name, head):
                if not rest:
                    yield child
                elif child.is_dir():
                    yield from child.glob(rest)

    def rglob(self, pattern: str) -> Iterator["ObjectPath"]:
        for key, _size in self.store.walk(self.key):
            p = ObjectPath(self.spec, key)
            if fnmatch.fnmatchcase(p.name, pattern):
                yield p

    # -- bytes ----------------------------------------------------------------------------
    def read_range(self, offset: int, length: int) -> bytes:
        return self.store.get(self.key, offset, length)

    def read_into(self, offset: int, buf: Any) -> int:
        return self.store.read_into(self.key, offset, buf)

    def read_bytes(self) -> bytes:
        size = self.stat().st_size
        buf = bytearray(size)
        n = self.read_into(0, buf)
        return bytes(buf[:n]) if n < size else bytes(buf)

    def read_text(self, encoding: str | None = None, errors: str | None = None) -> str:
        return self.read_bytes().decode(encoding or "utf-8", errors or "strict")

    def open(self, mode: str = "rb", buffering: int = -1, encoding: str | None = None,
             errors: str | None = None, newline: str | None = None) -> BinaryIO | Any:
        """A seekable reader (``"rb"``, or ``"r"`` for text); writing goes through the
        output staging (``ops/_remote_output``), never through here."""
        if mode not in ("rb", "r"):
            raise io.UnsupportedOperation(f"{self}: objects are opened for reading only")
        st = self.stat()
        if not stat_.S_ISREG(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "a prefix, not an object", str(self))
        size = st.st_size
        if size <= _SMALL:
            f: Any = io.BytesIO(self.read_bytes())
        else:
            f = io.BufferedReader(_RangedRaw(self, size), buffer_size=_SMALL)
        if mode == "r":
            return io.TextIOWrapper(f, encoding=encoding or "utf-8", errors=errors,
                                    newline=newline)
        return f


class _RangedRaw(io.RawIOBase):
    """A raw, seekable binary stream of one object: each read is a ranged GET."""

    def __init__(self, path: ObjectPath, size: int):
        self._path, self._size, self._pos = path, size, 0
        self.name = str(path)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_CUR:
            pos += self._pos
        elif whence == os.SEEK_END:
            pos += self._size
        if pos < 0:
            raise OSError(errno.EINVAL, "negative seek position")
        self._pos = pos
        return pos

    def readinto(self, b: Any) -> int:
        n = min(len(b), max(0, self._size - self._pos))
        if n == 0:
            return 0
        got = self._path.read_into(self._pos, memoryview(b)[:n])
        self._pos += got
        return got
