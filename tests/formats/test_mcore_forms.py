"""What Megatron-Core versions write around torch_dist data (``formats.mcore_dist.forms``),
read from checkpoints the real Megatron-Core 0.14 and 0.19 wrote, and written back by the
torch_dist writer in the source's form: 0.19's common state is the ``common_state`` object
(no ``common.pt``, a ``metadata.json`` without ``common_backend*``), every other source's is
``common.pt``."""

from __future__ import annotations

import json

import pytest

from ckpt_tool.formats.base import open_checkpoint
from ckpt_tool.formats.mcore_dist.forms import FILE_FORM, OBJECT_FORM, form_of, where_common

from _fixtures import fixture

MCORE019 = "mcore019_gpt_tp2dp2_distopt_buckets"
MCORE014 = "mcore014_gpt_tp2dp2_distopt_flattened"


def test_form_of_extras():
    assert form_of({"common_file": None, "common_object": "common_state/shard_0_1"}) \
        == OBJECT_FORM
    # common.pt outranks the object (0.19 reads the file first): the file form
    assert form_of({"common_file": "common.pt", "common_object": "common_state/shard_0_1"}) \
        == FILE_FORM
    assert form_of({"common_file": "common.pt"}) == form_of({}) == form_of(None) == FILE_FORM
    assert where_common({}) is None
    assert "0.19" in where_common({"common_object": "common_state/shard_0_1"})
    assert "ignores" in where_common({"common_file": "common.pt",
                                      "common_object": "common_state/shard_0_1"})


def test_the_019_common_state_is_the_common_state_object():
    root = fixture(MCORE019)
    with open_checkpoint(root) as reader:
        meta = reader.metadata()
        assert meta.extras["common_file"] is None
        assert meta.extras["common_object"] == "common_state/shard_0_1"
        assert "0.19" in meta.extras["common_state"]
        assert reader.objects_in_common() == {"common_state/shard_0_1"}
        common = reader.common()
        assert common["args"].tensor_model_parallel_size == 2
        assert common["content_metadata"]["distrib_optim_sharding_type"] == "dp_reshardable"
        assert meta.common["parallel"]["tp"] == 2  # the summary, read without torch
        light = reader.common_torch_free_exact()  # what reshard writes back without torch
        assert light is not None and vars(light["args"]).keys() == vars(common["args"]).keys()
    assert json.loads((root / "iter_0000010" / "metadata.json").read_text()) == {
        "sharded_backend": "torch_dist", "sharded_backend_version": 1}


def test_the_014_common_state_is_common_pt():
    with open_checkpoint(fixture(MCORE014)) as reader:
        meta = reader.metadata()
        assert meta.extras["common_file"] == "common.pt"
        assert meta.extras["common_object"] is None
        assert not reader.objects_in_common()
        assert form_of(meta.extras) == FILE_FORM
        assert meta.extras["optimizer_sharding"]["type"] == "fully_sharded_model_space"


@pytest.mark.parametrize("raw_save", [True, False])
def test_writer_keeps_the_object_form(tmp_path, raw_save):
    """The torch_dist writer, both paths (our raw DCP save and DCP's own), given a 0.19
    source's extras: the common state goes into the common_state object, once, the source's
    own common_state object is not copied, and metadata.json is 0.19's."""
    from ckpt_tool.formats.writer import WriteRequest, WriterOptions, writer_for
    from ckpt_tool.ops._source import ReaderSource

    src = fixture(MCORE019)
    out = tmp_path / "out"
    out.mkdir()
    with open_checkpoint(src) as reader:
        meta = reader.metadata()
        common = reader.common()
        common["iteration"] = 12
        request = WriteRequest(meta=meta, source=ReaderSource(reader, {k: k for k in meta.tensors},
                                                              {}),
                               common=common, objects=reader.read_object)
        writer_for("torch_dist")(out, WriterOptions(extra={
            "source_extras": meta.extras, "raw_save": raw_save})).write(request)
    assert sorted(p.name for p in out.iterdir() if not p.name.endswith(".distcp")) == \
        [".metadata", "metadata.json"]
    assert (out / "metadata.json").read_bytes() == \
        b'{"sharded_backend": "torch_dist", "sharded_backend_version": 1}'
    with open_checkpoint(out) as written:
        keys = [o.unique_key for o in written.metadata().objects if o.key == "common_state"]
        assert keys == ["common_state/shard_0_1"]
        assert written.common()["iteration"] == 12
        assert len(written.metadata().objects) == len(meta.objects)


def test_writer_writes_common_pt_for_other_sources(tmp_path):
    """A source without the object form (here: no extras at all) gets common.pt and the
    metadata.json every version reads; a stray common_state object is not written."""
    from ckpt_tool.formats.writer import WriteRequest, WriterOptions, writer_for
    from ckpt_tool.ops._source import ReaderSource

    src = fixture(MCORE019)
    out = tmp_path / "out"
    out.mkdir()
    with open_checkpoint(src) as reader:
        meta = reader.metadata()
        request = WriteRequest(meta=meta, source=ReaderSource(reader, {k: k for k in meta.tensors},
                                                              {}),
                               common=reader.common(), objects=reader.read_object)
        writer_for("torch_dist")(out, WriterOptions()).write(request)
    assert (out / "common.pt").is_file()
    assert json.loads((out / "metadata.json").read_text())["common_backend"] == "torch"
    with open_checkpoint(out) as written:
        assert not written.objects_in_common()
        assert written.common()["args"].tensor_model_parallel_size == 2
