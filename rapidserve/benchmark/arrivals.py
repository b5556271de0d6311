"""When requests are released: Poisson or fixed-rate arrivals, and request-rate sweeps.

Each rate of a sweep is one run: its requests are released at the offsets `arrival_times` returns
(seconds from the run's start, the first at 0, as vLLM's `bench serve`), and the run ends when all of
them have finished. A `--max-concurrency` cap can hold a released request until a slot frees; it
is then sent late (the record keeps both times).

- poisson: gaps drawn from an exponential distribution with mean 1/rate (a seeded numpy Generator,
  so a seed gives the same schedule every time). With a burstiness b other than 1 (`--burstiness`, as
  vLLM's `bench serve`), gaps from a gamma distribution of shape b and mean 1/rate: b < 1 is burstier
  than Poisson, b > 1 more even. Unlike vLLM, the gaps are not rescaled so that the last arrival falls
  at n / rate: the offered rate is the process's, not forced on each sample.
- fixed: one request every 1/rate seconds.
- rate inf: everything at 0 (a burst; then `--max-concurrency` is the only pacing).

The number of requests per rate is either a count (`--num-prompts`) or every arrival before
`--duration-s`; with both, the count caps the window. A rate of inf needs a count.
"""

from __future__ import annotations

import math

import numpy as np

ARRIVAL_PROCESSES: tuple[str, ...] = ("poisson", "fixed")
INF = math.inf


def parse_rates(text: str) -> tuple[float, ...]:
    """'1,2,4,inf' -> (1.0, 2.0, 4.0, inf): positive request rates (requests/s) or inf, in the order
    given, each at most once; ValueError with what is allowed otherwise."""
    allowed = "a comma-separated list of positive request rates (requests/s) or 'inf', e.g. 1,2,4,inf"
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise ValueError(f"{text!r} is not {allowed}")
    out: list[float] = []
    for p in parts:
        try:
            v = float(p)
        except ValueError:
            raise ValueError(f"{p!r} in {text!r} is not a number: expected {allowed}") from None
        if math.isnan(v) or v <= 0:
            raise ValueError(f"{p!r} in {text!r} is not positive: expected {allowed}")
        if v in out:
            raise ValueError(f"{p!r} appears twice in {text!r}")
        out.append(v)
    return tuple(out)


def rate_label(rate: float) -> str:
    """'inf' or the rate without trailing zeros ('2', '0.5')."""
    return "inf" if math.isinf(rate) else f"{rate:g}"


def rate_rng(seed: int, rate_index: int) -> np.random.Generator:
    """The arrival Generator of one rate of a sweep: reproducible, independent across rates."""
    return np.random.default_rng([seed, rate_index, 0xA771])


def arrival_times(rate: float, process: str, rng: np.random.Generator, num: int | None = None,
                  duration_s: float | None = None, burstiness: float = 1.0) -> np.ndarray:
    """Release offsets (seconds, non-decreasing, first at 0) of one run at `rate` requests/s.

    Exactly `num` arrivals, or those before `duration_s`, or (both given) the first `num` before it.
    `burstiness`: the gamma shape of poisson's gaps (1: exponential, the same draws as without it).
    """
    if process not in ARRIVAL_PROCESSES:
        raise ValueError(f"arrival process {process!r} is not one of {', '.join(ARRIVAL_PROCESSES)}")
    if not (math.isfinite(burstiness) and burstiness > 0):
        raise ValueError(f"burstiness {burstiness} must be a positive finite number (1: Poisson)")
    if burstiness != 1.0 and process != "poisson":
        raise ValueError(f"burstiness {burstiness:g} shapes Poisson arrivals: the {process} process has none")
    if not rate > 0:
        raise ValueError(f"request rate {rate} must be positive (or inf)")
    if num is None and duration_s is None:
        raise ValueError("give the number of requests, the duration, or both")
    if num is not None and num < 1:
        raise ValueError(f"number of requests {num} must be >= 1")
    if duration_s is not None and not duration_s > 0:
        raise ValueError(f"duration {duration_s} s must be positive")
    if math.isinf(rate):
        if num is None:
            raise ValueError("a request rate of inf releases everything at once: it needs a number of requests")
        return np.zeros(num)
    if duration_s is None:
        assert num is not None
        count = num
    else:  # enough arrivals to pass the window with overwhelming probability, then cut
        expected = rate * duration_s
        count = int(expected + 10 * math.sqrt(expected) + 10)
        if num is not None:
            count = min(count, num)
    if process == "fixed":
        t = np.arange(count, dtype=float) / rate
    else:
        if burstiness == 1.0:
            gaps = rng.exponential(1.0 / rate, size=count)
        else:
            gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=count)
        t = np.concatenate(([0.0], np.cumsum(gaps[:-1])))
    if duration_s is not None:
        t = t[t < duration_s]
    return t
