"""The expert alignment of the fused MoE layer (issue 40, `ops/triton_moe.py`) in Triton: `ops.moe.Alignment` of
expert ids [T, k], bit for bit what `ops.moe.align_block_size` computes, from one or two launches with no host read
and a grid fixed by the pairs count, so a CUDA graph captures it; any number of experts.

A stable counting sort, vectorised over the experts: a chunk of SUB pairs at a time becomes a one-hot tile
[SUB, E_P] (E_P = E rounded up to a power of two, SUB * E_P = TILE elements); its column sums count each expert's
pairs, and its cumulative sum down the pairs gives each pair its rank among the earlier pairs of its expert, so a
pair's row is its expert's run start + the pairs of that expert before its chunk + that rank (the sum of its row of
the tile times those per-expert values: no gather). Pairs keep their order within an expert's run, as torch's stable
sort keeps it: the layout is deterministic, and equal to `align_block_size`'s.

- `_align_one_kernel` (at most ONE_PROGRAM pairs: decode batches; its body `_align_all` is also the second half of
  `triton_moe_route`'s routing kernel): one program counts every pair (one pass over
  the tiles), lays out the runs (each expert's count padded to BLOCK_M, their cumulative sum), then writes every
  pair's row (a second pass), the sentinel T*k into each run's padding (a [E_P, 16] tile a step: at most BLOCK_M - 1
  rows an expert) and into every row past the padded total, and each BLOCK_M block's expert (the number of runs that
  end at or before the block's first row: a [MB_TILE, E_P] comparison; -1 past the total).
- above it, two launches of NB programs, each owning a block of `block` pairs (a multiple of SUB, about the square
  root of the pairs: `pairs_per_program`): `_align_count_kernel` stores each block's per-expert counts [NB, E]
  (scratch); `_align_scatter_kernel` sums that table in every program (the experts' totals, and the counts of the
  blocks before its own: its pairs' base rows), writes its own pairs' rows, its share of the padding (column chunks
  of every expert's), of the blocks' experts and of the rows past the total; program 0 stores the total. A program's
  work is about block / SUB + NB / NB_TILE tile steps (NB_TILE = SUB), least where block ~ NB ~ sqrt(pairs).

Tail blocks (a tile table's TAIL_BLOCK_M, `ops.moe.TailBlocks`): the alignment runs at BLOCK_M = the tail block,
and `_align_scatter_kernel` (FULL_M, the GEMMs' BLOCK_M, above 0) also writes the two GEMM launches' block lists
from the runs it has laid out: each expert's full FULL_M tiles, then its remaining tail blocks, found for a share
of each list by the same [MB_TILE, E_P] comparison as the blocks' experts (`_fill_list`); program 0 stores the
counts. `align_into` then always takes the two launches (the one program, shared with the routing kernel, has no
lists).

Both paths also write zeros into a caller's int32 buffer (`zero`: the grouped GEMMs' semaphores, which must be zero
before they run; the one program all of it, the count launch a share each), so clearing it costs no launch.

Every row < max_padded (`ops.moe.max_padded`) and every block of sorted_ids / expert_ids is written exactly once,
by one thread, so no store races another. Expert ids must lie in [0, E) (the router's top-k does): a pair of an id
outside counts for no expert and is in no run.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from rapidserve.ops.moe import Alignment, TailBlocks, max_padded, tail_capacity

ONE_PROGRAM = 128  # at most this many pairs are aligned by `_align_one_kernel`, more by the two-launch path
TILE = 4096  # elements of the one-hot tile [SUB, E_P] (and of the count table's [NB_TILE, E_P] tile)
WARPS = 8
MB_TILE = tl.constexpr(32)  # blocks whose expert one step finds
PAD_TILE = tl.constexpr(16)  # padding rows a step writes per expert
TAIL = tl.constexpr(1024)  # rows past the total a step writes


@triton.jit
def _count(ids_ptr, lo, hi, pairs, SUB: tl.constexpr, E_P: tl.constexpr):
    """Pairs of each expert among pairs [lo, hi) ([E_P] int32); hi - lo a multiple of SUB."""
    counts = tl.zeros([E_P], tl.int32)
    for s in range(lo, hi, SUB):  # the one-hot tile [SUB, E_P] of pairs [s, s + SUB) (rows past `pairs` zero)
        offs = s + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + offs, mask=offs < pairs, other=-1)
        counts += tl.sum((ids[:, None] == tl.arange(0, E_P)[None, :]).to(tl.int32), axis=0)
    return counts


@triton.jit
def _scatter(ids_ptr, sorted_ptr, lo, hi, pairs, base, SUB: tl.constexpr, E_P: tl.constexpr):
    """sorted_ids[base[e] + (pairs of e in [lo, hi) before it)] = each pair of [lo, hi), e its expert."""
    nxt = base
    for s in range(lo, hi, SUB):  # as `_count`'s
        offs = s + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + offs, mask=offs < pairs, other=-1)
        hot = (ids[:, None] == tl.arange(0, E_P)[None, :]).to(tl.int32)
        row = tl.sum((tl.cumsum(hot, axis=0) - hot + nxt[None, :]) * hot, axis=1)
        tl.store(sorted_ptr + row, offs, mask=offs < pairs)
        nxt += tl.sum(hot, axis=0)


@triton.jit
def _runs(totals, BLOCK_M: tl.constexpr):
    """(first row, end row) of each expert's run ([E_P] each): its pairs padded to BLOCK_M, in expert order."""
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    return ends - padded, ends


@triton.jit
def _fill_padding(sorted_ptr, first, ends, lo, step, pairs, BLOCK_M: tl.constexpr, E_P: tl.constexpr):
    """The sentinel `pairs` into the rows first[e] + j of every expert's padding (first: its run's start + its
    pairs; fewer than BLOCK_M rows up to ends[e]), for j in the PAD_TILE-wide column chunks lo, lo + step, ..."""
    for j in range(lo, BLOCK_M - 1, step):
        rows = first[:, None] + j + tl.arange(0, PAD_TILE)[None, :]
        tl.store(sorted_ptr + rows, tl.zeros([E_P, PAD_TILE], tl.int32) + pairs, mask=rows < ends[:, None])


@triton.jit
def _fill_blocks(expert_ptr, ends, total, lo, hi, BLOCK_M: tl.constexpr):
    """expert_ids of blocks [lo, hi): the expert whose run holds the block's first row (the runs ending at or before
    it), -1 from `total` on."""
    for j in range(lo, hi, MB_TILE):
        blocks = j + tl.arange(0, MB_TILE)
        first_row = blocks * BLOCK_M
        e = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ptr + blocks, tl.where(first_row < total, e, -1), mask=blocks < hi)


@triton.jit
def _fill_list(start_ptr, list_expert_ptr, first, lo_idx, hi_idx, lo, hi, STEP: tl.constexpr, E_P: tl.constexpr):
    """Entries [lo, hi) of a `TailBlocks` list: entry j lies in the expert e with lo_idx[e] <= j < hi_idx[e]; its
    block starts at row first[e] + (j - lo_idx[e]) * STEP (0 and expert -1 in no expert's range)."""
    experts = tl.arange(0, E_P)
    for j in range(lo, hi, MB_TILE):
        idx = j + tl.arange(0, MB_TILE)
        hot = (lo_idx[None, :] <= idx[:, None]) & (idx[:, None] < hi_idx[None, :])
        row = tl.sum(tl.where(hot, first[None, :] + (idx[:, None] - lo_idx[None, :]) * STEP, 0), axis=1)
        e = tl.sum(tl.where(hot, experts[None, :] + 1, 0), axis=1) - 1
        tl.store(start_ptr + idx, row, mask=idx < hi)
        tl.store(list_expert_ptr + idx, e, mask=idx < hi)


@triton.jit
def _fill_lists(ms_ptr, me_ptr, ts_ptr, te_ptr, cnt_ptr, starts, ends, n_main, n_tail, b, nb, BLOCK_M: tl.constexpr,
                FULL_M: tl.constexpr, E_P: tl.constexpr):
    """Program b of nb's share of the `TailBlocks` lists (capacities n_main, n_tail) of the runs [starts, ends)
    (padded to BLOCK_M, the tail block): each expert's full FULL_M tiles, then its other blocks; program 0 the
    counts."""
    per = FULL_M // BLOCK_M
    blocks = (ends - starts) // BLOCK_M
    full = blocks // per
    tail = blocks - full * per
    main_end = tl.cumsum(full, axis=0)
    tail_end = tl.cumsum(tail, axis=0)
    share = tl.cdiv(n_main, nb)
    _fill_list(ms_ptr, me_ptr, starts, main_end - full, main_end, b * share, tl.minimum(b * share + share, n_main),
               FULL_M, E_P)
    share = tl.cdiv(n_tail, nb)
    _fill_list(ts_ptr, te_ptr, starts + full * FULL_M, tail_end - tail, tail_end, b * share,
               tl.minimum(b * share + share, n_tail), BLOCK_M, E_P)
    tl.store(cnt_ptr, tl.max(main_end, axis=0), mask=b == 0)
    tl.store(cnt_ptr + 1, tl.max(tail_end, axis=0), mask=b == 0)


@triton.jit
def _fill_tail(sorted_ptr, total, lo, hi, pairs):
    """The sentinel `pairs` into rows [max(lo, total), hi)."""
    for r in range(tl.maximum(lo, total), hi, TAIL):
        rows = r + tl.arange(0, TAIL)
        tl.store(sorted_ptr + rows, tl.zeros([TAIL], tl.int32) + pairs, mask=rows < hi)


@triton.jit
def _zero(zero_ptr, lo, hi):
    """Zeros into zero_ptr[lo, hi) (the grouped GEMMs' semaphores, `align_into`'s `zero`)."""
    for z in range(lo, hi, TAIL):
        offs = z + tl.arange(0, TAIL)
        tl.store(zero_ptr + offs, tl.zeros([TAIL], tl.int32), mask=offs < hi)


@triton.jit
def _align_all(ids_ptr, sorted_ptr, expert_ptr, post_ptr, pairs, rows, BLOCK_M: tl.constexpr, SUB: tl.constexpr,
               E_P: tl.constexpr):
    """The whole `Alignment` of `pairs` expert ids by this one program (module docstring); rows = max_padded."""
    totals = _count(ids_ptr, 0, pairs, pairs, SUB, E_P)
    starts, ends = _runs(totals, BLOCK_M)
    total = tl.max(ends, axis=0)
    _scatter(ids_ptr, sorted_ptr, 0, pairs, pairs, starts, SUB, E_P)
    _fill_padding(sorted_ptr, starts + totals, ends, 0, PAD_TILE, pairs, BLOCK_M, E_P)
    _fill_blocks(expert_ptr, ends, total, 0, rows // BLOCK_M, BLOCK_M)
    _fill_tail(sorted_ptr, total, 0, rows, pairs)
    tl.store(post_ptr, total)


@triton.jit(do_not_specialize=["pairs", "rows", "n_zero"])
def _align_one_kernel(ids_ptr, sorted_ptr, expert_ptr, post_ptr, zero_ptr, pairs, rows, n_zero,
                      BLOCK_M: tl.constexpr, SUB: tl.constexpr, E_P: tl.constexpr):
    """The whole `Alignment` of `pairs` expert ids in one program (module docstring), and n_zero zeros at
    zero_ptr."""
    _align_all(ids_ptr, sorted_ptr, expert_ptr, post_ptr, pairs, rows, BLOCK_M, SUB, E_P)
    _zero(zero_ptr, 0, n_zero)


@triton.jit(do_not_specialize=["pairs", "block", "n_zero"])
def _align_count_kernel(ids_ptr, counts_ptr, zero_ptr, pairs, block, n_zero, NUM_EXPERTS: tl.constexpr,
                        SUB: tl.constexpr, E_P: tl.constexpr):
    """counts[b, e] = pairs of expert e among pairs [b * block, (b + 1) * block), b this program; and its share of
    the n_zero zeros at zero_ptr."""
    b = tl.program_id(0)
    experts = tl.arange(0, E_P)
    counts = _count(ids_ptr, b * block, b * block + block, pairs, SUB, E_P)
    tl.store(counts_ptr + b * NUM_EXPERTS + experts, counts, mask=experts < NUM_EXPERTS)
    share = tl.cdiv(n_zero, tl.num_programs(0))
    _zero(zero_ptr, b * share, tl.minimum(b * share + share, n_zero))


@triton.jit(do_not_specialize=["pairs", "block", "rows", "n_main", "n_tail"])
def _align_scatter_kernel(ids_ptr, counts_ptr, sorted_ptr, expert_ptr, post_ptr, ms_ptr, me_ptr, ts_ptr, te_ptr,
                          cnt_ptr, pairs, block, rows, n_main, n_tail, NUM_EXPERTS: tl.constexpr,
                          BLOCK_M: tl.constexpr, SUB: tl.constexpr, E_P: tl.constexpr, NB_TILE: tl.constexpr,
                          FULL_M: tl.constexpr):
    """This program's share of the `Alignment` from the count table [NB, E] (module docstring), and with FULL_M
    (above 0) of the `TailBlocks` lists (ms/me: main starts/experts, ts/te: tail's, cnt: counts)."""
    b = tl.program_id(0)
    nb = tl.num_programs(0)
    experts = tl.arange(0, E_P)
    totals = tl.zeros([E_P], tl.int32)
    before = tl.zeros([E_P], tl.int32)  # pairs of each expert in the blocks before this one
    for c in range(0, nb, NB_TILE):
        blocks = c + tl.arange(0, NB_TILE)
        counts = tl.load(counts_ptr + blocks[:, None] * NUM_EXPERTS + experts[None, :],
                         mask=(blocks < nb)[:, None] & (experts < NUM_EXPERTS)[None, :], other=0)
        totals += tl.sum(counts, axis=0)
        before += tl.sum(tl.where((blocks < b)[:, None], counts, 0), axis=0)
    starts, ends = _runs(totals, BLOCK_M)
    total = tl.max(ends, axis=0)
    _scatter(ids_ptr, sorted_ptr, b * block, b * block + block, pairs, starts + before, SUB, E_P)
    _fill_padding(sorted_ptr, starts + totals, ends, b * PAD_TILE, nb * PAD_TILE, pairs, BLOCK_M, E_P)
    m_blocks = rows // BLOCK_M
    share = tl.cdiv(m_blocks, nb)
    _fill_blocks(expert_ptr, ends, total, b * share, tl.minimum(b * share + share, m_blocks), BLOCK_M)
    share = tl.cdiv(rows, nb)
    _fill_tail(sorted_ptr, total, b * share, tl.minimum(b * share + share, rows), pairs)
    tl.store(post_ptr, total, mask=b == 0)
    if FULL_M > 0:
        _fill_lists(ms_ptr, me_ptr, ts_ptr, te_ptr, cnt_ptr, starts, ends, n_main, n_tail, b, nb, BLOCK_M, FULL_M,
                    E_P)


def sub_pairs(num_experts: int) -> int:
    """SUB: pairs of one one-hot tile [SUB, E_P] of TILE elements (at least 1)."""
    return max(TILE // triton.next_power_of_2(num_experts), 1)


def pairs_per_program(pairs: int, num_experts: int) -> int:
    """`block` of the two-launch path: the least power of two times SUB that is at least sqrt(pairs) (module
    docstring), so NB = ceil(pairs / block) <= ceil(sqrt(pairs))."""
    sub = sub_pairs(num_experts)
    root = math.isqrt(max(pairs, 1) - 1) + 1  # ceil(sqrt(pairs))
    return sub * triton.next_power_of_2(-(-root // sub))


def empty_alignment(pairs: int, num_experts: int, block_m: int, device: torch.device) -> Alignment:
    """Uninitialised buffers of the `Alignment` of `pairs` pairs (max_padded rows)."""
    rows = max_padded(pairs, num_experts, block_m)
    return Alignment(torch.empty(rows, dtype=torch.int32, device=device),
                     torch.empty(rows // block_m, dtype=torch.int32, device=device),
                     torch.empty(1, dtype=torch.int32, device=device))


def check_buffers(pairs: int, num_experts: int, block_m: int, out: Alignment) -> None:
    rows = out.sorted_ids.numel()
    if rows != max_padded(pairs, num_experts, block_m) or out.expert_ids.numel() != rows // block_m:
        raise ValueError(f"alignment buffers of {rows} rows and {out.expert_ids.numel()} blocks for {pairs} pairs: "
                         "allocate them with empty_alignment(pairs, num_experts, block_m, device)")


def zero_target(zero: torch.Tensor | None, out: Alignment) -> tuple[torch.Tensor, int]:
    """(pointer, count) of `zero` for the kernels: an int32 contiguous tensor, or nothing (a dummy, 0)."""
    if zero is None:
        return out.num_post, 0
    if zero.dtype != torch.int32 or not zero.is_contiguous():
        raise ValueError(f"zero must be a contiguous int32 tensor, got {zero.dtype}")
    return zero, zero.numel()


def empty_tails(pairs: int, num_experts: int, block_m: int, tail_m: int, device: torch.device) -> TailBlocks:
    """Uninitialised buffers of the `TailBlocks` of `pairs` pairs (`tail_capacity`); block_m the GEMMs' BLOCK_M, a
    multiple of tail_m above it."""
    if not (tail_m < block_m and block_m % tail_m == 0):
        raise ValueError(f"the tail block {tail_m} must divide BLOCK_M {block_m} and be smaller")
    n_main, n_tail = tail_capacity(pairs, num_experts, block_m, tail_m)
    new = lambda n: torch.empty(n, dtype=torch.int32, device=device)  # noqa: E731
    return TailBlocks(new(n_main), new(n_main), new(n_tail), new(n_tail), new(2), block_m, tail_m)


def _check_tails(pairs: int, num_experts: int, block_m: int, tails: TailBlocks) -> None:
    want = tail_capacity(pairs, num_experts, tails.block_m, tails.tail_m)
    if tails.tail_m != block_m or (tails.main_starts.numel(), tails.tail_starts.numel()) != want:
        raise ValueError(f"tail block lists of {tails.main_starts.numel()} / {tails.tail_starts.numel()} blocks at "
                         f"tail {tails.tail_m} for {pairs} pairs aligned at {block_m}: allocate them with "
                         "empty_tails(pairs, num_experts, block_m, tail_m, device) and align at tail_m")


def align_into(ids: torch.Tensor, num_experts: int, block_m: int, out: Alignment,
               one_program: bool | None = None, zero: torch.Tensor | None = None,
               tails: TailBlocks | None = None) -> Alignment:
    """Writes every element of `out` (`empty_alignment`'s buffers) with the `Alignment` of expert ids [T, k] (int32,
    on their device; module docstring): one program for at most ONE_PROGRAM pairs, else two launches;
    `one_program` forces the path (tests, the benches; no pairs always take one program). `zero` (int32): filled
    with zeros by the same launches (the grouped GEMMs' semaphores, `triton_moe`), so they cost no launch of their
    own. `tails` (`empty_tails`' buffers, block_m their tail block): also written, by the two launches whatever the
    pairs. Returns `out`."""
    flat = ids.reshape(-1).to(torch.int32)
    pairs, rows = flat.numel(), out.sorted_ids.numel()
    check_buffers(pairs, num_experts, block_m, out)
    zero_ptr, n_zero = zero_target(zero, out)
    e_p, sub = triton.next_power_of_2(num_experts), sub_pairs(num_experts)
    if tails is not None:
        _check_tails(pairs, num_experts, block_m, tails)
        if pairs == 0:  # no program to write them: nothing to list
            for t, fill in zip(tails[:5], (0, -1, 0, -1, 0), strict=True):
                t.fill_(fill)
        else:
            one_program = False
    if pairs == 0 or (pairs <= ONE_PROGRAM if one_program is None else one_program):
        _align_one_kernel[(1,)](flat, out.sorted_ids, out.expert_ids, out.num_post, zero_ptr, pairs, rows, n_zero,
                                BLOCK_M=block_m, SUB=sub, E_P=e_p, num_warps=WARPS)
        return out
    block = pairs_per_program(pairs, num_experts)
    nb = -(-pairs // block)
    counts = torch.empty(nb, num_experts, dtype=torch.int32, device=flat.device)
    _align_count_kernel[(nb,)](flat, counts, zero_ptr, pairs, block, n_zero, NUM_EXPERTS=num_experts, SUB=sub,
                               E_P=e_p, num_warps=WARPS)
    lists = (out.num_post,) * 5 if tails is None else tails[:5]
    n_main, n_tail = (0, 0) if tails is None else (tails.main_starts.numel(), tails.tail_starts.numel())
    _align_scatter_kernel[(nb,)](flat, counts, out.sorted_ids, out.expert_ids, out.num_post, *lists, pairs, block,
                                 rows, n_main, n_tail, NUM_EXPERTS=num_experts, BLOCK_M=block_m, SUB=sub, E_P=e_p,
                                 NB_TILE=max(TILE // e_p, 1), FULL_M=0 if tails is None else tails.block_m,
                                 num_warps=WARPS)
    return out


def align(ids: torch.Tensor, num_experts: int, block_m: int, one_program: bool | None = None,
          zero: torch.Tensor | None = None) -> Alignment:
    """`ops.moe.Alignment` of expert ids [T, k] on their device, in new buffers (`align_into`)."""
    out = empty_alignment(ids.numel(), num_experts, block_m, ids.device)
    return align_into(ids, num_experts, block_m, out, one_program, zero)


def align_tails(ids: torch.Tensor, num_experts: int, block_m: int, tail_m: int,
                zero: torch.Tensor | None = None) -> tuple[Alignment, TailBlocks]:
    """The `Alignment` of expert ids [T, k] at the tail block `tail_m` and its `TailBlocks` for the GEMMs' BLOCK_M
    `block_m`, in new buffers, in the two launches (`align_into`)."""
    tails = empty_tails(ids.numel(), num_experts, block_m, tail_m, ids.device)
    out = empty_alignment(ids.numel(), num_experts, tail_m, ids.device)
    return align_into(ids, num_experts, tail_m, out, False, zero, tails), tails
