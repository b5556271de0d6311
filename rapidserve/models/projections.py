"""How a decoder layer calls its projections (decoder_layer.py, gemma3.py): a projection is a float weight or an fp8
`ops.fp8.Fp8Linear` (issue 39), and its input is float rows or, for an fp8 projection with dynamic per-token
activations and per-row weight scales, rows that the op before it (RMSNorm, SiLU-and-mul, a decode step's
attention for o_proj) already quantized (`fused_fp8`, `ops.fp8.QuantizedRows`): the same numbers as the projection's
own quantizer, one launch and one pass over the rows fewer. A projection whose output only the next RMSNorm reads
(o_proj, down_proj) may hand that norm its split-K sums unreduced (`linear_sums`, ops/fold_table.py): the norm adds
them (`Ops.add_rms_norm_fp8_sums`), one launch fewer again. A projection that runs W8A16 at the step's rows
(`Ops.w8a16`, ops/triton_w8a16.py: fp8 weights, fp16 rows, no per-token scale) takes fp16 rows from the plain
producers instead (`fused_fp8` of those rows says float16: the RMSNorm and a decode step's attention write
`fp8.HalfRows`), and an MLP whose gate|up and down both do takes SiLU-and-mul in gate|up's epilogue
(`Ops.fp8_linear_silu_and_mul`, `HalfRows` out), as the bf16 path does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from rapidserve.ops import Ops
from rapidserve.ops.fp8 import Fp8Linear, HalfRows, QuantizedRows, SplitSums, takes_rows

Weight = nn.Parameter | Fp8Linear  # a projection: float, or fp8 with its scales
# a projection's input: float rows, rows its producer quantized, or W8A16's fp16 rows (fused_fp8)
Rows = torch.Tensor | QuantizedRows | HalfRows
HALF = torch.float16  # `fused_fp8`'s format for a W8A16 projection
HALF_SOURCES = (torch.bfloat16, torch.float16)  # the model dtypes whose rows W8A16 takes (triton_w8a16.half_ok)
Hidden = torch.Tensor | SplitSums  # a projection's output, or a split-K fp8 GEMM's unreduced sums (`linear_sums`)


def fused_fp8(ops: Ops, w: Weight | None, rows: int | None = None,
              dtype: torch.dtype | None = None) -> torch.dtype | None:
    """The format in which the op that makes projection `w`'s input writes it, where the fusion is on
    (`ops.fuse_fp8`) and `w` is fp8 with dynamic per-token activations and per-row weight scales (`fp8.takes_rows`):
    float16 (`HALF`: `fp8.HalfRows`, the bundle's `*_half` ops) where `w` runs W8A16 at the call's `rows` of
    `dtype` (`ops.w8a16`; rows None: not asked; W8A16's GEMM takes bf16 / fp16 models' rows only, so a float32
    model's producers quantize as before), else its fp8 format (quantized rows, the `*_fp8` ops). None where `w` takes
    float rows: static or per-tensor activation scales, block weight scales, float projections (and MoE experts, w
    None)."""
    if ops.fuse_fp8 and isinstance(w, Fp8Linear) and takes_rows(w):
        return HALF if rows and dtype in HALF_SOURCES and ops.w8a16(rows, w) else w.weight.dtype
    return None


def quantized_fp8(fmt: torch.dtype | None) -> torch.dtype | None:
    """`fused_fp8`'s format where it is an fp8 one, else None (for a producer that only quantizes: SiLU-and-mul after
    a gate|up that is not W8A16, whose W8A16 down then takes its float rows)."""
    return None if fmt == HALF else fmt


def attention_rows(o: torch.Tensor | QuantizedRows | HalfRows, width: int) -> Rows:
    """Attention's output as the o projection's input rows [T, width]: the float output [T, heads, head_dim] (or
    [T, width]) reshaped, or the rows a decode step's attention already wrote for it (`attention.attend`'s `out_fp8`,
    which the layer passes where `fused_fp8` says the projection takes them: quantized, or W8A16's fp16 rows)."""
    return o if isinstance(o, QuantizedRows | HalfRows) else o.reshape(o.shape[0], width)


def linear(ops: Ops, x: Rows, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ bias) by the bundle's op for `w` and x: float, fp8, or fp8 of quantized rows."""
    if isinstance(x, QuantizedRows):
        assert isinstance(w, Fp8Linear)  # only fused_fp8's projections are given quantized rows
        return ops.fp8_linear_rows(x, w, bias)
    if isinstance(x, HalfRows):
        assert isinstance(w, Fp8Linear)  # and W8A16's fp16 rows
        return ops.fp8_linear_half(x, w, bias)
    return ops.fp8_linear(x, w, bias) if isinstance(w, Fp8Linear) else ops.linear(x, w, bias)


def linear_sums(ops: Ops, x: Rows, w: Weight, bias: torch.Tensor | None = None) -> Hidden:
    """`linear`, whose output only an RMSNorm reads (`norm_input`): where the bundle folds split-K reduces
    (`ops.fold_split_k`) and x is quantized rows of an fp8 `w`, `ops.fp8_linear_sums` (a split-K skinny GEMM's sums
    unreduced at the rows ops/fold_table.py takes, else the output)."""
    if ops.fold_split_k and isinstance(x, QuantizedRows) and isinstance(w, Fp8Linear):
        return ops.fp8_linear_sums(x, w, bias)
    return linear(ops, x, w, bias)


MLP_ROW_CHUNK = 8192  # a step of more rows runs its MLP on row slices of this many (`by_row_chunks`): see there


def row_count(x: Rows) -> int:
    return x.q.shape[0] if isinstance(x, QuantizedRows) else x.x.shape[0] if isinstance(x, HalfRows) else x.shape[0]


def row_slice(x: Rows, a: int, b: int) -> Rows:
    """Rows a..b of x, in x's own form (a quantized row keeps its scale)."""
    if isinstance(x, QuantizedRows):
        return QuantizedRows(x.q[a:b], x.scale[a:b], x.dtype)
    if isinstance(x, HalfRows):
        return HalfRows(x.x[a:b], x.dtype)
    return x[a:b]


def by_row_chunks(x: Rows, fn: Callable[[Rows], torch.Tensor], chunk: int | None = None) -> torch.Tensor:
    """fn(x), where fn maps each row on its own (an MLP), computed on slices of at most `chunk` rows into one output.
    Why: an MLP's intermediate rows ([T, 2I] of gate|up, [T, I] after SiLU-and-mul) are a step's largest
    activations, and the KV pool's budget keeps a step's activation peak once per step-running process
    (runner/kv_budget.py): at 8192 tokens the Llama-3.1-70B shape's bf16 gate|up output alone is 0.88 GiB. The chunk
    is 8192, not smaller: on the H200 (2026-12-02, bench/mlp_slices_ab.py, bench/results/h200_1202b) slices of 2048
    rows saved 0.29-0.70 GiB of an 8192-token step's peak (Qwen3-8B bf16 / fp8, Llama-3.1-70B fp8) but cost 0.7-2.0%
    of its prefill time (the extra launches and the copy into the output, one pass over [T, hidden]): a worse trade
    than the KV tokens it buys, so steps of the default token budgets run whole and only larger ones are sliced.
    `chunk` None: `MLP_ROW_CHUNK`."""
    chunk = MLP_ROW_CHUNK if chunk is None else chunk
    rows = row_count(x)
    if rows <= chunk:
        return fn(x)
    out: torch.Tensor | None = None
    for a in range(0, rows, chunk):
        part = fn(row_slice(x, a, min(rows, a + chunk)))
        if out is None:
            out = part.new_empty((rows, *part.shape[1:]))
        out[a:a + part.shape[0]].copy_(part)
        del part
    assert out is not None
    return out


def row_wise(w: Weight) -> bool:
    """Whether `w`'s output rows each depend on their own input row only: float, or fp8 with static, per-token or
    per-token-group activation scales (not one dynamic scale over the step's rows)."""
    return not isinstance(w, Fp8Linear) or w.activations != "tensor"


def mlp(ops: Ops, x: Rows, gate_up: Weight, down: Weight, sums: bool = False) -> Hidden:
    """down(silu(gate) * up) of the (normed) rows x; with an fp8 gate|up, SiLU-and-mul quantizes its output for
    `down` where `fused_fp8` says so. `sums`: the output is read by an RMSNorm only (`linear_sums`). More than
    `MLP_ROW_CHUNK` rows: by row slices (`by_row_chunks`; no split sums there, a split-K GEMM is a decode step's),
    unless a projection takes one dynamic activation scale over all the rows ("tensor": a slice's would differ)."""
    if row_count(x) > MLP_ROW_CHUNK and row_wise(gate_up) and row_wise(down):
        return by_row_chunks(x, lambda part: _mlp(ops, part, gate_up, down, sums=False))
    return _mlp(ops, x, gate_up, down, sums)


def _mlp(ops: Ops, x: Rows, gate_up: Weight, down: Weight, sums: bool) -> Hidden:
    down_linear = linear_sums if sums else linear
    if not isinstance(gate_up, Fp8Linear):
        assert not isinstance(x, QuantizedRows)
        return down_linear(ops, ops.linear_silu_and_mul(x, gate_up), down)
    rows = row_count(x)
    fmt = fused_fp8(ops, down, rows, x.dtype)
    if fmt == HALF and not isinstance(x, QuantizedRows) and ops.w8a16(rows, gate_up):
        # W8A16 both: SiLU-and-mul in gate|up's epilogue, written as down's fp16 rows
        return down_linear(ops, ops.fp8_linear_silu_and_mul(x, gate_up), down)
    h = linear(ops, x, gate_up)
    fp8 = quantized_fp8(fmt)  # a W8A16 down after a W8A8 gate|up takes SiLU-and-mul's float rows
    act = ops.silu_and_mul(h) if fp8 is None else ops.silu_and_mul_fp8(h, fp8)
    del h  # gate|up's [T, 2I] rows are dead: not held through down's GEMM (a step's activation peak is KV memory)
    return down_linear(ops, act, down)


def norm_input(ops: Ops, hidden: Hidden) -> torch.Tensor:
    """`hidden` as a tensor for a consumer that cannot add split sums itself (`ops.reduce_sums`: the reduce launch
    `linear_sums` left out)."""
    return ops.reduce_sums(hidden) if isinstance(hidden, SplitSums) else hidden


__all__ = ["HALF", "MLP_ROW_CHUNK", "Hidden", "Rows", "Weight", "attention_rows", "by_row_chunks", "fused_fp8",
           "linear", "linear_sums", "mlp", "norm_input", "quantized_fp8", "row_count", "row_slice",
           "row_wise"]
