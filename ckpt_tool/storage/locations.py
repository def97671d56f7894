"""From a URL to the object store, bucket and key it names.

* ``s3://bucket/prefix``: the endpoint, region and credentials come from the environment and
  the AWS config files exactly as the AWS CLI reads them (``AWS_ACCESS_KEY_ID``...,
  ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3``, ``AWS_PROFILE``, ``~/.aws/config`` and
  ``credentials``): the client is botocore's, whose default chain is the CLI's.
* ``msc://profile/path`` (Megatron-Core's ``msc://`` paths, read through multi-storage-client):
  ``profile`` is looked up in multi-storage-client's configuration file, searched where it
  searches (``MSC_CONFIG``, ``$XDG_CONFIG_HOME/msc/config.yaml``, ``~/.msc_config.yaml``,
  ``~/.config/msc/config.yaml``, ``$XDG_CONFIG_DIRS/msc/config.yaml``, ``/etc/msc_config.yaml``,
  and their ``.json`` twins). Its ``storage_provider`` must be one of the S3-compatible kinds
  (``s3``, ``s8k``, ``gcs_s3``, ``ais_s3``: ``base_path`` = ``bucket/prefix``, ``endpoint_url``,
  ``region_name``, ``profile_name``; credentials from an ``S3Credentials`` provider or the AWS
  chain) or ``file`` (a local directory: the URL becomes a local path). ``$VAR`` / ``${VAR}``
  in the file are expanded from the environment. An implicit profile ``_s3-<bucket>`` names
  ``s3://<bucket>`` as multi-storage-client's shortcuts do.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_tool.errors import InputError, UnsupportedError, UsageError

__all__ = ["StoreSpec", "resolve_url", "msc_config_paths", "split_url"]

_S3_KINDS = ("s3", "s8k", "gcs_s3", "ais_s3")
_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")


@dataclass(frozen=True)
class StoreSpec:
    """One bucket of one S3-compatible service, as the client needs it. ``url_root``:
    how its keys are spelled for people (``s3://bucket/`` or ``msc://profile/``);
    ``key_prefix``: what that root is in the bucket (an msc profile's base path)."""

    bucket: str
    url_root: str
    key_prefix: str = ""
    endpoint_url: str | None = None
    region_name: str | None = None
    profile_name: str | None = None
    access_key: str | None = None
    secret_key: str | None = None
    session_token: str | None = None


def split_url(url: str) -> tuple[str, str, str]:
    """``"s3://b/k/x"`` -> ``("s3", "b", "k/x")``; ``s3:/b/k`` (pathlib's spelling) too."""
    scheme, _, rest = url.partition(":")
    rest = rest.lstrip("/")
    authority, _, key = rest.partition("/")
    parts = [p for p in key.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UsageError(f"'..' in an object-store URL is not supported: {url}",
                         hint="spell the key out")
    if not authority:
        raise UsageError(f"no {'bucket' if scheme == 's3' else 'profile'} in {url!r}",
                         hint=f"{scheme}://{'BUCKET' if scheme == 's3' else 'PROFILE'}/PATH")
    return scheme.lower(), authority, "/".join(parts)


def resolve_url(url: str) -> tuple[StoreSpec, str] | Path:
    """The store and key ``url`` names (or, for an msc ``file`` profile, the local path)."""
    scheme, authority, key = split_url(url)
    if scheme == "s3":
        return StoreSpec(bucket=authority, url_root=f"s3://{authority}/"), key
    spec = _msc_profile(authority)
    if isinstance(spec, Path):
        return spec / key if key else spec
    return spec, key


def msc_config_paths() -> list[str]:
    """Where multi-storage-client looks for its configuration, in its order."""
    paths = []
    if os.environ.get("MSC_CONFIG"):
        paths.append(os.environ["MSC_CONFIG"])
    xdg = os.environ.get("XDG_CONFIG_HOME")
    if xdg:
        paths += [os.path.join(xdg, "msc", "config.yaml"), os.path.join(xdg, "msc", "config.json")]
    home = os.environ.get("HOME")
    if home:
        paths += [os.path.join(home, ".msc_config.yaml"), os.path.join(home, ".msc_config.json"),
                  os.path.join(home, ".config", "msc", "config.yaml"),
                  os.path.join(home, ".config", "msc", "config.json")]
    for d in (os.environ.get("XDG_CONFIG_DIRS") or "/etc/xdg").split(":"):
        if d.strip():
            paths += [os.path.join(d.strip(), "msc", "config.yaml"),
                      os.path.join(d.strip(), "msc", "config.json")]
    return paths + ["/etc/msc_config.yaml", "/etc/msc_config.json"]


def _read_msc_config() -> tuple[dict[str, Any], str | None]:
    for p in msc_config_paths():
        if not os.path.exists(p):
            continue
        try:
            with open(p, encoding="utf-8") as f:
                if p.endswith(".json"):
                    cfg = json.load(f)
                else:
                    import yaml

                    cfg = yaml.safe_load(f)
        except (OSError, ValueError) as exc:
            raise InputError(f"cannot read the multi-storage-client configuration ({exc})",
                             path=p) from None
        except Exception as exc:  # yaml.YAMLError
            raise InputError(f"the multi-storage-client configuration is not valid YAML "
                             f"({type(exc).__name__})", path=p) from None
        return (cfg if isinstance(cfg, dict) else {}), p
    return {}, None


def _expand(value: Any, where: str) -> Any:
    if isinstance(value, dict):
        return {k: _expand(v, where) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v, where) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name not in os.environ:
            raise InputError(f"the multi-storage-client configuration uses ${name}, which is "
                             "not set", path=where, hint=f"export {name}")
        return os.environ[name]

    return _ENV.sub(one, value)


def _msc_profile(name: str) -> StoreSpec | Path:
    root = f"msc://{name}/"
    cfg, where = _read_msc_config()
    profile = (cfg.get("profiles") or {}).get(name)
    if profile is None:
        if name.startswith("_s3-") and len(name) > 4:  # an implicit profile
            return StoreSpec(bucket=name[4:], url_root=root)
        if name == "__filesystem__":
            return Path("/")
        raise InputError(
            f"no multi-storage-client profile {name!r}"
            + (f" in {where}" if where else " (no configuration file found)"), path=root,
            hint="define it under 'profiles:' in ~/.msc_config.yaml (or the file MSC_CONFIG "
                 "names): docs/object-storage.md")
    profile = _expand(profile, where or "")
    provider = profile.get("storage_provider") or {}
    kind = str(provider.get("type", ""))
    options = provider.get("options") or {}
    base = str(options.get("base_path", "")).strip("/")
    if kind == "file":
        return Path("/" + base) if base else Path("/")
    if kind not in _S3_KINDS:
        raise UnsupportedError(
            f"multi-storage-client profile {name!r} uses the {kind or 'unnamed'} storage "
            f"provider; ckpt reads S3-compatible stores ({', '.join(_S3_KINDS)}) and 'file'",
            path=root, hint="copy the checkpoint to S3 or a local disk")
    bucket, _, prefix = base.partition("/")
    if not bucket:
        raise InputError(f"multi-storage-client profile {name!r} has no base_path "
                         "(bucket/prefix)", path=where)
    creds = profile.get("credentials_provider") or {}
    copts = creds.get("options") or {} if creds.get("type") == "S3Credentials" else {}
    if creds and creds.get("type") != "S3Credentials":
        raise UnsupportedError(
            f"multi-storage-client profile {name!r}: credentials provider "
            f"{creds.get('type')!r} is not supported (S3Credentials, or none for the AWS "
            "chain)", path=root)
    return StoreSpec(bucket=bucket, url_root=root, key_prefix=prefix + "/" if prefix else "",
                     endpoint_url=options.get("endpoint_url") or None,
                     region_name=options.get("region_name") or None,
                     profile_name=options.get("profile_name") or None,
                     access_key=copts.get("access_key"), secret_key=copts.get("secret_key"),
                     session_token=copts.get("session_token"))
