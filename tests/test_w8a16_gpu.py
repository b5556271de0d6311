"""W8A16 decode GEMMs (issue 39, ops/triton_w8a16.py) on an NVIDIA GPU with fp8 (sm_89+), the path forced whatever
the packaged table says (it is empty until a GPU measures it):

- the kernel against `fp8.reference_linear_half` at Qwen3-8B's shapes, 1 / 16 / 64 rows, on each tile family it takes
  (16- and 32-row mma.sync tiles, swapped tiles on wgmma f16 with split-K and without, the plan's under a forced
  table), bf16 rows (cast in the kernel) and fp16 rows, a value past 65504 (saturated, finite), a bias; the gated
  gate|up launch equal to silu_and_mul of the ungated one, as fp16 rows; the RMSNorms and the decode attention that
  write fp16 rows equal the plain ones saturated, bit for bit, and the GEMM of them its GEMM of the plain rows;
- a 2-layer Qwen3-8B-shaped model (the preset's random weights, in bf16 and quantized at load) in decode graphs at
  batch 1 and 16: W8A16 (`with_w8a16(ops, w8a16_table.forced(gpu))`) launches no quantizer (no fp8 norm, SiLU-and-mul,
  per-token quantizer or folded norm in the step's kernels, nor a separate SiLU-and-mul) and its logits are nearer the
  bf16 model's than W8A8's, within the fp8 bounds.
Skipped without such a GPU, and on ROCm (W8A16 is NVIDIA's); the CPU checks: tests/test_w8a16.py,
tests/test_w8a16_model.py. Not run on the CPU machines: the lead's GPU runs."""

from __future__ import annotations

import pytest
import torch

from rapidserve.ops import fp8

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
REL_BF16 = 0.06  # tests/test_fp8_checkpoints.py's fp8-vs-bf16 bound (relative L2 of the logits)
QUANTIZERS = ("_rms_norm_fp8_kernel", "_silu_and_mul_fp8_kernel", "_quantize_tokens_kernel",
              "_sums_rms_norm_fp8_kernel", "_silu_and_mul_kernel")


def _nvidia_fp8() -> bool:
    return torch.cuda.is_available() and torch.version.hip is None and fp8.fp8_supported(CUDA)


needs_nvidia_fp8 = pytest.mark.skipif(not _nvidia_fp8(), reason="W8A16 runs on NVIDIA GPUs with fp8 (sm_89+)")


def _layer(n: int, k: int, seed: int) -> fp8.Fp8Linear:
    torch.manual_seed(seed)
    layer = fp8.Fp8Linear(n, k, torch.float8_e4m3fn, "token", None, CUDA)
    w8, s = fp8.quantize_weight(torch.randn(n, k, device=CUDA) / k**0.5, "channel", None, torch.float8_e4m3fn)
    layer.weight.copy_(w8)
    layer.weight_scale.copy_(s)
    return layer


def _close(got: torch.Tensor, want: torch.Tensor, bias: torch.Tensor | None, label: object) -> None:
    """One rounding of differently ordered float32 sums apart, at the magnitude of each value rounded (the product
    before the bias too): tests/test_w8a16.py's bound, plus a float32 summation slack over K."""
    eps = torch.finfo(got.dtype).eps
    scale = want.float().abs().clamp(min=1.0)
    if bias is not None:
        scale = scale + (want.float() - bias.float()).abs()
    err = float(((got.float() - want.float()).abs() / (scale * eps)).max())
    assert err <= 2.0, (label, err)


@needs_nvidia_fp8
@pytest.mark.parametrize(("m", "n", "k"), [(1, 6144, 4096), (1, 4096, 12288), (16, 4096, 4096), (64, 24576, 4096),
                                           (3, 4096, 12288)])
def test_every_tile_family_gives_the_reference(m: int, n: int, k: int) -> None:
    from rapidserve.ops import triton_w8a16
    from rapidserve.ops.fp8_tiles import Fp8Tiles
    from rapidserve.ops.triton_fp8_skinny import device_name
    from rapidserve.ops.w8a16_table import forced

    layer = _layer(n, k, seed=m)
    bm = next(t for t in (16, 32, 64) if m <= t)
    families = [Fp8Tiles(bm, 64, 256, 4, 4, True), Fp8Tiles(bm, 64, 128, 4, 4, True, 4)]
    if bm < 64:
        families += [Fp8Tiles(bm, 64, 512, 4, 4, False), Fp8Tiles(bm, 32, 256, 4, 3, False, 4)]
    planned = triton_w8a16.planned(m, layer.weight, forced(device_name(CUDA)))
    families += [planned] if planned is not None else []
    torch.manual_seed(k)
    b = torch.randn(n, device=CUDA, dtype=torch.bfloat16)
    for dt in (torch.bfloat16, torch.float16):
        x = (torch.randn(m, k, device=CUDA) * 3).to(dt)
        x[0, 0] = 1e5 if dt == torch.bfloat16 else 65504  # saturated at fp16's max, not inf
        for tiles in families:
            for bias in (None, b.to(dt)):
                got = triton_w8a16.w8a16_linear(x, layer.weight, layer.weight_scale, bias, config=tiles)
                assert got.dtype == dt and torch.isfinite(got).all(), tiles.label()
                _close(got, fp8.reference_linear_half(x, layer, bias), bias, (m, n, k, dt, tiles.label()))


@needs_nvidia_fp8
@pytest.mark.parametrize("m", [1, 16])
def test_the_gated_launch_is_silu_and_mul_of_the_ungated_one(m: int) -> None:
    """Qwen3-8B's gate|up [24576, 4096]: SiLU-and-mul in the epilogue equals silu_and_mul of the ungated launch's
    output on the same one-pass tiles (the same sums, the same epilogue)."""
    from rapidserve.ops import triton_ops, triton_w8a16
    from rapidserve.ops.fp8_tiles import Fp8Tiles

    layer = _layer(24576, 4096, seed=7)
    x = torch.randn(m, 4096, device=CUDA, dtype=torch.bfloat16)
    for tiles in (Fp8Tiles(16, 64, 256, 4, 3, True), Fp8Tiles(16, 64, 512, 4, 2, False)):  # a16_smem_bytes fit
        got = triton_w8a16.w8a16_linear_silu_and_mul(x, layer.weight, layer.weight_scale, config=tiles)
        whole = triton_w8a16.w8a16_linear(x, layer.weight, layer.weight_scale, config=tiles)
        want = fp8.to_half(triton_ops.silu_and_mul(whole))
        assert isinstance(got, fp8.HalfRows) and got.dtype == torch.bfloat16 and got.x.shape == (m, 12288)
        assert torch.equal(got.x, want), (tiles.label(), (got.x.float() - want.float()).abs().max())


@needs_nvidia_fp8
@pytest.mark.parametrize(("m", "k"), [(1, 4096), (16, 4096), (64, 5120)])
def test_the_norms_write_the_plain_norms_rows_in_fp16(m: int, k: int) -> None:
    """`rms_norm_half` / `add_rms_norm_half` (the plain RMSNorm's launch with a float16 output) equal `fp8.half_rows`
    of the plain launches bit for bit (values past 65504 saturated), and the W8A16 GEMM of those rows equals its GEMM
    of the plain bf16 rows (cast in the kernel) bit for bit."""
    from rapidserve.ops import triton_ops, triton_w8a16
    from rapidserve.ops.fp8_tiles import Fp8Tiles

    torch.manual_seed(m)
    x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16)
    r = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(k, device=CUDA)).to(torch.bfloat16)
    w[:4] = 40000.0
    got = triton_w8a16.rms_norm_half(x, w, 1e-6)
    plain = triton_ops.rms_norm(x, w, 1e-6)
    assert torch.equal(got.x, fp8.to_half(plain)) and float(got.x.float().abs().max()) == 65504
    (rows, res), (plain2, res2) = triton_w8a16.add_rms_norm_half(x, r, w, 1e-6), triton_ops.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(rows.x, fp8.to_half(plain2)) and torch.equal(res, res2)
    layer = _layer(4096, k, seed=1)
    # a swapped tile (W8A16 takes no unswapped 64-row tile, the untuned rule's at 64 rows and K 5120)
    tiles = Fp8Tiles(next(t for t in (16, 32, 64) if m <= t), 64, 256, 4, 4, True)
    assert torch.equal(triton_w8a16.w8a16_linear(rows, layer.weight, layer.weight_scale, config=tiles),
                       triton_w8a16.w8a16_linear(plain2, layer.weight, layer.weight_scale, config=tiles))


@needs_nvidia_fp8
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_the_decode_attention_writes_the_fp16_rows(batch: int) -> None:
    """Qwen3-8B's heads (32 of 128, 8 kv heads), 2048-token contexts: `decode_attention_fp8(out_fp8=float16)` gives
    `fp8.half_rows` of `decode_attention`'s output bit for bit where the reduce kernel writes them (2 and 8 splits),
    and the float output itself with one split."""
    from rapidserve.attention import triton_paged_decode as tp

    torch.manual_seed(batch)
    blocks, bs = 2048 // 16, 16
    kc = torch.randn(batch * blocks, 8, bs, 128, device=CUDA, dtype=torch.bfloat16)
    vc = torch.randn_like(kc) * 100
    q = torch.randn(batch, 32, 128, device=CUDA, dtype=torch.bfloat16)
    tables = torch.arange(batch * blocks, device=CUDA, dtype=torch.int32).reshape(batch, blocks)
    ctx = torch.full((batch,), 2047, device=CUDA, dtype=torch.int32)
    for n in (1, 2, 8):
        out = tp.decode_attention(q, kc, vc, tables, ctx, 128**-0.5, num_splits=n)
        got = tp.decode_attention_fp8(q, kc, vc, tables, ctx, 128**-0.5, out_fp8=torch.float16, num_splits=n)
        flat = out.view(batch, -1)
        if n == 1:
            assert isinstance(got, torch.Tensor) and torch.equal(got, flat)
        else:
            assert isinstance(got, fp8.HalfRows) and torch.equal(got.x, fp8.to_half(flat)), n


def _runner(quantization: object, batch: int, layers: int = 2, ctx: int = 256) -> object:
    """A `layers`-layer Qwen3-8B-shaped runner (the preset's random weights, bf16), graphs at `batch`, quantized at
    load with `quantization` (None: bf16), its KV pool random (seeded)."""
    from preset_runners import preset_runner

    runner = preset_runner("qwen3-8b", layers, ctx=ctx, graph_batches=(batch,), max_num_seqs=16,
                           max_num_batched_tokens=4096, quantization=quantization)  # type: ignore[arg-type]
    torch.manual_seed(batch)
    for layer in range(runner.kv_pool.tensor.shape[0]):
        runner.kv_pool.tensor[layer].normal_()
    return runner


def _step_kernels(fn: object) -> set[str]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()  # type: ignore[operator]
        torch.cuda.synchronize()
    return {ev.name for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA}


@needs_nvidia_fp8
@pytest.mark.parametrize("batch", [1, 16])
def test_a_w8a16_decode_step_is_nearer_bf16_than_w8a8(batch: int) -> None:
    from typing import Any

    from rapidserve.ops import with_w8a16
    from rapidserve.ops.w8a16_table import forced
    from rapidserve.quant_config import ONLINE_FP8
    from rapidserve.runner import DecodeItem

    ctx = 256
    r8: Any = _runner(ONLINE_FP8, batch, ctx=ctx)
    base = r8.model.ops
    r8.capture_decode_graphs(key="w8a8", show_progress=False)
    r8.model.ops = with_w8a16(base, forced(torch.cuda.get_device_name(CUDA)))
    assert r8.model.ops.name.endswith("-w8a16")
    r8.capture_decode_graphs(key="w8a16", show_progress=False)
    r8.model.ops = base
    per = ctx // r8.block_size
    items = [DecodeItem(5 + i, ctx - 1, [(i * per + j) % r8.kv_pool.num_blocks for j in range(per)])
             for i in range(batch)]
    w8a8 = r8.decode(items, graph_key="w8a8").float().clone()
    w8a16 = r8.decode(items, graph_key="w8a16").float().clone()  # rewrites the same slots with its own K/V
    graph = r8.decode_graph(batch, "w8a16")
    assert graph is not None
    names = _step_kernels(graph.replay)
    assert any("_fp8_skinny_kernel" in k for k in names), names
    assert not any(q in k for q in QUANTIZERS for k in names), sorted(names)  # no quantizer in the step
    del r8
    torch.cuda.empty_cache()
    rb: Any = _runner(None, batch, ctx=ctx)
    rb.capture_decode_graphs(key="bf16", show_progress=False)
    want = rb.decode(items, graph_key="bf16").float()
    rel = {name: float((got - want).norm() / want.norm()) for name, got in (("w8a8", w8a8), ("w8a16", w8a16))}
    assert torch.isfinite(w8a16).all() and rel["w8a16"] <= REL_BF16, rel
    assert rel["w8a16"] < rel["w8a8"], rel
