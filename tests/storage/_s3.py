"""The S3-compatible test server's helpers: a counting, cutting TCP proxy and a bucket.

See ``conftest.py`` for the fixtures that start them.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

def needs_server() -> None:
    """Skip the calling test module, saying why, without boto3 and moto's server."""
    import pytest

    pytest.importorskip("boto3", reason="the object-store tests need boto3 "
                        "(pip install -e '.[test]')")
    pytest.importorskip("moto.server", reason="the object-store tests need moto[server] "
                        "(pip install -e '.[test]')")


FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
BUCKET = "ckpt-tests"


class Proxy:
    """Forwards 127.0.0.1:``port`` to the server; counts the bytes the server sent
    (``down``) and, when armed, cuts connections:

    * ``cut_down_once(n)``: the first connection whose response bytes pass ``n`` (counted
      from the arming) is closed mid-stream, once;
    * ``cut_up_once(n)``: the first connection whose request bytes pass ``n`` (counted from
      the arming) is closed mid-stream, once;
    * ``cut_big_requests(n)``: every request carrying more than ``n`` bytes before the server
      answers (a big upload) is closed mid-body;
    * ``cut_down_after(n)``: once the server has sent ``n`` more bytes, every connection is
      closed as soon as it carries more (the server went away mid-read).
    """

    def __init__(self, upstream: int):
        self.upstream = upstream
        self.down = 0
        self.cuts = 0
        self._once: int | None = None
        self._big_up: int | None = None
        self._after: int | None = None
        self.up = 0
        self._up_once: int | None = None
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.port = self._srv.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def reset(self) -> None:
        with self._lock:
            self.down, self.up, self.cuts = 0, 0, 0
            self._once = self._big_up = self._after = self._up_once = None

    def cut_down_once(self, n: int) -> None:
        with self._lock:
            self._once = self.down + n

    def cut_up_once(self, n: int) -> None:
        with self._lock:
            self._up_once = self.up + n

    def cut_big_requests(self, n: int) -> None:
        self._big_up = n

    def cut_down_after(self, n: int) -> None:
        with self._lock:
            self._after = self.down + n

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._srv.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            with self._lock:
                self._socks += [client, server]
            state = {"up": 0, "down": 0}
            threading.Thread(target=self._pipe, args=(client, server, True, state),
                             daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, False, state),
                             daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, up: bool, state: dict) -> None:
        try:
            while True:
                data = src.recv(16384)
                if not data:
                    break
                cut = False
                with self._lock:
                    if up:
                        state["up"] += len(data)
                        state["down"] = 0
                        self.up += len(data)
                        cut = self._big_up is not None and state["up"] > self._big_up
                        if self._up_once is not None and self.up > self._up_once:
                            self._up_once, cut = None, True
                    else:
                        state["down"] += len(data)
                        state["up"] = 0
                        self.down += len(data)
                        if self._once is not None and self.down > self._once:
                            self._once, cut = None, True
                        elif self._after is not None and self.down > self._after:
                            cut = True
                    if cut:
                        self.cuts += 1
                if cut:
                    dst.sendall(data[:len(data) // 2])
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def stop(self) -> None:
        self._srv.close()
        with self._lock:
            for s in self._socks:
                try:
                    s.close()
                except OSError:
                    pass



def _env(endpoint: str) -> dict[str, str]:
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
            # never the instance-metadata service (a non-loopback address), never the user's
            # own AWS files
            "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_MAX_ATTEMPTS": "3",
            "AWS_RETRY_MODE": "standard"}


class S3:
    """A fresh bucket on the test server, through ``proxy``; ``url(key)``, ``upload``."""

    def __init__(self, port: int, proxy: Proxy, bucket: str):
        import boto3

        self.port, self.proxy, self.bucket = port, proxy, bucket
        self.endpoint = f"http://127.0.0.1:{proxy.port}"
        self.env = _env(self.endpoint)
        self.client = boto3.client(  # straight to the server: the test's own view
            "s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id="testing",
            aws_secret_access_key="testing", region_name="us-east-1")
        self.client.create_bucket(Bucket=bucket)

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def upload(self, local: Path, key: str) -> str:
        """Put the files of ``local`` under ``key/`` (around the tool: its cached listings
        are dropped)."""
        from ckpt_tool.storage.s3 import forget_stores

        for p in sorted(Path(local).rglob("*")):
            if p.is_file() and p.name not in ("generate.py", "VERSIONS.txt"):
                self.client.upload_file(str(p), self.bucket,
                                        f"{key}/{p.relative_to(local).as_posix()}")
        forget_stores()
        return self.url(key)

    def keys(self, prefix: str = "") -> list[str]:
        out = []
        for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix):
            out += [o["Key"] for o in page.get("Contents", ())]
        return sorted(out)

    def uploads(self, prefix: str = "") -> list[str]:
        r = self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=prefix)
        return [u["Key"] for u in r.get("Uploads", ())]


