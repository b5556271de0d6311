"""The one stop check of every engine and worker, and the rules it is made of: pure functions, no torch.

A request ends after an output token on EOS (unless `ignore_eos`) or one of its `stop_token_ids` (neither
below `min_tokens`, which bans them meanwhile: `early_stop_bans`, except that a grammar request gets EOS only
once its grammar is complete, and then ends), on `max_tokens`, or at the context cap (the window, or the KV
pool's capacity where that is smaller). Stop strings are the caller's (they need the text): `first_stop_string`
is their one match rule, which, as vLLM's, matches none that ends within the text of the first `min_tokens`
outputs.
"""

from __future__ import annotations

from collections.abc import Sequence

from rapidserve.sampling_params import SamplingParams


def check_stop(params: SamplingParams, outputs: list[int], num_tokens: int, eos_token_ids: tuple[int, ...],
               max_len: int) -> str | None:
    """Finish reason after the newest output token, or None to go on: the one stop check of every
    engine and worker (stop strings are the caller's). `num_tokens`: prompt + outputs; `max_len`: the
    context cap (the context window, or the KV pool's capacity where that is smaller)."""
    return check_stop_at(params, outputs[-1], len(outputs), num_tokens, eos_token_ids, max_len)


def check_stop_at(params: SamplingParams, tok: int, n_out: int, num_tokens: int, eos_token_ids: tuple[int, ...],
                  max_len: int) -> str | None:
    """`check_stop` for output token `tok`, the `n_out`-th output (for callers whose list already holds
    later tokens still in flight)."""
    # A grammar request gets EOS below min_tokens only once its grammar is complete (the mask bans it
    # before: rapidserve/structured/matchers.py), and then it ends.
    if n_out >= params.min_tokens or params.structured_outputs is not None:
        if not params.ignore_eos and tok in eos_token_ids:
            return "stop"
        if tok in params.stop_token_ids:
            return "stop"
    if reaches_length(params, n_out, num_tokens, max_len):
        return "length"
    return None


def reaches_length(params: SamplingParams, n_out: int, num_tokens: int, max_len: int) -> bool:
    """The length rule, written once: the `n_out`-th output (`num_tokens` in all) ends the request
    whatever its id (`max_tokens`, or the context cap `max_len`). A worker scheduling ahead asks it of a
    token still in flight: such a request gets no further step."""
    return (params.max_tokens is not None and n_out >= params.max_tokens) or num_tokens >= max_len


def early_stop_bans(params: SamplingParams, num_outputs: int, eos_token_ids: tuple[int, ...]) -> list[int]:
    """Token ids that may not be sampled next: below min_tokens, EOS and stop tokens are banned."""
    if num_outputs >= params.min_tokens:
        return []
    banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    return sorted(banned)


def first_stop_string(text: str, stops: Sequence[str], floor: int = 0) -> tuple[int, str] | None:
    """The earliest stop string in `text` (its index and itself), or None: only a match that ends past the first
    `floor` characters counts. `floor`: how much of `text` the first `min_tokens` outputs made (as vLLM's
    detokenizer, which searches for stop strings only in the text that follows them, and the stop strings that
    straddle its end), so a stop string never ends a request below min_tokens; 0 without min_tokens."""
    hits = [(i, s) for s in stops if s and (i := text.find(s, max(0, floor - len(s) + 1))) >= 0]
    return min(hits) if hits else None
