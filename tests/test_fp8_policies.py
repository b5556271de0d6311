"""Every user of the roofline gets the run's fp8 weights (issue 39; partition/fp8_costs.py): the adaptive policy's
`RooflineCosts`, the plan's fallback profile and peaks (the fp8 GEMM peak measured and said), drift's prefill models,
and duet deciding differently for fp8 weights than for bf16 at the same state."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

import rapidserve.partition.plan as partition_plan
from rapidserve.config import EngineConfig
from rapidserve.config_base import ConfigError
from rapidserve.partition.backend import Granularity
from rapidserve.partition.drift_plan import prefill_models
from rapidserve.partition.duet import decide_duet
from rapidserve.partition.peaks import Peaks
from rapidserve.partition.plan import PartitionPlan
from rapidserve.partition.policies import decide_adaptive
from rapidserve.partition.policy import PolicyState, WaitingPrefill
from rapidserve.partition.profile import Configuration, ProfileVariant
from rapidserve.partition.roofline import concurrent, decode_step_ms, mixed_operators, step_seconds
from rapidserve.partition.roofline_profile import roofline_profile
from rapidserve.partition.runtime import DecodePartition
from rapidserve.partition.shape import DecodeAlone, Fused, ShapeState, Split
from rapidserve.partition.step_costs import RooflineCosts
from rapidserve.partition.step_policies import step_costs
from rapidserve.partition_config import PartitionConfig
from rapidserve.quant_config import ONLINE_FP8, QuantizationConfig
from tests.test_roofline_fp8 import CONFIGS, H200, QWEN, ROOF


def test_roofline_costs_pass_the_quantization_everywhere() -> None:
    f8 = RooflineCosts(QWEN, H200, CONFIGS, quant=ONLINE_FP8)
    assert f8.fused_ms((2048,) * 32, [(1024, 0)]) == pytest.approx(1e3 * step_seconds(
        mixed_operators(QWEN, (2048,) * 32, [(1024, 0)], quant=ONLINE_FP8), 132, H200))
    assert f8.decode_alone_ms("split32", 32, 4096) == decode_step_ms(QWEN, 32, 4096, 32, H200, quant=ONLINE_FP8)
    assert f8.split("split32", 64, 2048, 4096) == concurrent(QWEN, 64, 2048, 32, 100, 4096, H200, quant=ONLINE_FP8)
    assert f8.split("split32", 64, 2048, 4096)[0] < ROOF.split("split32", 64, 2048, 4096)[0]


def qwen_cfg(quant: QuantizationConfig, **partition: Any) -> EngineConfig:
    return EngineConfig("preset:qwen3-8b", QWEN, quantization=quant,
                        partition=PartitionConfig(**partition))  # type: ignore[arg-type]


def test_step_costs_of_an_fp8_run_carry_its_quantization() -> None:
    plan = PartitionPlan("cuda-green", list(CONFIGS), None, "test", H200)
    costs = step_costs(qwen_cfg(ONLINE_FP8, policy="duet"), plan)
    assert isinstance(costs, RooflineCosts) and costs.quant == ONLINE_FP8
    plain = step_costs(qwen_cfg(QuantizationConfig(), policy="duet"), plan)
    assert isinstance(plain, RooflineCosts) and not (plain.quant and plain.quant.enabled)


def test_profile_lookup_without_a_measured_profile_is_refused() -> None:
    """Duet on the roofline (no measured profile) has no buckets to read between or round up to: `--profile-lookup
    interpolate` or `round-up` would change nothing, so either is refused by name rather than ignored (auto, the
    default, is no choice made); with a measured profile it is read."""
    plan = PartitionPlan("cuda-green", list(CONFIGS), None, "roofline of peaks measured now", H200)
    for how in ("interpolate", "round-up"):
        with pytest.raises(ConfigError, match=f"--profile-lookup {how} reads a measured profile.*roofline of peaks"):
            step_costs(qwen_cfg(QuantizationConfig(), policy="duet", profile_lookup=how), plan)
    assert isinstance(step_costs(qwen_cfg(QuantizationConfig(), policy="duet"), plan), RooflineCosts)


def test_drift_prefill_models_of_fp8_weights_are_faster() -> None:
    f8, bf = prefill_models(QWEN, H200, CONFIGS, 8192, quant=ONLINE_FP8), prefill_models(QWEN, H200, CONFIGS, 8192)
    for name in bf:
        assert 0.5 < f8[name].b_ms_per_token / bf[name].b_ms_per_token < 0.65


def test_roofline_profile_of_fp8_weights_is_the_fp8_variant() -> None:
    f8 = roofline_profile(QWEN, "g", "m", H200, CONFIGS, [1, 64], [2048], 4096, created="x", quant=ONLINE_FP8)
    bf = roofline_profile(QWEN, "g", "m", H200, CONFIGS, [1, 64], [2048], 4096, created="x")
    assert (f8.quantization, bf.quantization) == ("fp8", "none")
    for a, b in zip(f8.entries, bf.entries, strict=True):
        assert a.decode_ms_alone_p50 < b.decode_ms_alone_p50 and a.prefill_tokens_per_s > b.prefill_tokens_per_s
    with pytest.raises(ValueError, match="variant quantization='fp8' but the weights estimated are float"):
        roofline_profile(QWEN, "g", "m", H200, CONFIGS, [1], [2048], 4096, variant=ProfileVariant("fp8"))
    with pytest.raises(ValueError, match="variant quantization='none' but the weights estimated are fp8"):
        roofline_profile(QWEN, "g", "m", H200, CONFIGS, [1], [2048], 4096, variant=ProfileVariant(), quant=ONLINE_FP8)


@pytest.fixture
def fp8_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[dict[str, Any]]:
    """resolve_plan on a pretend H200 with no profile committed: its measure_peaks calls are recorded."""
    calls: list[dict[str, Any]] = []

    def peaks(device: Any, dtype: Any = None, **kw: Any) -> Peaks:
        calls.append(kw)
        return msgspec.structs.replace(H200, fp8_matmul_flops=1.3e15) if kw.get("fp8") else H200

    monkeypatch.setenv("RAPIDSERVE_PROFILES_DIR", str(tmp_path))
    monkeypatch.setattr(partition_plan, "device_granularity", lambda kind, device: Granularity(132, 8, 8))
    monkeypatch.setattr(partition_plan, "gpu_name", lambda device: "NVIDIA H200")
    monkeypatch.setattr(partition_plan, "measure_peaks", peaks)
    return calls


@pytest.mark.parametrize("policy", ["rapid", "duet", "drift"])
@pytest.mark.parametrize("quant", [ONLINE_FP8, QuantizationConfig()], ids=["fp8", "bf16"])
def test_the_plan_measures_and_uses_the_fp8_peak(fp8_gpu: list[dict[str, Any]], policy: str,
                                                 quant: QuantizationConfig) -> None:
    """No profile of this variant: the roofline fallback with the fp8 peak measured (fp8 weights) and said, the fp8
    variant's profile, and drift's prefill models of fp8 weights."""
    cfg = qwen_cfg(quant, backend="cuda-green", policy=policy)
    plan = partition_plan.resolve_plan(cfg, SimpleNamespace(type="cuda", index=0))
    assert fp8_gpu and all(kw == {"fp8": quant.enabled} for kw in fp8_gpu)
    assert ("fp8 GEMM 1300 TFLOP/s" in plan.source) == quant.enabled
    assert plan.profile is not None and plan.profile.quantization == ("fp8" if quant.enabled else "none")
    want = partition_plan.roofline_fallback(cfg, "NVIDIA H200", plan.configurations, plan.peaks)  # type: ignore[arg-type]
    assert plan.profile.entries == want.entries
    if policy == "drift":
        assert plan.prefill_models == prefill_models(QWEN, plan.peaks, plan.configurations,  # type: ignore[arg-type]
                                                     cfg.scheduler.max_num_batched_tokens, quant=quant)


# ---- duet decides differently for fp8 weights -----------------------------------------------------------------------
# 64 decodes at 2048 tokens, one 2048-token prompt, ITL SLO 44 ms (limit 39.6): the prompt in one fused step takes
# ~58 ms at bf16 and ~34 ms at fp8 (H200 peaks).

SLO, LIMIT = 44.0, 0.9 * 44.0
PROMPT = (WaitingPrefill("a", 0.0, 2048),)


def test_the_chunk_fits_the_slo_only_at_fp8_speed() -> None:
    f8 = RooflineCosts(QWEN, H200, CONFIGS, quant=ONLINE_FP8)
    assert f8.fused_ms((2048,) * 64, [(2048, 0)]) <= LIMIT < ROOF.fused_ms((2048,) * 64, [(2048, 0)])


@pytest.mark.parametrize(("current", "bf16"), [
    (DecodeAlone("split16"), Split),  # decode held on a split: bf16 keeps splitting (its chunk is not 1.15x better)
    (DecodeAlone(), Fused),  # on the whole GPU: bf16 fuses the part of the prompt that fits
])
def test_adaptive_policy_fuses_the_whole_prompt_at_fp8(current: Any, bf16: type) -> None:
    st = ShapeState((2048,) * 64, PROMPT, 0, current, SLO, 8192)
    configs = (*CONFIGS, Configuration("split16", 16, 116))
    d16, _ = decide_adaptive(st, RooflineCosts(QWEN, H200, configs))
    d8, _ = decide_adaptive(st, RooflineCosts(QWEN, H200, configs, quant=ONLINE_FP8))
    assert d8.shape == Fused(2048) and d8.meets_slo, d8.reason  # one step finishes the prompt within the SLO
    assert isinstance(d16.shape, bf16) and d16.shape != Fused(2048), d16.reason
    assert "finishes every pending prompt" in d8.reason and "finishes every pending prompt" not in d16.reason


def test_duet_aggregates_at_fp8_where_bf16_splits() -> None:
    st = PolicyState(0.0, (2048,) * 64, PROMPT, SLO)
    splits = [*CONFIGS, Configuration("split16", 16, 116)]
    d16 = decide_duet(st, QWEN, H200, splits)
    d8 = decide_duet(st, QWEN, H200, splits, quant=ONLINE_FP8)
    assert (d16.mode, d8.mode) == ("split", "aggregated"), (d16.reason, d8.reason)
    assert d8.predicted_step_ms <= LIMIT and d16.meets_slo
    assert f"mixed step {ROOF.fused_ms((2048,) * 64, [(2048, 0)]):.2f} ms > {LIMIT:g} ms" in d16.reason


def test_decode_partition_gives_duet_the_runs_quantization() -> None:
    """`DecodePartition.advance_duet` (the two-process duet of a plan without DuetPolicy) decides with the run's
    weights: decode beside a 4096-token prefill on the whole GPU (the overallocated model) takes ~60 ms at bf16 and
    ~35 ms at fp8, so fp8 aggregates and bf16 splits."""
    prof = roofline_profile(QWEN, "g", "m", H200, CONFIGS, [64], [2048], 4096, created="x")
    plan = PartitionPlan("cuda-green", list(CONFIGS), prof, "test", H200)
    prompt, modes = (WaitingPrefill("a", 0.0, 4096),), {}
    for name, quant in (("bf16", None), ("fp8", ONLINE_FP8)):
        dp = DecodePartition(PartitionConfig(policy="duet", slo_itl_ms=SLO), plan, QWEN, 8192, quant=quant)
        dp.advance_duet((2048,) * 64, prompt)
        assert dp.last_duet is not None
        want = decide_duet(PolicyState(0.0, (2048,) * 64, prompt, SLO, prefill_budget=8192), QWEN, H200, CONFIGS,
                           shared=True, quant=quant)
        assert (dp.last_duet.mode, dp.last_duet.predicted_step_ms) == (want.mode, want.predicted_step_ms)
        modes[name] = dp.last_duet.mode
    assert modes["fp8"] == "aggregated" != modes["bf16"]
