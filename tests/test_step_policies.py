"""The four policies as StepPolicies (partition/step_policies.py): what each decides, that each declares the workers
policy_spec says it uses, and the one a config and a partition plan make."""

from __future__ import annotations

import dataclasses

import pytest

from rapidserve.config import EngineConfig, SchedulerConfig
from rapidserve.loader.presets import preset_config
from rapidserve.partition.drift import LinearModel
from rapidserve.partition.manager import decide, make_state
from rapidserve.partition.plan import PartitionPlan
from rapidserve.partition.policies import DuetPolicy
from rapidserve.partition.policy import WaitingPrefill
from rapidserve.partition.profile import OVERALLOCATED, Configuration
from rapidserve.partition.roofline import prefix_pair_ms
from rapidserve.partition.shape import DecodeAlone, Fused, ShapeState, Split, StepTiming
from rapidserve.partition.step_costs import ProfileCosts, RooflineCosts
from rapidserve.partition.step_policies import (
    DriftPolicy,
    DuetWithoutSlo,
    FusedPolicy,
    RapidPolicy,
    make_step_policy,
)
from rapidserve.partition_config import PartitionConfig
from rapidserve.policy_spec import POLICY_SPECS
from tests.test_adaptive_policy import CONFIGS, H100, PROMPTS, WHOLE, state, synthetic_profile

PROFILE = synthetic_profile()
QWEN = preset_config("qwen3-8b")


def test_fused_always_takes_the_whole_budget() -> None:
    p = FusedPolicy()
    for st in (state(), state(waiting=()), state(batch=0), state(slo=1.0)):
        assert p.decide(st) == Fused(8192)
    p.observe(StepTiming(Fused(8192), 64, 100, None, 5.0))  # nothing to correct
    assert p.decide(state(budget=512)) == Fused(512)


def test_rapid_is_the_managers_configuration_always_split() -> None:
    p = RapidPolicy(PROFILE, OVERALLOCATED)
    want, _ = decide(make_state(OVERALLOCATED), decode_batch=64, decode_context=2048, prefill_pending=True,
                     slo_itl_ms=50.0, profile=PROFILE, prefill_tokens=8192, prefill_budget=8192, prefill_longest=4096)
    got = p.decide(state())
    assert got == Split(want.config, 8192) and want.config != OVERALLOCATED
    assert p.decide(state(waiting=(), busy=500)) == DecodeAlone(want.config)  # the prefill worker still runs
    assert isinstance(p.decide(state(batch=0)), Split)  # no decode: never fused either


@pytest.mark.parametrize(("batch_tokens", "want"), [(None, 8192), (2048, 2048)])
def test_rapid_hands_prefill_batches_of_prefill_batch_tokens(batch_tokens: int | None, want: int) -> None:
    p = RapidPolicy(None, "split32", prefill_batch_tokens=batch_tokens)
    assert p.decide(state()) == Split("split32", want)
    assert p.decide(state(waiting=(WaitingPrefill("s", 0, 100),))) == Split("split32", 100)
    assert p.decide(state(waiting=())) == DecodeAlone("split32")


def test_drift_is_split_on_drifts_configuration() -> None:
    models = {c.name: LinearModel(1.0, 0.01 * 132 / (c.prefill_units or 132)) for c in CONFIGS}
    p = DriftPolicy(PROFILE, models, 36)
    assert p.decide(state(waiting=())) == DecodeAlone(OVERALLOCATED)
    shape = p.decide(state())
    # the split with the most prefill units whose decode step beside prefill meets 45 ms: split32 (16.9 ms)
    assert shape == Split("split32", 8192)
    assert p.decide(state(batch=0)) == Split("overallocated", 8192)  # no decode: the most prefill units at once


@pytest.mark.parametrize("cls", [FusedPolicy, RapidPolicy, DuetPolicy, DriftPolicy, DuetWithoutSlo])
def test_each_declares_the_workers_policy_spec_gives_it(cls: type) -> None:
    assert cls.workers == POLICY_SPECS[cls.name].workers


def plan(profile: object = None, prefill_models: dict[str, LinearModel] | None = None) -> PartitionPlan:
    configs = list(CONFIGS)
    return PartitionPlan("cuda-green", configs, profile, "test", H100, prefill_models or {})  # type: ignore[arg-type]


def cfg(**kw: object) -> EngineConfig:
    return EngineConfig("preset:qwen3-8b", QWEN, partition=PartitionConfig(**kw))  # type: ignore[arg-type]


def test_make_step_policy() -> None:
    assert isinstance(make_step_policy(cfg(policy="fused"), plan()), FusedPolicy)
    rapid = make_step_policy(cfg(), plan(PROFILE))
    assert isinstance(rapid, RapidPolicy) and rapid.profile is PROFILE
    static = PartitionPlan("cuda-green", [Configuration("split32", 32, 100)], None, "static")
    fixed = make_step_policy(cfg(mode="static", static_decode_share=0.25), static)
    assert isinstance(fixed, RapidPolicy) and fixed.decide(state()) == Split("split32", 8192)
    pairs = prefix_pair_ms(QWEN, H100)  # the plan's peaks price a chunk's attention to its prefix
    duet = make_step_policy(cfg(policy="duet", profile_lookup="interpolate"), plan(PROFILE))
    assert isinstance(duet, DuetPolicy) and duet.costs == ProfileCosts(PROFILE, interpolate=True, prefix_pair_ms=pairs)
    for how, want in (("auto", ProfileCosts(PROFILE, interpolate=False, interpolate_fused=True, prefix_pair_ms=pairs)),
                      ("round-up", ProfileCosts(PROFILE, interpolate=False, interpolate_fused=False,
                                                prefix_pair_ms=pairs))):
        assert make_step_policy(cfg(policy="duet", profile_lookup=how), plan(PROFILE)).costs == want
    no_peaks = dataclasses.replace(plan(PROFILE), peaks=None)  # none measured: no prefix term (the profile alone)
    assert make_step_policy(cfg(policy="duet"), no_peaks).costs.prefix_pair_ms == 0.0  # type: ignore[attr-defined]
    gemma = preset_config("gemma3-12b")  # 40 of its 48 layers attend to the last 1024 tokens only
    windowed = make_step_policy(EngineConfig("preset:gemma3-12b", gemma, partition=PartitionConfig(policy="duet")),
                                plan(PROFILE)).costs
    added = windowed.fused_ms((2048,) * 64, [(1000, 100000)]) - windowed.fused_ms((2048,) * 64, [(1000, 0)])
    want = prefix_pair_ms(gemma, H100) * (8 / 48 * 1000 * 100000 + 40 / 48 * (1000 * 1024 - 1000 * 1001 // 2))
    assert added == pytest.approx(want)  # not 1000 x 100K pairs on every layer: 5.8x that
    capped = make_step_policy(dataclasses.replace(cfg(policy="duet"), scheduler=SchedulerConfig(
        prefill_batch_tokens=2048)), plan(PROFILE))
    assert capped.decide(state(slo=15.2)) == Split("split64", 2048, 7)  # --prefill-batch-tokens caps its batches
    roofline_plan = plan(synthetic_roofline_profile())
    duet = make_step_policy(cfg(policy="duet"), roofline_plan)
    assert isinstance(duet, DuetPolicy) and isinstance(duet.costs, RooflineCosts) and duet.costs.peaks == H100
    models = {c.name: LinearModel(1.0, 0.01) for c in CONFIGS}
    drift = make_step_policy(cfg(policy="drift"), plan(PROFILE, models))
    assert isinstance(drift, DriftPolicy) and drift.models == models
    with pytest.raises(ValueError, match="prefill models"):
        make_step_policy(cfg(policy="drift"), plan(PROFILE))


def synthetic_roofline_profile() -> object:
    """The plan's profile when no measured one exists: the roofline's own (source "roofline")."""
    import msgspec

    return msgspec.structs.replace(PROFILE, source="roofline")


def test_duet_policy_runs_on_a_roofline_plan() -> None:
    duet = make_step_policy(cfg(policy="duet"), plan(synthetic_roofline_profile()))
    shape = duet.decide(ShapeState((2048,) * 64, PROMPTS, 0, WHOLE, 50.0, 8192))
    # the Qwen3-8B sanity point of test_adaptive_policy, 1520, ended on the decode worker's 1536-token graph bucket
    # with its 64 decode rows (48 tokens deferred rather than 208 of padding to 1792)
    assert shape == Fused(1472) and isinstance(duet, DuetPolicy) and 1536 in duet.params.graph_buckets


def test_duet_without_an_slo_is_fused_with_the_whole_budget_on_every_plan() -> None:
    """`--slo-itl-ms none`: with a cost model (a measured profile, or the roofline and its peaks) duet is DuetPolicy,
    whose rule for no SLO is fused with the whole budget; on a plan without one (one configuration: a CPU,
    --partition-backend none) the same rule needs no prediction: DuetWithoutSlo, duet's workers, never a split."""
    no_slo = cfg(policy="duet", slo_itl_ms=None)
    states = [state(slo=None), state(slo=None, batch=0), state(slo=None, waiting=()), state(slo=None, budget=512),
              state(slo=None, current=DecodeAlone("split64"))]
    for p in (plan(PROFILE), plan(synthetic_roofline_profile())):
        duet = make_step_policy(no_slo, p)
        assert isinstance(duet, DuetPolicy)
        assert [duet.decide(st) for st in states] == [Fused(8192), Fused(8192), DecodeAlone(OVERALLOCATED),
                                                      Fused(512), Fused(8192)]
    bare = PartitionPlan("none", [Configuration(OVERALLOCATED, 0, 0)], None, "no partition backend on cpu")
    duet = make_step_policy(no_slo, bare)
    assert isinstance(duet, DuetWithoutSlo) and duet.workers == ("decode", "prefill") and not duet.reads_waiting
    assert [duet.decide(st) for st in states] == [Fused(8192), Fused(8192), Fused(8192), Fused(512), Fused(8192)]
    with pytest.raises(ValueError, match="needs the plan's peaks"):  # with an SLO a cost model is needed
        make_step_policy(cfg(policy="duet"), bare)
