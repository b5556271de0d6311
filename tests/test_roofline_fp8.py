"""The roofline with fp8 weights (issue 39; partition/fp8_costs.py, partition/peaks.py): hand-counted operators of each
fp8 scheme, the fp8 peak, the Qwen3-8B decode and prefill ratios to bf16, and float weights predicted exactly as before
(regression). Its users (policies, plan, drift): tests/test_fp8_policies.py."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import msgspec
import pytest

import rapidserve.ops.fp8 as fp8_ops
from rapidserve.config import ModelConfig
from rapidserve.loader.presets import preset_config
from rapidserve.partition.drift_plan import prefill_models
from rapidserve.partition.fp8_costs import fp8_layers
from rapidserve.partition.peaks import Peaks, describe_peaks, measure_peaks
from rapidserve.partition.profile import Configuration
from rapidserve.partition.roofline import (
    concurrent,
    decode_operators,
    decode_step_ms,
    mixed_operators,
    mixed_operators_summed,
    prefill_operators,
    prefill_tokens_per_s,
    step_seconds,
)
from rapidserve.partition.roofline_profile import roofline_profile
from rapidserve.partition.step_costs import RooflineCosts
from rapidserve.quant_config import ONLINE_FP8, QuantizationConfig

QWEN = preset_config("qwen3-8b")
MOE = preset_config("qwen3-30b-a3b")
GEMMA = preset_config("gemma3-12b")
GEMMA_FULL = dataclasses.replace(GEMMA, sliding_window=None, layer_types=())  # every layer global
H200 = Peaks(723e12, 3.97e12, 132, device="NVIDIA H200")  # bench/results/h200x2_1129: "GEMM 723 TFLOP/s, copy 3.97"
CONFIGS = (Configuration("overallocated", 0, 132), Configuration("split32", 32, 100), Configuration("split64", 64, 68))
BLOCK = QuantizationConfig(method="fp8", weights="block", block=(128, 128), activations="group")
STATIC = QuantizationConfig(method="fp8", weights="tensor", activations="static")
# h 256, q 2 x 128, kv 1 x 128 -> q|k|v [512, 256], o [256, 256], gate|up [1024, 256], down [256, 512]
MID = ModelConfig(arch="llama", vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=2,
                  num_kv_heads=1, head_dim=128)


def by_name(ops: list) -> dict:
    out: dict = {}
    for o in ops:
        out.setdefault(o.name, []).append(o)
    return out


# ---- float weights: every prediction as before fp8 was modelled, to the bit -----------------------------------------

ROOF = RooflineCosts(QWEN, H200, CONFIGS)
REGRESSION: dict[str, Any] = {
    # (what, the value main computed before this change: f596e08)
    "decode qwen b1 c2048": (lambda q: decode_step_ms(QWEN, 1, 2048, 132, H200, quant=q), 4.42243568582551),
    "decode qwen b64 c2048": (lambda q: decode_step_ms(QWEN, 64, 2048, 132, H200, quant=q), 10.074155731623541),
    "decode qwen b16 c8192 32 units tp2": (lambda q: decode_step_ms(QWEN, 16, 8192, 32, H200, 2, quant=q),
                                           9.18950145360041),
    "decode qwen b16 c2048 kv fp8": (lambda q: decode_step_ms(QWEN, 16, 2048, 132, H200, kv_bytes=1.0, quant=q),
                                     5.076218548202427),
    "decode moe b8 c1024": (lambda q: decode_step_ms(MOE, 8, 1024, 132, H200, quant=q), 7.649893524874055),
    # Gemma 3 without its sliding windows (its local layers attend to their last 1024 keys only since h-prefixwin:
    # tests/test_roofline_windows.py): every layer over the whole context, as main computed it
    "decode gemma b4 c4096": (lambda q: decode_step_ms(GEMMA_FULL, 4, 4096, 132, H200, quant=q), 8.599534765285094),
    "prefill qwen 4096": (lambda q: prefill_tokens_per_s(QWEN, 4096, 132, H200, quant=q), 36066.224486034276),
    "prefill qwen 1024 after 3000 on 100": (lambda q: prefill_tokens_per_s(QWEN, 1024, 100, H200, prefix=3000, quant=q),
                                            25259.685834267086),
    "split qwen b64 c2048 split32 4096": (lambda q: concurrent(QWEN, 64, 2048, 32, 100, 4096, H200, quant=q),
                                          (23.19682154592553, 21065.910604429628)),
    "overalloc qwen b16 c4096 8192": (lambda q: concurrent(QWEN, 16, 4096, 0, 132, 8192, H200, quant=q),
                                      (118.97929785590941, 30295.018250697925)),
    "split tp2": (lambda q: concurrent(QWEN, 32, 2048, 64, 68, 2048, H200, 2, quant=q),
                  (6.900463312094618, 26070.943484444837)),
    "mixed qwen": (lambda q: 1e3 * step_seconds(mixed_operators(QWEN, (2048,) * 8 + (1000,) * 8,
                                                                [(512, 0), (300, 4096)], quant=q), 132, H200),
                   22.809099182023104),
    "fused costs": (lambda q: RooflineCosts(QWEN, H200, CONFIGS, quant=q).fused_ms((2048,) * 32, [(1024, 0)]),
                    29.00535890132127),
    "alone costs split32": (lambda q: RooflineCosts(QWEN, H200, CONFIGS, quant=q).decode_alone_ms("split32", 32, 4096),
                            16.87937783649746),
    "drift models": (lambda q: sorted((k, v.a_ms, v.b_ms_per_token)
                                      for k, v in prefill_models(QWEN, H200, CONFIGS, 8192, quant=q).items()),
                     [("overallocated", 0.0, 0.031503358399119934), ("split32", 0.0, 0.04116283288226189),
                      ("split64", 0.0, 0.05991357746718454)]),
    "roofline profile": (lambda q: [(e.config, e.batch, e.context, e.decode_ms_alone_p50,
                                     e.decode_ms_beside_prefill_p50, e.prefill_tokens_per_s)
                                    for e in roofline_profile(QWEN, "g", "m", H200, CONFIGS, [1, 64], [2048], 4096,
                                                              created="x", quant=q).entries],
                         [("overallocated", 1, 2048, 4.42243568582551, 54.392734093352786, 33133.83726780242),
                          ("overallocated", 64, 2048, 10.074155731623541, 60.04445413915082, 30015.095079778308),
                          ("split32", 1, 2048, 7.487596606205545, 10.183131384439537, 21065.910604429628),
                          ("split32", 64, 2048, 17.056486430827597, 23.19682154592553, 21065.910604429628),
                          ("split64", 1, 2048, 5.464590398754721, 7.431842942306421, 13443.414966391001),
                          ("split64", 64, 2048, 12.448148169352917, 16.92948151031997, 13443.414966391001)]),
}


@pytest.mark.parametrize("quant", [None, QuantizationConfig()], ids=["no-quant", "method-none"])
@pytest.mark.parametrize("name", list(REGRESSION))
def test_float_weights_predict_exactly_as_before(name: str, quant: QuantizationConfig | None) -> None:
    fn, want = REGRESSION[name]
    assert fn(quant) == want  # ==, not approx: float weights' operators and their sums are unchanged


# ---- hand-counted operators (MID: h 256, i 512, L 2; b = 2; 4-byte scales) ------------------------------------------

def _ops(quant: QuantizationConfig, tokens: int, decode: bool) -> dict:
    if decode:
        return by_name(decode_operators(MID, tokens, 5, quant=quant))
    return by_name(prefill_operators(MID, tokens, quant=quant))


T = 3
PROJ_CASES = [
    # (scheme, decode step?, operator, [(flops, weight bytes, io bytes, count, fp8)])
    # per-channel, per-token (--quantization fp8): scales one per row; the producers quantize the inputs
    ("online", True, "qkv_proj", [(2 * T * 256 * 512, 256 * 512 + 4 * 512, T * 256 + 4 * T + T * 512 * 2, 2, True)]),
    ("online", True, "o_proj", [(2 * T * 256 * 256, 256 * 256 + 4 * 256, T * 256 + 4 * T + T * 256 * 2, 2, True)]),
    ("online", True, "gate_up_proj", [(2 * T * 256 * 1024, 256 * 1024 + 4 * 1024, T * 256 + 4 * T + T * 1024 * 2, 2,
                                       True)]),
    ("online", True, "down_proj", [(2 * T * 512 * 256, 512 * 256 + 4 * 256, T * 512 + 4 * T + T * 256 * 2, 2, True)]),
    ("online", True, "o_proj_quant", []),  # decode: attention writes o_proj's quantized rows
    ("online", False, "o_proj_quant", [(3 * T * 256, 0, T * 256 * 2 + T * 256 + 4 * T, 2, False)]),  # prefill: its own
    ("online", True, "qkv_proj_quant", []),
    ("online", True, "add_norm", [(5 * T * 256, 256 * 2, 3 * T * 256 * 2 + T * 256 + 4 * T, 4, False)]),
    ("online", True, "act_mul", [(5 * T * 512, 0, 2 * T * 512 * 2 + T * 512 + 4 * T, 2, False)]),
    ("online", True, "lm_head", [(2 * T * 256 * 1000, 256 * 1000 * 2, T * (256 + 1000) * 2, 1, False)]),  # stays bf16
    ("online", True, "embed", [(0, 0, 2 * T * 256 * 2, 1, False)]),
    # block 128x128 weights, per-token-group (128) activations: a scale per block, a quantizer per projection
    ("block", True, "qkv_proj", [(2 * T * 256 * 512, 256 * 512 + 4 * (4 * 2), T * 256 + 4 * T * 2 + T * 512 * 2, 2,
                                  True)]),
    ("block", True, "qkv_proj_quant", [(3 * T * 256, 0, T * 256 * 2 + T * 256 + 4 * T * 2, 2, False)]),
    ("block", True, "down_proj", [(2 * T * 512 * 256, 512 * 256 + 4 * (2 * 4), T * 512 + 4 * T * 4 + T * 256 * 2, 2,
                                   True)]),
    ("block", True, "down_proj_quant", [(3 * T * 512, 0, T * 512 * 2 + T * 512 + 4 * T * 4, 2, False)]),
    ("block", True, "add_norm", [(5 * T * 256, 256 * 2, 4 * T * 256 * 2, 4, False)]),  # writes float rows, as bf16's
    ("block", True, "act_mul", [(5 * T * 512, 0, 3 * T * 512 * 2, 2, False)]),
    # per-tensor weight scales (stored repeated over the rows), static activations: one input scale
    ("static", True, "o_proj", [(2 * T * 256 * 256, 256 * 256 + 4 * 256, T * 256 + 4 + T * 256 * 2, 2, True)]),
    ("static", True, "o_proj_quant", [(3 * T * 256, 0, T * 256 * 2 + T * 256 + 4, 2, False)]),
]


@pytest.mark.parametrize(("scheme", "decode", "name", "want"), PROJ_CASES,
                         ids=[f"{s}-{'decode' if d else 'prefill'}-{n}" for s, d, n, _ in PROJ_CASES])
def test_fp8_operator_counts(scheme: str, decode: bool, name: str, want: list) -> None:
    quant = {"online": ONLINE_FP8, "block": BLOCK, "static": STATIC}[scheme]
    got = [(o.flops, o.weight_bytes, o.io_bytes, o.count, o.fp8) for o in _ops(quant, T, decode).get(name, [])]
    assert got == want


def test_float_layers_stay_float_and_their_norms_write_float_rows() -> None:
    """A checkpoint that keeps layer 0's q|k|v in float: one float q|k|v, one fp8; the norm before the float one writes
    float rows (3 of the 4 RMSNorms quantize for their projection)."""
    keep = tuple(f"model.layers.0.self_attn.{p}_proj" for p in "qkv")
    quant = dataclasses.replace(ONLINE_FP8, float_layers=keep)
    assert fp8_layers(MID, quant) == {"qkv_proj": 1, "o_proj": 2, "gate_up_proj": 2, "down_proj": 2}
    ops = by_name(decode_operators(MID, T, 5, quant=quant))
    assert [(o.count, o.fp8, o.weight_bytes) for o in ops["qkv_proj"]] == [(1, True, 256 * 512 + 4 * 512),
                                                                          (1, False, 256 * 512 * 2)]
    assert [o.count for o in ops["add_norm"]] == [3, 1]
    assert ops["add_norm"][1].io_bytes == 4 * T * 256 * 2


def test_moe_experts_stay_at_the_model_dtype() -> None:
    """fp8 MoE is refused by the config builder and the loader: a sparse layer's experts and router keep b bytes;
    its attention projections are fp8 and it has no dense MLP."""
    counts = fp8_layers(MOE, ONLINE_FP8)
    assert counts["qkv_proj"] == counts["o_proj"] == MOE.num_layers
    assert counts["gate_up_proj"] == counts["down_proj"] == MOE.num_layers - MOE.moe.num_sparse(MOE.num_layers) == 0
    fp8, bf16 = by_name(decode_operators(MOE, 8, 1024, quant=ONLINE_FP8)), by_name(decode_operators(MOE, 8, 1024))
    for name in ("moe_router", "moe_gate_up", "moe_down"):
        assert fp8[name] == bf16[name]


def test_fp8_weights_are_half_the_projection_bytes_plus_scales() -> None:
    """Qwen3-8B decode: weight bytes fp8 = bf16 - one byte per projection value + one float32 per projection row."""
    h, q, kv, i, n = 4096, 32 * 128, 8 * 128, 12288, QWEN.num_layers
    values = n * (h * (q + 2 * kv) + q * h + 2 * h * i + i * h)
    rows = n * ((q + 2 * kv) + h + 2 * i + h)
    weights = [sum(o.count * o.weight_bytes for o in decode_operators(QWEN, 1, 2048, quant=w)) for w in (None,
                                                                                                       ONLINE_FP8)]
    assert weights[1] == weights[0] - values + 4 * rows


def test_tensor_parallel_rank_holds_its_rows_scales() -> None:
    """At tp 2 a rank's q|k|v is its heads' rows (column parallel: its rows' scales), down its K half (row parallel:
    every output row's scale)."""
    ops = by_name(decode_operators(QWEN, 1, 2048, tp=2, quant=ONLINE_FP8))
    assert ops["qkv_proj"][0].weight_bytes == 4096 * (16 + 2 * 4) * 128 + 4 * (16 + 2 * 4) * 128
    assert ops["down_proj"][0].weight_bytes == 6144 * 4096 + 4 * 4096


# ---- the fp8 peak --------------------------------------------------------------------------------------------------

def test_fp8_projections_multiply_at_the_fp8_peak() -> None:
    """A compute-bound fp8 GEMM takes 1/2 the bf16 time at the assumed 2x peak, 1/3 at a measured 3x; float operators
    do not move."""
    ops = [o for o in prefill_operators(QWEN, 4096, quant=ONLINE_FP8) if o.fp8]
    bf16 = [o for o in prefill_operators(QWEN, 4096) if o.name in {x.name for x in ops}]
    assumed = H200
    measured = msgspec.structs.replace(H200, fp8_matmul_flops=3 * H200.matmul_flops)
    assert assumed.fp8_flops == 2 * H200.matmul_flops
    t16 = step_seconds(bf16, 132, H200)
    assert step_seconds(ops, 132, assumed) == pytest.approx(t16 / 2, rel=1e-12)
    assert step_seconds(ops, 132, measured) == pytest.approx(t16 / 3, rel=1e-12)
    rest = [o for o in prefill_operators(QWEN, 4096, quant=ONLINE_FP8) if not o.fp8]
    assert step_seconds(rest, 132, assumed) == step_seconds(rest, 132, measured)


@pytest.mark.parametrize(("fp8", "want"), [(None, None), (1.4e15, 1.4e15)])
def test_peaks_fp8_field(fp8: float | None, want: float | None) -> None:
    p = Peaks(7e14, 4e12, 132, fp8_matmul_flops=fp8)
    assert p.fp8_matmul_flops == want and p.fp8_flops == (want or 1.4e15)
    with pytest.raises(AttributeError):
        p.fp8_matmul_flops = 1.0  # type: ignore[misc]  # frozen


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan])
def test_peaks_refuse_a_non_positive_fp8_peak(bad: float) -> None:
    with pytest.raises(ValueError, match="fp8_matmul_flops must be > 0"):
        Peaks(7e14, 4e12, 132, fp8_matmul_flops=bad)


def test_measure_peaks_on_cpu_has_no_fp8_peak() -> None:
    """A CPU does not multiply fp8 (`fp8_supported`): no fp8 peak, fp8_flops assumes 2x bf16's; asked or not."""
    for fp8 in (False, True):
        p = measure_peaks("cpu", reps=2, fp8=fp8)
        assert p.fp8_matmul_flops is None and p.fp8_flops == 2 * p.matmul_flops


def test_measure_peaks_times_the_fp8_gemm_where_the_device_has_fp8(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where `fp8_supported`, fp8=True measures the scaled-mm GEMM (torch's CPU kernel stands in for the GPU's here);
    without fp8=True it is not measured."""
    monkeypatch.setattr(fp8_ops, "fp8_supported", lambda device: True)
    p = measure_peaks("cpu", reps=2, fp8=True)
    assert p.fp8_matmul_flops is not None and p.fp8_matmul_flops > 0 and p.fp8_flops == p.fp8_matmul_flops
    assert measure_peaks("cpu", reps=2).fp8_matmul_flops is None


@pytest.mark.parametrize(("peaks", "fp8", "tail"), [
    (H200, False, "copy 3.97 TB/s"),
    (H200, True, "copy 3.97 TB/s, fp8 GEMM not measured (assumed 2 x bf16: 1446 TFLOP/s)"),
    (msgspec.structs.replace(H200, fp8_matmul_flops=1.3e15), True, "copy 3.97 TB/s, fp8 GEMM 1300 TFLOP/s"),
])
def test_describe_peaks(peaks: Peaks, fp8: bool, tail: str) -> None:
    line = describe_peaks(peaks, fp8=fp8)
    assert line.startswith("peaks measured now: GEMM 723 TFLOP/s") and line.endswith(tail)


# ---- what the fp8 roofline predicts on the Qwen3-8B shape (H200 peaks, fp8 peak assumed 2x) --------------------------

@pytest.mark.parametrize(("batch", "lo", "hi"), [
    (1, 0.5, 0.6),  # weights dominate: half of them, plus the bf16 LM head and the KV reads
    (16, 0.6, 0.7),  # the KV reads (bf16 cache) grow with the batch
    (64, 0.75, 0.85),
])
def test_fp8_decode_step_against_bf16(batch: int, lo: float, hi: float) -> None:
    fp8, bf16 = (decode_step_ms(QWEN, batch, 2048, 132, H200, quant=q) for q in (ONLINE_FP8, None))
    assert lo < fp8 / bf16 < hi


@pytest.mark.parametrize(("chunks", "lo", "hi"), [
    ([(4096, 0)], 0.55, 0.62),  # the GEMMs halve at 2x; attention, norms and RoPE do not
    ([(1024, 0)] * 8, 0.53, 0.58),
    ([(4096, 0)] * 2, 0.55, 0.62),
])
def test_fp8_prefill_forward_against_bf16(chunks: list[tuple[int, int]], lo: float, hi: float) -> None:
    t = [step_seconds(mixed_operators_summed(QWEN, 0, 0, chunks, quant=q), 132, H200) for q in (ONLINE_FP8, None)]
    assert lo < t[0] / t[1] < hi


def test_fp8_kv_cache_and_fp8_weights_together() -> None:
    """Both halve their bytes: each alone is faster than neither, both faster than either."""
    def ms(kv: float | None, q: QuantizationConfig | None) -> float:
        return decode_step_ms(QWEN, 64, 8192, 132, H200, kv_bytes=kv, quant=q)
    assert ms(1.0, ONLINE_FP8) < min(ms(None, ONLINE_FP8), ms(1.0, None)) <= max(ms(None, ONLINE_FP8), ms(1.0, None)) \
        < ms(None, None)
