"""A split's prefill batch pays its chunks' attention to their cached prefixes, as a fused chunk does.

The fused composition adds a chunk's (query, key) pairs beyond its prefix at `prefix_pair_ms` each
(partition/step_costs.py); the split's prefill tokens/s is the profile's (or the roofline's) forward at prefix 0. Priced
on one side only, duet saw a split as faster than a fused step deep into a long prompt or after a long cached
conversation: with the committed H200 profile and H200 peaks, 8 decode rows at 12K and a prompt's last 3000 tokens
after 8000 chunked, duet split (31.3K tok/s predicted) over a fused 1056-token chunk (23.5K); on the H200's Mooncake
run (2026-11-30, 21:00 UTC) 77-85% of duet's steps were split, about 1% fused. Now `StepCosts.prefix_ms` prices the
same pairs on the split's prefill share and `split_options` counts them in its tokens/s."""

from __future__ import annotations

import dataclasses

import pytest

from rapidserve.loader.presets import preset_config
from rapidserve.partition.policies import DEFAULT_PARAMS, NO_CORRECTION, decide_adaptive, split_options
from rapidserve.partition.policy import WaitingPrefill
from rapidserve.partition.roofline import Peaks, prefix_pair_ms, prefix_pairs
from rapidserve.partition.shape import Fused, Split
from rapidserve.partition.step_costs import RooflineCosts
from tests.test_adaptive_policy import CONFIGS, COSTS, state

RATE = 2e-6  # ms per (query, key) pair on the whole GPU (an H200's order: 1.5e-6 for Qwen3-8B)
PRICED = dataclasses.replace(COSTS, prefix_pair_ms=RATE)


@pytest.mark.parametrize(("config", "share"), [("overallocated", 1.0), ("split32", 132 / 100), ("split64", 132 / 68)])
def test_the_split_pays_the_fused_compositions_pairs_on_its_share(config: str, share: float) -> None:
    chunks = [(3000, 8000), (500, 0)]  # a prompt's last 3000 tokens after 8000 computed, then a new one
    assert PRICED.prefix_ms(config, chunks) == pytest.approx(RATE * 3000 * 8000 * share)
    assert PRICED.prefix_ms(config, [(500, 0)]) == 0.0  # no prefix: the profile's forward as measured
    assert COSTS.prefix_ms(config, chunks) == 0.0  # no rate (no peaks measured): nothing, as the fused side
    windowed = dataclasses.replace(PRICED, prefix_windows=((4096, 1.0),))  # Mistral: the window's pairs only
    assert windowed.prefix_ms(config, chunks) == pytest.approx(RATE * prefix_pairs(3000, 8000, 4096) * share)


def test_the_split_options_tokens_per_s_count_the_prefix_time() -> None:
    head = (WaitingPrefill("c", 0.0, 3000, 8000),)
    st = state(batch=16, context=8192, waiting=head)
    plain = split_options(st, COSTS, NO_CORRECTION, DEFAULT_PARAMS, 3000)
    priced = split_options(st, PRICED, NO_CORRECTION, DEFAULT_PARAMS, 3000)
    for name, o in priced.items():
        p = o.shape.prefill_batch_tokens  # type: ignore[union-attr]
        tps = COSTS.split(name, 16, 8192, p)[1]
        want = p / (p / tps + PRICED.prefix_ms(name, [(p, 8000)]) / 1e3)
        assert o.tokens_per_s == pytest.approx(want) and o.tokens_per_s < plain[name].tokens_per_s
        assert o.step_ms == plain[name].step_ms  # decode's step beside it is unchanged


def test_deep_into_a_long_prompt_duet_no_longer_splits_for_a_throughput_it_does_not_have() -> None:
    """The same state, unpriced on the split's side (before) splits; priced on both, the fused chunk wins."""
    st = state(batch=16, context=8192, waiting=(WaitingPrefill("c", 0.0, 3000, 8000),))
    fused_only = dataclasses.replace(COSTS, prefix_pair_ms=RATE)
    before = decide_adaptive(st, _SplitUnpriced(fused_only))[0]
    after = decide_adaptive(st, fused_only)[0]
    assert isinstance(before.shape, Split), before.reason
    assert isinstance(after.shape, Fused) and after.shape.chunk_tokens > 0, after.reason


@dataclasses.dataclass(frozen=True)
class _SplitUnpriced:
    """ProfileCosts as before this change: the prefix priced in fused steps only."""

    inner: object

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def prefix_ms(self, config: str, chunks: object) -> float:
        return 0.0


def test_roofline_costs_price_the_same_pairs() -> None:
    model = preset_config("qwen3-8b")
    peaks = Peaks(num_compute_units=132, matmul_flops=790e12, hbm_bw=4.4e12)
    costs = RooflineCosts(model, peaks, tuple(CONFIGS))
    rate = prefix_pair_ms(model, peaks)
    assert costs.prefix_ms("split64", [(1000, 6000)]) == pytest.approx(rate * 1000 * 6000 * 132 / 68)
    assert costs.prefix_ms("overallocated", [(1000, 0)]) == 0.0
