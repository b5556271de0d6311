"""The goodput search's run against a real server (`rapidserve bench --goodput-search`); the search's loop over any
measurement, `search_frontier`, is search.py's.

`run_goodput_search(cfg, scfg)` runs it against `cfg.base_url`: the model and max model length as
`run_benchmark` resolves them, `cfg.warmup` unrecorded requests, then (without `scfg.start_rate`) one
closed-loop probe of `probe_requests` requests at once, whose completed requests per second is the peak the
search starts from (`scfg.start_fraction` of it) and whose median E2E is the first lifetime estimate, then the
probes. Given a `KnownPeak` (bench/compare.py --search-peak-from-prior: an earlier report's), the closed loop is not
run: that peak and its lifetime stand for it in every use (the start, the ceiling, the probes above the peak, the
first lifetime estimate) and the result's "search" says where it came from. Each probe gets its own prompts and
arrivals (its index salts them, as a sweep's rates are salted), so none finds another's prompts in a
prefix cache. The result dict is described in goodput_report.py.
"""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from typing import Any, NamedTuple

import aiohttp

from rapidserve.benchmark.arrivals import rate_label
from rapidserve.benchmark.client import Target as Server
from rapidserve.benchmark.client import counter_deltas, server_counters
from rapidserve.benchmark.goodput import CEILING_WORDS, Probe, bound_key, round_rate, share_note
from rapidserve.benchmark.replay import Replay
from rapidserve.benchmark.results import bound_label, trace_line
from rapidserve.benchmark.runner import (
    BenchConfig,
    config_json,
    new_session,
    prepare,
    rate_json,
    run_rate,
    say,
    warm_up,
)
from rapidserve.benchmark.search import AGAIN, TTFT, Outcome, search_frontier
from rapidserve.benchmark.search_config import SearchConfig
from rapidserve.benchmark.stats import RequestRecord, summarize
from rapidserve.benchmark.step_mix import step_cell
from rapidserve.benchmark.sustain import (
    CAP_FLAG,
    RERUN,
    TRACE_CAP,
    arrivals_of,
    probe_arrivals,
    realized_lifetime,
)
from rapidserve.redaction import redact_text


class KnownPeak(NamedTuple):
    """A closed-loop peak measured before this search, reused instead of running the closed loop (bench/compare.py
    --search-peak-from-prior): the peak (arrivals per second, as `closed_peak` gives it), the closed-loop run's median
    E2E (None where the report did not record it: the first probe then estimates its own lifetime, as with a given
    start rate), the report it was read from and the report that measured it (the same, unless that report had
    reused it in turn), and how many requests its closed loop sent at once (None: not recorded); a closed loop of
    another size measured another peak (its concurrency), and the search then runs its own."""

    request_throughput: float
    lifetime_s: float | None
    source: str
    measured_in: str
    probe_requests: int | None = None

    def to_json(self) -> dict[str, Any]:
        """What a result's "search" records of it (beside "peak_request_throughput" and "peak_lifetime_s")."""
        return {"peak_reused_from": self.source, "peak_measured_in": self.measured_in}

    def describe(self) -> str:
        """'1.67 req/s, median E2E 21.9 s, reused from a.json (measured in b.json)': for the log."""
        life = f", median E2E {self.lifetime_s:.3g} s" if self.lifetime_s is not None else ", no median E2E recorded"
        also = f" (measured in {self.measured_in})" if self.measured_in != self.source else ""
        return f"{self.request_throughput:.2f} req/s{life}, reused from {self.source}{also}"


def no_peak_advice(errors: dict[str, int]) -> str:
    """What to do when the closed-loop probe completed no request, from its errors (error text -> count; a summary's
    "(N other error texts)" entry aside): where the server refused every one (HTTP 4xx) the workload does not fit it;
    else the search can start from a given rate instead of the peak."""
    texts = [e for e in errors if not e.startswith("(")]
    if texts and all(e.startswith("HTTP 4") for e in texts):
        return ("the server refused the workload's requests: make them fit it (e.g. --token-range 3:V for a vocabulary "
                "of V tokens; --input-len and --output-len within its --max-model-len)")
    return "give --search-start-rate (with no closed-loop peak the search starts there)"


def start_from_peak(scfg: SearchConfig, peak: float) -> float:
    """Where a search starts from the closed-loop peak: `start_fraction` of it, never above a given --search-max-rate
    (a ceiling below the start would make the start itself the ceiling) nor below a given --search-min-rate."""
    start = round_rate(scfg.start_fraction * peak)
    if scfg.max_rate is not None:
        start = min(start, scfg.max_rate)
    if scfg.min_rate is not None:
        start = max(start, scfg.min_rate)
    return start


def probe_extra(p: Probe, out: Outcome) -> dict[str, Any]:
    """What a probe adds to its record: "ramp" (its warm-up and verdict: sustain.Ramp.to_json); above the closed-loop
    peak also "above_peak", "arrivals" and "backlog" (backlog.Backlog.to_json, or None where too few requests to
    judge)."""
    extra: dict[str, Any] = {"ramp": p.ramp.to_json()} if p.ramp is not None else {}
    if not p.above_peak:
        return extra
    sent = p.ramp.plan.sent if p.ramp is not None else (out.arrivals or {}).get(p.rate)
    return {**extra, "above_peak": True, "arrivals": sent,
            "backlog": p.backlog.to_json() if p.backlog is not None else None}


def attainment_json(p: Probe, bounds: Sequence[float | None]) -> dict[str, float]:
    """A probe's attainment at each bound, by bound_key."""
    return {bound_key(b): p.attainment(b) for b in bounds}


def arrival_turns(cfg: BenchConfig) -> int:
    """Requests an arrival makes: a multi-turn conversation's turns (its arrivals are conversations), else 1."""
    return cfg.workload.num_turns if cfg.workload.name == "multiturn" else 1


def closed_peak(run: dict[str, Any], turns: int = 1) -> float | None:
    """Arrivals per second a closed-loop run completed, in the unit of the probes' rates: its completed requests per
    second over `turns` (`arrival_turns`: a multi-turn workload's arrivals are conversations of that many requests,
    its summary counts the requests); None when it completed nothing."""
    s = run["summary"]
    return float(s["request_throughput"]) / turns if s["completed"] and s["request_throughput"] > 0 else None


def first(replay: Replay | None, k: int) -> Replay | None:
    """A trace's first k requests (a probe's arrivals; k at most the window: the search's cap)."""
    if replay is None or k >= len(replay.items):
        return replay
    return replace(replay, items=replay.items[:k])


async def _one_run(session: aiohttp.ClientSession, target: Server, cfg: BenchConfig, rate: float, index: int,
                   replay: Replay | None, desc: str) -> tuple[list[RequestRecord], dict[str, Any]]:
    before = await server_counters(session, cfg.base_url, cfg.api_key)
    records, _ = await run_rate(session, target, cfg, rate, cfg.salt_base + index, replay, desc=desc)
    after = await server_counters(session, cfg.base_url, cfg.api_key)
    run: dict[str, Any] = {"rate": rate_json(rate), "summary": summarize(records, cfg.slos_ms),
                           "requests": [r.to_json() for r in records]}
    run.update(counter_deltas(before, after))
    return records, run


async def run_goodput_search(cfg: BenchConfig, scfg: SearchConfig, deadline: float | None = None,
                             clock: Callable[[], float] = time.monotonic,
                             shared_peak: float | None = None,
                             known_peak: KnownPeak | None = None) -> dict[str, Any]:
    """Search the goodput frontier of the server at cfg.base_url on cfg's workload; the result dict.
    `deadline` (a `clock` value) and scfg.budget_s, whichever is sooner, bound the probes' time. `shared_peak`: the
    highest closed-loop peak of a comparison's other systems so far (bench/compare.py --search-shared-ceiling): the
    ceiling where it lies above this server's own. `known_peak`: this server's closed-loop peak and lifetime from an
    earlier search (bench/compare.py --search-peak-from-prior), used instead of running the closed loop."""
    if known_peak is not None and scfg.start_rate is not None:
        raise ValueError("a reused closed-loop peak sets the search's start, and --search-start-rate gives one: drop "
                         "one of them")
    if known_peak is not None and not (known_peak.request_throughput > 0
                                       and math.isfinite(known_peak.request_throughput)):
        raise ValueError(f"the closed-loop peak reused from {known_peak.source} is "
                         f"{known_peak.request_throughput!r}: not a positive rate")
    if cfg.burstiness != 1.0:
        raise ValueError("--goodput-search measures Poisson arrivals: drop --burstiness")
    if scfg.trace_probe is not None and cfg.workload.name != "trace":
        raise ValueError("--search-trace-probe sets a trace's arrivals per probe; for this workload --num-prompts "
                         "does: drop --search-trace-probe")
    if scfg.budget_s is not None:
        deadline = min(deadline if deadline is not None else math.inf, clock() + scfg.budget_s)
    async with new_session() as session:
        target, cfg, replay = await prepare(session, cfg)
        window = len(replay.items) if replay is not None else None
        n = (scfg.trace_probe or window) if window is not None else cfg.num_prompts
        if n is None:
            raise ValueError("the goodput search sends a fixed number of requests per probe: give --num-prompts")
        # a trace's window is its probes' cap (`cap` below; checked against them: trace_window_problem); the cap is
        # the flag's for the others
        scfg.check(n, trace=window is not None, window=window)
        label = cfg.label or target.model
        say(cfg, f"goodput search: {label} at {redact_text(cfg.base_url)}, model {target.model}, "
                 f"workload {cfg.workload.name}, "
                 f"{n} arrivals per probe ({scfg.discard} discarded as warm-up)"
                 + (f", from a trace window of {window}" if window is not None and window > n else ""))
        if replay is not None:
            say(cfg, "  " + trace_line(replay.describe()))
        # what a probe counts at or below the closed-loop peak, and above it (longer: --search-above-peak-factor)
        counts = [n - scfg.discard, probe_arrivals(n, scfg.discard, scfg.above_peak_factor) - scfg.discard]
        for q in scfg.shares:
            note = share_note(q, counts)
            if note is not None:
                say(cfg, f"  share {q:g}: {note}")
        await warm_up(session, target, cfg, replay)
        not_reused: str | None = None
        if known_peak is not None and known_peak.probe_requests not in (None, n):
            not_reused = (f"its earlier closed loop ({known_peak.source}) sent {known_peak.probe_requests} requests at "
                          f"once, this one sends {n}: its closed-loop peak is measured (--search-peak-from-prior "
                          "reuses a closed loop of the same size only)")
            say(cfg, f"  {not_reused}")
            known_peak = None
        peak_run: dict[str, Any] | None = None
        peak: float | None = None
        life: float | None = None  # the closed-loop run's median E2E: the first probe's lifetime estimate
        if known_peak is not None:  # --search-peak-from-prior: no closed loop
            peak, life = known_peak.request_throughput, known_peak.lifetime_s
            say(cfg, f"  closed loop not run: its peak {known_peak.describe()} (--search-peak-from-prior)")
            start = start_from_peak(scfg, peak)
        elif scfg.start_rate is None:
            peak_records, peak_run = await _one_run(session, target, cfg, math.inf, 0, first(replay, n),
                                                    "closed loop")
            peak = closed_peak(peak_run, arrival_turns(cfg))
            life = realized_lifetime(arrivals_of(peak_records))
            if peak is None:
                errors = peak_run["summary"]["errors"]
                raise ConnectionError(f"the closed-loop probe ({n} requests at once) completed none ({errors}): "
                                      + no_peak_advice(errors))
            say(cfg, f"  closed loop: {peak:.2f} req/s" + (f", median E2E {life:.3g} s" if life is not None else ""))
            start = start_from_peak(scfg, peak)
        else:
            start = scfg.start_rate
        top = scfg.ceiling(start, peak, shared_peak)
        if scfg.waypoint(top.rate, peak) is not None:
            say(cfg, f"  ceiling {top.rate:g} req/s ({CEILING_WORDS[top.source]}), above the closed-loop peak: "
                     f"probes above it count {scfg.wanted(math.inf, n, peak)} arrivals after their warm-up and fail "
                     "where their backlog grew")
        runs: list[dict[str, Any]] = []  # each probe's run, in the order they ran (a rate probed twice: twice)
        cap, cap_name = (window, TRACE_CAP) if window is not None else (scfg.max_probe_arrivals, CAP_FLAG)
        async def measure(rate: float, arrivals: int, why: str) -> list[RequestRecord]:
            longer = replace(cfg, num_prompts=arrivals) if replay is None else cfg  # a trace: its first arrivals
            what = "" if arrivals == n else f", {arrivals} arrivals" + (
                " (above the peak)" if scfg.above_peak(rate, peak) else "")
            words = {RERUN: ", again (a short probe, a longer warm-up)", AGAIN: ", again (a failure below a pass)",
                     TTFT: ", for TTFT at one rate (--search-ttft-rate)"}
            records, run = await _one_run(session, target, longer, rate, len(runs) + 1, first(replay, arrivals),
                                          f"probe {len(runs) + 1} at {rate_label(rate)} req/s{what}"
                                          + words.get(why, ""))
            runs.append({**run, "again": True} if why == AGAIN else {**run, "ttft_probe": True} if why == TTFT else run)
            return records

        def tell(p: Probe) -> None:
            steps = step_cell(runs[-1])
            say(cfg, f"  probe {len(runs)} at {rate_label(p.rate)} req/s, {p.n} counted: attainment "
                     + ", ".join(f"{bound_label(b)} {p.attainment(b):.0%}" for b in scfg.bounds())
                     + ("" if steps == "-" else f"; server steps: {steps}")
                     + (f"; {p.ramp.describe(cap_name)}" if p.ramp is not None else "")
                     + (f"; above the peak, {p.backlog.describe()}" if p.backlog is not None else ""))

        out = await search_frontier(measure, scfg, start, n, clock, deadline, tell, peak, shared_peak, life, cap)
    probes = [{**run, "order": i + 1, "counted": p.n, "attainment": attainment_json(p, scfg.bounds()),
               **probe_extra(p, out)} for i, (p, run) in enumerate(zip(out.probes, runs, strict=True))]
    return {
        "kind": "goodput_search", "label": label, "base_url": redact_text(cfg.base_url), "model": target.model,
        "workload": cfg.workload.describe(), "config": config_json(cfg),
        "search": {"settings": asdict(scfg), "start_rate": out.start, "min_rate": out.min_rate,
                   "max_rate": out.max_rate, "probe_requests": n, "peak_request_throughput": peak,
                   "peak_lifetime_s": life, "max_probe_arrivals": cap, "trace_window": window,
                   "ceiling": out.ceiling.source if out.ceiling is not None else None, "shared_peak": shared_peak,
                   **(known_peak.to_json() if known_peak is not None else {}),
                   **({"peak_not_reused": not_reused} if not_reused is not None else {})},
        **({"trace": replay.describe()} if replay is not None else {}),
        "peak": peak_run, "probes": probes, "goodput": out.goodput,
        "finished": out.stopped is None, "stopped": out.stopped,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
