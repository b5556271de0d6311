"""The sweep comparison's numbers and tables: per system and workload, from each rate's summary and requests
(pure), the peak, the throughput and goodput at p99 ITL bounds, the strict goodput, the ratios versus vLLM
and versus the best hybrid, the markdown report; and the files written from them (<name>.json, .md, .png).
(A goodput search's: bench/compare_frontier.py.)

Definitions (per system and workload, over the rates of its sweep):
- peak throughput: the highest output tokens/s of any rate (with that rate's requests/s, TTFT p50 and p99,
  and p99 ITL).
- throughput at p99 ITL <= B ms: the highest output tokens/s among the rates whose p99 ITL (over every
  token of every request at that rate) is <= B and where no request failed; with that rate and its
  p99 TTFT. "-" when no rate meets it. Reported for B = 100 and 50 (--itl-bounds-ms).
- goodput at p99 ITL <= B ms: the highest, over the rates whose p99 ITL is <= B with no failures, of
  completed requests per second whose TTFT was <= 1 s per 1K prompt tokens (RAPID-Serve's TTFT
  rule): the load a system carries while its token stream keeps the p99 bound.
- strict goodput at B ms (per request): the highest, over the rates, of completed requests per second
  whose every inter-token gap was <= B ms and whose TTFT met the same rule (one slow gap in a
  request's stream disqualifies it).
- versus vLLM (when a vLLM system ran; --vllm-baseline picks another system as the reference): each
  system's figure divided by vLLM's on the same workload: requests/s, output tokens/s, TTFT p50 and p99
  (each at the system's peak rate: with one rate, e.g. `--rates inf`, the same load for all; a TTFT ratio
  below 1 is faster than vLLM), goodput and strict goodput at each ITL bound.
- versus the best hybrid: each non-hybrid system's figures divided by the highest any `hybrid*`
  system reached on the same workload (the issue's targets: goodput >= 1.5x, peak >= 0.9x).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rapidserve.benchmark.arrivals import rate_label  # noqa: E402
from rapidserve.benchmark.plot import plot_sweeps  # noqa: E402
from rapidserve.benchmark.report import fmt, jsonable, workload_title  # noqa: E402
from rapidserve.benchmark.stats import RequestRecord, meets_rapid_ttft, meets_slos  # noqa: E402


def _stat(summary: Mapping[str, Any], key: str, stat: str = "p99") -> float | None:
    v = (summary.get(key) or {}).get(stat)
    return float(v) if isinstance(v, (int, float)) else None


def _p99(summary: Mapping[str, Any], key: str) -> float | None:
    return _stat(summary, key, "p99")


def _point(run: Mapping[str, Any]) -> dict[str, Any]:
    s = run["summary"]
    return {"rate": run["rate"], "output_throughput": s["output_throughput"],
            "request_throughput": s["request_throughput"], "p99_itl_ms": _p99(s, "itl_ms"),
            "p50_ttft_ms": _stat(s, "ttft_ms", "median"), "p99_ttft_ms": _p99(s, "ttft_ms")}


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
    row: dict[str, Any] = {"system": label,
                           "workload": result.get("title") or workload_title(result.get("workload", {})),
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


def vllm_keys(bounds_ms: Sequence[float]) -> list[str]:
    """The figures the vs-vLLM ratios are taken of, in the table's order."""
    return ["request_throughput", "output_throughput", "ttft_p50_ms", "ttft_p99_ms",
            *(f"goodput_p99_itl_le_{b:g}ms" for b in bounds_ms), *(f"goodput_itl_le_{b:g}ms" for b in bounds_ms)]


def row_figures(row: Mapping[str, Any], bounds_ms: Sequence[float]) -> dict[str, float | None]:
    """A table row's figures by vllm_keys: requests/s, output tokens/s and TTFT p50 / p99 at its peak rate,
    goodput and strict goodput at each ITL bound (None where the row has none)."""
    pk = row.get("peak") or {}
    out: dict[str, float | None] = {"request_throughput": pk.get("request_throughput"),
                                    "output_throughput": pk.get("output_throughput"),
                                    "ttft_p50_ms": pk.get("p50_ttft_ms"), "ttft_p99_ms": pk.get("p99_ttft_ms")}
    for b in bounds_ms:
        for k in (f"goodput_p99_itl_le_{b:g}ms", f"goodput_itl_le_{b:g}ms"):
            g = row.get(k)
            out[k] = None if g is None else g.get("goodput")
    return {k: (None if v is None else float(v)) for k, v in out.items()}


def versus_vllm(rows: Sequence[Mapping[str, Any]], bounds_ms: Sequence[float],
                baseline: str | None) -> list[dict[str, Any]]:
    """Per workload and system other than `baseline` (vLLM's label): each figure of row_figures divided by
    the baseline's on the same workload (None: either figure missing, or the baseline's is 0). Empty when
    there is no baseline; a workload the baseline has no row for is left out."""
    if baseline is None:
        return []
    keys = vllm_keys(bounds_ms)
    out: list[dict[str, Any]] = []
    for w in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == w]
        base = next((r for r in mine if r["system"] == baseline), None)
        if base is None:
            continue
        bf = row_figures(base, bounds_ms)
        for r in mine:
            if r is base:
                continue
            f = row_figures(r, bounds_ms)
            ratios: dict[str, Any] = {"system": r["system"], "workload": w, "baseline": baseline}
            for k in keys:
                v, b = f[k], bf[k]
                ratios[k] = None if v is None or not b else v / b
            out.append(ratios)
    return out


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def to_markdown(rows: Sequence[Mapping[str, Any]], bounds_ms: Sequence[float], meta: Mapping[str, Any]) -> str:
    def at(p: Mapping[str, Any] | None) -> str:
        return "-" if p is None else f"{fmt(p['output_throughput'], '.0f')} @ {rate_label(float(p['rate']))}"

    def num(p: Mapping[str, Any] | None, key: str, spec: str = ".0f") -> str:
        return "-" if p is None else fmt(p.get(key), spec)

    def gp(g: Mapping[str, Any] | None) -> str:
        return "-" if g is None else f"{fmt(g['goodput'], '.2f')} @ {rate_label(float(g['rate']))}"

    baseline = meta.get("vllm_baseline")
    head = ["system", "peak out tok/s @ rate", "req/s at peak", "TTFT p50 at peak (ms)", "p99 TTFT at peak (ms)",
            "p99 ITL at peak (ms)"]
    for b in bounds_ms:
        head += [f"out tok/s @ rate, p99 ITL <= {b:g} ms", "p99 TTFT there (ms)",
                 f"goodput, p99 ITL <= {b:g} ms (req/s)", f"strict goodput, every gap <= {b:g} ms (req/s)"]
    lines = [f"# rapidserve compare: {meta.get('model')}", "",
             f"- {meta.get('created')}; serve args: `{meta.get('serve_args') or '(none)'}`",
             f"- sweep: rates {meta.get('rates')}, {meta.get('per_rate')} per rate, arrivals {meta.get('arrival')}, "
             f"seed {meta.get('seed')}",
             "- definitions: bench/compare_tables.py's docstring (p99 ITL over all tokens of a rate; goodput: "
             "TTFT-rule requests/s at the best rate within the p99 ITL bound; strict goodput: requests with every gap "
             "within the bound and TTFT <= 1 s per 1K prompt tokens)", ""]
    for s in meta.get("systems", []):
        lines.append(f"- {s['label']}: `{s['flags']}` - {s['status']}")
    for w in meta.get("workloads", []):
        lines.append(f"- workload {w['title']}: `rapidserve bench {w['flags']}`")
    vs_vllm = versus_vllm(rows, bounds_ms, baseline)
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    for w in workloads:
        lines += ["", f"## {w}", "", "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
        for r in (r for r in rows if r["workload"] == w):
            pk = r["peak"]
            cells = [r["system"], at(pk), num(pk, "request_throughput", ".2f"), num(pk, "p50_ttft_ms"),
                     num(pk, "p99_ttft_ms"), num(pk, "p99_itl_ms", ".1f")]
            for b in bounds_ms:
                p = r[f"itl_le_{b:g}ms"]
                cells += [at(p), num(p, "p99_ttft_ms"), gp(r[f"goodput_p99_itl_le_{b:g}ms"]),
                          gp(r[f"goodput_itl_le_{b:g}ms"])]
            lines.append("| " + " | ".join(cells) + " |")
        vs = [x for x in vs_vllm if x["workload"] == w]
        if vs:
            vhead = ["system", "req/s vs vLLM", "out tok/s vs vLLM", "TTFT p50 vs vLLM", "TTFT p99 vs vLLM"] + \
                [f"goodput p99 ITL <= {b:g} ms vs vLLM" for b in bounds_ms] + \
                [f"strict <= {b:g} ms vs vLLM" for b in bounds_ms]
            lines += ["", f"Versus vLLM (`{baseline}`) on this workload: each figure over vLLM's (requests/s, output "
                      "tokens/s and TTFT at each system's peak rate: a TTFT ratio below 1 is faster than vLLM; "
                      "goodputs at each ITL bound):", "", "| " + " | ".join(vhead) + " |", "|---" * len(vhead) + "|"]
            for x in vs:
                lines.append("| " + " | ".join([x["system"], *(_x(x[k]) for k in vllm_keys(bounds_ms))]) + " |")
        ratios = [x for x in versus_best_hybrid(rows, bounds_ms) if x["workload"] == w]
        if ratios:
            rhead = ["system", "peak"] + [f"goodput p99 <= {b:g} ms" for b in bounds_ms] + \
                [f"strict <= {b:g} ms" for b in bounds_ms]
            lines += ["", "Versus the best hybrid on this workload (ratio of each figure to the highest any hybrid "
                      "budget reached):", "", "| " + " | ".join(rhead) + " |", "|---" * len(rhead) + "|"]
            keys = ratio_keys(bounds_ms)
            for x in ratios:
                lines.append("| " + " | ".join([x["system"]] + [_x(x[k]) for k in keys]) + " |")
    return "\n".join(lines) + "\n"


def write_report(a: argparse.Namespace, meta: dict[str, Any], results: Sequence[Mapping[str, Any]],
                 plot: bool, prior: Mapping[str, Any] | None = None) -> list[str]:
    """<name>.json and <name>.md (and, when `plot`, <name>.png) from the results so far; their paths. `prior`: an
    earlier report this run continues (`--continue-from`): its rows and sweeps come first."""
    prior_rows = list(prior["rows"]) if prior else []
    prior_sweeps = list(prior["sweeps"]) if prior else []
    rows = prior_rows + [table_row(r["label"], r, a.itl_bounds_ms) for r in results]
    base = os.path.join(a.out, a.name)
    sweeps = prior_sweeps + [
        {"label": r["label"], "workload": r["workload"], "title": r.get("title"), "path": r.get("path"),
         "skipped_rates": r.get("skipped_rates", []),
         "runs": [{"rate": x["rate"], "summary": x["summary"]} for x in r["runs"]]} for r in results]
    with open(base + ".json", "w") as f:
        json.dump(jsonable({**meta, "itl_bounds_ms": a.itl_bounds_ms, "rows": rows,
                            "versus_vllm": versus_vllm(rows, a.itl_bounds_ms, meta.get("vllm_baseline")),
                            "versus_best_hybrid": versus_best_hybrid(rows, a.itl_bounds_ms), "sweeps": sweeps}),
                  f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(to_markdown(rows, a.itl_bounds_ms, meta))
    paths = [base + ".json", base + ".md"]
    if plot and sweeps:
        plot_sweeps(sweeps, base + ".png", title=f"{a.model}: systems against offered load",
                    itl_bounds_ms=a.itl_bounds_ms)
        paths.append(base + ".png")
    return paths
