"""The adaptive policy (`--policy duet`, the default issue 37 asks for) with its ITL SLO set to each bound: the
`duet@B` systems of bench/compare.py and the goodput frontier's composite row "default (SLO = bound)" (pure, tested
on CPU).

A user who needs p95 ITL <= B runs `rapidserve serve --policy duet --slo-itl-ms B`, so the policy's goodput at bound
B is that of a server started with SLO = B, not that of one server (SLO 50 ms, the flag's default) read at every
bound.

- `duet@B` (B in ms): `--mode rapid --policy duet --slo-itl-ms B`, searched at bound B alone (its search's
  `only_bounds`: the probes follow B's targets and stop once B's brackets close; the other bounds' cells read `-`).
- `duet@none`: `--slo-itl-ms none` (no ITL SLO: the policy maximises throughput, every step fused with the whole
  --max-num-batched-tokens budget, never split; without the flag the SLO would be 50 ms), searched unbounded alone.

The engine reads its SLO once, at start, from its frozen config (no runtime knob), so each duet@B is a server of its
own. The composite row (`composite`), per workload: at each bound B and share, duet@B's goodput at B (unbounded:
duet@none's), with its status (a ratio taken of it is exact only where that search settled); a bound whose duet@B
did not run is `-`. It is finished when every duet@B it reads finished.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from rapidserve.benchmark.goodput import bound_key
from rapidserve.benchmark.results import entry, search_shares

SLO_POLICY = "duet"  # the engine's adaptive policy, whose SLO each system sets
SLO_PREFIX = SLO_POLICY + "@"
SLO_FLAGS = "--mode rapid --policy duet --slo-itl-ms"
NO_SLO = "none"  # --slo-itl-ms's word for no ITL SLO (rapidserve/cli_args.py)
COMPOSITE = "default (SLO = bound)"
SLO_BOUNDS: tuple[float | None, ...] = (25.0, 50.0, 100.0, 200.0, None)  # frontier_plan.py's group ours-slo


def slo_label(bound: float | None) -> str:
    """duet@25, duet@50, ..., duet@none."""
    return SLO_PREFIX + (NO_SLO if bound is None else f"{bound:g}")


def parse_slo_system(name: str) -> tuple[str, str, float | None] | None:
    """`duet@B` or `duet@none` as (its label, its `rapidserve serve` flags, the bound it is searched at: B, or None:
    unbounded); None for a name of another form. ValueError when B is not a positive finite number of ms or none."""
    if not name.startswith(SLO_PREFIX):
        return None
    text = name[len(SLO_PREFIX):].strip()
    if text.lower() == NO_SLO:
        return slo_label(None), f"{SLO_FLAGS} {NO_SLO}", None
    try:
        b = float(text)
    except ValueError:
        b = math.nan
    if not (b > 0 and math.isfinite(b)):
        raise ValueError(f"--systems: {name}: give {SLO_PREFIX}B with B the ITL SLO in ms (e.g. {slo_label(50.0)}), "
                         f"or {slo_label(None)} for no SLO")
    return slo_label(b), f"{SLO_FLAGS} {b:g}", b


def slo_bound(label: str) -> tuple[bool, float | None]:
    """(whether `label` is a duet@B system's, its bound: B, None for duet@none)."""
    try:
        got = parse_slo_system(label)
    except ValueError:
        return False, None
    return (got is not None and got[0] == label), (got[2] if got is not None else None)


def is_part(label: str) -> bool:
    """Whether `label` is a duet@B system's (a part of the composite row)."""
    return slo_bound(label)[0]


def composite(frontiers: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The composite row of each workload that has a duet@B frontier, as a frontier record (label COMPOSITE): its
    entries are each duet@B's at its own bound B (with "system": that label), "parts" {bound key: label}."""
    out: list[dict[str, Any]] = []
    for title in dict.fromkeys(f["title"] for f in frontiers):
        parts: dict[str, tuple[float | None, Mapping[str, Any]]] = {}
        for f in frontiers:
            ok, b = slo_bound(f["label"])
            if ok and f["title"] == title:
                parts.setdefault(bound_key(b), (b, f))
        if not parts:
            continue
        bounds = sorted({float(x) for _, f in parts.values() for x in f["search"]["settings"]["itl_bounds_ms"]})
        shares = sorted({q for _, f in parts.values() for q in search_shares(f)})
        entries: list[dict[str, Any]] = []
        for b, f in sorted(parts.values(), key=lambda p: math.inf if p[0] is None else p[0]):
            entries += [{**e, "system": f["label"]} for e in (entry(f, b, q) for q in shares) if e is not None]
        stopped = [f"{f['label']}: {f['stopped']}" for _, f in parts.values() if not f["finished"]]
        first = next(iter(parts.values()))[1]
        out.append({"label": COMPOSITE, "title": title, "workload": first.get("workload"), "path": None,
                    "search": {"settings": {"itl_bounds_ms": bounds, "shares": shares}}, "goodput": entries,
                    "finished": not stopped, "stopped": "; ".join(stopped) or None, "probes": [],
                    "parts": {k: f["label"] for k, (_, f) in parts.items()}})
    return out


def with_composite(frontiers: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The frontiers, each workload's composite row just before its first duet@B row."""
    rows = composite(frontiers)
    out: list[Mapping[str, Any]] = []
    for f in frontiers:
        if is_part(f["label"]):
            out += [r for r in rows if r["title"] == f["title"] and r not in out]
        out.append(f)
    return out
