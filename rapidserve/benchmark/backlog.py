"""The backlog rule (`backlog_trend`): whether the load a probe offered was sustained, read from its counted requests'
TTFT in arrival order (pure, no I/O). Applied to every probe above a server's own closed-loop peak (sustain.py says
why and with which probes; goodput.py applies it).

The backlog rule. u = TTFT / the request's TTFT limit (`goodput.ttft_limit_s`; u <= 1 meets the rule; a failed
request counts as u = inf), of the counted requests in arrival order, m of them. With k = max(2, m // 4):
first = median u of the first k, last = median u of the last k, slope = (last - first) / (m - k) per arrival (the
quarters' middles lie m - k arrivals apart), projected = last + max(0, slope) x m. The backlog grew when
projected > 1. Below m = MIN_TREND_REQUESTS there is no verdict (None: the probe is judged on attainment alone).

Why this rule: below the rate a server sustains, its TTFT is stationary (the queue stays bounded), so the first and
last quarters' medians agree up to noise and the projection stays near the level the probe already showed. Above it,
at rate r against a service rate mu, the backlog grows by r - mu requests per second and each later arrival waits
(r - mu) / (r mu) s longer: u rises linearly in arrival index, and the TTFT rule breaks for the typical request after
a finite time, which a short probe may not reach. A pass is therefore trusted only if the same load, held for another
probe length, would still keep the typical (median) request within its limit. Medians of quarters, not a least-squares
fit, so that a few outliers (one stall, one failed request) move neither end; an absolute threshold on u, not a ratio
of the two medians, so that a tiny TTFT doubling (20 ms to 40 ms) is not read as overload.

Resolution: with TTFT = b + g t (g = (r - mu) / mu, t the arrival time, the counted requests spanning T seconds, L
the limit) the rule fires when b + g x 7T/8 + g x T > L, i.e. for g > (L - b) / (1.875 T), while attainment at share
q alone fails only for g > (L - b) / (q T): the rule sees an overload about half as large. Either way the overload
that goes unseen shrinks as 1 / T: doubling the probe (factor 2) halves it, which is what the longer probes above
the peak buy. A rate a little above mu (g below that) can still pass: the goodput found above the peak is within
that margin of the sustained rate, not exact; the report gives each such probe's first, last and projected u so a
reader can judge. The other way round, just below mu the queue fills from empty slowly (its relaxation time grows as
mu approaches), so the first quarter can read low and a sustainable rate close to mu can fail: just below mu the
rule can err low, as just above it it can err high by the margin above.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MIN_TREND_REQUESTS = 8  # fewer counted requests: no backlog verdict


@dataclass(frozen=True)
class Backlog:
    """A probe's TTFT trend (u = TTFT / its limit): the first and last quarters' medians and the projection one probe
    length on; `grew` when the projection breaks the TTFT rule (see the module docstring)."""

    first: float
    last: float
    projected: float
    requests: int

    @property
    def grew(self) -> bool:
        return self.projected > 1.0

    def to_json(self) -> dict[str, Any]:
        return {"first": _finite(self.first), "last": _finite(self.last), "projected": _finite(self.projected),
                "requests": self.requests, "grew": self.grew}

    def describe(self) -> str:
        """'u 0.05 -> 0.31, projected 1.2: grew' (u = TTFT / its limit)."""
        return (f"TTFT/limit {_text(self.first)} -> {_text(self.last)}, projected {_text(self.projected)}: "
                + ("GREW (fails every target)" if self.grew else "steady"))


def backlog_trend(usage: Sequence[float]) -> Backlog | None:
    """The backlog rule over the counted requests' u = TTFT / limit in arrival order (inf: a failed request); None
    below MIN_TREND_REQUESTS of them."""
    m = len(usage)
    if m < MIN_TREND_REQUESTS:
        return None
    k = max(2, m // 4)
    first, last = statistics.median(usage[:k]), statistics.median(usage[-k:])
    if math.isinf(last):
        return Backlog(first, last, math.inf, m)
    slope = 0.0 if math.isinf(first) else (last - first) / (m - k)
    return Backlog(first, last, last + max(0.0, slope) * m, m)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _text(x: float) -> str:
    return f"{x:.2g}" if math.isfinite(x) else "inf"
