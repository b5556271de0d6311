"""What every scheduling policy is fed (`--policy rapid|duet|drift`, issue 18): one frozen state.

The three policies are pure decision functions over the same `PolicyState`:
* rapid (`partition/manager.py:decide`): the measured profile picks the configuration at each decode
  step boundary (RAPID-Serve);
* duet (`partition/duet.py:decide_duet`): a roofline predicts the next iteration; aggregated (one mixed
  batch on the whole GPU) while it meets the TBT SLO, else a decode/prefill split with k look-ahead
  decode steps (DuetServe, arXiv 2511.04791, sections 4.1-4.3);
* drift (`partition/drift.py:decide_drift`): block-wise prefill beside decode, a linear latency model
  per partition, preemption of a long prefill batch by a short request (DRIFT, the PD-multiplexing
  paper, sections 3.3-3.5).
The workers carry the decisions out; nothing here touches a device.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WaitingPrefill:
    """A prompt (or the rest of one) waiting for prefill."""

    req_id: str
    arrival_s: float
    tokens: int  # prompt tokens still to compute
    prefix: int = 0  # tokens already in the cache (a cached prefix or earlier chunks)

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.prefix < 0:
            raise ValueError(f"{self.req_id}: tokens={self.tokens} must be >= 1 and prefix={self.prefix} >= 0")


@dataclass(frozen=True)
class PendingWork:
    """What the rapid policy is told of prefill's queue (`DecodeScheduler.pending_work`): the prompt
    tokens still to compute, counted up to a cap, and the longest pending prompt with its cached prefix (how
    far its forwards' attention reaches)."""

    tokens: int
    longest: int

    def __post_init__(self) -> None:
        if self.tokens < 0 or self.longest < 0:
            raise ValueError(f"tokens={self.tokens} and longest={self.longest} must be >= 0")


@dataclass(frozen=True)
class PolicyState:
    """One step boundary: the running decode batch, the prefill queue (arrival order), the SLOs."""

    now_s: float
    decode_contexts: tuple[int, ...]  # each running request's context (tokens in the cache)
    waiting: tuple[WaitingPrefill, ...]
    slo_tbt_ms: float  # time between tokens (ITL) a decode step must stay within
    slo_ttft_ms: float | None = None
    prefill_budget: int = 8192  # tokens of one prefill batch (or of a mixed step's prompt chunks)
    # A request's TTFT SLO grows with its length: slo_ttft_ms + this * tokens / 1000 (`ttft_slo_ms`)
    slo_ttft_ms_per_1k_tokens: float = 0.0

    def __post_init__(self) -> None:
        if self.slo_tbt_ms <= 0 or (self.slo_ttft_ms is not None and self.slo_ttft_ms <= 0):
            raise ValueError("slo_tbt_ms and slo_ttft_ms must be positive")
        if self.slo_ttft_ms_per_1k_tokens < 0:
            raise ValueError("slo_ttft_ms_per_1k_tokens must be >= 0")
        if self.prefill_budget < 1 or any(c < 1 for c in self.decode_contexts):
            raise ValueError("prefill_budget must be >= 1 and every decode context >= 1")

    @property
    def decode_batch(self) -> int:
        return len(self.decode_contexts)

    @property
    def mean_context(self) -> int:
        return -(-sum(self.decode_contexts) // len(self.decode_contexts)) if self.decode_contexts else 0

    def ttft_slo_ms(self, tokens: int) -> float | None:
        """The TTFT SLO of a request of `tokens` tokens (its whole prompt); None: no TTFT SLO."""
        if self.slo_ttft_ms is None:
            return None
        return self.slo_ttft_ms + self.slo_ttft_ms_per_1k_tokens * tokens / 1000


def prefill_batch(state: PolicyState) -> tuple[tuple[str, int, int], ...]:
    """The next prefill batch in arrival order within the token budget: (req_id, chunk tokens, prefix)
    per request; a prompt longer than what is left of the budget gets a chunk of that size."""
    left, out = state.prefill_budget, []
    for w in state.waiting:
        if left == 0:
            break
        n = min(w.tokens, left)
        out.append((w.req_id, n, w.prefix))
        left -= n
    return tuple(out)
