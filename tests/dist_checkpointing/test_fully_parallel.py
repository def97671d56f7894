"""Fully-parallel save/load wrappers: distribution planning, torchrun DP=2 runs, MCore interop.

The torchrun runs use the ``layouts`` model at tp1pp1 on 2 gloo ranks: both ranks hold replicas
of every tensor (pure data parallelism), so without the wrapper rank 0 would write everything.
"""

from __future__ import annotations

import json
import random
import re
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "_workers"))
import layouts  # noqa: E402
from launch import torchrun  # noqa: E402

from ckpt_tool import dist_checkpointing  # noqa: E402
from ckpt_tool.dist_checkpointing import ShardedObject, ShardedTensor, mapping  # noqa: E402
from ckpt_tool.dist_checkpointing.core import CheckpointingException  # noqa: E402
from ckpt_tool.dist_checkpointing.exchange_utils import (  # noqa: E402
    _shard_size,
    distribute_shards_to_ranks,
)
from ckpt_tool.dist_checkpointing.serialization import (  # noqa: E402
    get_default_save_sharded_strategy,
)
from ckpt_tool.dist_checkpointing.strategies.base import SaveShardedStrategy  # noqa: E402
from ckpt_tool.dist_checkpointing.strategies.fully_parallel import (  # noqa: E402
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from ckpt_tool.dist_checkpointing.strategies.torch import (  # noqa: E402
    TorchDistLoadShardedStrategy,
)
from ckpt_tool.dist_checkpointing.utils import _sharded_tensor_shard_id  # noqa: E402
from ckpt_tool.formats.containers.dcp.dcp_metadata import read_dcp_metadata  # noqa: E402

_FILE_RANK = re.compile(r"__(\d+)_\d+\.distcp$")


# ------------------------------------------------------------------ pure distribution function


def test_distribution_balances_bytes_by_hand():
    # a (one holder) goes first, to rank 1 (5 bytes); b (largest) to the emptier rank 0 (8);
    # c then d (equal size, by id) each to the emptier rank: 1 (7), then 1 again (9 > 8).
    shard_to_ranks = {"a": [1], "b": [0, 1], "c": [0, 1], "d": [0, 1]}
    sizes = {"a": 5, "b": 8, "c": 2, "d": 2}
    assert distribute_shards_to_ranks(shard_to_ranks, sizes, 2, set()) == {
        "a": 1, "b": 0, "c": 1, "d": 1}


def test_distribution_assigns_cross_group_loads_last():
    # "big" has its main replica elsewhere: planned after "small" although larger
    shard_to_ranks = {"big": [0, 1], "small": [0, 1]}
    sizes = {"big": 10, "small": 1}
    assert distribute_shards_to_ranks(shard_to_ranks, sizes, 2, {"big"}) == {
        "small": 0, "big": 1}
    assert distribute_shards_to_ranks(shard_to_ranks, sizes, 2, set()) == {
        "big": 0, "small": 1}


def _random_case(rng: random.Random):
    num_ranks = rng.randint(1, 6)
    shard_to_ranks, sizes = {}, {}
    for i in range(rng.randint(0, 40)):
        shard_id = (f"key{i % 7}", (i, 0), None if i % 3 else (0, i + 1))
        shard_to_ranks[shard_id] = rng.sample(range(num_ranks), rng.randint(1, num_ranks))
        sizes[shard_id] = rng.choice([4, 8, 8, 16, 100, 1000])  # many ties
    cross = {s for s in shard_to_ranks if rng.random() < 0.3}
    return shard_to_ranks, sizes, num_ranks, cross


@pytest.mark.interop
def test_distribution_equals_megatron_core():
    mexchange = pytest.importorskip("megatron.core.dist_checkpointing.exchange_utils")
    rng = random.Random(0)
    for _ in range(200):
        case = _random_case(rng)
        assert distribute_shards_to_ranks(*case) == mexchange.distribute_shards_to_ranks(*case)


def test_shard_size_counts_dtype_bytes():
    sh = ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4, dtype=torch.bfloat16), (0, 1, 2))
    assert _shard_size(sh) == 3 * 4 * 2


# ------------------------------------------------------------------ without a process group


def _small_state(value: float) -> dict:
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.full((4, 3), value)),
        "b": ShardedTensor.from_rank_offsets("b", torch.arange(5.0) + value),
        "obj": ShardedObject("obj", {"v": value}, (1,), (0,)),
        "iteration": 7,
    }


def test_single_process_wrappers_round_trip(tmp_path):
    base = get_default_save_sharded_strategy()
    dist_checkpointing.save(_small_state(2.0), tmp_path,
                            sharded_strategy=FullyParallelSaveStrategyWrapper(base))
    loader = FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy())
    loaded = dist_checkpointing.load(_small_state(0.0), tmp_path, sharded_strategy=loader)
    assert torch.equal(loaded["w"], torch.full((4, 3), 2.0))
    assert torch.equal(loaded["b"], torch.arange(5.0) + 2.0)
    assert loaded["obj"] == {"v": 2.0} and loaded["iteration"] == 7
    assert set(loader.load_tensors_metadata(tmp_path)) == {"w", "b"}


class _SyncOnly(SaveShardedStrategy):
    def save(self, sharded_state_dict, checkpoint_dir):
        raise AssertionError("not reached")


def test_async_save_needs_an_async_base_strategy(tmp_path):
    wrapper = FullyParallelSaveStrategyWrapper(_SyncOnly("torch_dist", 1))
    assert (wrapper.backend, wrapper.version) == ("torch_dist", 1)
    with pytest.raises(CheckpointingException, match="non-async"):
        wrapper.async_save(_small_state(1.0), tmp_path)


# ------------------------------------------------------------------ torchrun, DP=2, gloo


@pytest.fixture(scope="module")
def fp_run(tmp_path_factory):
    """Our fully-parallel save, then our fully-parallel load with every exchange algorithm
    (the worker checks the loaded values on both ranks)."""
    root = tmp_path_factory.mktemp("fp")
    torchrun("fp_worker.py", 2, "--lib", "ours", "--dir", str(root / "ckpt"),
             "--out", str(root), "--async-dir", str(root / "async_ckpt"))
    return root


def _chunk_files(ckpt: Path) -> dict:
    """{(key, chunk offsets): (data file, chunk bytes)} of every tensor chunk in .metadata."""
    md = read_dcp_metadata(ckpt)
    files = {(idx.fqn, tuple(idx.offset)): info.relative_path
             for idx, info in md.storage_data.items() if idx.offset is not None}
    out = {}
    for key, tmd in md.state_dict_metadata.items():
        if not hasattr(tmd, "chunks"):
            continue
        itemsize = torch.empty((), dtype=tmd.properties.dtype).element_size()
        for chunk in tmd.chunks:
            where = (key, tuple(chunk.offsets))
            out[where] = (files.pop(where), chunk.sizes.numel() * itemsize)
    assert not files, f"storage entries without a chunk: {files}"
    return out


def _file_rank(name: str) -> int:
    return int(_FILE_RANK.match(name).group(1))


def _expected_assignment() -> dict:
    """Our pure distribution applied to the layout's shards, both ranks holding all."""
    sd = layouts.build_sharded_state_dict(mapping, layouts.parse_layout("tp1pp1", 0, 2))
    shards = [v for v in dist_checkpointing.dict_utils.nested_values(sd)
              if isinstance(v, ShardedTensor)]
    ids = {_sharded_tensor_shard_id(sh): sh for sh in shards}
    plan = distribute_shards_to_ranks({i: [0, 1] for i in ids},
                                      {i: _shard_size(sh) for i, sh in ids.items()}, 2, set())
    return {(sh.key, tuple(sh.global_offset)): plan[i] for i, sh in ids.items()}


@pytest.mark.multiproc
def test_each_shard_written_once_balanced_over_ranks(fp_run):
    chunks = _chunk_files(fp_run / "ckpt")
    full = layouts.global_tensors()
    # every chunk of every tensor is stored exactly once and the chunks cover each tensor
    for key, tensor in full.items():
        stored = sum(size for (k, _), (_, size) in chunks.items() if k == key)
        assert stored == tensor.numel() * tensor.element_size(), key
    per_rank = defaultdict(int)
    for fname, size in chunks.values():
        per_rank[_file_rank(fname)] += size
    largest = max(size for _, size in chunks.values())
    assert set(per_rank) == {0, 1}
    assert abs(per_rank[0] - per_rank[1]) <= largest, dict(per_rank)
    # and exactly the greedy plan of distribute_shards_to_ranks
    assignment = {where: _file_rank(f) for where, (f, _) in chunks.items()}
    assert assignment == _expected_assignment()
    # the async save through the same wrapper (cached distribution) writes alike
    async_chunks = _chunk_files(fp_run / "async_ckpt")
    assert {where: _file_rank(f) for where, (f, _) in async_chunks.items()} == assignment


@pytest.mark.multiproc
def test_load_reads_each_file_on_one_rank(fp_run):
    data_files = {p.name for p in (fp_run / "ckpt").glob("*.distcp")}
    for algo in ("broadcast", "gather_rounds", "gather_object"):
        reads = [json.loads((fp_run / f"reads_{r}.json").read_text())[algo] for r in (0, 1)]
        for rank, files in enumerate(reads):
            assert files and all(_file_rank(f) == rank for f in files), (algo, rank, files)
        assert set(reads[0]) | set(reads[1]) == data_files, algo


@pytest.mark.multiproc
@pytest.mark.interop
def test_megatron_core_loads_it_and_distributes_alike(fp_run):
    pytest.importorskip("megatron.core")
    mcore_dir = fp_run / "mcore_fp"
    torchrun("fp_worker.py", 2, "--lib", "mcore", "--dir", str(fp_run / "ckpt"),
             "--mcore-dir", str(mcore_dir))
    ours = {w: _file_rank(f) for w, (f, _) in _chunk_files(fp_run / "ckpt").items()}
    theirs = {w: _file_rank(f) for w, (f, _) in _chunk_files(mcore_dir).items()}
    assert ours == theirs


@pytest.mark.multiproc
def test_tp2dp2_spread_within_each_dp_group(tmp_path):
    """4 ranks, TP2 x DP2, wrappers over the DP groups (and the world for loading); the
    worker checks every load on every rank."""
    ckpt = tmp_path / "ckpt"
    torchrun("fp_worker.py", 4, "--lib", "ours", "--tp2dp2", "--dir", str(ckpt))
    chunks = _chunk_files(ckpt)
    for key, tensor in layouts.global_tensors().items():
        stored = sum(size for (k, _), (_, size) in chunks.items() if k == key)
        assert stored == tensor.numel() * tensor.element_size(), key
    per_rank = defaultdict(int)
    for fname, size in chunks.values():
        per_rank[_file_rank(fname)] += size
    largest = max(size for _, size in chunks.values())
    assert set(per_rank) == {0, 1, 2, 3}
    for dp_group in ((0, 2), (1, 3)):  # rank = dp_rank * 2 + tp_rank
        a, b = (per_rank[r] for r in dp_group)
        assert abs(a - b) <= largest, dict(per_rank)


@pytest.mark.interop
@pytest.mark.parametrize("module", ["exchange_utils", "strategies.fully_parallel"])
def test_same_public_api_as_megatron_core(module):
    """Megatron-Core's public functions/classes of the module exist here with the same
    parameter names (methods of the classes included)."""
    import importlib
    import inspect

    theirs = pytest.importorskip(f"megatron.core.dist_checkpointing.{module}")
    ours = importlib.import_module(f"ckpt_tool.dist_checkpointing.{module}")
    wanted = [name for name, obj in vars(theirs).items()
              if not name.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
              and obj.__module__ == theirs.__name__]
    assert wanted
    for name in wanted:
        mine, other = getattr(ours, name), getattr(theirs, name)
        assert getattr(mine, "_fields", None) == getattr(other, "_fields", None), name
        pairs = [(name, mine, other)]
        if inspect.isclass(other):
            pairs += [(f"{name}.{m}", getattr(mine, m), f) for m, f in vars(other).items()
                      if inspect.isfunction(f) and (not m.startswith("_") or m == "__init__")]
        for label, a, b in pairs:
            if callable(b) and not isinstance(b, type) or label.endswith("__init__"):
                assert list(inspect.signature(a).parameters) == \
                    list(inspect.signature(b).parameters), label
