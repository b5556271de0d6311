"""The producers of fp8 projections' inputs fused with their per-token quantization (issue 39: RMSNorm, the residual
add + RMSNorm, SiLU-and-mul writing fp8 rows and scales; ops/triton_fp8_fused.py), the GEMM entry points that take
those rows (`fp8.reference_linear_rows`, `fp8_gpu.gpu_linear_rows`, `triton_fp8_skinny.skinny_fp8_linear_rows`), and
which projections the model feeds them to (`projections.fused_fp8`), on CPU:

- the decision as a table: dynamic per-token activations with per-row weight scales are fused, static / per-tensor
  activations, block weights, float projections and a bundle with the fusion off are not;
- the torch bundle's fused ops are the op then `quantize_input(.., "token")`, and the rows' linear is
  `reference_linear` exactly;
- tiny fp8 models (Llama; Gemma 3, whose MLP norm is its own) call the fused ops where they should, and give the
  unfused path's logits bit for bit; a per-tensor-activation model calls none;
- under the Triton interpreter (a subprocess), each fused kernel gives the unfused kernels' bits (the op, then
  `quantize_tokens`, both interpreted: the interpreter's fp8 cast rounds the same wrong way in both), and the skinny
  GEMM of fused rows gives `skinny_fp8_linear`'s output exactly.
Bit-exactness against the unfused path on the GPU (the hardware's cast, the real reductions): test_fp8_fused_gpu.py.

Run as a script (``TRITON_INTERPRET=1 python tests/test_fp8_fused.py``) it performs the interpreter checks.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from triton_interp import exit_passed, run_interpreted

from rapidserve.models.projections import fused_fp8
from rapidserve.ops import Ops, fp8, fp8_ops, torch_ops, torch_ops_bundle, unfused_fp8, unfused_ops

FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
HAS_TRITON = importlib.util.find_spec("triton") is not None
CPU = torch.device("cpu")


def _layer(n: int, k: int, acts: str, block: tuple[int, int] | None, dt: torch.dtype = FN) -> fp8.Fp8Linear:
    g = torch.Generator().manual_seed(n + k)
    layer = fp8.Fp8Linear(n, k, dt, acts, block, CPU)
    w8, s = fp8.quantize_weight(torch.randn(n, k, generator=g) / k**0.5, "block" if block else "channel", block, dt)
    layer.weight.copy_(w8)
    layer.weight_scale.copy_(s)
    if layer.input_scale is not None:
        layer.input_scale.fill_(0.02)
    return layer


@pytest.mark.parametrize(("acts", "block", "dt", "fuse", "want"), [
    ("token", None, FN, True, FN),  # per-channel (or per-tensor) weights, dynamic per-token activations
    ("token", None, FNUZ, True, FNUZ),  # ROCm's format: the rows in the weight's
    ("token", None, FN, False, None),  # the fusion off (unfused_fp8)
    ("static", None, FN, True, None),  # a calibrated input scale: its own quantizer
    ("tensor", None, FN, True, None),  # one dynamic scale over all rows: not a row's op
    ("group", (32, 32), FN, True, None),  # block weights: per-token-group activations
])
def test_which_projections_take_quantized_rows(acts: str, block: tuple[int, int] | None, dt: torch.dtype, fuse: bool,
                                               want: torch.dtype | None) -> None:
    ops = torch_ops_bundle() if fuse else unfused_fp8(torch_ops_bundle())
    layer = _layer(64, 64, acts, block, dt)
    assert fused_fp8(ops, layer) == want
    assert fp8.takes_rows(layer) == (acts == "token")
    assert fused_fp8(ops, torch.nn.Parameter(torch.zeros(4, 4))) is None and fused_fp8(ops, None) is None


def test_bundles_that_turn_the_fusion_off() -> None:
    ops = torch_ops_bundle()
    assert ops.fuse_fp8 and ops.fp8_linear_rows is fp8.reference_linear_rows
    assert not unfused_fp8(ops).fuse_fp8 and unfused_fp8(unfused_fp8(ops)) == unfused_fp8(ops)
    assert unfused_ops(ops) is ops  # the torch bundle is its own unfused form
    assert fp8_ops(ops, "cpu") is ops  # already the reference: fused (the torch compositions)
    gpu_without_fp8 = dataclasses.replace(ops, fp8_linear=lambda x, layer, bias=None: x)
    ref = fp8_ops(gpu_without_fp8, "cpu")  # a bundle whose fp8 linear the device cannot run
    assert ref.fp8_linear is fp8.reference_linear and ref.fp8_linear_rows is fp8.reference_linear_rows
    assert not ref.fuse_fp8
    if HAS_TRITON:  # the GPU bundle: the fused kernels and the rows' GEMM routing; unfused_ops as before the fusion
        from rapidserve.ops import fp8_gpu, triton_fp8_fused, triton_ops_bundle

        tri = triton_ops_bundle(skinny=True)
        assert tri.fuse_fp8 and tri.add_rms_norm_fp8 is triton_fp8_fused.add_rms_norm_fp8
        assert tri.silu_and_mul_fp8 is triton_fp8_fused.silu_and_mul_fp8
        assert tri.fp8_linear_rows is fp8_gpu.gpu_linear_rows
        assert not unfused_ops(tri).fuse_fp8 and unfused_fp8(tri).name == "triton-fp8unfused"


@pytest.mark.parametrize("dt", [FN, FNUZ])
def test_torch_fused_ops_are_the_op_then_the_quantizer(dt: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 96, generator=g).to(torch.bfloat16)
    r = torch.randn(5, 96, generator=g).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(torch.bfloat16)
    x[2] = 0
    r[2] = 0  # a zero row: MIN_AMAX
    rows = torch_ops.rms_norm_fp8(x, w, 1e-6, dt)
    want = fp8.quantize_input(torch_ops.rms_norm(x, w, 1e-6), "token", dt)
    assert rows.dtype == torch.bfloat16 and torch.equal(rows.scale, want[1]) and torch.equal(rows.q, want[0])
    rows, res = torch_ops.add_rms_norm_fp8(x, r, w, 1e-6, dt)
    normed, want_res = torch_ops.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(res, want_res) and torch.equal(rows.q, fp8.quantize_input(normed, "token", dt)[0])
    rows = torch_ops.silu_and_mul_fp8(x, dt)
    want = fp8.quantize_input(torch_ops.silu_and_mul(x), "token", dt)
    assert rows.q.shape == (5, 48) and torch.equal(rows.q, want[0]) and torch.equal(rows.scale, want[1])
    layer = _layer(32, 48, "token", None, dt)
    b = torch.randn(32, generator=g).to(torch.bfloat16)
    y = torch_ops.silu_and_mul(x)
    assert torch.equal(fp8.reference_linear_rows(rows, layer, b), fp8.reference_linear(y, layer, b))


def test_rows_that_do_not_fit_are_refused() -> None:
    layer = _layer(32, 48, "token", None)
    rows = fp8.quantize_rows(torch.randn(3, 48), FN)
    with pytest.raises(ValueError, match="not 32x64 .*block=\\(32, 32\\), activations=group: pass the float rows"):
        fp8.reference_linear_rows(fp8.quantize_rows(torch.randn(3, 64), FN), _layer(32, 64, "group", (32, 32)))
    with pytest.raises(ValueError, match=r"q \[M, 48\] of that dtype .*got q \(3, 40\)"):
        fp8.reference_linear_rows(fp8.quantize_rows(torch.randn(3, 40), FN), layer)
    with pytest.raises(ValueError, match="float8_e4m3fnuz"):
        fp8.reference_linear_rows(rows._replace(q=rows.q.view(torch.uint8).view(FNUZ)), layer)
    with pytest.raises(ValueError, match=r"scale \[M, 1\] float32"):
        fp8.reference_linear_rows(rows._replace(scale=rows.scale[:1]), layer)


def _tiny_fp8_runner(preset: str, acts: str) -> tuple[Any, int]:
    """A CPU ModelRunner of `preset` quantized online to fp8 with `acts` activation scales, and its layer count."""
    from rapidserve.config_builder import build_engine_config
    from rapidserve.quant_config import ONLINE_FP8
    from rapidserve.runner import ModelRunner

    cfg, source = build_engine_config(f"preset:{preset}", device="cpu", dtype="bfloat16", quantization="fp8",
                                      num_kv_blocks=16, enforce_eager=True)
    cfg = dataclasses.replace(cfg, quantization=dataclasses.replace(ONLINE_FP8, activations=acts))
    return ModelRunner(cfg, source, show_progress=False), cfg.model_config.num_layers


def _counting(ops: Ops, calls: Counter[str]) -> Ops:
    """`ops` with the fused ops and both fp8 linears counting their calls."""
    def wrap(name: str) -> Callable[..., Any]:
        fn = getattr(ops, name)

        def counted(*args: Any) -> Any:
            calls[name] += 1
            return fn(*args)
        return counted
    names = ("rms_norm_fp8", "add_rms_norm_fp8", "silu_and_mul_fp8", "fp8_linear_rows", "fp8_linear")
    return dataclasses.replace(ops, **{n: wrap(n) for n in names})


@pytest.mark.parametrize(("preset", "acts"), [("tiny-llama", "token"), ("tiny-gemma3", "token"),
                                              ("tiny-llama", "tensor")])
def test_a_tiny_fp8_model_takes_the_fused_path_with_the_same_logits(preset: str, acts: str) -> None:
    """Per layer, with per-token activations: the input norm (alone in layer 0) and the MLP's norm quantize for
    q|k|v and gate|up, SiLU-and-mul for down (Gemma 3: GELU-tanh, so down quantizes its own rows), o_proj quantizes
    its own (attention's output); the logits of a prompt are the unfused path's bit for bit. Per-tensor activations
    fuse nothing."""
    from rapidserve.runner import PrefillItem

    runner, layers = _tiny_fp8_runner(preset, acts)
    base = runner.model.ops
    assert base.fuse_fp8
    prompt = [(7 * i + 3) % 500 + 3 for i in range(21)]
    out = {}
    for fuse in (True, False):
        calls: Counter[str] = Counter()
        runner.model.ops = _counting(base if fuse else unfused_fp8(base), calls)
        out[fuse] = runner.prefill([PrefillItem(prompt, 0, [0, 1])])
        runner.model.ops = base
        gelu = preset == "tiny-gemma3"
        if fuse and acts == "token":
            assert calls == Counter(rms_norm_fp8=1, add_rms_norm_fp8=2 * layers - 1,
                                    silu_and_mul_fp8=0 if gelu else layers, fp8_linear_rows=(2 if gelu else 3) * layers,
                                    fp8_linear=(2 if gelu else 1) * layers), calls
        else:
            assert calls == Counter(fp8_linear=4 * layers), calls
    assert out[True].dtype == torch.float32 and torch.equal(out[True], out[False])


@pytest.mark.parametrize(("preset", "acts"), [("tiny-llama", "token"), ("tiny-gemma3", "token"),
                                              ("tiny-llama", "tensor")])
def test_decode_attention_quantizes_for_o_proj_with_the_same_logits(preset: str, acts: str) -> None:
    """In a decode step the attention's output reaches an fp8 o_proj that takes quantized rows as those rows
    (`attention.attend`'s out_fp8: the torch backend's `decode_attention_fp8`), so no projection quantizes its own
    input there (Gemma 3: its GELU-tanh MLP's down still does); the logits are the unfused path's bit for bit, over
    the same cache. Per-tensor activations fuse nothing. A prefill step keeps o_proj's own quantizer (the previous
    test)."""
    from rapidserve.runner import DecodeItem, PrefillItem

    runner, layers = _tiny_fp8_runner(preset, acts)
    base = runner.model.ops
    prompts = [[(7 * i + 3) % 500 + 3 for i in range(21)], [(5 * i + 1) % 400 + 3 for i in range(9)]]
    tables = [[0, 1], [2]]
    runner.prefill([PrefillItem(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    items = [DecodeItem(11, 21, tables[0]), DecodeItem(12, 9, tables[1])]
    out = {}
    for fuse in (True, False):
        calls: Counter[str] = Counter()
        runner.model.ops = _counting(base if fuse else unfused_fp8(base), calls)
        out[fuse] = runner.decode(items)  # the same slots written with the same values each time
        runner.model.ops = base
        gelu = preset == "tiny-gemma3"
        if fuse and acts == "token":
            assert calls == Counter(rms_norm_fp8=1, add_rms_norm_fp8=2 * layers - 1,
                                    silu_and_mul_fp8=0 if gelu else layers, fp8_linear_rows=(3 if gelu else 4) * layers,
                                    fp8_linear=layers if gelu else 0), calls
        else:
            assert calls == Counter(fp8_linear=4 * layers), calls
    assert out[True].shape[0] == 2 and torch.equal(out[True], out[False])


def test_attend_returns_quantized_rows_only_for_decode_steps() -> None:
    """`attend(..., out_fp8=)`: a decode step's output as `QuantizedRows` ([B, heads * head_dim], the numbers of
    `quantize_rows` of the float output), a prefill or mixed step's as the float output (o_proj quantizes it); a
    backend without `decode_attention_fp8` gives the float output."""
    from test_attention import decode_seqs, make_batch

    from rapidserve.attention import attend, get_attention_backend, split_decode_rows
    from rapidserve.ops import torch_kv

    attn = get_attention_backend("torch", "cpu")
    b = make_batch(decode_seqs([9, 0, 33]), num_kv_heads=2, group=2, head_dim=16, block_size=8, decode=True)
    torch_kv.write_kv(b.k_new, b.v_new, b.k_cache, b.v_cache, b.meta.slot_mapping)
    args = (b.q, b.k_cache, b.v_cache, b.meta, 0.25)
    rows = attend(attn, *args, out_fp8=FN)
    flat = attend(attn, *args).reshape(3, -1)
    assert isinstance(rows, fp8.QuantizedRows) and rows.q.shape == (3, 64)
    want = fp8.quantize_rows(flat, FN)
    assert torch.equal(rows.q.view(torch.uint8), want.q.view(torch.uint8)) and torch.equal(rows.scale, want.scale)
    assert isinstance(attend(dataclasses.replace(attn, decode_attention_fp8=None), *args, out_fp8=FN), torch.Tensor)
    p = make_batch([(1, 4), (3, 2)], num_kv_heads=2, group=2, head_dim=16, block_size=8)
    torch_kv.write_kv(p.k_new, p.v_new, p.k_cache, p.v_cache, p.meta.slot_mapping)
    for meta in (p.meta, split_decode_rows(p.meta, [1, 3])):  # prefill, then a mixed step
        got = attend(attn, p.q, p.k_cache, p.v_cache, meta, 0.25, out_fp8=FN)
        assert isinstance(got, torch.Tensor) and torch.equal(got, attend(attn, p.q, p.k_cache, p.v_cache, meta, 0.25))


def _reduce_layouts(kernel: str, target: str, dtype: str, residual_only: bool = True) -> list[list[str]]:
    """The layouts of the row reductions (`tt.reduce` operands) of each of `kernel`'s distinct with-residual launches
    (`residual_only` False: every launch, for a kernel without HAS_RESIDUAL) for Qwen3-8B's rows (4096) on `target`
    (the fused kernel's: one program a row, and rows cut into slices), compiled (no GPU) as
    bench/amd_compile_check.py compiles them."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from bench.amd_compile_check import make_job
    from bench.amd_launches import TARGETS, Shape, capture, jit_function

    tg = TARGETS[target]
    out, seen = [], set()
    for launch in capture(Shape("qwen3-8b", 1, dtype), tg).launches:
        if launch.kernel != kernel or (residual_only and not launch.kwargs["HAS_RESIDUAL"]):
            continue
        job = make_job(launch, tg, {})
        if job.key() in seen:
            continue
        seen.add(job.key())
        compiled = triton.compile(ASTSource(jit_function(kernel), job.signature, job.constexprs, job.attrs),
                                  target=GPUTarget(tg.backend, tg.arch, tg.warp_size), options=job.options)
        ir = compiled.asm["ttgir"]
        layouts = dict(re.findall(r"^(#\w+) = (.*)$", ir, re.M))
        out.append([layouts[m] for m in re.findall(r"\}\) : \(tensor<\d+xf32, (#\w+)>\) -> f32", ir)])
    return out


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize(("target", "dtype"), [("sm_90", "bfloat16"), ("gfx942", "float32")])
def test_the_fused_norm_sums_in_the_unfused_kernels_layout(target: str, dtype: str) -> None:
    """Bit-exactness of the fused RMSNorm rests on its float32 sum of squares running in the same order as
    triton_ops' kernel's, i.e. over the same layout: compiled for the target, every reduction of the fused kernel
    (the sum, then the amax), one program a row or rows cut into slices, takes the layout of the unfused kernel's sum
    (an fp8 store left to itself would lay the row out 16 to a thread: triton_fp8_fused's VEC)."""
    (unfused,) = _reduce_layouts("_rms_norm_kernel", target, dtype)
    variants = _reduce_layouts("_rms_norm_fp8_kernel", target, dtype)
    assert len(unfused) == 1 and len(variants) == 2, (unfused, variants)  # one program a row; slices
    for fused in variants:
        assert len(fused) == 2 and set(fused) == set(unfused), (unfused, fused)


# --------------------------------------------------------------------------------------- the interpreter checks
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_fused_kernels_interpreter() -> None:
    """The fused kernels under TRITON_INTERPRET=1 against the unfused kernels (check_fused_kernels)."""
    run_interpreted(__file__, timeout=600)


def _same_rows(got: fp8.QuantizedRows, q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype, label: object) -> None:
    assert got.dtype == dtype and got.q.dtype == q.dtype, label
    assert torch.equal(got.scale, s), label
    assert torch.equal(got.q.view(torch.uint8), q.view(torch.uint8)), label


def check_fused_kernels() -> None:
    """Each fused kernel gives the unfused kernels' bits: the op (triton_ops), then `triton_fp8.quantize_tokens`, all
    interpreted. Exact equality holds because both round through the interpreter's (deviant) fp8 cast of the same
    float32 quotients; on the GPU both use the hardware's cast (test_fp8_fused_gpu.py). The scales, which involve no
    fp8 cast, also equal `quantize_input`'s of the unfused op's output."""
    from rapidserve.ops import triton_fp8, triton_fp8_fused, triton_fp8_skinny, triton_ops

    g = torch.Generator().manual_seed(5)
    for dt in (FN, FNUZ):
        for xdt, m, k in ((torch.bfloat16, 3, 96), (torch.float16, 5, 300), (torch.float32, 2, 1024)):
            x = (torch.randn(m, k, generator=g) * 4).to(xdt)
            r = torch.randn(m, k, generator=g).to(xdt)
            w = (1 + 0.1 * torch.randn(k, generator=g)).to(xdt)
            x[1] = 0
            r[1] = 0  # an all-zero row: the scale from MIN_AMAX, no 0 / 0
            label = (dt, xdt, m, k)
            y = triton_ops.rms_norm(x, w, 1e-6)
            q, s = triton_fp8.quantize_tokens(y, dt)
            assert torch.equal(s, fp8.quantize_input(y, "token", dt)[1]), label
            y_res, res = triton_ops.add_rms_norm(x, r, w, 1e-6)
            q_res, s_res = triton_fp8.quantize_tokens(y_res, dt)
            # one program a row (the rule's choice at these sizes), then rows cut into 2 slices and into 5 to 8 (the
            # last one partial at k 96 and 300, whole at 1024): every program takes the whole row's amax and quantizes
            # its slice, the same bits. The widths grow with the row (f) so that rows keep few slices: the
            # interpreter's cost is per program, and each program takes the whole row's amax.
            f = (1 << (k - 1).bit_length()) // 128  # 1, 4, 8
            for width in (None, 64 * f, 16 * f):
                _same_rows(triton_fp8_fused.rms_norm_fp8(x, w, 1e-6, dt, width), q, s, xdt, (label, width))
                rows, got_res = triton_fp8_fused.add_rms_norm_fp8(x, r, w, 1e-6, dt, width)
                assert torch.equal(got_res, res), (label, width)
                _same_rows(rows, q_res, s_res, xdt, (label, width))
            # a strided x (a column slice): copied first, the same numbers
            wide = torch.cat([x, x], dim=1)[:, k:]
            _same_rows(triton_fp8_fused.rms_norm_fp8(wide, w, 1e-6, dt), q, s, xdt, label)
            y = triton_ops.silu_and_mul(x)
            q, s = triton_fp8.quantize_tokens(y, dt)
            # in registers; the two-pass loop with one slice wider than the row (the rule's width here is the whole
            # row: the same launch); slices of the row (the last one partial at k 96 and 300) (f as above; 16 * f
            # columns in registers at most: the loop)
            assert triton_fp8_fused.slice_cols(m, k // 2, triton_fp8_fused.SILU_MIN_SLICE) >= k // 2, label
            for one_pass, width in ((triton_fp8_fused.ONE_PASS_COLS, None), (16 * f, 1 << 20),
                                    (triton_fp8_fused.ONE_PASS_COLS, 32 * f), (16 * f, 16 * f), (16 * f, 64 * f)):
                _same_rows(triton_fp8_fused.silu_and_mul_fp8(x, dt, one_pass, width), q, s, xdt,
                           (label, one_pass, width))
        # a row of more than LOOP_BLOCK columns cut into slices of two LOOP_BLOCK steps each, the last one partial
        long_rows = (torch.randn(2, 2 * 9000, generator=g) * 4).to(torch.bfloat16)
        want = triton_fp8.quantize_tokens(triton_ops.silu_and_mul(long_rows), dt)
        for width in (None, 8192):
            _same_rows(triton_fp8_fused.silu_and_mul_fp8(long_rows, dt, slice_width=width), *want, torch.bfloat16,
                       width)
        # a norm weight of another dtype (its product promotes): the unfused launches, float32 rows
        w32 = torch.rand(k, generator=g) + 0.5
        rows = triton_fp8_fused.rms_norm_fp8(x.to(torch.bfloat16), w32, 1e-6, dt)
        y = triton_ops.rms_norm(x.to(torch.bfloat16), w32, 1e-6)
        _same_rows(rows, *triton_fp8.quantize_tokens(y, dt), torch.float32, "promoted")
        empty = triton_fp8_fused.silu_and_mul_fp8(x[:0], dt)
        assert empty.q.shape == (0, k // 2) and empty.scale.shape == (0, 1)
        # the skinny GEMM of fused rows: skinny_fp8_linear's kernel on the same x8 (float16: the interpreter's bf16
        # tl.dot is wrong)
        layer = _layer(64, 96, "token", None, dt)
        x = torch.randn(4, 96, generator=g).to(torch.float16)
        b = torch.randn(64, generator=g).to(torch.float16)
        rows = fp8.QuantizedRows(*triton_fp8.quantize_tokens(x, dt), torch.float16)
        got = triton_fp8_skinny.skinny_fp8_linear_rows(rows, layer.weight, layer.weight_scale, b)
        assert torch.equal(got, triton_fp8_skinny.skinny_fp8_linear(x, layer.weight, layer.weight_scale, b))
        assert triton_fp8_skinny.rows_ok(rows, layer.weight, layer.weight_scale)
        assert not triton_fp8_skinny.routed_rows(rows, layer.weight, layer.weight_scale)  # a CPU tensor
        with pytest.raises(ValueError, match="skinny_fp8_linear_rows takes 1..64 rows"):
            triton_fp8_skinny.skinny_fp8_linear_rows(rows._replace(dtype=torch.float32), layer.weight,
                                                     layer.weight_scale)
    with pytest.raises(ValueError, match="rows x"):
        triton_fp8_fused.rms_norm_fp8(torch.zeros(2, 3, 8), torch.ones(8), 1e-6, FN)
    with pytest.raises(ValueError, match="even last dim"):
        triton_fp8_fused.silu_and_mul_fp8(torch.zeros(2, 7), FN)


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("set TRITON_INTERPRET=1 before running the interpreter checks")
    check_fused_kernels()
    print("fp8 fused kernels: ok")
    exit_passed()
