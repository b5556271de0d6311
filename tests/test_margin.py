"""Duet's SLO margin adapted to the token gaps its steps made (partition/margin.py), table-tested; its wiring into
DuetPolicy, make_step_policy, the flag and the Stats."""

from __future__ import annotations

import argparse

import pytest

from rapidserve.config_base import ConfigError
from rapidserve.engine.step_tally import correction_ratios
from rapidserve.partition.margin import DEFAULT_MARGIN, Margin, MarginParams, adapted
from rapidserve.partition.policies import DuetPolicy, fused_chunk
from rapidserve.partition.shape import DecodeAlone, Fused, Split, StepTiming
from rapidserve.partition.step_policies import make_step_policy
from rapidserve.partition_config import PartitionConfig
from rapidserve.policy_spec import conflicts, given_settings
from tests.test_adaptive_policy import COSTS, state
from tests.test_step_policies import PROFILE, cfg, plan

P = MarginParams(start=0.9, lo=0.8, hi=0.97, target_over=0.1, decay=0.5, min_gaps=1.5, up=0.01, down=0.05,
                 binding=0.8)


def step(gap: float | None, measured: float = 44.0, shape: object = Fused(1024), chunk: int = 1000,
         idle: float | None = None) -> StepTiming:
    return StepTiming(shape, 64, chunk, 40.0, measured, gap, idle)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("before", "timing", "slo", "after"),
    [
        # counted: a binding fused step (44 ms >= 0.8 x 0.9 x 50) with a gap; under min_gaps nothing moves yet
        (Margin(0.9), step(45.0), 50.0, Margin(0.9, 1.0, 0.0)),
        (Margin(0.9), step(55.0), 50.0, Margin(0.9, 1.0, 1.0)),
        # past min_gaps, on the event: a gap within while few are over -> up; a gap over while too many are -> down;
        # a gap within while many are over, or one over while few are, holds it
        (Margin(0.9, 1.0, 0.0), step(45.0), 50.0, Margin(0.91, 1.5, 0.0)),
        (Margin(0.9, 1.0, 0.0), step(55.0), 50.0, Margin(0.85, 1.5, 1.0)),
        (Margin(0.9, 4.0, 2.0), step(45.0), 50.0, Margin(0.9, 3.0, 1.0)),  # share 0.33 > target: no rise
        (Margin(0.9, 40.0, 0.0), step(55.0), 50.0, Margin(0.9, 21.0, 1.0)),  # share 0.048 < target: no fall
        (Margin(0.9, 10.0, 0.8), step(45.0), 50.0, Margin(0.9, 6.0, 0.4)),  # share 0.067: in [target / 2, target]
        # the bounds hold
        (Margin(0.97, 4.0, 0.0), step(45.0), 50.0, Margin(0.97, 3.0, 0.0)),
        (Margin(0.8, 4.0, 4.0), step(60.0, measured=41.0), 50.0, Margin(0.8, 3.0, 3.0)),
        (Margin(0.8, 4.0, 0.0), step(45.0, measured=41.0), 50.0, Margin(0.81, 3.0, 0.0)),
        # not counted: no SLO, no gap, a bad gap, a step with no prompt tokens, a split or decode-alone step, and a
        # step well under the limit it was planned within (a light load says nothing about the margin)
        (Margin(0.9, 3.0, 0.0), step(45.0), None, Margin(0.9, 3.0, 0.0)),
        (Margin(0.9, 3.0, 0.0), step(None), 50.0, Margin(0.9, 3.0, 0.0)),
        (Margin(0.9, 3.0, 0.0), step(float("nan")), 50.0, Margin(0.9, 3.0, 0.0)),
        (Margin(0.9, 3.0, 0.0), step(45.0, chunk=0), 50.0, Margin(0.9, 3.0, 0.0)),
        (Margin(0.9, 3.0, 0.0), step(60.0, shape=DecodeAlone("overallocated")), 50.0, Margin(0.9, 3.0, 0.0)),
        # decode on a split's share was sized by the margin too (Split, or DecodeAlone on a split): counted
        (Margin(0.9, 3.0, 0.0), step(60.0, shape=Split("split32", 1024), chunk=0), 50.0, Margin(0.85, 2.5, 1.0)),
        (Margin(0.9, 3.0, 0.0), step(45.0, shape=DecodeAlone("split32"), chunk=0), 50.0, Margin(0.91, 2.5, 0.0)),
        (Margin(0.9, 3.0, 0.0), step(20.0, measured=20.0), 50.0, Margin(0.9, 3.0, 0.0)),
        # a gap over the SLO only by the device's idle time before the step (a host-bound bubble): not counted;
        # over by more than that idle time: counted as over (the step itself was too long)
        (Margin(0.9, 1.0, 0.0), step(55.0, idle=7.0), 50.0, Margin(0.9, 1.0, 0.0)),
        (Margin(0.9, 1.0, 0.0), step(55.0, idle=3.0), 50.0, Margin(0.85, 1.5, 1.0)),
        (Margin(0.9, 1.0, 0.0), step(45.0, idle=7.0), 50.0, Margin(0.91, 1.5, 0.0)),  # within: counted as ever
        (Margin(0.9, 1.0, 0.0), step(55.0, idle=float("nan")), 50.0, Margin(0.85, 1.5, 1.0)),
    ],
)
def test_adapted(before: Margin, timing: StepTiming, slo: float | None, after: Margin) -> None:
    got = adapted(before, timing, slo, P)
    assert got.margin == pytest.approx(after.margin) and got.gaps == pytest.approx(after.gaps)
    assert got.over == pytest.approx(after.over)


def test_steady_runs_move_it_to_its_bounds() -> None:
    """With the defaults: binding steps whose gaps stay within the SLO raise the margin to hi; a run where every
    tenth gap is over (10% > the 1% target) lowers it to lo."""
    m = Margin()
    for _ in range(400):
        m = adapted(m, step(44.0), 50.0)
    assert m.margin == pytest.approx(DEFAULT_MARGIN.hi)
    for i in range(1000):
        m = adapted(m, step(55.0 if i % 10 == 0 else 44.0), 50.0)
    assert m.margin == pytest.approx(DEFAULT_MARGIN.lo)


def test_the_simulation_settles_with_about_the_target_over() -> None:
    """bench/margin_sim.py (the rule on simulated steps): a steadier GPU earns a higher margin, and the share of gaps
    over the SLO stays near the 1% target at every jitter."""
    import importlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    sim = importlib.import_module("margin_sim")
    rows = [sim.simulate(j, h, 3000, 50.0, 1000, 1) for j, h in sim.CASES]
    means = [r["margin_mean"] for r in rows]
    assert means == sorted(means, reverse=True) and means[0] > 0.95 and means[-1] < 0.9
    assert all(r["gaps_over_share"] <= 0.015 for r in rows)


@pytest.mark.parametrize("bad", [dict(lo=0.95, start=0.9), dict(hi=1.1), dict(target_over=0.0), dict(decay=1.0),
                                 dict(up=0.0), dict(binding=0.0), dict(min_gaps=0.5)])
def test_params_are_checked(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="MarginParams"):
        MarginParams(**bad)


def test_duet_policy_plans_within_the_adapted_margin() -> None:
    """The margin DuetPolicy learnt is the one its next decision plans within: a higher margin, a larger fused chunk
    (as `fused_chunk` gives at that limit); a fixed margin (margin=None) never moves."""
    s = state(batch=64)
    adaptive = DuetPolicy(COSTS, margin=DEFAULT_MARGIN)
    fixed = DuetPolicy(COSTS)
    assert adaptive.decide(s) == fixed.decide(s)  # both start at 0.9
    for p in (adaptive, fixed):
        for _ in range(400):
            p.observe(step(44.0))
    assert adaptive.margin.margin == pytest.approx(DEFAULT_MARGIN.hi) and fixed.margin.margin == 0.9
    big, small = adaptive.decide(s), fixed.decide(s)
    assert isinstance(big, Fused) and isinstance(small, Fused) and big.chunk_tokens > small.chunk_tokens
    want, _ = fused_chunk(s, COSTS, 1.0, DEFAULT_MARGIN.hi * 50.0)
    assert big.chunk_tokens <= want and adaptive.last is not None and adaptive.last.predicted_ms is not None
    assert adaptive.last.predicted_ms <= DEFAULT_MARGIN.hi * 50.0
    assert fixed.last is not None and fixed.last.predicted_ms is not None and fixed.last.predicted_ms <= 0.9 * 50.0
    assert correction_ratios(adaptive)["slo_margin"] == pytest.approx(DEFAULT_MARGIN.hi)
    assert "slo_margin" not in correction_ratios(fixed)


@pytest.mark.parametrize(("given", "adapts", "margin"), [(None, True, 0.9), (0.95, False, 0.95), (1.0, False, 1.0)])
def test_make_step_policy_reads_slo_margin(given: float | None, adapts: bool, margin: float) -> None:
    duet = make_step_policy(cfg(policy="duet", slo_margin=given), plan(PROFILE))
    assert isinstance(duet, DuetPolicy) and (duet.margin_params is not None) == adapts
    assert duet.params.margin == margin and duet.margin.margin == margin


def test_no_slo_no_margin_to_adapt() -> None:
    duet = make_step_policy(cfg(policy="duet", slo_itl_ms=None), plan(PROFILE))
    assert isinstance(duet, DuetPolicy) and duet.margin_params is None and "slo_margin" not in correction_ratios(duet)


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5, True, float("nan")])
def test_config_refuses_a_bad_margin(bad: object) -> None:
    with pytest.raises(ConfigError, match="slo_margin"):
        PartitionConfig(policy="duet", slo_margin=bad)  # type: ignore[arg-type]


def test_a_margin_without_an_slo_is_refused() -> None:
    """`--slo-itl-ms none --slo-margin 0.95`: duet then fuses every step with the whole budget and plans within no
    SLO, so the margin would change nothing: refused, naming both flags."""
    with pytest.raises(ConfigError, match="--slo-margin 0.95 is a share of the ITL SLO, and --slo-itl-ms none"):
        PartitionConfig(policy="duet", slo_itl_ms=None, slo_margin=0.95)
    assert PartitionConfig(policy="duet", slo_itl_ms=None).slo_margin is None  # auto with no SLO: nothing given


def test_flag_values() -> None:
    from rapidserve.cli_args import _slo_margin

    assert _slo_margin("auto") is None and _slo_margin("0.95") == 0.95 and _slo_margin("1") == 1.0
    for bad in ("0", "1.2", "high", "-1"):
        with pytest.raises(argparse.ArgumentTypeError, match="auto"):
            _slo_margin(bad)


@pytest.mark.parametrize(("policy", "refused"), [("duet", False), ("rapid", True), ("drift", True)])
def test_only_duet_reads_it(policy: str, refused: bool) -> None:
    found = conflicts("rapid", policy, given_settings({"partition": PartitionConfig(policy=policy, slo_margin=0.95)}))
    assert bool(found) == refused
    if refused:
        assert found[0].startswith("--slo-margin: not read by --policy") and "--policy duet" in found[0]
