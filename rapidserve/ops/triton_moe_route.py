"""The router's top-k of a mixture-of-experts layer in Triton (issue 40, `ops/triton_moe.py`), and at decode sizes the
expert alignment in the same launch: what `ops.moe.route` then `triton_moe_align.align_into` compute, in one launch
where the batch is small and two or three above, with no host read and a grid fixed by the batch (CUDA-graph safe).

Per token (a row of the router's logits [T, E], any float dtype, read as float32): the k largest logits, one at a
time (`tl.max` with its index, the lowest expert id on a tie, then that logit masked off), so the slots are in
decreasing order, as `torch.topk`'s; the weight of slot j is softmax(logits)[id_j] (`renormalize` off) or the
softmax over the k chosen logits (on: the top-k of the softmax renormalised to sum to 1, the same number):
exp(l_j - max) over the sum of exp(l - max) over all experts, or over the k chosen. Ids are clamped into [0, E) (a
row of NaN logits still names experts that exist, so every pair lands in a run). The float32 weights equal
`ops.moe.route`'s to rounding (its softmax, then a division by the sum); the ids equal its ids where no two of a
token's logits tie (tests/test_moe_ops.py).

- `_route_align_kernel` (at most ONE_PROGRAM pairs: decode batches): one program routes every token (tiles of T_TILE
  tokens x E_P experts), stores weights [T, k] and ids [T, k], then (after a barrier: its own stores are visible to
  all its threads) aligns those ids as `_align_one_kernel` does (`triton_moe_align._align_all`) and writes the zeros
  the caller asks for (the grouped GEMMs' semaphores).
- above it, `_route_kernel` (a program per T_TILE tokens) stores weights and ids; `align_into` then aligns them (its
  two-launch path, which writes the zeros).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rapidserve.ops.moe import Alignment, TailBlocks
from rapidserve.ops.triton_moe_align import (
    ONE_PROGRAM,
    TILE,
    WARPS,
    _align_all,
    _zero,
    align_into,
    check_buffers,
    empty_alignment,
    sub_pairs,
    zero_target,
)

ROUTE_WARPS = 4  # the many-program route kernel: a [T_TILE, E_P] tile of TILE elements a program


@triton.jit
def _route_rows(logits_ptr, weights_ptr, ids_ptr, t0, T, E, stride_l, TOP_K: tl.constexpr, K_P: tl.constexpr,
                RENORM: tl.constexpr, T_TILE: tl.constexpr, E_P: tl.constexpr):
    """weights[t, :] and ids[t, :] of tokens t0 .. t0 + T_TILE - 1 below T (module docstring)."""
    tokens = t0 + tl.arange(0, T_TILE)
    experts = tl.arange(0, E_P)
    slots = tl.arange(0, K_P)
    tok_ok = tokens < T
    logits = tl.load(logits_ptr + tokens.to(tl.int64)[:, None] * stride_l + experts[None, :],
                     mask=tok_ok[:, None] & (experts < E)[None, :], other=float("-inf")).to(tl.float32)
    logits = tl.where(tok_ok[:, None], logits, 0.0)  # rows past T: finite (never stored)
    top = tl.max(logits, axis=1)
    if not RENORM:
        denom = tl.sum(tl.exp(logits - top[:, None]), axis=1)
    vals = tl.full([T_TILE, K_P], float("-inf"), tl.float32)
    ids = tl.zeros([T_TILE, K_P], tl.int32)
    for j in tl.static_range(TOP_K):
        val, best = tl.max(logits, axis=1, return_indices=True, return_indices_tie_break_left=True)
        best = best.to(tl.int32)
        vals = tl.where(slots[None, :] == j, val[:, None], vals)
        ids = tl.where(slots[None, :] == j, tl.minimum(best, E - 1)[:, None], ids)
        logits = tl.where(experts[None, :] == best[:, None], float("-inf"), logits)
    num = tl.exp(vals - top[:, None])  # slots past TOP_K: exp(-inf) = 0
    if RENORM:
        denom = tl.sum(num, axis=1)
    offs = tokens.to(tl.int64)[:, None] * TOP_K + slots[None, :]
    mask = tok_ok[:, None] & (slots < TOP_K)[None, :]
    tl.store(weights_ptr + offs, num / denom[:, None], mask=mask)
    tl.store(ids_ptr + offs, ids, mask=mask)


@triton.jit(do_not_specialize=["T", "E", "rows", "n_zero"])
def _route_align_kernel(logits_ptr, weights_ptr, ids_ptr, sorted_ptr, expert_ptr, post_ptr, zero_ptr, T, E, stride_l,
                        rows, n_zero, TOP_K: tl.constexpr, K_P: tl.constexpr, RENORM: tl.constexpr,
                        T_TILE: tl.constexpr, BLOCK_M: tl.constexpr, SUB: tl.constexpr, E_P: tl.constexpr):
    """Routing, alignment and zeros of a small batch in one program (module docstring); rows = max_padded."""
    for t0 in range(0, T, T_TILE):
        _route_rows(logits_ptr, weights_ptr, ids_ptr, t0, T, E, stride_l, TOP_K, K_P, RENORM, T_TILE, E_P)
    tl.debug_barrier()  # the ids this program stored, visible to every one of its threads
    _align_all(ids_ptr, sorted_ptr, expert_ptr, post_ptr, T * TOP_K, rows, BLOCK_M, SUB, E_P)
    _zero(zero_ptr, 0, n_zero)


@triton.jit(do_not_specialize=["T", "E"])
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, T, E, stride_l, TOP_K: tl.constexpr, K_P: tl.constexpr,
                  RENORM: tl.constexpr, T_TILE: tl.constexpr, E_P: tl.constexpr):
    """weights and ids of this program's T_TILE tokens."""
    _route_rows(logits_ptr, weights_ptr, ids_ptr, tl.program_id(0) * T_TILE, T, E, stride_l, TOP_K, K_P, RENORM,
                T_TILE, E_P)


def token_tile(tokens: int, num_experts: int) -> int:
    """T_TILE: tokens of one [T_TILE, E_P] routing tile, at most TILE elements, and no more than the batch needs
    (a power of two)."""
    return max(min(TILE // triton.next_power_of_2(num_experts), triton.next_power_of_2(max(tokens, 1))), 1)


def _check(logits: torch.Tensor, top_k: int) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1 or not logits.dtype.is_floating_point:
        raise ValueError(f"logits must be a float [T, E] with a contiguous last dim, got {tuple(logits.shape)} "
                         f"{logits.dtype}")
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"top_k must be in [1, {logits.shape[1]}] (the experts), got {top_k}")


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, ids [T, k] int32) of router logits [T, E] (module docstring; `ops.moe.route`'s
    contract), `_route_kernel` alone."""
    _check(logits, top_k)
    t, e = logits.shape
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    if t:
        tile = token_tile(t, e)
        _route_kernel[(triton.cdiv(t, tile),)](logits, weights, ids, t, e, logits.stride(0), TOP_K=top_k,
                                               K_P=triton.next_power_of_2(top_k), RENORM=renormalize, T_TILE=tile,
                                               E_P=triton.next_power_of_2(e), num_warps=ROUTE_WARPS)
    return weights, ids


def route_align(logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int, zero: torch.Tensor | None = None,
                one_program: bool | None = None, tails: TailBlocks | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, Alignment]:
    """(weights [T, k] float32, ids [T, k] int32, their `Alignment` under block_m) of router logits [T, E], in new
    buffers, and zeros into `zero` (int32, optional): one launch for at most ONE_PROGRAM pairs, else `route` then
    `align_into`'s two launches; `one_program` forces the path (tests; no tokens always take one program). `tails`
    (`empty_tails`' buffers, block_m their tail block): written too, always by `route` then the two launches."""
    _check(logits, top_k)
    t, e = logits.shape
    pairs = t * top_k
    out = empty_alignment(pairs, e, block_m, logits.device)
    if tails is not None or not (pairs == 0 or (pairs <= ONE_PROGRAM if one_program is None else one_program)):
        weights, ids = route(logits, top_k, renormalize)
        return weights, ids, align_into(ids, e, block_m, out, False, zero, tails)
    check_buffers(pairs, e, block_m, out)
    zero_ptr, n_zero = zero_target(zero, out)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    _route_align_kernel[(1,)](logits, weights, ids, out.sorted_ids, out.expert_ids, out.num_post, zero_ptr, t, e,
                              logits.stride(0), out.sorted_ids.numel(), n_zero, TOP_K=top_k,
                              K_P=triton.next_power_of_2(top_k), RENORM=renormalize, T_TILE=token_tile(t, e),
                              BLOCK_M=block_m, SUB=sub_pairs(e), E_P=triton.next_power_of_2(e), num_warps=WARPS)
    return weights, ids, out


__all__ = ["ONE_PROGRAM", "route", "route_align", "token_tile"]
