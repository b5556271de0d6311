"""The structured-outputs host path per step (rapidserve/structured, bench/structured_host_overhead.py): the
inline advance of matchers one token behind gives the masks a replay from scratch gives, in every case
it does not take (new, out of step, EOS, a rejected token, a grammar that ends); a row whose newest token
is given apart (`GrammarRow.last`, the hybrid worker's placeholder); the bitmask applied in place to a
run of rows or through a gather, as the reference unpacking does."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from rapidserve.loader import load_hf_tokenizer, resolve_model
from rapidserve.sampling_params import SamplingParams, StructuredOutputs
from rapidserve.structured import GrammarBook, GrammarMask, GrammarRow, apply_grammar_mask
from rapidserve.structured.bitmask import contiguous_start

VOCAB = 49152
EOS = (2, 0)
PLACEHOLDER = -1


@pytest.fixture(scope="module")
def hf() -> Any:
    return load_hf_tokenizer(resolve_model(None))


@pytest.fixture(scope="module", autouse=True)
def _one_tokenizer_view() -> Iterator[None]:
    """llguidance's view of the tokenizer (`trial.ll_tokenizer`: about a CPU-second for SmolLM2's vocabulary, and
    this module's books, the fresh ones that replay rows from scratch among them, would build 20) is built once and
    shared by every book here, as one engine's books share theirs: the view is read-only; the matchers and masks
    the tests compare are each book's own."""
    from rapidserve.structured import matchers

    real = matchers.ll_tokenizer
    views: dict[tuple[int, int, tuple[int, ...]], Any] = {}

    def shared(hf: Any, vocab_size: int, eos: Sequence[int]) -> Any:
        key = (id(hf), vocab_size, tuple(eos))
        if key not in views:
            views[key] = real(hf, vocab_size, eos)
        return views[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(matchers, "ll_tokenizer", shared)
        yield


def book_of(hf: Any) -> GrammarBook:
    return GrammarBook(lambda: hf, VOCAB, EOS, cache_size=4)


def params(min_tokens: int = 0, **kw: Any) -> SamplingParams:
    return SamplingParams(structured_outputs=StructuredOutputs(**kw), max_tokens=64, min_tokens=min_tokens)


def pick(mask: GrammarMask, i: int, rng: random.Random) -> int:
    allowed = mask.allowed(i, VOCAB)
    return allowed[rng.randrange(len(allowed))]


def words(mask: GrammarMask) -> tuple[list[int], bytes]:
    return mask.rows, mask.words.numpy().tobytes()


def test_stepping_matchers_gives_the_masks_of_a_replay_from_scratch(hf: Any) -> None:
    """Rows of several constraints stepped together (the inline advance), against a fresh book replaying each
    row's tokens every step (`_synced` from nothing), until every grammar has ended; min_tokens bans too."""
    kinds = [params(regex="[a-c]{2,6}"), params(choice=("yes", "no")), params(json='{"type": "integer"}'),
             params(min_tokens=4, regex="[0-9]{1,8}")]
    stepped, rng = book_of(hf), random.Random(0)
    toks: list[list[int]] = [[] for _ in kinds]
    for _ in range(12):
        rows = [GrammarRow(i, f"r{i}", p, list(toks[i])) for i, p in enumerate(kinds)]
        mask, failed = stepped.fill(rows, pin=False)
        fresh, ffailed = book_of(hf).fill(rows, pin=False)
        assert not failed and not ffailed and words(mask) == words(fresh)
        for j, row in enumerate(mask.rows):
            toks[row].append(pick(mask, j, rng))
    assert all(t[-1] in EOS for t in toks[:2]), toks  # the bounded ones ended on EOS (all that was left)


def test_a_row_whose_newest_token_is_given_apart_masks_as_its_known_tokens(hf: Any) -> None:
    p = params(regex="[a-z]{1,12}")
    ab = hf.encode("abxq", add_special_tokens=False)[:2]
    assert len(ab) == 2
    book = book_of(hf)
    book.fill([GrammarRow(0, "x", p, ab[:1])], pin=False)
    tokens = [*ab[:1], PLACEHOLDER]  # the request's list ends with a stand-in for its newest token
    mask, failed = book.fill([GrammarRow(0, "x", p, tokens, ab[1])], pin=False)
    fresh, _ = book_of(hf).fill([GrammarRow(0, "x", p, ab)], pin=False)
    assert not failed and words(mask) == words(fresh) and mask.row_start == 0
    assert tokens == [ab[0], PLACEHOLDER] and book._matchers["x"].count == 2
    # replayed from scratch (a new book) from the same row, the stand-in never reaches the grammar
    again, failed = book_of(hf).fill([GrammarRow(0, "x", p, tokens, ab[1])], pin=False)
    assert not failed and words(again) == words(fresh)


def test_a_rejected_token_fails_its_row_alone_with_the_replays_message(hf: Any) -> None:
    p = params(regex="[0-9]+")
    seven, letter = hf.encode("7", add_special_tokens=False), hf.encode("a", add_special_tokens=False)
    book = book_of(hf)
    book.fill([GrammarRow(0, "bad", p, seven), GrammarRow(1, "good", p, seven)], pin=False)
    mask, failed = book.fill([GrammarRow(0, "bad", p, seven + letter), GrammarRow(1, "good", p, seven + seven)],
                             pin=False)
    _, replayed = book_of(hf).fill([GrammarRow(0, "bad", p, seven + letter)], pin=False)
    why = f"token {letter[0]} does not continue the regex constraint: "
    assert list(failed) == [0] and failed[0].startswith(why) and replayed[0].startswith(why)
    assert mask.rows == [1] and "bad" not in book._matchers and len(book) == 1


def test_out_of_step_rows_are_replayed_and_eos_under_ignore_eos_leaves_the_row_unconstrained(hf: Any) -> None:
    p = params(choice=("no",)).replace(ignore_eos=True)
    no = hf.encode("no", add_special_tokens=False)
    book = book_of(hf)
    book.fill([GrammarRow(0, "q", p, no)], pin=False)
    other = hf.encode("n", add_special_tokens=False)  # a different history under the same key: replayed
    mask, _ = book.fill([GrammarRow(0, "q", p, other)], pin=False)
    assert words(mask) == words(book_of(hf).fill([GrammarRow(0, "q", p, other)], pin=False)[0])
    mask, _ = book.fill([GrammarRow(0, "q", p, no)], pin=False)
    assert set(mask.allowed(0, VOCAB)) == set(EOS)  # complete: EOS only
    mask, failed = book.fill([GrammarRow(0, "q", p, [*no, EOS[0]])], pin=False)
    assert not failed and mask.num_rows == 0  # EOS consumed: free text from here on


def reference_apply(logits: torch.Tensor, mask: GrammarMask) -> torch.Tensor:
    """The bits unpacked on the host, row by row."""
    out = logits.clone()
    vocab = logits.shape[-1]
    for i, row in enumerate(mask.rows):
        bits = np.unpackbits(mask.words[i].numpy().view(np.uint8), bitorder="little")[:vocab]
        out[row, torch.from_numpy(bits == 0)] = -math.inf
    return out


@pytest.mark.parametrize(("vocab", "rows", "batch"), [
    (70, [1], 3), (64, [0, 1, 2], 3), (100, [2, 3, 4], 6), (100, [4, 1], 6), (33, [0, 2, 5], 6), (49152, [0, 1], 2)])
def test_apply_in_place_on_a_run_of_rows_or_through_a_gather_matches_the_reference(
        vocab: int, rows: list[int], batch: int) -> None:
    gen = torch.Generator().manual_seed(vocab + batch)
    mask = GrammarMask.new(len(rows), vocab, pin=False, fill=False, rows=rows)
    mask.words.copy_(torch.randint(-(2**31), 2**31 - 1, mask.words.shape, generator=gen, dtype=torch.int64))
    assert mask.row_start == contiguous_start(rows) and mask.rows == rows
    logits = torch.randn(batch, vocab, generator=gen)
    want = reference_apply(logits, mask)
    got = logits.clone()
    apply_grammar_mask(got, mask)
    assert torch.equal(got, want)
    unknown = GrammarMask(mask.buf, mask.num_rows, mask.num_words)  # rows not known to be a run: the gather
    got = logits.clone()
    apply_grammar_mask(got, unknown)
    assert torch.equal(got, want)


def test_contiguous_start_and_a_mask_without_rows() -> None:
    assert contiguous_start([3, 4, 5]) == 3 and contiguous_start([0]) == 0
    assert contiguous_start([]) is None and contiguous_start([0, 2]) is None and contiguous_start([1, 0]) is None
    assert GrammarMask.new(2, 64, pin=False).row_start is None  # the caller writes row_ids: any rows
    with pytest.raises(ValueError, match="2 row ids"):
        GrammarMask.new(1, 64, pin=False, rows=[0, 1])
