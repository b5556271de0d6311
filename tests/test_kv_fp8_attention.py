"""The fp8 KV cache's arithmetic (issue 39; rapidserve/ops/kv_quant.py) in every attention backend on CPU:

- the write: fp8(clamp(x / scale, +-fp8_max)), round-trip error within e4m3's half ulp (2^-4 relative) in its normal
  range, saturating beyond it, with the layer's scale;
- the torch reference reading an fp8 cache is the reference over its dequantized values (a float cache holding
  x8 * scale), and within a bound of attention over the unquantized keys and values;
- the Triton kernels (write_kv, the fused rope_write, decode, prefill; e4m3fn and ROCm's e4m3fnuz) under the Triton
  interpreter against the torch reference, writes bit for bit;
- a sliding window over an fp8 cache (every backend, the interpreter's kernels included): the window of the
  dequantized cache;
- the FA3 glue with a stand-in kernel: an e4m3fn cache is prefilled with an fp8 query and q/k/v descales of shape
  [batch, kv_heads] that give back the reference's numbers; a build without fp8, or an e4m3fnuz cache, falls back
  to the Triton kernel with the scales.

Run as a script (``TRITON_INTERPRET=1 python tests/test_kv_fp8_attention.py write|rope_write|decode|prefill``) it
performs the interpreter checks; `test_triton_interpreter` does exactly that (all in one subprocess)."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from test_attention import DECODE_CASES, PREFILL_CASES, Batch, decode_seqs, make_batch
from triton_interp import interpreted_checks, run_checks, selected

from rapidserve.attention import attend, get_attention_backend
from rapidserve.attention import torch_ref as ref
from rapidserve.ops import kv_quant as kq
from rapidserve.ops import torch_kv

HAS_TRITON = importlib.util.find_spec("triton") is not None
FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz


def scales(k: float, v: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([k], dtype=torch.float32), torch.tensor([v], dtype=torch.float32)


def fp8_cache(b: Batch, dtype: torch.dtype = FN) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty fp8 caches of the batch's shape (unwritten slots hold NaN, as make_batch's float ones)."""
    return (torch.full(b.k_cache.shape, float("nan")).to(dtype), torch.full(b.v_cache.shape, float("nan")).to(dtype))


def write_all(b: Batch, kc: torch.Tensor, vc: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor) -> None:
    """Every key and value of every sequence written to the fp8 caches (prefix and new tokens)."""
    slots, keys, values = [], [], []
    bs = b.k_cache.shape[2]
    for i, (k, v) in enumerate(zip(b.keys, b.values, strict=True)):
        n = k.shape[0]
        slots += [int(b.meta.block_tables[i, t // bs]) * bs + t % bs for t in range(n)]
        keys.append(k)
        values.append(v)
    if slots:
        dev = kc.device  # the batch's keys may live on the CPU while the caches are on a GPU (test_kv_fp8_gpu)
        torch_kv.write_kv(torch.cat(keys).to(dev), torch.cat(values).to(dev), kc, vc, torch.tensor(slots, device=dev),
                          ks, vs)


def within_fp8_error(got: torch.Tensor, exact: torch.Tensor, b: Batch) -> None:
    """Attention over an fp8 cache against the unquantized one: each output is a convex combination of values, each
    stored within 2^-4 of itself, so at most 2^-4 max|v| away, plus what the keys' rounding moves in the softmax
    (a few hundredths on unit-variance data); on average far less."""
    vmax = max((float(v.abs().max()) for v in b.values if v.numel()), default=0.0)
    err = (got - exact).abs()
    assert float(err.max()) <= 2.0**-4 * vmax + 0.05, (float(err.max()), vmax)
    assert float(err.mean()) < 0.02, float(err.mean())


# --------------------------------------------------------------------------------------------- the write
@pytest.mark.parametrize("dtype", [FN, FNUZ])
def test_round_trip_is_within_half_an_ulp_and_saturates(dtype: torch.dtype) -> None:
    top = float(torch.finfo(dtype).max)
    scale = torch.tensor([0.05])
    x = torch.randn(4096) * 3.0  # |x| / scale up to ~240: the normal range of both formats, some saturating
    x[:4] = torch.tensor([1e6, -1e6, top * 0.05 * 1.5, 0.0])
    x8 = kq.quantize(x, dtype, scale)
    assert x8.dtype == dtype
    back = kq.dequantize(x8, scale, torch.float32)
    inside = (x / scale).abs() <= top
    normal = inside & ((x / scale).abs() >= float(torch.finfo(dtype).smallest_normal))
    rel = ((back - x).abs() / x.abs())[normal]
    assert float(rel.max()) <= 2.0**-4 + 1e-6  # e4m3: 3 mantissa bits, round to nearest
    assert torch.equal(back[~inside], torch.sign(x[~inside]) * top * 0.05)  # saturated, never NaN
    assert float(back[3]) == 0.0
    # the same numbers with another scale: the scale is applied, not ignored
    assert not torch.equal(kq.quantize(x, dtype, torch.tensor([0.1])).float(), x8.float())


def test_scales_must_match_the_cache() -> None:
    b = make_batch([(3, 2)], num_kv_heads=2, group=1, head_dim=32, block_size=8)
    kc, vc = fp8_cache(b)
    with pytest.raises(ValueError, match="needs the layer's k_scale and v_scale"):
        torch_kv.write_kv(b.k_new, b.v_new, kc, vc, b.meta.slot_mapping)
    with pytest.raises(ValueError, match="needs the layer's k_scale"):
        ref.decode_attention(b.q[:1], kc, vc, b.meta.block_tables, b.meta.context_lens, 0.1)
    ks, vs = scales(1.0, 1.0)
    with pytest.raises(ValueError, match="stores values unscaled"):
        torch_kv.write_kv(b.k_new, b.v_new, b.k_cache, b.v_cache, b.meta.slot_mapping, ks, vs)


def test_torch_write_kv_quantizes_at_the_slots_and_skips_padding() -> None:
    b = make_batch([(5, 3), (2, -1), (4, 0)], num_kv_heads=2, group=2, head_dim=32, block_size=8, seed=3)
    kc, vc = fp8_cache(b)
    ks, vs = scales(0.02, 0.03)
    torch_kv.write_kv(b.k_new, b.v_new, kc, vc, b.meta.slot_mapping, ks, vs)
    fk, fv = torch.full(b.k_cache.shape, float("nan")), torch.full(b.v_cache.shape, float("nan"))
    torch_kv.write_kv(kq.dequantize(kq.quantize(b.k_new, FN, ks), ks, torch.float32),
                      kq.dequantize(kq.quantize(b.v_new, FN, vs), vs, torch.float32), fk, fv, b.meta.slot_mapping)
    assert torch.equal(kq.dequantize(kc, ks, torch.float32).nan_to_num(7.0), fk.nan_to_num(7.0))
    assert torch.equal(kq.dequantize(vc, vs, torch.float32).nan_to_num(7.0), fv.nan_to_num(7.0))
    written = (b.meta.slot_mapping >= 0).sum().item()
    assert int((~kc.float().isnan()).sum()) == written * kc.shape[1] * kc.shape[3]  # padding rows wrote nothing


# ------------------------------------------------------------------------------------- the torch reference
def _dequantized(kc: torch.Tensor, vc: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return kq.dequantize(kc, ks, dtype), kq.dequantize(vc, vs, dtype)


@pytest.mark.parametrize("dtype", [FN, FNUZ])
@pytest.mark.parametrize("case", PREFILL_CASES[:6], ids=[f"p{i}" for i in range(6)])
def test_torch_prefill_reads_the_dequantized_cache(case: tuple, dtype: torch.dtype) -> None:
    bs, group, d, hkv, seqs = case
    b = make_batch(seqs, num_kv_heads=hkv, group=group, head_dim=d, block_size=bs, seed=5)
    kc, vc = fp8_cache(b, dtype)
    top = float(torch.finfo(dtype).max)
    ks, vs = scales(5 / top, 5 / top)  # above the data's amax (unit-variance samples): a calibrated scale
    write_all(b, kc, vc, ks, vs)
    got = ref.prefill_attention(b.q, kc, vc, b.meta, d**-0.5, ks, vs)
    want = ref.prefill_attention(b.q, *_dequantized(kc, vc, ks, vs, torch.float32), b.meta, d**-0.5)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    torch_kv.write_kv(b.k_new, b.v_new, b.k_cache, b.v_cache, b.meta.slot_mapping)  # the unquantized cache
    exact = ref.prefill_attention(b.q, b.k_cache, b.v_cache, b.meta, d**-0.5)
    within_fp8_error(got, exact, b)


@pytest.mark.parametrize("case", DECODE_CASES[:6], ids=[f"d{i}" for i in range(6)])
def test_torch_decode_reads_the_dequantized_cache(case: tuple) -> None:
    bs, group, d, hkv, ctxs = case
    b = make_batch(decode_seqs(ctxs), num_kv_heads=hkv, group=group, head_dim=d, block_size=bs, decode=True, seed=2)
    kc, vc = fp8_cache(b)
    ks, vs = scales(1.0, 1.0)  # uncalibrated: unit-variance data sits in e4m3's normal range all the same
    write_all(b, kc, vc, ks, vs)
    args = (b.meta.block_tables, b.meta.context_lens, d**-0.5)
    got = ref.decode_attention(b.q, kc, vc, *args, ks, vs)
    want = ref.decode_attention(b.q, *_dequantized(kc, vc, ks, vs, torch.float32), *args)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    torch_kv.write_kv(b.k_new, b.v_new, b.k_cache, b.v_cache, b.meta.slot_mapping)  # the unquantized cache
    exact = ref.decode_attention(b.q, b.k_cache, b.v_cache, *args)
    within_fp8_error(got, exact, b)


def test_attend_passes_the_scales_to_both_halves_of_a_mixed_step() -> None:
    from rapidserve.attention import split_decode_rows

    b = make_batch([(1, 40), (1, 3), (20, 0), (5, 17)], num_kv_heads=2, group=4, head_dim=64, block_size=16, seed=7)
    kc, vc = fp8_cache(b)
    ks, vs = scales(0.01, 0.02)
    write_all(b, kc, vc, ks, vs)
    meta = split_decode_rows(b.meta, b.q_lens)
    assert meta.num_decode_seqs == 2 and meta.prefill_part is not None
    got = attend(get_attention_backend("torch", "cpu"), b.q, kc, vc, meta, 0.125, ks, vs)
    want = ref.prefill_attention(b.q, *_dequantized(kc, vc, ks, vs, torch.float32), b.meta, 0.125)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 7, 30])
def test_windowed_attention_over_an_fp8_cache(window: int) -> None:
    """A sliding-window layer (Mistral, Gemma 3's local layers) over an fp8 cache: prefill, decode and a mixed step
    through `attend` read the window of the dequantized cache, and the window hides keys (not the windowless
    result)."""
    from rapidserve.attention import split_decode_rows

    b = make_batch([(1, 40), (1, 3), (20, 0), (5, 17)], num_kv_heads=2, group=4, head_dim=64, block_size=16, seed=8)
    kc, vc = fp8_cache(b)
    ks, vs = scales(0.01, 0.02)
    write_all(b, kc, vc, ks, vs)
    dq = _dequantized(kc, vc, ks, vs, torch.float32)
    got = ref.prefill_attention(b.q, kc, vc, b.meta, 0.125, ks, vs, window=window)
    want = ref.prefill_attention(b.q, *dq, b.meta, 0.125, window=window)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(got, ref.prefill_attention(b.q, kc, vc, b.meta, 0.125, ks, vs), atol=1e-3)
    mixed = attend(get_attention_backend("torch", "cpu"), b.q, kc, vc, split_decode_rows(b.meta, b.q_lens), 0.125,
                   ks, vs, window=window)
    torch.testing.assert_close(mixed, want, atol=1e-6, rtol=1e-5)
    d = make_batch(decode_seqs([33, 0, 1, 50]), num_kv_heads=2, group=4, head_dim=64, block_size=16, decode=True,
                   seed=6)
    kc, vc = fp8_cache(d)
    write_all(d, kc, vc, ks, vs)
    args = (d.meta.block_tables, d.meta.context_lens, 0.125)
    got = ref.decode_attention(d.q, kc, vc, *args, ks, vs, window=window)
    want = ref.decode_attention(d.q, *_dequantized(kc, vc, ks, vs, torch.float32), *args, window=window)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------------------------------- FA3 glue
class FakeFa3:
    """A stand-in FA3 kernel: records its inputs and computes what FA3 computes from them (the inputs times their
    descales, the torch reference's attention), in bf16 for fp8 inputs as FA3 writes."""

    def __init__(self) -> None:
        self.calls: list[dict[str, object]] = []

    def __call__(self, q, k, v, page_table, seqused_k, cu, max_q, max_k, scale, window_left,  # type: ignore[no-untyped-def]
                 descales=None):
        from rapidserve.attention.metadata import AttentionMetadata

        self.calls.append({"q": q.dtype, "k": k.dtype, "descales": descales, "window_left": window_left})
        meta = AttentionMetadata(True, torch.full((q.shape[0],), -1), page_table, seqused_k, cu, max_q, max_k)
        kc, vc = k.transpose(1, 2), v.transpose(1, 2)
        window = None if window_left < 0 else window_left + 1
        if descales is None:
            return ref.prefill_attention(q, kc.contiguous(), vc.contiguous(), meta, scale, window=window)
        qd, kd, vd = (t[0, 0] for t in descales)
        out = ref.prefill_attention(q.float() * qd, kc.float() * kd, vc.float() * vd, meta, scale, window=window)
        return out.to(torch.bfloat16)


def _fa3(fp8: bool) -> tuple[object, FakeFa3, list[tuple]]:
    from rapidserve.attention import fa3

    fake, fallen = FakeFa3(), []

    def fallback(*args: object, **kw: object) -> torch.Tensor:
        fallen.append(args)
        return ref.prefill_attention(*args, **kw)  # type: ignore[arg-type]

    kernel = fa3.Fa3Kernel("fake", fake, fp8=fp8)
    return fa3.Fa3Attention(kernel, fallback_prefill=fallback), fake, fallen


def test_fa3_prefills_an_fp8_cache_with_an_fp8_query_and_descales() -> None:
    b = make_batch([(20, 12), (1, 30), (9, 0)], num_kv_heads=2, group=4, head_dim=64, block_size=16, seed=9)
    kc, vc = fp8_cache(b)
    ks, vs = scales(0.01, 0.02)
    write_all(b, kc, vc, ks, vs)
    impl, fake, fallen = _fa3(fp8=True)
    q = b.q.to(torch.bfloat16)
    got = impl.prefill_attention(q, kc, vc, b.meta, 0.125, ks, vs)  # type: ignore[attr-defined]
    assert not fallen and got.dtype == torch.bfloat16
    call = fake.calls[-1]
    assert call["q"] == FN and call["k"] == FN
    qd, kd, vd = call["descales"]  # type: ignore[misc]
    assert qd.shape == kd.shape == vd.shape == (3, 2) and qd.dtype == torch.float32  # [batch, kv heads]
    assert float(kd[0, 0]) == pytest.approx(0.01) and float(vd[1, 1]) == pytest.approx(0.02)
    assert float(qd[2, 1]) == pytest.approx(float(q.float().abs().max()) / 448, rel=1e-6)  # per tensor, dynamic
    want = ref.prefill_attention(q.float(), *_dequantized(kc, vc, ks, vs, torch.float32), b.meta, 0.125)
    err = (got.float() - want).abs()  # the query's own fp8 rounding (2^-4 relative) moves the scores, then bf16
    assert float(err.max()) < 0.12 and float(err.mean()) < 0.015, (float(err.max()), float(err.mean()))
    assert "fp8" in impl.describe_kv(FN) and "FA3 prefill" in impl.describe_kv(torch.bfloat16)  # type: ignore[attr-defined]


def test_fa3_fp8_prefill_of_a_sliding_window_layer() -> None:
    """An fp8 cache and a window at once: FA3 gets the fp8 query, the descales and window_size_left W - 1; the
    fallback (a build without fp8) gets the scales and the window."""
    b = make_batch([(20, 12), (9, 0)], num_kv_heads=2, group=4, head_dim=64, block_size=16, seed=9)
    kc, vc = fp8_cache(b)
    ks, vs = scales(0.01, 0.02)
    write_all(b, kc, vc, ks, vs)
    q = b.q.to(torch.bfloat16)
    want = ref.prefill_attention(q.float(), *_dequantized(kc, vc, ks, vs, torch.float32), b.meta, 0.125, window=6)
    impl, fake, fallen = _fa3(fp8=True)
    got = impl.prefill_attention(q, kc, vc, b.meta, 0.125, ks, vs, window=6)  # type: ignore[attr-defined]
    assert not fallen and fake.calls[-1]["window_left"] == 5 and fake.calls[-1]["descales"] is not None
    err = (got.float() - want).abs()
    assert float(err.max()) < 0.12 and float(err.mean()) < 0.015, (float(err.max()), float(err.mean()))
    impl, fake, fallen = _fa3(fp8=False)
    got = impl.prefill_attention(q, kc, vc, b.meta, 0.125, ks, vs, window=6)  # type: ignore[attr-defined]
    assert not fake.calls and len(fallen) == 1
    torch.testing.assert_close(got.float(), ref.prefill_attention(q, kc, vc, b.meta, 0.125, ks, vs,
                                                                  window=6).float())


@pytest.mark.parametrize(("fp8", "cache"), [(False, FN), (True, FNUZ)])
def test_fa3_falls_back_to_triton_where_it_cannot_read_the_cache(fp8: bool, cache: torch.dtype) -> None:
    b = make_batch([(7, 5)], num_kv_heads=1, group=2, head_dim=32, block_size=8, seed=4)
    kc, vc = fp8_cache(b, cache)
    ks, vs = scales(0.05, 0.05)
    write_all(b, kc, vc, ks, vs)
    impl, fake, fallen = _fa3(fp8=fp8)
    impl.prefill_attention(b.q.to(torch.bfloat16), kc, vc, b.meta, 0.1, ks, vs)  # type: ignore[attr-defined]
    assert not fake.calls and len(fallen) == 1 and fallen[0][-2:] == (ks, vs)
    assert impl.describe_kv(cache).startswith("Triton prefill for the fp8 KV cache")  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------- Triton interpreter
def interp_fp8_equal(got: torch.Tensor, want: torch.Tensor, off_by_one_step: float = 0.0) -> None:
    """`got` (the kernel's fp8 under the interpreter) is `want` (torch's) bit for bit, but where the Triton
    interpreter's own fp32 -> fp8 conversion (triton/runtime/interpreter.py `_convert_float`) is inexact: it drops
    the carry of a rounding that overflows the mantissa (128 comes out 64 when the exponent is odd) and truncates
    subnormals. A GPU converts in hardware, exactly: tests/test_kv_fp8_gpu.py asserts the bits there.
    `off_by_one_step`: the share of elements that may also differ by one fp8 step (inputs that differ in their last
    float32 bit, e.g. RoPE's sums, land on the other side of a rounding edge)."""
    g, w = got.float(), want.float()
    diff = (g != w) & ~(g.isnan() & w.isnan())
    carry = diff & ((want.view(torch.uint8) & 0x07) == 0) & (g * 2 == w)
    small = float(torch.finfo(want.dtype).smallest_normal)
    subnormal = diff & (w.abs() < small) & ((g - w).abs() <= small / 8)
    rest = diff & ~carry & ~subnormal
    step = (g - w).abs() <= w.abs() / 8 + small / 8
    assert bool((step | ~rest).all()), (g[rest & ~step][:8], w[rest & ~step][:8])
    assert float(rest.float().mean()) <= off_by_one_step, float(rest.float().mean())
    assert float(diff.float().mean()) < 0.1  # most elements bit for bit


def _interp_write() -> None:
    from rapidserve.ops import triton_kv as tp

    for cache, dtype in ((FN, torch.float32), (FNUZ, torch.float16), (FN, torch.float16)):
        b = make_batch([(3, 5), (2, -1), (9, 0)], num_kv_heads=3, group=1, head_dim=64, block_size=8, dtype=dtype,
                       seed=1)
        ks, vs = scales(0.013, 0.021)
        want_k, want_v = fp8_cache(b, cache)
        got_k, got_v = fp8_cache(b, cache)
        torch_kv.write_kv(b.k_new, b.v_new, want_k, want_v, b.meta.slot_mapping, ks, vs)
        tp.write_kv(b.k_new, b.v_new, got_k, got_v, b.meta.slot_mapping, ks, vs)
        interp_fp8_equal(got_k, want_k)
        interp_fp8_equal(got_v, want_v)


def _interp_rope_write() -> None:
    from rapidserve.ops import torch_ops, triton_rope

    gen = torch.Generator().manual_seed(3)
    t, hq, hkv, d, bs, blocks = 7, 4, 2, 64, 8, 6
    for cache, norm in ((FN, True), (FNUZ, False)):
        q = torch.randn(t, hq, d, generator=gen)
        k = torch.randn(t, hkv, d, generator=gen) * 4
        v = torch.randn(t, hkv, d, generator=gen)
        qw = kw = (1 + 0.1 * torch.randn(d, generator=gen)) if norm else None
        pos = torch.arange(t) + 3
        table = torch.randn(64, d, generator=gen).float()
        slots = torch.tensor([3, 9, -1, 17, 30, 31, 40])
        ks, vs = scales(0.02, 0.01)
        caches = [torch.zeros(blocks, hkv, bs, d).to(cache) for _ in range(4)]
        want_q = torch_ops.rope_write(q.clone(), k.clone(), v, qw, kw, 1e-6, pos, table, caches[0], caches[1], slots,
                                      ks, vs)
        got_q = triton_rope.rope_write(q.clone(), k.clone(), v, qw, kw, 1e-6, pos, table, caches[2], caches[3], slots,
                                      ks, vs)
        torch.testing.assert_close(got_q, want_q, atol=2e-5, rtol=1e-5)
        interp_fp8_equal(caches[2], caches[0], off_by_one_step=0.01)
        interp_fp8_equal(caches[3], caches[1])


def _interp_decode() -> None:
    from rapidserve.attention import triton_paged_decode as tp

    cases = [(16, 3, 64, 3, [100, 0, 1, 48, 49], torch.float32, FN), (8, 4, 32, 2, [8, 9, 0, 64, 120], torch.float16,
                                                                          FNUZ)]
    for bs, group, d, hkv, ctxs, dtype, cache in cases:
        b = make_batch(decode_seqs(ctxs), num_kv_heads=hkv, group=group, head_dim=d, block_size=bs, dtype=dtype,
                       decode=True, strided_q=True)
        kc, vc = fp8_cache(b, cache)
        ks, vs = scales(0.011, 0.017)
        write_all(b, kc, vc, ks, vs)
        args = (b.q, kc, vc, b.meta.block_tables, b.meta.context_lens, d**-0.5)
        # A sliding-window layer over the fp8 cache too. Every config without a window: the table's (case 1 one
        # split of BLOCK_N 32, two pages a tile; case 2 two splits of 64, eight pages), one split and three of 16;
        # windows 1 (splits left empty) and 37 (a tile start off the page) with the table's config and three splits:
        # a window meets the direct and the split path, its start in a multi-page tile and in a one-page one.
        for window, configs in ((None, ((None, None), (1, 16), (3, 16))), (1, ((None, None), (3, 16))),
                                (37, ((None, None), (3, 16)))):
            want = ref.decode_attention(*args, ks, vs, window=window)
            for splits, block_n in configs:
                got = tp.decode_attention(*args, ks, vs, num_splits=splits, block_n=block_n, window=window)
                torch.testing.assert_close(got.float(), want.float(), atol=2e-5 if dtype == torch.float32 else 4e-3,
                                           rtol=1e-3, msg=lambda m, c=(bs, ctxs, cache, splits, window): f"{c}: {m}")


def _interp_prefill() -> None:
    from rapidserve.attention import triton_paged_prefill as tp

    cases = [(16, 3, 64, 3, [(40, 0), (9, 7), (1, 50), (3, -1)], torch.float32, FN, 16, 16),
             (8, 4, 32, 2, [(17, 16), (33, 0), (5, 3)], torch.float16, FNUZ, 32, 16)]
    for bs, group, d, hkv, seqs, dtype, cache, bm, bn in cases:
        b = make_batch(seqs, num_kv_heads=hkv, group=group, head_dim=d, block_size=bs, dtype=dtype, strided_q=True)
        kc, vc = fp8_cache(b, cache)
        ks, vs = scales(0.011, 0.017)
        write_all(b, kc, vc, ks, vs)
        for window in (None, 1, 11):  # a sliding-window layer over the fp8 cache too
            want = ref.prefill_attention(b.q, kc, vc, b.meta, d**-0.5, ks, vs, window=window)
            got = tp.prefill_attention(b.q, kc, vc, b.meta, d**-0.5, ks, vs, block_m=bm, block_n=bn, window=window)
            torch.testing.assert_close(got.float(), want.float(), atol=2e-5 if dtype == torch.float32 else 4e-3,
                                       rtol=1e-3, msg=lambda m, c=(bs, seqs, cache, window): f"{c}: {m}")


INTERP_CHECKS = {"write": _interp_write, "rope_write": _interp_rope_write, "decode": _interp_decode,
                 "prefill": _interp_prefill}


@pytest.fixture(scope="module")
def interpreter(request: pytest.FixtureRequest) -> dict[str, str]:
    """The session's interpreter checks of this module, in one subprocess (tests/triton_interp.py)."""
    return interpreted_checks(__file__, selected(request, "check"))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("check", sorted(INTERP_CHECKS))
def test_triton_interpreter(interpreter: dict[str, str], check: str) -> None:
    """The Triton kernels with an fp8 cache under TRITON_INTERPRET=1, against the torch reference."""
    assert interpreter[check] == "", interpreter[check]


if __name__ == "__main__":
    sys.exit(run_checks(INTERP_CHECKS, sys.argv[1:]))
