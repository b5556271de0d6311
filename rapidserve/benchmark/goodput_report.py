"""A goodput search's result: its markdown, and its files (JSON, markdown, the frontier plot).

The result dict (`search_run.run_goodput_search`): {"kind": "goodput_search", "label", "base_url", "model", "workload",
"config" (as a sweep's), "search": {"settings" (SearchConfig), "start_rate", "min_rate", "max_rate",
"probe_requests", "peak_request_throughput", "ceiling" (where max_rate came from: goodput.OWN_PEAK, ...),
"shared_peak", "peak_lifetime_s" (the closed-loop run's median E2E), "max_probe_arrivals" (the cap a probe ran under:
--search-max-probe-arrivals, a trace's window); where the peak and lifetime were reused from an earlier report instead
of measured (bench/compare.py --search-peak-from-prior: search_run.KnownPeak) also "peak_reused_from" (that report)
and "peak_measured_in" (the report whose search measured it)}, "peak" (the closed-loop run, or None with a given
start rate or a reused peak),
"probes": [a sweep's run dict plus "order", "counted" and "attainment" {bound_key: share of counted requests attaining
it}; "ramp" (its warm-up and whether it reached steady state: sustain.Ramp.to_json; absent from results written
before the ramp rule); a rapidserve server's steps over the probe: "server_steps" and "server_step_correction",
step_mix.py; a probe above the closed-loop peak: "above_peak" True, "arrivals" and "backlog"
(backlog.Backlog.to_json)], "goodput": [{"itl_bound_ms" (None:
unbounded), "share", "goodput", "lo", "hi", "status" (`not_searched`: a bound outside settings.only_bounds),
"passes_above" and "fails_above" (goodput.passes_above / fails_above; absent before 2026-12-01)}],
"finished", "stopped" (why probing stopped early, or None), "created"} and, for a trace, "trace". The new keys are
optional: a result written before them still reads.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from rapidserve.benchmark.goodput import (
    AT_MAX,
    BELOW_MIN,
    CEILING_WORDS,
    CONVERGED,
    NOT_SEARCHED,
    OWN_PEAK,
    START_X8,
    bound_key,
)
from rapidserve.benchmark.plot import PLOT_NEEDS, have_matplotlib, plot_frontier
from rapidserve.benchmark.report import fmt, write_json_and_markdown
from rapidserve.benchmark.results import bound_label, entry, search_bounds, search_shares, trace_line, workload_title
from rapidserve.benchmark.serving_result import WIDTH, table_row, title_line
from rapidserve.benchmark.step_mix import STEP_COLUMN, STEP_LEGEND, step_cell
from rapidserve.benchmark.sustain import CAP_FLAG, CAPPED, RERUN, SHORT, TRACE_CAP, probe_arrivals, ramp_text

DEFINITION = ("goodput at (ITL bound B, share q): the highest Poisson request rate at which at least q of the "
              "requests meet both the ITL bound (the p95 of the request's own inter-token gaps <= B; a request with "
              "fewer than 2 output tokens meets it) and the TTFT rule (TTFT <= max(1 s, 1 s per 1000 prompt tokens)); "
              "failed requests meet neither. Found by searching the rate (doubling or halving from the start rate, "
              "then bisecting between a passing and a failing rate). This is not a sweep's `--goodput` column (SLO-met "
              "requests per second at each offered rate).")
LEGEND = ("Cells: the goodput in requests/s; `< X`: even the lowest rate probed (X) fails; `>= X`: the highest rate "
          "the search may probe (X, its ceiling: by default the closed-loop peak, past which a finite probe shows no "
          "sustained rate; where a ceiling above the peak was given, the probes above the peak were longer and judged "
          "by their TTFT backlog too) still passes; `[lo, hi)*`: the search stopped before the bracket closed (the "
          "frontier lies in it); `-`: not searched; `(passes X)`: a higher rate X passed as well, after the failure "
          "below it was probed again (the attainment was not monotone in rate: the bracket counts that pass as noise; "
          "by the highest passing rate alone the goodput would read X).")
ABOVE_LEGEND = ("Above the peak: a probe at a rate above the server's own closed-loop peak (the search's ceiling lay "
                "above it) sends more arrivals (--search-above-peak-factor x the counted requests) and fails every "
                "target where its TTFT backlog grew: u = TTFT / the request's TTFT limit, the medians of its first and "
                "last quarter of counted requests, and u projected one probe length on; GREW when that is over 1 "
                "(rapidserve/benchmark/sustain.py).")
ABOVE_COLUMN = "above the peak: arrivals, backlog"
RAMP_LEGEND = ("Warm-up (the ramp rule, rapidserve/benchmark/sustain.py): a Poisson probe starts from an empty server "
               "whose requests in flight ramp up to rate x lifetime over one request lifetime (Little's law), so each "
               "probe first sends a warm-up of the larger of --search-discard arrivals and those within 1.25 "
               "lifetimes (estimated from the probes before it) and counts only the later arrivals released after "
               "the lifetime it measured (its median E2E), and one left with fewer than half what it meant to count "
               "(at least 8) is SHORT, run once more with a warm-up from that lifetime, and fails every target if "
               "still short, or CAPPED where steady state needs more arrivals than the cap "
               "(--search-max-probe-arrivals, a trace's window); above the peak a probe the cap cut is CAPPED too "
               "where it counted fewer than it meant to, too short for the backlog rule.")
RAMP_COLUMN = "warm-up: arrivals (s), lifetime, verdict"


def goodput_cell(e: Mapping[str, Any] | None) -> str:
    """One target's goodput as a table cell (see LEGEND)."""
    if e is None or e.get("status") == NOT_SEARCHED:
        return "-"
    above = e.get("passes_above")
    head = _bracket_cell(e)
    return head if above is None else f"{head} (passes {fmt(above, '.3g')})"


def _bracket_cell(e: Mapping[str, Any]) -> str:
    lo, hi, status = e.get("lo"), e.get("hi"), e.get("status")
    if status == CONVERGED:
        return fmt(lo, ".3g")
    if status == BELOW_MIN:
        return f"< {fmt(hi, '.3g')}"
    if status == AT_MAX:
        return f">= {fmt(lo, '.3g')}"
    return f"[{fmt(lo, '.3g') if lo is not None else '0'}, {fmt(hi, '.3g') if hi is not None else '?'})*"


def search_probes(result: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """A search result's goodput probes: its probes but the one at --search-ttft-rate after the search (`ttft_probe`,
    which no bracket reads: search.py runs it, search_run.py marks it)."""
    return [p for p in result.get("probes", []) if not p.get("ttft_probe")]


def above_peak(result: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The goodput probes of a search result that lay above the server's own closed-loop peak."""
    return [p for p in search_probes(result) if p.get("above_peak")]


def backlog_cell(p: Mapping[str, Any]) -> str:
    """A probe's ABOVE_COLUMN cell: '-' at or below the peak, else its arrivals and backlog trend."""
    if not p.get("above_peak"):
        return "-"
    b = p.get("backlog")
    if b is None:
        return f"{p.get('arrivals')} arrivals; too few requests to judge the backlog"

    def u(x: float | None) -> str:
        return "inf" if x is None else f"{x:.2g}"

    return (f"{p.get('arrivals')} arrivals; TTFT/limit {u(b['first'])} -> {u(b['last'])}, projected "
            f"{u(b['projected'])}: " + ("GREW (fails every target)" if b["grew"] else "steady"))


def has_ramp(result: Mapping[str, Any]) -> bool:
    """Whether the result's probes say how their warm-up went (written since the ramp rule)."""
    return any(p.get("ramp") for p in result.get("probes", []))


def cap_name(result: Mapping[str, Any]) -> str:
    """What capped a probe's arrivals: the flag, or a trace's window."""
    return TRACE_CAP if result.get("trace") else CAP_FLAG


def ramp_cell(p: Mapping[str, Any], cap: str = CAP_FLAG) -> str:
    """A probe's RAMP_COLUMN cell: its warm-up and verdict (sustain.ramp_text), '-' where the result has none."""
    r = p.get("ramp")
    return ramp_text(r, cap) if r else "-"


def ramp_counts(result: Mapping[str, Any]) -> tuple[int, int, int]:
    """(short, capped, re-run) among a result's goodput probes."""
    ramps = [p["ramp"] for p in search_probes(result) if p.get("ramp")]
    return (sum(r.get("verdict") == SHORT for r in ramps), sum(r.get("verdict") == CAPPED for r in ramps),
            sum(r.get("then") == RERUN for r in ramps))


def ceiling_text(result: Mapping[str, Any]) -> str:
    """Where the search's ceiling (max rate) came from, and (above the peak) how those probes ran; '' where it is
    the closed-loop peak or the start rate x 8, as by default."""
    s = result["search"]
    source, peak = s.get("ceiling"), s.get("peak_request_throughput")
    if source in (None, OWN_PEAK, START_X8):
        return ""
    st = s["settings"]
    if peak is None or s["max_rate"] <= float(f"{peak:.3g}"):
        return f"the ceiling {s['max_rate']:g} req/s is {CEILING_WORDS[source]}"
    n = probe_arrivals(s["probe_requests"], st["discard"], st.get("above_peak_factor"))
    send = (f"count {n - st['discard']} arrivals after their warm-up" if "max_probe_arrivals" in st
            else f"send {n} arrivals")  # before the ramp rule: the discard, then the counted
    return (f"the ceiling {s['max_rate']:g} req/s is {CEILING_WORDS[source]}, above this server's own "
            f"{peak:.3g}: probes above {peak:.3g} {send} ({st.get('above_peak_factor') or 1:g} x the "
            "counted) and fail every target where their TTFT backlog grew")


def search_line(result: Mapping[str, Any]) -> str:
    """How the search ran, in one line."""
    s = result["search"]
    st = s["settings"]
    peak = s.get("peak_request_throughput")
    start = (f"{st['start_fraction']:g} x the closed-loop peak {peak:.3g} req/s" if peak is not None
             else "given") + (f", reused from {s['peak_reused_from']}" if s.get("peak_reused_from") else "")
    n, d = s["probe_requests"], st["discard"]
    probes = (f"{n} Poisson arrivals (the first {d} discarded as warm-up)" if "max_probe_arrivals" not in st else
              f"Poisson arrivals, {n - d} counted after a warm-up of at least {d} (the ramp rule: 1.25 request "
              f"lifetimes; at most {s.get('max_probe_arrivals') or st['max_probe_arrivals']} arrivals a probe)")
    return (f"search: start {s['start_rate']:g} req/s ({start}), rates within [{s['min_rate']:g}, "
            f"{s['max_rate']:g}], tolerance {st['tolerance']:.0%}, at most {st['max_probes']} probes of {probes}; "
            + (f"searched at {', '.join(bound_label(b) for b in st['only_bounds'])} only; "
               if st.get("only_bounds") is not None else "")
            + (f"{ceiling_text(result)}; " if ceiling_text(result) else "")
            + ("finished" if result.get("finished") else f"UNFINISHED: {result.get('stopped')}"))


def search_markdown(result: Mapping[str, Any]) -> str:
    """The goodput table (bound x share) and the per-rate attainment curve."""
    bounds, shares = search_bounds(result), search_shares(result)
    lines = [f"# rapidserve bench goodput search: {result.get('label')}", "",
             f"- server: {result.get('base_url')}, model `{result.get('model')}`",
             f"- workload: {workload_title(result.get('workload', {}))}",
             *([f"- {trace_line(result['trace'])}"] if result.get("trace") else []),
             f"- {DEFINITION}", f"- {search_line(result)}", f"- {result.get('created')}", "",
             "| ITL bound | " + " | ".join(f"goodput, {q:.0%} (req/s)" for q in shares) + " |",
             "|---" * (len(shares) + 1) + "|"]
    for b in bounds:
        lines.append(f"| {bound_label(b)} | " + " | ".join(goodput_cell(entry(result, b, q)) for q in shares) + " |")
    above = bool(above_peak(result))  # the column only where a probe lay above the peak
    ramp = has_ramp(result)  # and the warm-up's where the probes say (written since the ramp rule)
    lines += ["", LEGEND, "", "Attainment at each probed rate (share of the counted requests meeting the TTFT rule "
              "and the bound), in rate order; a rate probed twice (`again`: a failure below a pass, probed once "
              "more) is judged on the two pooled (a short probe's re-run: on the re-run alone). " + STEP_LEGEND
              + (" " + ABOVE_LEGEND if above else "") + (" " + RAMP_LEGEND if ramp else ""), "",
              "| rate (req/s) | probe | counted | " + (f"{RAMP_COLUMN} | " if ramp else "")
              + " | ".join(bound_label(b) for b in bounds)
              + f" | p99 TTFT (ms) | p99 ITL (ms) | failed | {STEP_COLUMN} |" + (f" {ABOVE_COLUMN} |" if above else ""),
              "|---" * (len(bounds) + 7 + above + ramp) + "|"]
    for p in sorted(result.get("probes", []), key=lambda p: float(p["rate"])):
        s = p["summary"]
        att = [fmt(p["attainment"].get(bound_key(b)), ".1%") for b in bounds]
        again = " (again)" if p.get("again") else ""  # a failure below a pass, probed once more (goodput.py)
        again += " (re-run)" if (p.get("ramp") or {}).get("rerun") else ""  # a short probe's second run
        lines.append(f"| {float(p['rate']):g} | {p['order']}{again} | {p['counted']} | "
                     + (f"{ramp_cell(p, cap_name(result))} | " if ramp else "") + " | ".join(att)
                     + f" | {fmt(s['ttft_ms'].get('p99'), '.0f')} | {fmt(s['itl_ms'].get('p99'), '.1f')}"
                     f" | {s['failed']} | {step_cell(p)} |" + (f" {backlog_cell(p)} |" if above else ""))
    return "\n".join(lines) + "\n"


def search_block(result: Mapping[str, Any]) -> str:
    """The search's result as a table printed at its end, in the form of `vllm bench serve`'s: the closed-loop peak,
    the probes, the goodput at each bound and share (cells as the markdown's: see LEGEND), how the search ended."""
    s = result["search"]
    peak, n = s.get("peak_request_throughput"), s["probe_requests"]
    above = above_peak(result)
    grew = sum(bool((p.get("backlog") or {}).get("grew")) for p in above)
    warm = [p["ramp"]["warmup"] for p in result.get("probes", []) if p.get("ramp")]
    lines = [title_line(" Goodput Search Result ", "="),
             table_row("Closed-loop peak (req/s):", float(peak) if peak is not None else "not measured"),
             *([table_row("Closed-loop peak reused from:", os.path.basename(s["peak_reused_from"]))]
               if s.get("peak_reused_from") else []),
             table_row("Start rate (req/s):", float(s["start_rate"])),
             table_row("Poisson probes:", len(result.get("probes", []))),
             table_row("Arrivals per probe, counted:", f"{n}, {n - s['settings']['discard']}") if not warm else
             table_row("Counted per probe, warm-up:", f"{n - s['settings']['discard']}, {min(warm)}-{max(warm)} "
                       "arrivals"),
             *([table_row("Ceiling (req/s):", f"{float(s['max_rate']):g} ({CEILING_WORDS[s['ceiling']]})")]
               if s.get("ceiling") not in (None, OWN_PEAK, START_X8) else []),
             *([table_row("Probes above the peak, backlog grew:", f"{len(above)}, {grew}")] if above else []),
             *([table_row("Probes short, capped, re-run:", ", ".join(map(str, ramp_counts(result))))]
               if has_ramp(result) else []),
             title_line("Goodput (req/s): TTFT rule and p95 ITL bound", "-")]
    for b in search_bounds(result):
        for q in search_shares(result):
            what = "no ITL bound" if b is None else f"ITL <= {b:g} ms"
            lines.append(table_row(f"{what}, {q:.0%} of requests:", goodput_cell(entry(result, b, q))))
    lines += ["Search: " + ("finished" if result.get("finished") else f"UNFINISHED ({result.get('stopped')}): "
                            "[lo, hi)* is the bracket so far"), "=" * WIDTH]
    return "\n".join(lines)


def write_search_outputs(result: Mapping[str, Any], out_dir: str, name: str,
                         plot: bool = True) -> tuple[dict[str, str], str | None]:
    """Write <out_dir>/<name>.json, .md and (with `plot`, when matplotlib is there) .png; their paths by kind,
    and a note when the plot could not be drawn."""
    base = os.path.join(out_dir, name)
    paths = write_json_and_markdown(result, out_dir, name, search_markdown(result))
    if not plot:
        return paths, None
    if not have_matplotlib():
        return paths, PLOT_NEEDS
    paths["png"] = plot_frontier([result], base + ".png", title=f"{result.get('label')}: goodput frontier, "
                                 f"{workload_title(result.get('workload', {}))}", attainment=True)
    return paths, None
