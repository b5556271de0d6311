"""The server's step series over one run, as `rapidserve bench` reports them (pure: no I/O).

A rapidserve server counts its decode worker's landed steps by the shape its policy chose (label `kind`: fused, a
mixed step with prompt tokens; fused_decode, a fused step without any; split, decode beside the prefill worker;
alone, decode alone) in cumulative series: `rapidserve:steps_total`, `step_seconds_total` (measured),
`steps_over_slo_total` (longer than its ITL SLO), and over the steps that had a prediction
`step_predicted_seconds_total` and `step_predicted_measured_seconds_total`; and its policy's online correction now,
the gauge `rapidserve:step_correction_ratio{kind}` (rapidserve/server/metrics.py). The bench scrapes /metrics
before and after each run (a sweep's rate, a goodput probe: client.server_counters, which reads each line through
`parse_line`) and `step_deltas` keeps, in the run's JSON:

- "server_steps": per kind that had steps in the run, the raw deltas {"steps", "measured_s", "over_slo", "predicted_s",
  "predicted_measured_s", "gaps", "gap_s", "gaps_over_slo", "idle_s", "host_s"} (the last five: the host's view,
  engine/step_tally.py);
- "server_step_correction": the ratios at the run's end, per correction kind (fused, split, decode).

A server without these series (vLLM) gives neither, and `step_cell` says "-". The workers report their counts every
`stats_interval_s` (0.25 s by default), so a run's window is the scrapes' give or take that.

`step_cell(run)`: the run in one compact cell (STEP_COLUMN): each kind's share of the steps, then in brackets its
mean measured step (how much of the SLO its steps fill; - where none was timed), its measured / predicted time (-
where none of its steps had a prediction) and the share of its steps over the SLO, e.g.
"fused 62% (43.5 ms; 1.08, 6.1%) / split 30% (20.0 ms; 0.97, 0.2%) / alone 8% (-; -, 0%)"; from a server that reports
its host's view, each kind's bracket adds the share of the token gaps ending at its steps that were over the SLO, the
device's mean idle time before its steps and the host's mean time to plan and launch one: "fused 62% (43.5 ms; 1.08,
6.1%; gaps 9.5% over, idle 0.4 ms, host 3.1 ms)"; from a server whose policy adapts its SLO margin (duet), the
margin at the run's end last: "... / margin 0.95" (its gauge `step_correction_ratio{kind="slo_margin"}`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# the counters' names (without rapidserve: and _total) -> the run's JSON field
SERIES: dict[str, str] = {"steps": "steps", "step_seconds": "measured_s", "steps_over_slo": "over_slo",
                          "step_predicted_seconds": "predicted_s",
                          "step_predicted_measured_seconds": "predicted_measured_s", "step_gaps": "gaps",
                          "step_gap_seconds": "gap_s", "step_gaps_over_slo": "gaps_over_slo",
                          "step_idle_seconds": "idle_s", "step_host_seconds": "host_s"}
COUNTS = ("steps", "over_slo", "gaps", "gaps_over_slo")  # the fields kept as whole numbers
KINDS = ("fused", "fused_decode", "split", "alone")  # the server's kinds, in display order (others after them)
LABELS = {"fused_decode": "fused-dec"}
STEP_COLUMN = "server steps: kind share (mean step; measured/predicted, over SLO)"
STEP_LEGEND = ("The server's steps (rapidserve's /metrics over the run; `-` for a server without them): each shape "
               "kind's share of the decode worker's steps (fused with prompt tokens, fused-dec without, split beside "
               "the prefill worker, alone), then its measured / predicted step time (`-`: no prediction) and the "
               "share of its steps longer than the server's ITL SLO.")

_COUNTER = re.compile(r"^rapidserve:(" + "|".join(SERIES) + r")_total\{([^}]*)\}\s+(\S+)\s*$")
_GAUGE = re.compile(r"^rapidserve:step_correction_ratio\{([^}]*)\}\s+(\S+)\s*$")
_KIND = re.compile(r'kind="([^"]*)"')
_STEP, _CORRECTION = "step:", "step_correction:"  # keys in a scrape's dict: step:<field>:<kind>, step_correction:<kind>


def parse_line(line: str) -> tuple[str, float] | None:
    """One /metrics line of the step series as (key in a scrape's dict, value), or None for any other line."""
    m = _COUNTER.match(line)
    if m:
        kind = _KIND.search(m.group(2))
        return (f"{_STEP}{SERIES[m.group(1)]}:{kind.group(1)}", float(m.group(3))) if kind else None
    g = _GAUGE.match(line)
    if g:
        kind = _KIND.search(g.group(1))
        return (f"{_CORRECTION}{kind.group(1)}", float(g.group(2))) if kind else None
    return None


def _ordered(kinds: Mapping[str, Any]) -> list[str]:
    return [k for k in KINDS if k in kinds] + sorted(k for k in kinds if k not in KINDS)


def step_deltas(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, Any]:
    """What a run adds to its JSON from two scrapes (module docstring): {} when the server has no step series or
    counted no step in between."""
    kinds: dict[str, dict[str, float]] = {}
    for key, v in after.items():
        if key.startswith(_STEP):
            field, kind = key[len(_STEP):].split(":", 1)
            kinds.setdefault(kind, {})[field] = v - before.get(key, 0.0)
    steps: dict[str, dict[str, float | int]] = {}
    for kind in _ordered(kinds):
        d = kinds[kind]
        n = round(d.get("steps", 0.0))
        if n > 0:
            steps[kind] = {f: round(d.get(f, 0.0)) if f in COUNTS else round(d.get(f, 0.0), 6)
                           for f in SERIES.values()}
    if not steps:
        return {}
    out: dict[str, Any] = {"server_steps": steps}
    ratios = {key[len(_CORRECTION):]: v for key, v in after.items() if key.startswith(_CORRECTION)}
    if ratios:
        out["server_step_correction"] = ratios
    return out


def _share(x: float) -> str:
    return "0%" if x == 0 else f"{x:.1%}"


def step_cell(run: Mapping[str, Any]) -> str:
    """One run's steps in one compact cell (module docstring); "-" without any."""
    steps = run.get("server_steps")
    if not steps:
        return "-"
    total = sum(d["steps"] for d in steps.values()) or 1
    parts = []
    for kind in _ordered(steps):
        d = steps[kind]
        p = d.get("predicted_s") or 0.0
        ratio = f"{d.get('predicted_measured_s', 0.0) / p:.2f}" if p > 0 else "-"
        over = _share(d["over_slo"] / d["steps"])
        host = ""
        if d.get("gaps"):  # a server that reports the host's view (older ones do not)
            idle_ms, host_ms = (1e3 * d.get(f, 0.0) / d["steps"] for f in ("idle_s", "host_s"))
            host = (f"; gaps {_share(d.get('gaps_over_slo', 0) / d['gaps'])} over, idle {idle_ms:.1f} ms, "
                    f"host {host_ms:.1f} ms")
        mean = f"{1e3 * d['measured_s'] / d['steps']:.1f} ms" if d.get("measured_s") else "-"
        parts.append(f"{LABELS.get(kind, kind)} {d['steps'] / total:.0%} ({mean}; {ratio}, {over}{host})")
    margin = (run.get("server_step_correction") or {}).get("slo_margin")
    if margin is not None:  # duet's adapted SLO margin at the run's end (partition/margin.py)
        parts.append(f"margin {margin:.3g}")
    return " / ".join(parts)
