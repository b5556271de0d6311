"""Reading a partition profile's figures at a decode batch and context: at the bucket at or above each (`lookup`),
between the buckets around them (`estimate(interpolate=True)`), and past the largest bucket by extrapolation from the
two largest (`estimate`, `_extended`). The profile's types, validation, loading and saving are partition/profile.py's.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from rapidserve.partition.profile import Entry, Profile


@dataclass(frozen=True)
class Bucketed:
    """A value rounded up to a profile bucket; beyond=True when it exceeded the largest bucket."""

    bucket: int
    beyond: bool


def bucket_up(buckets: list[int], value: int) -> Bucketed:
    """Round `value` up to the next bucket; beyond the largest -> the largest, flagged."""
    if not buckets:
        raise ValueError("no buckets")
    i = bisect.bisect_left(buckets, value)
    if i >= len(buckets):
        return Bucketed(buckets[-1], True)
    return Bucketed(buckets[i], False)


@dataclass(frozen=True)
class Lookup:
    entry: Entry
    beyond: bool  # the batch or context exceeded the profiled buckets


def entry_index(profile: Profile) -> dict[tuple[str, int, int], Entry]:
    return {(e.config, e.batch, e.context): e for e in profile.entries}


def lookup(profile: Profile, config: str, batch: int, context: int) -> Lookup:
    """The entry for `config` at (batch, context) rounded up to the profile's buckets."""
    b = bucket_up(profile.batch_buckets, batch)
    c = bucket_up(profile.context_buckets, context)
    for e in profile.entries:
        if e.config == config and e.batch == b.bucket and e.context == c.bucket:
            return Lookup(e, b.beyond or c.beyond)
    raise KeyError((config, b.bucket, c.bucket))


def _around(buckets: list[int], value: int) -> tuple[int, int, float, bool]:
    """(lower bucket, upper bucket, weight of the upper in [0, 1], beyond) for linear interpolation: below the
    smallest bucket both are the smallest; beyond the largest both are the largest, flagged."""
    if not buckets:
        raise ValueError("no buckets")
    i = bisect.bisect_left(buckets, value)
    if i >= len(buckets):
        return buckets[-1], buckets[-1], 0.0, True
    if i == 0 or buckets[i] == value:
        return buckets[i], buckets[i], 0.0, False
    lo, hi = buckets[i - 1], buckets[i]
    return lo, hi, (value - lo) / (hi - lo), False


_FIGURES = ("decode_ms_alone_p50", "decode_ms_alone_p95", "decode_ms_beside_prefill_p50",
            "decode_ms_beside_prefill_p95", "prefill_tokens_per_s")


def estimate(profile: Profile, config: str, batch: int, context: int, *, interpolate: bool = False) -> Lookup:
    """`config`'s figures at (batch, context). interpolate=False: `lookup` (each rounded up to its bucket).
    interpolate=True: every figure interpolated linearly between the buckets around the batch and around the
    context (bilinear over the four measured corners); below the smallest bucket the smallest's figures. Beyond the
    largest bucket (flagged, as `lookup`'s), either way: extrapolated linearly from the two largest buckets
    (`_extended`), the batch first, then the context.

    Why: a decode step grows about linearly with its batch and context (weights once, then K/V reads in
    proportion), so rounding up overstates it by up to a whole bucket: 4096-token prompts decode at context
    4097-4160, which rounds up to the 8192 bucket, where the committed H100 Qwen3-8B profile has split16's
    step beside prefill at 48 ms for batch 16 against 31 ms at 4096, and the manager gives prefill 100 SMs
    instead of 116. Measured (H100, 4096:64 all at once, 2026-11-27, bench/results/issue16.md): interpolated,
    6% more requests/s but p99 ITL 63 ms (34 ms rounded up). The profile's step beside prefill was measured beside
    forwards of `prefill_tokens` (4096) tokens; 4096:64's prefill batches hold up to 8192 tokens of 4096-token
    prompts, and decode beside them is slower than the profile has it, which rounding up had hidden. So the
    manager rounds up unless `--profile-lookup interpolate` asks otherwise. (The returned entry's batch and
    context are the query's, clamped to the profiled range, not a bucket's.)

    Beyond the largest bucket the same growth holds, and reading the largest bucket's figures instead understates a
    step by as much as the batch exceeds it: the committed H200 Qwen3-8B profile stops at batch 128, while with
    vLLM's default of 1024 sequences 1024:256 ran 140-300 in flight (2026-11-30, bench/results/issue37.md), each read
    as 128."""
    bb, cb = profile.batch_buckets, profile.context_buckets
    if not bb or not cb:
        raise ValueError("no buckets")
    b_in, c_in = min(batch, bb[-1]), min(context, cb[-1])

    def at(b: int, c: int) -> dict[str, float]:  # within the buckets' range (each at most the largest)
        e = (_interpolated(profile, config, b, c) if interpolate else lookup(profile, config, b, c).entry)
        return {f: getattr(e, f) for f in _FIGURES}

    def by_batch(c: int) -> dict[str, float]:
        if batch <= bb[-1] or len(bb) < 2:
            return at(b_in, c)
        return _extended(at(bb[-1], c), at(bb[-2], c), (batch - bb[-1]) / (bb[-1] - bb[-2]))

    figures = by_batch(c_in)
    if context > cb[-1] and len(cb) >= 2:
        figures = _extended(figures, by_batch(cb[-2]), (context - cb[-1]) / (cb[-1] - cb[-2]))
    low_b, low_c = (min(max(batch, bb[0]), bb[-1]), min(max(context, cb[0]), cb[-1])) if interpolate else \
        (bucket_up(bb, batch).bucket, bucket_up(cb, context).bucket)
    return Lookup(Entry(config, low_b, low_c, **figures), batch > bb[-1] or context > cb[-1])


def _interpolated(profile: Profile, config: str, batch: int, context: int) -> Entry:
    """The bilinear interpolation of `config`'s entries at (batch, context), each within the buckets' range."""
    b_lo, b_hi, tb, _ = _around(profile.batch_buckets, batch)
    c_lo, c_hi, tc, _ = _around(profile.context_buckets, context)
    corners: dict[tuple[int, int], float] = {}
    for b, c, w in ((b_lo, c_lo, (1 - tb) * (1 - tc)), (b_hi, c_lo, tb * (1 - tc)), (b_lo, c_hi, (1 - tb) * tc),
                    (b_hi, c_hi, tb * tc)):
        corners[b, c] = corners.get((b, c), 0.0) + w  # the same corner twice where a value sits on a bucket
    found: dict[tuple[int, int], Entry] = {}
    for e in profile.entries:
        if e.config == config and (e.batch, e.context) in corners:
            found[e.batch, e.context] = e
            if len(found) == len(corners):
                break
    missing = [k for k in corners if k not in found]
    if missing:
        raise KeyError((config, *missing[0]))
    figures = {f: sum(w * getattr(found[k], f) for k, w in corners.items()) for f in _FIGURES}
    return Entry(config, min(max(batch, b_lo), b_hi), min(max(context, c_lo), c_hi), **figures)


MIN_EXTENDED_PREFILL = 0.5  # past the buckets, prefill's rate falls to at most this share of the largest bucket's


def _extended(last: dict[str, float], before: dict[str, float], t: float) -> dict[str, float]:
    """The figures `t` bucket-steps past the largest bucket (`last`), on the line through the two largest (`before`
    one step below): a decode step never shorter than at the largest bucket, prefill's rate beside it never higher
    and never below MIN_EXTENDED_PREFILL of it, and each p95 at least its p50. Pure."""
    out = {f: last[f] + (last[f] - before[f]) * t for f in _FIGURES}
    for f in _FIGURES[:4]:
        out[f] = max(out[f], last[f])
    rate = last["prefill_tokens_per_s"]
    out["prefill_tokens_per_s"] = min(rate, max(out["prefill_tokens_per_s"], MIN_EXTENDED_PREFILL * rate))
    out["decode_ms_alone_p95"] = max(out["decode_ms_alone_p95"], out["decode_ms_alone_p50"])
    out["decode_ms_beside_prefill_p95"] = max(out["decode_ms_beside_prefill_p95"], out["decode_ms_beside_prefill_p50"])
    return out
