"""`--policy drift` carried out (partition/drift_plan.py, DecodePartition.advance_drift): the prefill
time models fitted at start-up, the configuration decode applies (with hysteresis) and the decode-step
estimate it sends prefill; the flags; `resolve_plan` on CPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rapidserve.cli import build_parser
from rapidserve.cli_args import partition_config
from rapidserve.config import EngineConfig
from rapidserve.config_base import ConfigError
from rapidserve.loader.presets import preset_config
from rapidserve.partition.drift import DriftDecision, LinearModel
from rapidserve.partition.drift_plan import decode_ms_beside, drift_configuration, prefill_models
from rapidserve.partition.manager import ManagerState
from rapidserve.partition.plan import PartitionPlan, PlanWire, resolve_plan
from rapidserve.partition.policy import WaitingPrefill
from rapidserve.partition.profile import OVERALLOCATED, Configuration
from rapidserve.partition.roofline import Peaks, prefill_operators, step_seconds
from rapidserve.partition.runtime import DecodePartition
from rapidserve.partition_config import PartitionConfig
from rapidserve.policy_spec import check_settings
from tests.test_partition_manager import h100_profile

FULL = h100_profile()  # overallocated + split16/32/48/64 on 132 SMs; batch 32 at 3000 tokens: beside p95 (ms)
# overallocated 74, split16 10.8, split32 6.54, split48 7.5, split64 5.44
PEAKS = Peaks(matmul_flops=794e12, hbm_bw=2.98e12, num_compute_units=132)
QWEN = preset_config("qwen3-8b")


def test_prefill_models_fit_the_roofline() -> None:
    models = prefill_models(QWEN, PEAKS, FULL.configurations, 8192)
    assert set(models) == {c.name for c in FULL.configurations}
    for c in FULL.configurations:
        units = c.prefill_units or 132
        want = 1e3 * step_seconds(prefill_operators(QWEN, 8192), units, PEAKS)
        assert models[c.name].ms(8192) == pytest.approx(want, rel=0.1)
        assert models[c.name].b_ms_per_token > 0
    by_units = sorted(FULL.configurations, key=lambda c: c.prefill_units or 132)
    times = [models[c.name].ms(4096) for c in by_units]
    assert times == sorted(times, reverse=True)  # fewer prefill units, slower


def _d(action: str, config: str) -> DriftDecision:
    return DriftDecision(action, (), config, 4, 10.0, "test")  # type: ignore[arg-type]


BESIDE = decode_ms_beside(FULL, 32, 3000)


@pytest.mark.parametrize(("current", "held", "d", "running", "want"), [
    ("split16", 0, _d("idle", "split16"), True, OVERALLOCATED),  # nothing waits: decode alone after the hold...
    ("split16", 0, _d("start", "split16"), True, "split16"),  # ...kept while prefill waits
    (OVERALLOCATED, 0, _d("start", "split16"), True, "split16"),  # overallocated breaks the SLO: at once
    ("split64", 0, _d("start", "split16"), True, "split64"),  # split64 meets it: held (hysteresis)
    ("split64", 8, _d("start", "split16"), True, "split16"),  # ...until held 8 steps
    ("split64", 0, _d("start", "split16"), False, OVERALLOCATED),  # no decode: prefill on every unit, at once
    ("gone", 0, _d("start", "split16"), True, "split16"),  # current not in the profile: at once
])
def test_drift_configuration(current: str, held: int, d: DriftDecision, running: bool, want: str) -> None:
    state = ManagerState(current, held)
    name, reason, nxt = drift_configuration(state, d, FULL, BESIDE, 45.0, decode_running=running)
    if current == "split16" and d.action == "idle":  # held 0 < 8: not yet
        assert name == "split16" and "hold" in reason
        name, _, _ = drift_configuration(ManagerState(current, 8), d, FULL, BESIDE, 45.0, decode_running=running)
        assert name == want
        return
    assert name == want, reason
    assert nxt.config == name and (nxt.steps_since_switch == 0) == (name != current)


def drift_partition(slo: float = 50.0) -> DecodePartition:
    plan = PartitionPlan("cuda-green", list(FULL.configurations), FULL, "synthetic H100 profile", PEAKS,
                         prefill_models(QWEN, PEAKS, FULL.configurations, 8192))
    return DecodePartition(PartitionConfig(policy="drift", slo_itl_ms=slo, slo_ttft_ms=1000.0), plan, QWEN, 8192)


def test_decode_partition_drift_scenario() -> None:
    dp = drift_partition()
    decodes = (3000,) * 32
    prompts = tuple(WaitingPrefill(f"p{i}", 0.0, 2048) for i in range(4))
    assert dp.advance_drift(decodes, ()) is None and dp.current == OVERALLOCATED  # decode alone
    assert dp.hint_ms == BESIDE[OVERALLOCATED] and dp.hint_due()
    assert dp.sent_hint() == BESIDE[OVERALLOCATED] and not dp.hint_due()
    s = dp.advance_drift(decodes, prompts)  # overallocated would break the SLO beside prefill: at once
    assert s is not None and (s.old, s.new) == (OVERALLOCATED, "split16") and s.prefill_pending
    assert dp.hint_ms == BESIDE["split16"] and dp.hint_due()
    assert dp.sent_hint() == BESIDE["split16"]
    assert dp.advance_drift(decodes, prompts) is None and not dp.hint_due()  # same bucket: nothing to send
    assert dp.advance_drift((100,) * 4, prompts) is None and dp.hint_due()  # a smaller bucket: a new estimate
    assert dp.hint_ms == decode_ms_beside(FULL, 4, 100)["split16"]
    assert dp.advance_drift((), prompts) is not None and dp.current == OVERALLOCATED  # no decode: prefill on all
    assert dp.hint_ms is None
    tight = drift_partition(slo=10.0)  # limit 9 ms: split32 is the one with the most prefill units within it
    s = tight.advance_drift(decodes, prompts)
    assert s is not None and s.new == "split32"


def test_decode_partition_drift_not_adaptive() -> None:
    plan = PartitionPlan("none", [Configuration(OVERALLOCATED, 0, 0)], None, "partition off")
    dp = DecodePartition(PartitionConfig(policy="drift"), plan)
    assert dp.advance_drift((100,), ()) is None and not dp.hint_due()


def test_resolve_plan_cpu_fits_or_takes_the_prefill_model() -> None:
    def cfg(**kw: Any) -> EngineConfig:
        return EngineConfig("preset:tiny-llama", preset_config("tiny-llama"),
                            partition=PartitionConfig(policy="drift", **kw))

    plan = resolve_plan(cfg(), torch.device("cpu"), torch.float32)
    assert plan.peaks is not None and "drift prefill model (roofline" in plan.source
    assert set(plan.prefill_models) == {OVERALLOCATED} and plan.prefill_models[OVERALLOCATED].b_ms_per_token > 0
    wire = plan.wire()
    assert wire.prefill_models[OVERALLOCATED] == (plan.prefill_models[OVERALLOCATED].a_ms,
                                                  plan.prefill_models[OVERALLOCATED].b_ms_per_token)
    import msgspec

    assert msgspec.msgpack.decode(msgspec.msgpack.encode(wire), type=PlanWire) == wire
    given = resolve_plan(cfg(drift_prefill_model=(1.0, 0.5)), torch.device("cpu"))
    assert given.prefill_models == {OVERALLOCATED: LinearModel(1.0, 0.5)} and "given: 1 + 0.5" in given.source
    assert resolve_plan(EngineConfig("preset:tiny-llama", preset_config("tiny-llama")),
                        torch.device("cpu")).prefill_models == {}  # rapid: none


@pytest.mark.parametrize(("kw", "pattern"), [
    (dict(policy="drift", slo_ttft_ms_per_1k_tokens=100.0), "give --slo-ttft-ms too"),
    (dict(policy="drift", slo_ttft_ms=-1.0), "slo_ttft_ms=-1.0 must be a positive number"),
    (dict(policy="drift", drift_prefill_model=(1.0, 0.0)), "must be \\(a_ms >= 0, b_ms_per_token > 0\\)"),
])
def test_drift_config_invalid(kw: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        PartitionConfig(**kw)


@pytest.mark.parametrize(("kw", "pattern"), [
    (dict(slo_ttft_ms=500.0), "--slo-ttft-ms: not read by --policy rapid --partition adaptive; drop it "
                              "\\(read by --policy drift\\)"),
    (dict(policy="duet", drift_prefill_model=(1.0, 1.0)), "--drift-prefill-model: not read by --policy duet; drop it "
                                                          "\\(read by --policy drift\\)"),
    (dict(policy="drift", mode="off"), "--partition off: --policy drift runs with --partition adaptive \\(it picks "
                                       "among partition configurations\\)"),
])
def test_drift_settings_refused_by_the_flag_check(kw: dict[str, Any], pattern: str) -> None:
    """The drift-only settings, and drift's partition mode, are the one flag check's (policy_spec) to refuse; it took
    these rules over from PartitionConfig."""
    p = PartitionConfig(**kw)
    with pytest.raises(ConfigError, match=pattern):
        check_settings("rapid", p.policy, {"partition": p})


def test_cli_drift_flags() -> None:
    a = build_parser().parse_args(["serve", "--policy", "drift", "--slo-ttft-ms", "800",
                                   "--slo-ttft-ms-per-1k-tokens", "1000", "--drift-prefill-model", "2,0.05"])
    assert partition_config(a) == PartitionConfig(policy="drift", slo_ttft_ms=800.0, slo_ttft_ms_per_1k_tokens=1000.0,
                                                  drift_prefill_model=(2.0, 0.05))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--drift-prefill-model", "2"])
