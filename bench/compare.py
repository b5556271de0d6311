"""Engine configurations side by side on one GPU: the same request-rate sweep against each (issue 6).

    python bench/compare.py --model preset:qwen3-8b --systems rapid-adaptive,hybrid-2048 \\
        --workloads 4096:64,4096:1024 --rates 1,2,4,8,inf --num-prompts 32 --duration-budget-s 2400

For each system in turn: start `rapidserve serve --model M --port P <--serve-args> <system flags>`
as a subprocess (log in <out>/compare_logs/), wait for GET /health = 200, run every workload's sweep
with the bench client in this process (`rapidserve.benchmark.run_benchmark`, a few unrecorded warm-up
requests first), then SIGTERM the server and wait for it to exit. A system whose server does not
start is recorded as such and the next one runs. The flags are passed through as given (`--mode`,
`--partition`, `--max-num-batched-tokens`: the server validates them). `--dry-run` prints the
commands only.

Outputs, in --out (default bench/results): <name>.json (every system's flags and status, each
sweep's per-rate summaries, the table rows), <name>.md (the tables), <name>.png (one row per
workload: output throughput, p99 ITL and p99 TTFT against offered load, a line per system), and
each sweep's full bench result (every request) in <out>/compare_runs/.

Definitions (per system and workload, over the rates of its sweep):
- peak throughput: the highest output tokens/s of any rate (with that rate and its p99 TTFT).
- throughput at p99 ITL <= B ms: the highest output tokens/s among the rates whose p99 ITL (over every
  token of every request at that rate) is <= B and where no request failed; with that rate and its
  p99 TTFT. "-" when no rate meets it. Reported for B = 100 and 50 (--itl-bounds-ms).
- goodput at p99 ITL <= B ms: the highest, over the rates whose p99 ITL is <= B with no failures, of
  completed requests per second whose TTFT was <= 1 s per 1K prompt tokens (RAPID-Serve's TTFT
  rule): the load a system carries while its token stream keeps the p99 bound.
- strict goodput at B ms (per request): the highest, over the rates, of completed requests per second
  whose every inter-token gap was <= B ms and whose TTFT met the same rule (one slow gap in a
  request's stream disqualifies it).
- versus the best hybrid: each non-hybrid system's figures divided by the highest any `hybrid*`
  system reached on the same workload (the issue's targets: goodput >= 1.5x, peak >= 0.9x).
GPU time: the servers start once per system (all workloads run on it); keep --num-prompts small, or use
--duration-s for short fixed windows per rate, and --duration-budget-s to stop starting new rates and
systems once the budget is spent (skips are listed).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rapidserve.benchmark import BenchConfig, WorkloadSpec, run_benchmark, write_outputs  # noqa: E402
from rapidserve.benchmark.arrivals import rate_label  # noqa: E402
from rapidserve.benchmark.cli import (  # noqa: E402
    nonneg_int,
    positive_float,
    positive_int,
    rates_arg,
    safe_name,
    token_range_arg,
)
from rapidserve.benchmark.plot import plot_sweeps  # noqa: E402
from rapidserve.benchmark.report import fmt, jsonable, workload_title  # noqa: E402
from rapidserve.benchmark.stats import RequestRecord, meets_rapid_ttft, meets_slos  # noqa: E402
from rapidserve.benchmark.workloads import TRACES  # noqa: E402

SYSTEMS: dict[str, str] = {
    "rapid-adaptive": "--mode rapid --partition adaptive",
    "rapid-adaptive-slo100": "--mode rapid --partition adaptive --slo-itl-ms 100",
    "rapid-overallocated": "--mode rapid --partition off",
    "rapid-static-0.25": "--mode rapid --partition static:0.25",
    "rapid-static-0.5": "--mode rapid --partition static:0.5",
    "hybrid-512": "--mode hybrid --max-num-batched-tokens 512",
    "hybrid-2048": "--mode hybrid --max-num-batched-tokens 2048",
    "hybrid-8192": "--mode hybrid --max-num-batched-tokens 8192",
}


# ---------------------------------------------------------------- the table's numbers (pure)


def _p99(summary: Mapping[str, Any], key: str) -> float | None:
    v = (summary.get(key) or {}).get("p99")
    return float(v) if isinstance(v, (int, float)) else None


def _point(run: Mapping[str, Any]) -> dict[str, Any]:
    s = run["summary"]
    return {"rate": run["rate"], "output_throughput": s["output_throughput"],
            "request_throughput": s["request_throughput"], "p99_itl_ms": _p99(s, "itl_ms"),
            "p99_ttft_ms": _p99(s, "ttft_ms")}


def peak(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The rate with the highest output throughput."""
    done = [r for r in runs if r["summary"]["completed"]]
    return _point(max(done, key=lambda r: r["summary"]["output_throughput"])) if done else None


def within_itl(runs: Sequence[Mapping[str, Any]], bound_ms: float) -> list[Mapping[str, Any]]:
    """The rates with completions, no failures and p99 ITL <= bound_ms."""
    return [r for r in runs if r["summary"]["completed"] and not r["summary"]["failed"]
            and (p := _p99(r["summary"], "itl_ms")) is not None and p <= bound_ms]


def best_under_itl(runs: Sequence[Mapping[str, Any]], bound_ms: float) -> dict[str, Any] | None:
    """The highest output throughput among rates with no failures and p99 ITL <= bound_ms."""
    ok = within_itl(runs, bound_ms)
    return _point(max(ok, key=lambda r: r["summary"]["output_throughput"])) if ok else None


def request_goodput(run: Mapping[str, Any], itl_bound_ms: float | None = None) -> float:
    """Requests/s of one rate that completed with the RAPID TTFT rule met and, given a bound, every
    ITL within it."""
    dur = run["summary"]["duration_s"]
    slos = {} if itl_bound_ms is None else {"itl": itl_bound_ms}
    recs = [RequestRecord.from_json(r) for r in run.get("requests", [])]
    good = sum(1 for r in recs if meets_slos(r, slos) and meets_rapid_ttft(r))
    return good / dur if dur > 0 else 0.0


def best_goodput_p99(runs: Sequence[Mapping[str, Any]], itl_bound_ms: float) -> dict[str, Any] | None:
    """The most TTFT-rule requests/s among the rates whose p99 ITL is within the bound (no failures)."""
    ok = within_itl(runs, itl_bound_ms)
    if not ok:
        return None
    g, rate = max(((request_goodput(r), r["rate"]) for r in ok), key=lambda x: x[0])
    return {"goodput": g, "rate": rate}


def best_goodput(runs: Sequence[Mapping[str, Any]], itl_bound_ms: float) -> dict[str, Any] | None:
    scored = [(request_goodput(r, itl_bound_ms), r["rate"]) for r in runs]
    if not scored:
        return None
    g, rate = max(scored, key=lambda x: x[0])
    return {"goodput": g, "rate": rate}


def table_row(label: str, result: Mapping[str, Any], bounds_ms: Sequence[float]) -> dict[str, Any]:
    runs = result.get("runs", [])
    row: dict[str, Any] = {"system": label, "workload": workload_title(result.get("workload", {})),
                           "peak": peak(runs)}
    for b in bounds_ms:
        row[f"itl_le_{b:g}ms"] = best_under_itl(runs, b)
        row[f"goodput_p99_itl_le_{b:g}ms"] = best_goodput_p99(runs, b)
        row[f"goodput_itl_le_{b:g}ms"] = best_goodput(runs, b)
    row["skipped_rates"] = list(result.get("skipped_rates", []))
    return row


def ratio_keys(bounds_ms: Sequence[float]) -> list[str]:
    p99 = [f"goodput_p99_itl_le_{b:g}ms" for b in bounds_ms]
    return ["peak", *p99, *(f"goodput_itl_le_{b:g}ms" for b in bounds_ms)]


def versus_best_hybrid(rows: Sequence[Mapping[str, Any]], bounds_ms: Sequence[float]) -> list[dict[str, Any]]:
    """Per workload and non-hybrid system: its peak and goodputs over the best hybrid's (None: no hybrid
    figure, or the hybrid's is 0)."""
    def value(r: Mapping[str, Any], key: str) -> float | None:
        v = r.get(key)
        if v is None:
            return None
        return float(v["output_throughput"] if key == "peak" else v["goodput"])

    keys = ratio_keys(bounds_ms)
    out: list[dict[str, Any]] = []
    for w in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == w]
        hybrids = [r for r in mine if str(r["system"]).startswith("hybrid")]
        if not hybrids:
            continue
        best = {k: max((v for r in hybrids if (v := value(r, k)) is not None), default=None) for k in keys}
        for r in mine:
            if r in hybrids:
                continue
            ratios: dict[str, Any] = {"system": r["system"], "workload": w}
            for k in keys:
                v, b = value(r, k), best[k]
                ratios[k] = None if v is None or not b else v / b
            out.append(ratios)
    return out


def to_markdown(rows: Sequence[Mapping[str, Any]], bounds_ms: Sequence[float], meta: Mapping[str, Any]) -> str:
    def at(p: Mapping[str, Any] | None) -> str:
        return "-" if p is None else f"{fmt(p['output_throughput'], '.0f')} @ {rate_label(float(p['rate']))}"

    def ttft(p: Mapping[str, Any] | None) -> str:
        return "-" if p is None else fmt(p["p99_ttft_ms"], ".0f")

    def gp(g: Mapping[str, Any] | None) -> str:
        return "-" if g is None else f"{fmt(g['goodput'], '.2f')} @ {rate_label(float(g['rate']))}"

    head = ["system", "peak out tok/s @ rate", "p99 TTFT at peak (ms)"]
    for b in bounds_ms:
        head += [f"out tok/s @ rate, p99 ITL <= {b:g} ms", "p99 TTFT there (ms)",
                 f"goodput, p99 ITL <= {b:g} ms (req/s)", f"strict goodput, every gap <= {b:g} ms (req/s)"]
    lines = [f"# rapidserve compare: {meta.get('model')}", "",
             f"- {meta.get('created')}; serve args: `{meta.get('serve_args') or '(none)'}`",
             f"- sweep: rates {meta.get('rates')}, {meta.get('per_rate')} per rate, arrivals {meta.get('arrival')}, "
             f"seed {meta.get('seed')}",
             "- definitions: bench/compare.py's docstring (p99 ITL over all tokens of a rate; goodput: TTFT-rule "
             "requests/s at the best rate within the p99 ITL bound; strict goodput: requests with every gap within "
             "the bound and TTFT <= 1 s per 1K prompt tokens)", ""]
    for s in meta.get("systems", []):
        lines.append(f"- {s['label']}: `{s['flags']}` - {s['status']}")
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    for w in workloads:
        lines += ["", f"## {w}", "", "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
        for r in (r for r in rows if r["workload"] == w):
            cells = [r["system"], at(r["peak"]), ttft(r["peak"])]
            for b in bounds_ms:
                p = r[f"itl_le_{b:g}ms"]
                cells += [at(p), ttft(p), gp(r[f"goodput_p99_itl_le_{b:g}ms"]), gp(r[f"goodput_itl_le_{b:g}ms"])]
            lines.append("| " + " | ".join(cells) + " |")
        ratios = [x for x in versus_best_hybrid(rows, bounds_ms) if x["workload"] == w]
        if ratios:
            rhead = ["system", "peak"] + [f"goodput p99 <= {b:g} ms" for b in bounds_ms] + \
                [f"strict <= {b:g} ms" for b in bounds_ms]
            lines += ["", "Versus the best hybrid on this workload (ratio of each figure to the highest any hybrid "
                      "budget reached):", "", "| " + " | ".join(rhead) + " |", "|---" * len(rhead) + "|"]
            keys = ratio_keys(bounds_ms)
            for x in ratios:
                lines.append("| " + " | ".join([x["system"]] + ["-" if x[k] is None else f"{x[k]:.2f}x"
                                                                for k in keys]) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- servers


def parse_workload(text: str) -> WorkloadSpec:
    """'4096:64' (fixed input:output) or a trace name."""
    if text in TRACES:
        return WorkloadSpec(text)
    parts = text.split(":")
    if len(parts) == 2 and all(p.strip().isdigit() and int(p) > 0 for p in parts):
        return WorkloadSpec("fixed", int(parts[0]), int(parts[1]))
    raise argparse.ArgumentTypeError(f"{text!r} is not IN:OUT (positive token counts, e.g. 4096:64) or one of "
                                     f"{', '.join(TRACES)}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_command(model: str, port: int, serve_args: str, flags: str) -> list[str]:
    return [sys.executable, "-m", "rapidserve.cli", "serve", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), *shlex.split(serve_args), *shlex.split(flags)]


def wait_healthy(proc: subprocess.Popen[bytes], url: str, timeout_s: float) -> str | None:
    """None once GET /health answers 200; else why not (the process exited, or the time ran out)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"the server exited with code {proc.returncode} before it was healthy"
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return None
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    return f"not healthy after {timeout_s:g} s"


def stop_server(proc: subprocess.Popen[bytes], grace_s: float = 120.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def run_system(a: argparse.Namespace, label: str, flags: str, deadline: float | None,
               results: list[dict[str, Any]]) -> dict[str, Any]:
    """Start one system's server, run every workload's sweep, stop it; append results; its status."""
    port = a.port or free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = os.path.join(a.out, "compare_logs", f"{a.name}__{safe_name(label)}.log")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    info: dict[str, Any] = {"label": label, "flags": flags, "log": log_path, "status": "ok"}
    cmd = serve_command(a.model, port, a.serve_args, flags)
    print(f"== {label}: {shlex.join(cmd)}", flush=True)
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        why = wait_healthy(proc, url, a.startup_timeout_s)
        info["startup_s"] = round(time.monotonic() - t0, 1)
        if why is not None:
            info.update(status=f"did not start: {why}", log_tail=_tail(log_path))
            print(f"   {label}: {info['status']} (see {log_path})", flush=True)
            return info
        for spec in a.workloads:
            spec = dataclasses.replace(spec, token_lo=a.token_range[0], token_hi=a.token_range[1])
            cfg = BenchConfig(base_url=url, label=label, workload=spec, rates=a.rates, arrival=a.arrival,
                              num_prompts=a.num_prompts, duration_s=a.duration_s, max_concurrency=a.max_concurrency,
                              seed=a.seed, warmup=a.warmup, timeout_s=a.timeout_s, deadline=deadline)
            try:
                res = asyncio.run(run_benchmark(cfg))
            except (ValueError, ConnectionError, OSError, aiohttp.ClientError, asyncio.TimeoutError) as e:
                info["status"] = f"error on {workload_title(spec.describe())}: {e}"
                print(f"   {label}: {info['status']}", flush=True)
                continue
            stem = safe_name(f"{a.name}__{label}__{workload_title(res['workload'])}")
            res["path"] = write_outputs(res, os.path.join(a.out, "compare_runs"), stem, plot=False)["json"]
            results.append(res)
    finally:
        info["exit_code"] = stop_server(proc)
    return info


# ---------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="preset:qwen3-8b")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated subset of {', '.join(SYSTEMS)} (default: all)")
    p.add_argument("--system", action="append", default=[], metavar="LABEL=FLAGS",
                   help="an extra system, e.g. 'mine=--mode rapid --partition static:0.75' (repeatable)")
    p.add_argument("--serve-args", default="", help="flags every server gets, e.g. '--max-model-len 8192'")
    p.add_argument("--workloads", type=lambda t: [parse_workload(x) for x in t.split(",")],
                   default=[WorkloadSpec("fixed", 4096, 64), WorkloadSpec("fixed", 4096, 1024)],
                   help="comma-separated IN:OUT or trace names (default: 4096:64,4096:1024)")
    p.add_argument("--rates", type=rates_arg, default=(1.0, 2.0, 4.0, 8.0, math.inf))
    p.add_argument("--arrival", default="poisson", choices=("poisson", "fixed"))
    p.add_argument("--token-range", type=token_range_arg, default=(1000, 20000), metavar="LO:HI",
                   help="prompt token ids are drawn from [LO, HI) (default: 1000:20000)")
    p.add_argument("--num-prompts", type=positive_int, default=32, help="per rate (with --duration-s: a cap)")
    p.add_argument("--duration-s", type=positive_float, default=None, help="per-rate window instead of a count")
    p.add_argument("--max-concurrency", type=positive_int, default=None)
    p.add_argument("--warmup", type=nonneg_int, default=2, help="unrecorded requests before each sweep")
    p.add_argument("--seed", type=nonneg_int, default=0)
    p.add_argument("--timeout-s", type=positive_float, default=300.0, help="per request")
    p.add_argument("--itl-bounds-ms", type=lambda t: [positive_float(x) for x in t.split(",")], default=[100.0, 50.0])
    p.add_argument("--duration-budget-s", type=positive_float, default=None,
                   help="no new system or rate starts after this many seconds")
    p.add_argument("--startup-timeout-s", type=positive_float, default=900.0)
    p.add_argument("--port", type=nonneg_int, default=0, help="server port (default: a free one)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--name", default="compare")
    p.add_argument("--dry-run", action="store_true", help="print the server commands and exit")
    return p


def select_systems(p: argparse.ArgumentParser, a: argparse.Namespace) -> list[tuple[str, str]]:
    names = [s.strip() for s in a.systems.split(",") if s.strip()] if a.systems else []
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        p.error(f"--systems: unknown {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")
    chosen = [(n, SYSTEMS[n]) for n in names]
    for item in a.system:
        label, sep, flags = item.partition("=")
        if not sep or not label.strip():
            p.error(f"--system {item!r}: expected LABEL=FLAGS")
        chosen.append((label.strip(), flags.strip()))
    if not chosen:
        p.error("no systems selected")
    return chosen


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    systems = select_systems(p, a)
    if a.dry_run:
        for label, flags in systems:
            print(f"{label}: {shlex.join(serve_command(a.model, a.port or 8000, a.serve_args, flags))}")
        return 0
    os.makedirs(a.out, exist_ok=True)
    deadline = time.monotonic() + a.duration_budget_s if a.duration_budget_s else None
    results: list[dict[str, Any]] = []
    infos: list[dict[str, Any]] = []
    for label, flags in systems:
        if deadline is not None and time.monotonic() >= deadline:
            infos.append({"label": label, "flags": flags, "status": "skipped: duration budget spent"})
            continue
        infos.append(run_system(a, label, flags, deadline, results))
    rows = [table_row(r["label"], r, a.itl_bounds_ms) for r in results]
    meta = {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "model": a.model, "serve_args": a.serve_args, "rates": ",".join(rate_label(r) for r in a.rates),
            "per_rate": f"{a.duration_s:g} s of arrivals" if a.duration_s else f"{a.num_prompts} requests",
            "arrival": a.arrival, "seed": a.seed, "systems": infos}
    base = os.path.join(a.out, a.name)
    sweeps = [{"label": r["label"], "workload": r["workload"], "path": r.get("path"), "skipped_rates":
               r.get("skipped_rates", []), "runs": [{"rate": x["rate"], "summary": x["summary"]} for x in r["runs"]]}
              for r in results]
    with open(base + ".json", "w") as f:
        json.dump(jsonable({**meta, "itl_bounds_ms": a.itl_bounds_ms, "rows": rows,
                            "versus_best_hybrid": versus_best_hybrid(rows, a.itl_bounds_ms), "sweeps": sweeps}),
                  f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(to_markdown(rows, a.itl_bounds_ms, meta))
    if results:
        plot_sweeps(results, base + ".png", title=f"{a.model}: systems against offered load",
                    itl_bounds_ms=a.itl_bounds_ms)
    with open(base + ".md") as f:
        print(f.read(), flush=True)
    print(f"wrote {base}.json, {base}.md" + (f", {base}.png" if results else ""), flush=True)
    return 0 if all(i["status"] == "ok" for i in infos) else 1


if __name__ == "__main__":
    sys.exit(main())
