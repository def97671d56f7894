"""The S3 client: listings, ranged GETs (parallel for big ranges), uploads, deletes.

Built on botocore (``boto3``, the ``s3`` extra), imported on the first request: its
credential chain is the AWS CLI's (environment, ``AWS_PROFILE``, ``~/.aws/config`` and
``credentials``, SSO, instance roles) and so is its endpoint resolution (``AWS_ENDPOINT_URL``,
``AWS_ENDPOINT_URL_S3``, ``endpoint_url`` in a profile). One client per store, shared by the
threads (botocore clients are thread-safe).

* Requests are retried by botocore (``standard`` mode, 5 attempts) up to the response headers;
  a body cut short after them (a dropped connection mid-read) is retried here, a bounded number
  of times, and the length of what came is checked: a short or failed read is an
  ``InputError``, never short data.
* Ranges bigger than :data:`PART` are fetched as parts on :data:`CONCURRENCY` threads.
* Files bigger than :data:`MULTIPART` are uploaded in parts on the same threads; a failed or
  interrupted upload is aborted (``AbortMultipartUpload``) before the error goes on.
* Listings of a "directory" (``Delimiter='/'``) are cached per store, forgotten when something
  is written through it: sniffing a checkpoint asks about the same few names many times. A
  name missing from a listing older than :data:`FRESH` seconds lists the directory again (a
  long-lived process sees what others wrote since).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterator

from ckpt_tool.errors import InputError, OutputError, UsageError
from ckpt_tool.storage.locations import StoreSpec
from ckpt_tool.storage.read_ahead import ReadAhead
from ckpt_tool.storage.s3_errors import error_code, store_error, transient

__all__ = ["Store", "store_for", "Listing", "fetch_into", "forget_stores", "PART", "MULTIPART",
           "CONCURRENCY"]

PART = int(os.environ.get("CKPT_S3_PART", 8 << 20))  # a ranged GET (upload parts: 2x)
MULTIPART = 64 << 20  # files bigger than this are uploaded in parts
CONCURRENCY = max(1, int(os.environ.get("CKPT_S3_CONCURRENCY", "16") or 16))
FRESH = 2.0
_READ_TRIES = 4  # a body cut short is fetched again this many times at most
_MAX_PARTS = 10_000  # S3's limit on the parts of one upload


@dataclass
class Listing:
    """The immediate children of a prefix: ``files`` name -> (size, last modified epoch
    seconds), ``dirs`` the names of deeper prefixes."""

    files: dict[str, tuple[int, float]]
    dirs: set[str]
    taken: float = 0.0  # time.monotonic() of the LIST


_STORES: dict[StoreSpec, "Store"] = {}
_STORES_LOCK = threading.Lock()
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def store_for(spec: StoreSpec) -> "Store":
    """The one :class:`Store` of ``spec`` in this process."""
    with _STORES_LOCK:
        s = _STORES.get(spec)
        if s is None:
            s = _STORES[spec] = Store(spec)
        return s


def forget_stores() -> None:
    """Drop every store's client and listings (a changed environment: new endpoint, new
    credentials; the tests' servers)."""
    with _STORES_LOCK:
        _STORES.clear()


def fetch_into(jobs: list[tuple[Any, int, Any]]) -> list[int]:
    """Fill each ``(object path, offset, writable buffer)`` of ``jobs`` from its object: all
    of them as parts of at most :data:`PART` bytes on the shared threads at once. Returns the
    bytes read into each buffer (fewer: the object is shorter)."""
    parts: list[tuple[int, Any, int, Any]] = []
    for j, (path, offset, buf) in enumerate(jobs):
        view = memoryview(buf).cast("B")
        for s in range(0, len(view), PART):
            parts.append((j, path, offset + s, view[s:s + PART]))

    def one(part: tuple[int, Any, int, Any]) -> int:
        _, path, off, view = part
        return store_for(path.spec).get_into(path.key, off, view)

    got = [0] * len(jobs)
    short = [False] * len(jobs)
    for (j, _, _, view), n in zip(parts, _pool().map(one, parts)):
        if not short[j]:
            got[j] += n
            short[j] = n < len(view)
    return got


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(CONCURRENCY, thread_name_prefix="ckpt-s3")
        return _POOL


def _missing_boto() -> UsageError:
    return UsageError("reading or writing object stores needs the s3 extra (boto3)",
                      hint="pip install 'ckpt-tool[s3]'")


class Store:
    """One bucket (see the module docstring)."""

    def __init__(self, spec: StoreSpec):
        self.spec = spec
        self._client: Any = None
        self._lock = threading.Lock()
        self._listings: dict[str, Listing] = {}
        self._ahead = ReadAhead(PART)

    # -- the client -----------------------------------------------------------------------
    @property
    def client(self) -> Any:
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = self._make_client()
        return self._client

    def _make_client(self) -> Any:
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise _missing_boto() from None
        s = self.spec
        session = boto3.session.Session(profile_name=s.profile_name) if s.profile_name \
            else boto3.session.Session()
        endpoint = s.endpoint_url
        custom = endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") \
            or os.environ.get("AWS_ENDPOINT_URL") or _profile_endpoint(session)
        s3_opts = {"addressing_style": "path"} if custom and not _profile_addressing(session) \
            else {}
        # retries: the environment's or the profile's (AWS_MAX_ATTEMPTS, AWS_RETRY_MODE,
        # max_attempts, retry_mode) when set, else 5 attempts in "standard" mode
        configured = any(os.environ.get(v) for v in ("AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE")) \
            or _profile_value(session, "max_attempts") or _profile_value(session, "retry_mode")
        config = Config(retries=None if configured else {"max_attempts": 5, "mode": "standard"},
                        max_pool_connections=2 * CONCURRENCY, s3=s3_opts or None,
                        connect_timeout=10, read_timeout=60)
        kw: dict[str, Any] = {"config": config}
        if endpoint:
            kw["endpoint_url"] = endpoint
        if s.region_name:
            kw["region_name"] = s.region_name
        if s.access_key:
            kw.update(aws_access_key_id=s.access_key, aws_secret_access_key=s.secret_key,
                      aws_session_token=s.session_token)
        return session.client("s3", **kw)

    def url(self, key: str) -> str:
        """How the object ``key`` (relative to the store's root) is spelled for people."""
        return self.spec.url_root + key

    def _key(self, key: str) -> str:
        return self.spec.key_prefix + key

    def error(self, exc: BaseException, key: str, *, writing: bool = False) -> Exception:
        """``exc`` (botocore's, or a connection error) as one clear ckpt error."""
        return store_error(exc, self.url(key), self, writing)

    # -- listings -------------------------------------------------------------------------
    def listing(self, key: str, *, looking_for: str | None = None) -> Listing:
        """The children of ``key`` taken as a directory (cached; listed again when
        ``looking_for`` is not in a listing older than :data:`FRESH` seconds)."""
        got = self._listings.get(key)
        if got is not None and (looking_for is None or looking_for in got.files
                                or looking_for in got.dirs
                                or time.monotonic() - got.taken < FRESH):
            return got
        prefix = self._key(key) + "/" if key else self.spec.key_prefix
        files: dict[str, tuple[int, float]] = {}
        dirs: set[str] = set()
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.spec.bucket, Prefix=prefix, Delimiter="/")
            for page in pages:
                for o in page.get("Contents", ()):
                    name = o["Key"][len(prefix):]
                    if name:
                        files[name] = (int(o["Size"]), o["LastModified"].timestamp())
                for p in page.get("CommonPrefixes", ()):
                    dirs.add(p["Prefix"][len(prefix):].rstrip("/"))
        except Exception as exc:  # noqa: BLE001 - mapped to one clear error
            raise self.error(exc, key) from None
        got = Listing(files, dirs, time.monotonic())
        self._listings[key] = got
        return got

    def walk(self, key: str) -> Iterator[tuple[str, int]]:
        """Every object under ``key/`` (recursively): ``(key relative to the store, size)``."""
        prefix = self._key(key) + "/" if key else self.spec.key_prefix
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(
                    Bucket=self.spec.bucket, Prefix=prefix):
                for o in page.get("Contents", ()):
                    yield o["Key"][len(self.spec.key_prefix):], int(o["Size"])
        except Exception as exc:  # noqa: BLE001
            raise self.error(exc, key) from None

    def head(self, key: str) -> tuple[int, float] | None:
        """``(size, modified)`` of the object ``key``, None when there is none."""
        try:
            r = self.client.head_object(Bucket=self.spec.bucket, Key=self._key(key))
        except Exception as exc:  # noqa: BLE001
            if error_code(exc) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise self.error(exc, key) from None
        return int(r["ContentLength"]), r["LastModified"].timestamp()

    def forget(self) -> None:
        """Drop the cached listings (after a write or a delete)."""
        self._listings.clear()

    # -- reads ----------------------------------------------------------------------------
    def get(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes ``[offset, offset + length)`` of ``key`` (the rest of it when ``length`` is
        None; fewer when the object is shorter), in one GET, a body cut short fetched again;
        FileNotFoundError when there is no such object."""
        if length == 0:
            return b""
        return self._get(key, offset, length, None)

    def get_into(self, key: str, offset: int, view: memoryview) -> int:
        """:meth:`get` of ``len(view)`` bytes read straight into ``view`` (no copy of the
        body); the bytes read."""
        if not len(view):
            return 0
        return self._get(key, offset, len(view), view)

    def _get(self, key: str, offset: int, length: int | None, into: Any) -> Any:
        rng = f"bytes={offset}-" + ("" if length is None else str(offset + length - 1))
        last: BaseException | None = None
        for attempt in range(_READ_TRIES):
            try:
                r = self.client.get_object(Bucket=self.spec.bucket, Key=self._key(key),
                                           Range=rng)
                body = r["Body"]
                try:
                    got = _body_into(body, into) if into is not None else body.read()
                finally:
                    body.close()
                n = got if into is not None else len(got)
                want = int(r.get("ContentLength", n))
                if n == want:
                    return got
                last = ConnectionError(f"short read: {n} of {want} bytes")
            except Exception as exc:  # noqa: BLE001
                code = error_code(exc)
                if code == "InvalidRange":  # offset at or past the end
                    return 0 if into is not None else b""
                if code in ("NoSuchKey", "404"):
                    import errno

                    raise FileNotFoundError(errno.ENOENT, "no such object",
                                            self.url(key)) from None
                if code is not None or not transient(exc):
                    raise self.error(exc, key) from None
                last = exc
            time.sleep(min(1.0, 0.05 * 2 ** attempt))
        raise self.error(last or ConnectionError("read failed"), key) from None

    def read_into(self, key: str, offset: int, buf: Any) -> int:
        """Fill ``buf`` from byte ``offset`` of ``key``: one GET, or parts of :data:`PART` on
        the shared threads; served from the read-ahead window when a sequential reader's
        next range is in it (``read_ahead``). Returns the bytes read (fewer: the object
        is shorter)."""
        view = memoryview(buf).cast("B")
        n = len(view)
        got = self._ahead.take(key, offset, view)
        if got is None:
            got = self._fetch(key, offset, view)
        elif got < n:  # the window held the start: the rest is read now
            got += self._fetch(key, offset + got, view[got:])
        self._ahead.after(self, key, offset, n, got, _pool().submit)
        return got

    def _fetch(self, key: str, offset: int, view: memoryview) -> int:
        n = len(view)
        if n <= PART:
            return self.get_into(key, offset, view)
        starts = list(range(0, n, PART))

        def part(s: int) -> int:
            return self.get_into(key, offset + s, view[s:s + PART])

        got = list(_pool().map(part, starts))
        done = 0
        for s, g in zip(starts, got):
            if g < min(PART, n - s):
                return s + g
            done = s + g
        return done

    # -- writes ---------------------------------------------------------------------------
    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> bool:
        """Write ``data`` as ``key``. ``if_absent``: only when no object ``key`` exists (a
        conditional PUT); returns False when one did."""
        kw = {"IfNoneMatch": "*"} if if_absent else {}
        try:
            self.client.put_object(Bucket=self.spec.bucket, Key=self._key(key), Body=data, **kw)
        except Exception as exc:  # noqa: BLE001
            if if_absent and error_code(exc) in ("PreconditionFailed", "412",
                                                 "ConditionalRequestConflict"):
                return False
            raise self.error(exc, key, writing=True) from None
        finally:
            self.forget()
        return True

    def put_file(self, key: str, path: str | os.PathLike, size: int) -> None:
        """Upload the local file ``path`` (``size`` bytes) as ``key``: one PUT, or a multipart
        upload aborted on any failure (an interrupt included)."""
        try:
            if size <= MULTIPART:
                with open(path, "rb") as f:
                    self.client.put_object(Bucket=self.spec.bucket, Key=self._key(key), Body=f)
                return
            self._multipart(key, path, size)
        except (InputError, OutputError):
            raise
        except Exception as exc:  # noqa: BLE001
            raise self.error(exc, key, writing=True) from None
        finally:
            self.forget()

    def _multipart(self, key: str, path: str | os.PathLike, size: int) -> None:
        part = max(PART * 2, -(-size // _MAX_PARTS))
        bucket, k = self.spec.bucket, self._key(key)
        upload = self.client.create_multipart_upload(Bucket=bucket, Key=k)["UploadId"]
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                def one(i: int) -> dict[str, Any]:
                    data = os.pread(fd, part, i * part)
                    r = self.client.upload_part(Bucket=bucket, Key=k, UploadId=upload,
                                                PartNumber=i + 1, Body=data)
                    return {"PartNumber": i + 1, "ETag": r["ETag"]}

                parts = list(_pool().map(one, range(-(-size // part))))
            finally:
                os.close(fd)
            self.client.complete_multipart_upload(Bucket=bucket, Key=k, UploadId=upload,
                                                  MultipartUpload={"Parts": parts})
        except BaseException:
            try:
                self.client.abort_multipart_upload(Bucket=bucket, Key=k, UploadId=upload)
            except Exception:  # noqa: BLE001 - the first error is the one to report;
                pass           # the next run reclaims an upload left open
            raise

    def delete(self, keys: list[str]) -> None:
        """Delete the objects ``keys`` (1000 a request)."""
        try:
            for i in range(0, len(keys), 1000):
                batch = [{"Key": self._key(k)} for k in keys[i:i + 1000]]
                r = self.client.delete_objects(Bucket=self.spec.bucket,
                                               Delete={"Objects": batch, "Quiet": True})
                if r.get("Errors"):
                    e = r["Errors"][0]
                    raise OutputError(f"cannot delete {e.get('Key')} ({e.get('Message')})",
                                      path=self.url(keys[i]))
        except OutputError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise self.error(exc, keys[0] if keys else "", writing=True) from None
        finally:
            self.forget()

    def open_uploads(self, key: str) -> list[tuple[str, str]]:
        """The multipart uploads open under ``key`` (as a prefix): ``(key, upload id)``."""
        out = []
        try:
            for page in self.client.get_paginator("list_multipart_uploads").paginate(
                    Bucket=self.spec.bucket, Prefix=self._key(key)):
                for u in page.get("Uploads", ()):
                    out.append((u["Key"][len(self.spec.key_prefix):], u["UploadId"]))
        except Exception as exc:  # noqa: BLE001
            raise self.error(exc, key) from None
        return out

    def abort_upload(self, key: str, upload_id: str) -> None:
        try:
            self.client.abort_multipart_upload(Bucket=self.spec.bucket, Key=self._key(key),
                                               UploadId=upload_id)
        except Exception as exc:  # noqa: BLE001
            if error_code(exc) not in ("NoSuchUpload", "404"):
                raise self.error(exc, key, writing=True) from None


def _body_into(body: Any, view: memoryview) -> int:
    """Read a GET's body into ``view``: straight from the HTTP response (``readinto``) when
    botocore hands it over unwrapped, else through ``read``."""
    raw = getattr(body, "_raw_stream", None)
    if type(body).__name__ != "StreamingBody" or not hasattr(raw, "readinto"):
        data = body.read()
        view[:len(data)] = data
        return len(data)
    got = 0
    while got < len(view):
        n = raw.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def _scoped(session: Any) -> dict[str, Any]:
    try:
        return session._session.get_scoped_config()  # the profile's own keys
    except Exception:  # noqa: BLE001 - a profile that does not exist: botocore says so later
        return {}


def _profile_value(session: Any, name: str) -> Any:
    return _scoped(session).get(name)


def _profile_endpoint(session: Any) -> str | None:
    cfg = _scoped(session)
    s3 = cfg.get("s3") if isinstance(cfg.get("s3"), dict) else {}
    return cfg.get("endpoint_url") or s3.get("endpoint_url")


def _profile_addressing(session: Any) -> str | None:
    cfg = _scoped(session)
    s3 = cfg.get("s3") if isinstance(cfg.get("s3"), dict) else {}
    return s3.get("addressing_style")
