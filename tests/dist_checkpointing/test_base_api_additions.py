"""Module-level names Megatron-Core offers: ``strategies.base.async_calls``, the ``debug_time``
timings of async finalization and shard exchange, ``validation``'s strategy re-exports."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from ckpt_tool.dist_checkpointing import exchange_utils, validation
from ckpt_tool.dist_checkpointing.strategies import async_utils, base


def test_module_queue_exists_and_starts_no_process():
    code = ("import multiprocessing as mp\n"
            "from ckpt_tool.dist_checkpointing.strategies import base\n"
            "q = base.async_calls\n"
            "assert type(q).__name__ == 'AsyncCallsQueue' and not q.persistent\n"
            "assert q.persistent_caller is None and q.get_num_unfinalized_calls() == 0\n"
            "assert mp.active_children() == []\n"
            "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.strip() == "ok", done.stderr[-2000:]
    assert isinstance(base.async_calls, async_utils.AsyncCallsQueue)


def test_finalize_is_timed(caplog):
    calls = []
    queue = async_utils.AsyncCallsQueue()
    queue.schedule_async_request(async_utils.AsyncRequest(None, (), [lambda: calls.append(1)]))
    with caplog.at_level(logging.DEBUG, logger=async_utils.logger.name):
        assert queue.maybe_finalize_async_calls(blocking=True, no_dist=True) == [0]
    assert calls == [1]
    assert any(r.getMessage().startswith("finalize took ") for r in caplog.records)


@pytest.mark.parametrize("algo", ["broadcast", "gather_rounds"])
def test_exchange_is_timed(caplog, single_rank_group, algo):
    nothing = exchange_utils.ShardDistribution({}, set(), {}, {})
    with caplog.at_level(logging.DEBUG, logger=exchange_utils.logger.name):
        assert exchange_utils.exchange_by_distribution({}, {}, nothing, None, algo) == {}
    assert any(r.getMessage().startswith(f"exchange_loaded_tensors_{algo} took ")
               for r in caplog.records)


def test_validation_offers_the_strategy_names():
    for name in ("LoadCommonStrategy", "LoadShardedStrategy", "SaveCommonStrategy",
                 "SaveShardedStrategy", "StrategyAction", "get_default_strategy"):
        assert getattr(validation, name) is getattr(base, name)
    assert validation.is_main_replica((0, 0)) and not validation.is_main_replica(1)
