"""A split-K fp8 GEMM's reduce folded into the RMSNorm after it (issue 39: ops/fold_table.py, ops/triton_fp8_fold.py,
`triton_fp8_skinny.skinny_fp8_linear_sums`, `fp8_gpu.gpu_linear_sums`), on CPU:

- the gate as a table of cases (`fold_for_step`: rows, device, table);
- the bundles: the torch bundle never hands out sums, `no_split_fold` / `unfused_fp8` / `unfused_ops` / `fp8_ops` turn
  the fold off, the Triton bundle's fields are the Triton functions;
- the model's plumbing on tiny fp8 models (torch bundle with a split-K GEMM in torch that hands out sums): which norms
  get sums (o_proj's into the post-attention norm, down_proj's into the next layer's input norm, never out of the last
  layer of a `run_layers` call, none for Gemma 3 or an MoE block's norm), the same logits bit for bit as the same
  GEMM reduced at once;
- under the Triton interpreter (a subprocess), at 1, 2 and 8 rows (folded) and 17 (the gate off: the reduce
  launched), the norm of the sums gives the unfused path's bits (the reduce kernel, then `add_rms_norm_fp8`), one
  program a row and rows cut into slices, with and without a bias, both fp8 formats; `reduce_sums` is the reduce
  kernel's and `fp8.reduce_sums_reference`'s output;
- compiled for sm_90 (no GPU), the norm's sum of squares takes the unfused kernel's layout, so the GPU sums in the
  same order (test_fp8_fused_gpu.py checks the bits on the GPU).

Run as a script (``TRITON_INTERPRET=1 python tests/test_fp8_fold.py``) it performs the interpreter checks.
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
from triton_interp import run_interpreted

from rapidserve.ops import Ops, fold_table, fp8, fp8_ops, no_split_fold, torch_ops_bundle, unfused_fp8, unfused_ops
from rapidserve.ops.fold_table import FoldEntry, fold_for_step

FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
HAS_TRITON = importlib.util.find_spec("triton") is not None
H200, H100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize(("rows", "device", "table", "want"), [
    (1, H200, fold_table.FOLD_TABLE, True),  # batch 1: o_proj (split 4) and down_proj (split 8) folded
    (2, H200, fold_table.FOLD_TABLE, True),
    (8, H200, fold_table.FOLD_TABLE, True),
    (16, H200, fold_table.FOLD_TABLE, True),  # the entry's max_rows (reasoning, not measured)
    (17, H200, fold_table.FOLD_TABLE, False),  # past it: the reduce kernel
    (64, H200, fold_table.FOLD_TABLE, False),
    (1, H100, fold_table.FOLD_TABLE, True),  # a GPU without an entry takes the H200's
    (17, H100, fold_table.FOLD_TABLE, False),
    (1, H100, {H100: FoldEntry(0, "never")}, False),  # its own entry wins
    (4, H100, {H100: FoldEntry(4, "t"), H200: FoldEntry(16, "t")}, True),
    (5, H100, {H100: FoldEntry(4, "t"), H200: FoldEntry(16, "t")}, False),
    (1, H100, {}, False),  # no entry at all: never
])
def test_the_fold_gate(rows: int, device: str, table: fold_table.FoldTable, want: bool) -> None:
    assert fold_for_step(rows, device, table) is want


def test_the_fold_gate_refuses_no_rows() -> None:
    with pytest.raises(ValueError, match="at least one row"):
        fold_for_step(0, H200)


def test_bundles_that_fold_and_those_that_do_not() -> None:
    ref_ops = torch_ops_bundle()
    assert not ref_ops.fold_split_k and ref_ops.fp8_linear_sums is fp8.reference_linear_rows  # never sums
    assert no_split_fold(ref_ops) is ref_ops
    ops = dataclasses.replace(ref_ops, fold_split_k=True)
    for off in (no_split_fold(ops), unfused_fp8(ops)):
        assert not off.fold_split_k
    assert no_split_fold(ops).name == "torch-nofold" and no_split_fold(no_split_fold(ops)).name == "torch-nofold"
    assert unfused_fp8(ops).name == "torch-fp8unfused"  # the name the A/B keys by, as before the fold
    gpu_without_fp8 = dataclasses.replace(ops, fp8_linear=lambda x, layer, bias=None: x)
    ref = fp8_ops(gpu_without_fp8, "cpu")
    assert not ref.fold_split_k and ref.fp8_linear_sums is fp8.reference_linear_rows
    if HAS_TRITON:
        from rapidserve.ops import fp8_gpu, triton_fp8_fold, triton_fp8_skinny, triton_ops_bundle

        tri = triton_ops_bundle(skinny=True)
        assert tri.fold_split_k and tri.fp8_linear_sums is fp8_gpu.gpu_linear_sums
        assert tri.add_rms_norm_fp8_sums is triton_fp8_fold.add_rms_norm_fp8_sums
        assert tri.reduce_sums is triton_fp8_skinny.reduce_sums
        assert not unfused_ops(tri).fold_split_k and not unfused_fp8(tri).fold_split_k


# ------------------------------------------------------------------------------------------ the model's plumbing
def _torch_split_sums(splits: int) -> Callable[..., torch.Tensor | fp8.SplitSums]:
    """A torch `fp8_linear_sums` that splits K into `splits` slices and hands out their raw float32 sums (what the
    skinny kernel's split launch writes), for the model's plumbing on CPU."""
    def linear_sums(rows: fp8.QuantizedRows, layer: fp8.Fp8Linear, bias: torch.Tensor | None = None) -> fp8.SplitSums:
        k = rows.q.shape[1]
        per = -(-k // splits)
        x, w = rows.q.float(), layer.weight.float()
        ws = torch.stack([x[:, s:s + per] @ w[:, s:s + per].T for s in range(0, k, per)])
        return fp8.SplitSums(ws.contiguous(), rows.scale, layer.weight_scale, bias, rows.dtype)
    return linear_sums


FOLD_OPS = ("fp8_linear_sums", "add_rms_norm_fp8_sums", "reduce_sums", "add_rms_norm_fp8", "fp8_linear_rows")


def counting(ops: Ops, calls: Counter[str], names: tuple[str, ...] = FOLD_OPS) -> Ops:
    """`ops` with each of `names` counting its calls into `calls` (tests/test_w8a16_model.py counts its own)."""
    def count(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any) -> Any:
            calls[name] += 1
            return fn(*args)
        return wrapped
    return dataclasses.replace(ops, **{n: count(n, getattr(ops, n)) for n in names})


def _runner(preset: str) -> Any:
    from rapidserve.config_builder import build_engine_config
    from rapidserve.runner import ModelRunner

    cfg, source = build_engine_config(f"preset:{preset}", device="cpu", dtype="bfloat16", quantization="fp8",
                                      num_kv_blocks=16, enforce_eager=True)
    return ModelRunner(cfg, source, show_progress=False)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3", "tiny-gemma3"])
def test_layers_pass_split_sums_to_the_norms_that_read_them(preset: str) -> None:
    """A bundle whose fp8 GEMM of quantized rows splits K and hands out its sums: in a prefill down_proj's sums go to
    the next layer's input norm, in a decode step o_proj's (whose rows the attention quantized) to the post-attention
    norm too; never out of the last layer. The logits equal those of the same split GEMM reduced at once
    (`reduce_sums_reference`, then the norm) bit for bit, and the fold off calls none of it. Gemma 3 (its own layer
    halves) never asks for sums."""
    from rapidserve.runner import DecodeItem, PrefillItem

    runner = _runner(preset)
    layers = runner.model.cfg.num_layers
    split = _torch_split_sums(3)
    folding = dataclasses.replace(runner.model.ops, fold_split_k=True, fp8_linear_sums=split)
    at_once = dataclasses.replace(folding, fp8_linear_sums=lambda rows, layer, bias=None: fp8.reduce_sums_reference(
        split(rows, layer, bias)))
    prompts = [[(7 * i + 3) % 500 + 3 for i in range(21)], [(5 * i + 1) % 400 + 3 for i in range(9)]]
    tables = [[0, 1], [2]]
    steps = [DecodeItem(11, 21, tables[0]), DecodeItem(12, 9, tables[1])]
    out: dict[str, torch.Tensor] = {}
    for name, ops in (("fold", folding), ("at_once", at_once), ("off", no_split_fold(folding))):
        calls: Counter[str] = Counter()
        runner.model.ops = counting(ops, calls)
        out[name + "-prefill"] = runner.prefill([PrefillItem(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
        prefill = Counter(calls)
        out[name + "-decode"] = runner.decode(steps)  # the same slots written with the same values each time
        decode = calls - prefill
        if name == "off" or preset == "tiny-gemma3":
            assert calls["fp8_linear_sums"] == 0 and calls["add_rms_norm_fp8_sums"] == 0, (name, calls)
            continue
        assert prefill["fp8_linear_sums"] == layers - 1, prefill  # down_proj, but the last layer's
        assert decode["fp8_linear_sums"] == 2 * layers - 1, decode  # and o_proj's
        if name == "fold":
            assert prefill["add_rms_norm_fp8_sums"] == layers - 1, prefill
            assert prefill["add_rms_norm_fp8"] == layers, prefill  # o_proj of float rows: no sums
            assert decode["add_rms_norm_fp8_sums"] == 2 * layers - 1, decode
            assert decode["add_rms_norm_fp8"] == 0 and calls["reduce_sums"] == 0, decode
    for step in ("prefill", "decode"):
        assert torch.equal(out["fold-" + step], out["at_once-" + step]), step


def test_sums_a_norm_cannot_read_are_reduced_first() -> None:
    """A layer given sums whose input norm does not quantize (the fusion off: float rows for q|k|v) reduces them
    (`reduce_sums`) first, then the plain norm."""
    runner = _runner("tiny-llama")
    layer = runner.model.layers[1]
    calls: Counter[str] = Counter()
    ops = counting(unfused_fp8(runner.model.ops), calls)
    h = runner.model.cfg.hidden_size
    g = torch.Generator().manual_seed(3)
    sums = fp8.SplitSums(torch.randn(2, 3, h, generator=g), torch.rand(3, 1, generator=g), torch.rand(h, generator=g),
                         None, torch.bfloat16)
    residual = torch.randn(3, h, generator=g).to(torch.bfloat16)
    normed, res = layer.norm_for(ops, layer.qkv_proj, sums, residual, layer.input_layernorm)
    want = ops.add_rms_norm(fp8.reduce_sums_reference(sums), residual, layer.input_layernorm,
                            runner.model.cfg.rms_norm_eps)
    assert calls["reduce_sums"] == 1 and torch.equal(normed, want[0]) and torch.equal(res, want[1])


# --------------------------------------------------------------------------------------- the interpreter checks
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_fold_kernels_interpreter() -> None:
    """The fold's kernels under TRITON_INTERPRET=1 against the unfused launches (check_fold_kernels)."""
    run_interpreted(__file__, timeout=600)


def _same(got: tuple[fp8.QuantizedRows, torch.Tensor], want: tuple[fp8.QuantizedRows, torch.Tensor],
          label: object) -> None:
    (rows, res), (w_rows, w_res) = got, want
    assert rows.dtype == w_rows.dtype and torch.equal(res, w_res), label
    assert torch.equal(rows.scale, w_rows.scale), label
    assert torch.equal(rows.q.view(torch.uint8), w_rows.q.view(torch.uint8)), label


def check_fold_kernels() -> None:
    """At 1, 2 and 8 rows the gate folds (`gpu_linear_sums` hands out sums; the skinny kernel routed and planned
    with split tiles by patching, as a GPU's table would), at 17 it does not (the reduce launched, a tensor); the
    norm of the sums gives the reduce-then-norm bits. float16 rows: the interpreter's bf16 tl.dot is wrong."""
    from unittest import mock

    from rapidserve.ops import fp8_gpu, triton_fp8_fold, triton_fp8_fused, triton_fp8_skinny
    from rapidserve.ops.fp8_tiles import Fp8Tiles

    g = torch.Generator().manual_seed(7)
    n, k = 64, 128  # the norm's row (a GEMM's N) and the GEMM's K: split in 4 slices of 32
    dt16 = torch.float16

    def tiles(rows: int, weight: torch.Tensor, tables: object) -> Fp8Tiles:
        return Fp8Tiles(16 if rows <= 16 else 32, 32, 32, 4, 2, False, 4)

    for dt in (FN, FNUZ):
        layer = fp8.Fp8Linear(n, k, dt, "token", None, torch.device("cpu"))
        w8, s = fp8.quantize_weight(torch.randn(n, k, generator=g) / k**0.5, "channel", None, dt)
        layer.weight.copy_(w8)
        layer.weight_scale.copy_(s)
        norm_w = (1 + 0.1 * torch.randn(n, generator=g)).to(dt16)
        bias = torch.randn(n, generator=g).to(dt16)
        with mock.patch.object(triton_fp8_skinny, "routed_rows", lambda *a, **kw: True), \
                mock.patch.object(triton_fp8_skinny, "_planned", tiles):
            for m in (1, 2, 8, 17):
                x = (torch.randn(m, k, generator=g) * 3).to(dt16)
                rows = fp8.QuantizedRows(*fp8.quantize_input(x, "token", dt), dt16)
                r = torch.randn(m, n, generator=g).to(dt16)
                for b in (None, bias):
                    label = (dt, m, b is not None)
                    out = fp8_gpu.gpu_linear_sums(rows, layer, b)
                    want_x = fp8_gpu.gpu_linear_rows(rows, layer, b)  # the split launch, then the reduce kernel
                    if m > fold_table.entry_for(fold_table.FOLD_TABLE, "cpu").max_rows:  # the gate: off
                        assert isinstance(out, torch.Tensor) and torch.equal(out, want_x), label
                        continue
                    assert isinstance(out, fp8.SplitSums) and out.ws.shape == (4, m, n), label
                    assert torch.equal(triton_fp8_skinny.reduce_sums(out), want_x), label
                    assert torch.equal(fp8.reduce_sums_reference(out), want_x), label
                    for width in (None, 32, 16):  # one program a row; slices of the row
                        want = triton_fp8_fused.add_rms_norm_fp8(want_x, r, norm_w, 1e-6, dt, width)
                        got = triton_fp8_fold.add_rms_norm_fp8_sums(out, r, norm_w, 1e-6, dt, width)
                        _same(got, want, (label, width))
                    # a norm weight of another dtype: the unfused launches, the same numbers
                    w32 = norm_w.float()
                    _same(triton_fp8_fold.add_rms_norm_fp8_sums(out, r, w32, 1e-6, dt),
                          triton_fp8_fused.add_rms_norm_fp8(want_x, r, w32, 1e-6, dt), (label, "promoted"))
    empty = fp8.SplitSums(torch.zeros(2, 0, n), torch.zeros(0, 1), torch.ones(n), None, dt16)
    q, res = triton_fp8_fold.add_rms_norm_fp8_sums(empty, torch.zeros(0, n, dtype=dt16), norm_w, 1e-6, FN)
    assert q.q.shape == (0, n) and res.shape == (0, n)


# ----------------------------------------------------------------------------------- the reduction's layout (sm_90)
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_the_folded_norm_sums_in_the_unfused_kernels_layout() -> None:
    """Bit-exactness on the GPU rests on the sum of squares running over the same layout as triton_ops' RMSNorm
    kernel's: compiled for sm_90, each launch of the fold kernel (one program a row; slices) reduces in that layout
    (its amax too)."""
    from test_fp8_fused import _reduce_layouts

    (unfused,) = _reduce_layouts("_rms_norm_kernel", "sm_90", "bfloat16")
    variants = _reduce_layouts("_sums_rms_norm_fp8_kernel", "sm_90", "bfloat16", residual_only=False)
    assert len(unfused) == 1 and len(variants) == 2, (unfused, variants)
    for fused in variants:
        assert len(fused) == 2 and set(fused) == set(unfused), (unfused, fused)


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("set TRITON_INTERPRET=1 before running the interpreter checks")
    check_fold_kernels()
    print("fp8 fold kernels: ok")
