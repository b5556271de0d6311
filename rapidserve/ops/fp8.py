"""FP8 linear layers (issue 39): weights in float8 e4m3 with float32 scales, inputs quantized to fp8 at each call.

`Fp8Linear` holds one fused projection of a decoder layer (rapidserve/quant_config.py says which scheme):
- `weight` [N, K]: float8_e4m3fn; float8_e4m3fnuz on ROCm's gfx94x (`fp8_dtype`), whose fp8 has no negative zero
  and an exponent bias one larger: the same bits are half the value, so a checkpoint's e4m3fn weight is stored
  bit for bit (-0 made +0) with its scales doubled (`to_fnuz`), and dequantizes to the same numbers;
- `weight_scale` float32: [N], one per output row (a checkpoint's per-tensor scales repeated over the rows of
  their projection, so q|k|v keep their three scales without requantizing), or [ceil(N / bn), ceil(K / bk)], one
  per (bn x bk) block (`block`);
- `input_scale` float32 [1]: static activations only (the largest of the fused projections' calibrated scales).

The math, which every path computes (up to the order of float32 sums):
    x8, sx = quantize_input(x)                    x8 = fp8(clamp(x / sx, -fp8_max, fp8_max)), sx per token /
                                                  tensor / token-group (the scheme's activations)
    y[m, n] = sum_k (x8[m, k] sx[m, k]) (w8[n, k] sw[n, k]) (+ bias[n])   sx, sw broadcast over what they cover
The paths (`Ops.fp8_linear`, rapidserve/ops/__init__.py; the GPU ones routed by `fp8_gpu.gpu_linear`):
- `reference_linear`: dequantizes x8 and the weight to the compute dtype and calls F.linear. CPU, and GPUs
  without fp8 (`fp8_supported`): the definition the CPU tests check against.
- `scaled_mm_linear`: per-row scales (weights) x per-token or per-tensor scales (activations) through
  `torch._scaled_mm`'s row-wise scaling (cuBLASLt / CUTLASS on sm_89+, hipBLASLt on MI300): fp8 products
  accumulated in float32, scaled in its epilogue, bfloat16 out.
- `triton_fp8.block_linear`: 128x128-style block scales (`gpu_linear` routes them there).
- `triton_fp8_skinny.skinny_fp8_linear`: decode's calls of at most 64 rows with per-token activations and per-row
  weight scales on NVIDIA (`gpu_linear` routes them there by `triton_fp8_skinny.plan`: 1-16 rows by the untuned
  rule, 17-64 where this GPU's measured table says so): one kernel that quantizes x as `quantize_input` does and
  multiplies fp8 by fp8 (cuBLASLt's fp8 GEMMs read small-M weights at well under the memory bandwidth:
  bench/results/fp8_linear_probe.md).

Rows already quantized per token (`QuantizedRows`, by the fused RMSNorm / SiLU-and-mul of ops/triton_fp8_fused.py
or `quantize_rows`) go through `reference_linear_rows` / `fp8_gpu.gpu_linear_rows`: the same routes on the same
numbers, for the layers that `takes_rows` (per-token activations, per-row weight scales).

W8A16 (ops/triton_w8a16.py, NVIDIA, where ops/w8a16_table.json says: on the H200, measured 2026-12-01,
never: it lost to W8A8 at every batch 1-64) takes the same per-row
scaled weights without quantizing the activations: the rows in fp16 (`to_half`: saturated at HALF_MAX), float16 by
float16 products of the widened weight, out[m, n] = (sum_k x16[m, k] w8[n, k]) * sw[n] (`reference_linear_half`);
its producers write `HalfRows` (fp16 rows, the rows' dtype) instead of `QuantizedRows`.

Activations are quantized by the same math on every path (per-token ones on a GPU by one Triton kernel,
`triton_fp8.quantize_tokens`, equal up to the device's float32 division), so only the GEMM differs. Nothing
reads a device value on the host: every path is CUDA-graph safe.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from rapidserve.config_base import ConfigError

FP8_E4M3FN = torch.float8_e4m3fn
FP8_E4M3FNUZ = torch.float8_e4m3fnuz
MIN_AMAX = 1e-12  # a row (or group, tensor) of zeros gets this amax, not a 0 scale (0 / 0)
HALF_MAX = 65504.0  # float16's largest finite value: W8A16's activations saturate there (`to_half`)


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of the fp8 format: 448 (e4m3fn), 240 (e4m3fnuz)."""
    return float(torch.finfo(dtype).max)


def _rocm_arch(device: torch.device) -> str:
    return str(getattr(torch.cuda.get_device_properties(device), "gcnArchName", ""))


def fp8_dtype(device: torch.device | str) -> torch.dtype:
    """The fp8 weight format on `device`: e4m3fnuz on ROCm's gfx94x (MI300), e4m3fn everywhere else (CPU, NVIDIA,
    gfx950's OCP fp8)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.version.hip is not None and _rocm_arch(device).startswith("gfx94"):
        return FP8_E4M3FNUZ
    return FP8_E4M3FN


def fp8_supported(device: torch.device | str) -> bool:
    """Whether `device` multiplies fp8 in hardware: NVIDIA sm_89+ (Ada, Hopper, Blackwell), AMD gfx94x / gfx95x.
    Elsewhere fp8 layers run `reference_linear` (CPU, and older GPUs)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if torch.version.hip is not None:
        return _rocm_arch(device).startswith(("gfx94", "gfx95"))
    return torch.cuda.get_device_capability(device) >= (8, 9)


FP8_NEEDS = ("fp8 support (NVIDIA compute capability 8.9 or later: Ada, Hopper, Blackwell; AMD MI300 / gfx94x and "
             "later)")  # what an error on a GPU without fp8 says it needs (`fp8_device_problem`)


def fp8_device_problem(device: torch.device | str) -> str | None:
    """What stands in the way of fp8 on `device`, for an error message: a GPU without fp8 (`fp8_supported`) named
    with its compute capability ("NVIDIA A100-SXM4-80GB has compute capability 8.0") or, on ROCm, as having none;
    None for a GPU with fp8 and for the CPU (which runs fp8 layers as `reference_linear` and stores an fp8 KV cache
    as it is). Callers refuse with it before anything loads (kv_pool.check_fp8_kv_device, config_builder)."""
    device = torch.device(device)
    if device.type != "cuda" or fp8_supported(device):
        return None
    name = torch.cuda.get_device_name(device)
    if torch.version.hip is not None:
        return f"{name} has no fp8"
    major, minor = torch.cuda.get_device_capability(device)
    return f"{name} has compute capability {major}.{minor}"


def check_fp8_weights_device(device: torch.device, enabled: bool, scheme: str, from_checkpoint: bool) -> None:
    """ConfigError when fp8 weights (`enabled`; `scheme`: the quantization section's description) would run on a GPU
    without fp8 (`fp8_device_problem`: NVIDIA before sm_89, AMD before gfx94x), before any weight is read.
    rapidserve has no weight-only fp8 GEMM for such GPUs (vLLM runs one with Marlin kernels), and dequantizing every
    weight at each call would serve, without a word, at a fraction of bf16's speed; so it says so. The CPU runs fp8
    layers dequantized (`reference_linear`) and is let by."""
    if not enabled or (has := fp8_device_problem(device)) is None:
        return
    if from_checkpoint:
        what, fix = (f"the model is an FP8 checkpoint ({scheme})",
                     "serve the model's bf16 original on this GPU, or this checkpoint on a GPU with fp8")
    else:
        what, fix = "--quantization fp8", "drop --quantization fp8 to serve the model in its own dtype on this GPU"
    raise ConfigError(f"{what}: {has}, and rapidserve's fp8 GEMMs need {FP8_NEEDS} (it has no weight-only fp8 path "
                      f"for older GPUs); {fix}")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Fp8Linear(nn.Module):
    """One fp8 projection's tensors (module docstring): `weight` [N, K] fp8, `weight_scale` float32 ([N], or
    [ceil(N / bn), ceil(K / bk)] with `block`), `input_scale` float32 [1] with static activations (else None).
    `activations`: quant_config's ("token", "tensor", "static", "group")."""

    def __init__(self, n: int, k: int, fp8: torch.dtype, activations: str, block: tuple[int, int] | None,
                 device: torch.device) -> None:
        super().__init__()
        self.activations, self.block = activations, block
        self.weight = nn.Parameter(torch.empty((n, k), dtype=fp8, device=device), requires_grad=False)
        scale = (n,) if block is None else (cdiv(n, block[0]), cdiv(k, block[1]))
        self.weight_scale = nn.Parameter(torch.empty(scale, dtype=torch.float32, device=device), requires_grad=False)
        self.input_scale: nn.Parameter | None
        if activations == "static":
            self.input_scale = nn.Parameter(torch.empty(1, dtype=torch.float32, device=device), requires_grad=False)
        else:
            self.register_parameter("input_scale", None)

    @property
    def group(self) -> int | None:
        """Input columns per activation scale ("group" activations)."""
        return self.block[1] if self.activations == "group" and self.block is not None else None

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as numbers, w8 * scale, in `dtype` (computed in float32)."""
        return dequantize_weight(self.weight, self.weight_scale, self.block).to(dtype)

    def extra_repr(self) -> str:
        n, k = self.weight.shape
        return f"{n}x{k} {self.weight.dtype}, block={self.block}, activations={self.activations}"


def expand_scale(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int] | None) -> torch.Tensor:
    """A weight scale ([N] per row, or [ceil(N/bn), ceil(K/bk)] per block) as a float32 [rows, cols] broadcastable
    to the weight: [N, 1] per row, the block scales repeated over their blocks (cut at the edges)."""
    if block is None:
        return scale.float().reshape(-1, 1)
    bn, bk = block
    return scale.float().repeat_interleave(bn, 0)[:rows].repeat_interleave(bk, 1)[:, :cols]


def dequantize_weight(w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """w8 * scale in float32 (scale as `expand_scale` lays it out)."""
    return w8.float() * expand_scale(scale, w8.shape[0], w8.shape[1], block)


def quantize_input(x: torch.Tensor, activations: str, fp8: torch.dtype, input_scale: torch.Tensor | None = None,
                   group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as (x8 [M, K] fp8, scale float32): scale [M, 1] ("token"), [1, 1] ("tensor", "static": the given
    `input_scale`), [M, ceil(K / group)] ("group"). x8 = fp8(clamp(x / scale, +-fp8_max)), scale = amax / fp8_max
    over what it covers (amax at least MIN_AMAX), formed as amax * (1 / fp8_max) in float32 (CUDA torch divides
    a tensor by a scalar that way and the CPU does not: the explicit product is the same bits on every device and
    in the Triton kernels). Pure torch: the same numbers on every device."""
    xf = x.float()
    top = fp8_max(fp8)
    if activations == "static":
        if input_scale is None:
            raise ValueError("static fp8 activations need the layer's input_scale")
        scale = input_scale.float().reshape(1, 1)
        return (xf / scale).clamp(-top, top).to(fp8), scale
    if activations == "token":
        scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX) * (1.0 / top)
        return (xf / scale).clamp(-top, top).to(fp8), scale
    if activations == "tensor":
        scale = xf.abs().amax().clamp(min=MIN_AMAX).reshape(1, 1) * (1.0 / top)
        return (xf / scale).clamp(-top, top).to(fp8), scale
    if activations != "group" or group is None:
        raise ValueError(f"fp8 activations {activations!r} (group={group}): use token, tensor, static or group")
    m, k = xf.shape
    groups = cdiv(k, group)
    padded = F.pad(xf, (0, groups * group - k)).reshape(m, groups, group)
    scale = padded.abs().amax(dim=-1).clamp(min=MIN_AMAX) * (1.0 / top)  # [M, groups]
    x8 = (padded / scale.unsqueeze(-1)).clamp(-top, top).reshape(m, groups * group)[:, :k]
    return x8.contiguous().to(fp8), scale


def dequantize_input(x8: torch.Tensor, scale: torch.Tensor, group: int | None) -> torch.Tensor:
    """x8 * scale in float32 (scale as `quantize_input` made it)."""
    if group is None:
        return x8.float() * scale
    return x8.float() * scale.repeat_interleave(group, 1)[:, :x8.shape[1]]


def quantize_weight(w: torch.Tensor, weights: str, block: tuple[int, int] | None,
                    fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] as (w8, scale) with scale = amax / fp8_max over each row ("channel": [N]), the whole
    tensor ("tensor": [1]) or each block ("block": [ceil(N/bn), ceil(K/bk)]): `--quantization fp8` and dummy
    weights of an fp8 scheme. w8 = fp8(clamp(w / scale, +-fp8_max))."""
    wf = w.float()
    top = fp8_max(fp8)
    if weights == "channel":
        scale = wf.abs().amax(dim=1).clamp(min=MIN_AMAX) / top
    elif weights == "tensor":
        scale = wf.abs().amax().clamp(min=MIN_AMAX).reshape(1) / top
    elif weights == "block" and block is not None:
        n, k = wf.shape
        bn, bk = block
        padded = F.pad(wf, (0, cdiv(k, bk) * bk - k, 0, cdiv(n, bn) * bn - n))
        tiles = padded.reshape(cdiv(n, bn), bn, cdiv(k, bk), bk)
        scale = tiles.abs().amax(dim=(1, 3)).clamp(min=MIN_AMAX) / top
    else:
        raise ValueError(f"fp8 weight scales {weights!r} (block={block}): use channel, tensor or block")
    full = scale.reshape(1, 1) if weights == "tensor" else expand_scale(scale, wf.shape[0], wf.shape[1], block)
    return (wf / full).clamp(-top, top).to(fp8), scale


def to_fnuz(w8: torch.Tensor) -> torch.Tensor:
    """e4m3fn bits as e4m3fnuz (ROCm's gfx94x): the same bits, -0 (0x80, NaN in fnuz) made +0 and e4m3fn's NaNs
    (0x7f, 0xff: +-240 in fnuz) made fnuz's NaN (0x80). Each value is half the e4m3fn one, so the caller doubles the
    scales: w8 * s is unchanged."""
    if w8.dtype != FP8_E4M3FN:
        raise ValueError(f"to_fnuz takes float8_e4m3fn, got {w8.dtype}")
    bits = w8.view(torch.int8)
    bits = torch.where(bits == -128, torch.zeros_like(bits), bits)
    return torch.where((bits & 0x7F) == 0x7F, torch.full_like(bits, -128), bits).view(FP8_E4M3FNUZ)


def reference_linear(x: torch.Tensor, layer: Fp8Linear, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The definition (module docstring): x quantized as the scheme says, x8 and the weight dequantized to x's
    dtype, F.linear. Runs anywhere; on a GPU it writes the dequantized weight each call (slow)."""
    x8, sx = quantize_input(x, layer.activations, layer.weight.dtype, layer.input_scale, layer.group)
    return _dequantized_linear(x8, sx, layer, x.dtype, bias)


def _dequantized_linear(x8: torch.Tensor, sx: torch.Tensor, layer: Fp8Linear, dtype: torch.dtype,
                        bias: torch.Tensor | None) -> torch.Tensor:
    xq = dequantize_input(x8, sx, layer.group).to(dtype)
    return F.linear(xq, layer.dequantized(dtype), bias)


class QuantizedRows(NamedTuple):
    """Rows already quantized per token (issue 39's fusion: the op that makes a projection's input, RMSNorm or
    SiLU-and-mul, writes them): `q` [M, K] fp8 and `scale` [M, 1] float32, `quantize_input(x, "token", fp8)`'s
    numbers for the rows x it would have written, and `dtype`, x's dtype (the projection's output dtype)."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


class SplitSums(NamedTuple):
    """A split-K fp8 GEMM's output before its reduce (issue 39: `triton_fp8_skinny` hands these to the RMSNorm that
    reads them, `ops/triton_fp8_fold.py`, instead of launching its reduce kernel): `ws` [S, M, N] float32, the raw
    sums of each K slice s; `sx` [M, 1] float32 the rows' activation scales; `sw` [N] float32 the weight's scales;
    `bias` [N] or None; `dtype` the output's. Its value is `reduce_sums_reference`'s: the slices added in the order
    0, 1, ..., S - 1, times sx[m], times sw[n] (+ bias[n] after a rounding to `dtype`), in `dtype`: the reduce
    kernel's numbers."""

    ws: torch.Tensor
    sx: torch.Tensor
    sw: torch.Tensor
    bias: torch.Tensor | None
    dtype: torch.dtype


def reduce_sums_reference(sums: SplitSums) -> torch.Tensor:
    """The [M, N] output that `sums` stand for (its docstring), in torch: the same float32 operations in the same
    order as the reduce kernel's (`triton_fp8_skinny._fp8_split_reduce_kernel`)."""
    acc = sums.ws[0].clone()
    for s in range(1, sums.ws.shape[0]):
        acc = acc + sums.ws[s]
    acc = acc * sums.sx.reshape(-1, 1) * sums.sw.reshape(1, -1)
    if sums.bias is not None:
        acc = acc.to(sums.dtype).float() + sums.bias.float()
    return acc.to(sums.dtype)


def to_half(x: torch.Tensor) -> torch.Tensor:
    """x as W8A16's activations (ops/triton_w8a16.py): float16, clamped to +-HALF_MAX first (a saturating cast, as
    e4m3's is at 448), rounded to nearest even; x of float16 unchanged."""
    return x if x.dtype == torch.float16 else x.float().clamp(-HALF_MAX, HALF_MAX).to(torch.float16)


class HalfRows(NamedTuple):
    """W8A16's input rows (ops/triton_w8a16.py) as the op before the projection wrote them (the RMSNorm, gate|up's
    SiLU-and-mul epilogue): `x` [M, K] float16, `to_half` of the rows it would have written in `dtype`, and `dtype`,
    the rows' own dtype (the projection's output dtype). No scale: fp16 holds the values themselves."""

    x: torch.Tensor
    dtype: torch.dtype


def half_rows(x: torch.Tensor) -> HalfRows:
    """x as `HalfRows` (`to_half`): the reference of the ops that write them (torch_ops' `*_half`)."""
    return HalfRows(to_half(x), x.dtype)


def reference_linear_half(x: torch.Tensor | HalfRows, layer: Fp8Linear, bias: torch.Tensor | None = None
                          ) -> torch.Tensor:
    """W8A16 (ops/triton_w8a16.py) of float rows x [M, K] (or `HalfRows`) through a per-row-scaled fp8 layer:
    out[m, n] = (sum_k to_half(x)[m, k] w8[n, k]) * sw[n] (+ bias[n] after a rounding to the rows' dtype), float32
    sums, out in the rows' dtype: the kernel's numbers up to the order of its float32 sums. No activation scale and no
    quantizer: fp16's 10 mantissa bits against e4m3's 3."""
    if layer.block is not None or layer.weight_scale.dim() != 1:
        raise ValueError(f"W8A16 takes per-row weight scales; got {layer.extra_repr()}")
    rows = x if isinstance(x, HalfRows) else half_rows(x)
    acc = F.linear(rows.x.float(), layer.weight.float()) * layer.weight_scale.float()
    if bias is not None:
        acc = acc.to(rows.dtype).float() + bias.float()
    return acc.to(rows.dtype)


def quantize_rows(x: torch.Tensor, fp8: torch.dtype) -> QuantizedRows:
    """x [M, K] quantized per token (`quantize_input(x, "token", fp8)`) as `QuantizedRows`: the reference of the
    fused ops (torch_ops' `*_fp8`)."""
    x8, sx = quantize_input(x, "token", fp8)
    return QuantizedRows(x8, sx, x.dtype)


def takes_rows(layer: Fp8Linear) -> bool:
    """Whether `layer` takes `QuantizedRows` (`reference_linear_rows`, `fp8_gpu.gpu_linear_rows`): dynamic
    per-token activations and per-row weight scales, the scheme whose input quantization the op before it can
    do. Static or per-tensor activation scales and block weight scales (per-token-group activations) quantize
    their input themselves."""
    return layer.activations == "token" and layer.block is None


def reference_linear_rows(rows: QuantizedRows, layer: Fp8Linear, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`reference_linear` of the rows x that `rows` quantize (the same numbers: quantizing is all that moved out),
    out in rows.dtype. ValueError for a layer that does not `takes_rows` or rows of another fp8 format or width."""
    check_rows(rows, layer)
    return _dequantized_linear(rows.q, rows.scale, layer, rows.dtype, bias)


def check_rows(rows: QuantizedRows, layer: Fp8Linear) -> None:
    """ValueError naming what does not fit unless `layer` `takes_rows` these rows (its fp8 format, its K columns,
    one float32 scale a row)."""
    n, k = layer.weight.shape
    if not takes_rows(layer):
        raise ValueError(f"pre-quantized rows feed per-token fp8 layers with per-row weight scales, not "
                         f"{layer.extra_repr()}: pass the float rows")
    q, s = rows.q, rows.scale
    if q.dim() != 2 or q.shape[1] != k or q.dtype != layer.weight.dtype or s.dtype != torch.float32 \
            or tuple(s.shape) != (q.shape[0], 1):
        raise ValueError(f"quantized rows for a {n}x{k} {layer.weight.dtype} layer must be q [M, {k}] of that dtype "
                         f"and scale [M, 1] float32; got q {tuple(q.shape)} {q.dtype}, scale {tuple(s.shape)} "
                         f"{s.dtype}")


__all__ = ["FP8_E4M3FN", "FP8_E4M3FNUZ", "FP8_NEEDS", "Fp8Linear", "HALF_MAX", "HalfRows", "MIN_AMAX", "QuantizedRows",
           "SplitSums", "check_fp8_weights_device", "check_rows", "dequantize_input", "dequantize_weight",
           "expand_scale", "fp8_device_problem", "fp8_dtype", "fp8_max", "fp8_supported", "half_rows", "quantize_input",
           "quantize_rows", "quantize_weight", "reduce_sums_reference", "reference_linear", "reference_linear_half",
           "reference_linear_rows", "takes_rows", "to_fnuz", "to_half"]
