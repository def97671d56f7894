"""``validate``: is a checkpoint complete and intact? Collects every finding, never stops early.

Checks, in order (the pure ones live in ``ops/validate/_checks.py``, CRC32/sha256 ones in
``ops/validate/_integrity_pass.py``):

1. completeness markers: the tracker file of a training save directory names an existing
   iteration; dist checkpoints have a parseable ``metadata.json`` and ``.metadata`` (an
   interrupted save, e.g. ``*.distcp`` without ``.metadata``, is an *error finding*, exit 1);
2. every file the chunks/objects reference exists and holds every item's byte range;
3. every tensor is covered by its chunks exactly once (in bounds, no gap, no overlap); the
   metadata agrees with the files (tensors at all, the backend, zarr dtypes:
   ``_meta``); each DCP item holds the dtype and elements the metadata says (4.);
4. integrity: the CRC32 of every zip entry of every DCP item and of every legacy/torch.save
   file (``torch.load`` does not check them), in one pass over a read-only mmap of each file;
   the manifest (``ckpt_tool.integrity_manifest``): files present at their sizes, digests with ``deep``;
5. stale ``*.distcp`` files nobody references, leftover ``*.tmp``/staging files (warnings);
6. the caller's expectations: ``expect_tp``/``expect_pp``/``expect_keys``/``expect_iteration``;
   legacy: every ``mp_rank_*`` file present, replicated tensors consistent across TP ranks;
   objects' pickles through the allowlist (``_items``);
7. ``deep``: PyTorch's own archive reader opens every torch.save archive (what it refuses
   is an error, ``_torch_reader``); read every tensor, count NaN/Inf (warnings),
   report read failures (errors); plain tensor archives / raw elements are counted in place
   during 4. (no copies).

A path that is not a checkpoint at all (missing, unknown format, unsafe pickle without
``trust``) raises the usual :class:`~ckpt_tool.errors.InputError` (exit 2): there is nothing to
validate. A checkpoint that is recognisably a checkpoint but broken gives error findings.
"""

from __future__ import annotations

import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from ckpt_tool.errors import CorruptCheckpointError, InputError, UnsafePickleError
from ckpt_tool.model import CheckpointMeta, FormatKind
from ckpt_tool.storage import as_path, is_remote
from ckpt_tool.ops.validate._checks import (check_coverage, check_expectations, check_storage,
                                            error, warning)
from ckpt_tool.model import Finding
from ckpt_tool.ops.validate._common_states import common_state_differences
from ckpt_tool.ops.validate._integrity_pass import check_loose_archives, scan_archives
from ckpt_tool.ops.manifest_checks import manifest_findings
from ckpt_tool.ops.validate._deep import deep_read
from ckpt_tool.ops.validate._optimizer_consistency import optimizer_model_findings
from ckpt_tool.ops.validate._meta import check_common_state, check_meta_against_files
from ckpt_tool.ops.validate._torch_reader import torch_reader_findings
from ckpt_tool.ops.validate._items import check_object_pickles, check_overlaps
from ckpt_tool.ops.validate._source_checks import UNVERIFIED_NOTE, check_source

if TYPE_CHECKING:
    from ckpt_tool.formats.base import Reader

__all__ = ["Finding", "ValidateResult", "validate", "read_expected_keys", "check_source",
           "UNVERIFIED_NOTE"]


@dataclass(frozen=True)
class ValidateResult:
    """Every finding plus what was checked (``stats``)."""

    path: str
    root: str | None = None
    format: str | None = None
    findings: list[Finding] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)
    # ``deep``: per tensor with any NaN/Inf, ``(nan, inf, elements)``; None without ``deep``
    nonfinite: dict[str, tuple[int, int, int]] | None = None
    # the input could not be read at all (exit 2): the one-line reason; no other field is set
    unreadable: str | None = None

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    @property
    def ok(self) -> bool:
        return not self.errors and self.unreadable is None

    @classmethod
    def for_unreadable(cls, path: str | Path, reason: str) -> "ValidateResult":
        """The verdict on an input that cannot be read at all (the CLI exits 2): one error
        finding saying why, so that a CI job reads the same document as for any other run."""
        return cls(str(path), findings=[error(reason)], unreadable=reason)

    def counts(self) -> dict[str, int]:
        """``errors``, ``warnings``; with ``deep`` also ``nan``, ``inf`` (element totals) and
        ``tensors_with_nan_or_inf``."""
        out = {"errors": len(self.errors), "warnings": len(self.warnings)}
        if self.nonfinite is not None:
            out["nan"] = sum(v[0] for v in self.nonfinite.values())
            out["inf"] = sum(v[1] for v in self.nonfinite.values())
            out["tensors_with_nan_or_inf"] = len(self.nonfinite)
        return out

    def to_dict(self) -> dict[str, Any]:
        """The verdict document of ``ckpt validate --json``."""
        out: dict[str, Any] = {
            "ok": self.ok, "path": self.path, "root": self.root, "format": self.format,
            "unreadable": self.unreadable, "counts": self.counts(),
            "findings": [f.to_dict() for f in self.findings], "stats": self.stats}
        if self.nonfinite is not None:
            out["nonfinite"] = {k: {"nan": n, "inf": i, "elements": e}
                                for k, (n, i, e) in sorted(self.nonfinite.items())}
        return out


def read_expected_keys(path: str | Path) -> list[str]:
    """One key per line; blank lines and ``#`` comments ignored."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"cannot read the expected-keys file ({exc.strerror})",
                         path=path) from None
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]


def validate(path: str | Path, *, trust: bool = False, deep: bool = False,
             expect_tp: int | None = None, expect_pp: int | None = None,
             expect_keys: Iterable[str] | None = None,
             expect_iteration: int | None = None, ranks: Any = None,
             progress: Any = None, proven: frozenset[str] = frozenset()) -> ValidateResult:
    """Check the checkpoint at ``path`` and return every finding (see the module docstring).

    ``progress``: a sink with ``start(total_bytes, total_count, unit)`` and ``update(nbytes,
    count_done)``, started once per pass over the data: the files scanned (CRC32, NaN/Inf in
    place), then, with ``deep``, the tensors read through the reader.

    ``ranks`` (a ``ckpt_tool.parallel.Ranks`` under torchrun): every rank of the job calls
    this, the byte scan is split over them and every rank gets every finding.

    ``proven``: data files (names relative to the checkpoint) whose bytes the writer of this
    process proved as it wrote them (``ckpt_tool.digests.proven_files``): their CRC-32 scan
    is not repeated (ignored with ``deep``)."""
    from ckpt_tool.formats.base import check_readable
    from ckpt_tool.formats.regular_files import check_tree
    from ckpt_tool.formats.save_dir import resolve_checkpoint_dir

    p = as_path(path)
    check_readable(p)  # missing, symlink loop, permission denied: InputError (exit 2)
    findings: list[Finding] = []
    stats: dict[str, int] = {}
    nonfinite: dict[str, tuple[int, int, int]] | None = {} if deep else None

    def done(root: Path | None = None, fmt: str | None = None) -> ValidateResult:
        return ValidateResult(str(p), None if root is None else str(root), fmt, findings, stats,
                              nonfinite)

    root = _follow_tracker(p, findings)
    if root is None:
        return done()
    if root == p:
        root = resolve_checkpoint_dir(p)
    if root.is_dir():
        check_tree(root)  # a FIFO, socket or device in it: InputError before any read
    if root.is_dir() and not _check_markers(root, findings):
        if is_remote(p):
            findings.extend(_beside(p))
        return done(root)

    from ckpt_tool.formats import detect

    fmt = detect(root)
    try:
        reader = fmt.open(root, trust=trust)
        try:
            meta = reader.metadata()
        except BaseException:
            reader.close()
            raise
    except UnsafePickleError:
        raise
    except CorruptCheckpointError as exc:
        findings.append(error(f"unreadable metadata: {exc.message}", file=_rel(exc.path, root)))
        reader, meta = _sharded_only(fmt, root, trust)
        if meta is None:
            return done(root, fmt.name)
    try:
        root_path = as_path(meta.root)
        base = root_path if root_path.is_dir() else root_path.parent
        stats.update(tensors=len(meta.tensors), objects=len(meta.objects),
                     chunks=sum(len(t.chunks) for t in meta.tensors.values()))
        sizes = _file_sizes(base, meta)
        stats["files"] = sum(1 for s in sizes.values() if s is not None)
        findings.extend(check_storage(meta, sizes) + check_overlaps(meta))
        for key in sorted(meta.tensors):
            findings.extend(check_coverage(meta.tensors[key]))
        findings.extend(check_meta_against_files(base, meta))
        findings.extend(_check_completion(meta) + _check_common_state(base, meta, trust))
        findings.extend(_read_past(reader))
        counted: dict[str, tuple[int, int]] = {}
        # (on an object store the bytes are fetched only with ``deep``: without it, validate
        # reads metadata alone)
        if meta.kind.torch_save_archives and (deep or not is_remote(base)):
            skip = set(reader.objects_with_transforms())
            crc_findings, counted = scan_archives(base, meta, sizes, stats, skip, deep=deep,
                                                  ranks=ranks, progress=progress,
                                                  proven=proven)
            findings.extend(crc_findings)
        findings.extend(check_loose_archives(base, meta))
        if meta.kind.dcp_files:
            findings.extend(_stale_data_files(base, meta))
        findings.extend(manifest_findings(p, root_path, deep=deep, stats=stats))
        if base.is_dir() and root_path.is_dir():
            findings.extend(_leftovers(base))
        if p.resolve() != base.resolve():  # a save directory given: its own leftovers too
            findings.extend(_beside(p))
        findings.extend(check_expectations(
            meta, expect_tp=expect_tp, expect_pp=expect_pp,
            expect_keys=None if expect_keys is None else list(expect_keys),
            expect_iteration=expect_iteration))
        if deep or not is_remote(base):  # (object items are data, like the CRCs)
            findings.extend(check_object_pickles(reader, meta, findings, deep=deep,
                                                 trust=trust, stats=stats))
        if deep and (meta.kind.torch_save_archives or meta.kind.zarr_arrays):
            findings.extend(torch_reader_findings(base, meta, findings, stats))
        if deep:
            findings.extend(deep_read(reader, meta, findings, stats, counted, nonfinite,
                                      progress))
            findings.extend(optimizer_model_findings(reader, meta, findings, stats))
    finally:
        reader.close()
    findings.extend(_sub_checkpoint_findings(as_path(meta.root), trust=trust, deep=deep,
                                             nonfinite=nonfinite))
    return done(as_path(meta.root), meta.format)


def _sub_checkpoint_findings(root: Path, *, trust: bool, deep: bool,
                             nonfinite: dict[str, tuple[int, int, int]] | None) -> list[Finding]:
    """Findings of complete dist checkpoints nested in this one (``modelopt_state/``), with
    their files named relative to the outer checkpoint (NaN/Inf counts keyed ``sub/key``)."""
    import dataclasses

    sub = root / "modelopt_state"
    if not root.is_dir() or not sub.is_dir():
        return []
    inner = validate(sub, trust=trust, deep=deep)
    if nonfinite is not None and inner.nonfinite:
        nonfinite.update({f"{sub.name}/{k}": v for k, v in inner.nonfinite.items()})
    return [dataclasses.replace(f, file=f"{sub.name}/{f.file}" if f.file else sub.name)
            for f in inner.findings]


# -- 1. completeness ------------------------------------------------------------------------

def _follow_tracker(p: Path, findings: list[Finding]) -> Path | None:
    """The iteration dir a training save dir's tracker names (``p`` itself otherwise); None
    (with an error finding) when the tracker is unreadable or names a missing iteration."""
    from ckpt_tool.formats.save_dir import (LATEST_FILE, iteration_dir_name, iteration_dirs,
                                            iterations_text, read_latest)

    save = p.parent if p.is_file() and p.name == LATEST_FILE else p
    if not save.is_dir() or any((save / m).exists() for m in ("metadata.json", ".metadata")):
        return p
    if not (save / LATEST_FILE).is_file():
        iters = iteration_dirs(save)
        if iters:  # the latest is validated (resolve_checkpoint_dir picks it)
            findings.append(warning(
                f"no {LATEST_FILE}: Megatron-LM finds no checkpoint to resume from here "
                f"(iterations: {iterations_text(iters)}; the latest, {iters[-1].name}, is "
                "validated)", file=LATEST_FILE))
        return p
    try:
        latest = read_latest(save)
    except InputError as exc:
        findings.append(error(exc.message, file=LATEST_FILE))
        return None
    target = save / iteration_dir_name(latest)
    if not target.is_dir():
        findings.append(error(
            f"{LATEST_FILE} names iteration {latest} but {target.name}/ is missing "
            f"(present: {', '.join(d.name for d in iteration_dirs(save)[-5:]) or 'none'})",
            file=LATEST_FILE))
        return None
    return target


def _check_markers(root: Path, findings: list[Finding]) -> bool:
    """Commit markers of dist/DCP directories; False when validation cannot go further."""
    from ckpt_tool.formats.dcp.reader import metadata_files
    from ckpt_tool.formats.mcore_dist.reader import read_backend_config

    has_json = (root / "metadata.json").is_file()
    dcp_md = metadata_files(root)
    distcp = any(root.glob("*.distcp"))
    if has_json:
        try:
            cfg = read_backend_config(root)
        except InputError as exc:
            findings.append(error(f"not a complete checkpoint: {exc.message}",
                                  file="metadata.json"))
            return False
        # (metadata.json names the backend as the format registry does)
        if FormatKind(cfg["sharded_backend"]).dcp_files and not (root / ".metadata").is_file():
            findings.append(error(
                f"not a complete checkpoint: metadata.json says {cfg['sharded_backend']} but "
                ".metadata is missing" + (" (.metadata.tmp present: the save was interrupted)"
                                          if (root / ".metadata.tmp").exists() else ""),
                file=".metadata"))
            return False
        return True
    if not dcp_md:
        if distcp or (root / ".metadata.tmp").exists():
            findings.append(error(
                "not a complete checkpoint: *.distcp data but no .metadata (an interrupted "
                "save: .metadata is written last)", file=".metadata"))
            return False
        if (root / "common.pt").is_file():
            findings.append(error(
                "not a complete checkpoint: common.pt but no metadata.json (an interrupted "
                "Megatron-Core save: metadata.json is written last)", file="metadata.json"))
            return False
        return True  # not a dist checkpoint: detection decides (safetensors, torch files, ...)
    return True  # DCP data: what shows it to be a Megatron-Core save is checked with its meta


def _check_completion(meta: CheckpointMeta) -> list[Finding]:
    """DCP data that is a Megatron-Core dist checkpoint (its ``common.pt``, ``MCoreMetadata``
    or 0.19's ``common_state`` object: the DCP reader's ``megatron_core_save``) without the
    ``metadata.json`` that every Megatron-Core version writes last to mark it complete."""
    signs = meta.extras.get("megatron_core_save") if meta.kind.plain_dcp else None
    if not signs:
        return []
    return [error(f"not a complete checkpoint: a Megatron-Core save ({signs}) without "
                  "metadata.json (interrupted: Megatron-Core writes it last and refuses the "
                  "directory without it); data checked as plain DCP", file="metadata.json")]


def _sharded_only(fmt: Any, root: Path, trust: bool) -> tuple[Any, CheckpointMeta | None]:
    """A Megatron-Core dist checkpoint whose common state is unreadable still has its sharded
    data checked: the metadata without the common summary (None for other formats)."""
    try:
        reader = fmt.open(root, trust=trust)
    except InputError:
        return None, None
    try:
        sharded = reader.sharded_metadata()
    except Exception:  # noqa: BLE001 - anything else wrong was reported already
        sharded = None
    if sharded is None:
        reader.close()
        return None, None
    tensors, objects, extras = sharded
    return reader, CheckpointMeta(format=fmt.name, root=str(reader.root), tensors=tensors,
                                  objects=tuple(objects), extras=extras)


def _read_past(reader: Reader) -> list[Finding]:
    """What the reader's metadata read past (``Reader.problems``; Megatron-LM legacy: every
    ``mp_rank_*`` file for TP x PP (x EP) present, replicated tensors agree across TP ranks)."""
    return [error(p["message"], key=p.get("key"), file=p.get("file"))
            for p in reader.problems]


def _check_common_state(root: Path, meta: CheckpointMeta, trust: bool) -> list[Finding]:
    """Megatron-Core dist checkpoints keep their common state in ``common.pt`` (0.12-0.18) or
    in the ``common_state`` object (0.19): without either, Megatron-Core cannot load them
    (``_meta.check_common_state``); with both (no version writes both), 0.19 loads
    ``common.pt`` and ignores the object: an error when the two disagree, a warning when they
    are the same."""
    missing = check_common_state(root, meta)
    obj = meta.extras.get("common_object")
    if missing or not ((root / "common.pt").is_file() and obj):
        return missing
    differ = common_state_differences(root, meta, obj, trust)
    if differ is None:  # one of them is unreadable: reported with the objects and files
        return []
    if differ:
        more = f" (and {len(differ) - 4} more)" if len(differ) > 4 else ""
        return [error(f"two contradicting common states: common.pt and the {obj} object "
                      f"differ in {'; '.join(differ[:4])}{more}. Megatron-Core 0.19 loads "
                      "common.pt and ignores the object, older versions never read the "
                      "object: remove the one that is wrong", file="common.pt")]
    return [warning(f"the common state is stored twice, as common.pt and as the {obj} "
                    "object (the same; no Megatron-Core version writes both)", file="common.pt")]


# -- 2. files -------------------------------------------------------------------------------

def _file_sizes(base: Path, meta: CheckpointMeta) -> dict[str, int | None]:
    names = {c.file for t in meta.tensors.values() for c in t.chunks if c.file} \
        | {o.file for o in meta.objects if o.file}
    out: dict[str, int | None] = {}
    for name in sorted(names):
        try:
            st = (base / name).stat()
            out[name] = st.st_size if not stat.S_ISDIR(st.st_mode) else None
        except OSError:
            out[name] = None
    return out


def _rel(path: str | None, root: Path) -> str | None:
    if path is None:
        return None
    try:
        rel = as_path(path).relative_to(root)
        rel = rel if isinstance(rel, str) else rel.as_posix()
        return None if rel in ("", ".") else rel
    except (ValueError, TypeError):
        return as_path(path).name


# -- 5. leftovers ---------------------------------------------------------------------------

def _stale_data_files(root: Path, meta: CheckpointMeta) -> list[Finding]:
    referenced = {c.file for t in meta.tensors.values() for c in t.chunks if c.file} \
        | {o.file for o in meta.objects if o.file}
    out = []
    for f in sorted(root.glob("*.distcp")):
        if f.name not in referenced:
            out.append(warning("stale data file: not referenced by the metadata (left over "
                               "from another save?)", file=f.name))
    return out


def _is_leftover(name: str) -> bool:
    from ckpt_tool.leftovers import OLD_MARK

    low = name.lower()
    return ".tmp" in low or low.endswith(("~", ".partial")) or "staging" in low \
        or OLD_MARK in low


def _leftovers(root: Path) -> list[Finding]:
    out = []
    try:
        for f in sorted(root.iterdir()):
            if _is_leftover(f.name):
                kind = "directory" if f.is_dir() else "file"
                out.append(warning(f"leftover temporary {kind} from an unfinished write",
                                   file=f.name))
        for f in sorted(root.parent.iterdir()):
            if f != root and f.name.lstrip(".").startswith(root.name) and _is_leftover(f.name):
                out.append(warning("leftover staging/temporary entry next to the checkpoint",
                                   file=f"../{f.name}"))
    except OSError:
        pass
    return out


def _beside(target: Path) -> list[Finding]:
    from ckpt_tool.leftovers import describe_leftovers, leftovers

    if is_remote(target):  # the run marker and the objects of an unfinished write: one line
        left = leftovers(target)
        return [warning(f"an unfinished write left {describe_leftovers(left)} (a rerun of the "
                        "command that writes it reclaims it)", file=f"../{left[0].name}")
                ] if left else []
    return [warning("what an interrupted write of this path left (a rerun of the command "
                    "that writes it reclaims it)", file=f"../{f.name}")
            for f in leftovers(target)]
