"""What a prompt must be for an engine to serve it: the one prompt check, made at each edge.

The edges are where requests enter: the HTTP server (`server/requests.py`, which names the request
field in its 400), `AsyncEngine.generate` (the RAPID and hybrid engines) and `LLM.generate` (the
single-process engine). Workers trust what the router sends them and do not check again.

A prompt is served when it is non-empty, every id is an integer in [0, vocab_size), and it leaves
room for at least one generated token within the context cap: the model's context window, or the
KV pool's capacity where that is smaller (a request alone must always fit the pool, or it would
wait for blocks forever). The token ids a request's logit controls name (logit_bias,
allowed_token_ids, bad words) must be in [0, vocab_size) as well (`check_params`): an id beyond the
vocabulary would index past the logits on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from rapidserve.sampling_params import SamplingParams

Side = Literal["left", "right"]  # which end of a prompt truncation keeps: "left" the last tokens, "right" the first


class PromptError(ValueError):
    """A prompt the engine cannot serve; `code` is "context_length_exceeded" for one that is too long."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class PromptLimits:
    vocab_size: int
    max_model_len: int
    pool_tokens: int | None = None  # the KV pool's capacity in tokens, once the engine knows it

    @property
    def context_cap(self) -> int:
        """The longest context (prompt + outputs) a request may reach."""
        if self.pool_tokens is None:
            return self.max_model_len
        return min(self.max_model_len, self.pool_tokens)

    def check(self, prompt: Sequence[int], where: str = "prompt") -> None:
        """Raise PromptError saying why `prompt` cannot be served (`where` names it in the message)."""
        if not prompt:
            raise PromptError(f"'{where}' is empty; give at least one token")
        bad = next((t for t in prompt if not (isinstance(t, int) and 0 <= t < self.vocab_size)), None)
        if bad is not None:
            raise PromptError(f"'{where}' holds {bad!r}: token ids must be integers in [0, {self.vocab_size})")
        if len(prompt) >= self.context_cap:
            pool = ("" if self.pool_tokens is None or self.pool_tokens >= self.max_model_len
                    else f" (the KV pool holds {self.pool_tokens} tokens)")
            raise PromptError(f"This model's maximum context length is {self.context_cap} tokens{pool}, but "
                              f"'{where}' has {len(prompt)} tokens (it must leave room for at least one "
                              "generated token)", code="context_length_exceeded")

    def within_cap(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """`params` with max_tokens at most what a `prompt_len`-token prompt leaves within the context cap
        (min_tokens with it): the same "length" finish as the stop rule at the cap, for a caller whose cap is
        below the one the worker applies (disagg under --max-model-len auto: a smaller staging pool)."""
        room = self.context_cap - prompt_len
        if params.max_tokens is not None and params.max_tokens <= room:
            return params
        return params.replace(max_tokens=room, min_tokens=min(params.min_tokens, room))

    def check_params(self, params: SamplingParams) -> None:
        """Raise PromptError naming the field when a logit control names a token id outside the
        vocabulary, or `bad_words` were not tokenized (only an edge with a tokenizer can)."""
        if params.bad_words and not params.bad_words_token_ids:
            raise PromptError("'bad_words' must be tokenized where the tokenizer lives: send them through the "
                              "server or LLM, or give 'bad_words_token_ids' (sampling_params.resolve_bad_words)")
        bad = next(((f, t) for f, t in params.token_ids_in_controls() if t >= self.vocab_size), None)
        if bad is not None:
            raise PromptError(f"'{bad[0]}' holds token id {bad[1]}: token ids must be integers in "
                              f"[0, {self.vocab_size})")


def truncated(ids: list[int], keep: int | None, side: Side) -> list[int]:
    """`ids` cut to `keep` tokens from `side` (the last `keep` for "left"): vLLM's truncate_prompt_tokens, for the
    server's request field and `LLM`'s tokenization_kwargs alike."""
    if keep is None or len(ids) <= keep:
        return ids
    return ids[-keep:] if side == "left" else ids[:keep]
