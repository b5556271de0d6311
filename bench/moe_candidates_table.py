"""The tables of bench/moe_candidates.py (its docstring says what each column is): one for the decode rows, one for
the prefill rows, their columns driven by the candidates measured (`Candidate.head`: "ours", "vLLM", "torch"), each
in the same place whatever the others are, so a report written before a candidate existed (its rows lacking that
candidate's keys) still renders, '-' in that candidate's cells.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from bench.moe_candidate_kernels import Candidate

Row = dict[str, object]


def cell(v: object, fmt: str, scale: float = 1.0) -> str:
    """v (scaled) in `fmt`; '-' where it is missing (None, NaN). fmt 'd': a whole number as it is."""
    if not isinstance(v, (int, float)) or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, fmt) if fmt == "d" else format(float(v) * scale, fmt)


def err_cell(r: Row, names: list[str]) -> str:
    """Each candidate's relative error against the reference, then the largest between two candidates."""
    return " / ".join(cell(r.get(f"{n}_err"), ".1e") for n in [*names, "between"])


def note(r: Row, names: list[str]) -> str:
    """Why the row or a candidate's cells are empty ('|' kept out of the cell)."""
    keys = ["error", *(f"{n}_why" for n in names)]
    return "; ".join(str(r[key]) for key in keys if r.get(key)).replace("|", "/")


def heading(copy_bw: float, cands: list[Candidate]) -> str:
    """The copy bandwidth, then each candidate's version, or why it was not measured."""
    said = [c.title if c.run is not None else f"{c.label} not measured: {c.why}" for c in cands
            if c.run is None or c.title]
    return "; ".join([f"copy bandwidth {copy_bw / 1e12:.2f} TB/s (read+write)", *said])


def columns(phase: str, cands: list[Candidate]) -> list[tuple[str, Callable[[Row], str]]]:
    """(heading, the cell of a row) of each column of `phase`'s table: per candidate its graph us, its time over
    ours (each but ours, where ours is measured), its share of the limit, its eager us; the errors; per candidate
    its tiles / config; the note."""
    decode = phase == "decode"
    limit, of, limit_key, us = ("ceiling us", "of ceiling", "ceiling_ms", ".1f") if decode else \
        ("bound us", "of bound", "bound_ms", ".0f")
    names = [c.name for c in cands]
    others = [c for c in cands if c.name != "ours"] if "ours" in names else []
    cols: list[tuple[str, Callable[[Row], str]]] = [
        ("model", lambda r: str(r["model"])), ("tp", lambda r: str(r["tp"])),
        ("decode batch" if decode else "prefill tokens", lambda r: str(r["tokens"])),
        ("unique experts", lambda r: cell(r.get("unique_experts"), "d")),
        (limit, lambda r: cell(r.get(limit_key), us, 1e3))]
    if not decode:
        cols.append(("bound by", lambda r: str(r.get("bound_by", "-"))))
    cols += [(f"{c.head} us", lambda r, n=c.name: cell(r.get(f"{n}_ms"), us, 1e3)) for c in cands]
    cols += [(f"{c.head}/ours", lambda r, n=c.name: cell(r.get(f"{n}_over_ours"), ".2f")) for c in others]
    cols += [(f"{c.head} {of}", lambda r, n=c.name: cell(r.get(f"{n}_of_limit"), ".2f")) for c in cands]
    cols += [(f"{c.head} eager us", lambda r, n=c.name: cell(r.get(f"{n}_eager_ms"), us, 1e3)) for c in cands]
    cols.append((f"rel err {' / '.join(c.head for c in cands)} / between", lambda r: err_cell(r, names)))
    cols += [(f"{c.head} {c.config_head}", lambda r, n=c.name: str(r.get(f"{n}_config") or "-")) for c in cands]
    cols.append(("note", lambda r: note(r, names) or "-"))
    return cols


def table(rows: list[Row], copy_bw: float, cands: list[Candidate]) -> str:
    """The decode table, then the prefill table (bench/moe_candidates.py's docstring for the columns), of the
    candidates `cands` in their order."""
    out = [heading(copy_bw, cands), ""]
    for phase in ("decode", "prefill"):
        mine = [r for r in rows if r["phase"] == phase]
        if not mine:
            continue
        cols = columns(phase, cands)
        out += ["| " + " | ".join(head for head, _ in cols) + " |", "|" + "---|" * len(cols)]
        out += ["| " + " | ".join(fn(r) for _, fn in cols) + " |" for r in mine]
        out.append("")
    return "\n".join(out).rstrip("\n")
