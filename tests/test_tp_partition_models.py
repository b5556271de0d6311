"""Every partition cost model of a `-tp N` engine predicts one rank's step WITH its collectives (issue 17): the
roofline fallback used when no shard profile is committed, DRIFT's prefill time models and duet's roofline
decisions all take the whole model and the tensor-parallel size, so each estimate is the shard's own compute
plus the link model's all-reduces and logits all-gather (`roofline.with_collectives` does the same for a
measured shard profile). At tp 1 nothing changes."""

from __future__ import annotations

from typing import Any

import pytest

import rapidserve.partition.runtime as runtime
from rapidserve.config import EngineConfig, ParallelConfig, PartitionConfig
from rapidserve.loader.presets import preset_config
from rapidserve.parallel.shard import shard_config, tp_layout
from rapidserve.partition.drift_plan import prefill_models
from rapidserve.partition.duet import decide_duet
from rapidserve.partition.policy import PolicyState, WaitingPrefill
from rapidserve.partition.roofline import Peaks, decode_operators, decode_step_ms, prefill_operators, step_seconds
from tests.test_partition_manager import h100_profile
from tests.test_profiler import H100_NAME, fake_gpu  # noqa: F401 (a fixture)

QWEN = preset_config("qwen3-8b")
LLAMA70 = preset_config("llama-3.1-70b")  # 8 KV heads: replicated beyond tp 8
PEAKS = Peaks(matmul_flops=700e12, hbm_bw=3e12, num_compute_units=132, link_bw=300e9, link_latency_s=1e-5)
CONFIGS = h100_profile().configurations
REAL_FALLBACK = runtime.roofline_fallback  # before a fixture replaces it


def link_ms(model: Any, tp: int, ops: Any) -> float:
    comm = [o for o in ops(model, tp) if o.kind == "communication"]
    return 1e3 * step_seconds(comm, PEAKS.num_compute_units, PEAKS)


def shard(model: Any, tp: int) -> Any:
    return shard_config(model, tp_layout(model, tp, 0))


@pytest.mark.parametrize("model,tp", [(QWEN, 2), (QWEN, 4), (LLAMA70, 2), (LLAMA70, 8)])
@pytest.mark.parametrize("tokens", [4096, 8192])  # the line fits the long end best
def test_drift_prefill_model_at_tp_is_the_shard_plus_its_collectives(model: Any, tp: int, tokens: int) -> None:
    whole = prefill_models(model, PEAKS, CONFIGS, 8192, tp=tp)
    alone = prefill_models(shard(model, tp), PEAKS, CONFIGS, 8192)
    link = link_ms(model, tp, lambda m, t: prefill_operators(m, tokens, tp=t))
    assert link > 0
    for c in CONFIGS:  # the fit is DRIFT's line through the roofline's times (within 10-15% at the long end)
        units = c.prefill_units or PEAKS.num_compute_units
        own = 1e3 * step_seconds(prefill_operators(shard(model, tp), tokens), units, PEAKS)
        assert whole[c.name].ms(tokens) == pytest.approx(own + link, rel=0.15), c.name
        assert whole[c.name].ms(tokens) > alone[c.name].ms(tokens), c.name
        # the links add their per-token time to the slope
        assert whole[c.name].b_ms_per_token > alone[c.name].b_ms_per_token


@pytest.mark.parametrize("model", [QWEN, LLAMA70])
def test_drift_prefill_model_at_tp1_is_unchanged(model: Any) -> None:
    assert prefill_models(model, PEAKS, CONFIGS, 8192, tp=1) == prefill_models(model, PEAKS, CONFIGS, 8192)


def tp_config(model_name: str, model: Any, tp: int, policy: str = "rapid") -> EngineConfig:
    p = PartitionConfig(backend="cuda-green", policy=policy)  # type: ignore[arg-type]
    return EngineConfig(model_name, model, partition=p, parallel=ParallelConfig(tensor_parallel_size=tp))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_roofline_fallback_at_tp_adds_the_collectives(tp: int) -> None:
    cfg = tp_config("preset:qwen3-8b", QWEN, tp)
    prof = runtime.roofline_fallback(cfg, H100_NAME, list(CONFIGS), PEAKS)
    for e in prof.entries:
        if e.config != "overallocated":
            continue
        own = decode_step_ms(shard(QWEN, tp) if tp > 1 else QWEN, e.batch, e.context, 132, PEAKS)
        link = link_ms(QWEN, tp, lambda m, t, e=e: decode_operators(m, e.batch, e.context, tp=t)) if tp > 1 else 0.0
        assert e.decode_ms_alone_p50 == pytest.approx(own + link, rel=0.02), (e.batch, e.context)


def test_the_engine_at_tp_without_a_shard_profile_uses_the_roofline_with_collectives(
        tmp_path: Any, fake_gpu: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    monkeypatch.setenv("RAPIDSERVE_PROFILES_DIR", str(tmp_path))  # nothing committed there
    monkeypatch.setattr(runtime, "measure_peaks", lambda device, dtype=None: PEAKS)
    monkeypatch.setattr(runtime, "roofline_fallback", REAL_FALLBACK)  # fake_gpu forbids it
    cfg = tp_config("preset:qwen3-8b", QWEN, 2)
    plan = runtime.resolve_plan(cfg, fake_gpu)
    assert "ROOFLINE ESTIMATE" in plan.source and "one rank of tensor parallel 2, collectives" in plan.source
    assert plan.profile is not None
    assert plan.profile.entries == REAL_FALLBACK(cfg, H100_NAME, plan.configurations, PEAKS).entries
    one = runtime.resolve_plan(tp_config("preset:qwen3-8b", QWEN, 1), fake_gpu)
    assert "tensor parallel" not in one.source


@pytest.mark.parametrize("tp", [2, 4])
def test_duet_at_tp_predicts_a_slower_decode_than_the_shard_alone(tp: int) -> None:
    st = PolicyState(0.0, (2048,) * 64, (WaitingPrefill("r", 0.0, 4096),), 50.0, prefill_budget=8192)
    with_links = decide_duet(st, QWEN, PEAKS, CONFIGS, shared=True, tp=tp)
    shard_only = decide_duet(st, shard(QWEN, tp), PEAKS, CONFIGS, shared=True)
    assert with_links.predicted_step_ms > shard_only.predicted_step_ms


def test_decode_partition_passes_its_tensor_parallel_size_to_duet(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def fake_duet(st: Any, model: Any, peaks: Any, configs: Any, **k: Any) -> Any:
        seen.update(k, model=model)
        raise StopIteration

    monkeypatch.setattr(runtime, "decide_duet", fake_duet)
    plan = runtime.PartitionPlan("cuda-green", list(CONFIGS), h100_profile(), "test", PEAKS)
    dp = runtime.DecodePartition(PartitionConfig(backend="cuda-green", policy="duet"), plan, QWEN, 8192,
                                 tensor_parallel_size=2)
    with pytest.raises(StopIteration):
        dp.advance_duet((1024,), ())
    assert seen["tp"] == 2 and seen["model"] is QWEN
