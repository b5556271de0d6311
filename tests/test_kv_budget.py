"""runner/kv_budget.py: the GPU KV pool's budget, the same arithmetic the runner used inline before (total x
utilization - in use - max(step peak, logits floor)), and its log line naming each term."""

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
    assert line.startswith("KV budget 39.00 GiB = 0.8 x 140.00 GiB - in use 70.00")
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
