"""A real S3-compatible server on 127.0.0.1 for the object-store tests, and a TCP proxy in
front of it that counts and cuts connections.

The server is moto's server mode (``moto[server]``, in the ``test`` extra): every test module
here starts with ``_s3.needs_server()``, which skips it, saying so, when moto or ``boto3`` is
not installed. Only loopback addresses are used;
the proxy's threads end when their sockets close and :meth:`Proxy.stop` closes them all.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import pytest

from _s3 import BUCKET, S3, Proxy


@pytest.fixture(scope="session")
def s3_server() -> Iterator[int]:
    """moto's S3 server on 127.0.0.1 (a free port) for the whole session."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    port = server._server.server_address[1]
    yield port
    server.stop()


_count = [0]


@pytest.fixture
def s3(s3_server: int, monkeypatch: Any) -> Iterator[S3]:
    """A fresh bucket, the environment pointing at it through a counting proxy."""
    from ckpt_tool.storage import s3 as s3_module

    proxy = Proxy(s3_server)
    _count[0] += 1
    store = S3(s3_server, proxy, f"{BUCKET}-{os.getpid()}-{_count[0]}")
    for k, v in store.env.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "MSC_CONFIG"):
        monkeypatch.delenv(k, raising=False)
    s3_module.forget_stores()
    yield store
    s3_module.forget_stores()
    proxy.stop()
