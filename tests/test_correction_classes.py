"""The fused steps' correction by size class (partition/correction.py): the fused cost model's error depends on the
step's size, so a mix of small and large steps must not price the large ones at the small ones' ratio."""

from __future__ import annotations

import pytest
from test_adaptive_policy import COSTS, PROMPTS, state

from rapidserve.partition.correction import MIN_CLASS_SAMPLES, SIZE_EDGES, Correction, corrected, size_class
from rapidserve.partition.policies import DuetPolicy, decide_adaptive, fused_chunk
from rapidserve.partition.shape import DecodeAlone, Fused, Split, StepTiming


@pytest.mark.parametrize(("tokens", "want"), [(1, 0), (256, 0), (257, 1), (1024, 3), (1025, 4), (1536, 5),
                                              (8192, 11), (8193, 12), (100_000, 12)])
def test_size_class(tokens: int, want: int) -> None:
    assert size_class(tokens) == want and len(SIZE_EDGES) == 12


def fused(rows: int, chunk: int, measured: float, predicted: float) -> StepTiming:
    return StepTiming(Fused(chunk), rows, chunk, predicted, measured)


def test_a_fused_step_updates_the_one_ratio_and_its_class_which_starts_from_it() -> None:
    c = corrected(Correction(fused=1.2), fused(64, 1400, 10.0, 10.0))  # 1464 tokens: class 5, new: from 1.2
    assert c.fused == pytest.approx(1.18) and c.fused_classes == ((5, pytest.approx(1.18), 1),)
    c = corrected(c, fused(10, 300, 14.0, 10.0))  # 310 tokens: class 1, from the one ratio then (1.18)
    assert c.fused == pytest.approx(0.9 * 1.18 + 0.14) and [k for k, _, _ in c.fused_classes] == [1, 5]
    assert c.fused_classes[0][1] == pytest.approx(0.9 * 1.18 + 0.14)
    c = corrected(c, fused(64, 1400, 10.0, 10.0))  # class 5 again: from its own ratio
    assert c.fused_classes[1] == (5, pytest.approx(0.9 * 1.18 + 0.1), 2)
    same = corrected(c, StepTiming(Split("split32", 100), 64, 0, 10.0, 30.0))  # another kind: no class changes
    assert same.fused_classes == c.fused_classes and same.split > 1.0
    assert corrected(c, StepTiming(Fused(0), 64, 0, 10.0, 30.0)).fused_classes == c.fused_classes  # decode-only
    assert corrected(c, fused(64, 1400, 10.0, None)) == c  # type: ignore[arg-type]  # no prediction: nothing


@pytest.mark.parametrize(("classes", "tokens", "want"), [
    ((), 1500, 1.3),  # nothing learnt: the one ratio
    (((5, 0.95, MIN_CLASS_SAMPLES - 1),), 1500, 1.3),  # too few in its class
    (((5, 0.95, MIN_CLASS_SAMPLES),), 1500, 0.95),  # its own
    (((1, 1.4, 50), (5, 0.95, 50)), 300, 1.4), (((1, 1.4, 50), (5, 0.95, 50)), 1900, 0.95),  # nearest learnt
    (((1, 1.4, 50), (5, 0.95, 50)), 3000, 0.95),  # a larger step than any learnt: the largest learnt class's
    (((2, 1.2, 50), (4, 1.0, 50)), 800, 1.2),  # class 3 between two learnt ones: the smaller's (conservative)
])
def test_the_ratio_a_fused_step_is_priced_at(classes: tuple[tuple[int, float, int], ...], tokens: int,
                                             want: float) -> None:
    assert Correction(fused=1.3, fused_classes=classes).fused_ratio(tokens) == want


def test_small_steps_no_longer_shrink_the_large_chunk() -> None:
    """Multi-turn's mix on the H200 (bench/results/h200x2_1130f/): small fused steps ran 1.4x their prediction, large
    ones 1.0x, and the one ratio between them (1.24) priced the large ones 24% slow. Here (the synthetic profile)
    that made the fused chunk so small that a split won; with the classes learnt the step fuses the chunk a 1.0
    ratio gives."""
    st = state(64, 2048)
    mixed = Correction(fused=1.24)
    learnt = Correction(fused=1.24, fused_classes=((1, 1.41, 100), (5, 1.0, 100), (6, 1.0, 100)))
    (d_mixed, _), (d_learnt, _) = (decide_adaptive(st, COSTS, c) for c in (mixed, learnt))
    assert isinstance(d_mixed.shape, Split) and "fused 1136-token chunk" in d_mixed.reason
    assert fused_chunk(st, COSTS, 1.24, 45.0)[0] == 1136
    assert isinstance(d_learnt.shape, Fused) and d_learnt.shape.chunk_tokens == fused_chunk(st, COSTS, 1.0, 45.0)[0]
    assert d_learnt.shape.chunk_tokens > 1136
    assert d_learnt.predicted_ms == pytest.approx(d_learnt.model_ms) and d_learnt.predicted_ms <= 45.0


def test_the_policy_learns_the_classes_from_a_mix_of_steps() -> None:
    """A DuetPolicy fed alternating small steps measured at 1.4x and large ones at 1.0x (as multi-turn ran): the one
    ratio settles between, each class at its own, and the next large chunk is sized at 1.0."""
    policy, st = DuetPolicy(COSTS), state(64, 2048)
    for _ in range(40):
        policy.observe(fused(64, 200, 14.0, 10.0))
        policy.observe(fused(64, 1400, 40.0, 40.0))
    c = policy.correction
    assert 1.1 < c.fused < 1.3
    assert c.fused_ratio(264) == pytest.approx(1.4, rel=0.01) and c.fused_ratio(1464) == pytest.approx(1.0, rel=0.01)
    shape = policy.decide(st)
    assert isinstance(shape, Fused) and shape.chunk_tokens >= fused_chunk(st, COSTS, 1.01, 45.0)[0]
    assert shape.chunk_tokens > fused_chunk(st, COSTS, c.fused, 45.0)[0]


def test_prompts_alone_and_no_slo_are_priced_by_their_size_too() -> None:
    c = Correction(fused=1.3, fused_classes=((11, 1.0, 50),))  # 8192-token steps measured right
    d, _ = decide_adaptive(state(0, 2048, PROMPTS), COSTS, c)  # no decode: the whole budget, 8192 tokens
    assert d.shape == Fused(8192) and d.predicted_ms == pytest.approx(d.model_ms)
    d, _ = decide_adaptive(state(64, 2048, PROMPTS, slo=None), COSTS, c)  # no SLO: 64 + 8192 tokens
    assert d.shape == Fused(8192) and d.predicted_ms == pytest.approx(d.model_ms)
    d, _ = decide_adaptive(state(64, 2048, PROMPTS, slo=None), COSTS, Correction(fused=1.3))
    assert d.predicted_ms == pytest.approx(1.3 * d.model_ms)  # nothing learnt: the one ratio, as before


def split_step(config: str, measured: float, predicted: float, alone: bool = False) -> StepTiming:
    shape = DecodeAlone(config) if alone else Split(config, 256, 4)
    return StepTiming(shape, 64, 0, predicted, measured)


def test_decode_on_a_split_keeps_a_ratio_per_configuration_and_may_fall_to_a_quarter() -> None:
    """Multi-turn on the H200: decode beside short prefill batches ran at 0.35-0.49 of the profile's beside-prefill
    step, and the one split ratio sat at its old clamp 0.5. Now each configuration learns its own, down to 0.25."""
    c = Correction()
    for _ in range(60):
        c = corrected(c, split_step("split32", 3.5, 10.0))
        c = corrected(c, split_step("split16", 6.5, 10.0, alone=True))  # decode alone on split16: its own too
    assert c.split_ratio("split32") == pytest.approx(0.35, abs=0.01) and c.split_ratio("split16") == pytest.approx(
        0.65, abs=0.01)
    assert 0.35 < c.split < 0.65 and c.split_ratio("split64") == c.split  # never run: the one split ratio
    for _ in range(100):
        c = corrected(c, split_step("split32", 1.0, 10.0))  # 0.1: held at lo_split
    assert c.split_ratio("split32") == pytest.approx(0.25)
    f = Correction()
    for _ in range(100):
        f = corrected(f, fused(64, 1400, 1.0, 10.0))
    assert f.fused == pytest.approx(0.5) and f.fused_ratio(1464) == pytest.approx(0.5)  # fused keeps its 0.5
    assert Correction(split=0.5, split_configs=(("split32", 0.4, MIN_CLASS_SAMPLES - 1),)).split_ratio("split32") == 0.5


def test_a_split_is_priced_at_its_configurations_ratio() -> None:
    """split32's decode beside prefill, learnt at 0.4 of the profile's, is priced so in the policy's options and its
    decision, where the one split ratio (0.5) priced it 25% slower."""
    from rapidserve.partition.policies import DEFAULT_PARAMS, split_options

    st = state(64, 2048)
    one = split_options(st, COSTS, Correction(split=0.5), DEFAULT_PARAMS, 8192)
    learnt = split_options(st, COSTS, Correction(split=0.5, split_configs=(("split32", 0.4, 50),)), DEFAULT_PARAMS,
                           8192)
    assert learnt["split32"].step_ms == pytest.approx(0.8 * one["split32"].step_ms)
    assert learnt["split64"].step_ms == pytest.approx(one["split64"].step_ms)


def test_per_kind_learns_no_class_and_clamps_splits_at_a_half() -> None:
    """--step-correction per-kind (the correction before 2026-11-30): one ratio per kind, the split's held at 0.5."""
    from rapidserve.partition.correction import CorrectionParams

    per_kind = CorrectionParams(by_shape=False)
    c = Correction()
    for _ in range(100):
        c = corrected(c, fused(64, 200, 14.0, 10.0), per_kind)
        c = corrected(c, split_step("split32", 3.0, 10.0), per_kind)
    assert c.fused_classes == () and c.split_configs == ()
    assert c.fused_ratio(264) == c.fused == pytest.approx(1.4, rel=0.01) and c.split_ratio("split32") == c.split == 0.5


def test_the_flag_reaches_the_policy() -> None:
    from rapidserve.config import EngineConfig, SchedulerConfig
    from rapidserve.loader.presets import preset_config
    from rapidserve.partition.plan import PartitionPlan
    from rapidserve.partition.step_policies import make_step_policy
    from rapidserve.partition_config import PartitionConfig

    cfg = EngineConfig(model="preset:qwen3-8b", model_config=preset_config("qwen3-8b"),
                       scheduler=SchedulerConfig(max_model_len=8192),
                       partition=PartitionConfig(policy="duet", step_correction="per-kind"))
    plan = PartitionPlan("cuda-green", list(COSTS.profile.configurations), COSTS.profile, "a synthetic profile")
    policy = make_step_policy(cfg, plan)
    assert isinstance(policy, DuetPolicy) and policy.correction_params.by_shape is False
    with pytest.raises(Exception, match="step_correction='per-step'; use one of by-shape, per-kind"):
        PartitionConfig(policy="duet", step_correction="per-step")


H200_LIKE = Correction(fused=1.2, fused_classes=((1, 1.41, 50), (2, 1.18, 50), (3, 1.15, 50), (4, 1.0, 50),
                                                 (5, 1.0, 50), (6, 1.0, 50)))  # small steps slow, large ones not


def test_the_chunk_is_the_largest_that_fits_across_the_class_edges() -> None:
    """A larger step can be priced lower (its class learnt at 1.0 where the one below it has 1.15): the search takes
    each class from the largest down, so it finds the largest chunk that fits, not the first a bisection over all
    sizes stops at (64 rows at 512, a 26-ms limit: 976 tokens fit at 1.0 where a bisection found 832 at 1.15)."""
    st = state(64, 512)
    c, raw = fused_chunk(st, COSTS, H200_LIKE, 26.0)
    assert c == 976 and raw * H200_LIKE.fused_ratio(64 + c) <= 26.0
    for k in range(c + 16, min(st.max_chunk_tokens, st.pending_tokens) + 1, 16):  # nothing larger fits
        assert COSTS.fused_ms(st.decode_contexts, [(k, 0)]) * H200_LIKE.fused_ratio(64 + k) > 26.0, k
    assert fused_chunk(st, COSTS, 1.0, 26.0) == fused_chunk(st, COSTS, Correction(fused=1.0), 26.0)  # one ratio: same


def test_a_trim_to_the_bucket_below_never_prices_the_step_over_the_limit() -> None:
    """on_bucket may end a chunk on the bucket below (an edge of a size class too); where that smaller step's class
    prices it over the limit the chunk stays as found (padded up), so a fused step the policy takes meets the SLO."""
    import dataclasses

    from rapidserve.config import RunnerConfig
    from rapidserve.partition.policies import DEFAULT_PARAMS

    buckets = tuple(b for b in RunnerConfig().prefill_graph_tokens if b <= 8192)
    params = dataclasses.replace(DEFAULT_PARAMS, graph_buckets=buckets)
    for batch in (1, 16, 64, 256):
        for ctx in (512, 2048, 8192):
            for tenth in range(100, 1500, 5):
                slo = tenth / 10 / params.margin
                d, _ = decide_adaptive(state(batch, ctx, slo=slo), COSTS, H200_LIKE, None, params)
                if isinstance(d.shape, Fused) and d.shape.chunk_tokens > 0:
                    assert d.meets_slo and d.predicted_ms is not None and d.predicted_ms <= tenth / 10 + 1e-9, (
                        batch, ctx, tenth, d.reason)


def test_decode_alone_on_a_whole_gpu_that_is_a_split_is_priced_as_a_split() -> None:
    """A plan without an overallocated configuration (the whole GPU is its largest split): decode alone there is
    learnt as the split kind (correction.kind_of), so it is priced at that configuration's split ratio."""
    from rapidserve.partition.policies import whole_config
    from rapidserve.partition.profile import Profile
    from rapidserve.partition.step_costs import ProfileCosts

    prof = COSTS.profile
    splits = [c for c in prof.configurations if c.decode_units > 0]
    no_whole = Profile(prof.gpu, prof.model, prof.num_compute_units, splits, prof.batch_buckets, prof.context_buckets,
                       [e for e in prof.entries if e.config != "overallocated"], prof.created, prof.source)
    costs = ProfileCosts(no_whole)
    whole = whole_config(costs)
    corr = Correction(split=0.4, split_configs=((whole, 0.4, 50),))
    d, _ = decide_adaptive(state(16, 2048, (), current=DecodeAlone(whole)), costs, corr)
    assert d.shape == DecodeAlone(whole) and d.predicted_ms == pytest.approx(0.4 * d.model_ms)


def test_classes_learnt_alike_are_one_segment_of_the_chunk_search() -> None:
    """The chunk search bisects once where the ratio does not change across classes (nothing learnt, or learnt
    alike): no evaluation per class edge on the decode worker's host path; and where classes differ, one segment
    each."""
    from rapidserve.partition.fused_chunk import _ratio_segments

    assert _ratio_segments(Correction(fused=1.2), 64, 8192) == [(1, 8192, 1.2)]
    alike = Correction(fused=1.2, fused_classes=((3, 1.2, 50), (5, 1.2, 50)))
    assert _ratio_segments(alike, 64, 8192) == [(1, 8192, 1.2)]
    segments = _ratio_segments(H200_LIKE, 64, 3000)
    assert [r for _, _, r in segments] == [1.41, 1.18, 1.15, 1.0] and segments[0][0] == 1 and segments[-1][1] == 3000
    assert all(a[1] + 1 == b[0] for a, b in zip(segments, segments[1:], strict=False))


def test_the_flag_is_refused_where_no_slo_is_compared() -> None:
    from rapidserve.config_base import ConfigError
    from rapidserve.partition_config import PartitionConfig

    with pytest.raises(ConfigError, match="--step-correction per-kind .* --slo-itl-ms none gives none"):
        PartitionConfig(policy="duet", slo_itl_ms=None, step_correction="per-kind")
    assert PartitionConfig(policy="duet", slo_itl_ms=None).step_correction == "by-shape"  # the default: no flag
