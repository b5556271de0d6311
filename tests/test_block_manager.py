"""The block manager and its prefix cache (rapidserve/block_manager.py): reference counts, hits, the
one-token-left rule, commits only of written blocks, eviction order, and the accounting invariant."""

from __future__ import annotations

import pytest

from rapidserve.block_manager import BlockManager, BlockManagerError, block_hash

BS = 4


def bm(n: int = 16, caching: bool = True, watermark: float = 0.0, salt: bytes = b"m") -> BlockManager:
    return BlockManager(n, BS, watermark=watermark, enable_caching=caching, salt=salt)


def run(b: BlockManager, sid: str, tokens: list[int]) -> tuple[list[int], int]:
    """Admit, compute every token (commit), and finish: blocks stay registered on the free list."""
    table, cached = b.allocate_cached(sid, tokens)
    b.commit(sid, tokens, len(tokens))
    b.free(sid)
    b.check()
    return table, cached


P = list(range(100, 112))  # 12 tokens: 3 full blocks


@pytest.mark.parametrize("second, cached", [
    (P, 8),  # identical: every full block but the last, which must be computed for the logits
    (P + [7], 12),  # one token more: all 3 blocks hit
    (P[:8] + [1, 2, 3, 4], 8),  # shares 2 blocks
    (P[:6] + [1, 2, 3, 4, 5, 6], 4),  # shares 1 full block and half of the next: 1 block
    ([9] + P[1:], 0),  # differs in the first token: the chain breaks at once
    (P[:3], 0),  # shorter than a block
    (P[:5], 4),
])
def test_hits(second: list[int], cached: int) -> None:
    b = bm()
    first, _ = run(b, "a", P)
    table, got = b.allocate_cached("b", second)
    assert got == cached
    assert table[: cached // BS] == first[: cached // BS]  # the shared blocks are the same physical blocks
    assert len(table) == -(-len(second) // BS)
    assert b.queries == len(P) + len(second) and b.hits == cached
    b.check()


def test_shared_blocks_are_counted_and_survive_one_user() -> None:
    b = bm()
    ta, _ = b.allocate_cached("a", P + [1])
    b.commit("a", P + [1], 12)
    tb, cached = b.allocate_cached("b", P + [2])
    assert cached == 12 and tb[:3] == ta[:3] and tb[3] != ta[3]
    assert b._ref[ta[0]] == 2
    b.free("a")
    assert b._ref[ta[0]] == 1 and ta[0] not in b._free and ta[3] in b._free
    b.free("b")
    assert all(r == 0 for r in b._ref) and b.num_free == b.num_blocks
    b.check()


def test_nothing_is_shared_before_it_is_committed() -> None:
    b = bm()
    b.allocate_cached("a", P + [1])  # being computed: not registered
    _, cached = b.allocate_cached("b", P + [1])
    assert cached == 0
    b.commit("a", P + [1], 8)  # two blocks written so far
    _, cached = b.allocate_cached("c", P + [1])
    assert cached == 8
    b.check()


def test_commit_counts_only_full_written_blocks() -> None:
    b = bm()
    t, _ = b.allocate_cached("a", P)
    b.commit("a", P, 7)  # 7 tokens written: 1 full block
    assert b.num_cached_blocks == 1
    b.commit("a", P, 11)
    assert b.num_cached_blocks == 2
    b.commit("a", P, 12)
    assert b.num_cached_blocks == 3 and b._hash_of[t[2]] == block_hash(block_hash(block_hash(b"m", P[:4]), P[4:8]),
                                                                       P[8:])


def test_duplicate_content_keeps_the_first_block() -> None:
    b = bm()
    ta, _ = b.allocate_cached("a", P + [1])
    tb, _ = b.allocate_cached("b", P + [2])  # same prefix computed twice at once: no hit yet
    b.commit("a", P + [1], 12)
    b.commit("b", P + [2], 12)
    assert b.num_cached_blocks == 3 and all(x in b._hash_of for x in ta[:3]) and not any(x in b._hash_of
                                                                                         for x in tb)
    b.free("b")
    assert all(x in b._free for x in tb) and list(b._free)[: len(tb)] == sorted(tb, key=list(b._free).index)
    b.check()


def test_eviction_takes_unregistered_blocks_first_then_the_least_recently_freed() -> None:
    b = bm(n=9)
    x, _ = run(b, "x", [1, 1, 1, 1, 1, 1, 1, 1])  # 2 blocks registered, freed first
    y, _ = run(b, "y", [2, 2, 2, 2, 2, 2, 2, 2])  # 2 blocks registered, freed later
    assert b.num_free == 9 and b.num_cached_blocks == 4
    fresh, _ = b.allocate_cached("f", [9] * 17)  # 5 blocks: the 5 never-registered ones first
    assert set(fresh).isdisjoint(x + y) and b.num_cached_blocks == 4
    g, _ = b.allocate_cached("g", [8] * 4)  # 1 more: x's tail (x was freed first; a prefix's tail goes first)
    assert g == [x[1]] and b.num_cached_blocks == 3
    h, cached = b.allocate_cached("h", [2] * 8 + [3])  # y is still cached (2 hits off the free list) + x[0]
    assert cached == 8 and h == [y[0], y[1], x[0]] and b.num_free == 0 and b.num_cached_blocks == 2
    b.check()


def test_a_hit_on_a_free_cached_block_takes_it_off_the_free_list() -> None:
    b = bm(n=4)
    t, _ = run(b, "a", P)
    assert b.num_free == 4
    assert b.can_admit(13, alone=False, seq_id="b", token_ids=P + [5])  # 4 blocks, 3 of them the cached ones
    table, cached = b.allocate_cached("b", P + [5])
    assert cached == 12 and table[:3] == t and b.num_free == 0
    b.check()


@pytest.mark.parametrize("in_use, want", [(True, True), (False, False)])
def test_hits_in_use_cost_nothing_at_admission(in_use: bool, want: bool) -> None:
    b = bm(n=5)
    b.allocate_cached("a", P + [1])
    b.commit("a", P + [1], 12)  # a holds 4 blocks, 3 registered; 1 free
    if not in_use:
        b.free("a")
        b.allocate("z", 16)  # the free cached blocks get evicted by this: 4 taken, 1 free
    # b needs 4 blocks; with a's 3 in use it needs 1 fresh one, which is free
    assert b.can_admit(13, alone=False, seq_id="b", token_ids=P + [2]) is want


def test_caching_off() -> None:
    b = bm(caching=False)
    run(b, "a", P)
    _, cached = b.allocate_cached("b", P + [1])
    assert cached == 0 and b.num_cached_blocks == 0 and b.queries == 0 and b.hits == 0


def test_the_salt_separates_models() -> None:
    b = bm(salt=b"model-a")
    run(b, "a", P)
    b.salt = b"model-b"
    _, cached = b.allocate_cached("b", P + [1])
    assert cached == 0


def test_reset_cache_forgets_unused_blocks_only() -> None:
    b = bm()
    run(b, "a", P)
    b.allocate_cached("b", [5] * 9)
    b.commit("b", [5] * 9, 8)
    b.reset_cache()
    assert b.num_cached_blocks == 2  # b's, in use
    b.check()


def test_allocation_errors() -> None:
    b = bm(n=2)
    b.allocate_cached("a", [1, 2, 3])
    with pytest.raises(BlockManagerError, match="already holds"):
        b.allocate_cached("a", [1])
    with pytest.raises(BlockManagerError, match="fresh blocks"):
        b.allocate_cached("b", list(range(9)))
    b.check()


def test_check_catches_broken_accounting() -> None:
    b = bm()
    b.allocate("a", 8)
    b._ref[0] += 1
    with pytest.raises(BlockManagerError, match="reference count"):
        b.check()


# ---- pending blocks: what a sequence in flight is writing now (`pending_prefix`) ------------------------------
Q = P + [1]  # 13 tokens: 3 full blocks, then one token


def scene_nothing(b: BlockManager) -> None:
    pass


def scene_a_writing(b: BlockManager) -> None:
    b.allocate_cached("a", Q)


def scene_a_wrote_two(b: BlockManager) -> None:
    b.allocate_cached("a", Q)
    b.commit("a", Q, 8)


def scene_a_done(b: BlockManager) -> None:
    b.allocate_cached("a", Q)
    b.commit("a", Q, len(Q))


def scene_a_aborted(b: BlockManager) -> None:
    b.allocate_cached("a", Q)
    b.free("a")


def scene_a_writes_after_a_hit(b: BlockManager) -> None:
    run(b, "c", P[:4] + [5])  # the first block is registered
    b.allocate_cached("a", Q)  # a hits it, writes the other two


def scene_another_wrote_the_same(b: BlockManager) -> None:
    b.allocate_cached("a", Q)
    b.allocate_cached("c", Q)  # a duplicate writer: a holds the pending blocks
    b.commit("c", Q, len(Q))  # c landed first: the content is registered, a's pending blocks are gone


PENDING = [  # (scene, the new sequence's tokens, its pending prefix, its cached prefix)
    ("nothing in flight", scene_nothing, Q, 0, 0),
    ("the same prompt being written", scene_a_writing, Q, 12, 0),
    ("the same prompt exactly: one token is left to compute", scene_a_writing, P, 8, 0),
    ("two blocks shared, then other tokens", scene_a_writing, P[:8] + [7, 7, 7, 7, 7], 8, 0),
    ("a different first token", scene_a_writing, [9] + Q[1:], 0, 0),
    ("shorter than a block", scene_a_writing, P[:3], 0, 0),
    ("two blocks landed, one in flight", scene_a_wrote_two, Q, 4, 8),
    ("all landed: cached, nothing pending", scene_a_done, Q, 0, 12),
    ("the writer was freed before writing", scene_a_aborted, Q, 0, 0),
    ("pending after the cached prefix", scene_a_writes_after_a_hit, Q, 8, 4),
    ("a duplicate writer landed first", scene_another_wrote_the_same, Q, 0, 12),
]


@pytest.mark.parametrize("name,scene,tokens,pending,cached", PENDING, ids=[c[0] for c in PENDING])
def test_pending_prefix(name: str, scene: object, tokens: list[int], pending: int, cached: int) -> None:
    b = bm()
    scene(b)  # type: ignore[operator]
    b.check()
    assert b.pending_prefix("b", tokens) == pending
    assert b.cached_prefix("b", tokens) == cached
    _, got = b.allocate_cached("b", tokens)
    assert got == cached  # pending blocks are never shared: only registered ones
    b.check()


def test_a_sequences_own_pending_blocks_do_not_count_and_leave_with_it() -> None:
    b = bm()
    b.allocate_cached("a", Q)
    assert b.pending_prefix("a", Q) == 0
    assert b.pending_prefix("b", Q) == 12
    b.allocate_cached("b", Q)  # a second writer of the same content adds no pending blocks of its own
    b.free("a")
    assert b.pending_prefix("c", Q) == 0 and not b._pending
    b.check()
    b.free("b")
    assert not b._pending and not b._pending_of
    b.check()


def test_caching_off_has_no_pending_blocks() -> None:
    b = bm(caching=False)
    b.allocate_cached("a", Q)
    assert b.pending_prefix("b", Q) == 0 and not b._pending


def test_check_catches_a_stale_pending_block() -> None:
    b = bm()
    b.allocate_cached("a", Q)
    b._pending_of.pop("a")
    with pytest.raises(BlockManagerError, match="pending"):
        b.check()


@pytest.mark.parametrize(("have", "new_len", "free", "grown"), [
    (2, 8, 3, True),  # covered already: nothing taken, whatever is free
    (2, 8, 0, True),
    (2, 9, 1, True),  # one block more
    (2, 13, 2, True),  # two more, exactly what is free
    (2, 13, 1, False),  # two more, one free: nothing changes
    (2, 9, 0, False),
])
def test_try_grow_is_can_grow_then_grow(have: int, new_len: int, free: int, grown: bool) -> None:
    """`try_grow` grows exactly as `can_grow` then `grow` would (the same blocks, in order), or changes nothing."""
    tables = []
    for tried in (True, False):
        b = bm(n=have + free + 2)
        b.allocate("a", have * BS)
        b.allocate("x", 2 * BS)  # two blocks held elsewhere, so the free list is `free` long
        assert b.num_free == free
        if tried:
            assert b.try_grow("a", new_len) is grown
        else:
            assert b.can_grow("a", new_len) is grown
            if grown:
                b.grow("a", new_len)
        b.check()
        tables.append((list(b.table("a")), b.num_free))
    assert tables[0] == tables[1] and (len(tables[0][0]) * BS >= new_len) == grown
