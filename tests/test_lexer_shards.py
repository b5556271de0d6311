"""Lexer shards (rapidserve/structured/lexers.py): a popular constraint gets more independent compiles,
in the background, up to the limit; copies spread over them round robin; a failed compile stops growth."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest

from rapidserve.sampling_params import SamplingParams, StructuredOutputs
from rapidserve.structured.lexers import LexerShards


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


def make(limit: int, per_shard: int, fail_from: int | None = None) -> tuple[LexerShards, ManualPool, list[int]]:
    pool, made = ManualPool(), [0]

    def compile_one() -> Compiled:
        made[0] += 1
        if fail_from is not None and made[0] >= fail_from:
            raise RuntimeError("out of memory")
        return Compiled(made[0])

    return LexerShards(Compiled(0), compile_one, pool, limit=limit, per_shard=per_shard), pool, made


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
