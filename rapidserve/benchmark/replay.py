"""Replaying a trace (`--workload trace --trace PATH`): the window, the arrivals, the prompts, the
ideal prefix-cache hit rate.

The window: the requests at trace times [`--trace-start`, `--trace-start` + `--duration-s`)
(seconds of trace time from its earliest request, before any time scaling; no `--duration-s`: to
the trace's end), in time order. Each request whose prompt + output exceeds the max model length
is clipped (`clip_lengths`: the output is kept first, capped at half the window; a clipped prompt
is the start of the unclipped one) or skipped (`--trace-overflow clip|skip`); then `--num-prompts`
caps how many are replayed. The report counts the requests in the window, replayed, clipped,
skipped, and those left out by the cap.

Arrivals (`--trace-arrivals`), one run per load point:
- timestamps: the trace's own times; request i is released (t_i - t_first) / S seconds after the
  run's start, for each `--time-scale` S: S = 2 replays twice as fast (inter-arrival times halved,
  twice the request rate), S = 0.5 half as fast. The run's "rate" is the offered rate:
  (n - 1) / (t_last - t_first) * S requests/s (inf when all arrive at once).
- poisson: the trace's lengths in trace order, released by Poisson arrivals at each
  `--request-rate` (as DuetServe replays its traces); the trace's times only choose the window.

Prompts are token ids in [token_lo, token_hi). With Mooncake `hash_ids`, hash block h (512
tokens) is the 512 ids `lo + splitmix64(splitmix64(h ^ key) + j) % (hi - lo)`, j = 0..511 (a
counter-based generator keyed by the hash id: equal ids give equal tokens, different ids different
ones with overwhelming probability), where key depends only on (seed, run): a run's prefixes repeat
exactly where the trace's ids do, but no run finds another's prompts in a prefix cache. A prompt is
its blocks in order, cut to its length (a last partial block is the first tokens of its block).
Without hash ids (Azure) each prompt is random tokens of its own (no reuse).

The ideal prefix-cache hit rate of the replayed requests (in replay order, as if every earlier
request's prompt were still cached, whatever the capacity): the fraction of prompt tokens that a
cache could reuse. `ideal_hit_rate_hash_blocks` (Mooncake only): a 512-token hash block counts its
tokens when its id and all ids before it in the prompt are the start of an earlier replayed
prompt. `ideal_hit_rate`: the same at the engine's block size (`--block-size`, default 16), on the
derived tokens: a full block counts when it and every block before it equal an earlier prompt's
(derived from the hash ids, no tokens built). Without hash ids both are 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rapidserve.benchmark.arrivals import arrival_times
from rapidserve.benchmark.traces import HASH_BLOCK_TOKENS, Trace, TraceSpec, load_trace
from rapidserve.benchmark.workloads import BenchRequest, WorkloadSpec, clip_lengths, random_tokens, request_rng

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


@dataclass(frozen=True)
class ReplayItem:
    """One replayed request: its trace line and time, its lengths (after clipping), its hash ids
    (only those its prompt uses) and whether it was clipped."""

    line: int
    t_s: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] | None
    clipped: bool = False


@dataclass(frozen=True)
class Replay:
    trace: Trace
    spec: TraceSpec
    items: tuple[ReplayItem, ...]
    window_s: tuple[float, float | None]  # [start, end) of trace time; end None: the trace's end
    in_window: int
    clipped: int
    skipped: int
    beyond_cap: int  # in the window after the --num-prompts cap was reached (neither clipped nor skipped)
    hits: dict[str, Any]

    def offsets(self, point: float, rng: np.random.Generator, burstiness: float = 1.0) -> np.ndarray:
        """Release offsets (s) of one run: `point` is the time scale (timestamps) or the rate (poisson, gamma
        gaps of shape `burstiness`)."""
        if self.spec.arrivals == "timestamps":
            if burstiness != 1.0:
                raise ValueError("--burstiness shapes Poisson arrivals: a trace's timestamps have their own")
            t = np.array([it.t_s for it in self.items])
            return (t - t[0]) / point
        return arrival_times(point, "poisson", rng, num=len(self.items), burstiness=burstiness)

    def offered_rate(self, point: float) -> float:
        """Requests/s of a run at `point`: the rate (poisson), or (n - 1) / span * scale (timestamps)."""
        if self.spec.arrivals == "poisson":
            return point
        span = self.items[-1].t_s - self.items[0].t_s
        return (len(self.items) - 1) / span * point if span > 0 else math.inf

    def request(self, i: int, seed: int, salt: int, lo: int, hi: int) -> BenchRequest:
        """Request `i` of the replay with tokens for run `salt`."""
        it = self.items[i]
        if it.hash_ids is None:
            prompt = random_tokens(request_rng(seed, i, salt + 1), it.input_len, lo, hi)
        else:
            prompt = hash_block_tokens(it.hash_ids, it.input_len, lo, hi, run_key(seed, salt)).tolist()
        return BenchRequest(i, prompt, it.output_len)

    def describe(self) -> dict[str, Any]:
        start, end = self.window_s
        return {"file": self.trace.path, "format": self.trace.format, "arrivals": self.spec.arrivals,
                "window_s": [start, end], "trace_span_s": self.trace.span_s,
                "replayed_span_s": self.items[-1].t_s - self.items[0].t_s, "first_line": self.items[0].line,
                "last_line": self.items[-1].line, "in_window": self.in_window, "replayed": len(self.items),
                "clipped": self.clipped, "skipped": self.skipped, "beyond_num_prompts": self.beyond_cap,
                "overflow": self.spec.overflow, "prompt_tokens": sum(it.input_len for it in self.items),
                "output_tokens": sum(it.output_len for it in self.items), **self.hits}


def build_replay(spec: WorkloadSpec, num_prompts: int | None, duration_s: float | None) -> Replay:
    """The replay of `spec.trace` (ValueError naming the flag when the window holds nothing)."""
    ts = spec.trace
    if ts is None:
        raise ValueError("the trace workload needs --trace PATH")
    ts.check()
    trace = load_trace(ts.path)
    end = ts.start_s + duration_s if duration_s is not None else None
    if ts.start_s > trace.span_s:
        raise ValueError(f"--trace-start {ts.start_s:g} is past the end of --trace {trace.path} "
                         f"({trace.span_s:g} s from its first request)")
    items: list[ReplayItem] = []
    in_window = clipped = skipped = beyond = 0
    mml = spec.max_model_len
    for r in trace.requests:
        if r.t_s < ts.start_s or (end is not None and r.t_s >= end):
            continue
        in_window += 1
        if num_prompts is not None and len(items) >= num_prompts:
            beyond += 1
            continue
        n_in, n_out = clip_lengths(r.input_len, r.output_len, mml)
        cut = (n_in, n_out) != (max(1, r.input_len), max(1, r.output_len))
        if cut and ts.overflow == "skip":
            skipped += 1
            continue
        clipped += cut
        blocks = -(-n_in // HASH_BLOCK_TOKENS)
        ids = r.hash_ids[:blocks] if r.hash_ids is not None and len(r.hash_ids) >= blocks else None  # 0 -> 1 token
        items.append(ReplayItem(r.line, r.t_s, n_in, n_out, ids, cut))
    if not items:
        what = (f"[{ts.start_s:g}, {end:g}) s" if end is not None else f"from {ts.start_s:g} s")
        why = f" ({skipped} skipped as longer than the max model length {mml})" if skipped else ""
        raise ValueError(f"no request of --trace {trace.path} to replay in the window {what}{why}: "
                         "move --trace-start, lengthen --duration-s or use --trace-overflow clip")
    hits = ideal_hits(items, ts.block_size) if trace.has_hash_ids else {
        "ideal_hit_rate": 0.0, "ideal_hit_tokens": 0, "block_size": ts.block_size,
        "hit_rate_note": "no hash ids in this trace: every prompt is random tokens of its own"}
    return Replay(trace, ts, tuple(items), (ts.start_s, end), in_window, clipped, skipped, beyond, hits)


def ideal_hits(items: Sequence[ReplayItem], block_size: int) -> dict[str, Any]:
    """The ideal prefix-cache hits of `items` in order (see the module docstring), from hash ids."""
    trie: dict[tuple[int, int], int] = {}  # (parent node, hash id) -> node: one node per distinct id prefix
    longest: list[int] = []  # node -> the longest earlier prompt (tokens) that starts with its prefix
    hash_hit = engine_hit = total = 0
    for it in items:
        n = it.input_len
        total += n
        ids = it.hash_ids or ()
        node, deepest, reach = -1, -1, 0
        for b, h in enumerate(ids):  # the longest id prefix seen before, and how far earlier prompts went
            nxt = trie.get((node, h))
            if nxt is None:
                break
            node, deepest, reach = nxt, b, longest[nxt]
        if deepest >= 0:
            covered = min(n, HASH_BLOCK_TOKENS * (deepest + 1))
            hash_hit += covered
            engine_hit += min(covered, reach) // block_size * block_size
        node = -1
        for h in ids:  # record this prompt's prefixes
            key = (node, h)
            nxt = trie.get(key)
            if nxt is None:
                nxt = trie[key] = len(longest)
                longest.append(0)
            longest[nxt] = max(longest[nxt], n)
            node = nxt
    return {"ideal_hit_rate": engine_hit / total if total else 0.0, "ideal_hit_tokens": engine_hit,
            "block_size": block_size, "ideal_hit_rate_hash_blocks": hash_hit / total if total else 0.0,
            "ideal_hit_tokens_hash_blocks": hash_hit, "hash_block_tokens": HASH_BLOCK_TOKENS,
            "hit_rate_note": f"ideal: every earlier replayed prompt cached; in {HASH_BLOCK_TOKENS}-token hash blocks "
                             f"(the trace's ids) and in full {block_size}-token blocks"}


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer on uint64 (a bijection; wraps around)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def run_key(seed: int, salt: int) -> int:
    """The 64-bit key of one run's hash-block tokens: depends only on (seed, salt)."""
    z = np.array([(seed * _GOLDEN + salt * 0xD1B54A32D192ED03 + 1) & _MASK], dtype=np.uint64)
    with np.errstate(over="ignore"):
        return int(_mix(z)[0])


def hash_block_tokens(hash_ids: Sequence[int], n: int, lo: int, hi: int, key: int) -> np.ndarray:
    """The first `n` token ids of the prompt made of `hash_ids`' blocks (see the module docstring)."""
    blocks = -(-n // HASH_BLOCK_TOKENS)
    if blocks > len(hash_ids):
        raise ValueError(f"{len(hash_ids)} hash ids cover {len(hash_ids) * HASH_BLOCK_TOKENS} tokens, not {n}")
    ids = np.array([h & _MASK for h in hash_ids[:blocks]], dtype=np.uint64)
    with np.errstate(over="ignore"):
        base = _mix(ids ^ np.uint64(key & _MASK))
        x = _mix(base[:, None] + np.arange(HASH_BLOCK_TOKENS, dtype=np.uint64)[None, :])
    return (lo + (x % np.uint64(hi - lo)).astype(np.int64)).reshape(-1)[:n]
