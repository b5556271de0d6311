"""The fp8 linear layer's pieces (rapidserve/ops/fp8.py, ops/triton_fp8.py, models/fp8_weights.py,
parallel/shard.py's scale rules) on CPU: activation and weight quantization against the definitions of
quant_config.py written out here, the reference linear against that formula, `torch._scaled_mm`'s row-wise path
and the Triton block kernel (under the Triton interpreter, in a subprocess) against the reference, ROCm's e4m3fnuz
conversion over all 256 bit patterns, which path each device gets, and how scales shard.

Run as a script (``TRITON_INTERPRET=1 python tests/test_fp8_ops.py``) it performs the interpreter checks.
"""

from __future__ import annotations

import importlib.util
import sys
from types import SimpleNamespace

import pytest
import torch
from triton_interp import interpreted_checks, run_checks, selected_by_test

from rapidserve.config import ModelConfig
from rapidserve.models import fp8_weights
from rapidserve.ops import fp8, fp8_gpu, fp8_ops, get_ops, torch_ops_bundle, triton_ops_bundle
from rapidserve.parallel.shard import ShardError, block_shard_problem, shard_bounds, shard_kind, shard_shape, tp_layout
from rapidserve.quant_config import QuantizationConfig, QuantizationError

FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _layer(n: int, k: int, acts: str, block: tuple[int, int] | None, dt: torch.dtype = FN,
           seed: int = 0) -> tuple[fp8.Fp8Linear, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k**0.5
    layer = fp8.Fp8Linear(n, k, dt, acts, block, torch.device("cpu"))
    w8, s = fp8.quantize_weight(w, "block" if block else "channel", block, dt)
    layer.weight.copy_(w8)
    layer.weight_scale.copy_(s)
    if layer.input_scale is not None:
        layer.input_scale.fill_(0.02)
    return layer, w


@pytest.mark.parametrize("dt", [FN, FNUZ])
def test_quantize_input_is_the_definition(dt: torch.dtype) -> None:
    top = torch.finfo(dt).max
    x = torch.randn(7, 300, generator=torch.Generator().manual_seed(44)) * torch.logspace(-2, 2, 7)[:, None]
    x[3] = 0.0  # a zero row: amax MIN_AMAX, no 0/0
    x8, s = fp8.quantize_input(x, "token", dt)
    want_s = x.abs().amax(-1, keepdim=True).clamp(min=fp8.MIN_AMAX) * (1.0 / top)  # the product, as CUDA torch forms it
    assert torch.equal(s, want_s) and torch.equal(x8, (x / want_s).clamp(-top, top).to(dt))
    assert not torch.isnan(x8.float()).any() and bool((x8[3].float() == 0).all())
    x8, s = fp8.quantize_input(x, "tensor", dt)
    # the float32 product of the definition, bit for bit (a float64 quotient differs by up to two float32 roundings,
    # which a relative bound of 1e-7 missed now and then with unseeded inputs)
    assert s.shape == (1, 1) and torch.equal(s, (x.abs().amax().clamp(min=fp8.MIN_AMAX) * (1.0 / top)).reshape(1, 1))
    x8, s = fp8.quantize_input(x, "static", dt, torch.tensor([0.01]))
    assert float(x8.float().abs().max()) == top  # clipped: static scales saturate, never overflow
    x8, s = fp8.quantize_input(x, "group", dt, group=128)  # 300 columns: groups of 128, 128, 44
    assert s.shape == (7, 3)
    assert torch.equal(s[:, 2], x[:, 256:].abs().amax(-1).clamp(min=fp8.MIN_AMAX) * (1.0 / top))
    back = fp8.dequantize_input(x8, s, 128)
    assert bool(((back - x).abs() <= s.repeat_interleave(128, 1)[:, :300] * 16 + 1e-30).all())  # half a step
    with pytest.raises(ValueError, match="static fp8 activations need"):
        fp8.quantize_input(x, "static", dt)


@pytest.mark.parametrize(("weights", "block"), [("channel", None), ("tensor", None), ("block", (128, 128)),
                                                ("block", (64, 32))])
def test_quantize_weight_is_the_definition(weights: str, block: tuple[int, int] | None) -> None:
    w = torch.randn(200, 150)  # partial blocks at both edges
    w8, s = fp8.quantize_weight(w, weights, block, FN)
    if weights == "channel":
        assert torch.equal(s, w.abs().amax(1) / 448)
    elif weights == "tensor":
        assert s.shape == (1,) and torch.equal(s, (w.abs().max() / 448).reshape(1))
    else:
        bn, bk = block  # type: ignore[misc]
        assert s.shape == (-(-200 // bn), -(-150 // bk))
        assert float(s[-1, -1]) == float(w[(s.shape[0] - 1) * bn:, (s.shape[1] - 1) * bk:].abs().max() / 448)
    deq = fp8.dequantize_weight(w8, s.reshape(-1) if weights != "block" else s, block)
    assert float((deq - w).norm() / w.norm()) < 0.04


@pytest.mark.parametrize(("acts", "block"), [("token", None), ("tensor", None), ("static", None),
                                             ("group", (128, 128))])
def test_reference_linear_is_the_formula(acts: str, block: tuple[int, int] | None) -> None:
    layer, _ = _layer(192, 256, acts, block)
    x, bias = torch.randn(5, 256), torch.randn(192)
    group = 128 if acts == "group" else None
    x8, sx = fp8.quantize_input(x, acts, FN, layer.input_scale, group)
    xs = sx.repeat_interleave(128, 1) if group else sx
    ws = (layer.weight_scale.repeat_interleave(128, 0)[:192].repeat_interleave(128, 1) if block
          else layer.weight_scale[:, None])
    want = (x8.float() * xs) @ (layer.weight.float() * ws).T + bias
    torch.testing.assert_close(fp8.reference_linear(x, layer, bias), want, rtol=1e-6, atol=1e-6)
    assert fp8.reference_linear(x.bfloat16(), layer).dtype == torch.bfloat16


def _has_cpu_scaled_mm() -> bool:
    try:
        torch._scaled_mm(torch.zeros(2, 16).to(FN), torch.zeros(16, 16).to(FN).t(), scale_a=torch.ones(2, 1),
                         scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


@pytest.mark.skipif(not _has_cpu_scaled_mm(), reason="this torch build has no CPU torch._scaled_mm")
@pytest.mark.parametrize("acts", ["token", "tensor", "static"])
def test_scaled_mm_linear_matches_the_reference(acts: str) -> None:
    """The GPU path's arguments (row-major x8, the weight's transpose, [M, 1] and [1, N] scales) through this
    torch's CPU `_scaled_mm`: the reference's numbers up to bf16 rounding of the output."""
    layer, _ = _layer(96, 128, acts, None)
    x = torch.randn(9, 128).bfloat16()
    assert fp8_gpu.scaled_mm_ok(x, layer)
    got, want = fp8_gpu.scaled_mm_linear(x, layer), fp8.reference_linear(x.float(), layer)
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
    assert fp8_gpu.gpu_linear(x, layer).dtype == torch.bfloat16


def test_gpu_linear_takes_the_reference_for_shapes_scaled_mm_cannot() -> None:
    layer, _ = _layer(20, 24, "token", None)  # N, K not multiples of 16
    x = torch.randn(3, 24)
    assert not fp8_gpu.scaled_mm_ok(x, layer)
    assert torch.equal(fp8_gpu.gpu_linear(x, layer), fp8.reference_linear(x, layer))


def test_fnuz_conversion_keeps_every_value() -> None:
    """All 256 e4m3fn bit patterns: as e4m3fnuz each is half the value (so doubled scales keep w8 * s), -0 is +0,
    NaN stays NaN."""
    bits = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8)
    fn = bits.view(FN)
    fnuz = fp8.to_fnuz(fn)
    a, b = fn.float(), fnuz.float() * 2
    nan = torch.isnan(a)
    assert torch.equal(torch.isnan(b), nan) and torch.equal(a[~nan], b[~nan])
    assert int(fnuz.view(torch.int8)[bits == -128]) == 0
    with pytest.raises(ValueError, match="takes float8_e4m3fn"):
        fp8.to_fnuz(fnuz)


def _fake_gpu(monkeypatch: pytest.MonkeyPatch, *, cap: tuple[int, int] = (9, 0), hip: str | None = None,
              arch: str = "") -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(gcnArchName=arch))
    monkeypatch.setattr(torch.version, "hip", hip)


@pytest.mark.parametrize(("cap", "hip", "arch", "supported", "dtype"), [
    ((9, 0), None, "", True, FN),  # H100 / H200
    ((8, 9), None, "", True, FN),  # Ada
    ((8, 0), None, "", False, FN),  # A100: the reference path
    ((0, 0), "6.4.0", "gfx942:sramecc+:xnack-", True, FNUZ),  # MI300X
    ((0, 0), "6.4.0", "gfx950", True, FN),  # MI355: OCP fp8
    ((0, 0), "6.4.0", "gfx90a", False, FN),  # MI250
])
def test_which_path_each_gpu_gets(cap: tuple[int, int], hip: str | None, arch: str, supported: bool,
                                  dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpu(monkeypatch, cap=cap, hip=hip, arch=arch)
    cuda = torch.device("cuda")
    assert fp8.fp8_supported(cuda) is supported and fp8.fp8_dtype(cuda) == dtype
    ops = fp8_ops(triton_ops_bundle(skinny=False), cuda)
    assert ops.fp8_linear is (fp8_gpu.gpu_linear if supported else fp8.reference_linear)
    assert not fp8.fp8_supported("cpu") and fp8.fp8_dtype("cpu") == FN


def test_cpu_bundle_is_the_reference() -> None:
    ops = get_ops("cpu")
    assert ops.fp8_linear is fp8.reference_linear and fp8_ops(ops, "cpu") is ops
    assert torch_ops_bundle().fp8_linear is fp8.reference_linear


def test_loading_expands_per_tensor_scales_max_combines_input_scales_and_doubles_for_fnuz() -> None:
    for dt, factor in ((FN, 1.0), (FNUZ, 2.0)):
        quant = QuantizationConfig(method="fp8", weights="tensor", activations="static")
        layer = fp8.Fp8Linear(48, 32, dt, "static", None, torch.device("cpu"))
        fp8_weights.begin([layer])
        for i, (off, rows) in enumerate(((0, 16), (16, 16), (32, 16))):  # q, k, v of a fused qkv
            parts = fp8_weights.fp8_parts(f"p{i}", layer, off, rows, quant)
            w8 = (torch.randn(rows, 32) * 10).to(FN)
            fp8_weights.store(parts[f"p{i}.weight"], f"p{i}.weight", w8, quant)
            fp8_weights.store(parts[f"p{i}.weight_scale"], f"p{i}.weight_scale", torch.tensor(0.5 + i), quant)
            fp8_weights.store(parts[f"p{i}.input_scale"], f"p{i}.input_scale", torch.tensor([0.3 - 0.1 * i]), quant)
            assert torch.equal(layer.dequantized()[off:off + rows], w8.float() * (0.5 + i))
        assert torch.equal(layer.weight_scale, factor * torch.tensor([0.5] * 16 + [1.5] * 16 + [2.5] * 16))
        assert float(layer.input_scale) == pytest.approx(0.3 * factor)  # type: ignore[arg-type]
        with pytest.raises(fp8_weights.Fp8WeightError, match="expected per-channel scales"):
            fp8_weights.store(fp8_weights.Fp8Part(layer, "scale", 0, 16), "x", torch.ones(3), quant)


def test_online_quantization_at_load() -> None:
    quant = QuantizationConfig(method="fp8", online=True)
    layer = fp8.Fp8Linear(32, 64, FN, "token", None, torch.device("cpu"))
    w = torch.randn(16, 64)
    part = fp8_weights.fp8_parts("p", layer, 16, 16, quant)["p.weight"]
    fp8_weights.store(part, "p.weight", w, quant)
    assert torch.equal(layer.weight_scale[16:], w.abs().amax(1) / 448)
    with pytest.raises(fp8_weights.Fp8WeightError, match="quantizes float weights"):
        fp8_weights.store(part, "p.weight", w.to(FN), quant)


def test_quantization_config_checks() -> None:
    for bad, needle in (({"method": "int8"}, "quantization method 'int8'"),
                        ({"method": "fp8", "weights": "block"}, "goes with weights='block'"),
                        ({"method": "fp8", "weights": "block", "block": (128, 128)}, "per-token-group"),
                        ({"method": "fp8", "online": True, "activations": "static"}, "no calibrated input_scale")):
        with pytest.raises(QuantizationError, match=needle):
            QuantizationConfig(**bad)  # type: ignore[arg-type]


CFG = ModelConfig(arch="qwen3", vocab_size=1000, hidden_size=512, intermediate_size=1024, num_layers=2, num_heads=8,
                  num_kv_heads=2, head_dim=64, qk_norm=True)


@pytest.mark.parametrize(("name", "shape", "block", "rank", "bounds"), [
    ("model.layers.0.self_attn.q_proj.weight_scale", (512, 1), None, 1, (0, 256, 512)),  # per row, column-parallel
    ("model.layers.0.self_attn.q_proj.weight_scale", (1,), None, 1, None),  # per tensor: replicated
    ("model.layers.0.self_attn.q_proj.weight_scale", (), None, 1, None),
    ("model.layers.0.self_attn.q_proj.input_scale", (1,), None, 1, None),
    ("model.layers.0.self_attn.o_proj.weight_scale", (512, 1), None, 1, None),  # row-parallel: rows whole
    ("model.layers.0.self_attn.o_proj.weight_scale", (4, 4), (128, 128), 1, (1, 2, 4)),  # block columns
    ("model.layers.0.mlp.gate_proj.weight_scale_inv", (8, 4), (128, 128), 0, (0, 0, 4)),  # block rows
    ("model.layers.0.self_attn.k_proj.weight_scale_inv", (2, 4), (64, 128), 1, (0, 1, 2)),  # KV head 1 of 2
    ("model.layers.0.self_attn.k_proj.weight_scale", (128, 1), None, 1, (0, 64, 128)),
])
def test_scale_shard_bounds(name: str, shape: tuple[int, ...], block: tuple[int, int] | None, rank: int,
                            bounds: tuple[int, int, int] | None) -> None:
    lay = tp_layout(CFG, 2, rank)
    assert shard_bounds(name, shape, lay, block) == bounds
    want = shape if bounds is None else (*shape[:bounds[0]], bounds[2] - bounds[1], *shape[bounds[0] + 1:])
    assert shard_shape(name, shape, lay, block) == want
    assert shard_kind("model.layers.0.self_attn.o_proj.input_scale") == "replicated"


def test_block_scales_that_do_not_split_on_blocks() -> None:
    lay = tp_layout(CFG, 2, 1)
    with pytest.raises(ShardError, match="are not whole 128-row blocks"):  # KV rows [64, 128) of 128-row blocks
        shard_bounds("model.layers.0.self_attn.k_proj.weight_scale_inv", (1, 4), lay, (128, 128))
    assert block_shard_problem(CFG, 1, (128, 128)) is None
    assert "k_proj/v_proj 64 rows" in (block_shard_problem(CFG, 2, (128, 128)) or "")
    assert "o_proj 128 columns" in (block_shard_problem(CFG, 4, (64, 256)) or "")


INTERP_TESTS = {"block": "test_block_kernel_interpreter", "rows": "test_row_kernels_interpreter"}  # check -> test


@pytest.fixture(scope="module")
def interpreter(request: pytest.FixtureRequest) -> dict[str, str]:
    """The session's interpreter checks of this module, in one subprocess (tests/triton_interp.py)."""
    return interpreted_checks(__file__, selected_by_test(request, INTERP_TESTS), timeout=1200)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_block_kernel_interpreter(interpreter: dict[str, str]) -> None:
    """The Triton block kernel under TRITON_INTERPRET=1 against the reference, e4m3fn and e4m3fnuz."""
    assert interpreter["block"] == "", interpreter["block"]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_row_kernels_interpreter(interpreter: dict[str, str]) -> None:
    """The per-token quantizer and decode's skinny fp8 linear under TRITON_INTERPRET=1, e4m3fn and e4m3fnuz."""
    assert interpreter["rows"] == "", interpreter["rows"]


def check_block_kernel() -> None:
    from rapidserve.ops import triton_fp8

    for dt in (FN, FNUZ):
        for m, n, k, block in ((5, 256, 384, (128, 128)), (17, 200, 300, (128, 128)), (3, 96, 160, (64, 32))):
            layer, _ = _layer(n, k, "group", block, dt, seed=m)
            x = torch.randn(m, k)
            x8, sx = fp8.quantize_input(x, "group", dt, group=block[1])
            want = fp8.reference_linear(x, layer)
            outs = []
            for cfg in (None, triton_fp8.BlockConfig(16, 32, min(block[1], 64), 4, 1)):
                outs.append(triton_fp8.block_linear(x8, sx, layer.weight, layer.weight_scale, block, torch.float32,
                                                    cfg))
                torch.testing.assert_close(outs[-1], want, rtol=1e-5, atol=1e-4)
            assert x.dtype == torch.float32  # outs[0]: block_linear(x8, sx, ..., x.dtype) on the default tiles
            assert torch.equal(fp8_gpu.gpu_linear(x, layer), outs[0])
        empty = triton_fp8.block_linear(x8[:0], sx[:0], layer.weight, layer.weight_scale, block, torch.float32)
        assert empty.shape == (0, layer.weight.shape[0])
    with pytest.raises(ValueError, match="want"):
        triton_fp8.block_linear(x8, sx[:, :1], layer.weight, layer.weight_scale, block, torch.float32)


def _interp_cast(y: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """y (float32) cast to `dt` by a Triton kernel: the interpreter's own cast."""
    import triton
    import triton.language as tl

    @triton.jit
    def cast(y_ptr, q_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(q_ptr + offs, tl.load(y_ptr + offs, mask=offs < n).to(q_ptr.dtype.element_ty), mask=offs < n)

    y = y.contiguous()
    q = torch.empty(y.shape, dtype=dt)
    cast[(triton.cdiv(y.numel(), 1024),)](y, q, y.numel(), BLOCK=1024)
    return q


def check_row_kernels() -> None:
    """The per-token quantizer equals `quantize_input(.., "token")` exactly (the interpreter divides as torch does);
    the skinny fp8 linear equals the definition on the same fp8 rows (`reference_linear_rows`), with and without
    bias, on each tile family, and gives the same output from rows quantized before (`skinny_fp8_linear_rows`); it
    refuses what it cannot take."""
    from rapidserve.ops import triton_fp8, triton_fp8_skinny
    from rapidserve.ops.fp8_tiles import Fp8Tiles

    g = torch.Generator().manual_seed(3)
    for dt in (FN, FNUZ):
        for m, k in ((1, 64), (7, 300), (3, 5000), (2, 16)):
            x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
            x[0, : k // 2] = 0 if m > 1 else x[0, : k // 2]
            if m > 2:
                x[1] = 0  # an all-zero row: MIN_AMAX, not 0 / 0
            q, s = triton_fp8.quantize_tokens(x, dt)
            wq, ws = fp8.quantize_input(x, "token", dt)
            assert torch.equal(s, ws), (dt, m, k)
            # the interpreter's float32 -> fp8 cast rounds ties away from zero and drops carries into the next
            # binade (125.4 -> 64 in e4m3fn), so q is checked against that same cast of torch's clamped quotient;
            # on the GPU (hardware round-to-nearest-even) test_fp8_gpu checks q against torch bit for bit
            top = fp8.fp8_max(dt)
            want = _interp_cast((x.float() / ws).clamp(-top, top), dt)
            assert torch.equal(q.view(torch.uint8), want.view(torch.uint8)), (dt, m, k)
        assert triton_fp8.quantize_tokens(x[:0], dt)[0].shape == (0, x.shape[1])
        # float16 rows: the interpreter's tl.dot is wrong in bfloat16 (test_fused_decode_ops interprets fp16 too).
        # Rows 1..64; N and K tails (masked weight loads); 16-row tiles (mma.sync on the GPU), 64-row tiles and the
        # swapped operand order (wgmma); the default tiles (the rule's: 16 rows, or 64 above RULE_ROWS)
        # skinny_fp8_linear_rows is the same launch on the rows quantize_tokens gave: checked once a case, with the
        # bias on every other case and without it on the rest (both on each dtype).
        cases = ((1, 64, 512, None), (5, 100, 300, None), (16, 48, 1024, Fp8Tiles(16, 16, 256, 4, 2)),
                 (1, 128, 256, Fp8Tiles(16, 64, 128, 4, 3, True)),
                 (17, 96, 160, Fp8Tiles(32, 32, 64, 4, 2)), (33, 80, 96, Fp8Tiles(64, 64, 32, 4, 2, True)),
                 (64, 200, 304, None), (40, 48, 1000, Fp8Tiles(64, 16, 128, 4, 2)),
                 (64, 64, 128, Fp8Tiles(64, 64, 128, 8, 2, True)))
        for c, (m, n, k, cfg) in enumerate(cases):
            layer, _ = _layer(n, k, "token", None, dt, seed=m)
            x = torch.randn(m, k, generator=g).to(torch.float16)
            x8, sx = triton_fp8.quantize_tokens(x, dt)  # the interpreter's cast (checked above)
            rows = fp8.QuantizedRows(x8, sx, torch.float32)  # the reference in float32, on the same fp8 rows
            b = torch.randn(n, generator=g).to(torch.float16)
            for bias in (None, b):
                want = fp8.reference_linear_rows(rows, layer, None if bias is None else bias.float())
                got = triton_fp8_skinny.skinny_fp8_linear(x, layer.weight, layer.weight_scale, bias, config=cfg)
                assert got.dtype == torch.float16 and got.shape == (m, n)
                err = float((got.float() - want).abs().max())
                assert err <= 4e-3 + 2e-3 * float(want.abs().max()), (m, n, k, cfg, bias is not None, err)
                if (bias is None) == (c % 2 == 1):  # rows without the bias on even cases, with it on odd ones
                    continue
                same = triton_fp8_skinny.skinny_fp8_linear_rows(rows._replace(dtype=torch.float16), layer.weight,
                                                                layer.weight_scale, bias, config=cfg)
                assert torch.equal(same, got), (m, n, k, cfg)
        with pytest.raises(ValueError, match="float32 scales"):
            triton_fp8_skinny.skinny_fp8_linear(x, layer.weight, layer.weight_scale[:-1])
        with pytest.raises(ValueError, match="1..64 rows"):
            triton_fp8_skinny.skinny_fp8_linear(torch.zeros(65, k, dtype=torch.float16), layer.weight,
                                                layer.weight_scale)
        with pytest.raises(ValueError, match="hold 16 rows; the call has 17"):
            triton_fp8_skinny.skinny_fp8_linear(torch.zeros(17, k, dtype=torch.float16), layer.weight,
                                                layer.weight_scale, config=Fp8Tiles(16, 16, 64, 4, 2))

if __name__ == "__main__":
    sys.exit(run_checks({"block": check_block_kernel, "rows": check_row_kernels}, sys.argv[1:]))
