"""botocore's errors and dropped connections as one clear ckpt error each."""

from __future__ import annotations

import os
from typing import Any

from ckpt_tool.errors import InputError, OutputError, UsageError

__all__ = ["error_code", "transient", "store_error"]


def error_code(exc: BaseException) -> str | None:
    resp = getattr(exc, "response", None)
    if isinstance(resp, dict):
        err = resp.get("Error") or {}
        code = err.get("Code") or str((resp.get("ResponseMetadata") or {}).get(
            "HTTPStatusCode", ""))
        return str(code) if code else None
    return None


def transient(exc: BaseException) -> bool:
    """A dropped connection or a body cut short: worth another GET."""
    names = {c.__name__ for c in type(exc).__mro__}
    return bool(names & {"IncompleteReadError", "ResponseStreamingError", "ReadTimeoutError",
                         "ConnectionClosedError", "EndpointConnectionError", "ProtocolError",
                         "ConnectionError", "HTTPClientError", "IncompleteRead",
                         "ConnectTimeoutError"})


def store_error(exc: BaseException, url: str, store: Any, writing: bool) -> Exception:
    kind = OutputError if writing else InputError
    if isinstance(exc, (InputError, OutputError, UsageError)):
        return exc
    names = {c.__name__ for c in type(exc).__mro__}
    endpoint = store.spec.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") \
        or os.environ.get("AWS_ENDPOINT_URL") or "the default AWS endpoint"
    if "NoCredentialsError" in names or "PartialCredentialsError" in names:
        return kind("no credentials for the object store", path=url,
                    hint="set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, "
                         "or ~/.aws/credentials")
    if "ProfileNotFound" in names:
        return kind(f"{exc}", path=url, hint="check AWS_PROFILE and ~/.aws/config")
    code = error_code(exc)
    if code in ("NoSuchBucket",):
        return kind(f"no such bucket {store.spec.bucket!r}", path=url,
                    hint="check the URL and the endpoint (AWS_ENDPOINT_URL)")
    if code in ("NoSuchKey", "404", "NotFound"):
        return kind("no such object", path=url, hint="check the URL")
    if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
        return kind(f"access denied by the object store ({code})", path=url,
                    hint="check the credentials and the bucket policy")
    if code is not None:
        msg = (getattr(exc, "response", {}).get("Error") or {}).get("Message") or code
        return kind(f"the object store answered {code}: {msg}", path=url)
    if transient(exc) or "EndpointConnectionError" in names:
        what = "writing" if writing else "reading"
        return kind(f"{what} failed: the connection to the object store at {endpoint} broke "
                    f"or timed out ({type(exc).__name__})", path=url,
                    hint="check the network and the endpoint, then rerun")
    return kind(f"object store request failed ({type(exc).__name__}: {exc})", path=url)
