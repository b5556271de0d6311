"""Which KV heads move between which ranks in disagg mode with tensor parallelism on either side (NPMD).

Disagg mode (engine/disagg.py) runs a prefill side of N tensor-parallel ranks (`--prefill-tensor-parallel-size`)
and a decode side of M (`--tensor-parallel-size`). Each rank's pool holds only its shard of the KV heads
(parallel/shard.py: with T ranks and K KV heads, T dividing K, rank t holds the model's heads
[t*K/T, (t+1)*K/T), in that order, as heads 0 .. K/T - 1 of its pool). So the KV of one block is spread over
the ranks of each side, cut differently when N != M.

A `HeadRoute` is one pair of ranks whose head ranges overlap, and the slice each pool holds of their common
heads. Every KV head lies on exactly one rank of each side (no replicated heads: N and M divide K, checked by
`ParallelConfig.disagg_problem`), so:
- a push: prefill rank r copies, for each of its routes, its slice of every pushed block into the route's
  decode rank; every decode rank receives each of its heads from exactly one prefill rank;
- a pull (a cached prefix): prefill rank r copies each route's slice from that decode rank; the routes of r
  cover all of r's heads exactly once.
With N == M each prefill rank r has the one route r <-> r over all its heads; with N | M (or M | N) a rank
of the smaller side is paired with M/N (N/M) ranks of the other, each over a part of its heads.
Pure functions, no torch: tests/test_disagg_routes.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadRoute:
    """Prefill rank `prefill_rank` and decode rank `decode_rank` share the model's KV heads `heads`
    [start, stop), which are heads `prefill_heads` of the prefill rank's pool and `decode_heads` of the decode
    rank's (each [start, stop), as long as `heads`)."""

    prefill_rank: int
    decode_rank: int
    heads: tuple[int, int]
    prefill_heads: tuple[int, int]
    decode_heads: tuple[int, int]


def head_range(kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """The model's KV heads [start, stop) that rank `rank` of `tp` holds (`tp` must divide `kv_heads`)."""
    if tp < 1 or not 0 <= rank < tp or kv_heads % tp:
        raise ValueError(f"rank {rank} of {tp} cannot hold a whole share of {kv_heads} KV heads")
    per = kv_heads // tp
    return rank * per, (rank + 1) * per


def head_routes(kv_heads: int, prefill_tp: int, decode_tp: int) -> list[HeadRoute]:
    """Every pair of ranks whose heads overlap, by prefill rank then decode rank."""
    out = []
    for r in range(prefill_tp):
        p0, p1 = head_range(kv_heads, prefill_tp, r)
        for s in range(decode_tp):
            d0, d1 = head_range(kv_heads, decode_tp, s)
            lo, hi = max(p0, d0), min(p1, d1)
            if lo < hi:
                out.append(HeadRoute(r, s, (lo, hi), (lo - p0, hi - p0), (lo - d0, hi - d0)))
    return out


def prefill_routes(kv_heads: int, prefill_tp: int, decode_tp: int, rank: int) -> list[HeadRoute]:
    """Prefill rank `rank`'s routes, by decode rank: the decode pools it pushes into and pulls from."""
    return [h for h in head_routes(kv_heads, prefill_tp, decode_tp) if h.prefill_rank == rank]


def decode_peers(kv_heads: int, prefill_tp: int, decode_tp: int, rank: int) -> list[int]:
    """The prefill ranks decode rank `rank` hands its pool to (start-up), ascending."""
    return [h.prefill_rank for h in head_routes(kv_heads, prefill_tp, decode_tp) if h.decode_rank == rank]
