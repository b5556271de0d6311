"""The fp8 GPU paths (issue 39) against the CPU-checked reference, on a GPU that multiplies fp8 (NVIDIA sm_89+,
AMD gfx94x; skipped elsewhere, and everywhere without a GPU): `torch._scaled_mm` with row-wise scales, decode's
skinny fp8 kernel (1-64 rows, where `triton_fp8_skinny.plan` routes, and each tile family), the Triton block-scale
GEMM at small and Qwen3-8B sizes, and FP8 checkpoints end to end through `LLM` (bf16, CUDA graphs)
against the same checkpoints on the CPU reference path. Not run on the CPU machines: the lead's GPU runs."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from fp8_folders import SCHEMES, float_folder, fp8_folder

from rapidserve import LLM, SamplingParams
from rapidserve.ops import fp8, fp8_gpu

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and fp8.fp8_supported(CUDA)


needs_fp8 = pytest.mark.skipif(not _fp8_gpu(), reason="no GPU that multiplies fp8 (sm_89+, gfx94x)")


def _layer(n: int, k: int, acts: str, block: tuple[int, int] | None) -> fp8.Fp8Linear:
    dt = fp8.fp8_dtype(CUDA)
    layer = fp8.Fp8Linear(n, k, dt, acts, block, CUDA)
    w = torch.randn(n, k, device=CUDA) / k**0.5
    w8, s = fp8.quantize_weight(w, "block" if block else "channel", block, dt)
    layer.weight.copy_(w8)
    layer.weight_scale.copy_(s)
    if layer.input_scale is not None:
        layer.input_scale.fill_(4.0 / fp8.fp8_max(dt))
    return layer


@needs_fp8
@pytest.mark.parametrize("acts", ["token", "tensor", "static"])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 4096, 4096), (16, 6144, 4096), (300, 4096, 12288), (4096, 4096, 4096)])
def test_scaled_mm_matches_the_reference(acts: str, m: int, n: int, k: int) -> None:
    torch.manual_seed(m)
    layer = _layer(n, k, acts, None)
    x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16)
    got = fp8_gpu.gpu_linear(x, layer)
    want = fp8.reference_linear(x.float(), layer)  # the same fp8 inputs, float32 products
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=1.6e-2, atol=1e-2 * float(want.abs().max()))


@needs_fp8
@pytest.mark.parametrize(("m", "k"), [(1, 4096), (16, 4096), (300, 12288), (4096, 4096), (3, 100)])
def test_token_quantizer_equals_torch_bit_for_bit(m: int, k: int) -> None:
    """`triton_fp8.quantize_tokens` (IEEE division, the hardware's round-to-nearest-even cast) gives torch's bits."""
    from rapidserve.ops import triton_fp8

    torch.manual_seed(m)
    dt = fp8.fp8_dtype(CUDA)
    x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16) * 3
    x[0, :3] = torch.tensor([125.4, -136.0, 0.0], dtype=torch.bfloat16)  # the row amax, a large value, a zero
    q, s = triton_fp8.quantize_tokens(x, dt)
    wq, ws = fp8.quantize_input(x, "token", dt)
    assert torch.equal(s, ws), (s - ws).abs().max()
    bad = q.view(torch.uint8) != wq.view(torch.uint8)
    y = (x.float() / ws)[bad]
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} differ: x / s {y[:6].tolist()}, ours "
                           f"{q[bad][:6].float().tolist()}, torch {wq[bad][:6].float().tolist()}")


@needs_fp8
@pytest.mark.skipif(torch.version.hip is not None, reason="the skinny kernels serve NVIDIA only (not measured on ROCm)")
@pytest.mark.parametrize(("m", "n", "k"), [(1, 6144, 4096), (16, 4096, 12288), (5, 24576, 4096), (17, 6144, 4096),
                                           (40, 4096, 12288), (64, 24576, 4096)])
def test_decode_rows_take_the_kernel_the_plan_gives(m: int, n: int, k: int) -> None:
    """`gpu_linear` sends 1-64 rows of a wide fp8 weight to `skinny_fp8_linear` exactly where
    `triton_fp8_skinny.plan` gives tiles (the untuned rule: 1-16 rows; a packaged table of this GPU: what it says),
    else to torch._scaled_mm; either way the reference's numbers up to float32 sum order and the bf16 output's
    rounding; with a bias too."""
    from rapidserve.ops import triton_fp8_skinny as fsk

    torch.manual_seed(m)
    layer = _layer(n, k, "token", None)
    x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16)
    planned = fsk.plan(m, n, k, fsk.device_name(CUDA), fsk.TUNED)
    assert fsk.routed(x, layer.weight, layer.weight_scale) == (planned is not None)
    if not fsk.TUNED.get(fsk.device_name(CUDA)):  # the rule alone: 1-16 rows here
        assert (planned is not None) == (m <= fsk.RULE_ROWS)
    want = fp8.reference_linear(x.float(), layer)
    tol = (2e-3 if planned is not None else 1e-2) * float(want.abs().max())  # cuBLASLt: fast accumulation
    got = fp8_gpu.gpu_linear(x, layer)
    torch.testing.assert_close(got.float(), want, rtol=1.6e-2, atol=tol)
    b = torch.randn(n, device=CUDA, dtype=torch.bfloat16)
    torch.testing.assert_close(fp8_gpu.gpu_linear(x, layer, b).float(), want + b.float(), rtol=1.6e-2, atol=2 * tol)


@needs_fp8
@pytest.mark.skipif(torch.version.hip is not None, reason="the skinny kernels serve NVIDIA only (not measured on ROCm)")
@pytest.mark.parametrize("m", [1, 16, 33, 64])  # the JIT's three specialisations of M (1, % 16, other)
@pytest.mark.parametrize(("n", "k"), [(4096, 12288), (200, 304)])
def test_every_tile_family_gives_the_reference(m: int, n: int, k: int) -> None:
    """The skinny fp8 kernel on each family of tiles bench/fp8_sweep.py times, at 1-64 rows: a 16-row tile
    (mma.sync, fp8 widened to fp16), a 64-row tile (wgmma, x8 @ w8^T), the swapped order on the smallest row tile
    (wgmma, w8 @ x8^T; 4 and 8 warps), and each cut into K slices (split-K: the split kernel, then the reduce
    kernel), which give the same bits when run again; N and K tails (200 x 304); with a bias: the reference's
    numbers."""
    from rapidserve.ops import triton_fp8_skinny as fsk
    from rapidserve.ops.fp8_tiles import Fp8Tiles

    torch.manual_seed(m + n)
    layer = _layer(n, k, "token", None)
    x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16)
    b = torch.randn(n, device=CUDA, dtype=torch.bfloat16)
    want = fp8.reference_linear(x.float(), layer)
    bm = next(t for t in (16, 32, 64) if m <= t)
    families = [fsk.rule_tiles(m, n, k), Fp8Tiles(64, 16, 256, 4, 3), Fp8Tiles(64, 32, 512, 4, 3),
                Fp8Tiles(bm, 64, 256, 4, 4, True), Fp8Tiles(bm, 128, 128, 8, 3, True)]
    families += [fsk.rule_tiles(m, n, k)._replace(split_k=3), Fp8Tiles(64, 32, 256, 4, 3, False, 8),
                 Fp8Tiles(bm, 64, 256, 4, 3, True, 4), Fp8Tiles(bm, 128, 128, 4, 4, True, 2)]
    for tiles in families:
        got = fsk.skinny_fp8_linear(x, layer.weight, layer.weight_scale, config=tiles)
        torch.testing.assert_close(got.float(), want, rtol=1.6e-2, atol=2e-3 * float(want.abs().max()),
                                   msg=lambda e, t=tiles: f"{t.label()}: {e}")
        if tiles.split_k > 1:  # the reduce adds the slices in a fixed order: deterministic
            assert torch.equal(fsk.skinny_fp8_linear(x, layer.weight, layer.weight_scale, config=tiles), got)
        got = fsk.skinny_fp8_linear(x, layer.weight, layer.weight_scale, b, config=tiles)
        torch.testing.assert_close(got.float(), want + b.float(), rtol=1.6e-2, atol=4e-3 * float(want.abs().max()),
                                   msg=lambda e, t=tiles: f"{t.label()} + bias: {e}")


@needs_fp8
@pytest.mark.parametrize(("m", "n", "k"), [(1, 4096, 4096), (7, 6144, 4096), (64, 24576, 4096), (333, 4096, 12288),
                                           (4096, 4096, 4096), (5, 200, 300)])
def test_block_kernel_matches_the_reference(m: int, n: int, k: int) -> None:
    torch.manual_seed(m)
    layer = _layer(n, k, "group", (128, 128))
    x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16)
    got = fp8_gpu.gpu_linear(x, layer)
    want = fp8.reference_linear(x.float(), layer)
    torch.testing.assert_close(got.float(), want, rtol=1.6e-2, atol=1e-2 * float(want.abs().max()))


@needs_fp8
@pytest.mark.parametrize("scheme", ["ct-tensor-static", "ct-channel-token", "ct-block", "hf-block"])
def test_fp8_checkpoint_on_the_gpu_matches_the_cpu_reference(scheme: str, tmp_path: Path) -> None:
    """bf16 compute with CUDA graphs (decode) against float32 on the CPU reference path: the first generated
    token's logprobs agree within bf16 rounding, and greedy tokens agree until a near-tie of the CPU run."""
    arch = SCHEMES[scheme][3]
    folder = str(fp8_folder(float_folder(tmp_path / "float", arch), tmp_path / scheme, scheme))
    prompts = [[(7 * i + 3) % 500 + 3 for i in range(n)] for n in (5, 17, 33, 120)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    # a small pool of its own: the earlier cases' engines may still hold memory in this process
    gpu = LLM(folder, device="cuda", dtype="bfloat16", show_progress=False, num_kv_blocks=64)
    try:
        cpu = LLM(folder, device="cpu", dtype="float32", show_progress=False)
        assert gpu.engine.runner.ops.fp8_linear is fp8_gpu.gpu_linear
        for g, c in zip(gpu.generate(prompts, params, use_tqdm=False), cpu.generate(prompts, params, use_tqdm=False),
                        strict=True):
            got, want = g.outputs[0], c.outputs[0]
            assert want.top_logprobs is not None and got.logprobs is not None and want.logprobs is not None
            i = next((j for j, (a, b) in enumerate(zip(got.token_ids, want.token_ids, strict=True)) if a != b), None)
            if i is not None:
                (_, first), (runner_up, second) = want.top_logprobs[i][:2]
                assert first - second < 0.2 and got.token_ids[i] == runner_up, (i, want.top_logprobs[i])
            if i != 0:  # the same first token: its logprob within bf16 rounding, plus the activations' fp8
                # rounding, which bf16 and fp32 inputs can take to neighbouring e4m3 values (block scales on the H200:
                # 0.051 nats, 2026-11-29)
                assert abs(got.chosen_logprobs()[0] - want.chosen_logprobs()[0]) < 0.1
    finally:
        del gpu
        gc.collect()
        torch.cuda.empty_cache()
