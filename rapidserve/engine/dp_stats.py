"""The Stats of several data-parallel engines as one (`DataParallelEngine.stats`): the whole server's.

/metrics' ``vllm:`` series do not read this: as vLLM labels each engine core's series by its index, each engine's
are its own Stats (`DataParallelEngine.engine_stats`, by index; server/metrics.py). The combined Stats feeds the
``rapidserve:`` series (labelled by model only: server/metrics_own.py): the partition, its steps and switches, the
step kinds and corrections, the prompts handed over; and whatever reads `engine.stats` as of one engine (the benches).

How each field combines:
- counters (`num_preemptions`, `partition_switches`, `prefix_cache_queries`, `prefix_cache_hits`,
  `num_hand_overs`, each configuration's `partition_steps` and each field of each step kind's `step_kinds`): the
  sum over engines of everything each engine counted, in this and its earlier worker generations. An engine's
  counts start again from 0 when its workers restart; `CounterCarry` notices the drop and keeps what the
  dead generation had counted, so the sum never goes down because one engine restarted (the server's
  metrics take a drop as a restart of the whole engine and would count the survivors' totals twice). The
  drop is seen when a read (a /metrics scrape) falls between the last report of the old workers and the
  first report of the new ones that passes it; otherwise what the old ones counted after the previous
  read is lost, as with one engine.
- gauges (`num_running`, `num_waiting`, `num_prefilling`, `kv_blocks_total`, `kv_blocks_free`,
  `token_slots`): the sum over the engines that are running now. A dead or restarting engine holds no
  requests and no pool, so its last report is left out; KV usage, 1 - free/total, is then the share of
  all serving pools in use.
- `step_correction` (ratios, per correction kind): the mean over the running engines that report the kind; a sum
  of ratios means nothing.
- `partition`: the configurations the running engines are in, distinct, in engine order, joined by
  "+" ("none" when no engine is running).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from rapidserve.engine import messages as m

COUNTERS = ("num_preemptions", "partition_switches", "prefix_cache_queries", "prefix_cache_hits", "num_hand_overs")
GAUGES = ("num_running", "num_waiting", "num_prefilling", "kv_blocks_total", "kv_blocks_free", "token_slots")
_STEPS = "partition_steps:"  # counter keys of partition_steps, by configuration
_KIND = "step_kinds:"  # counter keys of step_kinds: `step_kinds:<kind>:<field>`
_KIND_FIELDS = m.StepKindStats.__struct_fields__


def counters_of(s: m.Stats) -> dict[str, float]:
    """The cumulative counts of one Stats, flattened (partition_steps as `partition_steps:<config>`, step_kinds as
    `step_kinds:<kind>:<field>`)."""
    flat: dict[str, float] = {c: int(getattr(s, c)) for c in COUNTERS}
    flat.update({_STEPS + k: int(v) for k, v in s.partition_steps.items()})
    for kind, st in s.step_kinds.items():
        flat.update({f"{_KIND}{kind}:{f}": getattr(st, f) for f in _KIND_FIELDS})
    return flat


def _step_kinds(totals: dict[str, float]) -> dict[str, m.StepKindStats]:
    """`step_kinds` back from the flattened totals."""
    by_kind: dict[str, dict[str, float]] = {}
    for key, v in totals.items():
        if key.startswith(_KIND):
            kind, f = key[len(_KIND):].rsplit(":", 1)
            by_kind.setdefault(kind, {})[f] = v
    ints = {"steps", "over_slo", "gaps", "gaps_over_slo"}
    return {kind: m.StepKindStats(**{k: int(f.get(k, 0)) if k in ints else float(f.get(k, 0.0)) for k in _KIND_FIELDS})
            for kind, f in sorted(by_kind.items())}


def _mean_ratios(live: Sequence[m.Stats]) -> dict[str, float]:
    """Each correction kind's ratio, the mean over the engines that report it."""
    out: dict[str, float] = {}
    for kind in dict.fromkeys(k for s in live for k in s.step_correction):
        vs = [s.step_correction[kind] for s in live if kind in s.step_correction]
        out[kind] = sum(vs) / len(vs)
    return out


@dataclass(frozen=True)
class CounterCarry:
    """One engine's counts: `retired`, those of its earlier worker generations; `last`, the latest seen.
    Invariant: retired + last never decreases, key by key (given the engine's counts only grow within
    a generation)."""

    retired: dict[str, float] = field(default_factory=dict)
    last: dict[str, float] = field(default_factory=dict)

    def advance(self, s: m.Stats | None) -> CounterCarry:
        """After the engine reported `s` (None: nothing yet). A count lower than the last one seen means
        the workers restarted: the last one is retired."""
        if s is None:
            return self
        now = counters_of(s)
        retired = dict(self.retired)
        for k, v in self.last.items():
            if now.get(k, 0) < v:
                retired[k] = retired.get(k, 0) + v
        return CounterCarry(retired, now)

    def total(self, key: str) -> float:
        return self.retired.get(key, 0) + self.last.get(key, 0)

    def keys(self) -> set[str]:
        return set(self.retired) | set(self.last)


def combine_stats(stats: Sequence[m.Stats | None], running: Sequence[bool],
                  carries: Sequence[CounterCarry]) -> m.Stats | None:
    """One Stats for all engines (module doc): `stats[i]` is engine i's latest (None: none yet),
    `running[i]` whether it runs now, `carries[i]` its counts so far. None while no engine reported."""
    if all(s is None for s in stats):
        return None
    live = [s for s, up in zip(stats, running, strict=True) if up and s is not None]
    gauges = {g: sum(int(getattr(s, g)) for s in live) for g in GAUGES}
    keys = set().union(*(c.keys() for c in carries))
    totals = {k: sum(c.total(k) for c in carries) for k in keys}
    steps = {k[len(_STEPS):]: int(v) for k, v in sorted(totals.items()) if k.startswith(_STEPS)}
    partition = "+".join(dict.fromkeys(s.partition for s in live)) or "none"
    return m.Stats(**gauges, partition=partition, partition_steps=steps,
                   **{c: int(totals.get(c, 0)) for c in COUNTERS}, step_kinds=_step_kinds(totals),
                   step_correction=_mean_ratios(live))
