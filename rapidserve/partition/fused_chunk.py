"""The fused step's prompt chunk: how many of the queue's prompt tokens one mixed step of the decode worker takes so
that its predicted time, corrected, stays within the ITL SLO's limit (partition/policies.py's rule 3, the fused
candidate), and where that chunk ends on a piecewise graph's token bucket. Pure: the cost model
(partition/step_costs.py) and the online correction (partition/correction.py) are given.
"""

from __future__ import annotations

from collections.abc import Sequence

from rapidserve.partition.correction import SIZE_EDGES, Correction
from rapidserve.partition.policy import WaitingPrefill
from rapidserve.partition.shape import ShapeState
from rapidserve.partition.step_costs import Chunk, StepCosts


def chunks(waiting: Sequence[WaitingPrefill], budget: int) -> list[Chunk]:
    """The prompt chunks of a step taking `budget` tokens of the queue in arrival order: (tokens, prefix) each."""
    out, left = [], budget
    for w in waiting:
        if left <= 0:
            break
        n = min(w.tokens, left)
        out.append((n, w.prefix))
        left -= n
    return out


def fused_chunk(state: ShapeState, costs: StepCosts, ratio: float | Correction, limit: float,
                granularity: int = 16) -> tuple[int, float]:
    """(C, raw ms): the largest prompt chunk C <= min(max_chunk_tokens, pending) whose fused step, times its
    correction (`ratio`: one ratio, or a `Correction`: the ratio of the step's size class, decode rows plus C,
    `Correction.fused_ratio`), is within `limit` ms, searched on multiples of `granularity` (and the cap itself),
    with the step's raw prediction; (0, the decode-only step) when not even the smallest chunk fits.

    The step's time grows with C, and within a size class so does its corrected time; across a class edge it may
    fall (a larger class learnt at a lower ratio), so the classes are searched from the largest down, each by
    bisection, and the first that holds a chunk that fits gives the largest."""
    cap = min(state.max_chunk_tokens, state.pending_tokens)
    rows = len(state.decode_contexts)

    def ms(c: int) -> float:
        return costs.fused_ms(state.decode_contexts, chunks(state.waiting, c))

    for lo_c, hi_c, r in reversed(_ratio_segments(ratio, rows, cap)):
        if hi_c == cap:  # the cap itself is a candidate
            top = ms(cap)
            if top * r <= limit:
                return cap, top
            hi_c = cap - 1
        lo_k, hi_k = -(-lo_c // granularity), hi_c // granularity  # candidates k * granularity, k in [lo_k, hi_k]
        if lo_k > hi_k or ms(lo_k * granularity) * r > limit:
            continue
        while lo_k < hi_k:
            mid = (lo_k + hi_k + 1) // 2
            if ms(mid * granularity) * r <= limit:
                lo_k = mid
            else:
                hi_k = mid - 1
        return lo_k * granularity, ms(lo_k * granularity)
    if cap > 0 and granularity > 1:  # below one granule: try the largest that fits in it
        small = min(cap, granularity - 1)
        while small > 0 and ms(small) * _ratio_at(ratio, rows + small) > limit:
            small //= 2
        if small > 0:
            return small, ms(small)
    return 0, costs.fused_ms(state.decode_contexts, []) if state.decode_contexts else 0.0


def _ratio_at(ratio: float | Correction, tokens: int) -> float:
    return ratio.fused_ratio(tokens) if isinstance(ratio, Correction) else float(ratio)


def _ratio_segments(ratio: float | Correction, rows: int, cap: int) -> list[tuple[int, int, float]]:
    """The chunk sizes 1..cap beside `rows` decode rows cut where the ratio changes (one ratio: one segment; a
    `Correction`: at those of its size classes' edges where the ratio differs, so that a correction with no class
    learnt, or classes learnt alike, is searched in one bisection), ascending: (first chunk, last chunk, ratio)."""
    if cap < 1:
        return []
    if not isinstance(ratio, Correction):
        return [(1, cap, float(ratio))]
    out: list[tuple[int, int, float]] = []
    first = 1
    for edge in (*SIZE_EDGES, None):
        last = cap if edge is None else min(cap, edge - rows)
        if last >= first:
            r = ratio.fused_ratio(rows + first)
            if out and out[-1][2] == r:
                out[-1] = (out[-1][0], last, r)
            else:
                out.append((first, last, r))
            first = last + 1
        if first > cap:
            break
    return out


def on_bucket(chunk: int, decode_rows: int, pending: int, buckets: Sequence[int]) -> int:
    """The fused chunk to take instead of `chunk` beside `decode_rows` decode rows, where the step's T = rows + chunk
    tokens replay piecewise graphs padded to a bucket (`buckets`, ascending): the chunk ending on the bucket below T
    when that defers fewer tokens (T - below) than padding to the bucket above would waste (above - T); `chunk`
    itself when T is on a bucket, over the largest (eager), under the smallest, when the chunk finishes every pending
    prompt (its TTFT first), or when the trim would leave no chunk. Pure."""
    t = decode_rows + chunk
    if chunk <= 0 or chunk >= pending or not buckets or t > buckets[-1] or t in buckets:
        return chunk
    above = next(b for b in buckets if b >= t)
    below = max((b for b in buckets if b < t), default=0)
    trimmed = below - decode_rows
    return trimmed if trimmed > 0 and t - below < above - t else chunk
