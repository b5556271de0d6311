"""The fused producers of per-token fp8 rows (issue 39, ops/triton_fp8_fused.py) on a GPU that multiplies fp8: bit
for bit the unfused path (the op's Triton kernel, then `triton_fp8.quantize_tokens`, whose bits test_fp8_gpu checks
against torch), at Qwen3-8B / Llama-8B row widths, one program a row or rows cut into slices; the GEMM of the fused
rows (`fp8_gpu.gpu_linear_rows`) gives `gpu_linear`'s output exactly on both of its paths (the skinny kernel where
`triton_fp8_skinny.plan` routes, `torch._scaled_mm` elsewhere) and on each tile family of the skinny kernel; and an
fp8 model gives the same logits fused and unfused, in prefill and in captured decode graphs, and a 2-layer
Qwen3-8B-shaped one the same logits with split-K reduces folded into the norms (ops/fold_table.py) and without.
Skipped without such a GPU (the CPU checks: test_fp8_fused.py, test_fp8_fold.py); the lead's GPU runs."""

from __future__ import annotations

import inspect

import pytest
import torch

from rapidserve.ops import fp8, fp8_gpu

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and fp8.fp8_supported(CUDA)


needs_fp8 = pytest.mark.skipif(not _fp8_gpu(), reason="no GPU that multiplies fp8 (sm_89+, gfx94x)")


def _rows(m: int, k: int, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16) * 3
    x[0, :3] = torch.tensor([125.4, -136.0, 0.0], dtype=torch.bfloat16)  # a large value, rounding near a binade
    if m > 2:
        x[1] = 0  # an all-zero row: MIN_AMAX
    return x


def _same(got: fp8.QuantizedRows, want: tuple[torch.Tensor, torch.Tensor], label: object) -> None:
    q, s = want
    assert torch.equal(got.scale, s), (label, (got.scale - s).abs().max())
    bad = got.q.view(torch.uint8) != q.view(torch.uint8)
    assert not bad.any(), (label, f"{int(bad.sum())} of {bad.numel()} differ")


@needs_fp8
@pytest.mark.parametrize("width", [None, 1024, 2048, 1 << 30])
@pytest.mark.parametrize(("m", "k"), [(1, 4096), (16, 4096), (64, 5120), (300, 8192), (3, 100)])
def test_fused_norms_equal_the_unfused_kernels_bit_for_bit(m: int, k: int, width: int | None) -> None:
    """The rule's slices of a row (`slice_width` None), given slices (the last one partial for 5120) and one program a
    row: the same bits."""
    from rapidserve.ops import triton_fp8, triton_fp8_fused, triton_ops

    dt = fp8.fp8_dtype(CUDA)
    x, r = _rows(m, k, m), _rows(m, k, m + 1)
    w = (1 + 0.1 * torch.randn(k, device=CUDA)).to(torch.bfloat16)
    y = triton_ops.rms_norm(x, w, 1e-6)
    label = (m, k, width)
    rows = triton_fp8_fused.rms_norm_fp8(x, w, 1e-6, dt, width)
    _same(rows, triton_fp8.quantize_tokens(y, dt), ("rms", label))
    _same(rows, fp8.quantize_input(y, "token", dt), ("rms/torch", label))
    y, res = triton_ops.add_rms_norm(x, r, w, 1e-6)
    rows, got_res = triton_fp8_fused.add_rms_norm_fp8(x, r, w, 1e-6, dt, width)
    assert torch.equal(got_res, res), label
    _same(rows, triton_fp8.quantize_tokens(y, dt), ("add_rms", label))


@needs_fp8
@pytest.mark.parametrize(("m", "inter"), [(1, 12288), (16, 14336), (64, 12288), (5, 25600), (3, 100)])
def test_fused_silu_and_mul_equals_the_unfused_kernels_bit_for_bit(m: int, inter: int) -> None:
    """Rows held in registers (I <= ONE_PASS_COLS), the two-pass loop (wider, or forced), the rule's slices and given
    ones (one step or several a slice, the last one partial)."""
    from rapidserve.ops import triton_fp8, triton_fp8_fused, triton_ops

    dt = fp8.fp8_dtype(CUDA)
    x = _rows(m, 2 * inter, m)
    want = triton_fp8.quantize_tokens(triton_ops.silu_and_mul(x), dt)
    for one_pass, width in ((triton_fp8_fused.ONE_PASS_COLS, None), (16, 1 << 30), (triton_fp8_fused.ONE_PASS_COLS,
                                                                                    1 << 30), (16, 1024), (16, 8192)):
        _same(triton_fp8_fused.silu_and_mul_fp8(x, dt, one_pass, width), want, ("silu", m, inter, one_pass, width))


@needs_fp8
@pytest.mark.parametrize(("m", "n", "k"), [(1, 6144, 4096), (16, 4096, 12288), (40, 6144, 4096), (64, 24576, 4096),
                                           (300, 4096, 4096), (5, 200, 304)])
def test_the_gemm_of_fused_rows_is_gpu_linears(m: int, n: int, k: int) -> None:
    """`gpu_linear_rows(quantized x)` takes `gpu_linear(x)`'s kernel on the same fp8 rows: the same output."""
    from rapidserve.ops import triton_fp8_skinny

    torch.manual_seed(n)
    dt = fp8.fp8_dtype(CUDA)
    layer = fp8.Fp8Linear(n, k, dt, "token", None, CUDA)
    w8, s = fp8.quantize_weight(torch.randn(n, k, device=CUDA) / k**0.5, "channel", None, dt)
    layer.weight.copy_(w8)
    layer.weight_scale.copy_(s)
    x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16)
    rows = fp8.QuantizedRows(*fp8.quantize_input(x, "token", dt), x.dtype)
    skinny = torch.version.hip is None and triton_fp8_skinny.routed(x, layer.weight, layer.weight_scale)
    assert triton_fp8_skinny.routed_rows(rows, layer.weight, layer.weight_scale) == skinny
    b = torch.randn(n, device=CUDA, dtype=torch.bfloat16)
    for bias in (None, b):
        got = fp8_gpu.gpu_linear_rows(rows, layer, bias)
        assert got.dtype == torch.bfloat16 and torch.equal(got, fp8_gpu.gpu_linear(x, layer, bias)), (m, skinny)
    if torch.version.hip is None and m <= 64:  # each tile family (16/64-row tiles, both orders, split-K): the same
        from rapidserve.ops.fp8_tiles import Fp8Tiles

        bm = next(t for t in (16, 32, 64) if m <= t)
        for tiles in (triton_fp8_skinny.rule_tiles(m, n, k), Fp8Tiles(64, 32, 256, 4, 3),
                      Fp8Tiles(bm, 64, 256, 4, 4, True), Fp8Tiles(bm, 64, 256, 4, 3, True, 4)):
            got = triton_fp8_skinny.skinny_fp8_linear_rows(rows, layer.weight, layer.weight_scale, b, config=tiles)
            want = triton_fp8_skinny.skinny_fp8_linear(x, layer.weight, layer.weight_scale, b, config=tiles)
            assert torch.equal(got, want), (m, tiles.label())


@needs_fp8
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_an_fp8_model_gives_the_same_logits_fused_and_unfused_in_graphs(preset: str) -> None:
    """`--quantization fp8` (per-token activations): the engine's bundle fuses; prefill logits and the logits of a
    decode step replayed from captured graphs equal those of the same model with the fusion off."""
    from rapidserve.config_builder import build_engine_config
    from rapidserve.ops import triton_fp8_fused, unfused_fp8
    from rapidserve.runner import DecodeItem, ModelRunner, PrefillItem

    cfg, source = build_engine_config(f"preset:{preset}", device="cuda", dtype="bfloat16", quantization="fp8",
                                      num_kv_blocks=64)
    runner = ModelRunner(cfg, source, show_progress=False)
    base = runner.model.ops  # the engine's bundle, its launchers bound (PDL off outside decode steps: ops/pdl.py)
    assert base.fuse_fp8 and inspect.unwrap(base.rms_norm_fp8) is triton_fp8_fused.rms_norm_fp8
    prompts = [[(7 * i + 3) % 500 + 3 for i in range(21)], [(5 * i + 1) % 400 + 3 for i in range(9)]]
    items = [PrefillItem(prompts[0], 0, [0, 1]), PrefillItem(prompts[1], 0, [2])]
    fused = runner.prefill(items)
    runner.model.ops = unfused_fp8(base)
    unfused = runner.prefill(items)  # rewrites the same K/V (the same bits)
    runner.capture_decode_graphs(key="unfused", show_progress=False)
    runner.model.ops = base
    runner.capture_decode_graphs(key="fused", show_progress=False)
    assert torch.equal(fused, unfused)
    steps = [DecodeItem(11, 21, [0, 1]), DecodeItem(13, 9, [2])]
    got = runner.decode(steps, graph_key="fused").clone()  # the keys share one logits buffer
    want = runner.decode(steps, graph_key="unfused")
    assert runner.decode_graph(2, "fused") is not None and runner.decode_graph(2, "unfused") is not None
    assert torch.equal(got, want)


@needs_fp8
@pytest.mark.parametrize("batch", [1, 16])
def test_split_k_folded_into_the_norms_gives_the_unfolded_logits(batch: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 2-layer Qwen3-8B-shaped fp8 runner (the preset's random weights quantized at load): decode graphs with the
    split-K reduces of o_proj and down_proj folded into the norms after them (ops/fold_table.py; the engine's
    bundle) give the logits of graphs with the fold off (`no_split_fold`: the reduce kernel, then the norm) bit for
    bit, at batch 1 and 16. The tiles of o_proj and down_proj (N = hidden) split K in 4 wherever this GPU's plan
    would not (an H200's table splits them at these batches; another GPU's untuned rule never does), so the fold is
    exercised on any GPU; both graph sets take the same tiles."""
    import dataclasses
    from collections.abc import Iterator

    from rapidserve.config import CacheConfig, EngineConfig, RunnerConfig, SchedulerConfig
    from rapidserve.loader import ModelSource, expected_tensor_shapes
    from rapidserve.loader.preset_table import preset_table
    from rapidserve.loader.presets import preset_tensor
    from rapidserve.ops import fold_table, no_split_fold, triton_fp8_skinny
    from rapidserve.quant_config import ONLINE_FP8
    from rapidserve.runner import DecodeItem, ModelRunner

    if torch.version.hip is not None:
        pytest.skip("ROCm's fp8 GEMMs never split K: nothing to fold")
    assert fold_table.fold_for_step(batch, torch.cuda.get_device_name(CUDA))  # the gate folds at both batches
    layers, ctx = 2, 256
    mcfg = dataclasses.replace(preset_table()["qwen3-8b"], num_layers=layers)
    shapes = expected_tensor_shapes(mcfg)

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for name, shape in shapes.items():
            yield name, preset_tensor("qwen3-8b", mcfg, name, shape, device=CUDA, dtype=torch.bfloat16)

    planned = triton_fp8_skinny._planned

    def split_hidden(rows: int, weight: torch.Tensor, tables: object) -> object:
        tiles = planned(rows, weight, tables)  # type: ignore[arg-type]
        if tiles is None or tiles.split_k > 1 or weight.shape[0] != mcfg.hidden_size:
            return tiles
        return tiles._replace(split_k=4)

    monkeypatch.setattr(triton_fp8_skinny, "_planned", split_hidden)
    source = ModelSource(mcfg, weights, len(shapes), None, None, None, f"qwen3-8b ({layers} layers)")
    cfg = EngineConfig(model="qwen3-8b", model_config=mcfg, cache=CacheConfig(num_blocks=1024),
                       scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=4096, max_model_len=ctx),
                       runner=RunnerConfig(device="cuda", dtype="bfloat16", graph_batch_sizes=(batch,)))
    runner = ModelRunner(dataclasses.replace(cfg, quantization=ONLINE_FP8), source, show_progress=False)
    torch.manual_seed(batch)
    for layer in range(runner.kv_pool.tensor.shape[0]):  # contexts of random K/V
        runner.kv_pool.tensor[layer].normal_()
    base = runner.model.ops
    assert base.fold_split_k
    sums_seen: list[bool] = []
    linear_sums = base.fp8_linear_sums

    def seen(rows: fp8.QuantizedRows, layer: fp8.Fp8Linear, bias: torch.Tensor | None = None,
             pdl: bool | None = None, prefetch: int | None = None) -> object:  # bound per step as the GEMM's
        out = linear_sums(rows, layer, bias, pdl=pdl, prefetch=prefetch)
        sums_seen.append(isinstance(out, fp8.SplitSums))
        return out

    runner.model.ops = dataclasses.replace(base, fp8_linear_sums=seen)
    runner.capture_decode_graphs(key="fold", show_progress=False)
    assert sums_seen and all(sums_seen), sums_seen  # o_proj of both layers and down_proj of the first: all folded
    runner.model.ops = no_split_fold(base)
    runner.capture_decode_graphs(key="nofold", show_progress=False)
    runner.model.ops = base
    per = ctx // runner.block_size
    items = [DecodeItem(5 + i, ctx - 1, [(i * per + j) % runner.kv_pool.num_blocks for j in range(per)])
             for i in range(batch)]
    got = runner.decode(items, graph_key="fold").clone()
    want = runner.decode(items, graph_key="nofold")  # rewrites the same slots with the same values
    assert runner.decode_graph(batch, "fold") is not None and runner.decode_graph(batch, "nofold") is not None
    assert got.shape[0] == batch and torch.isfinite(got).all()
    assert torch.equal(got, want), (got - want).abs().max()
