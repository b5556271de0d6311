"""How a decoder layer calls its projections (transformer.py, gemma3.py): a projection is a float weight or an fp8
`ops.fp8.Fp8Linear` (issue 39), and its input is float rows or, for an fp8 projection with dynamic per-token
activations and per-row weight scales, rows that the op before it (RMSNorm, SiLU-and-mul, a decode step's
attention for o_proj) already quantized (`fused_fp8`, `ops.fp8.QuantizedRows`): the same numbers as the projection's
own quantizer, one launch and one pass over the rows fewer.
"""

from __future__ import annotations

import torch
from torch import nn

from rapidserve.ops import Ops
from rapidserve.ops.fp8 import Fp8Linear, QuantizedRows, takes_rows

Weight = nn.Parameter | Fp8Linear  # a projection: float, or fp8 with its scales
Rows = torch.Tensor | QuantizedRows  # a projection's input: float rows, or rows its producer quantized (fused_fp8)


def fused_fp8(ops: Ops, w: Weight | None) -> torch.dtype | None:
    """The fp8 format in which the op that makes projection `w`'s input quantizes it (RMSNorm, SiLU-and-mul: the
    bundle's `*_fp8` ops), or None where `w` takes float rows: the fusion is on (`ops.fuse_fp8`) and `w` is fp8 with
    dynamic per-token activations and per-row weight scales (`fp8.takes_rows`). Static or per-tensor activation
    scales, block weight scales, float projections (and MoE experts, w None) keep the float rows."""
    if ops.fuse_fp8 and isinstance(w, Fp8Linear) and takes_rows(w):
        return w.weight.dtype
    return None


def attention_rows(o: torch.Tensor | QuantizedRows, width: int) -> Rows:
    """Attention's output as the o projection's input rows [T, width]: the float output [T, heads, head_dim] (or
    [T, width]) reshaped, or the rows a decode step's attention already quantized for it (`attention.attend`'s
    `out_fp8`, which the layer passes where `fused_fp8` says the projection takes them)."""
    return o if isinstance(o, QuantizedRows) else o.reshape(o.shape[0], width)


def linear(ops: Ops, x: Rows, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ bias) by the bundle's op for `w` and x: float, fp8, or fp8 of quantized rows."""
    if isinstance(x, QuantizedRows):
        assert isinstance(w, Fp8Linear)  # only fused_fp8's projections are given quantized rows
        return ops.fp8_linear_rows(x, w, bias)
    return ops.fp8_linear(x, w, bias) if isinstance(w, Fp8Linear) else ops.linear(x, w, bias)


def mlp(ops: Ops, x: Rows, gate_up: Weight, down: Weight) -> torch.Tensor:
    """down(silu(gate) * up) of the (normed) rows x; with an fp8 gate|up, SiLU-and-mul quantizes its output for
    `down` where `fused_fp8` says so."""
    if not isinstance(gate_up, Fp8Linear):
        assert not isinstance(x, QuantizedRows)
        return linear(ops, ops.linear_silu_and_mul(x, gate_up), down)
    h = linear(ops, x, gate_up)
    fp8 = fused_fp8(ops, down)
    return linear(ops, ops.silu_and_mul(h) if fp8 is None else ops.silu_and_mul_fp8(h, fp8), down)


__all__ = ["Rows", "Weight", "attention_rows", "fused_fp8", "linear", "mlp"]
