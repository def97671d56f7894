"""The bad-input corpus: each case damages a copy of a checkpoint the real libraries wrote
(``fixtures/`` for Megatron-Core torch_dist and zarr, PyTorch DCP and Megatron-LM legacy;
``torch.save`` and ``safetensors`` files written at test time by torch and safetensors).

A case is ``Case(name, base, mutate, ...)``; ``mutate(ck)`` gets the copy (a directory, or the
file for torch.save / safetensors) and damages it in place."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import _mutate as m

FIX = Path(__file__).resolve().parents[2] / "fixtures"
FIXTURE_BASES = {
    "torch_dist": FIX / "mcore016_gpt_tp2pp2_fp32" / "iter_0000010",
    "zarr": FIX / "mcore015_zarr_gpt_tp2pp2" / "iter_0000010",
    "dcp": FIX / "dcp_plain",
    "legacy": FIX / "megatron_legacy_tp2pp2",
    # (integrity cases: bf16 weights with Adam state; MCore 0.15's flattened optimizer state)
    "torch_dist_bf16": FIX / "mcore016_gpt_tp2pp2_bf16_optim" / "iter_0000010",
    "torch_dist_flat": FIX / "mcore015_gpt_flattened_optim" / "iter_0000010",
}
FILE_NAMES = {"torch": "model.pt", "safetensors": "model.safetensors",
              "st_index": "model.safetensors.index.json"}
MARKER = "PWNED"  # what a malicious pickle would create, beside the checkpoint copy


@dataclass(frozen=True)
class Case:
    name: str
    base: str
    mutate: Callable[[Path], None]
    must_reject: bool = False  # invalid whatever the real loaders say (code, paths outside)
    oracle: bool = True  # ask the real loaders (False: they would run the pickle or hang)
    isolate: bool = False  # subprocess with a time and memory limit (may hang / allocate TBs)
    deny: str | None = None  # path (relative to the copy) nobody may read
    # commands that may succeed although the case is broken, because what they read is
    # intact: convert to safetensors drops objects, reshard the rng state's (its per-rank
    # shards do not fit another layout); a dist checkpoint without metadata.json is a complete
    # plain DCP one; a missing common.pt leaves every tensor readable
    lenient: tuple = ()
    tags: tuple = field(default_factory=tuple)


def write_pristine(root: Path) -> dict[str, Path]:
    """torch.save, safetensors and a safetensors index set written by the real libraries."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    sd = {"embed.weight": torch.randn(16, 8, generator=g),
          "fc.weight": torch.randn(8, 8, generator=g).bfloat16(),
          "fc.bias": torch.randn(8, generator=g), "step": torch.tensor([3, 4])}
    out = {}
    (root / "torch").mkdir(parents=True)
    torch.save(sd, root / "torch" / "model.pt")
    out["torch"] = root / "torch" / "model.pt"
    (root / "safetensors").mkdir()
    save_file(sd, root / "safetensors" / "model.safetensors", metadata={"format": "pt"})
    out["safetensors"] = root / "safetensors" / "model.safetensors"
    d = root / "st_index"
    d.mkdir()
    parts = [{k: sd[k] for k in ("embed.weight", "fc.weight")},
             {k: sd[k] for k in ("fc.bias", "step")}]
    weight_map = {}
    for i, part in enumerate(parts):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file(part, d / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    total = sum(t.numel() * t.element_size() for t in sd.values())
    (d / FILE_NAMES["st_index"]).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    out["st_index"] = d
    return out


# -- mutation builders ------------------------------------------------------------------------

def _f(rel, fn):
    """Apply ``fn(path)`` to ``ck/rel`` (or to ``ck`` itself when rel is None)."""
    return lambda ck: fn(ck / rel if rel else ck)


def truncate(rel, keep):
    return _f(rel, lambda p: m.truncate(p, keep))


def write(rel, data: bytes):
    return _f(rel, lambda p: p.write_bytes(data))


def remove(rel):
    return _f(rel, lambda p: shutil.rmtree(p) if p.is_dir() else p.unlink())


def garble(rel, n=700):
    return write(rel, bytes((i * 131 + 7) % 256 for i in range(n)))


def as_dir(rel):
    """A directory where a file is expected."""
    def fn(p):
        p.unlink()
        p.mkdir()
        (p / "x").write_bytes(b"x")
    return _f(rel, fn)


def as_file(rel):
    """A file where a directory is expected."""
    def fn(p):
        shutil.rmtree(p)
        p.write_bytes(b"not a directory\n")
    return _f(rel, fn)


def symlink_loop(rel):
    def fn(p):
        p.unlink() if not p.is_dir() else shutil.rmtree(p)
        os.symlink(p.name + ".loop", p)
        os.symlink(p.name, p.with_name(p.name + ".loop"))
    return _f(rel, fn)


def evil_torch_save(rel, wrap=lambda e: {"args": e}):
    """A torch.save file whose pickle would create the marker file."""
    return _f(rel, lambda p: p.write_bytes(m.torch_save_bytes(wrap(m.evil(_marker(p))))))


def _marker(p: Path) -> Path:
    """Where a malicious pickle would create its file: the case directory (above ``ck``)."""
    for q in (p, *p.parents):
        if q.name == "ck":
            return q.parent / MARKER
    raise AssertionError(p)


def dcp_meta(fn):
    """Edit the pickled DCP Metadata of the copy with ``fn(md, ck)``."""
    def mut(ck):
        md = m.read_dcp_metadata(ck)
        fn(md, ck)
        m.write_dcp_metadata(ck, md)
    return mut


def _set_storage(fqn, **changes):
    def fn(md, ck):
        idx, info = m.storage_of(md, fqn)
        vals = {k: (v(ck, info) if callable(v) else v) for k, v in changes.items()}
        md.storage_data[idx] = dataclasses.replace(info, **vals)
    return dcp_meta(fn)


def _overlap(a, b):
    def fn(md, ck):
        _, ia = m.storage_of(md, a)
        ib_idx, _ = m.storage_of(md, b)
        md.storage_data[ib_idx] = ia
    return dcp_meta(fn)


def _tb_shape(fqn, scale_chunks):
    import torch

    def fn(md, ck):
        tm = md.state_dict_metadata[fqn]
        big = torch.Size([1 << 20] * 2 + list(tm.size[2:])) if len(tm.size) >= 2 \
            else torch.Size([1 << 40])
        tm.size = big
        if scale_chunks:
            for c in tm.chunks:
                c.sizes = big  # noqa: one chunk "covers" all of it, its data is KBs
    return dcp_meta(fn)


def _outside_copy(rel_target, how):
    """Point every item of ``rel_target`` at a copy outside the checkpoint (``../`` or an
    absolute path); ``how="fifo"`` puts a FIFO there instead (reading it would block)."""
    def mut(ck):
        outside = ck.parent / "outside"
        outside.mkdir(exist_ok=True)
        dst = outside / Path(rel_target).name
        if how == "fifo":
            os.mkfifo(dst)
        else:
            shutil.copy(ck / rel_target, dst)
        rel = os.path.relpath(dst, ck) if how in ("relative", "fifo") else str(dst)
        md = m.read_dcp_metadata(ck)
        for idx, info in list(md.storage_data.items()):
            if info.relative_path == rel_target:
                md.storage_data[idx] = dataclasses.replace(info, relative_path=rel)
        m.write_dcp_metadata(ck, md)
    return mut


def item_field(fqn, family, field, entry=0, mask=1):
    return lambda ck: m.flip_item_field(ck, fqn, family, field, entry, mask)


def file_field(rel, family, field, entry=0, mask=1):
    def fn(p):
        m.xor(p, m.zip_field_at(p.read_bytes(), family, field, entry), mask)
    return _f(rel, fn)


def evil_item(fqn):
    return lambda ck: m.append_item(ck, fqn, m.torch_save_bytes([m.evil(_marker(ck))]))


def evil_pickle(rel):
    import pickle

    return _f(rel, lambda p: p.write_bytes(pickle.dumps({"x": m.evil(_marker(p))})))


def st_header(rel, fn):
    return _f(rel, lambda p: m.edit_st(p, fn))


def st_raw(rel, raw=None, length=None):
    def fn(p):
        header, body = m.read_st(p)
        m.write_st(p, header, body, raw_header=raw, length=length)
    return _f(rel, fn)


def json_edit(rel, fn):
    def mut(p):
        d = json.loads(p.read_text())
        fn(d, p)
        p.write_text(json.dumps(d))
    return _f(rel, mut)


def _escape_index(how):
    def fn(d, p):
        outside = p.parent.parent / "outside"
        outside.mkdir(exist_ok=True)
        shard = "model-00002-of-00002.safetensors"
        shutil.copy(p.parent / shard, outside / shard)
        target = f"../outside/{shard}" if how == "relative" else str(outside / shard)
        d["weight_map"] = {k: (target if v == shard else v) for k, v in d["weight_map"].items()}
    return json_edit(FILE_NAMES["st_index"], fn)


def _tb_storage_pickle(p):
    # torch.save of {"embed.weight": [16, 8] ...}: size (16, 8) -> (2**20, 2**20)
    m.rewrite_zip_member(p, "data.pkl", lambda b: b.replace(
        b"K\x10K\x08\x86", b"J\x00\x00\x10\x00J\x00\x00\x10\x00\x86", 1))


def _short_storage(p):
    import zipfile

    names = zipfile.ZipFile(p).namelist()
    storage = sorted(n for n in names if "/data/" in n)[0]
    m.rewrite_zip_member(p, storage, lambda b: b[: len(b) // 2])


# -- the corpus -------------------------------------------------------------------------------

D0 = "__0_0.distcp"
OUT_W = "output_layer.weight"
RNG = "rng_state/shard_0.0_2.2"
ZW = "output_layer.weight"
LEG = "iter_0000010/mp_rank_00_000/model_optim_rng.pt"
ST, IX = "", FILE_NAMES["st_index"]
SH2 = "model-00002-of-00002.safetensors"


def _corpus() -> list[Case]:
    C = Case
    td = [
        C("truncated-half", "torch_dist", truncate(D0, 0.5)),
        C("truncated-end-record", "torch_dist", truncate(D0, -5)),
        C("truncated-in-first-header", "torch_dist", truncate(D0, 20)),
        C("empty-data-file", "torch_dist", write(D0, b"")),
        C("zip64-disk-number", "torch_dist", item_field(OUT_W, "end", "zip64 record: disk")),
        C("zip64-directory-size-beyond-file", "torch_dist",
          item_field(OUT_W, "end", "zip64 record: directory size", mask=0x40)),
        C("central-local-header-offset", "torch_dist",
          item_field(OUT_W, "central", "local header offset", entry=1, mask=0x10)),
        C("local-header-signature", "torch_dist", item_field(OUT_W, "local", "signature")),
        C("storage-offset-out-of-bounds", "torch_dist",
          _set_storage(OUT_W, offset=lambda ck, i: (ck / i.relative_path).stat().st_size + 64)),
        C("storage-length-1TB", "torch_dist", _set_storage(OUT_W, length=1 << 40),
          isolate=True),
        C("storage-overlapping", "torch_dist",
          _overlap("decoder.final_layernorm.weight", "decoder.final_layernorm.bias")),
        C("shape-TBs-uncovered", "torch_dist", dcp_meta_tb(OUT_W, False), isolate=True),
        C("shape-TBs-one-chunk", "torch_dist", dcp_meta_tb(OUT_W, True), isolate=True),
        C("unknown-dtype", "torch_dist", _f(".metadata", lambda p: m.replace_first(
            p, b"float32", b"flaot32"))),
        C("metadata-missing", "torch_dist", remove(".metadata")),
        C("metadata-empty", "torch_dist", write(".metadata", b"")),
        C("metadata-truncated", "torch_dist", truncate(".metadata", 0.6)),
        C("metadata-malicious", "torch_dist", evil_pickle(".metadata"), must_reject=True,
          oracle=False),
        C("common-missing", "torch_dist", remove("common.pt"),
          lenient=("convert", "diff", "reshard")),
        C("common-empty", "torch_dist", write("common.pt", b"")),
        C("common-truncated", "torch_dist", truncate("common.pt", 0.5)),
        C("common-malicious", "torch_dist", evil_torch_save("common.pt"), must_reject=True,
          oracle=False),
        C("metadata-json-missing", "torch_dist", remove("metadata.json"),
          lenient=("convert", "diff", "reshard")),
        C("metadata-json-garbled", "torch_dist", garble("metadata.json", 60)),
        C("metadata-json-unknown-backend", "torch_dist", write(
            "metadata.json", b'{"sharded_backend": "nope", "sharded_backend_version": 1, '
                             b'"common_backend": "torch", "common_backend_version": 1}')),
        C("object-malicious", "torch_dist", evil_item(RNG), must_reject=True, oracle=False,
          lenient=("convert", "reshard")),
        C("path-escape-relative", "torch_dist", _outside_copy(D0, "relative"),
          must_reject=True),
        C("path-escape-fifo", "torch_dist", _outside_copy(D0, "fifo"), must_reject=True,
          oracle=False, isolate=True),
        C("data-file-unreadable", "torch_dist", lambda ck: None, deny=D0, must_reject=True,
          oracle=False),
        C("data-file-symlink-loop", "torch_dist", symlink_loop(D0)),
        C("data-file-is-directory", "torch_dist", as_dir(D0)),
        C("metadata-is-directory", "torch_dist", as_dir(".metadata")),
    ]
    zarr = [
        C("chunk-truncated", "zarr", truncate(f"{ZW}/0.0", 0.5)),
        C("chunk-missing", "zarr", remove(f"{ZW}/1.0"), must_reject=True),
        C("zarray-missing", "zarr", remove(f"{ZW}/.zarray")),
        C("zarray-garbled", "zarr", garble(f"{ZW}/.zarray", 100)),
        C("zarray-unknown-dtype", "zarr",
          json_edit(f"{ZW}/.zarray", lambda d, p: d.update(dtype="<q9"))),
        C("zarray-shape-TBs", "zarr", json_edit(
            f"{ZW}/.zarray", lambda d, p: d.update(shape=[1 << 20, 1 << 20])), isolate=True,
          must_reject=True),
        C("zarray-chunks-TBs", "zarr", json_edit(
            f"{ZW}/.zarray", lambda d, p: d.update(shape=[1 << 20, 1 << 20],
                                                   chunks=[1 << 20, 1 << 20])), isolate=True),
        C("array-is-file", "zarr", as_file(ZW)),
        C("common-malicious", "zarr", evil_torch_save("common.pt"), must_reject=True,
          oracle=False),
        C("object-malicious", "zarr", evil_torch_save("rng_state/shard_0.0_2.2.pt",
                                                      wrap=lambda e: [e]),
          must_reject=True, oracle=False, lenient=("convert", "reshard")),
        C("object-truncated", "zarr", truncate("rng_state/shard_0.0_2.2.pt", 0.5),
          lenient=("convert", "reshard")),
        C("metadata-json-empty", "zarr", write("metadata.json", b"")),
    ]
    dcp = [
        C("truncated-third", "dcp", truncate(D0, 0.33)),
        C("truncated-end-record", "dcp", truncate("__1_0.distcp", -1)),
        C("end-record-entries", "dcp", item_field("model.head.weight", "end",
                                                  "end record: entries")),
        C("central-method", "dcp", item_field("model.head.weight", "central", "method",
                                              mask=8)),
        C("central-disk", "dcp", item_field("model.embed.weight", "central", "disk")),
        C("local-compressed-size", "dcp", item_field("model.embed.weight", "local",
                                                     "compressed size", entry=2, mask=0x80)),
        C("metadata-malicious", "dcp", evil_pickle(".metadata"), must_reject=True,
          oracle=False),
        C("metadata-garbled", "dcp", garble(".metadata")),
        C("storage-offset-out-of-bounds", "dcp", _set_storage(
            "model.head.weight", offset=lambda ck, i: (ck / i.relative_path).stat().st_size)),
        C("storage-overlapping", "dcp", _overlap("model.head.weight", "model.embed.weight")),
        C("path-escape-relative", "dcp", _outside_copy(D0, "relative"), must_reject=True),
        C("path-escape-absolute", "dcp", _outside_copy(D0, "absolute"), must_reject=True),
        C("bytes-item-malicious", "dcp", evil_item("extra.note"), must_reject=True,
          oracle=False, lenient=("convert",)),
        C("shape-TBs", "dcp", dcp_meta_tb("model.embed.weight", True), isolate=True),
        C("directory-unreadable", "dcp", lambda ck: None, deny=".", must_reject=True,
          oracle=False),
    ]
    legacy = [
        C("truncated-half", "legacy", truncate(LEG, 0.5)),
        C("truncated-end-record", "legacy", truncate(LEG, -10)),
        C("central-disk", "legacy", file_field(LEG, "central", "disk", entry=1)),
        C("end-record-directory-offset", "legacy", file_field(
            LEG, "end", "zip64 record: directory offset", mask=0x20)),
        C("malicious", "legacy", evil_torch_save(LEG, wrap=lambda e: {"model": {}, "args": e}),
          must_reject=True, oracle=False),
        C("data-pkl-garbled", "legacy", _f(LEG, lambda p: m.rewrite_zip_member(
            p, "data.pkl", lambda b: b[:40] + bytes(range(256)) + b[296:]))),
        C("rank-dir-is-file", "legacy", as_file("iter_0000010/mp_rank_01_001")),
        C("rank-missing", "legacy", remove("iter_0000010/mp_rank_01_001"), must_reject=True),
        C("tracker-garbage", "legacy", write("latest_checkpointed_iteration.txt", b"1x0\n")),
        C("file-unreadable", "legacy", lambda ck: None, deny=LEG, must_reject=True,
          oracle=False),
    ]
    torch_ = [
        C("truncated-third", "torch", truncate(ST, 0.33)),
        C("truncated-end-record", "torch", truncate(ST, -3)),
        C("end-record-directory-offset", "torch", _f(ST, lambda p: m.xor(
            p, m.zip_field_at(p.read_bytes(), "end", "end record: directory offset"), 4))),
        C("central-disk", "torch", file_field(ST, "central", "disk")),
        C("local-signature", "torch", file_field(ST, "local", "signature", entry=0)),
        C("malicious", "torch", evil_torch_save(ST, wrap=lambda e: {"w": e}),
          must_reject=True),
        C("data-pkl-garbled", "torch", _f(ST, lambda p: m.rewrite_zip_member(
            p, "data.pkl", lambda b: b[:30] + b"\xff" * 40 + b[70:]))),
        C("shape-TBs", "torch", _f(ST, _tb_storage_pickle), isolate=True),
        C("storage-short", "torch", _f(ST, _short_storage)),
        C("unknown-dtype", "torch", _f(ST, lambda p: m.rewrite_zip_member(
            p, "data.pkl", lambda b: b.replace(b"FloatStorage", b"FlaotStorage", 1)))),
        C("symlink-loop", "torch", symlink_loop(ST)),
        C("unreadable", "torch", lambda ck: None, deny=ST, must_reject=True, oracle=False),
    ]
    st = [
        C("header-bigger-than-file", "safetensors", st_raw(ST, length=1 << 20)),
        C("header-length-huge", "safetensors", st_raw(ST, length=(1 << 63) - 1),
          isolate=True),
        C("header-garbled", "safetensors", st_raw(ST, raw=b'{"a": [1, 2')),
        C("header-empty", "safetensors", st_raw(ST, raw=b"")),
        C("offsets-out-of-bounds", "safetensors", st_header(
            ST, lambda h: h["step"].update(data_offsets=[10 ** 6, 10 ** 6 + 16]))),
        C("offsets-overlapping", "safetensors", st_header(
            ST, lambda h: h["fc.bias"].update(data_offsets=h["embed.weight"]["data_offsets"][
                :1] + [h["embed.weight"]["data_offsets"][0] + 32]))),
        C("unknown-dtype", "safetensors", st_header(ST, lambda h: h["fc.bias"].update(
            dtype="F128"))),
        C("shape-TBs", "safetensors", st_header(ST, lambda h: h["embed.weight"].update(
            shape=[1 << 20, 1 << 20])), isolate=True),
        C("truncated-data", "safetensors", truncate(ST, -20)),
        C("metadata-not-strings", "safetensors", st_header(
            ST, lambda h: h.update(__metadata__={"format": ["pt"]}))),
    ]
    ix = [
        C("index-escape-relative", "st_index", _escape_index("relative"), must_reject=True),
        C("index-escape-absolute", "st_index", _escape_index("absolute"), must_reject=True),
        C("index-missing-shard", "st_index", remove(SH2)),
        C("index-garbled", "st_index", garble(IX, 90)),
        C("index-empty", "st_index", write(IX, b"")),
        C("index-key-not-in-shard", "st_index", json_edit(
            IX, lambda d, p: d["weight_map"].update({"ghost.weight": SH2})), must_reject=True),
        C("index-shard-is-directory", "st_index", as_dir(SH2)),
        C("index-shard-symlink-loop", "st_index", symlink_loop(SH2)),
    ]
    return td + zarr + dcp + legacy + torch_ + st + ix + _integrity_corpus()


# -- integrity: damage only the zip CRC-32s or the items themselves reveal ---------------------
# (the real loaders accept most of these: torch.load ignores the CRCs, and nothing compares
# the metadata with the items. They are broken all the same: must_reject.)

EXP_AVG = "optimizer.state.exp_avg.output_layer.weight"
FLAT_EXP_AVG = "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight"
BF16_W = "embedding.word_embeddings.weight"


def _meta_dtype(fqn, dtype):
    import torch

    def fn(md, ck):
        md.state_dict_metadata[fqn].properties.dtype = getattr(torch, dtype)
    return dcp_meta(fn)


def _meta_rows(fqn, extra):
    import torch

    def fn(md, ck):
        tm = md.state_dict_metadata[fqn]
        tm.size = torch.Size([tm.size[0] + extra, *tm.size[1:]])
    return dcp_meta(fn)


def _no_arrays(ck):
    for z in sorted(ck.rglob(".zarray")):
        shutil.rmtree(z.parent)


_ZARR_JSON = (b'{"sharded_backend": "zarr", "sharded_backend_version": 1, '
              b'"common_backend": "torch", "common_backend_version": 1}')


def _integrity_corpus() -> list[Case]:
    C = Case
    crc = dict(must_reject=True, tags=("integrity",))
    meta = dict(must_reject=True, tags=("integrity",))
    return [
        C("item-data-crc", "torch_dist", lambda ck: m.flip_item_data(ck, OUT_W), **crc),
        C("common-record-crc", "torch_dist", _f("common.pt", lambda p: m.flip_record_data(
            p, ".data/serialization_id")), **crc),
        C("central-disk-start", "torch_dist",
          item_field(OUT_W, "central", "disk", entry=4, mask=0x02), tags=("integrity",)),
        C("metadata-dtype-float16", "torch_dist", _meta_dtype(OUT_W, "float16"), **meta),
        C("metadata-dtype-int64", "torch_dist", _meta_dtype(OUT_W, "int64"), **meta),
        C("metadata-shape-beyond-chunks", "torch_dist", _meta_rows(OUT_W, 64), **meta),
        C("metadata-json-says-zarr", "torch_dist", write("metadata.json", _ZARR_JSON), **meta),
        C("metadata-dtype-float16-for-bf16", "torch_dist_bf16", _meta_dtype(BF16_W, "float16"),
          **meta),
        C("exp-avg-item-crc", "torch_dist_bf16", lambda ck: m.flip_item_data(ck, EXP_AVG),
          **crc),
        C("flattened-optim-item-crc", "torch_dist_flat",
          lambda ck: m.flip_item_data(ck, FLAT_EXP_AVG), **crc),
        C("no-arrays", "zarr", _no_arrays, **meta),
        C("zarray-dtype-same-size", "zarr",
          json_edit(f"{ZW}/.zarray", lambda d, p: d.update(dtype="<f2")), **meta),
        C("item-data-crc", "dcp", lambda ck: m.flip_item_data(ck, "model.embed.weight"), **crc),
        C("rank-file-data-crc", "legacy", _f(LEG, m.flip_record_data), **crc),
        C("data-crc", "torch", _f(ST, m.flip_record_data), **crc),
    ]


def dcp_meta_tb(fqn, scale_chunks):
    return _tb_shape(fqn, scale_chunks)


# -- robustness: what must never hang a command, crash it or be allocated ---------------------
# (entries that are not regular files where a checkpoint's file belongs: opening a FIFO waits
# for a writer, /dev/zero never ends; the real loaders would hang on them, so they are not
# asked: must_reject. Metadata whose sizes contradict the items: the real loaders decide.)

def fifo(rel):
    """A FIFO (named pipe) where ``rel`` was: reading it waits for a writer forever."""
    def fn(p):
        p.unlink() if not p.is_dir() else shutil.rmtree(p)
        os.mkfifo(p)
    return _f(rel, fn)


def socket_node(rel):
    """A socket where ``rel`` was."""
    import stat

    def fn(p):
        p.unlink()
        os.mknod(p, stat.S_IFSOCK | 0o644)
    return _f(rel, fn)


def to_device(rel, device="/dev/zero"):
    """A symlink to a character device where ``rel`` was (reading it never ends)."""
    def fn(p):
        p.unlink()
        os.symlink(device, p)
    return _f(rel, fn)


def _rows(fqn, rows, chunk=None):
    """``.metadata`` says ``fqn`` has ``rows`` rows (``chunk="last"``: its last chunk stretches
    to cover them; the items stay as they were)."""
    import torch

    def fn(md, ck):
        tm = md.state_dict_metadata[fqn]
        tm.size = torch.Size([rows, *tm.size[1:]])
        if chunk == "last":
            c = max(tm.chunks, key=lambda c: c.offsets[0])
            c.sizes = torch.Size([rows - c.offsets[0], *c.sizes[1:]])
    return dcp_meta(fn)


def _retile(fqn):
    """The first two chunks of ``fqn`` along dim 0 re-cut (half of the first moved to the
    second): they still tile the tensor, but no longer match the items they point at."""
    import torch

    def fn(md, ck):
        c0, c1 = sorted(md.state_dict_metadata[fqn].chunks, key=lambda c: c.offsets[0])[:2]
        half = c0.sizes[0] // 2
        c0.sizes = torch.Size([half, *c0.sizes[1:]])
        c1.offsets = torch.Size([c1.offsets[0] - half, *c1.offsets[1:]])
        c1.sizes = torch.Size([c1.sizes[0] + half, *c1.sizes[1:]])
    return dcp_meta(fn)


EMB = "embedding.word_embeddings.weight"
DCP_HEAD = "model.head.weight"
ZCHUNK = f"{ZW}/0.0"


def _robustness_corpus() -> list[Case]:
    C = Case
    never = dict(must_reject=True, oracle=False, isolate=True, tags=("robustness",))
    return [
        C("data-file-is-fifo", "torch_dist", fifo(D0), **never),
        C("metadata-is-fifo", "torch_dist", fifo(".metadata"), **never),
        C("common-is-socket", "torch_dist", socket_node("common.pt"), **never),
        C("data-file-is-dev-zero", "torch_dist", to_device(D0), **never),
        C("data-file-is-fifo", "dcp", fifo("__1_0.distcp"), **never),
        C("chunk-is-fifo", "zarr", fifo(ZCHUNK), **never),
        C("zarray-is-fifo", "zarr", fifo(f"{ZW}/.zarray"), **never),
        C("rank-file-is-fifo", "legacy", fifo(LEG), **never),
        C("tracker-is-fifo", "legacy", fifo("latest_checkpointed_iteration.txt"), **never),
        C("is-fifo", "torch", fifo(ST), **never),
        C("is-fifo", "safetensors", fifo(ST), **never),
        C("shard-is-fifo", "st_index", fifo(SH2), **never),
        C("index-is-fifo", "st_index", fifo(IX), **never),
        C("shape-1e15-rows", "torch_dist", _rows(EMB, 10 ** 15), isolate=True,
          tags=("robustness",)),
        C("last-chunk-claims-1e15-rows", "torch_dist", _rows(EMB, 10 ** 15, chunk="last"),
          isolate=True, tags=("robustness",)),
        C("chunk-sizes-disagree-with-items", "torch_dist", _retile(EMB),
          tags=("robustness",)),
        C("shape-1e15-rows", "dcp", _rows(DCP_HEAD, 10 ** 15), isolate=True,
          tags=("robustness",)),
        C("chunk-sizes-disagree-with-items", "dcp", _retile(DCP_HEAD), tags=("robustness",)),
    ]


# -- hostile inputs: reads outside through links, guesses, hostile sizes and fields ------------
# (a tar torch.save member that is a symlink: torch.load extracts it and opens its target; the
# real loaders are not asked about links out of the checkpoint: must_reject)

def tar_with_link(rel, target="secret"):
    """``rel`` replaced by a torch.save file in its tar form whose ``storages`` member is a
    symlink to ``outside/<target>`` beside the copy: a regular file holding what torch.load
    would read there, or (``target="fifo"``) a FIFO, whose open blocks."""
    def fn(p):
        outside = _marker(p).parent / "outside"
        outside.mkdir(exist_ok=True)
        dst = outside / target
        if target == "fifo":
            os.mkfifo(dst)
        else:
            import pickle

            dst.write_bytes(pickle.dumps(0, protocol=2) + pickle.dumps([], protocol=2))
        p.write_bytes(m.tar_torch_save(str(dst)))
    return _f(rel, fn)


def rank_args(rel, fn):
    """Edit the ``args`` of one legacy rank file with ``fn(state)`` (torch.load, torch.save:
    the file stays what the real library writes)."""
    def mut(p):
        import torch

        state = torch.load(p, weights_only=False)
        fn(state)
        torch.save(state, p)
    return _f(rel, mut)


LEG2 = "iter_0000010/mp_rank_01_001/model_optim_rng.pt"


def st_key_escape(rel, escaped: str):
    """The safetensors header's ``fc.bias`` key rewritten as ``fc<escaped>bias`` in the JSON
    text itself (``\\ud800``: a lone surrogate, which ``json.dumps`` cannot write)."""
    def fn(p):
        header, body = m.read_st(p)
        raw = json.dumps(header).encode().replace(b'"fc.bias"',
                                                  b'"fc' + escaped.encode() + b'bias"', 1)
        m.write_st(p, header, body, raw_header=raw)
    return _f(rel, fn)


def _chunk_field(fqn, field, as_type):
    """Every chunk of ``fqn`` in ``.metadata`` with ``field`` (sizes/offsets) of another type."""
    def fn(md, ck):
        for c in md.state_dict_metadata[fqn].chunks:
            setattr(c, field, [as_type(v) for v in getattr(c, field)])
    return dcp_meta(fn)


def _dtype_string(fqn):
    def fn(md, ck):
        md.state_dict_metadata[fqn].properties.dtype = "float32"
    return dcp_meta(fn)


def _link_outside(rel):
    """``rel`` moved beside the copy (``outside/``) and replaced by a symlink to it."""
    def fn(p):
        outside = _marker(p).parent / "outside"
        outside.mkdir(exist_ok=True)
        shutil.move(p, outside / p.name)
        os.symlink(os.path.relpath(outside / p.name, p.parent), p)
    return _f(rel, fn)


def _hostile_corpus() -> list[Case]:
    C = Case
    outside = dict(must_reject=True, oracle=False, tags=("outside",))
    hang = dict(outside, isolate=True)
    return [
        C("common-tar-link-outside", "torch_dist", tar_with_link("common.pt"), **outside),
        C("common-tar-link-fifo", "torch_dist", tar_with_link("common.pt", "fifo"), **hang),
        C("rank-file-tar-link-outside", "legacy", tar_with_link(LEG), **outside),
        C("rank-file-tar-link-fifo", "legacy", tar_with_link(LEG, "fifo"), **hang),
        C("tar-link-outside", "torch", tar_with_link(ST), **outside),
        C("data-file-links-outside", "dcp", _link_outside(D0), **outside),
        # the layout is read from what the rank files say, never guessed (the real loader,
        # torch.load, reads every file: the layout is ckpt's own reading, so must_reject)
        C("first-rank-without-args", "legacy", rank_args(LEG, lambda s: s.pop("args")),
          must_reject=True, tags=("layout",)),
        C("ranks-disagree-on-swiglu", "legacy",
          rank_args(LEG2, lambda s: setattr(s["args"], "swiglu", False)), must_reject=True,
          tags=("layout",)),
        # fields parsed as the real loader parses them (int() of the tracker's text)
        C("tracker-superscript-two", "legacy",
          write("latest_checkpointed_iteration.txt", "\u00b2\n".encode())),
        C("tracker-5000-digits", "legacy",
          write("latest_checkpointed_iteration.txt", b"9" * 5000 + b"\n")),
        C("key-with-nul", "safetensors", st_header(
            ST, lambda h: h.update({"fc\u0000bias": h.pop("fc.bias")}))),
        C("key-lone-surrogate", "safetensors", st_key_escape(ST, "\\ud800")),
        C("storage-length-2-70", "torch_dist", _set_storage(OUT_W, length=1 << 70),
          isolate=True),
        C("common-200000-deep", "torch_dist", _f("common.pt", lambda p: m.rewrite_zip_member(
            p, "data.pkl", lambda b: m.deep_list_pickle(200_000)))),
        C("common-self-referential", "torch_dist", _f("common.pt", lambda p: m.rewrite_zip_member(
            p, "data.pkl", lambda b: m.self_referential_pickle()))),
        C("common-asks-2GB", "torch_dist", _f("common.pt", lambda p: m.rewrite_zip_member(
            p, "data.pkl", lambda b: m.allocating_pickle(2_000_000_000))), isolate=True),
        C("deflated-records", "torch", _f(ST, m.deflate_zip)),
        C("deflated-records", "legacy", _f(LEG, m.deflate_zip)),
        C("common-object-with-stand-in-names", "torch_dist", _f(
            "common.pt", lambda p: m.rewrite_zip_member(p, "data.pkl", lambda b: (
                m.with_megatron_object(b, {"_args": 5, "_items": 3, "_state": "x",
                                           "hidden_size": 8}))))),
        # what the real loaders refuse, validate refuses (fields of the wrong type or range)
        C("shape-float", "safetensors", st_header(ST, lambda h: h["fc.bias"].update(
            shape=[8.0]))),
        C("shape-string", "safetensors", st_header(ST, lambda h: h["fc.bias"].update(
            shape=["8"]))),
        C("offsets-float", "safetensors", st_header(ST, lambda h: h["fc.bias"].update(
            data_offsets=[float(x) for x in h["fc.bias"]["data_offsets"]]))),
        C("offsets-string", "safetensors", st_header(ST, lambda h: h["fc.bias"].update(
            data_offsets=[str(x) for x in h["fc.bias"]["data_offsets"]]))),
        C("chunk-sizes-float", "torch_dist", _chunk_field(OUT_W, "sizes", float)),
        C("chunk-offsets-string", "torch_dist", _chunk_field(OUT_W, "offsets", str)),
        C("dtype-a-string", "dcp", _dtype_string(DCP_HEAD)),
        C("backend-version-99", "torch_dist", json_edit(
            "metadata.json", lambda d, p: d.update(sharded_backend_version=99))),
        C("common-backend-zarr", "torch_dist", json_edit(
            "metadata.json", lambda d, p: d.update(common_backend="zarr"))),
        # a symlink nothing references, to a directory full of devices: not a damage at all
        C("stray-link-to-root", "torch_dist", lambda ck: os.symlink("/", ck / "rootfs"),
          tags=("intact",)),
    ]


CASES = _corpus() + _robustness_corpus() + _hostile_corpus()
BY_ID = {f"{c.base}/{c.name}": c for c in CASES}
assert len(BY_ID) == len(CASES), "case names must be unique per base"
