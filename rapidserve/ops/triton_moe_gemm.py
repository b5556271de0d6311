"""The two grouped GEMMs of the fused MoE layer in Triton (issue 40; `ops/triton_moe.py` runs them after the alignment
and documents the layer): the kernels and their launches. Their program grid (the tiles' order, split K, persistent
programs, tail-block lists) and the weights' loads by TMA: `ops/triton_moe_grid.py` (its docstring, and the device
and host helpers both GEMMs share).

- `_gate_up_kernel`: one BLOCK_M run of one expert's (token, slot) pairs x BLOCK_N features: the pairs' token rows of
  x gathered (each loaded once per K step for both products), times the expert's gate and up tiles (two fp32
  accumulators), SiLU(gate) * up in the epilogue, stored at the pairs' rows of act [T*k, I].
- `_down_kernel`: act's rows of the run times the expert's down tile, scaled by each pair's routing weight, and the k
  rows of each token summed into out [T, h] in the same launch (`triton_moe.py`: the semaphores, split K).

The tile loop of a persistent program (PERSISTENT: `triton_moe_grid.py`): gate|up's is flattened with the K loop
(`tl.range(flatten=True)`; sm_90 under Triton 3.6: one loop, the cp.async / TMA pipeline carried across tiles), so
the next tile's first K steps load during a tile's epilogue instead of the pipeline draining between tiles. down's
is not: Triton 3.6's FuseNestedLoops pass fails on the branch around its top-k sum, and without that branch the
flattened loop compiled with no cp.async pipeline at all, so each of its tiles pipelines its own K loop.

Programmatic dependent launch (`ops.pdl`'s rules; `triton_moe.py` says why the trigger is late): every program
waits (`gdc_wait`, USE_GDC) before its first global access (the filled-tile count, the sorted rows, the TMA loads:
copies from global memory like any other) and before an idle one returns; a one-tile program lets the next launch's
programs start (`gdc_launch_dependents`) after its K loop, before its epilogue; a persistent program only after the
K loop of its last tile (a runtime test on the tile index: the instruction counts once, at its first run, so an
earlier tile's would start the dependents while most of its work remains).

Loads are masked only on a K tail (EVEN_K: none): padding rows read token 0's row and pointer columns past N wrap to
the first rows of the weight, and neither result is stored. The variants (EVEN_K, any GROUP_M, TMA, PERSISTENT) give
the same bits, split K the same numbers to fp32 rounding (tests/test_moe_ops.py). fp32 inputs multiply in IEEE fp32
(no TF32), for the CPU checks; bf16/fp16 on the tensor cores with fp32 sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rapidserve.ops import pdl as pdl_launch
from rapidserve.ops.moe import Alignment, TailBlocks
from rapidserve.ops.moe_plan import split_plan
from rapidserve.ops.moe_tiles import GemmTiles
from rapidserve.ops.triton_moe_grid import (
    _filled,
    _first_row,
    _group_m,
    _program_tile,
    _sems,
    _split_range,
    _weights_arg,
    grid_size,
    m_lists,
    use_tma,
)

REDUCE_ELEMS = 512  # partial-row elements a thread of down's top-k sum loads at once by the rule (`reduce_width`)


@triton.jit
def _gate_up_tile(x_ptr, w_ptr, w_desc, out_ptr, part_ptr, sem_ptr, sorted_ptr, expert_ptr, pairs, N, K, pid_m, pid_n,
                  pid_s, k_lo, k_hi, row0, num_pid_n, splits, stride_xm, stride_we, stride_wn, stride_om,
                  TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  EVEN_K: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr,
                  USE_GDC: tl.constexpr, trigger):
    """One tile of `_gate_up_kernel` over split pid_s's K range [k_lo, k_hi); w [E, 2N, K] (gate rows [0, N), up rows
    [N, 2N)), row-major (TMA: w_desc over it viewed [E * 2N, K]). SPLIT (more than one split): each split stores
    its fp32 sums in part [splits, pairs, 2N] and counts itself in the tile's semaphore; the split that arrives last
    sums the splits in split order and applies the epilogue (`triton_moe.py`). USE_GDC: the kernel has waited
    already; where `trigger` (True, or a persistent program's last tile) the next launch's programs may start after
    this tile's K loop (module docstring). row0: the tile's first row of sorted_ids (`_first_row`)."""
    e = tl.load(expert_ptr + pid_m)
    rows = tl.load(sorted_ptr + row0 + tl.arange(0, BLOCK_M))
    row_ok = rows < pairs
    tokens = tl.where(row_ok, rows // TOP_K, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_xm + offs_k[None, :]
    g_ptrs = w_ptr + e.to(tl.int64) * stride_we + (offs_n % N)[None, :] * stride_wn + offs_k[:, None]
    if SPLIT:
        a_ptrs += k_lo
        g_ptrs += k_lo
    u_ptrs = g_ptrs + N * stride_wn
    g_row = e * (2 * N) + pid_n * BLOCK_N  # TMA: the gate tile's first row of w as [E * 2N, K]; up's is N further
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        a = tl.load(a_ptrs) if EVEN_K else tl.load(a_ptrs, mask=(offs_k < k_hi - k0)[None, :], other=0.0)
        if TMA:  # zeros past K: no mask
            g = w_desc.load([g_row, k0]).T
            u = w_desc.load([g_row + N, k0]).T
        elif EVEN_K:
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
        else:
            g = tl.load(g_ptrs, mask=(offs_k < k_hi - k0)[:, None], other=0.0)
            u = tl.load(u_ptrs, mask=(offs_k < k_hi - k0)[:, None], other=0.0)
        if IEEE:
            acc_g = tl.dot(a, g, acc_g, input_precision="ieee")
            acc_u = tl.dot(a, u, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, g, acc_g)
            acc_u = tl.dot(a, u, acc_u)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if USE_GDC:  # noqa: SIM102 (a constexpr, then a runtime test) after the K loop (`ops.pdl`, rule 3): down's
        # programs may start, and wait in turn
        if trigger:
            tl.extra.cuda.gdc_launch_dependents()
    mask = row_ok[:, None] & (offs_n < N)[None, :]
    if SPLIT:
        mine = part_ptr + (pid_s * pairs + rows).to(tl.int64)[:, None] * (2 * N) + offs_n[None, :]
        tl.store(mine, acc_g, mask=mask)
        tl.store(mine + N, acc_u, mask=mask)
        tl.debug_barrier()  # every thread's partial sums stored before the semaphore says so (release)
        sem = sem_ptr + pid_m * num_pid_n + pid_n
        last = tl.atomic_add(sem, 1, sem="acq_rel", scope="gpu") == splits - 1
        if last:
            tl.debug_barrier()
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(0, splits):
                part = part_ptr + (s * pairs + rows).to(tl.int64)[:, None] * (2 * N) + offs_n[None, :]
                acc_g += tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
                acc_u += tl.load(part + N, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(sem, 0)  # left zero for the next launch
        mask = tl.where(last, mask, False)  # only the last split stores act
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + offs_n[None, :], act.to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit(do_not_specialize=["pairs", "group_m", "splits", "split_steps"])
def _gate_up_kernel(x_ptr, w_ptr, w_desc, out_ptr, part_ptr, sem_ptr, sorted_ptr, expert_ptr, post_ptr, start_ptr,
                    pairs, N, K, group_m, splits, split_steps, stride_xm, stride_we, stride_wn, stride_om,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN_K: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr, USE_GDC: tl.constexpr,
                    TMA: tl.constexpr, PERSISTENT: tl.constexpr, LISTS: tl.constexpr):
    """act[pair] = silu(x[token] @ gate[e].T) * (x[token] @ up[e].T), a tile a program or (PERSISTENT) every
    num_programs-th filled tile from this program's (module docstring; `_gate_up_tile`). LISTS: the m blocks are a
    `TailBlocks` list's (start_ptr its starts, expert_ptr its experts, post_ptr its count)."""
    num_pid_n = tl.cdiv(N, BLOCK_N)
    if PERSISTENT:
        if USE_GDC:  # launched early (programmatic dependent launch): the alignment's launch complete and visible
            tl.extra.cuda.gdc_wait()  # first, before any global access (the tile count, the TMA loads included)
        num_tiles = _filled(post_ptr, BLOCK_M, LISTS) * num_pid_n
        for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=True):
            pid_m, pid_n = _program_tile(tile, num_tiles, num_pid_n, group_m)
            row0 = _first_row(start_ptr, pid_m, BLOCK_M, LISTS)
            _gate_up_tile(x_ptr, w_ptr, w_desc, out_ptr, part_ptr, sem_ptr, sorted_ptr, expert_ptr, pairs, N, K, pid_m,
                          pid_n, 0, 0, K, row0, num_pid_n, 1, stride_xm, stride_we, stride_wn, stride_om, TOP_K,
                          BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, False, IEEE, TMA, USE_GDC,
                          tile + tl.num_programs(0) >= num_tiles)  # dependents after the last tile's K loop
    else:
        pid_m, pid_n, pid_s, k_lo, k_hi = _split_range(num_pid_n, group_m, splits, split_steps, K, BLOCK_K, SPLIT)
        if USE_GDC:  # as above
            tl.extra.cuda.gdc_wait()
        if pid_m >= _filled(post_ptr, BLOCK_M, LISTS):
            return
        row0 = _first_row(start_ptr, pid_m, BLOCK_M, LISTS)
        _gate_up_tile(x_ptr, w_ptr, w_desc, out_ptr, part_ptr, sem_ptr, sorted_ptr, expert_ptr, pairs, N, K, pid_m,
                      pid_n, pid_s, k_lo, k_hi, row0, num_pid_n, splits, stride_xm, stride_we, stride_wn, stride_om,
                      TOP_K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, SPLIT, IEEE, TMA, USE_GDC, True)


@triton.jit
def _reduce_columns(part_ptr, out_ptr, tokens, last, offs_n, pairs, N, splits, stride_om, TOP_K: tl.constexpr,
                    BLOCK_M: tl.constexpr, WIDTH: tl.constexpr, SPLIT: tl.constexpr):
    """out[token, offs_n] = the sum of its TOP_K x splits partial rows there (part [splits, pairs, N]; split by split,
    slot by slot within one: a fixed order) for the tokens (int64) whose last partial this program wrote."""
    mask = last[:, None] & (offs_n < N)[None, :]
    first = part_ptr + (tokens * TOP_K)[:, None] * N + offs_n[None, :]
    total = tl.zeros((BLOCK_M, WIDTH), dtype=tl.float32)
    for s in range(0, splits if SPLIT else 1):
        ptrs = first + s * pairs * N if SPLIT else first
        for _j in tl.static_range(TOP_K):  # the slots' loads issued together
            total += tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
            ptrs += N
    tl.store(out_ptr + tokens[:, None] * stride_om + offs_n[None, :], total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _reduce_tokens(part_ptr, out_ptr, sems, tokens, last, pid_n, pairs, N, splits, stride_om, TOP_K: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RED_N: tl.constexpr, SPLIT: tl.constexpr):
    """The tile's columns of out for the tokens whose last partial this program wrote (`_reduce_columns`): all at
    once, or RED_N at a time (`reduce_width`: fewer registers, a round of loads more a chunk); their semaphores back
    to 0."""
    tokens = tokens.to(tl.int64)
    if RED_N == BLOCK_N:
        _reduce_columns(part_ptr, out_ptr, tokens, last, pid_n * BLOCK_N + tl.arange(0, BLOCK_N), pairs, N, splits,
                        stride_om, TOP_K, BLOCK_M, BLOCK_N, SPLIT)
    else:
        for c in tl.range(0, BLOCK_N // RED_N, loop_unroll_factor=1):
            _reduce_columns(part_ptr, out_ptr, tokens, last, pid_n * BLOCK_N + c * RED_N + tl.arange(0, RED_N), pairs,
                            N, splits, stride_om, TOP_K, BLOCK_M, RED_N, SPLIT)
    tl.store(sems, 0, mask=last)  # left zero for the next launch


@triton.jit
def _down_tile(a_ptr, w_ptr, w_desc, out_ptr, part_ptr, sem_ptr, weights_ptr, sorted_ptr, expert_ptr, pairs, N, K,
               pid_m, pid_n, pid_s, k_lo, k_hi, row0, num_pid_n, splits, stride_am, stride_we, stride_wn, stride_om,
               TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               EVEN_K: tl.constexpr, SPLIT: tl.constexpr, REDUCE: tl.constexpr, RED_N: tl.constexpr,
               IEEE: tl.constexpr, TMA: tl.constexpr, USE_GDC: tl.constexpr, trigger):
    """One tile of `_down_kernel` over split pid_s's K range; w [E, N, K] row-major (TMA: w_desc over [E * N, K]),
    weights [T*k] float32; padding rows read act's row 0. REDUCE (top_k or splits above 1): stored in part
    [splits, pairs, N], counted in the semaphore of each (token, n block), and the program that brings a token's
    count to top_k x splits sums its partial rows into out [T, N] (`_reduce_tokens`); else (one slot, one split) the
    product is the token's row of out. USE_GDC, `trigger` as `_gate_up_tile`'s."""
    e = tl.load(expert_ptr + pid_m)
    rows = tl.load(sorted_ptr + row0 + tl.arange(0, BLOCK_M))
    row_ok = rows < pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + tl.where(row_ok, rows, 0).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = w_ptr + e.to(tl.int64) * stride_we + (offs_n % N)[None, :] * stride_wn + offs_k[:, None]
    if SPLIT:
        a_ptrs += k_lo
        b_ptrs += k_lo
    b_row = e * N + pid_n * BLOCK_N  # TMA: the tile's first row of w as [E * N, K]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        a = tl.load(a_ptrs) if EVEN_K else tl.load(a_ptrs, mask=(offs_k < k_hi - k0)[None, :], other=0.0)
        if TMA:  # zeros past K: no mask
            b = w_desc.load([b_row, k0]).T
        elif EVEN_K:
            b = tl.load(b_ptrs)
        else:
            b = tl.load(b_ptrs, mask=(offs_k < k_hi - k0)[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision="ieee") if IEEE else tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if USE_GDC:  # noqa: SIM102 (a constexpr, then a runtime test) after the K loop (`ops.pdl`, rule 3)
        if trigger:
            tl.extra.cuda.gdc_launch_dependents()
    acc = acc * tl.load(weights_ptr + rows, mask=row_ok, other=0.0)[:, None]
    n_ok = offs_n < N
    mask = row_ok[:, None] & n_ok[None, :]
    if REDUCE:
        part_rows = (pid_s * pairs + rows) if SPLIT else rows
        tl.store(part_ptr + part_rows.to(tl.int64)[:, None] * N + offs_n[None, :], acc.to(part_ptr.dtype.element_ty),
                 mask=mask)
        tl.debug_barrier()  # every thread's partial rows stored before the semaphores say so (release)
        tokens = rows // TOP_K
        sems = sem_ptr + tokens * num_pid_n + pid_n
        last = (tl.atomic_add(sems, 1, mask=row_ok, sem="acq_rel", scope="gpu") == TOP_K * splits - 1) & row_ok
        if tl.max(last.to(tl.int32), axis=0) > 0:
            tl.debug_barrier()
            _reduce_tokens(part_ptr, out_ptr, sems, tokens, last, pid_n, pairs, N, splits, stride_om, TOP_K,
                           BLOCK_M, BLOCK_N, RED_N, SPLIT)
    else:
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["pairs", "group_m", "splits", "split_steps"])
def _down_kernel(a_ptr, w_ptr, w_desc, out_ptr, part_ptr, sem_ptr, weights_ptr, sorted_ptr, expert_ptr, post_ptr,
                 start_ptr, pairs, N, K, group_m, splits, split_steps, stride_am, stride_we, stride_wn, stride_om,
                 TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, SPLIT: tl.constexpr, REDUCE: tl.constexpr, RED_N: tl.constexpr,
                 IEEE: tl.constexpr, USE_GDC: tl.constexpr, TMA: tl.constexpr, PERSISTENT: tl.constexpr,
                 LISTS: tl.constexpr):
    """weight[pair] * (act[pair] @ down[e].T) summed per token, a tile a program or (PERSISTENT) every
    num_programs-th filled tile from this program's (module docstring; `_down_tile`). LISTS as `_gate_up_kernel`'s."""
    num_pid_n = tl.cdiv(N, BLOCK_N)
    if PERSISTENT:
        if USE_GDC:  # launched early: gate|up's launch complete and visible first, before any global access
            tl.extra.cuda.gdc_wait()
        num_tiles = _filled(post_ptr, BLOCK_M, LISTS) * num_pid_n
        for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):  # not flattened: module docstring
            pid_m, pid_n = _program_tile(tile, num_tiles, num_pid_n, group_m)
            row0 = _first_row(start_ptr, pid_m, BLOCK_M, LISTS)
            _down_tile(a_ptr, w_ptr, w_desc, out_ptr, part_ptr, sem_ptr, weights_ptr, sorted_ptr, expert_ptr, pairs, N,
                       K, pid_m, pid_n, 0, 0, K, row0, num_pid_n, 1, stride_am, stride_we, stride_wn, stride_om, TOP_K,
                       BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, False, REDUCE, RED_N, IEEE, TMA, USE_GDC,
                       tile + tl.num_programs(0) >= num_tiles)  # dependents after the last tile's K loop
    else:
        pid_m, pid_n, pid_s, k_lo, k_hi = _split_range(num_pid_n, group_m, splits, split_steps, K, BLOCK_K, SPLIT)
        if USE_GDC:  # as above
            tl.extra.cuda.gdc_wait()
        if pid_m >= _filled(post_ptr, BLOCK_M, LISTS):
            return
        row0 = _first_row(start_ptr, pid_m, BLOCK_M, LISTS)
        _down_tile(a_ptr, w_ptr, w_desc, out_ptr, part_ptr, sem_ptr, weights_ptr, sorted_ptr, expert_ptr, pairs, N, K,
                   pid_m, pid_n, pid_s, k_lo, k_hi, row0, num_pid_n, splits, stride_am, stride_we, stride_wn, stride_om,
                   TOP_K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, SPLIT, REDUCE, RED_N, IEEE, TMA, USE_GDC, True)


def reduce_width(block_m: int, tiles: GemmTiles, top_k: int) -> int:
    """Columns of down's tile that its top-k sum (`_reduce_tokens`) loads at a time: the tiles' REDUCE_N where set,
    else all BLOCK_N unless the TOP_K partial tiles would be more than REDUCE_ELEMS elements a thread at once, then
    the widest power of two within it (at least 16). Compiled for sm_90 under Triton 3.6 at Qwen3-30B-A3B's top-8
    (bench/results/moe_prefill.md): BLOCK_M 64, BLOCK_N 256, 8 warps (512 elements a thread) whole, 149 registers
    and no spill (ptxas interleaves the loads with the sums; before this sum's rewrite, 255 and 160 bytes of spill a
    thread); BLOCK_M 128 (1024) whole 255 and 248 bytes, in halves (the rule) 255 and 16, in quarters (REDUCE_N 64)
    220 and none. A chunk more is a round of loads more, so the rule chunks only past 512."""
    if tiles.reduce_n:
        return tiles.reduce_n
    width = tiles.block_n
    while width > 16 and block_m * width * top_k > REDUCE_ELEMS * 32 * tiles.num_warps:
        width //= 2
    return width


def launch_gate_up(x: torch.Tensor, w13: torch.Tensor, act: torch.Tensor, al: Alignment, top_k: int, block_m: int,
                   tiles: GemmTiles, even_k: bool | None = None, sems: torch.Tensor | None = None,
                   pdl: bool | None = None, tails: TailBlocks | None = None) -> None:
    """act [pairs, I] = SiLU(gate) * up of every pair's token row of x (`_gate_up_kernel`); `even_k` (default:
    whether K % BLOCK_K == 0) picks the unmasked K loop: forcing it off is for the tests. Where `tiles` split K:
    `sems` (int32, zero, at least the tiles of the larger launch; left zero) count the splits, new zeros when None.
    `pdl`: programmatic dependent launch (`ops.pdl.use_pdl`; `triton_moe.py`). `tails`: two launches, the full tiles
    then the tail blocks on the same tiles (`m_lists`)."""
    pairs, inter, h = act.shape[0], act.shape[1], x.shape[1]
    launches = m_lists(al, block_m, tails)
    m_most = max(experts.numel() for _, experts, *_ in launches)
    n_blocks = -(-inter // tiles.block_n)
    split = split_plan(h, tiles, pairs, 2 * inter)
    part = sem = act
    if split.splits > 1:
        part = torch.empty(split.splits, pairs, 2 * inter, dtype=torch.float32, device=x.device)
        sem = _sems(sems, m_most * n_blocks, x.device)
    tma = use_tma(tiles, w13)
    for starts, experts, filled, bm, lists in launches:
        m_blocks = experts.numel()
        _gate_up_kernel[(grid_size(tiles, m_blocks, n_blocks, split.splits, x.device),)](
            x, w13, _weights_arg(w13, tiles, tma), act, part, sem, al.sorted_ids, experts, filled, starts, pairs,
            inter, h, _group_m(tiles, m_blocks), split.splits, split.k_split // tiles.block_k, x.stride(0),
            w13.stride(0), w13.stride(1), act.stride(0), TOP_K=top_k, BLOCK_M=bm, BLOCK_N=tiles.block_n,
            BLOCK_K=tiles.block_k, EVEN_K=h % tiles.block_k == 0 if even_k is None else even_k,
            SPLIT=split.splits > 1, IEEE=x.dtype == torch.float32, TMA=tma,
            PERSISTENT=bool(tiles.persistent) and split.splits == 1, LISTS=lists, num_warps=tiles.num_warps,
            num_stages=tiles.num_stages, **pdl_launch.launch_options(pdl_launch.use_pdl(pdl, x.device)))


def launch_down(act: torch.Tensor, w2: torch.Tensor, out: torch.Tensor, weights: torch.Tensor, al: Alignment,
                top_k: int, block_m: int, tiles: GemmTiles, even_k: bool | None = None,
                sems: torch.Tensor | None = None, pdl: bool | None = None, tails: TailBlocks | None = None) -> None:
    """out [T, h] = for each token the sum over its top_k pairs of the pair's routing weight (`weights` [pairs]
    float32) times its act row @ down[e].T (`_down_kernel`, which sums them too); `even_k` as `launch_gate_up`'s.
    Where a token has more than one partial row (top_k x splits > 1): `sems` (int32, zero, at least T x the n
    blocks; left zero) count them, new zeros when None. `pdl`, `tails` as `launch_gate_up`'s: the two launches
    share the partial rows and the semaphores, so a token whose pairs fall in both is summed by the program that
    brings its count to top_k x splits, in the tail launch (the same sum, in the same order, as one launch's)."""
    pairs, h, inter = act.shape[0], out.shape[1], act.shape[1]
    if out.shape[0] * top_k != pairs:
        raise ValueError(f"out must be [{pairs // top_k}, {h}] for {pairs} pairs of top_k {top_k}, got "
                         f"{tuple(out.shape)}")
    n_blocks = -(-h // tiles.block_n)
    split = split_plan(inter, tiles, pairs, h)
    reduce = top_k * split.splits > 1
    part = sem = out
    if reduce:
        part_dtype = torch.float32 if split.splits > 1 else out.dtype
        part = torch.empty(split.splits, pairs, h, dtype=part_dtype, device=out.device)
        sem = _sems(sems, out.shape[0] * n_blocks, out.device)
    tma = use_tma(tiles, w2)
    for starts, experts, filled, bm, lists in m_lists(al, block_m, tails):
        m_blocks = experts.numel()
        _down_kernel[(grid_size(tiles, m_blocks, n_blocks, split.splits, out.device),)](
            act, w2, _weights_arg(w2, tiles, tma), out, part, sem, weights, al.sorted_ids, experts, filled, starts,
            pairs, h, inter, _group_m(tiles, m_blocks), split.splits, split.k_split // tiles.block_k, act.stride(0),
            w2.stride(0), w2.stride(1), out.stride(0), TOP_K=top_k, BLOCK_M=bm, BLOCK_N=tiles.block_n,
            BLOCK_K=tiles.block_k, EVEN_K=inter % tiles.block_k == 0 if even_k is None else even_k,
            SPLIT=split.splits > 1, REDUCE=reduce, RED_N=reduce_width(bm, tiles, top_k),
            IEEE=act.dtype == torch.float32, TMA=tma, PERSISTENT=bool(tiles.persistent) and split.splits == 1,
            LISTS=lists, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
            **pdl_launch.launch_options(pdl_launch.use_pdl(pdl, out.device)))


__all__ = ["REDUCE_ELEMS", "launch_down", "launch_gate_up", "reduce_width"]
