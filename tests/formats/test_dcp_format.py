"""Plain PyTorch DCP checkpoints (format ``dcp``): detection, metadata, reads, per-rank saves.

Ground truth is torch itself: ``format_utils.dcp_to_torch_save`` on ``fixtures/dcp_plain`` (a
real 2-rank FSDP2 checkpoint) and ``dcp.save`` in tmp_path (single process, ``no_dist=True``;
the per-rank ``__{rank}.metadata`` variant with ``use_collectives=False`` on a fake process
group, one rank after the other in this process).
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from typer.testing import CliRunner

from _builders import write_mcore_dist
from ckpt_tool.errors import CorruptCheckpointError, InputError, NotACheckpointError
from ckpt_tool.formats import detect, formats, open_checkpoint
from ckpt_tool.formats.containers.dcp.dcp_metadata import read_dcp_metadata

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "fixtures" / "dcp_plain"
pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
              pytest.mark.filterwarnings("ignore:Detected an existing checkpoint:UserWarning")]
needs_fixture = pytest.mark.skipif(not (FIXTURE / ".metadata").is_file(),
                                   reason="fixtures/dcp_plain is missing")


def _nested_get(sd, path):
    for p in path:
        sd = sd[p]
    return sd


@pytest.fixture(scope="module")
def fixture_truth(tmp_path_factory):
    """``{fqn: value}`` of fixtures/dcp_plain as torch's dcp_to_torch_save loads it."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path_factory.mktemp("truth") / "full.pt"
    dcp_to_torch_save(FIXTURE, out)
    nested = torch.load(out, weights_only=False)
    md = read_dcp_metadata(FIXTURE)
    return {fqn: _nested_get(nested, md.planner_data[fqn]) for fqn in md.state_dict_metadata}


def _bitwise_equal(a, b):
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.view(torch.uint8) if a.dim() else a.reshape(1).view(torch.uint8),
                            b.view(torch.uint8) if b.dim() else b.reshape(1).view(torch.uint8)))


# -- detection ------------------------------------------------------------------------------

def test_registered_after_mcore():
    names = list(formats())
    assert names.index("dcp") > names.index("torch_dist")
    assert names.index("dcp") > names.index("zarr")


@needs_fixture
def test_detect_fixture():
    assert detect(FIXTURE).name == "dcp"
    assert detect(FIXTURE / ".metadata").name == "dcp"
    assert Path(open_checkpoint(FIXTURE / ".metadata").metadata().root) == FIXTURE


def test_sniff_rejects_with_reasons(tmp_path):
    sniff = formats()["dcp"].sniff
    empty = tmp_path / "empty"
    empty.mkdir()
    assert sniff(empty) == "no .metadata file"
    mcore = write_mcore_dist(tmp_path / "mcore", {"w": ((2,), [((0,), torch.ones(2))])}, {})
    assert "metadata.json" in sniff(mcore) and "Megatron-Core" in sniff(mcore)
    assert detect(mcore).name == "torch_dist"
    (empty / "__0_0.distcp").write_bytes(b"x")
    assert "interrupted DCP save" in sniff(empty)
    eclipse = tmp_path / "ws"
    (eclipse / ".metadata").mkdir(parents=True)  # an Eclipse workspace, not DCP
    assert sniff(eclipse) == "no .metadata file"
    with pytest.raises(NotACheckpointError) as e:
        detect(empty)
    assert "dcp: *.distcp files but no .metadata" in str(e.value)


# -- fixtures/dcp_plain against torch -------------------------------------------------------

@needs_fixture
def test_fixture_metadata(fixture_truth):
    meta = open_checkpoint(FIXTURE).metadata()
    assert meta.format == "dcp" and meta.version == "1.0.0"
    tensors = {k: v for k, v in fixture_truth.items() if isinstance(v, torch.Tensor)}
    others = {k: v for k, v in fixture_truth.items() if not isinstance(v, torch.Tensor)}
    assert (len(tensors), len(others)) == (40, 16)
    assert set(meta.tensors) == set(tensors)
    for key, t in tensors.items():
        m = meta.tensors[key]
        assert (m.dtype, m.shape) == (str(t.dtype).removeprefix("torch."), tuple(t.shape)), key
        assert sum(c.numel for c in m.chunks) == t.numel(), key
        assert all(c.layout == "torch_save" and c.file.endswith(".distcp") for c in m.chunks)
    head = meta.tensors["model.head.weight"]
    assert [(c.offsets, c.sizes) for c in head.chunks] == [((0, 0), (3, 8)), ((3, 0), (2, 8))]
    assert meta.tensors["model.proj_bf16.weight"].dtype == "bfloat16"
    assert meta.tensors["optim.state.head.weight.step"].shape == ()
    assert {o.unique_key for o in meta.objects} == set(others)
    assert all(o.key == o.unique_key for o in meta.objects)
    ex = meta.extras
    assert ex["dcp_version"] == "1.0.0" and ex["metadata_files"] == [".metadata"]
    assert not ex["per_rank_metadata"] and ex["tensor_items"] == 40 and ex["bytes_items"] == 16
    assert ex["data_files"] == ex["data_files_on_disk"] == 2 and ex["missing_data_files"] == []
    assert ex["storage_meta"]["save_id"] and ex["has_planner_data"]
    values = meta.common["values"]
    assert values["step"] == 1 and values["extra.epoch"] == 3
    assert values["extra.note"] == "ckpt fixture" and values["extra.lr_history"] == [0.001]
    assert values["optim.param_groups.0.params"] == others["optim.param_groups.0.params"]
    json.dumps(meta.to_dict())


@needs_fixture
def test_fixture_reads_bit_exact(fixture_truth):
    with open_checkpoint(FIXTURE) as r:
        for key, want in fixture_truth.items():
            if isinstance(want, torch.Tensor):
                assert _bitwise_equal(r.read(key), want), key
            else:
                assert r.read_object(key) == want, key
        # slices crossing the uneven 3 + 2 row boundary of head.*
        w = fixture_truth["model.head.weight"]
        assert _bitwise_equal(r.read("model.head.weight", (slice(2, 5), slice(1, 6))),
                              w[2:5, 1:6].contiguous())
        b = fixture_truth["optim.state.head.bias.exp_avg"]
        assert _bitwise_equal(r.read("optim.state.head.bias.exp_avg", (slice(1, 4),)), b[1:4])
        bf = fixture_truth["model.proj_bf16.weight"]
        assert _bitwise_equal(r.read("model.proj_bf16.weight", (slice(3, 5),)), bf[3:5])
        common = r.common()
        # nested again by planner_data, as dcp_to_torch_save gives it
        assert common["extra"]["lr_history"] == [1e-3] and common["step"] == 1
        with pytest.raises(InputError, match="no tensor"):
            r.read("nope")
        with pytest.raises(InputError, match="no object"):
            r.read_object("nope")


@needs_fixture
def test_metadata_imports_no_torch():
    code = (
        "import sys, json\n"
        "from ckpt_tool.formats import open_checkpoint\n"
        f"m = open_checkpoint({str(FIXTURE)!r}).metadata()\n"
        "assert m.format == 'dcp' and len(m.tensors) == 40 and m.common['values']['step'] == 1\n"
        "json.dumps(m.to_dict())\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- checkpoints written here by dcp.save ---------------------------------------------------

STATE = {
    "model": {"w": torch.randn(6, 4, generator=torch.Generator().manual_seed(0)),
              "b16": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4),
              "ids": torch.arange(5, dtype=torch.int64), "scale": torch.tensor(2.5)},
    "meta": {"name": "run-1", "tags": ["a", "b"], "cfg": {"depth": 2}},
    "step": 42,
}


def _flat(state, prefix=""):
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


@pytest.mark.parametrize("single_file_per_rank", [True, False])
def test_single_process_save(tmp_path, single_file_per_rank):
    ck = tmp_path / "ckpt"
    dcp.save(STATE, storage_writer=FileSystemWriter(ck, single_file_per_rank=single_file_per_rank),
             no_dist=True)
    assert detect(ck).name == "dcp"
    with open_checkpoint(ck) as r:
        meta = r.metadata()
        flat = _flat(STATE)
        assert set(meta.tensors) == {k for k, v in flat.items() if isinstance(v, torch.Tensor)}
        assert {o.unique_key for o in meta.objects} == {"meta.name", "meta.tags",
                                                        "meta.cfg.depth", "step"}
        for key in meta.tensors:
            assert _bitwise_equal(r.read(key), flat[key]), key
        assert _bitwise_equal(r.read("model.w", (slice(1, 3), slice(2, None))),
                              flat["model.w"][1:3, 2:].contiguous())
        assert r.read_object("meta.tags") == ["a", "b"] and r.read_object("step") == 42
        assert meta.common["values"] == {"meta.name": "run-1", "meta.tags": ["a", "b"],
                                         "meta.cfg.depth": 2, "step": 42}
        assert meta.extras["data_files"] == (1 if single_file_per_rank else 8)


def test_truncated_and_empty_metadata(tmp_path):
    ck = tmp_path / "ckpt"
    dcp.save(STATE, checkpoint_id=ck, no_dist=True)
    data = (ck / ".metadata").read_bytes()
    (ck / ".metadata").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match="cannot unpickle"):
        open_checkpoint(ck).metadata()
    (ck / ".metadata").write_bytes(b"")
    with pytest.raises(CorruptCheckpointError, match="empty"):
        open_checkpoint(ck).metadata()


def test_missing_data_file_reported_and_read_fails(tmp_path):
    ck = tmp_path / "ckpt"
    dcp.save(STATE, checkpoint_id=ck, no_dist=True)
    (ck / "__0_0.distcp").unlink()
    r = open_checkpoint(ck)
    assert r.metadata().extras["missing_data_files"] == ["__0_0.distcp"]
    assert "unreadable" in r.metadata().common
    with pytest.raises(CorruptCheckpointError, match="missing"):
        r.read("model.w")


# -- per-rank metadata (dcp.save(use_collectives=False)) ------------------------------------

def _save_per_rank(ck: Path, full: torch.Tensor, world: int = 2) -> None:
    """Each rank saves its rows of ``full`` (a DTensor, Shard(0)) without collectives."""
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    rows = [3, 2]
    for rank in range(world):
        dist.init_process_group("fake", rank=rank, world_size=world, store=fake_pg.FakeStore())
        try:
            mesh = init_device_mesh("cpu", (world,))
            start = sum(rows[:rank])
            local = full[start:start + rows[rank]]
            dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                    shape=full.shape, stride=full.stride())
            sd = {"w": dt, "replicated": torch.arange(4.0) + rank, "step": 7,
                  f"only_rank{rank}": rank}
            dcp.save(sd, checkpoint_id=ck, use_collectives=False)
        finally:
            dist.destroy_process_group()


def test_per_rank_metadata_merged(tmp_path):
    ck = tmp_path / "ckpt"
    full = torch.arange(15.0).reshape(5, 3)
    _save_per_rank(ck, full)
    assert sorted(p.name for p in ck.iterdir()) == ["__0.metadata", "__0_0.distcp",
                                                    "__1.metadata", "__1_0.distcp"]
    assert detect(ck).name == "dcp" and detect(ck / "__1.metadata").name == "dcp"
    with open_checkpoint(ck) as r:
        meta = r.metadata()
        w = meta.tensors["w"]
        assert [(c.offsets, c.sizes, c.file) for c in w.chunks] == [
            ((0, 0), (3, 3), "__0_0.distcp"), ((3, 0), (2, 3), "__1_0.distcp")]
        assert torch.equal(r.read("w"), full)
        assert torch.equal(r.read("w", (slice(2, 4),)), full[2:4])
        # replicated items are kept once, from the lowest rank
        assert torch.equal(r.read("replicated"), torch.arange(4.0))
        assert {o.unique_key for o in meta.objects} == {"step", "only_rank0", "only_rank1"}
        assert r.read_object("only_rank1") == 1 and r.read_object("step") == 7
        ex = meta.extras
        assert ex["per_rank_metadata"] and ex["metadata_files"] == ["__0.metadata",
                                                                    "__1.metadata"]
        assert ex["replicated_items"] == 2 and ex["data_files"] == 2
        assert meta.common["values"] == {"only_rank0": 0, "only_rank1": 1, "step": 7}


def test_per_rank_metadata_conflict(tmp_path):
    ck = tmp_path / "ckpt"
    _save_per_rank(ck, torch.arange(15.0).reshape(5, 3))
    import pickle

    md = read_dcp_metadata(ck, rank=1)
    md.state_dict_metadata["w"].size = torch.Size([6, 3])
    (ck / "__1.metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CorruptCheckpointError, match=r"tensor w: __0.metadata says float32"):
        open_checkpoint(ck).metadata()


def test_global_metadata_preferred_over_per_rank(tmp_path):
    ck = tmp_path / "ckpt"
    dcp.save(STATE, checkpoint_id=ck, no_dist=True)
    shutil.copy(ck / ".metadata", ck / "__0.metadata")
    meta = open_checkpoint(ck).metadata()
    assert meta.extras["metadata_files"] == [".metadata"]


# -- CLI -------------------------------------------------------------------------------------

@needs_fixture
def test_cli_inspect_fixture():
    from ckpt_tool.cli.app import app

    runner = CliRunner()
    result = runner.invoke(app, ["inspect", str(FIXTURE), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["format"] == "dcp" and doc["totals"]["tensors"] == 40
    assert doc["tensors"]["model.head.weight"]["chunks"] == 2
    assert doc["common"]["values"]["step"] == 1
    human = runner.invoke(app, ["inspect", str(FIXTURE)], env={"COLUMNS": "200"})
    assert human.exit_code == 0, human.output
    for text in ("dcp", "dcp_version=1.0.0", "model.proj_bf16.weight", "extra.note",
                 "optim.param_groups.0.params=[embed.weight", "totals per dtype"):
        assert text in human.output, text
    assert "optimizer sharding" not in human.output
