"""The pruned tile space bench/moe_tune.py sweeps for the fused MoE GEMMs (ops/triton_moe.py), and its choice of the
winner: pure functions, no GPU (tests/test_moe_tune.py checks them on CPU).

Per (shape, token count T) point, with p = T * top_k / E pairs per expert on average:

- BLOCK_M: `block_m_candidates(p)`, 1-3 sizes around p (decode's runs of a few rows only 16; long prefills 64, 128);
  above TAIL_MIN_P pairs an expert (prefill) also BLOCK_M 64 and 128 with a TAIL_BLOCK_M (`TAILS`: each expert's
  rows past its full tiles in a second launch of blocks of 16 or 32, `ops.moe.TailBlocks`), timed as further m
  candidates (`m_candidates`) on their BLOCK_M's tiles (the tail launch takes the same tiles);
- per BLOCK_M, each GEMM's (BLOCK_N, BLOCK_K, num_warps, num_stages[, SPLIT_K]) from a hand-pruned list (`GATE_UP`,
  `DOWN`: small N tiles and deep K steps for decode's memory-bound runs, and at BLOCK_M 16 the same wide tiles with K
  split over 2 or 4 programs, so a few experts' tiles still fill the SMs; wide N tiles and 8 warps for prefill's
  compute-bound ones; the untuned rule's own tiles always among them), less those whose pipeline stages exceed
  Hopper's shared memory, each timed at GROUP_M = `FIRST_GROUP`;
- then GROUP_M (a runtime argument: no compile) swept over `GROUPS` on each GEMM's winner;
- the BLOCK_M whose two winners sum fastest wins (`choose`); it is kept only if the whole layer (alignment, both GEMMs,
  sum) beats the rule's config at that point, else the rule's config is written (`bench/moe_tune.py` times both).

Decode is memory-bound: each program streams its expert's [BLOCK_N, K] weight tiles once, the same bytes whatever the
tile, so one thing a tile decides is how evenly the programs spread over the SMs (`grid_balance`: the SMs' busy share
when each streams its resident programs' tiles at an equal rate; `resident`: programs one SM holds, by shared memory
and warps). At Qwen3-30B-A3B's batch 1 (8 experts, gate|up N = 768) the BLOCK_M 16 list had none above 0.73 (BLOCK_N
16 with BLOCK_K 256 and 4 stages: 384 programs, 2 resident an SM, so two waves of 264; BLOCK_N 32: 192 programs, two on
60 SMs and one on 72); (16, 128, 4, 4) holds 4 an SM: all 384 at once, 2-3 an SM, 0.97 (tests/test_moe_tune.py). The
model leaves out what a program's own rate depends on (its bytes in flight, the L2): the H200 sweep of 09:51 UTC chose
BLOCK_N 64-128 there (96-48 programs), so the sweep, not the model, decides; the model only says which tiles to try.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from rapidserve.ops.moe_plan import split_plan
from rapidserve.ops.moe_tiles import ALL_M, GemmTiles, MoeKernelConfig, rule_config

TOKENS = (8192, 4096, 1024, 256, 1, 8, 64, 2048, 512, 128, 32, 16, 4, 2)  # bench/moe_gemm.py's rows first
SMEM_BYTES = 232448  # one Hopper block's shared memory (227 KiB)
SMS = 132  # H100 / H200 SXM streaming multiprocessors
SM_SMEM_BYTES = 233472  # one Hopper SM's shared memory (228 KiB), 1 KiB of it reserved per resident block
SM_WARPS = 64
FIRST_GROUP = 8
GROUPS = (1, 8, 32, ALL_M)

# (BLOCK_N, BLOCK_K, num_warps, num_stages[, SPLIT_K[, TMA[, PERSISTENT[, REDUCE_N]]]]) per BLOCK_M. gate|up holds
# two BLOCK_M x BLOCK_N accumulators. From BLOCK_M 32 up (prefill) the H200 tables' winners also come with the weights
# by TMA, on a persistent grid (one program an SM; two for a down tile two of which fit an SM), and both; at BLOCK_M
# 128 a down tile whose top-k sum takes quarters (REDUCE_N 64: Qwen3's top-8 then compiles to 220 registers and no
# spill; the rule's halves 255 and 16 bytes) (ops/triton_moe_gemm.py; bench/results/moe_prefill.md says why).
Tile = tuple[int, ...]
GATE_UP: Mapping[int, tuple[Tile, ...]] = {
    16: ((16, 256, 4, 4), (16, 128, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4), (64, 64, 4, 5),
         (128, 128, 4, 3), (128, 128, 4, 3, 2), (128, 128, 4, 3, 4), (64, 128, 4, 4, 2), (64, 128, 4, 4, 4),
         (32, 128, 4, 3, 4)),
    32: ((32, 128, 4, 4), (64, 64, 4, 4), (64, 128, 4, 4), (128, 64, 4, 4), (128, 64, 8, 4),
         (64, 128, 4, 4, 1, 1), (64, 128, 4, 4, 1, 1, 1)),
    64: ((64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 4, 4), (128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 8, 5),
         (128, 64, 4, 4, 1, 1), (128, 64, 4, 4, 1, 0, 1), (128, 64, 4, 4, 1, 1, 1)),
    128: ((64, 64, 8, 4), (128, 64, 8, 3), (128, 64, 8, 4), (64, 128, 8, 3),
          (128, 64, 8, 4, 1, 1), (128, 64, 8, 3, 1, 0, 1), (128, 64, 8, 3, 1, 1, 1)),
}
DOWN: Mapping[int, tuple[Tile, ...]] = {
    16: ((32, 128, 4, 4), (64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 4), (128, 64, 4, 5), (256, 64, 4, 4),
         (128, 128, 4, 4, 2), (128, 128, 4, 4, 4), (256, 64, 4, 4, 2), (256, 64, 4, 4, 4), (64, 128, 4, 4, 2)),
    32: ((64, 64, 4, 4), (64, 128, 4, 4), (128, 64, 4, 4), (128, 128, 4, 3), (256, 64, 8, 3),
         (256, 64, 8, 3, 1, 1), (256, 64, 8, 3, 1, 1, 1)),
    64: ((64, 64, 4, 4), (128, 64, 4, 4), (128, 64, 8, 4), (128, 128, 8, 3), (256, 64, 8, 3), (256, 64, 8, 4),
         (256, 64, 8, 4, 1, 1), (128, 64, 4, 4, 1, 1), (256, 64, 8, 4, 1, 0, 1), (128, 64, 4, 3, 1, 1, 2)),
    128: ((128, 64, 8, 4), (128, 128, 8, 3), (256, 64, 8, 3), (256, 64, 8, 4),
          (256, 64, 8, 4, 1, 1), (256, 64, 8, 3, 1, 0, 1), (256, 64, 8, 3, 1, 1, 1), (256, 64, 8, 4, 1, 0, 0, 64)),
}
# the --dry-run space: tiny tiles the interpreter runs quickly
# the tail blocks (TAIL_BLOCK_M) tried with each prefill BLOCK_M, above TAIL_MIN_P pairs an expert: at Qwen3-30B-A3B's
# 4096 tokens (256 +- 16 pairs an expert) BLOCK_M 128 pads about half the experts by a mostly empty third tile (~20% of
# the MMA work), a tail of 16 or 32 by at most 15 or 31 rows (bench/results/moe_tune_h200_1130/README.md)
TAILS: Mapping[int, tuple[int, ...]] = {64: (16,), 128: (16, 32)}
TAIL_MIN_P = 48
QUICK_GATE_UP: Mapping[int, tuple[Tile, ...]] = {16: ((16, 32, 4, 2), (32, 32, 4, 2, 2)), 32: ((16, 32, 4, 2),)}
QUICK_DOWN: Mapping[int, tuple[Tile, ...]] = {16: ((32, 16, 4, 2), (64, 16, 4, 2, 2)), 32: ((32, 16, 4, 2),)}
QUICK_TAILS = ((32, 16),)  # the dry run's tail candidate: BLOCK_M 32, tail blocks of 16
QUICK_GROUPS = (ALL_M,)
QUICK_TOKENS = (4,)


class Shape(NamedTuple):
    """One rank's slice of one MoE layer: E experts, N = its intermediate size, K = hidden, top_k."""

    model: str
    tp: int
    num_experts: int
    n: int
    k: int
    top_k: int


def per_expert(shape: Shape, tokens: int) -> float:
    return tokens * shape.top_k / shape.num_experts


def block_m_candidates(p: float, quick: bool = False) -> tuple[int, ...]:
    """BLOCK_M sizes worth timing at p pairs per expert: near p, never far above it (padding is wasted work)."""
    if quick or p <= 4:
        return (16,)
    if p <= 12:
        return (16, 32)
    if p <= 48:
        return (16, 32, 64)
    if p <= 192:
        return (32, 64, 128)
    return (64, 128)


def m_candidates(p: float, quick: bool = False) -> tuple[tuple[int, int], ...]:
    """(BLOCK_M, TAIL_BLOCK_M) pairs worth timing at p pairs per expert: each of `block_m_candidates` without a tail
    (0), then above TAIL_MIN_P the `TAILS` of each (the dry run: QUICK_TAILS)."""
    plain = tuple((bm, 0) for bm in block_m_candidates(p, quick))
    if quick:
        return plain + QUICK_TAILS
    if p <= TAIL_MIN_P:
        return plain
    return plain + tuple((bm, tail) for bm, _ in plain for tail in TAILS.get(bm, ()))


def smem_bytes(block_m: int, block_n: int, block_k: int, stages: int, products: int, elem: int = 2) -> int:
    """Shared memory of the pipelined A and B tiles: `stages` buffers of a BLOCK_M x BLOCK_K tile of A and
    `products` BLOCK_K x BLOCK_N tiles of weights (2 for gate|up)."""
    return stages * (block_m * block_k + products * block_k * block_n) * elem


def resident(block_m: int, tiles: GemmTiles, products: int) -> int:
    """Programs of these tiles one Hopper SM holds at once: by shared memory (`smem_bytes` + 1 KiB each) and warps."""
    smem = smem_bytes(block_m, tiles.block_n, tiles.block_k, tiles.num_stages, products) + 1024
    return min(SM_SMEM_BYTES // smem, SM_WARPS // tiles.num_warps)


def grid_balance(programs: int, per_sm: int, sms: int = SMS) -> float:
    """The SMs' busy share of a memory-bound grid of `programs` equal programs, `per_sm` resident an SM, each SM
    streaming its resident programs at an equal rate: all resident (programs <= per_sm * sms), the time is that of the
    SM with the most, ceil(programs / sms); else of ceil(programs / (per_sm * sms)) full waves."""
    slots = per_sm * sms
    if programs <= slots:
        return programs / (-(-programs // sms) * sms)
    return programs / (-(-programs // slots) * slots)


def splits(k: int, tiles: GemmTiles) -> int:
    """Programs one tile's K range of `k` takes under tiles.split_k (`ops.moe_plan.split_plan` without its scratch
    bound, which decode sizes never reach): whole BLOCK_K steps each, no empty split."""
    return split_plan(k, tiles, 0, 0).splits


def decode_balance(shape: Shape, tokens: int, gemm: str, tiles: GemmTiles, block_m: int = 16) -> float:
    """`grid_balance` of one GEMM at a decode batch of `tokens` whose pairs all go to distinct experts (top_k *
    tokens of them, at most E; one run each): programs = experts x N blocks x K splits (gate|up: N = the intermediate
    size, K the hidden; down: the other way round)."""
    experts = min(shape.num_experts, shape.top_k * tokens)
    n, k, products = (shape.n, shape.k, 2) if gemm == "gate_up" else (shape.k, shape.n, 1)
    return grid_balance(experts * -(-n // tiles.block_n) * splits(k, tiles), resident(block_m, tiles, products))


def _tiles(block_m: int, table: Mapping[int, tuple[Tile, ...]], products: int, quick: bool) -> list[GemmTiles]:
    rule = rule_config(block_m * 8, 8, hip=False)  # the rule's tiles at this BLOCK_M
    own: list[Tile] = [] if quick or rule.block_m != block_m else [
        (rule.gate_up.block_n, rule.gate_up.block_k, rule.gate_up.num_warps, rule.gate_up.num_stages)]
    out: list[GemmTiles] = []
    for bn, bk, warps, stages, *rest in [*table[block_m], *own]:
        t = GemmTiles(bn, bk, FIRST_GROUP, warps, stages, *rest)
        if t not in out and smem_bytes(block_m, bn, bk, stages, products) <= SMEM_BYTES:
            out.append(t)
    return out


def gate_up_candidates(block_m: int, quick: bool = False) -> list[GemmTiles]:
    return _tiles(block_m, QUICK_GATE_UP if quick else GATE_UP, 2, quick)


def down_candidates(block_m: int, quick: bool = False) -> list[GemmTiles]:
    return _tiles(block_m, QUICK_DOWN if quick else DOWN, 1, quick)


def with_group(tiles: GemmTiles, group_m: int) -> GemmTiles:
    return tiles._replace(group_m=group_m)


def other_groups(groups: tuple[int, ...]) -> tuple[int, ...]:
    """The GROUP_M values the sweep times after the first."""
    return tuple(g for g in groups if g != FIRST_GROUP)


def fastest(times: Mapping[GemmTiles, float]) -> GemmTiles:
    """The tiles of the least time; the first listed on a tie."""
    return min(times, key=lambda t: times[t])


def choose(best: Mapping[int | tuple[int, int], tuple[GemmTiles, float, GemmTiles, float]]) -> MoeKernelConfig | None:
    """BLOCK_M or (BLOCK_M, TAIL_BLOCK_M; 0: none) -> (gate|up tiles, ms, down tiles, ms) of each m candidate's
    winners: the candidate of the least sum (on a tie the smaller BLOCK_M: less padding; at one BLOCK_M no tail, then
    the smaller: fewer launches); None when no candidate had both GEMMs run (every candidate failed)."""
    def m(key: int | tuple[int, int]) -> tuple[int, int]:
        return key if isinstance(key, tuple) else (key, 0)

    ok = [b for b in sorted(best, key=m) if math.isfinite(best[b][1] + best[b][3])]
    if not ok:
        return None
    win = min(ok, key=lambda b: best[b][1] + best[b][3])
    gu, _, dn, _ = best[win]
    return MoeKernelConfig(m(win)[0], gu, dn, m(win)[1])


def compile_key(tiles: GemmTiles, k: int) -> GemmTiles:
    """The tiles as the JIT sees them: GROUP_M, the split count and a persistent grid's size are runtime arguments
    (GROUP_M 1, SPLIT_K 1 or 2 for whether K is split at all, at this GEMM's K; PERSISTENT 1 or 0 for whether the
    grid is persistent)."""
    return tiles._replace(group_m=1, split_k=min(splits(k, tiles), 2), persistent=min(tiles.persistent, 1))


def compile_set(shapes: Iterable[Shape], quick: bool = False) -> set[tuple[str, int, int, GemmTiles, bool, int]]:
    """Every distinct kernel launch the sweep compiles: (kernel, TOP_K, BLOCK_M, `compile_key` tiles, EVEN_K,
    TAIL_BLOCK_M); GROUP_M and the number of splits are runtime arguments and do not compile. One with a tail (not 0)
    compiles the kernel twice, its full tiles' launch and its tail blocks' (the latter shared by the BLOCK_Ms of one
    tail)."""
    out: set[tuple[str, int, int, GemmTiles, bool, int]] = set()
    for s in shapes:
        for t in TOKENS if not quick else QUICK_TOKENS:
            for bm, tail in m_candidates(per_expert(s, t), quick):
                for g in gate_up_candidates(bm, quick):
                    out.add(("gate_up", s.top_k, bm, compile_key(g, s.k), s.k % g.block_k == 0, tail))
                for d in down_candidates(bm, quick):
                    out.add(("down", s.top_k, bm, compile_key(d, s.n), s.n % d.block_k == 0, tail))
    return out


def space_size(shape: Shape, quick: bool = False) -> int:
    """Timed configurations at one shape over all token counts: tiles at the first GROUP_M, then the GROUP_M sweep
    of each winner, then the layer under the winner and under the rule."""
    groups = QUICK_GROUPS if quick else GROUPS
    n = 0
    for t in TOKENS if not quick else QUICK_TOKENS:
        for bm, _ in m_candidates(per_expert(shape, t), quick):
            n += len(gate_up_candidates(bm, quick)) + len(down_candidates(bm, quick)) + 2 * len(other_groups(groups))
        n += 2
    return n

