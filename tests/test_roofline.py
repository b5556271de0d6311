"""Roofline fallback: hand-counted FLOPs/bytes, monotonicity, H100 + Llama-3-8B sanity, profiles, compare()."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest

from rapidserve.config import ModelConfig
from rapidserve.partition.manager import decide, make_state
from rapidserve.partition.profile import Configuration, Profile, load_profile, save_profile, validate_profile
from rapidserve.partition.roofline import (
    Peaks,
    bw_share,
    concurrent,
    decode_operators,
    decode_step_ms,
    decode_step_ms_beside_prefill,
    measure_peaks,
    prefill_operators,
    prefill_tokens_per_s,
    totals,
)
from rapidserve.partition.roofline_error import compare
from rapidserve.partition.roofline_profile import roofline_profile

LLAMA3_8B = ModelConfig(arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                        num_heads=32, num_kv_heads=8, head_dim=128, name="llama-3-8b")
H100 = Peaks(794e12, 2.98e12, 132, device="NVIDIA H100 80GB HBM3")
TINY = ModelConfig(arch="llama", vocab_size=11, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=2)
CONFIGS = [Configuration("overallocated", 0, 132), Configuration("split32", 32, 100),
           Configuration("split64", 64, 68)]


def by_name(ops: list) -> dict:
    return {o.name: o for o in ops}


# --- counts against hand calculations (TINY: h=8, i=16, L=2, 4 q heads, 2 kv heads, d=2 -> q=8, kv=4, V=11) ---

@pytest.mark.parametrize(
    "name, flops, weight_bytes, io_bytes, count",
    [
        # decode batch 3, context 5, bf16
        ("qkv_proj", 2 * 3 * 8 * 16, 8 * 16 * 2, 3 * (8 + 8 + 8) * 2, 2),
        ("o_proj", 2 * 3 * 8 * 8, 8 * 8 * 2, 3 * (8 + 8) * 2, 2),
        ("gate_up_proj", 4 * 3 * 8 * 16, 2 * 8 * 16 * 2, 3 * (8 + 32) * 2, 2),
        ("down_proj", 2 * 3 * 16 * 8, 16 * 8 * 2, 3 * (16 + 8) * 2, 2),
        ("attention", 4 * 4 * 2 * 5 * 3, 0, (2 * 4 * 5 + 2 * 8) * 3 * 2, 2),  # KV read 2*kv*ctx per sequence
        ("lm_head", 2 * 3 * 8 * 11, 8 * 11 * 2, 3 * (8 + 11) * 2, 1),
        ("embed", 0, 0, 2 * 3 * 8 * 2, 1),  # a gather reads only the batch's rows
    ],
)
def test_decode_operator_counts(name: str, flops: int, weight_bytes: int, io_bytes: int, count: int) -> None:
    op = by_name(decode_operators(TINY, 3, 5))[name]
    assert (op.flops, op.weight_bytes, op.io_bytes, op.count) == (flops, weight_bytes, io_bytes, count)


def test_prefill_attention_is_causal_over_prefix_and_chunk() -> None:
    ops = by_name(prefill_operators(TINY, 4, prefix=3))
    # 4 new tokens see 3 cached + 1..4 new keys: sum = 4*3 + 10; flops = 4 * Hq * d * that
    assert ops["attention"].flops == 4 * 4 * 2 * (4 * 3 + 10)
    assert ops["attention"].io_bytes == (2 * 4 * 8 + 2 * 4 * 7) * 2
    assert ops["lm_head"].flops == 2 * 1 * 8 * 11  # only the last token reaches the LM head


@pytest.mark.parametrize("tied", [False, True])
def test_weights_streamed_once_per_step(tied: bool) -> None:
    cfg = TINY.replace(tie_word_embeddings=tied)
    for batch in (1, 7):
        weight = sum(o.count * o.weight_bytes for o in decode_operators(cfg, batch, 9))
        # the embedding table is gathered, not streamed; tied, it is streamed once as the LM head
        assert weight == 2 * (cfg.num_params() - (0 if tied else cfg.vocab_size * cfg.hidden_size))


def test_decode_flops_hand_total() -> None:
    per_layer = 8 * 16 + 8 * 8 + 3 * 8 * 16  # qkv, o, gate/up/down weights
    gemm = 2 * 3 * (2 * per_layer + 8 * 11)
    attn = 2 * 4 * 4 * 2 * 5 * 3
    elementwise = sum(o.count * o.flops for o in decode_operators(TINY, 3, 5)
                      if o.name in ("add_norm", "rope_kv_write", "act_mul", "final_norm"))
    assert totals(decode_operators(TINY, 3, 5))[0] == gemm + attn + elementwise


def test_tensor_parallel_adds_communication_only_when_tp_above_one() -> None:
    assert not [o for o in decode_operators(LLAMA3_8B, 4, 100) if o.kind == "communication"]
    ops = by_name(decode_operators(LLAMA3_8B, 4, 100, tp=2))
    # two per layer and one after the vocabulary-parallel embedding
    assert ops["all_reduce"].count == 65 and ops["all_reduce"].link_bytes == 2 * (1 / 2) * 4 * 4096 * 2
    assert ops["logits_all_gather"].link_bytes == (1 / 2) * 4 * 128256 * 2
    assert ops["qkv_proj"].weight_bytes == 4096 * (2048 + 2 * 512) * 2
    one, two = decode_step_ms(LLAMA3_8B, 1, 2048, 132, H100), decode_step_ms(LLAMA3_8B, 1, 2048, 132, H100, tp=2)
    assert one / 2 < two < one
    slow_link = msgspec.structs.replace(H100, link_bw=1e9)
    assert decode_step_ms(LLAMA3_8B, 1, 2048, 132, slow_link, tp=2) > two


# --- shape of the model ---

@pytest.mark.parametrize("units", [16, 32, 64, 132])
@pytest.mark.parametrize("context", [128, 2048, 8192])
def test_decode_grows_with_batch(units: int, context: int) -> None:
    ts = [decode_step_ms(LLAMA3_8B, b, context, units, H100) for b in (1, 2, 8, 32, 128, 256)]
    assert ts == sorted(ts) and ts[0] < ts[-1]


@pytest.mark.parametrize("units", [16, 32, 64, 132])
@pytest.mark.parametrize("batch", [1, 16, 128])
def test_decode_grows_with_context(units: int, batch: int) -> None:
    ts = [decode_step_ms(LLAMA3_8B, batch, c, units, H100) for c in (64, 512, 2048, 8192, 32768)]
    assert ts == sorted(ts) and ts[0] < ts[-1]


@pytest.mark.parametrize("batch, context", [(1, 512), (8, 2048), (64, 2048), (256, 8192)])
def test_decode_never_slower_with_more_units(batch: int, context: int) -> None:
    ts = [decode_step_ms(LLAMA3_8B, batch, context, u, H100) for u in (8, 16, 24, 32, 48, 64, 96, 132)]
    assert ts == sorted(ts, reverse=True)


def test_decode_bandwidth_saturates() -> None:
    t = {u: decode_step_ms(LLAMA3_8B, 1, 2048, u, H100) for u in (8, 16, 66, 132)}
    assert t[8] / t[16] > 1.5  # few units: bandwidth grows almost linearly
    assert t[66] / t[132] < 1.3  # half the GPU already streams most of the bandwidth


@pytest.mark.parametrize("sms, measured_ms", [(16, 3.62), (32, 2.19), (48, 1.79), (64, 1.60), (132, 1.40)])
def test_bandwidth_curve_fits_facts(sms: int, measured_ms: float) -> None:
    """docs/measured.md: a 3.49 GB decode GEMM chain alone on n of 132 H100 SMs (memory-bound)."""
    predicted = 3.49e9 / (H100.hbm_bw * H100.bw_efficiency * bw_share(sms / 132, H100.bw_knee)) * 1e3
    assert predicted == pytest.approx(measured_ms, rel=0.06)


def test_prefill_scales_about_linearly_with_units() -> None:
    tps = {u: prefill_tokens_per_s(LLAMA3_8B, 8192, u, H100) for u in (33, 66, 132)}
    assert 1.7 < tps[132] / tps[66] <= 2.0
    assert 1.7 < tps[66] / tps[33] <= 2.0


def test_llama3_8b_on_h100() -> None:
    ms = decode_step_ms(LLAMA3_8B, 1, 2048, 132, H100)
    assert 5.5 <= ms <= 6.0  # ~15 GB of weights + 0.27 GB of KV at ~2.6 TB/s
    for chunk in (2048, 8192):
        flops = totals(prefill_operators(LLAMA3_8B, chunk))[0]
        mfu = flops * prefill_tokens_per_s(LLAMA3_8B, chunk, 132, H100) / chunk / H100.matmul_flops
        assert 0.6 <= mfu <= 0.75, (chunk, mfu)


# --- concurrency ---

@pytest.mark.parametrize("batch, context, starved", [(1, 512, 4), (16, 2048, 2), (64, 2048, 2), (128, 8192, 1.3)])
def test_split_protects_decode_overallocation_starves_it(batch: int, context: int, starved: float) -> None:
    for du in (16, 32, 64):
        alone = decode_step_ms(LLAMA3_8B, batch, context, du, H100)
        beside = decode_step_ms_beside_prefill(LLAMA3_8B, batch, context, du, 132 - du, 2048, H100)
        assert alone < beside <= alone * 1.6
        _, tps = concurrent(LLAMA3_8B, batch, context, du, 132 - du, 2048, H100)
        assert tps < prefill_tokens_per_s(LLAMA3_8B, 2048, 132 - du, H100)
    over = decode_step_ms_beside_prefill(LLAMA3_8B, batch, context, 0, 132, 2048, H100)
    assert over > starved * decode_step_ms(LLAMA3_8B, batch, context, 132, H100)  # Hopper: decode starves


def test_more_decode_units_trade_decode_latency_for_prefill_throughput() -> None:
    rows = [concurrent(LLAMA3_8B, 32, 2048, du, 132 - du, 2048, H100) for du in (16, 32, 48, 64)]
    assert [r[0] for r in rows] == sorted((r[0] for r in rows), reverse=True)
    assert [r[1] for r in rows] == sorted((r[1] for r in rows), reverse=True)


@pytest.mark.parametrize("du, pu", [(32, 0), (100, 40), (140, 0)])
def test_bad_splits_rejected(du: int, pu: int) -> None:
    with pytest.raises(ValueError):
        concurrent(LLAMA3_8B, 1, 128, du, pu, 512, H100)


def test_peaks_validation() -> None:
    with pytest.raises(ValueError, match="hbm_bw"):
        Peaks(1e12, 0.0, 10)
    with pytest.raises(ValueError, match="bw_efficiency"):
        Peaks(1e12, 1e12, 10, bw_efficiency=1.5)


# --- profiles and error reports ---

def make_profile() -> Profile:
    return roofline_profile(LLAMA3_8B, "NVIDIA H100 80GB HBM3", "llama-3-8b", H100, CONFIGS, [1, 16, 64],
                            [512, 2048, 8192], 2048, created="2026-11-22T00:00:00Z")


def test_roofline_profile_validates_and_round_trips(tmp_path: Path) -> None:
    prof = make_profile()
    validate_profile(prof)
    assert prof.source == "roofline" and len(prof.entries) == 3 * 3 * 3
    assert prof.prefill_tokens == 2048  # the prefill forward its beside-prefill figures assume
    path = tmp_path / "h100__llama.json"
    save_profile(prof, path)
    assert load_profile(path, expect_gpu="NVIDIA H100 80GB HBM3", expect_model="llama-3-8b") == prof


def test_manager_uses_roofline_profile() -> None:
    prof = make_profile()
    d, _ = decide(make_state("overallocated"), decode_batch=16, decode_context=2048, prefill_pending=True,
                  slo_itl_ms=40.0, profile=prof)
    assert d.config.startswith("split") and d.switched
    d, _ = decide(make_state("split32", 100), decode_batch=16, decode_context=2048, prefill_pending=False,
                  slo_itl_ms=40.0, profile=prof)
    assert d.config == "overallocated"


def test_compare_identical_is_zero_and_perturbed_is_measured() -> None:
    prof = make_profile()
    report = compare(prof, prof)
    assert all(v == 0 for r in report.rows for v in r.errors.values())
    assert all(s.median_abs == 0 and s.p90_abs == 0 for s in report.stats.values())
    slower = msgspec.structs.replace(prof, entries=[
        msgspec.structs.replace(e, decode_ms_alone_p50=e.decode_ms_alone_p50 * 1.25) for e in prof.entries[:-1]])
    report = compare(slower, prof)  # measured 25% slower than predicted: error -20%
    assert report.stats["decode_alone"].median_abs == pytest.approx(0.2)
    assert report.stats["decode_alone"].median_signed == pytest.approx(-0.2)
    assert report.stats["prefill_tokens_per_s"].p90_abs == 0
    md = compare(prof, slower).to_markdown()
    assert "| decode_alone | 26 | 25.0% | 25.0% | +25.0% |" in md and "1 measured entries have no prediction" in md
    with pytest.raises(ValueError):
        compare(prof, msgspec.structs.replace(prof, entries=[]))


def test_measure_peaks_on_cpu_is_quick() -> None:
    t0 = time.perf_counter()
    peaks = measure_peaks("cpu", reps=3)
    assert time.perf_counter() - t0 < 10
    assert peaks.matmul_flops > 0 and peaks.hbm_bw > 0 and peaks.num_compute_units >= 1 and peaks.device == "cpu"
    assert decode_step_ms(LLAMA3_8B, 1, 128, peaks.num_compute_units, peaks) > 0
