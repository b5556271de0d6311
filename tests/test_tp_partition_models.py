"""Every partition cost model of a `-tp N` engine is one rank's shard estimate PLUS its collectives (issue 17).

The collectives term is one function, `roofline.collectives_ms` (the formula: `collective_ops`), and one way of
adding it, `roofline.plus_collectives`: a decode step takes the term more, a prefill forward of P tokens its own
(lower tokens/s). The tables below check, at tp 2 (4, 8), each model against the same model of the bare shard
(`shard_config`, as `rapidserve profile --shard-of-tp` measures it) plus that term: the roofline's decode step,
prefill throughput and concurrency, the roofline fallback profile (which must equal `with_collectives` of the
shard's roofline profile, the measured path), DRIFT's prefill lines and duet's decisions. At tp 1 the term is 0
and nothing changes (the tp 1 figures were also checked bitwise against the code before this change), and the
start-up log says which models hold the collectives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

import rapidserve.partition.plan as partition_plan
import rapidserve.partition.runtime as runtime
from rapidserve.config import EngineConfig, ModelConfig, ParallelConfig
from rapidserve.loader.presets import preset_config
from rapidserve.parallel.shard import shard_config, tp_layout
from rapidserve.partition.drift_plan import prefill_models
from rapidserve.partition.duet import decide_duet
from rapidserve.partition.policy import PolicyState, WaitingPrefill
from rapidserve.partition.profile import Configuration, Entry, model_label, profile_filename, save_profile
from rapidserve.partition.roofline import (
    Peaks,
    collective_ops,
    collectives_ms,
    concurrent,
    decode_step_ms,
    plus_collectives,
    prefill_tokens_per_s,
)
from rapidserve.partition.roofline_profile import roofline_profile, with_collectives
from rapidserve.partition_config import PartitionConfig
from tests.test_partition_manager import h100_profile
from tests.test_profiler import H100_NAME, fake_gpu  # noqa: F401 (a fixture)

QWEN = preset_config("qwen3-8b")  # 36 layers, hidden 4096, vocabulary 151936
LLAMA70 = preset_config("llama-3.1-70b")  # 8 KV heads: one per rank at tp 8
TINY = preset_config("tiny-llama")  # 3 layers, hidden 64, vocabulary 1280
ODD_VOCAB = ModelConfig(arch="llama", vocab_size=1001, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16)  # padded to 1002 at tp 2, 1004 at tp 4
PEAKS = Peaks(matmul_flops=700e12, hbm_bw=3e12, num_compute_units=132, link_bw=300e9, link_latency_s=1e-5)
CONFIGS = h100_profile().configurations  # overallocated and splits of 16..64 of 132 units
AT_TP = [(QWEN, 2), (QWEN, 4), (LLAMA70, 2), (LLAMA70, 8)]
REAL_FALLBACK = partition_plan.roofline_fallback  # before the fake_gpu fixture replaces it


def shard(model: ModelConfig, tp: int) -> ModelConfig:
    return shard_config(model, tp_layout(model, tp, 0))


def approx(x: float) -> Any:
    return pytest.approx(x, rel=1e-9)


# ---- the term itself ------------------------------------------------------------------------------------
@pytest.mark.parametrize("model,tp,tokens,rows", [
    (QWEN, 2, 1, 1), (QWEN, 2, 64, 64), (QWEN, 4, 8192, 1), (LLAMA70, 8, 256, 256), (ODD_VOCAB, 2, 7, 3),
    (ODD_VOCAB, 4, 7, 3)])
def test_collectives_ms_by_hand(model: ModelConfig, tp: int, tokens: int, rows: int) -> None:
    b, bw, lat = 2, PEAKS.link_bw, PEAKS.link_latency_s
    padded = -(-model.vocab_size // tp) * tp
    all_reduce = 2 * (tp - 1) / tp * tokens * model.hidden_size * b / bw + lat  # one ring all-reduce of T x h
    gather = (tp - 1) / tp * rows * padded * b / bw + lat  # the logits of `rows` rows
    want_ms = 1e3 * ((2 * model.num_layers + 1) * all_reduce + gather)  # 2 a layer + the embedding's
    assert collectives_ms(model, tokens, rows, PEAKS, tp=tp) == approx(want_ms)


@pytest.mark.parametrize("model", [QWEN, LLAMA70, ODD_VOCAB])
def test_no_collectives_at_tp1(model: ModelConfig) -> None:
    assert collective_ops(model, 128, 128, tp=1) == []
    assert collectives_ms(model, 128, 128, PEAKS, tp=1) == 0.0


# ---- the roofline's step models -----------------------------------------------------------------------
@pytest.mark.parametrize("model,tp", AT_TP)
@pytest.mark.parametrize("batch,context,units", [(1, 512, 132), (64, 4096, 132), (256, 32768, 64)])
def test_decode_step_at_tp_is_the_shard_plus_its_collectives(model: ModelConfig, tp: int, batch: int, context: int,
                                                             units: int) -> None:
    got = decode_step_ms(model, batch, context, units, PEAKS, tp)
    assert got == approx(decode_step_ms(shard(model, tp), batch, context, units, PEAKS)
                         + collectives_ms(model, batch, batch, PEAKS, tp=tp))
    assert decode_step_ms(model, batch, context, units, PEAKS, 1) == decode_step_ms(model, batch, context, units, PEAKS)


@pytest.mark.parametrize("model,tp", AT_TP)
@pytest.mark.parametrize("tokens,units", [(512, 132), (8192, 68)])
def test_prefill_throughput_at_tp_is_the_shard_plus_its_collectives(model: ModelConfig, tp: int, tokens: int,
                                                                    units: int) -> None:
    own = prefill_tokens_per_s(shard(model, tp), tokens, units, PEAKS)
    _, want = plus_collectives(0.0, own, tokens, 0.0, collectives_ms(model, tokens, 1, PEAKS, tp=tp))
    assert prefill_tokens_per_s(model, tokens, units, PEAKS, tp) == approx(want)
    assert want == approx(tokens / (tokens / own + collectives_ms(model, tokens, 1, PEAKS, tp=tp) / 1e3))


@pytest.mark.parametrize("model,tp", AT_TP)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_concurrent_at_tp_is_the_shard_plus_its_collectives(model: ModelConfig, tp: int, config: Any) -> None:
    batch, context, chunk = 32, 4096, 4096
    args = (batch, context, config.decode_units, config.prefill_units, chunk, PEAKS)
    d_ms, tps = concurrent(shard(model, tp), *args)
    want = plus_collectives(d_ms, tps, chunk, collectives_ms(model, batch, batch, PEAKS, tp=tp),
                            collectives_ms(model, chunk, 1, PEAKS, tp=tp))
    got = concurrent(model, *args, tp)
    assert got[0] == approx(want[0]) and got[1] == approx(want[1])
    assert got[0] > d_ms and got[1] < tps


# ---- the profile the rapid manager (and drift's decode step) reads ------------------------------------------
def tp_config(model: ModelConfig, tp: int, policy: str = "rapid", *, profile: Path | None = None,
              drift_given: tuple[float, float] | None = None) -> EngineConfig:
    p = PartitionConfig(backend="cuda-green", policy=policy, profile=str(profile) if profile else None,  # type: ignore[arg-type]
                        drift_prefill_model=drift_given)
    return EngineConfig(f"preset:{model.name}", model, partition=p, parallel=ParallelConfig(tensor_parallel_size=tp))


ENTRY_FIELDS = [f for f in Entry.__struct_fields__ if f not in ("config", "batch", "context")]


@pytest.mark.parametrize("tp", [2, 4])
def test_the_roofline_fallback_at_tp_is_the_shard_estimate_through_with_collectives(tp: int) -> None:
    """The fallback is the roofline's profile of the shard, given the collectives by the very function a
    measured shard profile goes through, so the two sources differ only in the shard's own figures."""
    cfg = tp_config(QWEN, tp)
    got = REAL_FALLBACK(cfg, H100_NAME, list(CONFIGS), PEAKS)
    bare = roofline_profile(shard(QWEN, tp), H100_NAME, model_label(cfg.model), PEAKS, CONFIGS,
                            partition_plan.ROOFLINE_BATCHES, partition_plan.ROOFLINE_CONTEXTS,
                            cfg.scheduler.max_num_batched_tokens, created=got.created)
    want = with_collectives(msgspec.structs.replace(bare, tensor_parallel_size=tp), QWEN, PEAKS)
    assert got.tensor_parallel_size == tp and len(got.entries) == len(want.entries) == len(bare.entries)
    tokens = bare.prefill_tokens
    p_link_s = collectives_ms(QWEN, tokens, 1, PEAKS, tp=tp) / 1e3
    for g, w, e in zip(got.entries, want.entries, bare.entries, strict=True):
        assert (g.config, g.batch, g.context) == (w.config, w.batch, w.context) == (e.config, e.batch, e.context)
        for f in ENTRY_FIELDS:
            assert getattr(g, f) == approx(getattr(w, f)), f
        d_link = collectives_ms(QWEN, e.batch, e.batch, PEAKS, tp=tp)  # spelled out for one field of each kind
        assert g.decode_ms_beside_prefill_p95 == approx(e.decode_ms_beside_prefill_p95 + d_link)
        assert g.prefill_tokens_per_s == approx(tokens / (tokens / e.prefill_tokens_per_s + p_link_s))


def test_the_roofline_fallback_at_tp1_is_the_whole_model_unchanged() -> None:
    cfg = tp_config(QWEN, 1)
    got = REAL_FALLBACK(cfg, H100_NAME, list(CONFIGS), PEAKS)
    want = roofline_profile(QWEN, H100_NAME, model_label(cfg.model), PEAKS, CONFIGS, partition_plan.ROOFLINE_BATCHES,
                            partition_plan.ROOFLINE_CONTEXTS, cfg.scheduler.max_num_batched_tokens, created=got.created)
    assert got == want and got.tensor_parallel_size == 1


# ---- DRIFT's prefill models -------------------------------------------------------------------------------
@pytest.mark.parametrize("model,tp", [*AT_TP, (QWEN, 1)])
def test_drift_prefill_model_at_tp_is_the_shard_line_plus_the_collectives(model: ModelConfig, tp: int) -> None:
    got = prefill_models(model, PEAKS, CONFIGS, 8192, tp=tp)
    bare = prefill_models(shard(model, tp) if tp > 1 else model, PEAKS, CONFIGS, 8192)
    for c in CONFIGS:
        for tokens in (1, 512, 4096, 8192, 20000):  # the collectives are affine in tokens: exact at every size
            want = bare[c.name].ms(tokens) + collectives_ms(model, tokens, 1, PEAKS, tp=tp)
            assert got[c.name].ms(tokens) == approx(want), (c.name, tokens)
    if tp == 1:
        assert got == bare == prefill_models(model, PEAKS, CONFIGS, 8192)


# ---- duet's decisions -------------------------------------------------------------------------------------
SPLIT32 = [c for c in CONFIGS if c.name == "split32"]
DECODES = (2048,) * 64


@pytest.mark.parametrize("case,contexts,waiting,slo_ms,shared,mode,step_rows,prefill_rows", [
    # name: what duet predicts, and the (tokens, rows) of the step whose collectives each figure gains
    ("decode alone", DECODES, (), 1e6, True, "decode", (64, 64), None),
    ("prefill alone", (), (("a", 4096), ("b", 1000)), 1e6, False, "aggregated", (5096, 2), (5096, 2)),
    ("one mixed step", DECODES, (("a", 4096),), 1e6, False, "aggregated", (64 + 4096, 65), (64 + 4096, 65)),
    ("decode beside prefill, shared", DECODES, (("a", 4096),), 1e6, True, "aggregated", (64, 64), (64, 64)),
    ("split, SLO missed", DECODES, (("a", 4096),), 1e-3, True, "split", (64, 64), (4096, 1)),
    ("split, mixed step over SLO", DECODES, (("a", 4096),), 1e-3, False, "split", (64, 64), (4096, 1)),
])
@pytest.mark.parametrize("model,tp", [(QWEN, 2), (LLAMA70, 8)])
def test_duet_at_tp_predicts_the_shard_plus_its_collectives(
        model: ModelConfig, tp: int, case: str, contexts: tuple[int, ...], waiting: tuple[tuple[str, int], ...],
        slo_ms: float, shared: bool, mode: str, step_rows: tuple[int, int], prefill_rows: tuple[int, int] | None,
) -> None:
    st = PolicyState(0.0, contexts, tuple(WaitingPrefill(r, 0.0, n) for r, n in waiting), slo_ms, prefill_budget=8192)
    got = decide_duet(st, model, PEAKS, SPLIT32, shared=shared, tp=tp)
    bare = decide_duet(st, shard(model, tp), PEAKS, SPLIT32, shared=shared)
    assert got.mode == bare.mode == mode, case
    assert got.predicted_step_ms == approx(bare.predicted_step_ms + collectives_ms(model, *step_rows, PEAKS, tp=tp))
    if prefill_rows is None:
        assert got.predicted_prefill_ms == bare.predicted_prefill_ms == 0.0
    else:
        assert got.predicted_prefill_ms == approx(bare.predicted_prefill_ms
                                                  + collectives_ms(model, *prefill_rows, PEAKS, tp=tp))
    assert decide_duet(st, model, PEAKS, SPLIT32, shared=shared, tp=1) == decide_duet(st, model, PEAKS, SPLIT32,
                                                                                         shared=shared)


def test_decode_partition_passes_its_tensor_parallel_size_to_duet(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def fake_duet(st: Any, model: Any, peaks: Any, configs: Any, **k: Any) -> Any:
        seen.update(k, model=model)
        raise StopIteration

    monkeypatch.setattr(runtime, "decide_duet", fake_duet)
    plan = partition_plan.PartitionPlan("cuda-green", list(CONFIGS), h100_profile(), "test", PEAKS)
    dp = runtime.DecodePartition(PartitionConfig(backend="cuda-green", policy="duet"), plan, QWEN, 8192,
                                 tensor_parallel_size=2)
    with pytest.raises(StopIteration):
        dp.advance_duet((1024,), ())
    assert seen["tp"] == 2 and seen["model"] is QWEN


# ---- what the engine uses, and what it says at start ----------------------------------------------------------
def tiny_profile(tp: int) -> Any:
    return msgspec.structs.replace(h100_profile(), gpu=H100_NAME, model="preset:tiny-llama", tensor_parallel_size=tp)


WITH = "= one rank's shard + its collectives (8 a step"  # tiny-llama: 2 x 3 layers + 1 all-reduces, 1 all-gather


@pytest.mark.parametrize("policy,profile,drift_given,with_links,as_given", [
    ("rapid", None, None, ["the profile's figures (roofline estimate of the shard)"], []),
    ("rapid", "shard", None, ["the profile's figures (measured shard profile)"], []),
    ("rapid", "whole", None, [], ["the profile's figures (a WHOLE-MODEL profile, no collectives added"]),
    ("duet", None, None, ["duet's roofline decisions"], []),
    ("duet", "shard", None, ["the profile's figures (measured shard profile)"], []),  # duet reads a measured one
    ("duet", "whole", None, [], ["the profile's figures (a WHOLE-MODEL profile, no collectives added"]),
    ("drift", None, None, ["the profile's decode step beside prefill (roofline estimate of the shard)",
                           "drift's prefill models"], []),
    ("drift", "shard", (1.0, 0.5), ["the profile's decode step beside prefill (measured shard profile)"],
     ["drift's prefill models"]),
])
def test_the_start_up_line_says_which_models_hold_the_collectives(
        tmp_path: Path, fake_gpu: Any, monkeypatch: pytest.MonkeyPatch, policy: str,  # noqa: F811
        profile: str | None, drift_given: tuple[float, float] | None, with_links: list[str], as_given: list[str],
) -> None:
    monkeypatch.setenv("RAPIDSERVE_PROFILES_DIR", str(tmp_path))
    monkeypatch.setattr(partition_plan, "measure_peaks", lambda device, dtype=None, fp8=False: PEAKS)
    monkeypatch.setattr(partition_plan, "roofline_fallback", REAL_FALLBACK)
    given = None
    if profile == "shard":
        save_profile(tiny_profile(2), tmp_path / profile_filename(H100_NAME, "preset:tiny-llama", 2))
    elif profile == "whole":
        given = tmp_path / "whole.json"
        save_profile(tiny_profile(1), given)
    cfg = tp_config(TINY, 2, policy, profile=given, drift_given=drift_given)
    plan = partition_plan.resolve_plan(cfg, fake_gpu)
    assert plan.source.count("; tensor parallel 2") == 1  # said once, last
    note = plan.source[plan.source.index("; tensor parallel 2"):]
    if with_links:
        assert note.startswith(f"; tensor parallel 2: {', '.join(with_links)} {WITH}"), note
        assert "link model 300 GB/s, 10 us each, not measured" in note
    else:
        assert "collectives (" not in note
    if as_given:
        assert f"used as given: {', '.join(as_given)}" in note
    else:
        assert "used as given" not in note
    if profile is None:  # the roofline fallback with the collectives in it
        want = REAL_FALLBACK(cfg, H100_NAME, plan.configurations, PEAKS)
        assert plan.profile is not None and plan.profile.entries == want.entries
        assert plan.profile.tensor_parallel_size == 2
    one = partition_plan.resolve_plan(tp_config(TINY, 1, policy, drift_given=drift_given), fake_gpu)
    assert "tensor parallel" not in one.source


def test_no_line_without_a_cost_model(fake_gpu: Any) -> None:  # noqa: F811
    plan = partition_plan.PartitionPlan("none", [Configuration("overallocated", 0, 0)], None, "partition off")
    assert partition_plan.tp_cost_models(tp_config(TINY, 2), plan) == ""
