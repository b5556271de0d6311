"""DuetServe's policy (partition/duet.py) and the shared policy state, in tables of cases on CPU."""

from __future__ import annotations

import math

import pytest

from rapidserve.loader.presets import preset_config
from rapidserve.partition.duet import DuetDecision, decide_duet, duet_configuration
from rapidserve.partition.manager import ManagerState
from rapidserve.partition.policy import PolicyState, WaitingPrefill, prefill_batch
from rapidserve.partition.profile import Configuration
from rapidserve.partition.roofline import Peaks, mixed_operators, step_seconds

CFG = preset_config("qwen3-8b")
PEAKS = Peaks(matmul_flops=794e12, hbm_bw=2.98e12, num_compute_units=132)  # the H100 of docs/measured.md
SPLITS = [Configuration("overallocated", 0, 132)] + [Configuration(f"split{d}", d, 132 - d) for d in (16, 32, 48, 64)]


def state(batch: int, context: int, prompts: list[int], slo: float, budget: int = 8192) -> PolicyState:
    waiting = tuple(WaitingPrefill(f"p{i}", float(i), n) for i, n in enumerate(prompts))
    return PolicyState(0.0, (context,) * batch, waiting, slo, prefill_budget=budget)


# (decode batch, context, prompts, TBT SLO ms) -> (mode, decode units, meets the SLO)
CASES = [
    ((0, 1, [], 50.0), ("idle", 0, True)),
    ((64, 2048, [], 50.0), ("decode", 0, True)),
    ((0, 1, [4096], 50.0), ("aggregated", 0, True)),  # no decode running: the whole GPU for prefill
    ((8, 1024, [256], 50.0), ("aggregated", 0, True)),  # a small mixed step meets the SLO
    ((64, 2048, [4096, 4096], 50.0), ("split", 32, True)),
    ((64, 2048, [4096, 4096], 100.0), ("split", 16, True)),  # a looser SLO leaves decode fewer SMs
    ((64, 2048, [4096, 4096], 20.0), ("split", 64, False)),  # none meets: the fastest decode, flagged
    ((256, 4096, [8192], 30.0), ("split", 64, False)),
]


@pytest.mark.parametrize(("args", "want"), CASES, ids=[f"c{i}" for i in range(len(CASES))])
def test_duet_decisions(args: tuple[int, int, list[int], float], want: tuple[str, int, bool]) -> None:
    s = state(*args)
    d = decide_duet(s, CFG, PEAKS, SPLITS)
    assert (d.mode, d.decode_units, d.meets_slo) == want, d.reason
    assert ("SLO cannot be met" in d.reason) == (d.mode == "split" and not d.meets_slo)
    assert d == decide_duet(s, CFG, PEAKS, SPLITS)  # pure
    if d.mode == "split":
        assert d.prefill_units == 132 - d.decode_units
        # the k look-ahead decode steps cover the prefill batch, and one fewer would not
        assert d.lookahead * d.predicted_step_ms >= d.predicted_prefill_ms
        assert d.lookahead == 1 or (d.lookahead - 1) * d.predicted_step_ms < d.predicted_prefill_ms
        assert d.meets_slo == (d.predicted_step_ms <= 0.9 * args[3])
    else:
        assert d.lookahead == 1 and d.prefill_units == 0


def test_aggregated_predicts_the_mixed_step() -> None:
    d = decide_duet(state(8, 1024, [256], 50.0), CFG, PEAKS, SPLITS)
    want = 1e3 * step_seconds(mixed_operators(CFG, (1024,) * 8, [(256, 0)]), 132, PEAKS)
    assert math.isclose(d.predicted_step_ms, want) and d.prefill == (("p0", 256, 0),)


def test_split_maximises_throughput_within_the_slo() -> None:
    """Among the splits whose decode step meets the SLO, the chosen one has the highest (k*B + P) / time."""
    from rapidserve.partition.roofline import concurrent

    s = state(64, 2048, [4096, 4096], 50.0)
    d = decide_duet(s, CFG, PEAKS, SPLITS)
    scores = {}
    for c in SPLITS[1:]:
        t_d, tok_s = concurrent(CFG, 64, 2048, c.decode_units, c.prefill_units, 8192, PEAKS)
        t_p = 8192e3 / tok_s
        k = max(1, math.ceil(t_p / t_d))
        if t_d <= 45.0:
            scores[c.decode_units] = (k * 64 + 8192) / max(k * t_d, t_p)
    assert d.decode_units == max(scores, key=lambda u: scores[u])


def test_looser_slo_never_splits_where_a_tighter_one_aggregates() -> None:
    for batch, prompt in ((8, 256), (32, 1024), (64, 2048)):
        modes = [decide_duet(state(batch, 1024, [prompt], slo), CFG, PEAKS, SPLITS).mode for slo in (5, 20, 50, 200)]
        assert modes == sorted(modes, key=lambda m: m == "aggregated"), modes  # once aggregated, it stays


def test_no_split_configured() -> None:
    d = decide_duet(state(64, 2048, [8192], 5.0), CFG, PEAKS, SPLITS[:1])
    assert d.mode == "aggregated" and not d.meets_slo and "no split" in d.reason


def test_prefill_batch_takes_arrival_order_within_the_budget() -> None:
    s = state(0, 1, [3000, 4000, 2000], 50.0, budget=8192)
    assert prefill_batch(s) == (("p0", 3000, 0), ("p1", 4000, 0), ("p2", 1192, 0))
    assert prefill_batch(state(0, 1, [10000], 50.0, budget=4096)) == (("p0", 4096, 0),)


@pytest.mark.parametrize("kw,match", [
    ({"slo_tbt_ms": 0.0}, "positive"), ({"slo_ttft_ms": -1.0}, "positive"), ({"prefill_budget": 0}, "budget"),
    ({"decode_contexts": (5, 0)}, "context"),
])
def test_policy_state_refuses_bad_values(kw: dict[str, object], match: str) -> None:
    base = {"now_s": 0.0, "decode_contexts": (5,), "waiting": (), "slo_tbt_ms": 50.0}
    with pytest.raises(ValueError, match=match):
        PolicyState(**{**base, **kw})  # type: ignore[arg-type]


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="tokens"):
        WaitingPrefill("x", 0.0, 0)
    with pytest.raises(ValueError, match="margin"):
        decide_duet(state(1, 10, [10], 50.0), CFG, PEAKS, SPLITS, margin=0.0)
    with pytest.raises(ValueError, match="need work"):
        mixed_operators(CFG, (), [])


# ---- carrying the decision out on the two-process engine (duet_configuration) ----------------------
def decision(mode: str, decode_units: int = 0) -> DuetDecision:
    return DuetDecision(mode, (), decode_units, 132 - decode_units if decode_units else 0, 1, 1.0, 1.0, True,
                        f"{mode} {decode_units}")  # type: ignore[arg-type]


# (current, steps held, decision, decode running) -> (configuration, switched)
CARRY = [
    (("overallocated", 0, decision("aggregated"), True), ("overallocated", False)),
    (("overallocated", 0, decision("decode"), True), ("overallocated", False)),
    (("overallocated", 0, decision("idle"), False), ("overallocated", False)),
    # leaving aggregation because the shared step would miss the SLO: at once
    (("overallocated", 0, decision("split", 32), True), ("split32", True)),
    # split -> aggregated, or split -> another split: after the hold
    (("split32", 3, decision("aggregated"), True), ("split32", False)),
    (("split32", 8, decision("aggregated"), True), ("overallocated", True)),
    (("split32", 3, decision("split", 48), True), ("split32", False)),
    (("split32", 8, decision("split", 48), True), ("split48", True)),
    # no decode running: nobody is disturbed, at once
    (("split32", 0, decision("aggregated"), False), ("overallocated", True)),
    # a configuration this run does not have: at once
    (("gone", 0, decision("aggregated"), True), ("overallocated", True)),
]


@pytest.mark.parametrize(("args", "want"), CARRY, ids=[f"c{i}" for i in range(len(CARRY))])
def test_duet_configuration(args: tuple[str, int, DuetDecision, bool], want: tuple[str, bool]) -> None:
    current, held, d, running = args
    name, reason, st = duet_configuration(ManagerState(current, held), d, SPLITS, hysteresis_steps=8,
                                          decode_running=running)
    assert (name, name != current) == want
    assert st == (ManagerState(name, 0) if name != current else ManagerState(current, held + 1))
    assert d.reason in reason


def test_duet_configuration_without_the_split() -> None:
    with pytest.raises(ValueError, match="no configuration gives decode 40 units"):
        duet_configuration(ManagerState("overallocated", 0), decision("split", 40), SPLITS)


def test_duet_configuration_without_overallocated() -> None:
    splits = SPLITS[1:]  # only splits: aggregation takes the one with the most prefill units
    name, _, _ = duet_configuration(ManagerState("split64", 9), decision("aggregated"), splits)
    assert name == "split16"


def test_duet_end_to_end_short_turns_aggregate_long_prompts_split() -> None:
    """What the multiturn workload looks like to the policy: 32 decodes at ~3K context; a few 320-token
    turns (cached prefixes) aggregate, a burst of 2048-token first turns splits."""
    turns = tuple(WaitingPrefill(f"t{i}", float(i), 320, 2368) for i in range(3))
    d = decide_duet(PolicyState(0.0, (3000,) * 32, turns, 50.0), CFG, PEAKS, SPLITS)
    assert d.mode == "aggregated", d.reason
    burst = tuple(WaitingPrefill(f"f{i}", float(i), 2048) for i in range(8))
    d = decide_duet(PolicyState(0.0, (3000,) * 32, burst, 50.0), CFG, PEAKS, SPLITS)
    assert d.mode == "split" and d.meets_slo, d.reason
