"""The disagg prefill worker's staging-block allocator (rapidserve/parallel/staging.py): a table of cases."""

from __future__ import annotations

from typing import Any

import pytest

from rapidserve.parallel.staging import StagingAllocator

# Each case: the pool's size, then steps, each ("alloc", owner, n, expected blocks or None) or
# ("free", owner, expected count), then the free-block count at the end.
CASES: dict[str, tuple[int, list[tuple[Any, ...]], int]] = {
    "lowest blocks first": (8, [("alloc", "a", 3, [0, 1, 2]), ("alloc", "b", 2, [3, 4])], 3),
    "exactly all, then exhausted": (4, [("alloc", "a", 4, [0, 1, 2, 3]), ("alloc", "b", 1, None)], 0),
    "exhaustion takes nothing": (5, [("alloc", "a", 3, [0, 1, 2]), ("alloc", "b", 3, None),
                                     ("alloc", "c", 2, [3, 4])], 0),
    "larger than the pool": (4, [("alloc", "a", 5, None)], 4),
    "zero blocks": (2, [("alloc", "a", 0, []), ("free", "a", 0)], 2),
    "free returns the blocks, reused lowest first": (6, [("alloc", "a", 2, [0, 1]), ("alloc", "b", 3, [2, 3, 4]),
                                                         ("free", "a", 2), ("alloc", "c", 3, [0, 1, 5])], 0),
    "free twice": (4, [("alloc", "a", 2, [0, 1]), ("free", "a", 2), ("free", "a", 0)], 4),
    "free of an unknown owner": (4, [("alloc", "a", 1, [0]), ("free", "zz", 0)], 3),
    # a failed allocation leaves no holding behind: freeing the owner returns nothing, and it may try again
    "free after a failed allocation": (3, [("alloc", "a", 2, [0, 1]), ("alloc", "b", 2, None), ("free", "b", 0),
                                           ("free", "a", 2), ("alloc", "b", 2, [0, 1])], 1),
    "exhausted, then room once freed": (3, [("alloc", "a", 3, [0, 1, 2]), ("alloc", "b", 1, None),
                                            ("free", "a", 3), ("alloc", "b", 1, [0])], 2),
    "an owner allocates again after its free": (2, [("alloc", "a", 2, [0, 1]), ("free", "a", 2),
                                                    ("alloc", "a", 1, [0])], 1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_staging_allocator(name: str) -> None:
    size, steps, free_at_end = CASES[name]
    a = StagingAllocator(size)
    for step in steps:
        if step[0] == "alloc":
            _, owner, n, want = step
            before = a.num_free
            assert a.allocate(owner, n) == want, step
            if want is None:
                assert a.num_free == before and a.held(owner) is None, step  # nothing taken
            else:
                assert a.held(owner) == want
        else:
            _, owner, want = step
            assert a.free(owner) == want, step
            assert a.held(owner) is None
    assert a.num_free == free_at_end
    assert a.in_use == size - free_at_end
    assert sum(len(a.held(o) or []) for o in a.owners()) == a.in_use  # every block in use has one owner
    held = [b for o in a.owners() for b in a.held(o) or []]
    assert len(held) == len(set(held))  # and no block is held twice


def test_misuse_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        StagingAllocator(0)
    a = StagingAllocator(4)
    assert a.allocate("a", 1) == [0]
    with pytest.raises(ValueError, match="already holds"):
        a.allocate("a", 1)  # a job holds one allocation at a time
    with pytest.raises(ValueError, match="cannot allocate"):
        a.allocate("b", -1)
    assert a.fits(4) and not a.fits(5) and a.num_free == 3
