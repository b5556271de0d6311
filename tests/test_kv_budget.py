"""runner/kv_budget.py: the GPU KV pool's budget (total x utilization - this engine's use - max(step peak, logits
floor) per step-running process, at most what is free), and its log line naming each term."""

from __future__ import annotations

import pytest

from rapidserve.runner.kv_budget import GIB, KVBudget

G = int(GIB)


@pytest.mark.parametrize(("budget", "kv", "outside"), [
    # 0.8 x 140 GiB - 70 in use - a 3-GiB step peak over a 1-GiB logits floor
    (KVBudget(140 * G, 0.8, 70 * G, 68 * G, 69 * G, 8192, 3 * G, 1 * G), int(140 * G * 0.8) - 70 * G - 3 * G, 1 * G),
    # the logits floor above the step's peak is what is kept
    (KVBudget(80 * G, 0.9, 20 * G, 19 * G, 19 * G, 2048, G // 2, 2 * G), int(80 * G * 0.9) - 20 * G - 2 * G, 1 * G),
    # nothing outside torch: the allocator holds all that is in use
    (KVBudget(24 * G, 0.5, 10 * G, 9 * G, 10 * G, 512, G, 0), int(24 * G * 0.5) - 10 * G - G, 0),
    # over-committed: negative, for num_blocks_for_budget to refuse by name
    (KVBudget(16 * G, 0.5, 10 * G, 10 * G, 10 * G, 8192, G, 0), int(16 * G * 0.5) - 10 * G - G, 0),
])
def test_budget_terms(budget: KVBudget, kv: int, outside: int) -> None:
    assert budget.kv_bytes == kv
    assert budget.outside_torch == outside


def test_describe_names_each_term_in_gib() -> None:
    b = KVBudget(140 * G, 0.8, 70 * G, 68 * G, 69 * G, 8192, 3 * G, 1 * G)
    line = b.describe()
    assert line.startswith("KV budget 39.00 GiB = 0.8 x 140.00 GiB - this engine's use 70.00")
    assert "this process's tensors 68.00" in line and "unused cache 1.00" in line and "outside torch 1.00" in line
    assert "activation peak of a 8192-token step 3.00" in line and "floor" not in line
    floor = KVBudget(80 * G, 0.9, 20 * G, 19 * G, 19 * G, 2048, G // 2, 2 * G).describe()
    assert "activation peak of a 2048-token step 0.50 (under the decode logits floor 2.00, which is kept)" in floor
    assert KVBudget(16 * G, 0.5, 10 * G, 10 * G, 10 * G, 8192, G, 0).describe().startswith("KV budget 0.00 GiB")


def test_a_step_that_fit_in_the_unused_cache_is_charged_what_it_reserved() -> None:
    """The step's activations reused 2 GiB of the allocator's unused cache (already counted in use) and reserved
    1 GiB more: the budget keeps 1 GiB for steps, not the 3 GiB its tensors peaked at, and the log says why."""
    b = KVBudget(140 * G, 0.8, 72 * G, 68 * G, 71 * G, 8192, 1 * G, G // 2, step_allocated=3 * G)
    assert b.reserved_for_steps == 1 * G
    assert b.kv_bytes == int(140 * G * 0.8) - 72 * G - 1 * G
    assert "step 1.00 (its tensors peaked at 3.00; the rest fit in the unused cache)" in b.describe()
    assert "peaked" not in KVBudget(140 * G, 0.8, 70 * G, 68 * G, 69 * G, 8192, 3 * G, 1 * G, 3 * G).describe()


def test_memory_other_processes_held_at_start_is_not_charged_to_the_share() -> None:
    """vLLM's per-instance share: a second engine at 0.45 beside one holding 64 GiB gets its own 0.45, not 0.45 less
    the other's 64 GiB (which left it nothing)."""
    b = KVBudget(140 * G, 0.45, 64 * G + 20 * G, 19 * G, 19 * G + G // 2, 8192, 1 * G, G // 2,
                 baseline_used=64 * G)
    assert b.engine_used == 20 * G  # its tensors, unused cache and 0.5 GiB outside torch
    assert b.outside_torch == G // 2
    assert not b.short_of_share
    assert b.kv_bytes == int(140 * G * 0.45) - 20 * G - 1 * G
    assert "not charged: 64.00 in use before it started" in b.describe()
    # the baseline never makes this process's own allocator's segments uncharged
    assert KVBudget(140 * G, 0.45, 10 * G, 19 * G, 19 * G, 8192, G, 0, baseline_used=5 * G).engine_used == 19 * G


def test_an_earlier_engine_in_the_same_process_is_not_charged_to_the_share() -> None:
    """A second `LLM` in one process: the allocator already held the first's 40 GiB when the second runner started;
    the second is charged only what its allocator holds beyond that (before: the first's 40 GiB too, so 0 blocks)."""
    b = KVBudget(140 * G, 0.3, 5 * G + 40 * G + 3 * G, 40 * G + 2 * G, 40 * G + 3 * G, 2048, G // 2, G // 4,
                 baseline_used=5 * G + 40 * G, baseline_reserved=40 * G)
    assert b.engine_used == 3 * G
    assert b.outside_torch == 0
    assert b.kv_bytes == int(140 * G * 0.3) - 3 * G - G // 2
    assert "40.00 its allocator held: an earlier engine's" in b.describe()
    # without a baseline the whole allocator is this engine's, as before
    alone = KVBudget(140 * G, 0.3, 48 * G, 42 * G, 43 * G, 2048, G // 2, G // 4, baseline_used=5 * G)
    assert alone.engine_used == 43 * G


def test_a_gpu_with_less_free_than_the_share_gets_what_is_free_and_says_so() -> None:
    """Other processes hold 80 of 140 GiB and this engine asks for 0.9: the share would leave 104 GiB of KV, the device
    has 140 - 80 - 20 in use - 1 for steps = 39."""
    b = KVBudget(140 * G, 0.9, 100 * G, 19 * G, 19 * G, 8192, 1 * G, 0, baseline_used=80 * G)
    assert b.short_of_share
    assert b.kv_bytes == 39 * G
    line = b.describe()
    assert line.startswith("KV budget 39.00 GiB")
    assert "less free than that share: the pool gets what is free, 39.00 GiB (lower --gpu-memory-utilization" in line


@pytest.mark.parametrize(("processes", "peak", "floor", "reserve"), [
    (1, 3 * G, 1 * G, 3 * G),  # the hybrid worker, LLM: its own step
    (2, 3 * G, 1 * G, 6 * G),  # rapid mode: the prefill worker's allocator keeps its own 3-GiB peak
    (2, G // 2, 2 * G, 2 * G + G // 2),  # the decode logits floor is this process's; the peer's is its step peak
])
def test_each_process_running_full_steps_keeps_its_peak(processes: int, peak: int, floor: int, reserve: int) -> None:
    b = KVBudget(140 * G, 0.8, 70 * G, 68 * G, 69 * G, 8192, peak, floor, step_processes=processes)
    assert b.reserved_for_steps == reserve
    assert b.kv_bytes == int(140 * G * 0.8) - 70 * G - reserve
    assert ("1 more for the prefill worker's steps" in b.describe()) == (processes == 2)
