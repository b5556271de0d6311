"""The GPU KV pool's budget on a real GPU (runner/kv_budget.py): the share is this engine's, as vLLM's is its
instance's. Each test forces its situation: a second runner built while a first holds its share; a share larger
than what is free; a second step-running process. A 2-layer Qwen3-8B shape, sized from the share."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch
from preset_runners import preset_runner

from rapidserve.runner import ModelRunner

pytestmark = pytest.mark.gpu

TOKENS = 2048  # the profiled step


def runner(util: float, step_processes: int = 1) -> ModelRunner:
    return preset_runner("qwen3-8b", 2, ctx=4096, graph_batches=(), max_num_seqs=64, max_num_batched_tokens=TOKENS,
                         num_blocks=None, gpu_memory_utilization=util, step_processes=step_processes)


def pool_bytes(r: ModelRunner) -> int:
    return r.kv_pool.tensor.numel() * r.kv_pool.tensor.element_size()


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA or ROCm GPU")
    gc.collect()
    torch.cuda.empty_cache()
    yield
    gc.collect()
    torch.cuda.empty_cache()


def test_a_second_engine_beside_a_first_gets_its_own_share() -> None:
    """Two at 0.3 each: the second is not charged the first's memory (before: 0.3 less the first's 0.3, refused)."""
    first = runner(0.3)
    second = runner(0.3)
    b1, b2 = first.kv_budget, second.kv_budget
    assert b1 is not None and b2 is not None
    assert b2.baseline_used >= pool_bytes(first)  # the first's pool was in use when the second started
    assert not b2.short_of_share
    assert abs(pool_bytes(second) - pool_bytes(first)) <= 0.03 * pool_bytes(first)
    total = torch.cuda.mem_get_info()[1]
    assert pool_bytes(second) <= 0.3 * total
    del first, second


def test_a_share_larger_than_what_is_free_gets_what_is_free() -> None:
    """A first runner holds 0.55 of the GPU; a second asks for 0.55 too: it gets what is free, less its step."""
    first = runner(0.55)
    free_before = torch.cuda.mem_get_info()[0]
    second = runner(0.55)
    b = second.kv_budget
    assert b is not None and b.short_of_share
    assert 0 < pool_bytes(second) <= free_before
    assert pool_bytes(second) < pool_bytes(first)
    assert "less free than that share" in b.describe()
    del first, second


def test_a_second_step_running_process_keeps_its_step_peak() -> None:
    """Rapid mode's decode worker (2 processes run full steps) keeps one more step peak than the hybrid worker."""
    one = runner(0.3, step_processes=1)
    b1, p1 = one.kv_budget, pool_bytes(one)
    del one
    gc.collect()
    torch.cuda.empty_cache()
    two = runner(0.3, step_processes=2)
    b2, p2 = two.kv_budget, pool_bytes(two)
    assert b1 is not None and b2 is not None
    assert b2.step_peak > 0
    per_block = p2 // two.kv_pool.num_blocks
    assert abs((p1 - p2) - b2.step_peak) <= 0.1 * b2.step_peak + 2 * per_block
    del two
