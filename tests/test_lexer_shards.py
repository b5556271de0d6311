"""Lexer shards (rapidserve/structured/lexers.py): a popular constraint gets more independent compiles,
in the background, up to the limit; copies spread over them round robin; a failed compile stops growth."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest

from rapidserve.sampling_params import SamplingParams, StructuredOutputs
from rapidserve.structured.grammars import GrammarCache
from rapidserve.structured.lexers import LexerShards, ShardBudget


class Compiled:
    def __init__(self, n: int) -> None:
        self.n = n

    def deep_copy(self) -> tuple[str, int]:
        return ("copy of", self.n)


class ManualPool:
    """Holds submitted calls until `run_all` (a compile "in the background" that has not run yet)."""

    def __init__(self) -> None:
        self.queued: list[Callable[[], Any]] = []

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        self.queued.append(fn)
        f: Future[Any] = Future()
        return f

    def run_all(self) -> None:
        todo, self.queued = self.queued, []
        for fn in todo:
            fn()


def make(limit: int, per_shard: int, fail_from: int | None = None, budget: ShardBudget | None = None,
         pool: ManualPool | None = None) -> tuple[LexerShards, ManualPool, list[int]]:
    pool, made = pool or ManualPool(), [0]

    def compile_one() -> Compiled:
        made[0] += 1
        if fail_from is not None and made[0] >= fail_from:
            raise RuntimeError("out of memory")
        return Compiled(made[0])

    return LexerShards(Compiled(0), compile_one, pool, limit=limit, per_shard=per_shard, budget=budget), pool, made


@pytest.mark.parametrize(
    ("limit", "per_shard", "copies", "shards_after"),
    [
        (1, 4, 100, 1),  # limit 1: never grows (one compile, as before the shards)
        (4, 4, 3, 1),  # fewer copies than one shard's worth: a one-off constraint costs nothing more
        (4, 4, 4, 2),  # the 4th copy asks for a second compile
        (4, 4, 8, 3),
        (4, 4, 100, 4),  # capped at the limit
        (8, 16, 128, 8),  # the H100 bench: 128 rows of one schema, 8 fill threads
        (12, 16, 128, 9),  # the 128th copy asks for the 9th
    ],
)
def test_shards_grow_with_the_copies_made_up_to_the_limit(limit: int, per_shard: int, copies: int,
                                                          shards_after: int) -> None:
    sh, pool, _ = make(limit, per_shard)
    for _ in range(copies):
        sh.deep_copy()
        pool.run_all()  # each compile ends before the next copy
    assert len(sh.shards) == shards_after


def test_a_copy_never_waits_for_a_compile_and_compiles_under_way_count_as_shards() -> None:
    sh, pool, made = make(limit=4, per_shard=2)
    got = [sh.deep_copy() for _ in range(5)]  # nothing has compiled yet
    assert got == [("copy of", 0)] * 5  # every copy from the one compile there is
    assert made == [0] and len(pool.queued) == 2  # asked at the 2nd and 4th copies: one per 2 copies
    got = [sh.deep_copy() for _ in range(20)]
    assert len(pool.queued) == 3  # never past the limit, compiled or not
    pool.run_all()
    assert len(sh.shards) == 4
    got = [sh.deep_copy() for _ in range(8)]
    assert sorted({n for _, n in got}) == [0, 1, 2, 3]  # round robin over all of them
    assert not pool.queued


def test_round_robin_spreads_copies_evenly_over_the_shards() -> None:
    sh, pool, _ = make(limit=4, per_shard=1)
    for _ in range(8):
        sh.deep_copy()
        pool.run_all()
    assert len(sh.shards) == 4
    counts = [0] * 4
    for _ in range(400):
        counts[sh.deep_copy()[1]] += 1
    assert counts == [100] * 4


def test_a_failed_compile_stops_the_growth_and_the_shards_keep_serving() -> None:
    sh, pool, made = make(limit=8, per_shard=1, fail_from=2)
    for _ in range(20):
        sh.deep_copy()
        pool.run_all()
    assert len(sh.shards) == 2 and made == [2]  # the second extra compile failed; none was tried again
    assert sh.limit == 2
    assert {sh.deep_copy()[1] for _ in range(4)} == {0, 1}


def test_without_a_compiler_or_pool_it_is_one_compile() -> None:
    sh = LexerShards(Compiled(0), limit=8, per_shard=1)
    assert [sh.deep_copy() for _ in range(5)] == [("copy of", 0)] * 5 and len(sh.shards) == 1


def test_one_budget_bounds_the_extra_compiles_of_every_constraint() -> None:
    budget, pool = ShardBudget(5), ManualPool()
    a, _, _ = make(limit=4, per_shard=1, budget=budget, pool=pool)
    b, _, _ = make(limit=4, per_shard=1, budget=budget, pool=pool)
    for _ in range(10):
        a.deep_copy()
        pool.run_all()
    assert len(a.shards) == 4 and budget.used == 3  # its limit: 3 extra
    for _ in range(10):
        b.deep_copy()
        pool.run_all()
    assert len(b.shards) == 3 and budget.used == 5  # the budget's last 2
    a.release()  # a left the cache: its 3 go back, and b may grow again
    assert budget.used == 2
    b.deep_copy()
    pool.run_all()
    assert len(b.shards) == 4 and budget.used == 3
    a.release()  # twice: nothing more
    assert budget.used == 3


def test_a_compile_that_ends_after_release_is_not_kept_and_gives_its_share_back() -> None:
    budget = ShardBudget(4)
    sh, pool, _ = make(limit=4, per_shard=1, budget=budget)
    sh.deep_copy()  # asks for a second compile
    assert budget.used == 1 and len(pool.queued) == 1
    sh.release()
    assert budget.used == 1  # still compiling: its share comes back when it ends
    pool.run_all()
    assert budget.used == 0 and len(sh.shards) == 1
    for _ in range(5):  # released: never grows again
        sh.deep_copy()
    assert not pool.queued and sh.deep_copy() == ("copy of", 0)


def test_a_failed_compile_gives_its_share_back() -> None:
    budget = ShardBudget(4)
    sh, pool, _ = make(limit=4, per_shard=1, fail_from=1, budget=budget)
    sh.deep_copy()
    pool.run_all()
    assert budget.used == 0 and len(sh.shards) == 1


def test_the_grammar_cache_releases_what_it_evicts_or_replaces() -> None:
    evicted: list[str] = []
    made = iter(["a1", "b1", "c1", "a2"])
    cache = GrammarCache(lambda so: next(made), capacity=2, on_evict=evicted.append)
    from rapidserve.sampling_params import StructuredOutputs as SO

    cache.compile(SO(regex="a"))
    cache.compile(SO(regex="b"))
    assert evicted == []
    cache.compile(SO(regex="c"))  # over capacity: the least recent (a) goes
    assert evicted == ["a1"]
    cache.compile(SO(regex="a"))  # a again: compiled anew; b goes
    assert evicted == ["a1", "b1"]


@pytest.mark.parametrize(("limit", "per_shard"), [(0, 1), (1, 0)])
def test_bad_settings_are_refused(limit: int, per_shard: int) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        LexerShards(Compiled(0), limit=limit, per_shard=per_shard)


def test_a_real_grammar_book_spreads_a_popular_schema_over_compiles_and_masks_the_same() -> None:
    """llguidance, the embedded model's tokenizer: 40 requests of one JSON schema with 2 lexers; the
    second compile is made in the background, and every request's first mask equals the one-compile book's."""
    pytest.importorskip("llguidance")
    from rapidserve.loader import resolve_model
    from rapidserve.structured import GrammarBook
    from rapidserve.structured.matchers import GrammarRow
    from rapidserve.tokenizer import Tokenizer

    try:
        tok = Tokenizer.from_source(resolve_model(None))
    except Exception as e:  # noqa: BLE001 - no embedded model here
        pytest.skip(f"no embedded model: {e}")
    assert tok is not None
    so = StructuredOutputs(json='{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}')
    params = SamplingParams(structured_outputs=so, max_tokens=16)
    vocab = len(tok.hf)

    def masks(lexers: int) -> tuple[list[bytes], int]:
        book = GrammarBook(lambda: tok.hf, vocab, tuple(tok.eos_token_ids), threads=2, lexers=lexers)
        got = []
        for i in range(40):
            assert book.prepare(f"r{i}", so) or True
            while book.compiling():
                pass
            mask, failed = book.fill([GrammarRow(0, f"r{i}", params, [])], pin=False)
            assert not failed
            got.append(mask.words.numpy().tobytes())
        shards = book.cache.get(so)
        for _ in range(200):  # the background compile lands within a few seconds at most
            if len(shards.shards) >= lexers:
                break
            time.sleep(0.05)
        return got, len(shards.shards)

    one, n1 = masks(1)
    two, n2 = masks(2)
    assert n1 == 1 and n2 == 2
    assert one == two


def fake_book(monkeypatch: pytest.MonkeyPatch, matcher: Callable[[StructuredOutputs, str], Any], **kw: Any) -> Any:
    """A GrammarBook whose compiles are `matcher(so, text)` (no grammar engine or tokenizer needed)."""
    from rapidserve.structured import GrammarBook

    monkeypatch.setattr("rapidserve.structured.matchers.check", lambda so, tok: so.regex or "")
    book = GrammarBook(lambda: None, 100, (0,), threads=2, **kw)
    book._tokenizer = lambda: None  # type: ignore[method-assign]
    book._matcher = matcher  # type: ignore[method-assign]
    return book


def test_a_grammar_book_drops_an_evicted_constraints_extra_compiles_and_gives_them_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    book = fake_book(monkeypatch, lambda so, text: Compiled(0), cache_size=1, lexers=3)
    a = book.cache.compile(StructuredOutputs(regex="a"))
    assert isinstance(a, LexerShards) and a.limit == 3
    for _ in range(40):
        a.deep_copy()
    for _ in range(200):  # the shard pool's thread makes the extra compiles
        if len(a.shards) == 3:
            break
        time.sleep(0.01)
    assert len(a.shards) == 3 and book._shard_budget.used == 2
    book.cache.compile(StructuredOutputs(regex="b"))  # capacity 1: a is evicted
    assert book._shard_budget.used == 0 and len(a.shards) == 1  # dropped, and no longer handed out


def test_a_shard_compile_never_holds_up_the_compile_a_request_waits_for(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    gate, calls = threading.Event(), {"a": 0}

    def matcher(so: StructuredOutputs, text: str) -> Compiled:
        if text == "a":
            calls["a"] += 1
            if calls["a"] > 1:  # a's extra compiles: slow, until the test lets them go
                gate.wait(10)
        return Compiled(0)

    book = fake_book(monkeypatch, matcher, lexers=4)
    a = book.cache.compile(StructuredOutputs(regex="a"))
    for _ in range(64):  # popular: 3 extra compiles asked for, the first of them stuck
        a.deep_copy()
    try:
        assert not book.prepare("r1", StructuredOutputs(regex="b"))  # b compiles on the requests' pool
        deadline = time.monotonic() + 5
        while book.compiling() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert not book.compiling()  # ready while a's extra compile is still stuck
        assert len(a.shards) == 1
    finally:
        gate.set()


def test_a_pool_that_cannot_take_the_compile_stops_growth_and_gives_its_share_back() -> None:
    class Refusing:
        def submit(self, fn: Callable[[], Any]) -> Future[Any]:
            raise RuntimeError("can't start new thread")

    budget = ShardBudget(4)
    sh = LexerShards(Compiled(0), lambda: Compiled(1), Refusing(), limit=4, per_shard=1, budget=budget)
    assert sh.deep_copy() == ("copy of", 0)  # the copy is still made
    assert budget.used == 0 and sh.limit == 1
    sh.deep_copy()
    assert budget.used == 0
