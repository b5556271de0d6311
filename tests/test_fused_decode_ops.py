"""The decode step's kernels of issue 16: `rope_write` ((q/k norm,) RoPE and the KV-cache write in one
launch) and `skinny_linear` (linear layers of at most 16 rows). The Triton versions match the torch
compositions they replace: under the Triton interpreter on CPU (in a subprocess; fp32/fp16) and natively
on a GPU (bf16 too). Bad shapes get a ValueError naming what is allowed.

Run as a script (``TRITON_INTERPRET=1 python tests/test_fused_decode_ops.py``) it performs the
interpreter checks.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from test_ops import rope_inputs
from triton_interp import exit_passed, run_interpreted

from rapidserve.ops import cublas_linears, get_ops, torch_kv, triton_ops_bundle, unfused_ops
from rapidserve.ops import torch_ops as tops

HAS_TRITON = importlib.util.find_spec("triton") is not None
Close = Callable[[torch.Tensor, torch.Tensor, torch.dtype], None]


def _cache(num_blocks: int, num_kv: int, block: int, d: int, dtype: torch.dtype, device: str,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return tuple(torch.randn(num_blocks, num_kv, block, d, generator=g).to(dtype).to(device)  # type: ignore[return-value]
                 for _ in range(2))


def check_rope_write(dtypes: list[torch.dtype], device: str, close: Close) -> None:
    """Triton rope_write == torch (norm,) RoPE + write_kv: q, and the whole cache (untouched slots too)."""
    from rapidserve.ops import triton_rope as xrope

    for dtype in dtypes:
        for num_heads, num_kv, d, norm in ((6, 2, 64, True), (9, 3, 32, False), (32, 8, 128, True),
                                           (4, 4, 128, False)):
            t = 13
            q, k, pos, table = (x.to(device) for x in rope_inputs(dtype, t, num_heads, num_kv, d, seed=d))
            # v: a strided view, as the model's split of one qkv buffer gives it
            v = torch.randn(t, 2 * num_kv, d)[:, num_kv:].to(dtype).to(device)
            qw, kw = ((torch.rand(d) + 0.5).to(dtype).to(device) for _ in range(2)) if norm else (None, None)
            kc, vc = _cache(5, num_kv, 16, d, dtype, device)
            slots = torch.tensor([3, 17, -1, 40, 0, 79, 22, -1, 5, 63, 64, 11, 50], device=device)
            want_kc, want_vc = kc.clone(), vc.clone()
            want_q = tops.rope_write(q.clone(), k.clone(), v, qw, kw, 1e-6, pos, table, want_kc, want_vc, slots)
            # the Triton composition it replaces, bit for bit (the same kernels' roundings)
            unf_kc, unf_vc = kc.clone(), vc.clone()
            unf_q = unfused_ops(triton_ops_bundle()).rope_write(q.clone(), k.clone(), v, qw, kw, 1e-6, pos, table,
                                                                unf_kc, unf_vc, slots)
            k_before = k.clone()
            got_q = xrope.rope_write(q, k, v, qw, kw, 1e-6, pos, table, kc, vc, slots)
            assert got_q.data_ptr() == q.data_ptr()  # in place
            assert torch.equal(k, k_before)  # k itself is left as it was
            close(got_q, want_q, dtype)
            close(kc, want_kc, dtype)
            assert torch.equal(vc, want_vc), (dtype, num_heads, d)  # v is copied, never rounded
            assert torch.equal(got_q, unf_q) and torch.equal(kc, unf_kc) and torch.equal(vc, unf_vc)
        # norm weights of another dtype than q (fp32): the unfused path, promoting as torch does
        q, k, pos, table = (x.to(device) for x in rope_inputs(dtype, 5, 4, 2, 32))
        v = torch.randn(5, 2, 32).to(dtype).to(device)
        qw32, kw32 = torch.rand(32).to(device) + 0.5, torch.rand(32).to(device) + 0.5
        kc, vc = _cache(2, 2, 16, 32, dtype, device)
        want_kc, want_vc = kc.clone(), vc.clone()
        slots = torch.tensor([0, 1, 2, 30, -1], device=device)
        want_q = tops.rope_write(q.clone(), k.clone(), v, qw32, kw32, 1e-6, pos, table, want_kc, want_vc, slots)
        got_q = xrope.rope_write(q, k, v, qw32, kw32, 1e-6, pos, table, kc, vc, slots)
        close(got_q, want_q, want_q.dtype)
        if dtype == torch.float32:
            close(kc, want_kc, dtype)
        # empty batch: nothing launched, nothing written
        _, _, _, table = rope_inputs(dtype, 4, 4, 2, 32)
        q, k = torch.empty(0, 4, 32, dtype=dtype, device=device), torch.empty(0, 2, 32, dtype=dtype, device=device)
        none = torch.empty(0, dtype=torch.long, device=device)
        kc, vc = _cache(2, 2, 16, 32, dtype, device)
        before = kc.clone()
        xrope.rope_write(q, k, k.clone(), None, None, 1e-6, none, table.to(device), kc, vc, none)
        assert torch.equal(kc, before)


def check_skinny(dtypes: list[torch.dtype], device: str, close: Close) -> None:
    """skinny_linear == F.linear (gated: silu_and_mul of it) over row counts, ragged shapes, tile
    configurations and bias."""
    from rapidserve.ops import triton_ops as xops
    from rapidserve.ops.triton_skinny import SkinnyConfig, gated_config, skinny_linear

    g = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        for m, n, k, cfg in ((1, 64, 512, None), (5, 100, 300, None), (16, 48, 1024, SkinnyConfig(16, 256, 4, 2)),
                             (3, 70, 96, SkinnyConfig(32, 64, 4, 3)), (16, 40, 200, None)):
            w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(device)
            x = torch.randn(m, k, generator=g).to(dtype).to(device)
            b = torch.randn(n, generator=g).to(dtype).to(device)
            close(skinny_linear(x, w, config=cfg), F.linear(x.float(), w.float()).to(dtype), dtype)
            close(skinny_linear(x, w, b, config=cfg), F.linear(x.float(), w.float(), b.float()).to(dtype), dtype)
            # gated: w as cat(gate, up) [2I, K] with I = n, against silu_and_mul of the rounded product
            w2 = (torch.randn(2 * n, k, generator=g) / k**0.5 * 4).to(dtype).to(device)
            want = tops.silu_and_mul(F.linear(x.float(), w2.float()).to(dtype))
            got = skinny_linear(x, w2, config=cfg, gated=True)
            close(got, want, dtype)
            # bit for bit the ungated kernel (same tiles) then the Triton silu_and_mul: the epilogue rounds as it
            half = cfg or gated_config(2 * n, k)
            unf = xops.silu_and_mul(skinny_linear(x, w2, config=half))
            assert torch.equal(got, unf), (dtype, m, n, k)
        # a row view of a wider buffer (stride(0) > K) reads the right rows
        big = torch.randn(4, 700, generator=g).to(dtype).to(device)
        w = (torch.randn(32, 512, generator=g) / 20).to(dtype).to(device)
        close(skinny_linear(big[:, 100:612], w), F.linear(big[:, 100:612].float(), w.float()).to(dtype), dtype)


def _interp_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    atol = 1e-5 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(got, want, atol=atol, rtol=2e-3)


def _gpu_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    atol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=1.6e-2)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_fused_ops_interpreter() -> None:
    """Both kernels under TRITON_INTERPRET=1 (fp32/fp16: the interpreter's bf16 casts truncate)."""
    run_interpreted(__file__, timeout=600)


def test_torch_rope_write_is_rope_then_write_kv() -> None:
    q, k, pos, table = rope_inputs(torch.float32, 7, 6, 2, 64)
    v = torch.randn(7, 2, 64)
    qw, kw = torch.rand(64) + 0.5, torch.rand(64) + 0.5
    kc, vc = _cache(3, 2, 16, 64, torch.float32, "cpu")
    want_kc, want_vc = kc.clone(), vc.clone()
    slots = torch.tensor([0, 5, -1, 16, 47, 30, 2])
    got_q = tops.rope_write(q, k, v, qw, kw, 1e-6, pos, table, kc, vc, slots)
    want_q, want_k = tops.qk_norm_rope(q, k, qw, kw, 1e-6, pos, table)
    torch_kv.write_kv(want_k, v, want_kc, want_vc, slots)
    assert torch.equal(got_q, want_q) and torch.equal(kc, want_kc) and torch.equal(vc, want_vc)
    with pytest.raises(ValueError, match="both q/k norm weights or neither"):
        tops.rope_write(q, k, v, qw, None, 1e-6, pos, table, kc, vc, slots)


def test_cpu_bundle_and_unfused() -> None:
    ops = get_ops(torch.device("cpu"))
    assert ops.linear is tops.linear and ops.rope_write is tops.rope_write
    assert unfused_ops(ops) is ops  # the torch bundle has nothing fused


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_bundles_route_linears() -> None:
    """NVIDIA: the skinny kernel; ROCm (skinny off: not measured there): torch's F.linear; unfused_ops: the
    layer as before (F.linear, RoPE and the KV write as two launches), for A/B benches."""
    from rapidserve.ops import triton_ops_bundle, triton_skinny

    nv, amd = triton_ops_bundle(skinny=True), triton_ops_bundle(skinny=False)
    assert (nv.name, amd.name) == ("triton", "triton-noskinny")
    assert nv.linear is triton_skinny.linear and amd.linear is tops.linear
    assert nv.rope_write is amd.rope_write  # one Triton launch on both vendors
    part = cublas_linears(nv)  # decode graphs on part of the GPU: cuBLAS, the other fusions kept
    assert part.name == "triton-cublas" and part.linear is tops.linear and part.rope_write is nv.rope_write
    assert cublas_linears(amd) is amd and cublas_linears(get_ops(torch.device("cpu"))).name == "torch"
    from rapidserve.partition.profile import Configuration
    assert Configuration("overallocated", 0, 132).decode_whole and not Configuration("split16", 16, 116).decode_whole
    old = unfused_ops(nv)
    assert old.name == "triton-unfused" and old.linear is tops.linear and old.rope_write is not nv.rope_write
    assert old.rms_norm is nv.rms_norm  # everything else unchanged


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("make, match", [
    (lambda: (torch.randn(17, 64, dtype=torch.bfloat16), torch.randn(8, 64, dtype=torch.bfloat16)), "1..16 rows"),
    (lambda: (torch.randn(2, 64), torch.randn(8, 64)), "bf16/fp16"),
    (lambda: (torch.randn(2, 3, 64, dtype=torch.bfloat16), torch.randn(8, 64, dtype=torch.bfloat16)), "1..16 rows"),
    (lambda: (torch.randn(2, 64, dtype=torch.bfloat16), torch.randn(8, 32, dtype=torch.bfloat16)),
     r"x must be \[M, 32\]"),
    (lambda: (torch.randn(2, 64, dtype=torch.bfloat16), torch.randn(8, 64, dtype=torch.float16)), "same dtype"),
])
def test_skinny_refuses_bad_shapes(make: Callable[[], tuple[torch.Tensor, torch.Tensor]], match: str) -> None:
    from rapidserve.ops.triton_skinny import skinny_linear

    x, w = make()
    with pytest.raises(ValueError, match=match):
        skinny_linear(x, w)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_rope_write_refuses_bad_shapes() -> None:
    from rapidserve.ops import triton_rope as xrope

    q, k, pos, table = rope_inputs(torch.float16, 4, 4, 2, 32)
    v = torch.randn(4, 2, 32, dtype=torch.float16)
    kc, vc = _cache(2, 2, 16, 32, torch.float16, "cpu")
    slots = torch.arange(4)
    cases = [
        ((q, k, v[:, :1], None, None, 1e-6, pos, table, kc, vc, slots), r"v must have k's shape \(4, 2, 32\)"),
        ((q, k, v, None, None, 1e-6, pos, table, kc[:, :1], vc[:, :1], slots),
         r"contiguous \[num_blocks, 2, block_size"),
        ((q, k, v, None, None, 1e-6, pos, table, kc, vc.transpose(2, 3), slots), "k_cache and v_cache"),
        ((q, k, v, None, None, 1e-6, pos, table, kc, vc, slots[:3]), r"slot_mapping must be \[4\]"),
        ((q, k, v, torch.rand(16, dtype=torch.float16), torch.rand(16, dtype=torch.float16), 1e-6, pos, table,
          kc, vc, slots), r"q/k norm weights must be \[32\]"),
        ((q, k, v, torch.rand(32, dtype=torch.float16), None, 1e-6, pos, table, kc, vc, slots), "or neither"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            xrope.rope_write(*args)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_thin_grids_stay_on_cublas() -> None:
    """A weight giving the kernel fewer than MIN_PROGRAMS programs (a tensor-parallel shard, a small model)
    stays on cuBLAS: the kernel is slower per SM, so a thin grid loses."""
    from rapidserve.ops.triton_skinny import MIN_PROGRAMS, wide_enough

    assert MIN_PROGRAMS == 96
    # Qwen3-8B at TP 1: all four routed
    assert all(wide_enough(n, k) for n, k in ((6144, 4096), (4096, 4096), (4096, 12288)))
    assert wide_enough(24576, 4096, gated=True)
    # at TP 4 its qkv shard (1536 x 4096: 24 programs) is not; SmolLM2-135M's (960 x 576) neither
    assert not wide_enough(1536, 4096) and not wide_enough(960, 576)
    assert wide_enough(3072, 576, gated=True)  # SmolLM2's gate|up: 1536 columns in 16-wide tiles, 96
    assert not wide_enough(2048, 512, gated=True) and not wide_enough(24575, 4096, gated=True)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_skinny_gated_refuses_odd_rows_and_bias() -> None:
    from rapidserve.ops.triton_skinny import skinny_linear

    x = torch.randn(2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="even row count and no bias; got weight \\(7, 64\\)"):
        skinny_linear(x, torch.randn(7, 64, dtype=torch.bfloat16), gated=True)
    with pytest.raises(ValueError, match="and a bias"):
        skinny_linear(x, torch.randn(8, 64, dtype=torch.bfloat16), torch.randn(8, dtype=torch.bfloat16), gated=True)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_skinny_refuses_bad_bias_and_routes_by_rows() -> None:
    from rapidserve.ops.triton_skinny import gated_config, skinny_config, skinny_linear, skinny_ok

    x, w = torch.randn(2, 64, dtype=torch.bfloat16), torch.randn(8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"bias must be \[8\]"):
        skinny_linear(x, w, torch.randn(9, dtype=torch.bfloat16))
    assert skinny_ok(x, w) and not skinny_ok(torch.randn(17, 64, dtype=torch.bfloat16), w)
    assert not skinny_ok(x, w.t().contiguous().t())  # a transposed weight goes to F.linear
    # the table (Qwen3-8B's shapes, measured) and its rule for other sizes
    assert skinny_config(24576, 4096) == (64, 256, 4, 4) and skinny_config(4096, 4096) == (32, 256, 4, 4)
    assert skinny_config(6144, 4096) == (64, 256, 4, 4) and skinny_config(4096, 12288) == (32, 512, 4, 4)
    assert gated_config(24576, 4096) == (32, 128, 4, 3) and gated_config(64, 64).block_n == 16
    assert gated_config(8192, 2048) == (32, 256, 4, 4)  # narrower MLPs: the ungated rule, halved
    from rapidserve.ops import triton_skinny
    x, w = torch.randn(2, 64, dtype=torch.bfloat16), torch.randn(16, 64, dtype=torch.bfloat16)
    assert torch.equal(triton_skinny.linear(x, w), F.linear(x, w))  # CPU tensors: F.linear
    assert torch.equal(triton_skinny.linear_silu_and_mul(x, w, tops.silu_and_mul), tops.linear_silu_and_mul(x, w))


@pytest.mark.gpu
def test_fused_ops_gpu() -> None:
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    check_rope_write(dtypes, "cuda", _gpu_close)
    check_skinny([torch.bfloat16, torch.float16], "cuda", _gpu_close)
    from rapidserve.ops.triton_skinny import MAX_ROWS, routed

    ops = get_ops(torch.device("cuda"))
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 256, device="cuda", dtype=torch.bfloat16) / 16  # 128 programs: routed
    nvidia = torch.version.hip is None
    assert routed(x, w) and routed(x, w, gated=True)
    assert (ops.linear is not tops.linear) == nvidia  # the kernel on NVIDIA, cuBLAS on ROCm
    _gpu_close(ops.linear(x, w), F.linear(x, w), torch.bfloat16)
    bias = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    _gpu_close(ops.linear(x, w, bias), F.linear(x, w, bias), torch.bfloat16)
    big = torch.randn(MAX_ROWS + 1, 256, device="cuda", dtype=torch.bfloat16)
    assert not routed(big, w)
    assert torch.equal(ops.linear(big, w), F.linear(big, w))  # more than MAX_ROWS rows: cuBLAS, bit for bit
    _gpu_close(ops.linear_silu_and_mul(x, w), tops.silu_and_mul(F.linear(x, w)), torch.bfloat16)
    assert torch.equal(ops.linear_silu_and_mul(big, w), ops.silu_and_mul(F.linear(big, w)))
    thin = w[:512]  # 16 programs: cuBLAS
    assert not routed(x, thin) and torch.equal(ops.linear(x, thin), F.linear(x, thin))


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("set TRITON_INTERPRET=1 before running the interpreter checks")
    check_rope_write([torch.float32, torch.float16], "cpu", _interp_close)
    check_skinny([torch.float16], "cpu", _interp_close)
    print("fused decode ops: ok")
    exit_passed()
