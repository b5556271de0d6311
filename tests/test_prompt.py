"""The one prompt check (rapidserve/prompt.py), made at every edge: a table of prompts and limits."""

from __future__ import annotations

import pytest

from rapidserve.block_manager import BlockManager
from rapidserve.prompt import PromptError, PromptLimits
from rapidserve.sampling_params import SamplingParams

LIMITS = PromptLimits(vocab_size=1000, max_model_len=256)
SMALL_POOL = PromptLimits(vocab_size=1000, max_model_len=256, pool_tokens=64)


@pytest.mark.parametrize("limits, prompt, match, code", [
    (LIMITS, [], "'prompt' is empty", None),
    (LIMITS, [1, 2, 10**9], r"'prompt' holds 1000000000: token ids must be integers in \[0, 1000\)", None),
    (LIMITS, [1, -1], "holds -1", None),
    (LIMITS, [1, 999, 1000], "holds 1000", None),
    (LIMITS, [1, 2.5], "holds 2.5", None),  # type: ignore[list-item]
    (LIMITS, ["a"], "holds 'a'", None),  # type: ignore[list-item]
    (LIMITS, [1] * 256, "maximum context length is 256 tokens, but 'prompt' has 256 tokens", "context_length_exceeded"),
    (SMALL_POOL, [1] * 64, r"is 64 tokens \(the KV pool holds 64 tokens\)", "context_length_exceeded"),
])
def test_prompts_that_cannot_be_served(limits: PromptLimits, prompt: list[int], match: str, code: str | None) -> None:
    with pytest.raises(PromptError, match=match) as e:
        limits.check(prompt)
    assert e.value.code == code
    assert isinstance(e.value, ValueError)  # callers that catch ValueError see it


@pytest.mark.parametrize("limits, prompt", [
    (LIMITS, [0]), (LIMITS, [999] * 255), (SMALL_POOL, [5] * 63),
    (PromptLimits(1000, 256, pool_tokens=4096), [1] * 255),  # a pool larger than the window: the window caps
])
def test_prompts_that_fit(limits: PromptLimits, prompt: list[int]) -> None:
    limits.check(prompt)


def test_the_field_is_named() -> None:
    with pytest.raises(PromptError, match="'prompt_token_ids' is empty"):
        LIMITS.check([], "prompt_token_ids")


@pytest.mark.parametrize("max_len, pool, cap", [(256, None, 256), (256, 64, 64), (256, 4096, 256)])
def test_context_cap(max_len: int, pool: int | None, cap: int) -> None:
    assert PromptLimits(1000, max_len, pool).context_cap == cap


# within_cap: a caller whose cap (SMALL_POOL: 64) is below the worker's gives the request the max_tokens the stop
# rule at 64 would end it with, and no more min_tokens than that.
@pytest.mark.parametrize("prompt_len, max_tokens, min_tokens, want_max, want_min", [
    (10, None, 0, 54, 0),  # "until the cap": the cap's room
    (10, 100, 0, 54, 0),  # more than the room: cut to it
    (10, 100, 80, 54, 54),  # min_tokens past the cap: the cap ended it there anyway
    (10, 54, 5, 54, 5),  # exactly the room: unchanged
    (10, 20, 5, 20, 5),  # within: unchanged
    (63, None, 0, 1, 0),  # the longest prompt that fits leaves one token
])
def test_within_cap(prompt_len: int, max_tokens: int | None, min_tokens: int, want_max: int, want_min: int) -> None:
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, temperature=0.5, seed=3)
    got = SMALL_POOL.within_cap(params, prompt_len)
    assert (got.max_tokens, got.min_tokens) == (want_max, want_min)
    assert (got.temperature, got.seed) == (0.5, 3)  # nothing else changes
    if max_tokens is not None and max_tokens <= 64 - prompt_len:
        assert got is params


# The admission rule every scheduler shares (BlockManager.can_admit): 100 blocks of 16 tokens, 1 kept
# back as the watermark unless nothing else holds blocks.
@pytest.mark.parametrize("taken, tokens, alone, want", [
    (0, 16 * 99, False, True),  # leaves the watermark block free
    (0, 16 * 100, False, False),  # would eat the watermark
    (0, 16 * 100, True, True),  # ... which never starves the only sequence
    (0, 16 * 100 + 1, True, False),  # more than the pool: never
    (90, 16 * 9, False, True),
    (90, 16 * 10, False, False),
    (90, 16 * 10, True, True),
])
def test_admission_rule(taken: int, tokens: int, alone: bool, want: bool) -> None:
    bm = BlockManager(100, 16)
    if taken:
        bm.allocate("x", taken * 16)
    assert bm.can_admit(tokens, alone) is want
