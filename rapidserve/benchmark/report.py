"""Writing a sweep's result: the JSON (every request + summaries), a markdown report, the plot."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

from rapidserve.benchmark.arrivals import rate_label
from rapidserve.benchmark.results import load_result, trace_line, workload_title
from rapidserve.benchmark.step_mix import step_cell

__all__ = [
    "fmt", "jsonable", "load_result", "to_markdown", "trace_line", "workload_title", "write_json_and_markdown",
    "write_outputs",
]

THROUGHPUT_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("completed", "completed", "d"), ("failed", "failed", "d"), ("duration (s)", "duration_s", ".2f"),
    ("req/s", "request_throughput", ".2f"), ("output tok/s", "output_throughput", ".1f"),
    ("total tok/s", "total_token_throughput", ".1f"), ("--goodput SLO-met req/s at this rate", "goodput", ".2f"),
    ("TTFT-rule req/s at this rate", "goodput_rapid_ttft", ".2f"))
LATENCIES: tuple[tuple[str, str], ...] = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"),
                                          ("E2E", "e2el_ms"))
STATS: tuple[str, ...] = ("mean", "median", "p90", "p99")


def jsonable(x: Any) -> Any:
    """`x` with non-finite floats as None (JSON has no NaN or inf)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, Mapping):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def fmt(v: Any, spec: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return format(v, spec)


def _rate(v: float | str, time_scale: float | None = None) -> str:
    """A run's rate, and its time scale when it replayed a trace's timestamps."""
    return rate_label(float(v)) + (f" (x{time_scale:g})" if time_scale is not None else "")


def _run_rate(run: Mapping[str, Any]) -> str:
    return _rate(run["rate"], run.get("time_scale"))


def _arrivals(result: Mapping[str, Any]) -> list[str]:
    cfg = result.get("config", {})
    common = (f"max concurrency {cfg.get('max_concurrency') or 'none'}, seed {cfg.get('seed')}, warm-up "
              f"{cfg.get('warmup')}")
    t = result.get("trace")
    if t is None:
        return [f"- arrivals: {cfg.get('arrival')}, {_count(cfg)} per rate, {common}"]
    if cfg.get("time_scales"):
        how = ("the trace's timestamps, time-scaled: inter-arrival times divided by "
               + ", ".join(f"{s:g}" for s in cfg["time_scales"]) + " (one run each; the rate column is the "
               "offered rate, the scale in brackets)")
    else:
        how = "Poisson at each rate, with the trace's lengths in trace order"
    return [f"- {trace_line(t)}", f"- arrivals: {how}; {common}"]


def to_markdown(result: Mapping[str, Any]) -> str:
    cfg = result.get("config", {})
    slos = cfg.get("slos_ms") or {}
    lines = [
        f"# rapidserve bench: {result.get('label')}", "",
        f"- server: {result.get('base_url')}, model `{result.get('model')}`",
        f"- workload: {workload_title(result.get('workload', {}))} ({_workload_details(result.get('workload', {}))})",
        *_arrivals(result),
        "- per-rate SLO goodput (`--goodput`, not the searched goodput of `--goodput-search`): completed requests "
        "per second of each run meeting "
        + (", ".join(f"{k} <= {v:g} ms" for k, v in slos.items()) if slos else "(no --goodput bounds given)")
        + " (itl: the request's largest gap); TTFT-rule req/s: those with TTFT <= 1 s per 1K prompt tokens. The "
        "papers' goodput (the highest Poisson rate at which a share of requests meet a p95 ITL bound and the TTFT "
        "rule) is `rapidserve bench --goodput-search`",
        f"- {result.get('created')}", "",
        "| rate (req/s) | " + " | ".join(c[0] for c in THROUGHPUT_COLUMNS) + " |",
        "|---" * (len(THROUGHPUT_COLUMNS) + 1) + "|",
    ]
    for run in result.get("runs", []):
        s = run["summary"]
        lines.append(f"| {_run_rate(run)} | " + " | ".join(fmt(s.get(k), f) for _, k, f in THROUGHPUT_COLUMNS)
                     + " |")
    lines += ["", "Latencies (ms):", "", "| rate (req/s) | metric | " + " | ".join(STATS) + " |",
              "|---|---|" + "---|" * len(STATS)]
    for run in result.get("runs", []):
        for name, key in LATENCIES:
            d = run["summary"].get(key) or {}
            lines.append(f"| {_run_rate(run)} | {name} | " + " | ".join(fmt(d.get(k), ".1f") for k in STATS)
                         + " |")
    errors = [(run["rate"], e, n) for run in result.get("runs", []) for e, n in run["summary"]["errors"].items()]
    if errors:
        lines += ["", "Failures:", ""] + [f"- rate {_rate(r)}: {n} x {e}" for r, e, n in errors]
    mismatched = [(run["rate"], run["summary"]["output_len_mismatches"]) for run in result.get("runs", [])
                  if run["summary"].get("output_len_mismatches")]
    if mismatched:
        lines += ["", "Output lengths other than asked for (the server ignored ignore_eos/min_tokens?): "
                  + ", ".join(f"rate {_rate(r)}: {n}" for r, n in mismatched)]
    server = [_server_counts(run) for run in result.get("runs", [])]
    if any(server):
        lines += ["", "Server counters over each run:", ""] + [f"- rate {_run_rate(run)}: {s}" for run, s in
                                                                zip(result.get("runs", []), server, strict=True) if s]
    if result.get("skipped_rates"):
        lines += ["", "Skipped (time budget): rates " + ", ".join(_rate(r) for r in result["skipped_rates"])]
    return "\n".join(lines) + "\n"


def _server_counts(run: Mapping[str, Any]) -> str:
    """The server's own counts over one run: prefix cache hit rate, where the time to first token went,
    partition switches and decode steps, the decode worker's steps by shape kind (step_mix.py)."""
    parts = []
    pc = (run.get("prefix_cache") or {}).get("hit_rate")
    if pc is not None:
        parts.append(f"prefix cache hit rate {pc:.1%}")
    ph = run.get("ttft_phases_ms")
    if ph:
        parts.append("time to first token, server's means: " + ", ".join(f"{k} {v:g} ms" for k, v in ph.items()))
    part = run.get("partition")
    if part:
        steps = part.get("decode_steps") or {}
        total = sum(steps.values()) or 1
        share = ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(steps.items(), key=lambda kv: -kv[1]))
        parts.append(f"{part.get('switches', 0)} partition switches; decode steps by configuration: {share}")
    if run.get("server_steps"):
        parts.append(f"steps by kind, share (mean step; measured/predicted, over SLO): {step_cell(run)}")
    return "; ".join(parts)


def _count(cfg: Mapping[str, Any]) -> str:
    if cfg.get("duration_s") is not None:
        cap = f" (at most {cfg['num_prompts']})" if cfg.get("num_prompts") else ""
        return f"arrivals in {cfg['duration_s']:g} s{cap}"
    return f"{cfg.get('num_prompts')} requests"


def _workload_details(w: Mapping[str, Any]) -> str:
    skip = {"name"}
    return ", ".join(f"{k}={v}" for k, v in w.items() if k not in skip and v is not None)



def write_json_and_markdown(result: Mapping[str, Any], out_dir: str, name: str, markdown: str) -> dict[str, str]:
    """Write <out_dir>/<name>.json (the result, JSON-safe) and <name>.md (`markdown`); their paths by kind."""
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, name)
    paths = {"json": base + ".json", "md": base + ".md"}
    with open(paths["json"], "w") as f:
        json.dump(jsonable(result), f, indent=1, allow_nan=False)
        f.write("\n")
    with open(paths["md"], "w") as f:
        f.write(markdown)
    return paths

def write_outputs(result: Mapping[str, Any], out_dir: str, name: str, plot: bool = True) -> dict[str, str]:
    """Write <out_dir>/<name>.json, .md and (with `plot`) .png; return their paths by kind."""
    base = os.path.join(out_dir, name)
    paths = write_json_and_markdown(result, out_dir, name, to_markdown(result))
    if plot and result.get("runs"):
        from rapidserve.benchmark.plot import PLOT_NEEDS, have_matplotlib, plot_sweeps

        if not have_matplotlib():
            print(f"rapidserve bench: no {base}.png: {PLOT_NEEDS}", flush=True)
            return paths
        paths["png"] = base + ".png"
        plot_sweeps([result], paths["png"], title=f"{result.get('label')}: "
                                                  f"{workload_title(result.get('workload', {}))}")
    return paths
