"""Obtain the parts of Megatron-LM that the tests run and the package index does not serve.

``core_v0.16.1`` (the default): the peer suite runs Megatron-LM's own
``tests/unit_tests/dist_checkpointing`` on ours; those tests import ``megatron.training`` (and
through it ``megatron.legacy``, ``megatron.rl``, ``megatron.post_training``), which the
megatron-core wheel does not ship. ``core_v0.19.0``: ``megatron/core`` itself (the package index
serves megatron-core up to 0.16.1), which the version tests run from source on PYTHONPATH
(``tests/interop/_mcore019.py``). A commit of the main branch (the next release, as read for
docs/formats.md "Megatron-LM main"): its ``megatron/core`` and
``megatron/training/checkpointing.py`` (``tests/interop/_mcore_main.py``). This script puts
exactly these paths of the tag into a cache directory, unchanged::

    python tests/peer/fetch_megatron.py                        # prints the cache directory
    python tests/peer/fetch_megatron.py --check                # exit 1 when it is not there yet
    python tests/peer/fetch_megatron.py --tag core_v0.19.0     # megatron/core of 0.19.0
    python tests/peer/fetch_megatron.py --tag d98e8a64ddf34856e74b24714e3bedb2f5a39553  # main

Where from, first that works: the cache directory itself (``~/.cache/ckpt/megatron-lm-<tag>``;
``$CKPT_PEER_CACHE`` overrides it for ``core_v0.16.1``); a local git repository holding the tag
(``$CKPT_PEER_MEGATRON_GIT``, e.g. a mirror made with ``git clone --mirror``); GitHub's tarball
of the tag. Nothing is written to the cache until every path has been read (staging directory
renamed into place), so an interrupted fetch leaves no half tree.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

TAG = "core_v0.16.1"
REPO_URL = "https://github.com/NVIDIA/Megatron-LM"
# Paths of each tag the tests need (directories whole); the first must be there after a fetch.
PATHS = {
    TAG: (
        "tests/unit_tests/dist_checkpointing",
        "tests/__init__.py",
        "tests/unit_tests/__init__.py",
        "tests/unit_tests/test_utilities.py",
        "megatron/training",
        "megatron/legacy",
        "megatron/post_training",
        "megatron/rl",
    ),
    "core_v0.19.0": ("megatron/core",),
    # Megatron-LM's main branch as read for the next release's forms (tests/interop/_mcore_main.py)
    "d98e8a64ddf34856e74b24714e3bedb2f5a39553": ("megatron/core",
                                                 "megatron/training/checkpointing.py"),
}
_MARKER = ".complete"


def tarball_url(tag: str) -> str:
    """GitHub's tarball of a tag, or of a commit (40 hex digits)."""
    commit = len(tag) == 40 and all(c in "0123456789abcdef" for c in tag)
    ref = tag if commit else f"refs/tags/{tag}"
    return f"https://codeload.github.com/NVIDIA/Megatron-LM/tar.gz/{ref}"


class FetchError(RuntimeError):
    """The sources could not be obtained from any place."""


def cache_dir(tag: str = TAG) -> Path:
    """The directory the tag's files are kept in (``$CKPT_PEER_CACHE`` overrides it for the
    peer suite's tag)."""
    env = os.environ.get("CKPT_PEER_CACHE")
    if env and tag == TAG:
        return Path(env)
    return Path.home() / ".cache" / "ckpt" / f"megatron-lm-{tag}"


def is_complete(root: Path) -> bool:
    """Whether ``root`` holds a finished fetch."""
    return (root / _MARKER).is_file()


def _wanted(path: str, tag: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in PATHS[tag])


def _from_git(repo: str, dest: Path, tag: str) -> None:
    listing = subprocess.run(["git", "-C", repo, "ls-tree", "-r", "--name-only", tag, "--",
                              *PATHS[tag]], capture_output=True, text=True, check=True).stdout
    names = [n for n in listing.splitlines() if n]
    if not names:
        raise FetchError(f"{repo} has no {tag} with the wanted paths")
    for name in names:
        data = subprocess.run(["git", "-C", repo, "show", f"{tag}:{name}"],
                              capture_output=True, check=True).stdout
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


def _from_github(dest: Path, timeout: float, tag: str) -> None:
    url = tarball_url(tag)
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (fixed URL)
        blob = resp.read()
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            name = member.name.split("/", 1)[1] if "/" in member.name else ""
            if not name or not _wanted(name, tag) or ".." in Path(name).parts:
                continue
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(member) as src:
                target.write_bytes(src.read())
    if not (dest / PATHS[tag][0]).exists():
        raise FetchError(f"{url} has no {PATHS[tag][0]}")


def ensure(root: Path | None = None, timeout: float = 60.0, tag: str = TAG) -> Path:
    """Return the cache directory, filling it first when needed; :class:`FetchError` if not."""
    root = cache_dir(tag) if root is None else root
    if is_complete(root):
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=root.name + ".staging-", dir=root.parent))
    errors = []
    try:
        git = os.environ.get("CKPT_PEER_MEGATRON_GIT")
        done = False
        if git:
            try:
                _from_git(git, staging, tag)
                done = True
            except (OSError, subprocess.CalledProcessError, FetchError) as exc:
                errors.append(f"git {git}: {exc}")
        if not done:
            try:
                _from_github(staging, timeout, tag)
            except Exception as exc:  # noqa: BLE001 (network: any failure means "not here")
                errors.append(f"{tarball_url(tag)}: {exc}")
                raise FetchError(f"cannot obtain Megatron-LM {tag}: " + "; ".join(errors)
                                 + " (set CKPT_PEER_MEGATRON_GIT to a local clone)") from exc
        (staging / _MARKER).write_text(tag + "\n")
        if root.exists():
            shutil.rmtree(root)
        staging.rename(root)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return root


def ensure_or_skip(timeout: float = 30.0) -> Path:
    """For tests: the cached Megatron-LM files, or ``pytest.skip`` saying what is missing
    (megatron-core, ``six``/``pydantic`` that ``megatron.training`` imports, or the files)."""
    import importlib.util

    import pytest

    for module in ("megatron.core", "six", "pydantic"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install -e '.[test]' and "
                        "megatron-core==0.16.1 --no-deps)")
    try:
        return ensure(timeout=timeout)
    except FetchError as exc:
        pytest.skip(f"Megatron-LM {TAG} unavailable: {exc}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say whether it is cached")
    parser.add_argument("--tag", default=TAG, choices=sorted(PATHS),
                        help=f"the Megatron-LM tag (default {TAG})")
    args = parser.parse_args(argv)
    if args.check:
        ok = is_complete(cache_dir(args.tag))
        print(cache_dir(args.tag) if ok else f"not cached: {cache_dir(args.tag)}")
        return 0 if ok else 1
    try:
        print(ensure(tag=args.tag))
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
