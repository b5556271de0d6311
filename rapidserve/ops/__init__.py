"""Elementwise and normalisation ops of the decoder layers, in a torch and a Triton flavour.

``get_ops(device)`` returns an ``Ops`` bundle: the fused Triton kernels on CUDA/ROCm GPUs, the torch
reference (numerically identical to transformers) elsewhere. Signatures:

- ``rms_norm(x [..., N], weight [N], eps) -> [..., N]``
- ``add_rms_norm(x, residual, weight, eps) -> (rms_norm(residual + x), residual + x)``
- ``apply_rope(q [T, Hq, D], k [T, Hkv, D], positions [T], cos_sin_cache [max_pos, D] fp32) -> (q, k)``;
  the torch version returns new tensors, the Triton version rotates in place and returns its inputs,
  so callers must use the returned tensors and must not rely on the inputs being preserved.
- ``qk_norm_rope(q, k, q_weight [D], k_weight [D], eps, positions, cos_sin_cache) -> (q, k)``: Qwen3's
  per-head q/k RMSNorm then RoPE (the Triton version in one launch, in place, like apply_rope)
- ``silu_and_mul(x [..., 2I]) -> [..., I]``
- ``rope_write(q, k, v, q_weight | None, k_weight | None, eps, positions, cos_sin_cache, k_cache, v_cache,
  slot_mapping, k_scale=None, v_scale=None) -> q``: what a layer does between its qkv projection and attention:
  (q/k RMSNorm,) RoPE, and k/v written to their cache slots (layout: rapidserve/attention/metadata.py; an fp8
  cache quantized with the layer's scales, rapidserve/ops/kv_quant.py); the Triton version in one launch,
  q rotated in place, k left unrotated (callers use the cache from then on)
- ``linear(x [T, K], weight [N, K], bias [N] | None) -> [T, N]`` and ``linear_silu_and_mul(x [T, K],
  gate_up [2I, K]) = silu_and_mul(linear(x, gate_up)) -> [T, I]``: the Triton bundle runs decode batches
  of at most `triton_skinny.MAX_ROWS` (16) rows through `triton_skinny` (one kernel each; the gated one
  never writes the [T, 2I] product) on NVIDIA GPUs, where it was measured; everything else through
  torch's F.linear (cuBLAS / hipBLASLt)
- ``moe_experts(x [T, h], w13 [E, 2I, h], w2 [E, h, I], weights [T, k] fp32, ids [T, k] int32) -> [T, h]``: a
  mixture-of-experts layer's experts (issue 40; routing by `ops.moe.route`): `moe.moe_experts_ref` (a loop over
  experts) in the torch bundle, `triton_moe.fused_moe` (tokens sorted by expert, one grouped GEMM launch per
  projection, CUDA-graph safe) in the Triton one, on both vendors
- ``moe_layer(x [T, h], logits [T, E], w13, w2, top_k, renormalize) -> [T, h]``: the same from the router's logits
  (what the model calls): `moe.moe_layer_ref` (`moe.route`, then the reference experts) in the torch bundle,
  `triton_moe.routed_moe` in the Triton one (routing, alignment and the zeroed semaphores in one launch at decode
  sizes, then gate|up with SiLU-and-mul, then down with the routing weights and the top-k sum: three launches)
- ``fp8_linear(x [T, K], layer: fp8.Fp8Linear, bias [N] | None) -> [T, N]``: a projection stored in fp8 (issue 39,
  rapidserve/ops/fp8.py): `fp8.reference_linear` in the torch bundle, `fp8_gpu.gpu_linear` (torch._scaled_mm, the
  Triton block kernel) in the Triton one; `fp8_ops(bundle, device)` puts the reference back on a GPU without fp8
- the producers of an fp8 projection's input, fused with its per-token quantization (issue 39; the model takes them
  when `fuse_fp8` and the next projection `fp8.takes_rows`): ``rms_norm_fp8(x, weight, eps, fp8) -> QuantizedRows``,
  ``add_rms_norm_fp8(x, residual, weight, eps, fp8) -> (QuantizedRows, residual + x)``, ``silu_and_mul_fp8(x, fp8)
  -> QuantizedRows`` (`fp8.QuantizedRows`: q fp8 [T, K], scale [T, 1], the rows' dtype), and
  ``fp8_linear_rows(rows, layer, bias) -> [T, N]``, `fp8_linear` of the rows they quantize: the op then
  `fp8.quantize_rows` and `fp8.reference_linear_rows` in the torch bundle, one launch each
  (`triton_fp8_fused`) and `fp8_gpu.gpu_linear_rows` in the Triton one; the same numbers as the unfused ops.
  `unfused_fp8(bundle)` turns the fusion off (the A/B of bench/fp8_speed.py)
- a split-K fp8 GEMM's output handed to the RMSNorm after it unreduced (issue 39, ops/fold_table.py; the model takes
  it when `fold_split_k`): ``fp8_linear_sums(rows, layer, bias) -> [T, N] | fp8.SplitSums`` (`fp8_linear_rows`,
  except that in the Triton bundle a skinny fp8 GEMM that splits K at rows the GPU's fold rule takes returns its
  slices' sums, `fp8_gpu.gpu_linear_sums`; the torch bundle's never does, and has the fold off),
  ``add_rms_norm_fp8_sums(sums, residual, weight, eps, fp8)``, `add_rms_norm_fp8` of the output they stand for
  (Triton: one launch, ops/triton_fp8_fold.py), and ``reduce_sums(sums) -> [T, N]`` (the reduce kernel, for any
  other consumer); the same numbers as the unfused launches. `no_split_fold(bundle)` turns it off
  (bench/decode_profile.py's A/B)

- W8A16 (issue 39, ops/triton_w8a16.py: fp8 weights, the rows in fp16 with no per-token scale, no quantizer before the
  GEMM): ``w8a16(rows, layer) -> bool`` says whether `rows` float rows of an fp8 projection run W8A16 (the Triton
  bundle: `fp8_gpu.w8a16_routed`, by ops/w8a16_table.json: the H200's entry 0 rows, W8A16 having lost at every batch on
  2026-12-01, so the engine runs W8A8; the torch bundle: never), so the producer of that projection's rows writes them
  in fp16 (`fp8.HalfRows`: `fused_fp8` says float16): ``rms_norm_half(x, weight, eps) -> HalfRows``,
  ``add_rms_norm_half(x, residual, weight, eps) -> (HalfRows, residual + x)`` (the plain RMSNorm's launch, its output
  saturated to fp16), ``fp8_linear_silu_and_mul(x, gate_up) -> HalfRows`` (SiLU-and-mul of an fp8 gate|up's product for
  a W8A16 down: in the GEMM's epilogue, one launch), and ``fp8_linear_half(rows, layer, bias) -> [T, N]`` takes them
  (the attention's output stays float rows, cast to fp16 inside the GEMM). `with_w8a16(bundle, table)` binds another
  table (`w8a16_table.forced`: every row count the kernel takes; bench/decode_profile.py's `w8a16` variant and the GPU
  tests)

The Triton bundle's kernels launch with programmatic dependent launch where the GPU has it (NVIDIA sm_90+:
`rapidserve/ops/pdl.py`, which says the rules they keep); each of its functions that launches takes `pdl` (None:
that default; False: off), and `no_pdl(bundle)` binds it off in every one (tests/test_pdl_gpu.py's eager reference);
`with_launch(bundle, choice)` binds a step's `pdl_table.LaunchChoice` (PDL, and the skinny GEMMs' `prefetch` bytes),
which is how the runner launches every step.

`cublas_linears(bundle)` keeps every linear on torch's F.linear (decode graphs on a partition of the GPU use
it: see its docstring). `unfused_ops(bundle)` is the same bundle with RoPE and the KV write as two launches,
every linear through F.linear and SiLU-and-mul on its own, as before these changes (bench/decode_profile.py
measures both in one process).

Triton is imported only when the Triton ops are requested.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from rapidserve.ops import fp8, moe, torch_ops
from rapidserve.ops.pdl import bind_launch, bind_pdl, takes_pdl
from rapidserve.ops.pdl_table import LaunchChoice


class RopeWrite(Protocol):
    """`rope_write`'s signature (see the module docstring)."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor | None,
                 k_weight: torch.Tensor | None, eps: float, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, /) -> torch.Tensor: ...


class Linear(Protocol):
    """`linear`'s signature: x @ weight.T (+ bias)."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, /
                 ) -> torch.Tensor: ...


class MoeExperts(Protocol):
    """`moe_experts`'s signature (see the module docstring)."""

    def __call__(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                 ids: torch.Tensor, /) -> torch.Tensor: ...


class MoeLayer(Protocol):
    """`moe_layer`'s signature (see the module docstring)."""

    def __call__(self, x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
                 renormalize: bool, /) -> torch.Tensor: ...


@dataclass(frozen=True)
class Ops:
    name: str
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float],
                           tuple[torch.Tensor, torch.Tensor]]
    apply_rope: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                         tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    qk_norm_rope: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor,
                            torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    rope_write: RopeWrite
    linear: Linear
    linear_silu_and_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    fp8_linear: Callable[[torch.Tensor, fp8.Fp8Linear, torch.Tensor | None], torch.Tensor]
    moe_experts: MoeExperts = moe.moe_experts_ref
    moe_layer: MoeLayer = moe.moe_layer_ref
    rms_norm_fp8: Callable[[torch.Tensor, torch.Tensor, float, torch.dtype], fp8.QuantizedRows] = (
        torch_ops.rms_norm_fp8)
    add_rms_norm_fp8: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, torch.dtype],
                               tuple[fp8.QuantizedRows, torch.Tensor]] = torch_ops.add_rms_norm_fp8
    silu_and_mul_fp8: Callable[[torch.Tensor, torch.dtype], fp8.QuantizedRows] = torch_ops.silu_and_mul_fp8
    fp8_linear_rows: Callable[[fp8.QuantizedRows, fp8.Fp8Linear, torch.Tensor | None], torch.Tensor] = (
        fp8.reference_linear_rows)
    fuse_fp8: bool = True  # whether the model fuses the quantization of fp8 projections' inputs into their producers
    fp8_linear_sums: Callable[[fp8.QuantizedRows, fp8.Fp8Linear, torch.Tensor | None],
                              torch.Tensor | fp8.SplitSums] = fp8.reference_linear_rows
    add_rms_norm_fp8_sums: Callable[[fp8.SplitSums, torch.Tensor, torch.Tensor, float, torch.dtype],
                                    tuple[fp8.QuantizedRows, torch.Tensor]] = torch_ops.add_rms_norm_fp8_sums
    reduce_sums: Callable[[fp8.SplitSums], torch.Tensor] = fp8.reduce_sums_reference
    # whether the model asks for split-K sums (`fp8_linear_sums`) for the norm after o_proj / down_proj: the Triton
    # bundle's (whose skinny fp8 GEMM splits K); off in the torch bundle, whose GEMM never does
    fold_split_k: bool = False
    w8a16: Callable[[int, fp8.Fp8Linear], bool] = torch_ops.no_w8a16
    fp8_linear_silu_and_mul: Callable[[torch.Tensor | fp8.HalfRows, fp8.Fp8Linear],
                                      torch.Tensor | fp8.HalfRows] = torch_ops.fp8_linear_silu_and_mul
    rms_norm_half: Callable[[torch.Tensor, torch.Tensor, float], fp8.HalfRows] = torch_ops.rms_norm_half
    add_rms_norm_half: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float],
                                tuple[fp8.HalfRows, torch.Tensor]] = torch_ops.add_rms_norm_half
    fp8_linear_half: Callable[[fp8.HalfRows, fp8.Fp8Linear, torch.Tensor | None], torch.Tensor] = (
        fp8.reference_linear_half)


def torch_ops_bundle() -> Ops:
    return Ops("torch", torch_ops.rms_norm, torch_ops.add_rms_norm, torch_ops.apply_rope,
               torch_ops.silu_and_mul, torch_ops.qk_norm_rope, torch_ops.rope_write, torch_ops.linear,
               torch_ops.linear_silu_and_mul, fp8.reference_linear)


def triton_ops_bundle(skinny: bool | None = None) -> Ops:
    """The Triton kernels. `skinny` (default: on NVIDIA, off on ROCm, where it has not been measured)
    routes linear layers of small decode batches to `triton_skinny`."""
    from rapidserve.ops import (
        fp8_gpu,
        triton_fp8_fold,
        triton_fp8_fused,
        triton_fp8_skinny,
        triton_ops,
        triton_rope,
        triton_w8a16,
    )

    if skinny is None:
        skinny = torch.version.hip is None
    ops = Ops("triton-noskinny", triton_ops.rms_norm, triton_ops.add_rms_norm, triton_rope.apply_rope,
              triton_ops.silu_and_mul, triton_rope.qk_norm_rope, triton_rope.rope_write, torch_ops.linear,
              _cublas_then(triton_ops.silu_and_mul), fp8_gpu.gpu_linear, *_fused_moe(),
              triton_fp8_fused.rms_norm_fp8, triton_fp8_fused.add_rms_norm_fp8, triton_fp8_fused.silu_and_mul_fp8,
              fp8_gpu.gpu_linear_rows, fp8_linear_sums=fp8_gpu.gpu_linear_sums,
              add_rms_norm_fp8_sums=triton_fp8_fold.add_rms_norm_fp8_sums, reduce_sums=triton_fp8_skinny.reduce_sums,
              fold_split_k=True, w8a16=fp8_gpu.w8a16_routed, fp8_linear_silu_and_mul=fp8_gpu.gpu_linear_silu_and_mul,
              rms_norm_half=triton_w8a16.rms_norm_half, add_rms_norm_half=triton_w8a16.add_rms_norm_half,
              fp8_linear_half=fp8_gpu.gpu_linear_half)
    if not skinny:
        return ops
    from rapidserve.ops import triton_skinny

    def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, pdl: bool | None = None,
                            prefetch: int | None = None) -> torch.Tensor:
        return triton_skinny.linear_silu_and_mul(x, weight, triton_ops.silu_and_mul, pdl, prefetch)

    return dataclasses.replace(ops, name="triton", linear=triton_skinny.linear,
                               linear_silu_and_mul=linear_silu_and_mul)


def _fused_moe() -> tuple[MoeExperts, MoeLayer]:
    from rapidserve.ops import triton_moe

    return triton_moe.fused_moe, triton_moe.routed_moe


def _cublas_then(silu_and_mul: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`linear_silu_and_mul` as torch's F.linear, then the given `silu_and_mul` (given `pdl` when that is not None:
    a Triton one)."""
    def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, pdl: bool | None = None) -> torch.Tensor:
        return silu_and_mul(F.linear(x, weight), **({} if pdl is None else {"pdl": pdl}))
    return linear_silu_and_mul


def cublas_linears(ops: Ops) -> Ops:
    """`ops` with its linear layers through torch's F.linear (cuBLAS / hipBLASLt) whatever the rows; the other
    fusions kept. For decode graphs on a partition of the GPU: the skinny kernel reads weights at a lower rate
    per SM than cuBLAS, so with few SMs it is slower (decode on 16 of the H100's 132 SMs: 16.7 vs 12.1 ms a
    step at batch 1, `profiles/` on 2026-11-27); it is faster only with the whole GPU."""
    if ops.linear is torch_ops.linear:
        return ops
    return dataclasses.replace(ops, name=ops.name + "-cublas", linear=torch_ops.linear,
                               linear_silu_and_mul=_cublas_then(ops.silu_and_mul))


def unfused_ops(ops: Ops) -> Ops:
    """`ops` with RoPE and the KV write as two launches, every linear through torch's F.linear,
    SiLU-and-mul on its own and each fp8 projection quantizing its own input (`unfused_fp8`): the layer as it
    ran before these changes (for A/B measurements; the engine never uses it)."""
    if ops.name == "torch":
        return ops
    from rapidserve.ops.triton_kv import write_kv

    def rope_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor | None,
                   k_weight: torch.Tensor | None, eps: float, positions: torch.Tensor, cos_sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                   k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        if q_weight is not None and k_weight is not None:
            q, k = ops.qk_norm_rope(q, k, q_weight, k_weight, eps, positions, cos_sin)
        else:
            q, k = ops.apply_rope(q, k, positions, cos_sin)
        write_kv(k, v, k_cache, v_cache, slots, k_scale, v_scale)
        return q

    return dataclasses.replace(unfused_fp8(cublas_linears(ops)), name=ops.name + "-unfused", rope_write=rope_write)


def no_pdl(ops: Ops) -> Ops:
    """`ops` with programmatic dependent launch off in every function that takes `pdl` (the Triton launchers; the
    torch bundle has none), named so (`with_launch(ops, pdl_table.OFF)` is the same launches, the name kept)."""
    fields = {f.name: bind_pdl(getattr(ops, f.name), False) for f in dataclasses.fields(ops)
              if callable(getattr(ops, f.name)) and takes_pdl(getattr(ops, f.name))}
    return ops if not fields else dataclasses.replace(ops, name=ops.name + "-nopdl", **fields)


def with_launch(ops: Ops, choice: LaunchChoice) -> Ops:
    """`ops` with every launcher's `pdl` bound to `choice.pdl` and the skinny GEMMs' `prefetch` to its bytes
    (`pdl.bind_launch`): how the runner launches a step (`pdl_table.pdl_for_step`; rapidserve/ops/pdl.py says where).
    The bundle itself where nothing takes `pdl` (the torch bundle); a bound bundle's earlier choice is overridden."""
    fields = {f.name: bind_launch(getattr(ops, f.name), choice.pdl, choice.prefetch_bytes)
              for f in dataclasses.fields(ops) if callable(getattr(ops, f.name)) and takes_pdl(getattr(ops, f.name))}
    return ops if not fields else dataclasses.replace(ops, **fields)


def unfused_fp8(ops: Ops) -> Ops:
    """`ops` with `fuse_fp8` off: every fp8 projection quantizes its own input (`fp8_linear`), as before the fused
    producers (the A/B of bench/fp8_speed.py; the engine runs with the fusion), and no split-K reduce folded
    (`no_split_fold`: without quantized rows there are no sums to fold)."""
    if not ops.fuse_fp8:
        return ops if not ops.fold_split_k else dataclasses.replace(ops, fold_split_k=False)
    return dataclasses.replace(ops, name=ops.name + "-fp8unfused", fuse_fp8=False, fold_split_k=False)


def no_split_fold(ops: Ops) -> Ops:
    """`ops` with `fold_split_k` off: every split-K fp8 GEMM launches its own reduce kernel and the RMSNorm after it
    reads its output, as before the fold (ops/fold_table.py; the A/B column "unfused small kernels ms" of
    bench/decode_profile.py --quantization fp8)."""
    return ops if not ops.fold_split_k else dataclasses.replace(ops, name=ops.name + "-nofold", fold_split_k=False)


def fp8_ops(ops: Ops, device: torch.device | str) -> Ops:
    """`ops` with the fp8 linear `device` can run: its own where the device multiplies fp8 (`fp8.fp8_supported`)
    or the bundle's is already the reference, else `fp8.reference_linear` (a GPU without fp8: the weights
    dequantized at each call, correct and slow) with the fused producers off (their Triton kernels write fp8, which
    such a GPU has no conversions for)."""
    if ops.fp8_linear is fp8.reference_linear or fp8.fp8_supported(device):
        return ops
    return dataclasses.replace(ops, name=ops.name + "-fp8ref", fp8_linear=fp8.reference_linear,
                               fp8_linear_rows=fp8.reference_linear_rows, fuse_fp8=False,
                               fp8_linear_sums=fp8.reference_linear_rows, fold_split_k=False,
                               w8a16=torch_ops.no_w8a16, fp8_linear_silu_and_mul=torch_ops.fp8_linear_silu_and_mul,
                               rms_norm_half=torch_ops.rms_norm_half, add_rms_norm_half=torch_ops.add_rms_norm_half,
                               fp8_linear_half=fp8.reference_linear_half)


# the fields that read the W8A16 table
W8A16_FIELDS = ("fp8_linear", "w8a16", "fp8_linear_silu_and_mul", "fp8_linear_half")


def with_w8a16(ops: Ops, table: Mapping[str, object]) -> Ops:
    """`ops` with the W8A16 table `table` (ops/w8a16_table.py; `w8a16_table.forced(gpu)`: every row count the kernel
    takes) bound into every one of `W8A16_FIELDS` that takes it (the Triton bundle's, as their `w8a16` argument), named
    so; the bundle itself where none does (the torch bundle never runs W8A16). Bind before `with_launch`, which keeps
    this binding."""
    fields = {name: functools.update_wrapper(functools.partial(getattr(ops, name), w8a16=table), getattr(ops, name))
              for name in W8A16_FIELDS if _takes(getattr(ops, name), "w8a16")}
    return ops if not fields else dataclasses.replace(ops, name=ops.name + "-w8a16", **fields)


def _takes(fn: Callable[..., object], arg: str) -> bool:
    try:
        return arg in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


def get_ops(device: torch.device | str) -> Ops:
    """Triton ops on CUDA / ROCm devices (ROCm torch calls them "cuda"), torch ops otherwise."""
    if torch.device(device).type == "cuda":
        return triton_ops_bundle()
    return torch_ops_bundle()


__all__ = ["Linear", "MoeExperts", "MoeLayer", "Ops", "RopeWrite", "cublas_linears", "fp8_ops", "get_ops", "no_pdl",
           "no_split_fold", "torch_ops_bundle", "triton_ops_bundle", "unfused_fp8", "unfused_ops", "with_launch",
           "with_w8a16"]
