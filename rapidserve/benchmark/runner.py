"""A request-rate sweep against one server: `BenchConfig` in, a result dict (JSON-ready) out.

`run_benchmark(cfg)` resolves the model (first id of GET /v1/models unless given) and the max model
length (the server's, from /v1/models, unless given), sends `cfg.warmup` unrecorded requests, then
runs each rate in turn: requests are released on the arrival schedule, held by the concurrency cap
if one is set, and the rate's run ends when every request has finished. Rates not started by
`cfg.deadline` (a time.monotonic() value) are skipped and listed.

The trace workload (`replay.py`) is built once, after the max model length is known: its load
points are `cfg.time_scales` with `--trace-arrivals timestamps` (each run's "rate" is then the
offered rate and its "time_scale" the scale), else `cfg.rates`; the warm-up sends the window's
first `cfg.warmup` requests at once (with tokens of their own).

The result: {"label", "base_url", "model", "workload", "config", "runs": [{"rate", "summary",
"requests": [...]}, ...], "skipped_rates", "created"} and, for a trace, "trace" (the file, window,
counts and ideal hit rate: `Replay.describe`); rates are numbers or "inf".

Unless `cfg.quiet`, each run prints what vLLM's `bench serve` prints of one: its traffic settings, then (with
`cfg.progress`) a progress bar of its requests, then its "Serving Benchmark Result" table
(serving_result.py, with `cfg.percentile_metrics` and `cfg.metric_percentiles`).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import aiohttp
import numpy as np

from rapidserve.benchmark.arrivals import arrival_times, rate_label, rate_rng
from rapidserve.benchmark.client import Target, counter_deltas, fetch_models, server_counters, stream_completion
from rapidserve.benchmark.progress import Bar, request_bar
from rapidserve.benchmark.replay import Replay, build_replay
from rapidserve.benchmark.results import trace_line
from rapidserve.benchmark.serving_result import DEFAULT_METRICS, DEFAULT_PERCENTILES, result_block, serving_metrics
from rapidserve.benchmark.stats import RequestRecord, summarize
from rapidserve.benchmark.workloads import BenchRequest, WorkloadSpec, make_conversation, make_request
from rapidserve.redaction import redact_text

WARMUP_SALT = 1_000_000  # warm-up prompts differ from every measured rate's


@dataclass
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first id of GET /v1/models
    api_key: str | None = field(default=None, repr=False)  # sent, never recorded (results, reprs)
    label: str | None = None  # the system's name in reports and plots (default: the model id)
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    rates: tuple[float, ...] = (math.inf,)
    arrival: str = "poisson"
    num_prompts: int | None = 100
    duration_s: float | None = None
    max_concurrency: int | None = None
    seed: int = 0
    slos_ms: dict[str, float] = field(default_factory=dict)
    warmup: int = 0
    timeout_s: float = 600.0
    deadline: float | None = None
    quiet: bool = False
    time_scales: tuple[float, ...] = (1.0,)  # trace workload with timestamps arrivals: one run per scale
    sampling: dict[str, Any] = field(default_factory=dict)  # extra fields of every request (--penalties)
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every request's body
    # The first rate of this sweep salts its prompts and arrivals with this, the next with this + 1...
    # (bench/compare.py gives each workload and each follow-up sweep its own, so that no run finds an
    # earlier run's prompts in a server's prefix cache).
    salt_base: int = 0
    burstiness: float = 1.0  # the gamma shape of Poisson arrivals' gaps (1: Poisson; vLLM's --burstiness)
    percentile_metrics: tuple[str, ...] = DEFAULT_METRICS  # the printed table's (and --save-result's) metrics
    metric_percentiles: tuple[float, ...] = DEFAULT_PERCENTILES  # and their percentiles
    progress: bool = False  # a progress bar per run (stderr); `rapidserve bench` turns it on


def rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def rate_from_json(v: float | str) -> float:
    return float(v)


def load_points(cfg: BenchConfig, replay: Replay | None) -> tuple[float, ...]:
    """What each run of the sweep varies: time scales (trace timestamps) or request rates."""
    return cfg.time_scales if replay is not None and replay.spec.arrivals == "timestamps" else cfg.rates


async def _run_single_turn(session: aiohttp.ClientSession, target: Target, cfg: BenchConfig, offsets: np.ndarray,
                           sem: asyncio.Semaphore | None, t0: float, salt: int,
                           replay: Replay | None, bar: Bar) -> list[RequestRecord]:
    spec = cfg.workload

    def make(i: int) -> BenchRequest:
        if replay is not None:
            return replay.request(i, cfg.seed, salt, spec.token_lo, spec.token_hi)
        return make_request(spec, cfg.seed, i, salt)

    async def one(i: int, at: float) -> RequestRecord:
        req = make(i)
        rec = RequestRecord(i, len(req.prompt), req.output_len)
        await _sleep_until(t0 + at)
        rec.scheduled_s = time.perf_counter() - t0
        async with sem if sem is not None else contextlib.nullcontext():
            await stream_completion(session, target, req.prompt, req.output_len, rec, t0)
        bar.update(1)
        return rec

    return list(await asyncio.gather(*(one(i, float(at)) for i, at in enumerate(offsets))))


async def _run_conversations(session: aiohttp.ClientSession, target: Target, cfg: BenchConfig, offsets: np.ndarray,
                             sem: asyncio.Semaphore | None, t0: float, salt: int,
                             replay: Replay | None, bar: Bar) -> list[RequestRecord]:
    spec = cfg.workload

    async def one(c: int, at: float) -> list[RequestRecord]:
        conv = make_conversation(spec, cfg.seed, c, salt)
        await _sleep_until(t0 + at)
        history: list[int] = []
        out: list[RequestRecord] = []
        for turn in range(spec.num_turns):
            prompt = conv.prompt(turn, history)
            n_out = conv.output_lens[turn]
            rec = RequestRecord(c * spec.num_turns + turn, len(prompt), n_out, conversation=c, turn=turn)
            rec.scheduled_s = time.perf_counter() - t0
            async with sem if sem is not None else contextlib.nullcontext():
                got = await stream_completion(session, target, prompt, n_out, rec, t0, return_token_ids=True)
            out.append(rec)
            bar.update(1)
            if not rec.success:  # the conversation cannot go on without this turn (its other turns count as done)
                bar.update(spec.num_turns - 1 - turn)
                break
            outputs = got.token_ids if got.token_ids is not None else conv.standin(rec.output_tokens, spec)
            history = [*prompt, *outputs]
        return out

    runs = await asyncio.gather(*(one(c, float(at)) for c, at in enumerate(offsets)))
    return [r for conv_records in runs for r in conv_records]


async def _sleep_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


async def run_rate(session: aiohttp.ClientSession, target: Target, cfg: BenchConfig, rate: float,
                   rate_index: int, replay: Replay | None = None,
                   offsets: np.ndarray | None = None, desc: str | None = None) -> tuple[list[RequestRecord], float]:
    """One run at `rate` (the `rate_index`-th of the sweep, >= 0: it salts the arrivals and the prompts'
    tokens; for a trace `rate` is the load point: a time scale or a rate): its records and its wall
    time. `offsets`: release these instead of the schedule's (the warm-up). `desc`: the progress bar's
    label (with `cfg.progress`; default: the rate)."""
    rng = rate_rng(cfg.seed, rate_index)
    if offsets is None:
        offsets = (replay.offsets(rate, rng, cfg.burstiness) if replay is not None else
                   arrival_times(rate, cfg.arrival, rng, cfg.num_prompts, cfg.duration_s, cfg.burstiness))
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    multiturn = cfg.workload.name == "multiturn"
    total = len(offsets) * (cfg.workload.num_turns if multiturn else 1)
    bar = request_bar(cfg.progress and not cfg.quiet, total, desc or f"rate {rate_label(rate)}")
    t0 = time.perf_counter()
    run = _run_conversations if multiturn else _run_single_turn
    try:
        records = await run(session, target, cfg, offsets, sem, t0, rate_index, replay, bar)
    finally:
        bar.close()
    return records, time.perf_counter() - t0


async def resolve_target(session: aiohttp.ClientSession, cfg: BenchConfig) -> tuple[Target, int | None]:
    """The model to ask for and the server's max model length (None if it does not say)."""
    models = await fetch_models(session, cfg.base_url, cfg.api_key)
    if cfg.model is None and not models:
        raise ConnectionError(f"{redact_text(cfg.base_url)}/v1/models lists no model: pass --model")
    model = cfg.model if cfg.model is not None else str(models[0]["id"])
    entry = next((m for m in models if m["id"] == model), models[0] if models else {})
    mml = entry.get("max_model_len")
    target = Target(cfg.base_url, model, cfg.api_key, cfg.timeout_s, sampling=dict(cfg.sampling),
                    extra_body=dict(cfg.extra_body))
    return target, (int(mml) if isinstance(mml, int) else None)


def new_session() -> aiohttp.ClientSession:
    """The client session of a benchmark: no cap on connections (the arrival process paces the requests), and a
    connection of its own for each request, closed after it. A pooled keep-alive connection is a race with the
    server's idle timeout: uvicorn (vLLM) closes a connection idle for 5 s, and a request sent on it as it closes
    fails with ServerDisconnectedError, a miss charged to that server alone (2026-12-01, vLLM's probes on one H200:
    one such failure in 48-200 arrivals in 3 of 10 probes; none on rapidserve, whose --keepalive-timeout-s is 15 s).
    The cost, a connection a request, is ~0.35 ms on localhost, the same for every server."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True))


async def prepare(session: aiohttp.ClientSession, cfg: BenchConfig) -> tuple[Target, BenchConfig, Replay | None]:
    """The target, `cfg` with the workload's max model length resolved (the server's unless given) and
    checked, and the trace's replay (None for the other workloads)."""
    target, server_mml = await resolve_target(session, cfg)
    spec = cfg.workload
    if spec.max_model_len is None and server_mml is not None:
        spec = replace(spec, max_model_len=server_mml)
    spec.check()
    cfg = replace(cfg, workload=spec)
    replay = build_replay(spec, cfg.num_prompts, cfg.duration_s) if spec.name == "trace" else None
    return target, cfg, replay


async def warm_up(session: aiohttp.ClientSession, target: Target, cfg: BenchConfig, replay: Replay | None) -> None:
    """Send `cfg.warmup` unrecorded requests at once (a trace: its window's first ones); ConnectionError
    when one fails."""
    if not cfg.warmup:
        return
    warm = replace(cfg, num_prompts=cfg.warmup, duration_s=None)
    first = np.zeros(min(cfg.warmup, len(replay.items))) if replay is not None else None
    records, _ = await run_rate(session, target, warm, math.inf, WARMUP_SALT, replay, first, desc="warm-up")
    bad = [r.error for r in records if not r.success]
    if bad:
        raise ConnectionError(f"warm-up request failed: {bad[0]}")


def say(cfg: BenchConfig, msg: str) -> None:
    if not cfg.quiet:
        print(msg, flush=True)


def traffic_lines(cfg: BenchConfig, rate: float, time_scale: float | None = None) -> str:
    """What a run is about to send, as vLLM's `bench serve` says it before its run."""
    if time_scale is not None:
        first = f"Traffic: the trace's timestamps x{time_scale:g} (offered rate {rate_label(rate)} req/s)"
    else:
        first = f"Traffic request rate: {rate}"
    kind = ("Poisson process" if cfg.burstiness == 1.0 else "Gamma distribution") if cfg.arrival == "poisson" \
        else "fixed intervals"
    burst = "" if time_scale is not None else f"\nBurstiness factor: {cfg.burstiness} ({kind})"
    return f"{first}{burst}\nMaximum request concurrency: {cfg.max_concurrency}"


def run_table(cfg: BenchConfig, run: dict[str, Any]) -> str:
    """A finished run's "Serving Benchmark Result" table (serving_result.py) with cfg's metrics and percentiles."""
    records = [RequestRecord.from_json(r) for r in run["requests"]]
    m = serving_metrics(records, run["summary"], cfg.percentile_metrics, cfg.metric_percentiles)
    return result_block(run, m, cfg.percentile_metrics, cfg.metric_percentiles, cfg.max_concurrency)


async def run_benchmark(cfg: BenchConfig, on_run: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the sweep; return the result dict (every request's record and each rate's summary)."""
    async with new_session() as session:
        target, cfg, replay = await prepare(session, cfg)
        spec = cfg.workload
        points = load_points(cfg, replay)
        scaled = replay is not None and replay.spec.arrivals == "timestamps"
        label = cfg.label or target.model
        say(cfg, f"bench: {label} at {redact_text(cfg.base_url)}, model {target.model}, workload {spec.name}, "
                  + (f"time scales {', '.join(f'{s:g}' for s in points)}" if scaled else
                     f"rates {', '.join(rate_label(r) for r in cfg.rates)}"))
        if replay is not None:
            say(cfg, "  " + trace_line(replay.describe()))
        await warm_up(session, target, cfg, replay)
        runs: list[dict[str, Any]] = []
        skipped: list[float | str] = []
        for i, point in enumerate(points):
            rate = replay.offered_rate(point) if replay is not None else point
            if cfg.deadline is not None and time.monotonic() >= cfg.deadline:
                skipped.append(rate_json(rate))
                continue
            say(cfg, traffic_lines(cfg, rate, point if scaled else None))
            before = await server_counters(session, cfg.base_url, cfg.api_key)
            records, _ = await run_rate(session, target, cfg, point, cfg.salt_base + i, replay)
            after = await server_counters(session, cfg.base_url, cfg.api_key)
            summary = summarize(records, cfg.slos_ms)
            run: dict[str, Any] = {"rate": rate_json(rate), "summary": summary,
                                   "requests": [r.to_json() for r in records]}
            run.update(counter_deltas(before, after))  # the server's own counts, over this run only
            if scaled:
                run["time_scale"] = point
            runs.append(run)
            if not cfg.quiet:
                say(cfg, run_table(cfg, run))
            if on_run is not None:
                on_run(run)
    return {
        "label": label, "base_url": redact_text(cfg.base_url), "model": target.model, "workload": spec.describe(),
        "config": {**config_json(cfg), "rates": [rate_json(r) for r in cfg.rates],
                   **({"time_scales": list(points)} if scaled else {})},
        **({"trace": replay.describe()} if replay is not None else {}),
        "runs": runs, "skipped_rates": skipped,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def config_json(cfg: BenchConfig) -> dict[str, Any]:
    """The run settings a result records (its "config"), less the load points."""
    return {"label": cfg.label, "arrival": cfg.arrival, "burstiness": cfg.burstiness, "num_prompts": cfg.num_prompts,
            "duration_s": cfg.duration_s, "max_concurrency": cfg.max_concurrency, "seed": cfg.seed,
            "slos_ms": cfg.slos_ms, "warmup": cfg.warmup, "timeout_s": cfg.timeout_s,
            "workload_spec": asdict(cfg.workload), "sampling": dict(cfg.sampling),
            "percentile_metrics": list(cfg.percentile_metrics), "metric_percentiles": list(cfg.metric_percentiles)}
