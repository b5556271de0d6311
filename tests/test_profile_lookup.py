"""`--profile-lookup auto` (the default): duet's fused-step composition reads the profile between its buckets, a decode
step on a configuration (decode alone, beside the prefill worker) rounds up to them (partition_config's docstring)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rapidserve.partition.profile import load_profile
from rapidserve.partition.step_costs import ProfileCosts
from rapidserve.partition_config import lookup_interpolates

H200 = Path(__file__).resolve().parents[1] / "profiles" / "nvidia-h200__preset-qwen3-8b.json"


@pytest.mark.parametrize(("how", "fused", "want"), [
    ("auto", True, True), ("auto", False, False),
    ("interpolate", True, True), ("interpolate", False, True),
    ("round-up", True, False), ("round-up", False, False),
])
def test_lookup_interpolates(how: str, fused: bool, want: bool) -> None:
    assert lookup_interpolates(how, fused=fused) is want


def test_lookup_interpolates_refuses_an_unknown_lookup() -> None:
    with pytest.raises(ValueError, match="profile_lookup='nearest'; use one of auto, interpolate, round-up"):
        lookup_interpolates("nearest", fused=True)


def test_fused_composition_has_no_jump_at_a_bucket_edge() -> None:
    """On the committed H200 profile (batch buckets 256 / 512, context 2048 / 8192) one more decode row past a bucket
    made the rounded-up fused step 24% longer (one token of context past 2048: 64%), a bias the one correction ratio
    then carried into every step's chunk; read between the buckets (auto) the row costs what a row costs. Decode
    alone and splits still round up."""
    profile = load_profile(H200)
    assert profile.batch_buckets[-2:] == [256, 512] and profile.context_buckets[-2:] == [2048, 8192]
    up, auto = ProfileCosts(profile, interpolate_fused=False), ProfileCosts(profile)
    step = [(1140, 0)]
    jump_up = up.fused_ms([1150] * 257, step) / up.fused_ms([1150] * 256, step)
    jump_auto = auto.fused_ms([1150] * 257, step) / auto.fused_ms([1150] * 256, step)
    assert jump_up > 1.2 and 1.0 <= jump_auto < 1.01
    ctx_up = up.fused_ms([2049] * 128, step) / up.fused_ms([2048] * 128, step)
    ctx_auto = auto.fused_ms([2049] * 128, step) / auto.fused_ms([2048] * 128, step)
    assert ctx_up > 1.5 and 1.0 <= ctx_auto < 1.01
    # what the policy compares a split with is unchanged: decode alone and beside prefill round up as before
    for config in ("overallocated", profile.configurations[-1].name):
        assert auto.decode_alone_ms(config, 300, 1150) == up.decode_alone_ms(config, 300, 1150)
        assert auto.split(config, 300, 1150, 4096) == up.split(config, 300, 1150, 4096)
