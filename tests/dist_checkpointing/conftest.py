"""Fixtures shared by the dist_checkpointing tests."""

import pytest
import torch.distributed as dist


@pytest.fixture
def single_rank_group(tmp_path):
    """A one-rank gloo process group in this process, destroyed afterwards."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def release_async_staging():
    """Async saves keep a staging segment in a process-wide pool for the next save (released
    by ``AsyncCallsQueue.close()`` and at exit); tests that count this process's shared-memory
    files must not see the segment of an earlier test."""
    from ckpt_tool.dist_checkpointing._staging_pool import release_staging_memory

    release_staging_memory()
    yield
    release_staging_memory()
