"""The Triton decode kernel's fp16-dot path (an fp8 KV cache under a bf16 q, `F16_DOTS`:
rapidserve/attention/decode_config.py) and the tuning sweep's tile shapes, under the Triton interpreter on CPU
against the torch reference over the dequantized cache in fp32: GQA ratios 1 / 4 / 8, odd context lengths (not
multiples of the page or the tile), empty rows, batch 1 to 64, split counts from 1 to more than the tiles, sliding
windows (tiles start at the page of the window's first key), e4m3fn and e4m3fnuz, block_n from 16 to 128 against
pages of 8 to 32 (tiles of 1-16 whole pages, or slices of one), and queries past fp16's range.

(The interpreter's bf16 dots are wrong, so bf16 dots, the path of a bf16 cache, are checked on a GPU only:
tests/test_attention.py's gpu tests; fp16 and fp32 ones by tests/test_attention.py and test_kv_fp8_attention.py.)

The block-table prefetch (`DecodeConfig.prefetch`: each tile's pages loaded one iteration early) is checked the same
way over fp16 and fp8 caches: pages of 8-32 (tiles of one to eight pages, or slices of one), shuffled, windows,
a batch of varied contexts, split counts that leave some splits empty. The output quantized for an fp8 o projection
(`decode_attention_fp8`) against the separate quantizer of the float output, bit for bit.

Run as a script (``TRITON_INTERPRET=1 python tests/test_attention_decode.py fp16_dots|ranges|prefetch|fp8_out``) it
performs the interpreter checks; `test_triton_interpreter` runs them all in one subprocess.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from typing import Any

import pytest
import torch
from test_attention import Batch, decode_seqs, make_batch
from test_kv_fp8_attention import fp8_cache, scales, write_all
from triton_interp import interpreted_checks, run_checks, selected

from rapidserve.attention import torch_ref as ref
from rapidserve.attention.decode_config import DecodeConfig
from rapidserve.ops import kv_quant as kq
from rapidserve.ops import torch_kv

HAS_TRITON = importlib.util.find_spec("triton") is not None
FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
F16_DOTS = DecodeConfig(64, 4, 3, 2, True)  # block_n, warps and stages are overridden per case (the interpreter
# ignores warps and stages)


def _fp8_batch(ctxs: list[int], bs: int, group: int, d: int, hkv: int, cache: torch.dtype = FN,
               seed: int = 0) -> tuple[Batch, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode batch with a bf16 q over an fp8 cache holding every key and value: (batch, kc, vc, ks, vs)."""
    b = make_batch(decode_seqs(ctxs), num_kv_heads=hkv, group=group, head_dim=d, block_size=bs,
                   dtype=torch.bfloat16, decode=True, strided_q=True, seed=seed)
    kc, vc = fp8_cache(b, cache)
    ks, vs = scales(0.011, 0.017)
    write_all(b, kc, vc, ks, vs)
    return b, kc, vc, ks, vs


def _check(q: torch.Tensor, b: Batch, kc: torch.Tensor, vc: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
           block_n: int, splits: tuple[int | None, ...], window: int | None = None, what: object = "",
           prefetch: bool = False) -> None:
    """The kernel with fp16 dots, each split count, against the fp32 reference over the dequantized cache (the
    output is bf16: within its rounding)."""
    from rapidserve.attention import triton_paged_decode as tp

    d = q.shape[-1]
    args = (b.meta.block_tables, b.meta.context_lens, d**-0.5)
    want = ref.decode_attention(q.float(), kq.dequantize(kc, ks, torch.float32), kq.dequantize(vc, vs, torch.float32),
                                *args, window=window)
    cfg = F16_DOTS._replace(block_n=block_n, prefetch=prefetch)
    for n in splits:
        got = tp.decode_attention(q, kc, vc, *args, ks, vs, num_splits=n, config=cfg, window=window)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, atol=1.5e-2, rtol=1e-2,
                                   msg=lambda m, c=(what, block_n, n, window, prefetch): f"{c}: {m}")


def _interp_fp16_dots() -> None:
    # Split count None (the rule's) runs once, in the third case, where it gives 2: on the CPU the rule sees 4 SMs,
    # so elsewhere it gave 1, the same launch as the explicit 1 beside it. The fourth case's 4 splits of its 5 tiles
    # (2 under its window) leave splits empty; the first case's 3 and the third's 5 exceed the tiles.
    cases = [  # (block_size, group, head_dim, kv heads, contexts, block_n, split counts, windows, cache)
        (16, 4, 64, 2, [100, 0, 1, 48, 49, 17], 64, (1, 3), (None, 1, 37), FN),  # Qwen3's GQA 4; 3 > its 2 tiles
        (8, 1, 32, 4, [33, 1, 5, 70], 16, (1, 3), (None, 9), FN),  # GQA 1
        (16, 8, 32, 1, [250, 16, 1, 129], 128, (None, 1, 5), (None, 100), FN),  # GQA 8, tiles of 8 pages
        (32, 4, 32, 2, [70, 0, 31, 33], 16, (1, 4), (None, 20), FNUZ),  # tiles are slices of pages; ROCm's
        (8, 2, 64, 2, [63, 64, 65, 127], 32, (1, 3), (None, 64), FNUZ),
        (8, 4, 32, 1, [129, 3, 64], 128, (1, 2), (None, 50), FN),  # 16 pages a tile
    ]
    for bs, group, d, hkv, ctxs, bn, splits, windows, cache in cases:
        b, kc, vc, ks, vs = _fp8_batch(ctxs, bs, group, d, hkv, cache)
        for window in windows:
            _check(b.q, b, kc, vc, ks, vs, bn, splits, window, (bs, group, d, hkv, ctxs, cache))
    # batch 64 of odd lengths (empty rows among them), one kv head of 4 q heads
    rng = random.Random(3)
    ctxs = [rng.choice([0, 1, 2, 7, 15, 16, 17, 31, 33, 40]) for _ in range(64)]
    b, kc, vc, ks, vs = _fp8_batch(ctxs, 8, 4, 32, 1, seed=4)
    _check(b.q, b, kc, vc, ks, vs, 16, (3,), None, "batch 64")  # split and reduce kernels; one split: the cases above


def _interp_ranges() -> None:
    """Queries past fp16's range (65504): the kernel scales q down by max|q| / 2^15 for the dots and back into the
    score scale, so the result is the reference's (a plain fp16 cast would give inf and NaN)."""
    b, kc, vc, ks, vs = _fp8_batch([100, 1, 48, 17], 16, 4, 64, 2, seed=7)
    q = b.q.clone()
    q[0, 1, 5] = 7.0e4  # one head of sequence 0, over fp16's largest value
    q[2, 4:8] *= 3.0e4  # a whole kv group of sequence 2, scaled up
    q[3, :, 3] = -1.0e5
    assert q.float().abs().max() > 65504
    _check(q, b, kc, vc, ks, vs, 64, (1, 3), None, "large q")
    # small queries stay within fp16's subnormal spacing of the reference
    _check(b.q * 1e-3, b, kc, vc, ks, vs, 32, (2,), None, "small q")


def _interp_prefetch() -> None:
    """The block-table prefetch against the reference: an fp16 cache (the model's dtype, fp16 q) and fp8 caches under
    fp16 dots, tiles of 2-8 pages and half pages, windows, empty rows, more splits than tiles (empty splits load the
    entries past the context, masked), a batch of varied contexts."""
    from rapidserve.attention import triton_paged_decode as tp

    fp16 = DecodeConfig(32, 4, 3, 2, False, True)
    cases = [  # (block_size, group, kv heads, contexts, block_n, (split count, window) pairs)
        (16, 4, 2, [100, 0, 1, 48, 49, 17], 32, ((9, None), (None, 37))),  # 2 pages a tile; 9 splits > 4 tiles
        (32, 2, 1, [70, 31, 33, 1], 16, ((4, 20),)),  # tiles are half pages
    ]
    for bs, group, hkv, ctxs, bn, runs in cases:
        b = make_batch(decode_seqs(ctxs), num_kv_heads=hkv, group=group, head_dim=32, block_size=bs,
                       dtype=torch.float16, decode=True, strided_q=True, seed=bs)
        torch_kv.write_kv(b.k_new, b.v_new, b.k_cache, b.v_cache, b.meta.slot_mapping)
        args = (b.q, b.k_cache, b.v_cache, b.meta.block_tables, b.meta.context_lens, 32**-0.5)
        for n, window in runs:
            got = tp.decode_attention(*args, num_splits=n, window=window, config=fp16._replace(block_n=bn))
            torch.testing.assert_close(got.float(), ref.decode_attention(*args, window=window).float(), atol=4e-3,
                                       rtol=1e-3, msg=lambda m, c=(bs, group, ctxs, bn, n, window): f"{c}: {m}")
    b, kc, vc, ks, vs = _fp8_batch([129, 3, 64, 8], 8, 8, 32, 1, FN, seed=8)  # 8 pages a tile
    _check(b.q, b, kc, vc, ks, vs, 64, (2,), 50, "8 pages", prefetch=True)
    _check(b.q, b, kc, vc, ks, vs, 64, (1,), None, "8 pages", prefetch=True)
    b, kc, vc, ks, vs = _fp8_batch([70, 31, 33, 1], 32, 2, 32, 1, FNUZ, seed=32)  # half pages
    _check(b.q, b, kc, vc, ks, vs, 16, (1,), None, "half pages", prefetch=True)
    rng = random.Random(5)  # a batch of varied contexts, none a multiple of the page
    ctxs = [rng.choice([1, 3, 7, 9, 15, 17, 23, 31, 33, 45]) for _ in range(12)]
    b, kc, vc, ks, vs = _fp8_batch(ctxs, 8, 4, 32, 1, seed=6)
    _check(b.q, b, kc, vc, ks, vs, 16, (3,), None, "varied", prefetch=True)


def _interp_fp8_out() -> None:
    """`decode_attention_fp8` (the output quantized for an fp8 o projection, in the reduce kernel: the last program of
    each sequence quantizes its row) gives `quantize_tokens` of `decode_attention`'s output bit for bit, both
    interpreted (the interpreter's fp8 cast rounds its own way in both), its scales `quantize_input`'s: over an fp16
    cache (8 heads of 32: one quantizing step) and an fp8 one (fp16 dots; 16 heads of 128: 2048 columns, two steps of
    1024), empty rows among them (scale from MIN_AMAX), e4m3fn and e4m3fnuz, split counts 1 (no reduce kernel: the
    separate quantizer) to more than the tiles."""
    from rapidserve.attention import triton_paged_decode as tp
    from rapidserve.ops import fp8 as fp8_ops
    from rapidserve.ops.triton_fp8 import quantize_tokens

    b = make_batch(decode_seqs([100, 0, 1, 48, 49]), num_kv_heads=2, group=4, head_dim=32, block_size=16,
                   dtype=torch.float16, decode=True, strided_q=True, seed=9)
    torch_kv.write_kv(b.k_new, b.v_new, b.k_cache, b.v_cache, b.meta.slot_mapping)
    fp16 = (b.q, b.k_cache, b.v_cache, b.meta.block_tables, b.meta.context_lens, 32**-0.5), {}
    f, kc, vc, ks, vs = _fp8_batch([70, 0, 33], 16, 8, 128, 2, FNUZ, seed=10)
    fp8_cache = (f.q, kc, vc, f.meta.block_tables, f.meta.context_lens, 128**-0.5, ks, vs), {"config": F16_DOTS}
    for (args, kw), fmt, splits in ((fp16, FN, (1, 2, 7)), (fp16, FNUZ, (3,)), (fp8_cache, FN, (1, 2, 6))):
        for n in splits:
            out = tp.decode_attention(*args, num_splits=n, **kw)
            rows = tp.decode_attention_fp8(*args, out_fp8=fmt, num_splits=n, **kw)
            flat = out.view(out.shape[0], -1)
            q8, s8 = quantize_tokens(flat, fmt)
            label = (fmt, n, tuple(out.shape))
            assert rows.dtype == out.dtype and rows.q.dtype == fmt and rows.q.shape == flat.shape, label
            assert torch.equal(rows.scale, s8) and torch.equal(rows.scale, fp8_ops.quantize_input(flat, "token",
                                                                                               fmt)[1]), label
            assert torch.equal(rows.q.view(torch.uint8), q8.view(torch.uint8)), label
    with pytest.raises(ValueError, match="out_fp8 must be float8_e4m3fn"):
        tp.decode_attention_fp8(*fp16[0], out_fp8=torch.bfloat16)


INTERP_CHECKS = {"fp16_dots": _interp_fp16_dots, "ranges": _interp_ranges, "prefetch": _interp_prefetch,
                 "fp8_out": _interp_fp8_out}

# the sweep's corners (bench/decode_attn_tune.py): tiles of 32-128 keys, 2-8 warps, 2-5 stages, both dot types, the
# block-table prefetch with one to three K/V buffers
GPU_CONFIGS = [DecodeConfig(32, 2, 2, 1, True), DecodeConfig(64, 4, 3, 2, False), DecodeConfig(64, 4, 5, 4, True),
               DecodeConfig(64, 8, 3, 8, True), DecodeConfig(128, 4, 3, 3, False), DecodeConfig(128, 8, 5, 6, True),
               DecodeConfig(32, 4, 2, 2, False, True), DecodeConfig(64, 2, 3, 3, True, True),
               DecodeConfig(64, 4, 4, 2, False, True), DecodeConfig(128, 4, 3, 1, True, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("cfg", GPU_CONFIGS, ids=[f"n{c.block_n}w{c.num_warps}s{c.num_stages}" + "pf" * c.prefetch
                                                  for c in GPU_CONFIGS])
def test_gpu_decode_configs(cfg: DecodeConfig, fp8: bool) -> None:
    """Each sweep corner on the GPU against the fp32 reference (the bf16 dots the interpreter cannot check), Qwen3's
    shape, odd contexts; over an fp8 cache also queries past fp16's range."""
    from rapidserve.attention import triton_paged_decode as tp
    from rapidserve.ops.fp8 import fp8_dtype, fp8_supported

    cuda = torch.device("cuda")
    if fp8 and not fp8_supported(cuda):
        pytest.skip("no fp8 on this GPU")
    ctxs = [2048, 1, 0, 17, 999, 64, 4000, 333]
    b = make_batch(decode_seqs(ctxs), num_kv_heads=8, group=4, head_dim=128, block_size=16, dtype=torch.bfloat16,
                   device="cuda", decode=True, strided_q=True, seed=11)
    args = (b.meta.block_tables, b.meta.context_lens, 128**-0.5)
    if fp8:
        kc, vc = (torch.full(b.k_cache.shape, float("nan"), device=cuda).to(fp8_dtype(cuda)) for _ in range(2))
        ks, vs = (t.to(cuda) for t in scales(0.011, 0.017))
        write_all(b, kc, vc, ks, vs)
        sc: tuple[torch.Tensor, ...] = (ks, vs)
        kf, vf = kq.dequantize(kc, ks, torch.float32), kq.dequantize(vc, vs, torch.float32)
    else:
        torch_kv.write_kv(b.k_new, b.v_new, b.k_cache, b.v_cache, b.meta.slot_mapping)
        kc, vc, sc, kf, vf = b.k_cache, b.v_cache, (), b.k_cache.float(), b.v_cache.float()
    queries = [b.q]
    if fp8:
        big = b.q.clone()
        big[0, 1, 5], big[4, 8:12] = 7.0e4, big[4, 8:12] * 3.0e4
        queries.append(big)
    for q in queries:
        want = ref.decode_attention(q.float(), kf, vf, *args)
        for splits in (None, 1, 7):
            got = tp.decode_attention(q, kc, vc, *args, *sc, num_splits=splits, config=cfg)
            torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=1e-2, msg=lambda m, n=splits: f"{n}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("kv_fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_gpu_fp8_output_is_the_quantizers(batch: int, kv_fp8: bool) -> None:
    """`decode_attention_fp8` on the GPU at Qwen3-8B's decode shape (32 heads of 128 over 8 kv heads, contexts up to
    4000, empty rows), the engine's split rule and forced counts (1: the separate quantizer), with and without PDL:
    the bits of `quantize_tokens` of `decode_attention`'s output (the hardware's cast, the real atomics)."""
    from rapidserve.attention import triton_paged_decode as tp
    from rapidserve.ops.fp8 import fp8_dtype, fp8_supported
    from rapidserve.ops.triton_fp8 import quantize_tokens

    cuda = torch.device("cuda")
    if not fp8_supported(cuda):
        pytest.skip("no fp8 on this GPU")
    fmt = fp8_dtype(cuda)
    ctxs = [[2048, 1, 0, 17, 999, 64, 4000, 333][i % 8] for i in range(batch)]
    b = make_batch(decode_seqs(ctxs), num_kv_heads=8, group=4, head_dim=128, block_size=16, dtype=torch.bfloat16,
                   device="cuda", decode=True, strided_q=True, seed=batch)
    args: tuple[Any, ...] = (b.meta.block_tables, b.meta.context_lens, 128**-0.5)
    if kv_fp8:
        kc, vc = (torch.zeros(b.k_cache.shape, device=cuda).to(fmt) for _ in range(2))
        ks, vs = (t.to(cuda) for t in scales(0.011, 0.017))
        write_all(b, kc, vc, ks, vs)
        args = (b.q, kc, vc, *args, ks, vs)
    else:
        torch_kv.write_kv(b.k_new, b.v_new, b.k_cache, b.v_cache, b.meta.slot_mapping)
        args = (b.q, b.k_cache, b.v_cache, *args)
    for splits in (None, 1, 7):
        for pdl in (None, False):
            out = tp.decode_attention(*args, num_splits=splits, pdl=pdl)
            rows = tp.decode_attention_fp8(*args, out_fp8=fmt, num_splits=splits, pdl=pdl)
            q8, s8 = quantize_tokens(out.view(batch, -1), fmt)
            assert torch.equal(rows.scale, s8), (splits, pdl)
            assert torch.equal(rows.q.view(torch.uint8), q8.view(torch.uint8)), (splits, pdl)


@pytest.fixture(scope="module")
def interpreter(request: pytest.FixtureRequest) -> dict[str, str]:
    """The session's interpreter checks of this module, in one subprocess (tests/triton_interp.py)."""
    return interpreted_checks(__file__, selected(request, "check"))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("check", sorted(INTERP_CHECKS))
def test_triton_interpreter(interpreter: dict[str, str], check: str) -> None:
    """The decode kernel's fp16-dot path and the block-table prefetch under TRITON_INTERPRET=1, against the torch
    reference."""
    assert interpreter[check] == "", interpreter[check]


if __name__ == "__main__":
    sys.exit(run_checks(INTERP_CHECKS, sys.argv[1:]))
