"""The forcing behind tests/test_engine_gpu.py's adaptive runs (tests/forced_switch.py), checked on CPU: the
rapid manager on the forcing profile switches exactly on whether prefill has work, for any batch, context and
pending work, on every GPU shape; duet with the test's SLO splits whenever decode runs beside prefill work,
at any GPU speed; and the GPU test's request sequence (a holder, then eight prompts, twice) switches at least
twice a round under both."""

from __future__ import annotations

from pathlib import Path

import pytest

from rapidserve.config import PartitionConfig
from rapidserve.loader.presets import preset_config
from rapidserve.partition.backend import Granularity, check_configurations, cu_granularity, plan_configurations
from rapidserve.partition.manager import decide, make_state
from rapidserve.partition.policy import PendingWork, WaitingPrefill
from rapidserve.partition.profile import OVERALLOCATED, load_profile, model_label, save_profile, validate_profile
from rapidserve.partition.roofline import Peaks
from rapidserve.partition.runtime import DecodePartition, PartitionPlan
from tests.forced_switch import DUET_SLO_MS, forcing_profile, split_for_prefill

MODEL = "preset:tiny-llama"
SHARES = (0.25, 0.5)  # tests/test_engine_gpu.py's decode shares
BUDGET = 64  # and its prefill token budget
DEVICES = {  # granularities of the GPUs the test may run on (H100 and H200: 132 SMs in groups of 8)
    "NVIDIA H200": Granularity(132, 8, 8),
    "NVIDIA B200": Granularity(148, 8, 8),
    "NVIDIA H100 PCIe": Granularity(114, 8, 8),
    "AMD Instinct MI300X": cu_granularity(304),
}
NO_WORK = None
WORK = [PendingWork(5, 5), PendingWork(64, 150), PendingWork(409, 150), PendingWork(10_000, 4096)]


@pytest.mark.parametrize("gpu", list(DEVICES))
def test_the_forcing_profile_is_a_valid_profile_of_the_device(gpu: str, tmp_path: Path) -> None:
    g = DEVICES[gpu]
    configs = plan_configurations(g, SHARES)
    prof = forcing_profile(gpu, MODEL, configs, g.total, BUDGET)
    validate_profile(prof)
    check_configurations(prof.configurations, g, "forcing profile")  # what resolve_plan checks
    path = tmp_path / "forced.json"
    save_profile(prof, path)
    assert load_profile(path, expect_gpu=gpu, expect_model=model_label(MODEL)) == prof  # as --profile is read


@pytest.mark.parametrize("gpu", list(DEVICES))
@pytest.mark.parametrize("interpolate", [False, True])
def test_rapid_on_the_forcing_profile_switches_on_pending_work_alone(gpu: str, interpolate: bool) -> None:
    g = DEVICES[gpu]
    configs = plan_configurations(g, SHARES)
    prof = forcing_profile(gpu, MODEL, configs, g.total, BUDGET)
    split = split_for_prefill(configs)
    for current in [c.name for c in configs]:
        for batch in (0, 1, 3, 8, 9, 16, 40, 256):  # 0: no decode running; past 16: beyond the buckets
            for context in (1, 6, 200, 1024, 5000):
                for work in [NO_WORK, *WORK]:
                    d, state = decide(make_state(current), decode_batch=max(batch, 1), decode_context=context,
                                      prefill_pending=work is not None, slo_itl_ms=50.0, profile=prof,
                                      hysteresis_steps=0, decode_running=batch > 0,
                                      prefill_tokens=work.tokens if work else None,
                                      prefill_longest=work.longest if work else None, prefill_budget=BUDGET,
                                      interpolate=interpolate)
                    want = split if work is not None else OVERALLOCATED
                    assert d.config == want and state.config == want, (current, batch, context, work, d.reason)
                    assert d.switched == (current != want)


def rapid_partition(g: Granularity) -> DecodePartition:
    configs = plan_configurations(g, SHARES)
    prof = forcing_profile("NVIDIA H200", MODEL, configs, g.total, BUDGET)
    plan = PartitionPlan("cuda-green", configs, prof, "forcing profile")
    return DecodePartition(PartitionConfig(hysteresis_steps=0, decode_shares=SHARES), plan, preset_config("tiny-llama"),
                           BUDGET)


def duet_partition(g: Granularity, peaks: Peaks) -> DecodePartition:
    configs = plan_configurations(g, SHARES)
    prof = forcing_profile("NVIDIA H200", MODEL, configs, g.total, BUDGET)
    plan = PartitionPlan("cuda-green", configs, prof, "forcing profile", peaks)
    pcfg = PartitionConfig(policy="duet", slo_itl_ms=DUET_SLO_MS, hysteresis_steps=0, decode_shares=SHARES)
    return DecodePartition(pcfg, plan, preset_config("tiny-llama"), BUDGET)


LENGTHS = [5, 150, 12, 70, 33, 90, 8, 41]  # the GPU test's prompts


def test_the_gpu_tests_round_switches_under_rapid() -> None:
    """A round as decode sees it: the holder waits alone (engine idle), runs alone, then the eight arrive and are
    prefilled while it (and, one by one, they) decode, then all are done. Each phase is one or more step
    boundaries; the order of prefill completions does not matter."""
    dp = rapid_partition(DEVICES["NVIDIA H200"])
    split = split_for_prefill(dp.plan.configurations)
    for round_ in range(2):
        s = dp.advance(0, 0, True, PendingWork(5, 5))  # the holder waits at the boundary before admission
        assert s is not None and (s.old, s.new) == (OVERALLOCATED, split)
        s = dp.advance(1, 6, False, None)  # the holder decodes, nothing pending
        assert s is not None and s.new == OVERALLOCATED
        for done in range(len(LENGTHS)):  # the eight pending while the holder and the finished ones decode
            left = LENGTHS[done:]
            s = dp.advance(1 + done, 20, True, PendingWork(sum(left), max(left)))
            assert (s is not None) == (done == 0) and dp.current == split
        s = dp.advance(9, 40, False, None)
        assert s is not None and s.new == OVERALLOCATED
        assert dp.num_switches == 4 * (round_ + 1)


H100 = Peaks(matmul_flops=794e12, hbm_bw=2.98e12, num_compute_units=132)


@pytest.mark.parametrize("speedup", [1, 10, 1000])
def test_the_gpu_tests_round_splits_under_duet_at_any_speed(speedup: float) -> None:
    """With the holder decoding, the eight waiting or prefilling make decode's next boundary a split (the
    roofline's shared step is far above the SLO even on a GPU 1000x an H100), and decode alone takes the
    whole GPU back; with no decode running nothing is split."""
    peaks = Peaks(matmul_flops=H100.matmul_flops * speedup, hbm_bw=H100.hbm_bw * speedup, num_compute_units=132)
    dp = duet_partition(DEVICES["NVIDIA H200"], peaks)
    waiting = tuple(WaitingPrefill(f"r{i}", 0.0, n) for i, n in enumerate(LENGTHS))
    for round_ in range(2):
        assert dp.advance_duet((), (WaitingPrefill("hold", 0.0, 5),)) is None  # idle: the holder alone
        assert dp.current == OVERALLOCATED
        s = dp.advance_duet((6,), waiting)
        assert s is not None and s.old == OVERALLOCATED and s.new.startswith("split"), dp.last_duet
        assert dp.last_duet is not None and dp.last_duet.predicted_step_ms > 100 * DUET_SLO_MS
        for done in range(1, len(LENGTHS)):
            assert dp.advance_duet((20,) * (1 + done), waiting[done:]) is None  # the holder + those done
        s = dp.advance_duet((30,) * 9, ())  # all prefilled: decode alone
        assert s is not None and s.new == OVERALLOCATED
        assert dp.num_switches == 2 * (round_ + 1)
