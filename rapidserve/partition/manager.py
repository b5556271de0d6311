"""The pure decision core of the adaptive resource manager.

Each decode step boundary the engine calls `decide(state, ...)` and applies the returned
configuration. Rules:

* Prefill idle: the target is the configuration giving decode the whole GPU ("overallocated" if
  the profile has it, else the split with the most decode units).
* Prefill pending and no decode running: the configuration with the most prefill throughput (the
  whole GPU where the profile has "overallocated"): no decode step can miss its SLO. The first
  request to finish its prefill then starts decoding beside a prefill forward that holds every unit,
  and the decode step after it switches at once by the SLO rule below; that one step is the price.
* Prefill pending: among configurations whose decode p95 BESIDE prefill meets the SLO
  (p95 <= margin * slo_itl_ms), the one with the highest prefill tokens/s (ties: more decode units,
  then name). "overallocated" is only chosen when it meets the SLO that way. If none meets it, the
  one with the lowest decode p95 beside prefill, and the reason says the SLO cannot be met.
* Decode beside prefill: the profile measured it beside back-to-back prefill forwards of
  `profile.prefill_tokens` tokens each. When the engine says how many prompt tokens prefill still has
  to compute (`prefill_tokens`, P), two things bound decode's step beside that work (`beside_prefill_ms`):
  - the work is finite: a step waits at most for all of it,
        alone p95 + forward + P / prefill tokens/s,
    with `forward` a prefill forward's fixed cost: reading every weight, as the profile's smallest
    decode step (batch 1, shortest context) on that configuration does;
  - overallocated only (both phases on every unit), and only while no pending prompt, cached prefix
    included, is longer than the profile's forward (`prefill_longest`: a forward's attention kernels grow
    with its tokens times the context they attend to, which the profile measured no further than its
    own forward): a decode kernel waits for the prefill kernel in flight, whose length then grows with
    the tokens of prefill's forward, F = min(P, prefill budget). The wait is interpolated between a
    forward's fixed cost (F -> 0) and the profile's (F = its tokens):
        alone p95 + forward + (beside p95 - alone p95 - forward) * min(1, F / profile tokens).
    (On splits decode and prefill hold disjoint units: what is left is memory bandwidth, which does not
    shrink with the forward, so the profile's figure stands there.)
    Measured on the H100 (bench/results/issue15_h100.md): it holds for forwards up to ~1K tokens (p99 ITL
    31-38 ms on chat turns and 1024-token prompts); capping long prompts' forwards at ~2.4K tokens to keep
    the whole GPU was tried and broke the SLO (p99 64-79 ms), so it is not used to choose chunk sizes.
  So a short prefill (a chat's next turn, a few hundred tokens past its cached prefix) runs on the
  whole GPU beside decode, where the profile alone would push decode onto a few units for prefill
  throughput it does not need (the committed H100 Qwen3-8B profile, batch 32 at 2K context: split16
  takes decode from 10 to 33 ms a step for 10% more prefill throughput).
* Hysteresis, one uniform rule: leave the current configuration for the target only when the
  current one has been held for `hysteresis_steps` steps, OR when the current one violates the SLO
  in the present situation (beside-prefill p95 if prefill is pending, alone p95 if prefill is idle),
  OR the current one is not in the profile. So prefill arriving while decode holds an overallocated
  GPU (which starves decode on Hopper) switches at once, while prefill going idle returns decode to
  the whole GPU only after the split was held `hysteresis_steps` steps (unless the split is too
  slow for the SLO even alone, then at once). Oscillating inputs thus switch at most once per
  `hysteresis_steps` steps unless safety requires it.
"""

from __future__ import annotations

from dataclasses import dataclass

from rapidserve.partition.profile import OVERALLOCATED, Entry, Profile
from rapidserve.partition.profile_lookup import estimate, lookup


@dataclass(frozen=True)
class Decision:
    config: str
    reason: str
    switched: bool = False
    beyond_profile: bool = False  # batch/context exceeded the profiled buckets (largest used)


@dataclass(frozen=True)
class ManagerState:
    config: str
    steps_since_switch: int = 0


def make_state(initial: str, steps_since_switch: int = 0) -> ManagerState:
    """Start state holding `initial`; pass steps_since_switch >= hysteresis_steps to allow an early switch."""
    if steps_since_switch < 0:
        raise ValueError("steps_since_switch must be >= 0")
    return ManagerState(initial, steps_since_switch)


def full_decode_config(profile: Profile) -> str:
    """The configuration giving decode the whole GPU."""
    if profile.configuration(OVERALLOCATED) is not None:
        return OVERALLOCATED
    return max(profile.configurations, key=lambda c: (profile.effective_decode_units(c.name), c.name)).name


def beside_prefill_ms(entry: Entry, prefill_tokens: int | None, forward_ms: float | None = None, *,
                      forward_tokens: int | None = None, measured_tokens: int | None = None) -> float:
    """Decode's p95 step beside prefill under `entry`'s configuration: the profile's, or, when only
    `prefill_tokens` prompt tokens are left to compute, at most the step, a forward's fixed cost
    (`forward_ms`; None: the step's own time, an upper bound) and all of that work; and, given the tokens
    of prefill's next forward (`forward_tokens`, overallocated only) and of the profile's
    (`measured_tokens`), the profile's wait scaled to that forward (module docstring)."""
    measured = entry.decode_ms_beside_prefill_p95
    if prefill_tokens is None or entry.prefill_tokens_per_s <= 0:
        return measured
    alone = entry.decode_ms_alone_p95
    fixed = alone if forward_ms is None else forward_ms
    est = min(measured, alone + fixed + 1e3 * prefill_tokens / entry.prefill_tokens_per_s)
    if forward_tokens is not None and measured_tokens:
        wait = max(0.0, measured - alone - fixed)
        est = min(est, alone + fixed + wait * min(1.0, forward_tokens / measured_tokens))
    return est


def forward_ms(profile: Profile, config: str) -> float:
    """A forward's fixed cost under `config`: the profile's smallest decode step (batch 1, shortest context)."""
    return lookup(profile, config, 1, 1).entry.decode_ms_alone_p95


def pending_tokens_cap(profile: Profile, slo_itl_ms: float, margin: float = 0.9) -> int:
    """Prompt tokens beyond which more work no longer lets a configuration meet the SLO (past the profile's
    forward size the scaled wait is the profile's, and past this the finite-work bound misses the SLO):
    the engine need not count pending prefill work further (`decide`'s `prefill_tokens`). Where nothing
    meets the SLO, the fallback ranks by the estimates at the counted work, so it may differ from the one
    an exact count would give; which configurations meet the SLO does not."""
    best = max((e.prefill_tokens_per_s for e in profile.entries), default=0.0)
    return max(int(margin * slo_itl_ms * best / 1e3), profile.prefill_tokens) + 1


def _beside(profile: Profile, entries: dict[str, Entry], prefill_tokens: int | None, prefill_budget: int | None,
            prefill_longest: int | None) -> dict[str, float]:
    """`beside_prefill_ms` of every configuration at this state."""
    if prefill_tokens is None:
        return {n: e.decode_ms_beside_prefill_p95 for n, e in entries.items()}
    forward = prefill_tokens if prefill_budget is None else min(prefill_tokens, prefill_budget)
    scaled = prefill_longest is not None and prefill_longest <= profile.prefill_tokens
    out = {}
    for n, e in entries.items():
        c = profile.configuration(n)
        whole = c is not None and c.decode_units == 0  # overallocated: both phases on every unit
        out[n] = beside_prefill_ms(e, prefill_tokens, forward_ms(profile, n),
                                   forward_tokens=forward if whole and scaled else None,
                                   measured_tokens=profile.prefill_tokens)
    return out


def full_prefill_config(profile: Profile, entries: dict[str, Entry]) -> str:
    """The configuration with the most prefill throughput (ties: more prefill units, then name)."""
    return max(entries, key=lambda n: (entries[n].prefill_tokens_per_s, profile.effective_prefill_units(n), n))


def _target(
    profile: Profile, entries: dict[str, Entry], beside: dict[str, float], prefill_pending: bool,
    decode_running: bool, limit: float, slo_itl_ms: float, prefill_tokens: int | None,
) -> tuple[str, str]:
    if not prefill_pending:
        name = full_decode_config(profile)
        return name, f"prefill idle: {name} gives decode the whole GPU"
    if not decode_running:
        name = full_prefill_config(profile, entries)
        return name, (f"no decode running: {name} gives prefill the most throughput "
                      f"({entries[name].prefill_tokens_per_s:g} tok/s)")
    work = "" if prefill_tokens is None else f", {prefill_tokens} prompt tokens pending"
    meeting = [n for n in entries if beside[n] <= limit]
    if meeting:
        best = max(meeting, key=lambda n: (entries[n].prefill_tokens_per_s, profile.effective_decode_units(n), n))
        return best, (
            f"prefill pending{work}: {best} meets SLO (decode p95 beside prefill {beside[best]:g}"
            f" ms <= {limit:g} ms) with the most prefill throughput ({entries[best].prefill_tokens_per_s:g} tok/s)"
        )
    best = min(entries, key=lambda n: (beside[n], -entries[n].prefill_tokens_per_s, n))
    return best, (
        f"prefill pending{work}: SLO cannot be met ({slo_itl_ms:g} ms, limit {limit:g} ms); {best} has the lowest "
        f"decode p95 beside prefill ({beside[best]:g} ms)"
    )


def decide(
    state: ManagerState,
    *,
    decode_batch: int,
    decode_context: int,
    prefill_pending: bool,
    slo_itl_ms: float,
    profile: Profile,
    hysteresis_steps: int = 8,
    margin: float = 0.9,
    decode_running: bool = True,
    prefill_tokens: int | None = None,
    prefill_budget: int | None = None,
    prefill_longest: int | None = None,
    interpolate: bool = False,
) -> tuple[Decision, ManagerState]:
    """Choose the configuration for the next step. Pure: same inputs, same outputs.
    decode_batch / decode_context pick the profile bucket (at least 1); decode_running=False says the
    decode batch is empty; prefill_tokens: prompt tokens the pending prefill work still has to compute
    (None: not known, the profile's beside-prefill figures alone); prefill_budget: the most tokens of one
    prefill forward (None: no limit), so prefill's next forward has min(prefill_tokens, prefill_budget);
    prefill_longest: the longest pending prompt, cached prefix included (None: not known, so decode's wait
    on the whole GPU is not scaled to the forward); interpolate: read the profile between its buckets
    (`profile_lookup.estimate`), else (`--profile-lookup auto`, the default, or `round-up`) round batch and context up
    to them."""
    if slo_itl_ms <= 0:
        raise ValueError("slo_itl_ms must be positive")
    if not 0 < margin <= 1:
        raise ValueError("margin must be in (0, 1]")
    if hysteresis_steps < 0:
        raise ValueError("hysteresis_steps must be >= 0")
    if prefill_tokens is not None and prefill_tokens < 0:
        raise ValueError("prefill_tokens must be >= 0")
    if prefill_budget is not None and prefill_budget < 1:
        raise ValueError("prefill_budget must be >= 1")
    limit = margin * slo_itl_ms
    entries: dict[str, Entry] = {}
    beyond = False
    for c in profile.configurations:
        found = estimate(profile, c.name, max(decode_batch, 1), max(decode_context, 1), interpolate=interpolate)
        entries[c.name] = found.entry
        beyond = beyond or found.beyond
    note = " [batch/context beyond profiled buckets: largest bucket used]" if beyond else ""
    beside = _beside(profile, entries, prefill_tokens, prefill_budget, prefill_longest)
    target, why = _target(profile, entries, beside, prefill_pending, decode_running, limit, slo_itl_ms,
                          prefill_tokens)
    current = state.config
    if target == current:
        return (
            Decision(current, f"keep {current}: {why}{note}", False, beyond),
            ManagerState(current, state.steps_since_switch + 1),
        )
    if current not in entries:
        reason = f"switch {current} -> {target} (current not in profile): {why}{note}"
        return Decision(target, reason, True, beyond), ManagerState(target, 0)
    cur_p95 = beside[current] if prefill_pending else entries[current].decode_ms_alone_p95
    if decode_running and cur_p95 > limit and (not prefill_pending or beside[target] < cur_p95):
        reason = (
            f"switch {current} -> {target} at once: {current} violates SLO "
            f"(decode p95 {cur_p95:g} ms > {limit:g} ms); {why}{note}"
        )
        return Decision(target, reason, True, beyond), ManagerState(target, 0)
    if state.steps_since_switch >= hysteresis_steps:
        reason = f"switch {current} -> {target} (held {state.steps_since_switch} steps): {why}{note}"
        return Decision(target, reason, True, beyond), ManagerState(target, 0)
    reason = (
        f"hold {current} (hysteresis: held {state.steps_since_switch} < {hysteresis_steps} steps); "
        f"would switch to {target}: {why}{note}"
    )
    return Decision(current, reason, False, beyond), ManagerState(current, state.steps_since_switch + 1)
