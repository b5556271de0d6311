"""The goodput frontier's ratios (bench/compare_frontier.py; pure, tested on CPU): the better vLLM at each
(workload, bound, share), each of our systems' goodput over it (`versus_better_vllm`), the engine default's over
our other systems and the best hybrid chunk (`versus_ours`), and the range a ratio lies in where a search did not
settle (`ratio_range`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from compare_repeats import entry_bounds
from compare_slo import COMPOSITE, is_part

from rapidserve.benchmark.goodput import CONVERGED, NOT_SEARCHED
from rapidserve.benchmark.results import entry, search_bounds, search_shares

REFERENCE = "rapidserve"  # the engine's default policy: the system RAPID-Serve's own baselines are divided into
HYBRID_PREFIX = "hybrid-"  # hybrid at one chunk size (--max-num-batched-tokens): hybrid-512, hybrid-1024, ...
BEST_CHUNK = "best hybrid chunk"


def searched_entry(f: Mapping[str, Any], bound: float | None, share: float) -> dict[str, Any] | None:
    """A frontier's entry at (bound, share), None where it has none or did not search that bound (duet@B's others)."""
    e = entry(f, bound, share)
    return None if e is None or e.get("status") == NOT_SEARCHED else e


def reference(frontiers: Sequence[Mapping[str, Any]], given: str | None = None) -> str:
    """The system the `X / Y` rows divide by: `given`, else the composite row where duet@B systems ran, else
    REFERENCE (the engine's default policy as `rapidserve serve` runs it without flags)."""
    return given or (COMPOSITE if any(is_part(f["label"]) for f in frontiers) else REFERENCE)


def better_vllm(frontiers: Sequence[Mapping[str, Any]], vllm: set[str], title: str, bound: float | None,
                share: float) -> dict[str, Any] | None:
    """The vLLM system with the highest goodput at (bound, share) on the workload: {"system", "goodput", "status",
    "lower", "upper"}; None when no vLLM system was searched there. (Of any set of labels: the best of them.) "lower"
    and "upper" bound the best of them where searches did not settle: the largest of their lower bounds and the
    largest of their upper ones (math.inf: none), so a ratio to it is bounded whichever of them is truly best."""
    best: dict[str, Any] | None = None
    lower, upper = 0.0, 0.0
    for f in frontiers:
        e = searched_entry(f, bound, share) if f["title"] == title and f["label"] in vllm else None
        if e is None:
            continue
        lo, up = entry_bounds(e)
        lower, upper = max(lower, lo), max(upper, up)
        if best is None or e["goodput"] > best["goodput"]:
            best = {"system": f["label"], "goodput": float(e["goodput"]), "status": e["status"]}
    if best is not None:
        best.update(lower=lower, upper=upper)
    return best


def ratio_range(mine: tuple[float, float], theirs: tuple[float, float]) -> tuple[float, float]:
    """(least, greatest) our goodput over theirs can be, each given as (lower, upper) bounds (upper math.inf: none):
    our lower over their upper (0 where theirs is unbounded above), our upper over their lower (math.inf where
    theirs may be 0 or ours is unbounded above). Pure."""
    (lo_m, up_m), (lo_t, up_t) = mine, theirs
    least = 0.0 if math.isinf(up_t) or up_t <= 0 else lo_m / up_t
    greatest = math.inf if lo_t <= 0 or math.isinf(up_m) else up_m / lo_t
    return least, greatest


def _versus(e: Mapping[str, Any], best: Mapping[str, Any]) -> dict[str, Any]:
    """The ratio fields of our entry `e` over `best` (better_vllm's): the ratio of the goodputs (None where theirs is
    0), whether both settled, and the range the ratio lies in."""
    least, greatest = ratio_range(entry_bounds(e), (best["lower"], best["upper"]))
    return {"ratio": float(e["goodput"]) / best["goodput"] if best["goodput"] > 0 else None,
            # exact where ours settled and so did the best of theirs: every setting that could be the best settled at
            # it (an unsettled one whose upper bound lies above leaves lower < upper)
            "exact": e["status"] == CONVERGED and best["status"] == CONVERGED and best["lower"] == best["upper"],
            "ratio_lo": least, "ratio_hi": None if math.isinf(greatest) else greatest}


def versus_better_vllm(frontiers: Sequence[Mapping[str, Any]], vllm: set[str]) -> list[dict[str, Any]]:
    """Per workload, system other than vLLM's, bound and share: its goodput over the better vLLM's (None when
    that is 0), `exact` False when either figure is a bound (a search that did not settle). The duet@B systems have
    none: the composite row, where `frontiers` hold it (with_composite), has theirs."""
    out: list[dict[str, Any]] = []
    for f in frontiers:
        if f["label"] in vllm or is_part(f["label"]):
            continue
        for q in search_shares(f):
            for b in search_bounds(f):
                e, best = searched_entry(f, b, q), better_vllm(frontiers, vllm, f["title"], b, q)
                if e is None or best is None:
                    continue
                out.append({"system": f["label"], "workload": f["title"], "itl_bound_ms": b, "share": q,
                            "goodput": float(e["goodput"]), "better_vllm": best["goodput"],
                            "better_vllm_system": best["system"], **_versus(e, best)})
    return out


def versus_ours(frontiers: Sequence[Mapping[str, Any]], vllm: set[str], ref: str = REFERENCE) -> list[dict[str, Any]]:
    """RAPID-Serve's own baselines: per workload, bound and share, `ref`'s goodput (the engine's default policy)
    over each other system of ours (hybrid at a chunk size, disagg-npmd, ...) and over the best hybrid chunk
    (`BEST_CHUNK`: the best of the `hybrid-*` systems at that bound, where two or more ran); `ratio` None where
    the other's goodput is 0, `exact` False where either figure is a bound. Nothing without a `ref` frontier.
    The duet@B systems are the composite row's parts, not baselines of it."""
    out: list[dict[str, Any]] = []
    chunks = {f["label"] for f in frontiers if f["label"].startswith(HYBRID_PREFIX) and f["label"] not in vllm | {ref}}
    for r in (f for f in frontiers if f["label"] == ref):
        others = [f["label"] for f in frontiers if f["title"] == r["title"] and f["label"] not in vllm | {ref}
                  and not is_part(f["label"])]
        for q in search_shares(r):
            for b in search_bounds(r):
                mine = searched_entry(r, b, q)
                if mine is None:
                    continue
                for other in [*others, *([BEST_CHUNK] if len(chunks) >= 2 else [])]:
                    best = better_vllm(frontiers, chunks if other == BEST_CHUNK else {other}, r["title"], b, q)
                    if best is None:
                        continue
                    out.append({"system": ref, "over": other, "over_system": best["system"], "workload": r["title"],
                                "itl_bound_ms": b, "share": q, "goodput": float(mine["goodput"]),
                                "over_goodput": best["goodput"], **_versus(mine, best)})
    return out


def vllm_labels(meta: Mapping[str, Any]) -> set[str]:
    return {s["label"] for s in meta.get("systems", []) if s.get("kind") == "vllm"}
