"""How the fused MoE kernels (`ops/triton_moe.py`, issue 40) cut their work and launch: the split of a GEMM's K range
over several programs (`GemmTiles.split_k`, from the tuned tables of `ops.moe_tiles`) and the int32 semaphores the
cross-program sums count on, as pure functions (bench/moe_tune_space.py uses the same plan to count a candidate's
programs)."""

from __future__ import annotations

from typing import NamedTuple

from rapidserve.ops.moe import max_padded, tail_capacity
from rapidserve.ops.moe_tiles import GemmTiles, MoeKernelConfig

SPLIT_SCRATCH_BYTES = 64 << 20  # the most fp32 partial sums a split GEMM may hold (`split_plan`)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Split(NamedTuple):
    """How one GEMM's K range is cut: `splits` programs a tile, each over `k_split` (whole BLOCK_K steps) of K."""

    splits: int
    k_split: int


def split_plan(k: int, tiles: GemmTiles, rows: int, width: int) -> Split:
    """The split of K under `tiles`: at most tiles.split_k parts of whole BLOCK_K steps (fewer where K has fewer
    steps: no split is empty), and none where the fp32 partial sums of `rows` rows of `width` columns per split would
    pass SPLIT_SCRATCH_BYTES (a long prefill under a decode bucket's tiles)."""
    steps = _cdiv(k, tiles.block_k)
    want = min(tiles.split_k, steps)
    if want > 1 and want * rows * width * 4 > SPLIT_SCRATCH_BYTES:
        want = 1
    k_split = _cdiv(steps, want) * tiles.block_k
    return Split(_cdiv(k, k_split), k_split)


def semaphores(cfg: MoeKernelConfig, tokens: int, top_k: int, num_experts: int, inter: int, hidden: int,
               ) -> tuple[int, int]:
    """(gate|up's, down's) int32 semaphores: one a (m block, n block) tile where gate|up splits K (with TAIL_BLOCK_M
    the blocks of its larger list), one a (token, n block) where down sums more than one partial row (top_k x
    splits > 1); 0 where none is needed."""
    pairs = tokens * top_k
    gate_up = 0
    if split_plan(hidden, cfg.gate_up, pairs, 2 * inter).splits > 1:
        m_blocks = max_padded(pairs, num_experts, cfg.block_m) // cfg.block_m
        if cfg.tail_m:  # the larger of the two launches' lists: each leaves them zero for the next
            m_blocks = max(tail_capacity(pairs, num_experts, cfg.block_m, cfg.tail_m))
        gate_up = m_blocks * _cdiv(inter, cfg.gate_up.block_n)
    down = 0
    if top_k * split_plan(inter, cfg.down, pairs, hidden).splits > 1:
        down = tokens * _cdiv(hidden, cfg.down.block_n)
    return gate_up, down


__all__ = ["SPLIT_SCRATCH_BYTES", "Split", "semaphores", "split_plan"]
