"""Per-request records and the statistics reported over them (pure functions, no I/O).

Definitions (vLLM's `bench serve` where it has one):
- TTFT: from sending the request to the first streamed chunk that carries a token.
- ITL: the gap between consecutive token-carrying chunks. A chunk that carries k > 1 tokens adds k
  gaps of (gap / k) each (`chunk_itls`), so every token after the first chunk has one ITL.
- TPOT: (E2E - TTFT) / (output tokens - 1), per request (undefined for one output token).
- E2E: from sending the request to the end of its stream.
- Durations are kept in seconds in records; summaries report milliseconds (`*_ms`).
- Request throughput: completed requests / run duration; output throughput: output tokens of completed
  requests / duration; total token throughput: (prompt + output) tokens of completed requests / duration.
  The run duration goes from the first request's send to the last request's end.
- Goodput (`--goodput ttft:MS tpot:MS itl:MS e2el:MS`): completed requests meeting every given bound,
  per second of run. ttft, tpot and e2el are the request's own values; itl is the request's largest
  inter-token gap ("every token came within MS of the previous one").
- RAPID-Serve's TTFT rule, always reported as its own goodput: TTFT <= 1 s per 1K prompt tokens,
  i.e. ttft_s <= prompt_tokens / 1000.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

SLO_METRICS: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")
PERCENTILES: tuple[int, ...] = (50, 90, 99)
RAPID_TTFT_S_PER_TOKEN = 1.0 / 1000.0  # 1 s per 1K prompt tokens


@dataclass
class RequestRecord:
    """One request's outcome; times in seconds (offsets from the run's start, or durations)."""

    index: int
    prompt_tokens: int
    requested_output_tokens: int
    scheduled_s: float = 0.0  # when the arrival process released it
    start_s: float = 0.0  # when it was sent (later than scheduled when --max-concurrency held it)
    success: bool = False
    error: str = ""
    output_tokens: int = 0
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    itl_s: list[float] = field(default_factory=list)
    conversation: int | None = None
    turn: int | None = None
    generated_text: str = ""  # the streamed text (empty from servers that send only token ids)

    @property
    def end_s(self) -> float:
        return self.start_s + self.e2e_s

    @property
    def tpot_s(self) -> float:
        return tpot(self.e2e_s, self.ttft_s, self.output_tokens)

    @property
    def max_itl_s(self) -> float:
        return max(self.itl_s) if self.itl_s else 0.0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("scheduled_s", "start_s", "ttft_s", "e2e_s"):
            d[k] = _round(d[k])
        d["tpot_s"] = _round(self.tpot_s)
        d["itl_s"] = [round(x, 6) for x in self.itl_s]
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RequestRecord:
        names = set(cls.__dataclass_fields__)
        kw = {k: v for k, v in d.items() if k in names}
        for k in ("ttft_s", "e2e_s"):
            if kw.get(k) is None:
                kw[k] = math.nan
        return cls(**kw)


def _round(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 6)  # JSON has no NaN


def tpot(e2e_s: float, ttft_s: float, output_tokens: int) -> float:
    """Time per output token after the first: (e2e - ttft) / (n - 1); NaN when n < 2."""
    if output_tokens < 2 or math.isnan(e2e_s) or math.isnan(ttft_s):
        return math.nan
    return (e2e_s - ttft_s) / (output_tokens - 1)


def reconcile_chunk_tokens(counts: Sequence[int], total: int | None) -> list[int]:
    """Tokens per token-carrying chunk, made to sum to `total` (the usage count) when it is known.

    `counts` are what each chunk showed (len(token_ids) when the server sends ids, else 1). When usage
    says more tokens came than counted (a server that merges tokens into one chunk without saying so),
    the surplus is spread evenly over the chunks after the first (the first chunk's extra tokens would
    have no gap to share); when it says fewer, the counts are kept."""
    out = list(counts)
    if total is None or not out or sum(out) >= total:
        return out
    surplus = total - sum(out)
    targets = list(range(1, len(out))) or [0]
    share, rest = divmod(surplus, len(targets))
    for j, i in enumerate(targets):
        out[i] += share + (1 if j < rest else 0)
    return out


def chunk_itls(times: Sequence[float], counts: Sequence[int]) -> list[float]:
    """Inter-token latencies from chunk arrival times and the tokens each chunk carried.

    Chunk i > 0 with k tokens gives k ITLs of (t_i - t_{i-1}) / k; chunks with 0 tokens must be
    left out beforehand. The first chunk's tokens have no ITL (they make the TTFT)."""
    if len(times) != len(counts):
        raise ValueError(f"{len(times)} chunk times but {len(counts)} token counts")
    out: list[float] = []
    for i in range(1, len(times)):
        k = counts[i]
        if k <= 0:
            raise ValueError(f"chunk {i} carries {k} tokens: leave empty chunks out")
        gap = times[i] - times[i - 1]
        out.extend([gap / k] * k)
    return out


def percentile(xs: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's
    default); NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is not in [0, 100]")
    if not xs:
        return math.nan
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def describe_ms(xs_s: Sequence[float]) -> dict[str, float | None]:
    """mean, median, p90, p99 of durations given in seconds, in milliseconds (None when empty)."""
    xs = [x for x in xs_s if not math.isnan(x)]
    if not xs:
        return {"mean": None, "median": None, **{f"p{p}": None for p in PERCENTILES if p != 50}}
    out: dict[str, float | None] = {"mean": 1e3 * sum(xs) / len(xs), "median": 1e3 * percentile(xs, 50)}
    for p in PERCENTILES:
        if p != 50:
            out[f"p{p}"] = 1e3 * percentile(xs, p)
    return out


def parse_slos(items: Iterable[str]) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds); ValueError if bad."""
    out: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"{item!r}: a goodput bound is METRIC:MS with METRIC one of {', '.join(SLO_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"{item!r}: {value!r} is not a number of milliseconds") from None
        if not (ms > 0 and math.isfinite(ms)):
            raise ValueError(f"{item!r}: the bound must be a positive number of milliseconds")
        if name in out:
            raise ValueError(f"{item!r}: {name} is given twice")
        out[name] = ms
    return out


def meets_slos(r: RequestRecord, slos_ms: Mapping[str, float]) -> bool:
    """Whether a completed request meets every bound (ms); a failed request never does. A request
    with one output token has no TPOT and no ITL, which then count as met."""
    if not r.success:
        return False
    values = {"ttft": r.ttft_s, "tpot": r.tpot_s, "itl": r.max_itl_s, "e2el": r.e2e_s}
    for name, bound in slos_ms.items():
        v = values[name]
        if not math.isnan(v) and v * 1e3 > bound:
            return False
    return True


def meets_rapid_ttft(r: RequestRecord) -> bool:
    """RAPID-Serve's TTFT rule: TTFT <= 1 s per 1K prompt tokens."""
    return r.success and r.ttft_s <= r.prompt_tokens * RAPID_TTFT_S_PER_TOKEN


def run_duration(records: Sequence[RequestRecord]) -> float:
    """From the first send to the last end (0 when nothing was sent)."""
    started = [r for r in records if not math.isnan(r.start_s)]
    if not started:
        return 0.0
    t0 = min(r.start_s for r in started)
    ends = [r.end_s if not math.isnan(r.e2e_s) else r.start_s for r in started]
    return max(ends) - t0


def top_errors(errors: Counter[str], k: int = 10) -> dict[str, int]:
    """The k most common error texts with their counts; the rest summed under "(N other errors)"."""
    out = dict(errors.most_common(k))
    rest = sum(errors.values()) - sum(out.values())
    if rest:
        out[f"({len(errors) - len(out)} other error texts)"] = rest
    return out


def summarize(records: Sequence[RequestRecord], slos_ms: Mapping[str, float] | None = None,
              duration_s: float | None = None) -> dict[str, Any]:
    """The report of one run (one request rate): counts, throughputs, latency statistics, goodputs."""
    dur = run_duration(records) if duration_s is None else duration_s
    ok = [r for r in records if r.success]
    per_s = (lambda x: x / dur) if dur > 0 else (lambda x: 0.0)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    errors = Counter(r.error for r in records if not r.success)
    s: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": dur,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(in_tokens + out_tokens),
        "output_len_mismatches": sum(1 for r in ok if r.output_tokens != r.requested_output_tokens),
        "ttft_ms": describe_ms([r.ttft_s for r in ok]),
        "tpot_ms": describe_ms([r.tpot_s for r in ok]),
        "itl_ms": describe_ms([x for r in ok for x in r.itl_s]),
        "e2el_ms": describe_ms([r.e2e_s for r in ok]),
        "slos_ms": dict(slos_ms or {}),
        "goodput": per_s(sum(meets_slos(r, slos_ms) for r in records)) if slos_ms else None,
        "goodput_rapid_ttft": per_s(sum(meets_rapid_ttft(r) for r in records)),
        "errors": top_errors(errors),
    }
    return s
