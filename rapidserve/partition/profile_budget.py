"""A profile measured within a time budget: which cells first, when to stop, how the rest is filled.

`rapidserve profile` measures every (configuration, batch, context) cell, which takes minutes. The short
profile `rapidserve serve` measures at start (partition/autoprofile.py) has a deadline instead:
* `short_spec`: fewer buckets (batches 1/8/32/128/512, contexts 512/2048/8192, cut to the run's limits),
  fewer repetitions, two prefill forwards per cell instead of three;
* `cell_order`: the cells round-robin over the configurations, each configuration's grid from its middle
  cell out (the next cell the one farthest from those taken: the corners next), so wherever the deadline
  cuts, every configuration measured so far has its cells spread over the grid;
* `measure_within`: measures cells in that order while the next is expected to end by the deadline (the
  longest cell of its configuration so far; a configuration's first cell whenever time is left), skipping
  those that would not;
* `fill_from_roofline`: every cell not measured is the roofline's estimate for it (`roofline_profile` with
  peaks measured now) times the geometric mean of measured / roofline over the measured cells of its
  configuration (over all measured cells for a configuration with none), figure by figure, p95 kept at
  or above p50. Measured cells are kept as measured.
All of it is pure but `measure_within`'s calls of its `measure` and `clock`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import msgspec

from rapidserve.partition.profile import Entry, Profile
from rapidserve.partition.profiler import ProfileSpec

Cell = tuple[str, int, int]  # (configuration, batch bucket, context bucket)
SHORT_BATCHES = (1, 8, 32, 128, 512)
SHORT_CONTEXTS = (512, 2048, 8192)
SHORT_PREFILL_TOKENS = 4096  # the committed profiles' forward: the manager scales its wait from it
FIGURES = ("decode_ms_alone_p50", "decode_ms_alone_p95", "decode_ms_beside_prefill_p50",
           "decode_ms_beside_prefill_p95", "prefill_tokens_per_s")


def short_spec(max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int) -> ProfileSpec:
    """The short profile's buckets for a run: batches up to `max_num_seqs`, contexts up to the first bucket at or
    past `max_model_len` (a context is read at the bucket at or above it), forwards of at most 4096 tokens and
    at most the run's prefill budget; 8 repetitions, a 0.1 s window, two prefill forwards (one timed) a cell."""
    batches = tuple(b for b in SHORT_BATCHES if b <= max_num_seqs) or (1,)
    below = tuple(x for x in SHORT_CONTEXTS if x < max_model_len)
    above = [x for x in SHORT_CONTEXTS if x >= max_model_len]
    contexts = below + (above[0],) if above else below
    return ProfileSpec(batches, contexts, min(SHORT_PREFILL_TOKENS, max_num_batched_tokens), decode_reps=8,
                       min_window_s=0.1, min_prefill_forwards=2)


def _spread(rows: int, cols: int) -> list[tuple[int, int]]:
    """The grid's indices from the middle out, each next the farthest (squared distance in indices) from those
    taken; ties: the smaller row, then column. So the corners come right after the middle."""
    todo = [(i, j) for i in range(rows) for j in range(cols)]
    order = [(rows // 2, cols // 2)]
    todo.remove(order[0])
    while todo:
        nxt = max(todo, key=lambda c: (min((c[0] - t[0]) ** 2 + (c[1] - t[1]) ** 2 for t in order), -c[0], -c[1]))
        order.append(nxt)
        todo.remove(nxt)
    return order


def cell_order(configs: Sequence[str], batches: Sequence[int], contexts: Sequence[int]) -> list[Cell]:
    """Every cell once: round-robin over `configs`, each one's grid in `_spread` order (module docstring)."""
    grid = _spread(len(batches), len(contexts))
    return [(c, batches[i], contexts[j]) for i, j in grid for c in configs]


def measure_within(cells: Sequence[Cell], measure: Callable[[Cell], Entry], clock: Callable[[], float],
                   deadline: float, on_cell: Callable[[Cell, bool], None] | None = None) -> dict[Cell, Entry]:
    """Measure `cells` in order, skipping each that is expected to end past `deadline` (`clock`'s time): expected
    to take as long as the longest cell of its configuration so far. A configuration's first cell is tried
    whenever the deadline has not passed (one cell of each configuration scales the roofline for all of its
    cells), so the deadline is passed at most by one such first cell. `on_cell(cell, measured)` is told of
    each cell (a progress bar)."""
    out: dict[Cell, Entry] = {}
    longest: dict[str, float] = {}
    for cell in cells:
        start = clock()
        if start >= deadline or start + longest.get(cell[0], 0.0) > deadline:
            if on_cell is not None:
                on_cell(cell, False)
            continue
        out[cell] = measure(cell)
        longest[cell[0]] = max(longest.get(cell[0], 0.0), clock() - start)
        if on_cell is not None:
            on_cell(cell, True)
    return out


def _ratio(pairs: Sequence[tuple[float, float]]) -> float:
    """Geometric mean of measured / estimated."""
    return math.exp(sum(math.log(m / e) for m, e in pairs) / len(pairs))


def fill_from_roofline(measured: Mapping[Cell, Entry], roofline: Profile) -> list[Entry]:
    """Every cell of `roofline` (its order): measured where `measured` has it, else the roofline's entry scaled
    (module docstring). ValueError when nothing was measured or a measured cell is not in the roofline."""
    if not measured:
        raise ValueError("no cell was measured: nothing to scale the roofline by")
    est = {(e.config, e.batch, e.context): e for e in roofline.entries}
    missing = [c for c in measured if c not in est]
    if missing:
        raise ValueError(f"measured cell {missing[0]} is not in the roofline profile")
    pooled = {f: _ratio([(getattr(m, f), getattr(est[c], f)) for c, m in measured.items()]) for f in FIGURES}
    ratios: dict[str, dict[str, float]] = {}
    for name in {c for c, _, _ in est}:
        mine = [(c, m) for c, m in measured.items() if c[0] == name]
        ratios[name] = ({f: _ratio([(getattr(m, f), getattr(est[c], f)) for c, m in mine]) for f in FIGURES}
                        if mine else pooled)
    out = []
    for e in roofline.entries:
        key = (e.config, e.batch, e.context)
        if key in measured:
            out.append(measured[key])
            continue
        r = ratios[e.config]
        v = {f: getattr(e, f) * r[f] for f in FIGURES}
        v["decode_ms_alone_p95"] = max(v["decode_ms_alone_p95"], v["decode_ms_alone_p50"])
        v["decode_ms_beside_prefill_p95"] = max(v["decode_ms_beside_prefill_p95"], v["decode_ms_beside_prefill_p50"])
        out.append(Entry(e.config, e.batch, e.context, **v))
    return out


def budgeted_profile(measured: Mapping[Cell, Entry], roofline: Profile, created: str) -> Profile:
    """The short profile: `roofline`'s cells, measured or filled (`fill_from_roofline`), source "measured" with a
    note of how many cells were measured."""
    n, total = len(measured), len(roofline.entries)
    note = (f"auto-profile measured at start: {n} of {total} cells measured" +
            (f", the other {total - n} from the roofline scaled by them" if n < total else ""))
    return msgspec.structs.replace(roofline, entries=fill_from_roofline(measured, roofline), source="measured",
                                   created=created, note=note)
