"""A request's state while it is generated: tokens, progress through the cache, finish state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from rapidserve.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # needs (re)computation of its prompt: new, or preempted
    RUNNING = "running"  # all tokens but the last are in the cache; decodes each step
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int = 0  # monotonically increasing admission order (FCFS)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # Tokens (prompt + outputs) whose K/V are in the cache.
    num_computed: int = 0
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when first admitted
    started: float | None = None  # time.monotonic() when its first prompt chunk was queued (PhaseTimes)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def slot_key(self) -> tuple[str, int]:
        """The key of its penalty slot (logit_controls.py): a new one after each preemption."""
        return (self.seq_id, self.num_preemptions)


def token_seed(seed: int, index: int) -> int:
    """The sampling seed of output token `index` of a seeded request: the same in every process
    and however the request is batched, preempted or split between prefill and decode workers."""
    return (seed * 1_000_003 + index * 7_919 + 1) % (1 << 63)


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
