"""`bench/compare.py --goodput-search`: the goodput frontier of every system, side by side (pure, tested on CPU;
the files written from it at the end).

Per workload and system, the goodput search's result (rapidserve/benchmark/goodput.py: the highest Poisson
rate at which a share q of requests meet a per-request p95 ITL bound and the TTFT rule) at every bound and
share. The better vLLM at (workload, bound, share) is the highest goodput any vLLM system (vLLM at one of
its settings) reached there, and each of our systems' ratio is its goodput over that. A figure whose search
did not settle (unfinished, or beyond the rates probed) is a bound, not a value: its cell says so and a
ratio taken from it is marked `*`. RAPID-Serve's own baselines (`versus_ours`): the engine's default policy
(`reference`: the report's, else the composite row where duet@B systems ran, else `rapidserve`) over each other
system of ours (always-fused, always-split, hybrid at each chunk size, disagg-npmd, ...) and over the best hybrid
chunk at each bound.

The composite row "default (SLO = bound)" (bench/compare_slo.py): the adaptive policy (`--policy duet`, issue 37's
default) run with its ITL SLO set to each bound, its cell at bound B duet@B's goodput at B (unbounded: duet@none's).
It is computed from the duet@B frontiers whenever a report is written (never stored among the frontiers, so a merged
or continued report computes it afresh), drawn as the default policy's line (black, thick) in the frontier plot (the
duet@B systems, each searched at one bound, are not drawn), and its ratios stand for the duet@B systems' (which have
no ratio rows of their own).

A search whose ceiling lay above its own closed-loop peak (--search-max-rate, or --search-shared-ceiling: the
highest peak among the comparison's systems so far, bench/compare_peak.py) says so in its `search` column: the
ceiling, whose peak it was, and how many of its probes ran above its own peak (longer, with
--search-above-peak-factor) and how many of those failed on a growing TTFT backlog (rapidserve/benchmark/sustain.py).
A cell `>= X` is always X = that search's own ceiling, the highest rate it probed. A search whose closed-loop peak
was reused from an earlier report (--search-peak-from-prior, bench/compare_prior.py) says so there too, and from
which file.

Every probe's warm-up follows the ramp rule (rapidserve/benchmark/sustain.py: the larger of --search-discard
arrivals and those within 1.25 request lifetimes, so that the counted requests meet the server at its steady load);
the `search` column counts the probes that were short (too few arrivals after their lifetime, even once re-run) or
capped (steady state needs more than --search-max-probe-arrivals), each of which failed every target.

With --search-ttft-rate R each workload's section ends with every system's TTFT at R (bench/compare_ttft.py).

With --search-repeats N (bench/compare_repeats.py) every frontier is the median over N searches: its cells give the
median and the spread (`31 (30.9–33.5, n=3)`, a bracket of the median `[a, b]*` where a repetition did not settle),
the better vLLM and every ratio are taken of the medians (exact only where every repetition of both settled), the
plot draws the medians with the spread as error bars, and a table after each share's lists each repetition's cells.

The time budget (`--budget-s`): each search gets an even share of what is left, after the start-up time the
systems still to run will need (`search_deadline`, `startup_reserve`), so one slow search cannot starve the
others (with --search-repeats, each repetition is a search of its own); a search that runs out reports its brackets so
far, marked unfinished.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compare_ratios import (  # noqa: E402
    BEST_CHUNK,
    HYBRID_PREFIX,
    better_vllm,
    reference,
    searched_entry,
    versus_better_vllm,
    versus_ours,
    vllm_labels,
)
from compare_repeats import (  # noqa: E402
    REPEATS,
    REPEATS_LEGEND,
    cell,
    repeated_record,
    repeats_note,
    repeats_of,
    repeats_table,
    searches,
)
from compare_slo import COMPOSITE, composite, is_part, with_composite  # noqa: E402
from compare_ttft import ttft_lines  # noqa: E402

from rapidserve.benchmark.cli import safe_name  # noqa: E402
from rapidserve.benchmark.goodput import SHARED_PEAK, round_rate, share_note  # noqa: E402
from rapidserve.benchmark.goodput_report import (  # noqa: E402
    ABOVE_LEGEND,
    LEGEND,
    RAMP_LEGEND,
    above_peak,
    has_ramp,
    ramp_counts,
)
from rapidserve.benchmark.plot import PLOT_NEEDS, have_matplotlib, plot_frontier  # noqa: E402
from rapidserve.benchmark.report import jsonable  # noqa: E402
from rapidserve.benchmark.results import bound_label, entry, search_bounds, search_shares  # noqa: E402

# Start-up time guessed for a system still to run, by kind (vLLM: torch.compile and CUDA graphs, 2-3 min).
STARTUP_GUESS_S: dict[str, float] = {"vllm": 180.0, "rapidserve": 60.0, "ext": 0.0}


def search_deadline(now: float, deadline: float | None, searches_left: int, reserve_s: float) -> float | None:
    """The deadline of the next search: an even share of the time left after `reserve_s` (later systems'
    start-ups) over the `searches_left` searches (this one included). None: no budget."""
    if deadline is None:
        return None
    return now + max(0.0, deadline - now - reserve_s) / max(1, searches_left)


def startup_reserve(kinds: Sequence[str], measured: Mapping[str, float] | None = None) -> float:
    """The start-up time the systems of these kinds, still to run, will need: per system, the longest start-up of
    its kind `measured` so far in this run, else STARTUP_GUESS_S's guess (our five duet@B servers start in ~20 s
    each on one H200, a third of the guess: the first searches need not leave the guess's time to the later)."""
    return sum((measured or {}).get(k, STARTUP_GUESS_S.get(k, 60.0)) for k in kinds)


def frontier_record(res: Mapping[str, Any]) -> dict[str, Any]:
    """What the report keeps of a search result: its goodput entries, settings and per-probe attainment and server
    steps (rapidserve/benchmark/step_mix.py; every request stays in the result's own file, `path`). A repeated search
    (--search-repeats: "repeats", each repetition's result): its medians, each repetition's record kept
    (compare_repeats.repeated_record), with its number ("repeat") and the salt of its probes ("salt_base")."""
    if REPEATS in res:
        return repeated_record(res["label"], res["title"], [frontier_record(r) for r in res[REPEATS]])
    return {"label": res["label"], "title": res.get("title"), "workload": res["workload"], "path": res.get("path"),
            **{k: res[k] for k in ("repeat", "salt_base") if k in res},
            "search": res["search"], "goodput": res["goodput"], "finished": res["finished"],
            "stopped": res["stopped"],
            "probes": [{k: p.get(k) for k in ("rate", "order", "counted", "attainment", "summary", "server_steps",
                                              "server_step_correction", "again", "ttft_probe", "ramp", *ABOVE_KEYS)
                        if k in p or k not in (*ABOVE_KEYS, "again", "ttft_probe", "ramp")}
                       for p in res.get("probes", [])]}


ABOVE_KEYS = ("above_peak", "arrivals", "backlog")  # a probe above its own closed-loop peak (search_run.probe_extra)


def ceiling_note(f: Mapping[str, Any]) -> str:
    """A frontier's ceiling where it lay above its own closed-loop peak, and its probes above that peak: 'ceiling 12
    req/s (always-fused's peak) above its own peak 8.57: 3 probes above it (176 arrivals each), backlog grew in 1';
    '' where the ceiling was its own peak (or below it)."""
    s = f.get("search") or {}
    peak, top = s.get("peak_request_throughput"), s.get("max_rate")
    if peak is None or top is None or float(top) <= round_rate(float(peak)):
        return ""
    whose = (f"{s['shared_peak_system']}'s peak" if s.get("ceiling") == SHARED_PEAK and s.get("shared_peak_system")
             else "--search-max-rate" if s.get("ceiling") != SHARED_PEAK else "a shared peak")
    above = above_peak(f)
    arrivals = sorted({p.get("arrivals") for p in above if p.get("arrivals") is not None})
    grew = sum(bool((p.get("backlog") or {}).get("grew")) for p in above)
    each = f" ({', '.join(str(n) for n in arrivals)} arrivals each)" if arrivals else ""
    return (f"ceiling {float(top):g} req/s ({whose}) above its own peak {float(peak):.3g}: {len(above)} probe(s) "
            f"above it{each}, backlog grew in {grew}")


def peak_note(f: Mapping[str, Any]) -> str:
    """Where a search's closed-loop peak was reused from an earlier report instead of measured
    (--search-peak-from-prior): 'closed-loop peak 1.67 reused from trace_mooncake.json'; else ''."""
    s = f.get("search") or {}
    src, peak = s.get("peak_reused_from"), s.get("peak_request_throughput")
    if not src:
        return ""
    return f"closed-loop peak {float(peak):.3g} reused from {os.path.basename(str(src))}"


def ramp_note(f: Mapping[str, Any]) -> str:
    """A frontier's probes that did not reach steady state (the ramp rule): '2 probe(s) short, 1 capped (failed every
    target), 3 re-run'; '' where none was short or capped."""
    short, capped, rerun = ramp_counts(f)
    if not short and not capped:
        return ""
    return f"{short} probe(s) short, {capped} capped (failed every target), {rerun} re-run"


def _ratio(x: Mapping[str, Any] | None) -> str:
    """A ratio's cell: `1.23x` where both searches settled, else the range it lies in (module docstring)."""
    if x is None:
        return "-"
    if x["exact"]:
        return "-" if x["ratio"] is None else f"{x['ratio']:.2f}x"
    least, greatest = x.get("ratio_lo") or 0.0, x.get("ratio_hi")
    if least > 0 and greatest is not None:
        return f"{least:.2f}x*" if f"{least:.2f}" == f"{greatest:.2f}" else f"{least:.2f}–{greatest:.2f}x*"
    if least > 0:
        return f">= {least:.2f}x*"
    return "?*" if greatest is None else f"<= {greatest:.2f}x*"


def _better_cell(frontiers: Sequence[Mapping[str, Any]], title: str, best: Mapping[str, Any] | None,
                 bound: float | None, share: float) -> str:
    """The better vLLM's cell: its system's own goodput cell (a bracket stays a bracket: an unfinished search's
    lower bound is not its goodput) and which setting it is."""
    if best is None:
        return "-"
    f = next(f for f in frontiers if f["title"] == title and f["label"] == best["system"])
    return f"{cell(searched_entry(f, bound, share))} (`{best['system']}`)"


def _search_cell(f: Mapping[str, Any]) -> str:
    """The table's last column: how the row's search ended (the composite row: which searches it reads)."""
    done = "finished" if f["finished"] else f"unfinished ({f['stopped']})"
    if f["label"] == COMPOSITE:
        parts = ", ".join(f"`{label}` at {bound_label(None if k == 'unbounded' else float(k))}"
                          for k, label in f["parts"].items())
        return f"composite of {parts}; {done}"
    only = f["search"]["settings"].get("only_bounds")
    note = ("; ".join(x for x in (peak_note(f), ceiling_note(f), ramp_note(f)) if x) if REPEATS not in f
            else repeats_note(f))
    done = done if not note else f"{note}; {done}"
    return done if only is None else f"searched at {', '.join(bound_label(b) for b in only)} only; {done}"


def frontier_markdown(frontiers: Sequence[Mapping[str, Any]], meta: Mapping[str, Any]) -> str:
    """The report: per workload and share, goodput by system and ITL bound (with the composite row where duet@B
    systems ran), the better vLLM and our ratios."""
    vllm = vllm_labels(meta)
    ref = reference(frontiers, meta.get("reference"))
    rows = with_composite(frontiers)
    vs, own = versus_better_vllm(rows, vllm), versus_ours(rows, vllm, ref)
    lines = [f"# rapidserve compare: goodput frontier, {meta.get('model')}", "",
             f"- {meta.get('created')}; serve args: `{meta.get('serve_args') or '(none)'}`; "
             f"{meta.get('probe_text') or meta.get('per_rate')}",
             "- goodput at (p95 ITL bound B, share q): the highest Poisson rate (req/s) at which at least q of the "
             "requests meet both B (the p95 of the request's own inter-token gaps) and the TTFT rule (TTFT <= "
             "max(1 s, 1 s per 1000 prompt tokens)), found per system by searching the rate "
             "(rapidserve/benchmark/goodput.py). The better vLLM: the best of the vLLM settings at each bound.",
             f"- {LEGEND} A ratio marked `*` is a range, not a value: a search on either side did not settle, "
             "and the ratio lies in `a–bx*` (our lower bound over the other's upper, our upper over its lower; "
             f"`>= ax*` or `<= bx*` with one side unbounded, `?*` with neither). `{ref} / X`: "
             f"the engine's default policy over our other systems (RAPID-Serve's baselines; `{BEST_CHUNK}`: the best "
             f"`{HYBRID_PREFIX}*` at each bound).", ""]
    ramp = any(has_ramp(s) for f in frontiers for s in searches(f))
    if repeats_of(frontiers):
        lines[-1:-1] = [f"- {REPEATS_LEGEND}"]
    if any(above_peak(s) for f in frontiers for s in searches(f)):
        lines[-1:-1] = [f"- {ABOVE_LEGEND} The `search` column says which searches went above their own peak."
                        + (f" {RAMP_LEGEND} It also counts the probes short or capped." if ramp else "")]
    elif ramp:
        lines[-1:-1] = [f"- {RAMP_LEGEND} The `search` column counts the probes short or capped."]
    if len(rows) > len(frontiers):
        lines[-1:-1] = [f"- **{COMPOSITE}**: the adaptive policy (`--policy duet`, issue 37's default) as a user who "
                        "needs bound B runs it, "
                        "with `--slo-itl-ms B`: its cell at B is `duet@B`'s goodput (a server started with that SLO, "
                        "searched at B alone; unbounded: `duet@none`, no SLO, maximising throughput). The `duet@B` "
                        "rows show their own bound only; the ratios are the composite's."]
    for s in meta.get("systems", []):
        lines.append(f"- {s['label']}: `{s['flags']}` - {s['status']}")
    for w in meta.get("workloads", []):
        lines.append(f"- workload {w['title']}: `rapidserve bench {w['flags']}`")
    for title in dict.fromkeys(f["title"] for f in rows):
        mine = [f for f in rows if f["title"] == title]
        bounds = search_bounds(mine[0])
        lines += ["", f"## {title}"]
        for q in search_shares(mine[0]):
            head = ["system", *(bound_label(b) for b in bounds), "search"]
            note = share_note(q, [p.get("counted") or 0 for f in mine for s in searches(f)
                                  for p in s.get("probes") or []])
            lines += ["", f"Goodput (req/s) with {q:.0%} of requests meeting the bound and the TTFT rule"
                      + (f" ({note}):" if note else ":"), "",
                      "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
            for f in mine:
                name = f"**{COMPOSITE}**" if f["label"] == COMPOSITE else f["label"]
                lines.append(f"| {name} | " + " | ".join(cell(entry(f, b, q)) for b in bounds)
                             + f" | {_search_cell(f)} |")
            for other in dict.fromkeys(x["over"] for x in own if x["workload"] == title and x["share"] == q):
                cells = [_ratio(next((x for x in own if x["over"] == other and x["workload"] == title
                                      and x["itl_bound_ms"] == b and x["share"] == q), None)) for b in bounds]
                lines.append(f"| {ref} / {other} | " + " | ".join(cells) + " | |")
            if any(f["label"] in vllm for f in mine):
                lines += _vllm_rows(rows, mine, vllm, vs, title, bounds, q)
            lines += repeats_table(mine, bounds, q, _search_cell)
        lines += ttft_lines([f for f in frontiers if f["title"] == title], vllm)
    return "\n".join(lines) + "\n"


def _vllm_rows(rows: Sequence[Mapping[str, Any]], mine: Sequence[Mapping[str, Any]], vllm: set[str],
               vs: Sequence[Mapping[str, Any]], title: str, bounds: Sequence[float | None], q: float) -> list[str]:
    """A share's table's better-vLLM row, then each of our systems' ratio to it."""
    best = [better_vllm(rows, vllm, title, b, q) for b in bounds]
    lines = ["| **better vLLM** | " + " | ".join(
        _better_cell(rows, title, x, b, q) for x, b in zip(best, bounds, strict=True)) + " | |"]
    for f in mine:
        if f["label"] in vllm or is_part(f["label"]):
            continue
        cells = [_ratio(next((x for x in vs if x["system"] == f["label"] and x["workload"] == title
                              and x["itl_bound_ms"] == b and x["share"] == q), None)) for b in bounds]
        lines.append(f"| {f['label']} / better vLLM | " + " | ".join(cells) + " | |")
    return lines


def write_frontier_report(a: argparse.Namespace, meta: dict[str, Any], results: Sequence[Mapping[str, Any]],
                          plot: bool, prior: Mapping[str, Any] | None = None) -> list[str]:
    """<name>.json, <name>.md and (with `plot`, when matplotlib is there) one <name>__<workload>_frontier.png per
    workload, from the search results so far (after an earlier report's, `--continue-from`); their paths. The
    JSON's "composite" holds the composite rows, "reference" the system the ratios divide by."""
    frontiers = [*(prior.get("frontiers", []) if prior else []), *(frontier_record(r) for r in results)]
    rows = with_composite(frontiers)
    base = os.path.join(a.out, a.name)
    plots: dict[str, str] = {}
    if plot and frontiers and have_matplotlib():
        for title in dict.fromkeys(f["title"] for f in frontiers):
            path = f"{base}__{safe_name(title)}_frontier.png"
            drawn = [f for f in rows if f["title"] == title and not is_part(f["label"])]
            plots[title] = plot_frontier(drawn, path, title=f"{meta.get('model')}: goodput frontier, {title}",
                                         emphasis=(COMPOSITE,))
    elif plot and frontiers:
        print(f"compare: no frontier plots: {PLOT_NEEDS}", flush=True)
    vllm = vllm_labels(meta)
    ref = reference(frontiers, meta.get("reference"))
    with open(base + ".json", "w") as f:
        json.dump(jsonable({**meta, "reference": ref, "rows": [], "sweeps": [], "frontiers": frontiers,
                            "composite": composite(frontiers), "versus_better_vllm": versus_better_vllm(rows, vllm),
                            "versus_ours": versus_ours(rows, vllm, ref), "plots": plots}), f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(frontier_markdown(frontiers, meta))
    return [base + ".json", base + ".md", *plots.values()]
