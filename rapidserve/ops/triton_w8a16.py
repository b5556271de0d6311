"""W8A16 decode GEMMs (issue 39, route (c) of bench/results/issue39.md): fp8 (e4m3) weights with per-output-row scales,
the activations in fp16 with no per-token scale, on the skinny fp8 kernel (ops/triton_fp8_skinny.py, its `A16` form).

Why: at batch 1 on the H200 the fp8 decode step paid ~600 us a step more than bf16 in the kernels that quantize each
projection's input per token (the RMSNorm's amax and e4m3 cast, the attention reduce's, SiLU-and-mul's), while its
weight reads were 1.51x faster. W8A16 needs no quantizer, so its producers are the bf16 path's kernels: the RMSNorm's
plain launch writes its output in fp16 (`rms_norm_half`, `add_rms_norm_half`: `fp8.HalfRows`), gate|up takes
SiLU-and-mul in its epilogue and writes down's fp16 rows (`w8a16_linear_silu_and_mul`, as the bf16 skinny kernel
fuses it), and a decode step's attention reduce writes o_proj's fp16 rows beside its output
(`triton_paged_decode.decode_attention_fp8(out_fp8=float16)`; with one split, no reduce kernel: o_proj takes the float
output and casts it to fp16 in the GEMM's registers, CAST_X, as it does any float rows).

The math (`fp8.reference_linear_half`, up to the order of float32 sums):
    x16 = fp16(clamp(x, -65504, 65504))      x the bf16 rows the producer computes, saturated at fp16's max as e4m3's
                                             cast is at 448 (an fp16 model's rows are fp16 already: as they are)
    out[m, n] = (sum_k x16[m, k] w8[n, k]) * sw[n] (+ bias[n] after a rounding to x's dtype), in x's dtype
More accurate than W8A8 (fp16 has 10 mantissa bits, e4m3 3, and no per-row amax scales the small values away); bf16
to fp16 is exact inside fp16's normal range, so x16 is the bf16 value itself there. The same numbers whether the
producer wrote fp16 rows or the kernel casts bf16 rows (CAST_X): where the cast happens is a cost, not a number. The
cost (compiled for sm_90): on a 16-row mma.sync tile every warp widens the whole row tile, so CAST_X adds ~900
instructions a K step a thread on m16 64x512 (bf16 -> f32, the clamp's min and max, f32 -> f16x2) against the weight's
128 conversions; on a swapped tile the rows are spread over the threads and it adds ~50. Hence the fp16 rows from the
norms, the attention's reduce and the gated epilogue. Activations past 65504 saturate: Qwen3's down_proj inputs reach
thousands, not 65504; a model whose rows pass it is distorted there (the table turns W8A16 on per GPU, not per model:
measure the model's accuracy before putting an entry in).

What the GPU runs (compiled for sm_90 on a CPU, Triton 3.9; tests/test_w8a16.py): the fp8 weight tile reaches shared
memory by cp.async as before and is widened to fp16 (`cvt.rn.f16x2.e4m3x2`, 2 values an instruction) on its way into
the product; the rows are never converted from e4m3 (there is none). With BLOCK_M 16 / 32 and no SWAP the product is
mma.sync m16n8k16 f16 (as W8A8's, which widens BOTH operands: W8A16 converts half as many values at one 16-row tile
of a 64-wide weight tile); with SWAP (the weight the 64-tall operand) it is wgmma m64nNk16 f16 with the widened weight
as the register operand A and the rows from shared memory as B (W8A8's native e4m3 wgmma reads both from shared memory
and converts nothing: W8A16 adds the weight's conversion there, and takes twice as many k16 steps as e4m3's k32). A
non-swapped 64-row tile would put the widened weight back into shared memory for wgmma's B: `a16_fits` plans it out.
The rows take twice W8A8's shared memory (2 bytes a value) and the gated launch two weight tiles a stage: a table's
tiles that fit W8A8 may not fit W8A16, so the plan takes fewer pipeline stages where `a16_smem_bytes` passes
SMEM_LIMIT (an upper bound: compiled for sm_90, m16 64x512 s4 took 147456 bytes against its 196608, gated 245760
against 327680; m64 64x128 s6 swapped 139264 / 147456, gated 180224 / 196608), down to 2, else W8A8.

Which call runs W8A16 is `plan`, a pure function of (rows, N, K, device, the fp8 tile tables, the W8A16 table): the
W8A16 table's entry for the GPU takes the step's rows (ops/w8a16_table.py: the H200's entry is 0 rows, W8A16 having lost
to W8A8 at every batch there, so by default nothing runs here), the device is NVIDIA, and the fp8 kernel's own plan
(`triton_fp8_skinny.plan`: its tuned table, else its untuned rule) gives tiles that `a16_fits`; W8A16 runs on those
tiles (split-K included: its reduce kernel without sx). Elsewhere W8A8 as before (its tiles, `torch._scaled_mm`). ROCm:
never (no skinny kernel there).
"""

from __future__ import annotations

import torch

from rapidserve.ops import triton_fp8_skinny, triton_ops
from rapidserve.ops.fp8 import HalfRows, half_rows
from rapidserve.ops.fp8_tiles import MAX_ROWS, Fp8Tables, Fp8Tiles
from rapidserve.ops.triton_fp8_skinny import TUNED, _launch, device_name, fp8_ok, rule_tiles
from rapidserve.ops.w8a16_table import W8A16_TABLE, W8a16Device, W8a16Table, w8a16_for_step

HALF = torch.float16
SMEM_LIMIT = 227 * 1024  # shared memory a block may take on the H100 / H200 (sm_90)


def a16_fits(tiles: Fp8Tiles) -> bool:
    """Whether W8A16 runs on these tiles with the widened weight in registers (module docstring): mma.sync (BLOCK_M
    16 or 32, not swapped) or the swapped order (wgmma's register operand A); not a 64-row unswapped tile."""
    return tiles.swap or tiles.block_m < 64


def a16_smem_bytes(tiles: Fp8Tiles, gated: bool = False) -> int:
    """An upper bound of W8A16's pipelined shared memory: stages x (2 x BLOCK_M fp16 row bytes + the weight tiles'
    BLOCK_N bytes, two of them gated) x BLOCK_K (module docstring: the compiler's own figure is below it)."""
    return tiles.num_stages * (2 * tiles.block_m + (2 if gated else 1) * tiles.block_n) * tiles.block_k


def fit_stages(tiles: Fp8Tiles, gated: bool = False, limit: int = SMEM_LIMIT) -> Fp8Tiles | None:
    """`tiles` with as many of its pipeline stages as keep `a16_smem_bytes` within `limit` (at least 2), or None."""
    stages = tiles.num_stages
    while stages > 2 and a16_smem_bytes(tiles._replace(num_stages=stages), gated) > limit:
        stages -= 1
    fitted = tiles._replace(num_stages=stages)
    return fitted if a16_smem_bytes(fitted, gated) <= limit else None


def plan(rows: int, n: int, k: int, device: W8a16Device, tables: Fp8Tables, table: W8a16Table,
         gated: bool = False) -> Fp8Tiles | None:
    """The W8A16 tiles for `rows` rows of an [n, k] fp8 weight (gated: cat(gate, up), n = 2I, one pass over K), or
    None for W8A8 (module docstring)."""
    if not 0 < rows <= MAX_ROWS or not w8a16_for_step(rows, device, table) or (gated and n % 2):
        return None
    tiles = triton_fp8_skinny.plan(rows, n, k, device.name, tables)
    if tiles is None or not a16_fits(tiles):
        return None
    return fit_stages(tiles._replace(split_k=1) if gated else tiles, gated)


def device_of(weight: torch.Tensor) -> W8a16Device:
    """The facts `plan` reads of the weight's device: its table key and whether it is an NVIDIA GPU."""
    return W8a16Device(device_name(weight.device), weight.device.type == "cuda" and torch.version.hip is None)


def planned(rows: int, weight: torch.Tensor, table: W8a16Table | None = None, gated: bool = False,
            tables: Fp8Tables | None = None) -> Fp8Tiles | None:
    """`plan` of a call on `weight`'s device (`table`: default the packaged one; `tables`: the fp8 tile tables, default
    the packaged ones). A table with no entry above 0 rows (the packaged one: the H200's is 0) answers None without
    asking the device anything: every fp8 linear of the engine asks, prefill's and eager steps' too."""
    table = W8A16_TABLE if table is None else table
    if all(e.max_rows <= 0 for e in table.values()):
        return None
    return plan(rows, *weight.shape, device_of(weight), TUNED if tables is None else tables, table, gated)


def _split(x: torch.Tensor | HalfRows) -> tuple[torch.Tensor, torch.dtype]:
    """(the rows the kernel reads, the output dtype) of float rows or `HalfRows`."""
    return (x.x, x.dtype) if isinstance(x, HalfRows) else (x, x.dtype)


def half_ok(x: torch.Tensor | HalfRows, weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether the W8A16 kernel takes this call: `triton_fp8_skinny.fp8_ok`'s bounds (1..MAX_ROWS bf16 / fp16 rows with
    a contiguous last dim, a contiguous fp8 weight, float32 scales [N]) with an e4m3fn weight (NVIDIA's format); rows
    of `HalfRows` in float16, of a bf16 / fp16 dtype."""
    rows, dtype = _split(x)
    return (fp8_ok(rows, weight, scale) and weight.dtype == torch.float8_e4m3fn
            and dtype in (torch.bfloat16, torch.float16) and (not isinstance(x, HalfRows) or rows.dtype == HALF))


def routed(x: torch.Tensor | HalfRows, weight: torch.Tensor, scale: torch.Tensor, table: W8a16Table | None = None,
           gated: bool = False) -> bool:
    """Whether `fp8_gpu.gpu_linear` (gated: `gpu_linear_silu_and_mul`; `HalfRows`: `gpu_linear_half`) sends this call
    here: on an NVIDIA GPU, a call that `plan` gives tiles and that `half_ok` (the plan first: with no entry of
    the packaged table above 0 rows it answers at once, and every fp8 linear of the engine asks)."""
    rows = _split(x)[0]
    return rows.is_cuda and planned(rows.shape[0], weight, table, gated) is not None and half_ok(x, weight, scale)


def _tiles(x: torch.Tensor | HalfRows, weight: torch.Tensor, scale: torch.Tensor, config: Fp8Tiles | None,
           table: W8a16Table | None, gated: bool) -> Fp8Tiles:
    n, k = weight.shape
    rows = _split(x)[0]
    if not half_ok(x, weight, scale):
        raise ValueError(f"W8A16 takes 1..{MAX_ROWS} rows of bf16/fp16 [M, {k}] (HalfRows: float16) with a contiguous "
                         f"last dim, a contiguous e4m3fn weight and float32 scales [{n}]; got x {tuple(rows.shape)} "
                         f"{rows.dtype}, weight {tuple(weight.shape)} {weight.dtype}, scale {tuple(scale.shape)} "
                         f"{scale.dtype}")
    if gated and n % 2:
        raise ValueError(f"gated W8A16 takes a cat(gate, up) weight with an even row count; got {tuple(weight.shape)}")
    m = rows.shape[0]
    cfg = config or planned(m, weight, table, gated) or fit_stages(rule_tiles(m, n, k), gated)
    if cfg is None or not a16_fits(cfg):
        raise ValueError(f"W8A16 does not run on tiles {cfg.label() if cfg else None} (a 64-row tile must be "
                         "swapped, and its stages fit: a16_fits, fit_stages)")
    return cfg


def w8a16_linear(x: torch.Tensor | HalfRows, weight: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None, config: Fp8Tiles | None = None, pdl: bool | None = None,
                 prefetch: int | None = None, table: W8a16Table | None = None) -> torch.Tensor:
    """x [M, K] (bf16 / fp16 rows, cast to fp16 in the kernel, or `HalfRows`; M <= MAX_ROWS) through an fp8 projection
    (weight [N, K] e4m3fn, float32 scales [N]) as W8A16 -> [M, N] in the rows' dtype (module docstring), on `config`'s
    tiles (default: `plan`'s under `table`, else the untuned `rule_tiles`). `pdl`, `prefetch` as
    `triton_fp8_skinny.skinny_fp8_linear`'s. ValueError for what it cannot take."""
    cfg = _tiles(x, weight, scale, config, table, False)
    rows, dtype = _split(x)
    out = _launch(rows, scale, weight, scale, bias, dtype, cfg, pdl, prefetch, a16=True)
    assert isinstance(out, torch.Tensor)
    return out


def w8a16_linear_silu_and_mul(x: torch.Tensor | HalfRows, weight: torch.Tensor, scale: torch.Tensor,
                              config: Fp8Tiles | None = None, pdl: bool | None = None, prefetch: int | None = None,
                              table: W8a16Table | None = None, half_out: bool = True) -> HalfRows | torch.Tensor:
    """silu_and_mul(w8a16_linear(x, weight, scale)) for an MLP's fp8 gate|up [2I, K] in one launch, the [M, 2I]
    product never written (as `triton_skinny.linear_silu_and_mul`): [M, I], the numbers of `triton_ops.silu_and_mul`
    of the ungated output in the rows' dtype, written as `HalfRows` for a W8A16 down (`half_out`: saturated to fp16 in
    the epilogue; False: in the rows' dtype). One pass over K (the tiles' split_k ignored)."""
    cfg = _tiles(x, weight, scale, config, table, True)
    rows, dtype = _split(x)
    out = _launch(rows, scale, weight, scale, None, dtype, cfg, pdl, prefetch, a16=True, gated=True,
                  half_out=half_out)
    assert isinstance(out, torch.Tensor)
    return HalfRows(out, dtype) if half_out else out


def rms_norm_half(x: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool | None = None) -> HalfRows:
    """`triton_ops.rms_norm` written as W8A16's rows (`fp8.HalfRows`: the plain output saturated to fp16) in its one
    launch; a weight of another dtype (whose product promotes) takes the plain launch, then `fp8.half_rows`."""
    if weight.dtype != x.dtype or x.dtype not in (torch.bfloat16, torch.float16):
        return half_rows(triton_ops.rms_norm(x, weight, eps, pdl=pdl))
    return HalfRows(triton_ops._rms_launch(x, None, weight, eps, pdl, half=True)[0], x.dtype)


def add_rms_norm_half(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                      pdl: bool | None = None) -> tuple[HalfRows, torch.Tensor]:
    """`triton_ops.add_rms_norm`'s (normed rows as `rms_norm_half`'s, residual + x) in its one launch."""
    if weight.dtype != x.dtype or x.dtype not in (torch.bfloat16, torch.float16):
        normed, res = triton_ops.add_rms_norm(x, residual, weight, eps, pdl=pdl)
        return half_rows(normed), res
    out, res_out = triton_ops._rms_launch(x, residual, weight, eps, pdl, half=True)
    assert res_out is not None
    return HalfRows(out, x.dtype), res_out


__all__ = ["SMEM_LIMIT", "a16_fits", "a16_smem_bytes", "add_rms_norm_half", "device_of", "fit_stages", "half_ok",
           "plan", "planned", "rms_norm_half", "routed", "w8a16_linear", "w8a16_linear_silu_and_mul"]
