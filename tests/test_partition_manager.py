"""Table-driven tests of the adaptive resource manager's pure decision function (H100 numbers, docs/measured.md)."""

from __future__ import annotations

import pytest

from rapidserve.partition.manager import (
    Decision,
    ManagerState,
    beside_prefill_ms,
    decide,
    forward_ms,
    full_decode_config,
    full_prefill_config,
    make_state,
    pending_tokens_cap,
)
from rapidserve.partition.profile import Configuration, Entry, Profile
from rapidserve.partition.profile_lookup import bucket_up, lookup

PREFILL_TOKENS = 8192  # the prefill step of docs/measured.md: an 8192-token GEMM pair
# name -> (decode units, alone p50, alone p95, beside p50, beside p95, prefill step ms), batch 64 on 132 SMs
H100 = {
    "overallocated": (0, 1.40, 1.50, 35.9, 37.0, 5.6),
    "split16": (16, 3.62, 3.80, 4.9, 5.4, 6.5),
    "split32": (32, 2.19, 2.40, 2.93, 3.27, 7.9),
    "split48": (48, 1.79, 1.95, 2.59, 3.75, 10.6),
    "split64": (64, 1.60, 1.75, 2.18, 2.72, 13.9),
}
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
CONTEXTS = [512, 2048, 8192]


def scale(batch: int, context: int) -> float:
    """Decode latency grows 2x for large batches or long contexts (synthetic)."""
    return 2.0 if batch >= 128 or context >= 8192 else 1.0


def h100_profile(names: list[str] | None = None) -> Profile:
    names = list(H100) if names is None else names
    configs = [Configuration(n, H100[n][0], 132 if H100[n][0] == 0 else 132 - H100[n][0]) for n in names]
    entries = []
    for n in names:
        _, a50, a95, b50, b95, pf_ms = H100[n]
        for b in BATCHES:
            for c in CONTEXTS:
                f = scale(b, c)
                entries.append(Entry(n, b, c, a50 * f, a95 * f, b50 * f, b95 * f, PREFILL_TOKENS / (pf_ms / 1e3)))
    return Profile(
        "NVIDIA H100 80GB HBM3",
        "llama-3-8b",
        132,
        configs,
        BATCHES,
        CONTEXTS,
        entries,
        "2026-11-22T00:00:00Z",
        "measured",
    )


FULL = h100_profile()
SPLITS_ONLY = h100_profile(["split16", "split32", "split48", "split64"])
NO_32 = h100_profile(["overallocated", "split16", "split48", "split64"])


def fresh(
    profile: Profile, *, batch: int, prefill: bool, slo: float, margin: float = 0.9, context: int = 1024,
    interpolate: bool = False,
) -> Decision:
    """Decision from a state that may switch freely (held long enough)."""
    state = make_state(full_decode_config(profile), steps_since_switch=100)
    d, _ = decide(
        state,
        decode_batch=batch,
        decode_context=context,
        prefill_pending=prefill,
        slo_itl_ms=slo,
        profile=profile,
        margin=margin,
        interpolate=interpolate,
    )
    return d


@pytest.mark.parametrize(
    ("batch", "bucket", "beyond"),
    [
        (1, 1, False),
        (2, 2, False),
        (3, 4, False),
        (5, 8, False),
        (17, 32, False),
        (64, 64, False),
        (65, 128, False),
        (129, 256, False),
        (256, 256, False),
        (257, 256, True),
        (10_000, 256, True),
    ],
)
def test_batch_buckets(batch: int, bucket: int, beyond: bool) -> None:
    b = bucket_up(BATCHES, batch)
    assert (b.bucket, b.beyond) == (bucket, beyond)


@pytest.mark.parametrize(
    ("profile", "batch", "prefill", "slo", "margin", "want", "cannot"),
    [
        # prefill idle: decode gets the whole GPU
        (FULL, 1, False, 3.0, 0.9, "overallocated", False),
        (FULL, 256, False, 50.0, 0.9, "overallocated", False),
        (SPLITS_ONLY, 64, False, 5.0, 0.9, "split64", False),
        # SLO 50 ms: overallocated meets it beside prefill (37 <= 45) and has the most prefill throughput
        (FULL, 64, True, 50.0, 0.9, "overallocated", False),
        (FULL, 64, True, 50.0, 1.0, "overallocated", False),
        # batch 256: overallocated beside prefill is 74 ms > 45: best split by prefill throughput is split16
        (FULL, 256, True, 50.0, 0.9, "split16", False),
        # SLO 5 ms (limit 4.5): split32/48/64 meet; split32 has the most prefill throughput
        (FULL, 64, True, 5.0, 0.9, "split32", False),
        (FULL, 1, True, 5.0, 0.9, "split32", False),
        (FULL, 33, True, 5.0, 0.9, "split32", False),
        # SLO 5 without margin: split16 p95 5.4 still misses
        (FULL, 64, True, 5.0, 1.0, "split32", False),
        # missing split32: next best meeting SLO is split48
        (NO_32, 64, True, 5.0, 0.9, "split48", False),
        (SPLITS_ONLY, 64, True, 5.0, 0.9, "split32", False),
        (SPLITS_ONLY, 64, True, 50.0, 0.9, "split16", False),
        # SLO 3 ms, margin 1.0: only split64 (2.72) meets
        (FULL, 64, True, 3.0, 1.0, "split64", False),
        # SLO 3 ms, margin 0.9 (2.7 ms): none meets -> lowest p95 beside prefill, reason says so
        (FULL, 64, True, 3.0, 0.9, "split64", True),
        (SPLITS_ONLY, 64, True, 3.0, 0.9, "split64", True),
        # batch 128/256 doubles latency: SLO 5 ms cannot be met
        (FULL, 128, True, 5.0, 0.9, "split64", True),
        (FULL, 256, True, 5.0, 0.9, "split64", True),
        (FULL, 1000, True, 5.0, 0.9, "split64", True),
    ],
)
def test_choice(
    profile: Profile, batch: int, prefill: bool, slo: float, margin: float, want: str, cannot: bool
) -> None:
    d = fresh(profile, batch=batch, prefill=prefill, slo=slo, margin=margin)
    assert d.config == want, d.reason
    assert ("SLO cannot be met" in d.reason) == cannot


# (profile, current, SLO ms, hysteresis held, want): prefill pending and no decode running
@pytest.mark.parametrize(
    ("profile", "current", "slo", "held", "want"),
    [
        (FULL, "split32", 5.0, 0, "overallocated"),  # the whole GPU, even right after a switch
        (FULL, "split64", 50.0, 100, "overallocated"),
        (FULL, "overallocated", 3.0, 0, "overallocated"),  # no decode step can miss the SLO
        (SPLITS_ONLY, "split64", 5.0, 0, "split16"),  # no overallocated: the most prefill units
        (NO_32, "split48", 5.0, 0, "overallocated"),
    ],
)
def test_no_decode_running_gives_prefill_the_most(profile: Profile, current: str, slo: float, held: int,
                                                  want: str) -> None:
    d, state = decide(make_state(current, held), decode_batch=1, decode_context=1, prefill_pending=True,
                      slo_itl_ms=slo, profile=profile, hysteresis_steps=0, decode_running=False)
    assert d.config == want and state.config == want, d.reason
    assert d.switched == (current != want)
    assert "no decode running" in d.reason


def test_full_prefill_config_ties() -> None:
    e = lookup(FULL, "split16", 1, 1).entry
    same = {n: e for n in ("split16", "split32")}
    assert full_prefill_config(FULL, same) == "split16"  # 116 prefill units beat 100


def test_first_decode_beside_whole_gpu_prefill_splits_at_once() -> None:
    """Decode starts while prefill holds the whole GPU: the SLO rule switches at the next step."""
    state = make_state("overallocated", 0)
    d, _ = decide(state, decode_batch=1, decode_context=100, prefill_pending=True, slo_itl_ms=5.0, profile=FULL,
                  hysteresis_steps=8)
    assert d.config == "split32" and "at once" in d.reason


def test_long_context_bucket_and_beyond_flag() -> None:
    assert fresh(FULL, batch=8, prefill=True, slo=5.0, context=2048).config == "split32"
    # round-up: 4096 -> the 8192 bucket, doubled latency: nothing meets 4.5 ms
    d = fresh(FULL, batch=8, prefill=True, slo=5.0, context=4096, interpolate=False)
    assert d.config == "split64" and "SLO cannot be met" in d.reason and not d.beyond_profile
    # interpolated: a third of the way from 2048 to 8192, 1.33x: split32's 3.27 ms -> 4.36 ms, within 4.5
    d = fresh(FULL, batch=8, prefill=True, slo=5.0, context=4096, interpolate=True)
    assert d.config == "split32" and "SLO cannot be met" not in d.reason and not d.beyond_profile
    d = fresh(FULL, batch=8, prefill=True, slo=50.0, context=100_000)
    assert d.beyond_profile and "beyond profiled buckets" in d.reason
    assert fresh(FULL, batch=300, prefill=False, slo=50.0).beyond_profile


def test_lookup_rounds_up() -> None:
    found = lookup(FULL, "split32", 3, 600)
    assert (found.entry.batch, found.entry.context, found.beyond) == (4, 2048, False)


def test_full_decode_config() -> None:
    assert full_decode_config(FULL) == "overallocated"
    assert full_decode_config(SPLITS_ONLY) == "split64"


def test_decide_is_pure() -> None:
    s = make_state("split32", 3)
    kw = dict(decode_batch=64, decode_context=1024, prefill_pending=True, slo_itl_ms=5.0, profile=FULL)
    assert decide(s, **kw) == decide(s, **kw)
    assert s == ManagerState("split32", 3)


def run(
    profile: Profile, state: ManagerState, inputs: list[tuple[int, bool]], slo: float, hysteresis: int = 8
) -> tuple[list[str], ManagerState]:
    out = []
    for batch, prefill in inputs:
        d, state = decide(
            state,
            decode_batch=batch,
            decode_context=1024,
            prefill_pending=prefill,
            slo_itl_ms=slo,
            profile=profile,
            hysteresis_steps=hysteresis,
        )
        out.append(d.config)
    return out, state


def test_prefill_arrival_switches_at_once_when_overallocated_violates() -> None:
    d, s = decide(
        make_state("overallocated"),
        decode_batch=64,
        decode_context=1024,
        prefill_pending=True,
        slo_itl_ms=5.0,
        profile=FULL,
    )
    assert d.config == "split32" and d.switched and "violates SLO" in d.reason
    assert s == ManagerState("split32", 0)


def test_no_flapping_when_prefill_oscillates() -> None:
    inputs = [(64, i % 2 == 0) for i in range(20)]
    configs, _ = run(FULL, make_state("overallocated"), inputs, slo=5.0)
    # first step switches (safety), then split32 is held; it meets the SLO alone too, so idle steps
    # don't return to overallocated until held 8 steps; at step 9 idle -> overallocated, step 10 back
    switches = sum(a != b for a, b in zip(["overallocated"] + configs, configs, strict=False))
    assert configs[0] == "split32"
    assert configs[1:9] == ["split32"] * 8
    assert switches <= 1 + 2 * (20 // 9)


def test_no_flapping_when_batch_oscillates() -> None:
    # batch 64 -> split32 target; batch 128 -> split64 (cannot meet). split32 at 128 violates -> switch at once;
    # at batch 64, split64 meets the SLO (2.72 <= 4.5) so it is held by hysteresis rather than flapping back.
    inputs = [(64, True), (128, True)] * 6
    configs, _ = run(FULL, make_state("split32", 100), inputs, slo=5.0)
    # held 9 steps (index 1..9), then at most one hysteresis switch back, undone at once by the next violation
    assert configs[:10] == ["split32"] + ["split64"] * 9
    assert configs[10:] == ["split32", "split64"]


def test_hysteresis_switch_after_hold() -> None:
    state = make_state("split64")  # meets SLO 5 but split32 gives prefill more
    configs, state = run(FULL, state, [(64, True)] * 10, slo=5.0, hysteresis=8)
    assert configs == ["split64"] * 8 + ["split32"] * 2
    assert state == ManagerState("split32", 1)


def test_zero_hysteresis_switches_immediately() -> None:
    configs, _ = run(FULL, make_state("split64"), [(64, True), (64, False)], slo=5.0, hysteresis=0)
    assert configs == ["split32", "overallocated"]


def test_prefill_idle_returns_to_full_gpu_after_hold() -> None:
    configs, state = run(FULL, make_state("split32"), [(64, False)] * 9, slo=5.0)
    assert configs == ["split32"] * 8 + ["overallocated"]
    assert state.steps_since_switch == 0


def test_prefill_idle_switches_at_once_if_split_too_slow_alone() -> None:
    # split16 alone at batch 64 is 3.8 ms p95 > 0.9 * 3 ms: switch to the whole GPU at once
    d, _ = decide(
        make_state("split16"), decode_batch=64, decode_context=1024, prefill_pending=False, slo_itl_ms=3.0, profile=FULL
    )
    assert d.config == "overallocated" and d.switched and "violates SLO" in d.reason


def test_keep_counts_steps() -> None:
    d, s = decide(
        make_state("split32", 2),
        decode_batch=64,
        decode_context=1024,
        prefill_pending=True,
        slo_itl_ms=5.0,
        profile=FULL,
    )
    assert (d.config, d.switched, s) == ("split32", False, ManagerState("split32", 3))
    assert d.reason.startswith("keep")


def test_unknown_current_config_switches() -> None:
    d, _ = decide(
        make_state("split32"), decode_batch=64, decode_context=1024, prefill_pending=True, slo_itl_ms=5.0, profile=NO_32
    )
    assert d.config == "split48" and d.switched and "not in profile" in d.reason


def test_none_meets_and_current_is_best_keeps() -> None:
    d, _ = decide(
        make_state("split64"), decode_batch=256, decode_context=1024, prefill_pending=True, slo_itl_ms=3.0, profile=FULL
    )
    assert d.config == "split64" and not d.switched and "SLO cannot be met" in d.reason


@pytest.mark.parametrize("kw", [dict(slo_itl_ms=0.0), dict(margin=0.0), dict(margin=1.5), dict(hysteresis_steps=-1)])
def test_bad_arguments(kw: dict[str, float]) -> None:
    args: dict = dict(decode_batch=1, decode_context=1, prefill_pending=True, slo_itl_ms=5.0, profile=FULL)
    args.update(kw)
    with pytest.raises(ValueError):
        decide(make_state("split32"), **args)


# The committed H100 profile of preset:qwen3-8b at batch 1 / 32 and context 512 / 2048 (profiles/, measured
# 2026-11-22): (name, batch, context) -> (decode alone p95, decode beside prefill p95, prefill tokens/s)
QWEN3_UNITS = {"overallocated": 0, "split16": 16, "split32": 32, "split48": 48, "split64": 64}
QWEN3_H100 = {
    ("overallocated", 1, 512): (6.80, 53.72, 34038.0), ("overallocated", 1, 2048): (6.77, 57.71, 33856.0),
    ("overallocated", 32, 512): (7.71, 62.37, 33618.0), ("overallocated", 32, 2048): (10.13, 64.53, 32629.0),
    ("split16", 1, 512): (12.02, 16.18, 29124.0), ("split16", 1, 2048): (12.50, 16.54, 29166.0),
    ("split16", 32, 512): (17.30, 22.67, 29254.0), ("split16", 32, 2048): (25.35, 33.02, 29636.0),
    ("split32", 1, 512): (7.79, 11.27, 24265.0), ("split32", 1, 2048): (8.14, 11.40, 24478.0),
    ("split32", 32, 512): (10.52, 13.90, 25075.0), ("split32", 32, 2048): (14.69, 19.29, 25636.0),
    ("split48", 1, 512): (7.14, 9.13, 19630.0), ("split48", 1, 2048): (7.27, 9.32, 19752.0),
    ("split48", 32, 512): (8.92, 11.10, 20215.0), ("split48", 32, 2048): (12.20, 15.18, 20825.0),
    ("split64", 1, 512): (6.79, 8.81, 14035.0), ("split64", 1, 2048): (6.87, 8.97, 14067.0),
    ("split64", 32, 512): (8.10, 10.31, 14785.0), ("split64", 32, 2048): (10.50, 13.36, 14758.0),
}


def qwen3_profile() -> Profile:
    configs = [Configuration(n, u, 132 if u == 0 else 132 - u) for n, u in QWEN3_UNITS.items()]
    entries = [Entry(n, b, c, a, a, p, p, r) for (n, b, c), (a, p, r) in QWEN3_H100.items()]
    return Profile("NVIDIA H100 80GB HBM3", "preset:qwen3-8b", 132, configs, [1, 32], [512, 2048], entries,
                   "2026-11-22T00:00:00Z", "measured")


QWEN3 = qwen3_profile()


@pytest.mark.parametrize(
    ("slo", "tokens", "want"),
    [
        # the profile alone (work not known): split16 meets 45 ms (33 ms) with the most prefill throughput
        (50.0, None, "split16"),
        # a chat's next turn: overallocated waits at most its step 10.13 + a forward 6.80 (batch 1's step) +
        # 320 / 32629 tok/s = 26.7 ms <= 45
        (50.0, 1, "overallocated"),
        (50.0, 320, "overallocated"),
        # past ~900 tokens the finite-work bound misses 45 ms, but decode's kernels wait only for kernels of a
        # forward of those tokens: 16.93 + (64.53 - 10.13 - 6.80) x F / 4096 (the profile's forward)
        (50.0, 900, "overallocated"),  # min(44.5, 27.4) ms
        (50.0, 1000, "overallocated"),  # min(47.6, 28.6) ms
        (50.0, 2400, "overallocated"),  # 44.8 ms
        (50.0, 2500, "split16"),  # 46.0 ms > 45: the profile's rule again
        (50.0, 8192, "split16"),
        # SLO 30 ms (limit 27): 400 tokens fit overallocated (21.6 ms), 900 do not (27.4): split32 (19.3 ms)
        (30.0, 100, "overallocated"),
        (30.0, 400, "overallocated"),
        (30.0, 900, "split32"),
        (30.0, None, "split32"),
        # SLO 20 ms (limit 18): 1 token fits (16.96 ms), 100 do not (20.0): split48 (15.2 ms)
        (20.0, 1, "overallocated"),
        (20.0, 100, "split48"),
        (20.0, None, "split48"),
        # SLO 10 ms (limit 9): nothing meets; the lowest beside-prefill step, the bound included
        (10.0, None, "split64"),
        (10.0, 1, "split64"),  # split64: min(13.36, 17.3) = 13.36 < overallocated's 16.96
    ],
)
def test_short_prefill_work_bounds_decode_beside_it(slo: float, tokens: int | None, want: str) -> None:
    """A decode step waits at most for all the prefill work pending (plus a forward's fixed cost), so a
    short prefill runs on the whole GPU where the profile alone would put decode on 16 SMs."""
    state = make_state("overallocated", 100)
    d, _ = decide(state, decode_batch=32, decode_context=2048, prefill_pending=True, slo_itl_ms=slo,
                  profile=QWEN3, prefill_tokens=tokens, prefill_longest=3000)
    assert d.config == want, d.reason
    assert ("prompt tokens pending" in d.reason) == (tokens is not None)


@pytest.mark.parametrize(
    ("entry", "tokens", "forward", "want"),
    [
        (Entry("o", 32, 2048, 10.0, 10.0, 64.0, 64.0, 32000.0), None, 5.0, 64.0),
        (Entry("o", 32, 2048, 10.0, 10.0, 64.0, 64.0, 32000.0), 0, 5.0, 15.0),
        (Entry("o", 32, 2048, 10.0, 10.0, 64.0, 64.0, 32000.0), 320, 5.0, 25.0),
        (Entry("o", 32, 2048, 10.0, 10.0, 64.0, 64.0, 32000.0), 320, None, 30.0),  # no forward cost: the step's
        (Entry("o", 32, 2048, 10.0, 10.0, 64.0, 64.0, 32000.0), 100_000, 5.0, 64.0),  # never above the profile's
        (Entry("s", 32, 2048, 25.0, 25.0, 33.0, 33.0, 29000.0), 1, 12.0, 33.0),  # a split's own step bounds it
        (Entry("z", 32, 2048, 10.0, 10.0, 64.0, 64.0, 0.0), 1, 5.0, 64.0),  # no prefill rate: the profile's
    ],
)
def test_beside_prefill_ms(entry: Entry, tokens: int | None, forward: float | None, want: float) -> None:
    assert beside_prefill_ms(entry, tokens, forward) == pytest.approx(want)


def test_forward_ms_is_the_smallest_step() -> None:
    assert forward_ms(QWEN3, "overallocated") == 6.80 and forward_ms(QWEN3, "split16") == 12.02


@pytest.mark.parametrize(
    ("current", "held", "tokens", "want", "why"),
    [
        ("split16", 0, 320, "split16", "hold split16 (hysteresis"),  # short work: no hurry back to the whole GPU
        ("split16", 8, 320, "overallocated", "held 8 steps"),
        ("overallocated", 0, 320, "overallocated", "keep overallocated"),
        ("overallocated", 0, 4096, "split16", "at once: overallocated violates SLO (decode p95 64.53 ms"),
        ("overallocated", 0, None, "split16", "at once"),
    ],
)
def test_short_prefill_hysteresis(current: str, held: int, tokens: int | None, want: str, why: str) -> None:
    d, state = decide(make_state(current, held), decode_batch=32, decode_context=2048, prefill_pending=True,
                      slo_itl_ms=50.0, profile=QWEN3, hysteresis_steps=8, prefill_tokens=tokens,
                      prefill_longest=3000)
    assert d.config == want and state.config == want, d.reason
    assert why in d.reason


def test_pending_tokens_cap() -> None:
    # past the profile's forward (4096 tokens) the scaled wait is the profile's; the finite-work bound misses the
    # SLO past 0.9 x 50 ms at the profile's best 34038 tok/s (1531 tokens), or 0.9 x 200 ms (6126)
    assert pending_tokens_cap(QWEN3, 50.0) == 4097
    assert pending_tokens_cap(QWEN3, 200.0) == 6127
    d = fresh(QWEN3, batch=32, prefill=True, slo=50.0, context=2048)
    assert d.config == "split16"


def test_prefill_tokens_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="prefill_tokens must be >= 0"):
        decide(make_state("overallocated"), decode_batch=1, decode_context=1, prefill_pending=True, slo_itl_ms=50.0,
               profile=QWEN3, prefill_tokens=-1)


@pytest.mark.parametrize(
    ("tokens", "budget", "want"),
    [
        (8192, None, "split16"),  # one 8192-token forward: decode waits as long as the profile measured
        (8192, 2048, "overallocated"),  # forwards of 2048: 16.93 + 47.6 x 0.5 = 40.7 ms <= 45
        (8192, 4096, "split16"),
        (1000, 8192, "overallocated"),  # the budget only caps the forward
    ],
)
def test_prefill_budget_caps_the_forward(tokens: int, budget: int | None, want: str) -> None:
    d, _ = decide(make_state("overallocated", 100), decode_batch=32, decode_context=2048, prefill_pending=True,
                  slo_itl_ms=50.0, profile=QWEN3, prefill_tokens=tokens, prefill_budget=budget, prefill_longest=4096)
    assert d.config == want, d.reason


def test_beside_prefill_scales_with_the_forward() -> None:
    e = Entry("o", 32, 2048, 10.0, 10.0, 64.0, 64.0, 32000.0)
    # finite-work bound 10 + 5 + 100 ms; scaled wait 10 + 5 + 49 x 1000 / 4000
    assert beside_prefill_ms(e, 3200, 5.0, forward_tokens=1000, measured_tokens=4000) == pytest.approx(27.25)
    assert beside_prefill_ms(e, 3200, 5.0, forward_tokens=8000, measured_tokens=4000) == pytest.approx(64.0)
    assert beside_prefill_ms(e, 3200, 5.0) == pytest.approx(64.0)  # a split: the profile's (finite bound 115)
    assert beside_prefill_ms(e, None, 5.0, forward_tokens=10, measured_tokens=4000) == 64.0  # work not known
    odd = Entry("x", 32, 2048, 10.0, 10.0, 12.0, 12.0, 32000.0)  # beside below alone + forward: no negative wait
    assert beside_prefill_ms(odd, 3200, 5.0, forward_tokens=10, measured_tokens=4000) == pytest.approx(12.0)


def test_prefill_budget_must_be_positive() -> None:
    with pytest.raises(ValueError, match="prefill_budget must be >= 1"):
        decide(make_state("overallocated"), decode_batch=1, decode_context=1, prefill_pending=True, slo_itl_ms=50.0,
               profile=QWEN3, prefill_tokens=1, prefill_budget=0)


@pytest.mark.parametrize(
    ("tokens", "longest", "want"),
    [
        (1000, 3000, "overallocated"),  # every pending prompt within the profile's 4096-token forward: scaled, 28.6 ms
        (1000, 4096, "overallocated"),
        (1000, 4097, "split16"),  # a longer one (a short turn over a long cached history): the finite bound, 47.6 ms
        (1000, None, "split16"),  # not known: the same
        (320, 30000, "overallocated"),  # the finite bound alone still keeps a short turn: 26.7 ms
    ],
)
def test_wait_scales_only_within_the_profiles_forward(tokens: int, longest: int | None, want: str) -> None:
    """A forward's attention kernels grow with its tokens times the context they attend to, so decode's wait is
    scaled to the forward only where no pending prompt, cached prefix included, is longer than the profile's."""
    d, _ = decide(make_state("overallocated", 100), decode_batch=32, decode_context=2048, prefill_pending=True,
                  slo_itl_ms=50.0, profile=QWEN3, prefill_tokens=tokens, prefill_longest=longest)
    assert d.config == want, d.reason


def test_profile_lookup_config_invalid() -> None:
    from rapidserve.config_base import ConfigError
    from rapidserve.partition_config import PartitionConfig

    with pytest.raises(ConfigError, match="profile_lookup='nearest'; use one of auto, interpolate, round-up"):
        PartitionConfig(profile_lookup="nearest")


@pytest.mark.parametrize(("kw", "pattern"), [
    (dict(profile_lookup="interpolate", policy="drift"), "--profile-lookup: not read by --policy drift \\(DRIFT reads "
                                                          "the profile's buckets rounded up\\); drop it \\(read by "
                                                          "--policy rapid --partition adaptive, --policy duet\\)"),
    (dict(profile_lookup="interpolate", mode="off"), "--profile-lookup: not read by --policy rapid --partition off"),
])
def test_profile_lookup_refused_where_unread(kw: dict[str, object], pattern: str) -> None:
    """Where the profile is not read between buckets the one flag check (policy_spec) refuses it; it took this rule
    over from PartitionConfig. (duet reads it now: its cost model reads the profile, partition/step_costs.py.)"""
    from rapidserve.config_base import ConfigError
    from rapidserve.partition_config import PartitionConfig
    from rapidserve.policy_spec import check_settings

    p = PartitionConfig(**kw)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=pattern):
        check_settings("rapid", p.policy, {"partition": p})


def test_cli_profile_lookup() -> None:
    from rapidserve.cli import build_parser
    from rapidserve.cli_args import partition_config
    from rapidserve.partition_config import PartitionConfig

    a = build_parser().parse_args(["serve"])
    assert partition_config(a).profile_lookup == "auto"  # the default: splits rounded up, fused steps interpolated
    a = build_parser().parse_args(["serve", "--profile-lookup", "interpolate"])
    assert partition_config(a) == PartitionConfig(profile_lookup="interpolate", policy="duet")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--profile-lookup", "nearest"])


def test_decode_partition_reads_the_profile_as_configured() -> None:
    """The runtime passes --profile-lookup to the manager: at 4160 tokens of context (the synthetic profile's 8192
    bucket doubles the step) and a 5 ms SLO, split32 meets it only when interpolated; rounded up nothing does, and
    the manager falls back to the lowest step, split64."""
    from rapidserve.partition.plan import PartitionPlan
    from rapidserve.partition.runtime import DecodePartition
    from rapidserve.partition_config import PartitionConfig

    plan = PartitionPlan("cuda-green", list(FULL.configurations), FULL, "synthetic H100 profile")
    got = {}
    for how in ("interpolate", "round-up", "auto"):
        dp = DecodePartition(PartitionConfig(slo_itl_ms=5.0, profile_lookup=how), plan)
        dp.advance(8, 4160, prefill_pending=True)
        got[how] = dp.current
    assert got == {"interpolate": "split32", "round-up": "split64", "auto": "split64"}  # auto: a split rounds up
