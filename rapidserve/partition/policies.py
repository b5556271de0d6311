"""The adaptive policy (`--policy duet`, DuetServe's design, arXiv 2511.04791): fused when it can, split when it must.

At each step boundary the decode worker asks for a step shape (partition/shape.py); `decide_adaptive` is the
pure decision, `DuetPolicy` the `StepPolicy` that keeps its memory (hysteresis, online correction). Rules, in
the order they are tried:

1. Nothing pending: `DecodeAlone` on the whole GPU. While the prefill worker still holds prompts handed to it
   earlier, decode stays on its split (`DecodeAlone(split)`), never on the whole GPU beside a prefill (on
   Hopper a prefill GEMM holds every SM and starves decode: /work/shared/FACTS.md); leaving a split for the
   whole GPU waits `hysteresis_steps` steps held, unless the split alone breaks the SLO.
2. No decode running: `Fused(max_chunk_tokens)`, the prompts alone on the whole GPU in the decode worker (no
   hand-off), unless the prefill worker still holds prompts: then the rest goes to it too, on the
   configuration with the most prefill throughput (the whole GPU where the plan has it).
3. Decode running and prompts pending, the prefill worker idle: the two candidates are
   * fused: the largest chunk C (up to max_chunk_tokens and the pending tokens) whose predicted fused step
     (`StepCosts.fused_ms` of the decode rows plus the first C pending tokens in arrival order, times the
     fused correction of a step that size) is within margin x SLO: an SLO-aware token budget, found by
     bisection over C (the step time grows with C), ended on a graph bucket where that wastes less than
     padding (`on_bucket`); its prefill throughput is C / step;
   * split: over the plan's splits and a few prefill batch sizes P (the pending tokens up to the budget, and
     halvings of it down to min_chunk_tokens), decode's predicted step beside the prefill worker (times the
     split correction) within margin x SLO, the one with the most prefill tokens/s; its look-ahead
     k = ceil(t_prefill / t_decode) decode steps per launch cover the prefill batch.
   A fused step that finishes every pending prompt within the SLO is taken (no hand-off, no switch). Else the
   one with more prefill throughput wins, with hysteresis: leaving the current kind (fused or split)
   needs `switch_gain` times its throughput. A fused chunk smaller than min(min_chunk_tokens, pending) is
   not worth a step of its own when a split meets the SLO. Where no split meets the SLO a fused chunk that
   does is taken however small; where nothing meets it, the shape with the fastest decode step (and the
   reason says the SLO cannot be met). No SLO (slo_itl_ms None): fused with the whole budget.
4. Decode running, prompts pending and the prefill worker busy: never fused (both phases on the whole GPU);
   the rest goes to the prefill worker on the split it already runs on (`Split`, the split kept for the
   batch it launched), unless that split breaks the SLO (switch at once to the best one), or another has
   `switch_gain` times its prefill throughput and the current one was held `hysteresis_steps` steps.

Predicting and correcting: every time is a `StepCosts` prediction (partition/step_costs.py: the measured
profile where one exists, else the roofline with the peaks measured at start-up, tensor-parallel collectives
included in both), multiplied by the running measured/predicted ratio of its kind (partition/correction.py; a
fused step's, of its size class: the fused model's error depends on the step's size).
The decode worker copies `DuetPolicy.last.model_ms` (the raw prediction of decode's next step) into the
`StepTiming` of that step and gives it back through `observe`, which updates the ratio: a GPU 30% slower than
the model makes every prediction 30% longer within ~25 steps, so the fused chunk shrinks to what the GPU
really fits in the SLO; one outlier moves a ratio by at most 5%. The margin of "margin x SLO" is itself adapted from
the same timings unless fixed (`--slo-margin`; partition/margin.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from rapidserve.partition.correction import DEFAULT_CORRECTION, Correction, CorrectionParams, corrected
from rapidserve.partition.fused_chunk import chunks, fused_chunk, on_bucket
from rapidserve.partition.manager import ManagerState
from rapidserve.partition.margin import Margin, MarginParams, adapted
from rapidserve.partition.shape import (
    OVERALLOCATED,
    DecodeAlone,
    Fused,
    ShapeState,
    Split,
    StepShape,
    StepTiming,
)
from rapidserve.partition.step_costs import StepCosts
from rapidserve.policy_spec import POLICY_SPECS


@dataclass(frozen=True)
class AdaptiveParams:
    margin: float = 0.9  # a step must be predicted within margin x SLO
    min_chunk_tokens: int = 256  # a fused chunk below this (and below what is pending) is not worth it beside a split
    switch_gain: float = 1.15  # leave the current shape kind / split for one promising this much more throughput
    hysteresis_steps: int = 8  # steps a split is held before it is left for a better one or the whole GPU
    max_lookahead: int = 64  # decode steps per launch at most
    chunk_granularity: int = 16  # the fused chunk search steps by this many tokens
    prefill_batch_tokens: int | None = None  # a split's prefill batch at most (--prefill-batch-tokens; None: budget)
    # the token buckets of the fused steps' piecewise graphs (the decode worker's; () where it runs them eager): a
    # fused step of T tokens runs padded to the smallest bucket >= T, so its chunk is trimmed to end on the bucket
    # below where that defers fewer tokens than the padding would waste (`on_bucket`)
    graph_buckets: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not (0 < self.margin <= 1 and self.min_chunk_tokens >= 1 and self.switch_gain >= 1
                and self.hysteresis_steps >= 0 and self.max_lookahead >= 1 and self.chunk_granularity >= 1
                and (self.prefill_batch_tokens is None or self.prefill_batch_tokens >= 1)):
            raise ValueError(f"AdaptiveParams({self}): need 0 < margin <= 1, min_chunk_tokens >= 1, switch_gain >= 1, "
                             "hysteresis_steps >= 0, max_lookahead >= 1, chunk_granularity >= 1, "
                             "prefill_batch_tokens >= 1 or None")


@dataclass(frozen=True)
class ShapeDecision:
    shape: StepShape
    model_ms: float | None  # the cost model's raw prediction of the next step (decode's, beside prefill in a split)
    predicted_ms: float | None  # the same, corrected (what was compared with the SLO)
    prefill_tokens_per_s: float  # predicted prompt throughput of the shape (0: none)
    meets_slo: bool
    reason: str


@dataclass(frozen=True)
class _Option:
    shape: StepShape
    model_ms: float
    step_ms: float  # corrected
    tokens_per_s: float


def decode_config(shape: StepShape) -> str:
    """The configuration decode runs on in `shape` (a fused step: the whole GPU)."""
    return OVERALLOCATED if isinstance(shape, Fused) else shape.config


def whole_config(costs: StepCosts) -> str:
    """Decode's configuration on the whole GPU: overallocated, else the split with the most decode units."""
    names = [c.name for c in costs.configurations]
    if OVERALLOCATED in names:
        return OVERALLOCATED
    return max(costs.configurations, key=lambda c: (c.decode_units, c.name)).name


def _mean(contexts: Sequence[int]) -> int:
    return -(-sum(contexts) // len(contexts)) if contexts else 0


def _batch_sizes(cap: int, floor: int) -> list[int]:
    """Prefill batch sizes a split is tried with: the cap, its half and its quarter, none below `floor`."""
    return [cap] + [p for p in (cap // 2, cap // 4) if p >= floor]


def split_options(state: ShapeState, costs: StepCosts, corr: Correction, params: AdaptiveParams,
                  tokens: int) -> dict[str, _Option]:
    """Per split configuration (decode on a share), its best prefill batch of at most `tokens` tokens (and of
    `params.prefill_batch_tokens`): the most prefill tokens/s (ties: the larger batch), with decode's step beside it
    and the look-ahead k. The batch's tokens/s counts its chunks' attention to their cached prefixes (the queue's
    first `p` tokens: a prompt chunked here or a prefix-cache hit continues after one), as a fused chunk's is counted:
    priced on one side only, a split looked faster than it is deep into long prompts and after long cached
    conversations (`StepCosts.prefix_ms`)."""
    batch, context = len(state.decode_contexts), _mean(state.decode_contexts)
    tokens = min(tokens, params.prefill_batch_tokens or tokens)
    out: dict[str, _Option] = {}
    for c in costs.configurations:
        if c.decode_units == 0:
            continue
        for p in _batch_sizes(tokens, min(params.min_chunk_tokens, tokens)):
            raw, tps = costs.split(c.name, batch, context, p)
            extra = costs.prefix_ms(c.name, chunks(state.waiting, p))  # its chunks' attention to their prefixes
            if extra and tps > 0:  # priced as the fused composition prices it (step_costs.py), on the split's share
                tps = p / (p / tps + extra / 1e3)
            step = raw * corr.split_ratio(c.name)
            k = max(1, min(params.max_lookahead, math.ceil(1e3 * p / tps / step))) if step > 0 and tps > 0 else 1
            o = _Option(Split(c.name, p, k), raw, step, tps)
            if c.name not in out or tps > out[c.name].tokens_per_s:
                out[c.name] = o
    return out


def _best(options: dict[str, _Option], limit: float) -> _Option | None:
    """The option meeting the limit with the most prefill throughput (ties: the faster decode step)."""
    ok = [o for o in options.values() if o.step_ms <= limit]
    return max(ok, key=lambda o: (o.tokens_per_s, -o.step_ms, decode_config(o.shape))) if ok else None


def _fastest(options: dict[str, _Option]) -> _Option | None:
    return min(options.values(), key=lambda o: (o.step_ms, decode_config(o.shape))) if options else None


def _decision(o: _Option, limit: float, reason: str) -> ShapeDecision:
    return ShapeDecision(o.shape, o.model_ms, o.step_ms, o.tokens_per_s, o.step_ms <= limit, reason)


def _describe(o: _Option) -> str:
    if isinstance(o.shape, Split):
        s = o.shape
        return (f"split {s.config} (decode {o.step_ms:.1f} ms x {s.lookahead} beside a {s.prefill_batch_tokens}-token "
                f"prefill batch, {o.tokens_per_s:.0f} tok/s)")
    assert isinstance(o.shape, Fused)
    return f"fused {o.shape.chunk_tokens}-token chunk ({o.step_ms:.1f} ms, {o.tokens_per_s:.0f} tok/s)"


def _nothing_pending(state: ShapeState, costs: StepCosts, corr: Correction, params: AdaptiveParams, limit: float,
                     current: str, held_steps: int) -> ShapeDecision:
    batch, context, whole = len(state.decode_contexts), _mean(state.decode_contexts), whole_config(costs)
    if state.prefill_worker_tokens > 0:
        if batch == 0:
            return ShapeDecision(DecodeAlone(current), None, None, 0.0, True,
                                 "nothing to decode; the prefill worker finishes its prompts")
        opts = split_options(state, costs, corr, params, min(state.prefill_worker_tokens, state.max_chunk_tokens))
        cur = opts.get(current)
        if cur is not None and cur.step_ms <= limit:
            return ShapeDecision(DecodeAlone(current), cur.model_ms, cur.step_ms, 0.0, True,
                                 f"keep split {current} while the prefill worker finishes its batch "
                                 f"(decode {cur.step_ms:.1f} ms)")
        pick = _best(opts, limit) or _fastest(opts)
        if pick is None:
            return ShapeDecision(DecodeAlone(whole), None, None, 0.0, False,
                                 "no split configured: decode waits on the whole GPU for the prefill worker")
        why = "breaks the SLO" if cur is not None else "is not a split (decode would starve beside the prefill)"
        return _decision(_Option(DecodeAlone(decode_config(pick.shape)), pick.model_ms, pick.step_ms, 0.0), limit,
                         f"the prefill worker holds prompts and {current} {why}: decode on "
                         f"{decode_config(pick.shape)} ({pick.step_ms:.1f} ms)")
    if current != whole and batch > 0 and held_steps < params.hysteresis_steps:
        raw = costs.decode_alone_ms(current, batch, context)
        if raw * corr.split_ratio(current) <= limit:
            return ShapeDecision(DecodeAlone(current), raw, raw * corr.split_ratio(current), 0.0, True,
                                 f"nothing pending: hold {current} (held {held_steps} < {params.hysteresis_steps} "
                                 "steps) before decode takes the whole GPU")
    raw = costs.decode_alone_ms(whole, batch, context) if batch else 0.0
    # decode alone on the whole GPU is the decode kind's; where the plan has no overallocated configuration the whole
    # GPU is its largest split, whose steps the correction learns as the split kind's (correction.kind_of)
    ratio = corr.decode if whole == OVERALLOCATED else corr.split_ratio(whole)
    return ShapeDecision(DecodeAlone(whole), raw, raw * ratio, 0.0, raw * ratio <= limit,
                         "nothing pending: decode alone on the whole GPU")


def _no_decode(state: ShapeState, costs: StepCosts, corr: Correction, params: AdaptiveParams,
               limit: float) -> ShapeDecision:
    budget = min(state.max_chunk_tokens, state.pending_tokens)
    if state.prefill_worker_tokens == 0:
        raw = costs.fused_ms((), chunks(state.waiting, state.max_chunk_tokens))
        step = raw * corr.fused_ratio(budget)
        return ShapeDecision(Fused(state.max_chunk_tokens), raw, step, 1e3 * budget / step, True,
                             "no decode running: the prompts alone on the whole GPU in the decode worker")
    rates = {c.name: costs.split(c.name, 1, 1, budget)[1] for c in costs.configurations}
    name = max(rates, key=lambda n: (rates[n], n))
    return ShapeDecision(Split(name, budget, 1), None, None, rates[name], True,
                         f"no decode running and the prefill worker holds prompts: the rest to it on {name}, the "
                         f"most prefill throughput ({rates[name]:.0f} tok/s)")


def _prefill_busy(state: ShapeState, costs: StepCosts, corr: Correction, params: AdaptiveParams, limit: float,
                  current: str, held_steps: int) -> ShapeDecision:
    budget = min(state.max_chunk_tokens, state.pending_tokens)
    opts = split_options(state, costs, corr, params, budget)
    best, cur = _best(opts, limit), opts.get(current)
    if cur is not None and cur.step_ms <= limit:
        if (best is not None and best is not cur and held_steps >= params.hysteresis_steps
                and best.tokens_per_s > params.switch_gain * cur.tokens_per_s):
            return _decision(best, limit, f"prefill worker busy: leave {current} (held {held_steps} steps) for "
                                          f"{_describe(best)}")
        return _decision(cur, limit, f"prefill worker busy: keep {_describe(cur)}")
    pick = best or _fastest(opts)
    if pick is None:
        return ShapeDecision(DecodeAlone(current), None, None, 0.0, False,
                             "prefill worker busy and no split configured: decode waits for it before fusing")
    why = "breaks the SLO" if cur is not None else "is no split (decode would starve beside the prefill)"
    tail = "" if pick.step_ms <= limit else f"; SLO cannot be met: the fastest decode step {pick.step_ms:.1f} ms"
    return _decision(pick, limit, f"prefill worker busy and {current} {why}: {_describe(pick)}{tail}")


def _fused_or_split(state: ShapeState, costs: StepCosts, corr: Correction, params: AdaptiveParams, limit: float,
                    current: str, held_steps: int) -> ShapeDecision:
    rows = len(state.decode_contexts)
    if state.slo_itl_ms is None:
        raw = costs.fused_ms(state.decode_contexts, chunks(state.waiting, state.max_chunk_tokens))
        budget = min(state.max_chunk_tokens, state.pending_tokens)
        step = raw * corr.fused_ratio(rows + budget)
        return ShapeDecision(Fused(state.max_chunk_tokens), raw, step, 1e3 * budget / step,
                             True, "no ITL SLO: fused with the whole token budget")
    budget = min(state.max_chunk_tokens, state.pending_tokens)
    c, raw = fused_chunk(state, costs, corr, limit, params.chunk_granularity)
    trimmed = on_bucket(c, rows, state.pending_tokens, params.graph_buckets)
    if trimmed != c:  # ended on the bucket below, unless its size class prices that step over the limit
        raw_t = costs.fused_ms(state.decode_contexts, chunks(state.waiting, trimmed))
        if raw_t * corr.fused_ratio(rows + trimmed) <= limit:
            c, raw = trimmed, raw_t
    step = raw * corr.fused_ratio(rows + c)
    fused = _Option(Fused(c), raw, step, 1e3 * c / step if c else 0.0)
    if c == state.pending_tokens:  # one fused step finishes every pending prompt within the SLO: no hand-off
        return _decision(fused, limit, f"{_describe(fused)} finishes every pending prompt within {limit:g} ms")
    useful = c > 0 and c >= min(params.min_chunk_tokens, budget)
    opts = split_options(state, costs, corr, params, budget)
    split = _best(opts, limit)
    if split is not None and current in opts and opts[current].step_ms <= limit and split is not opts[current]:
        held = opts[current]  # the split decode is on stays unless another beats it clearly after the hysteresis
        if held_steps < params.hysteresis_steps or split.tokens_per_s <= params.switch_gain * held.tokens_per_s:
            split = held
    if split is None:
        if c > 0:
            why = "" if useful else " (a small chunk, but no split meets the SLO)"
            return _decision(fused, limit, f"{_describe(fused)} within {limit:g} ms{why}")
        smallest = min(params.min_chunk_tokens, budget)
        raw = costs.fused_ms(state.decode_contexts, chunks(state.waiting, smallest))
        step = raw * corr.fused_ratio(rows + smallest)
        small = _Option(Fused(smallest), raw, step, 1e3 * smallest / step)
        pick = min([small, *opts.values()], key=lambda o: (o.step_ms, decode_config(o.shape)))
        return _decision(pick, limit,
                         f"SLO cannot be met ({limit:g} ms): {_describe(pick)} has the fastest decode step")
    if not useful:
        return _decision(split, limit, f"{_describe(split)}: the fused chunk the SLO allows ({c} tokens) is too small")
    on_split = current != whole_config(costs)
    if on_split:
        pick = fused if fused.tokens_per_s > params.switch_gain * split.tokens_per_s else split
    else:
        pick = split if split.tokens_per_s > params.switch_gain * fused.tokens_per_s else fused
    other = split if pick is fused else fused
    return _decision(pick, limit, f"{_describe(pick)} over {_describe(other)} (now on {current}, leaving it needs "
                                  f"x{params.switch_gain:g})")


NO_CORRECTION = Correction()
DEFAULT_PARAMS = AdaptiveParams()


def decide_adaptive(state: ShapeState, costs: StepCosts, correction: Correction = NO_CORRECTION,
                    held: ManagerState | None = None,
                    params: AdaptiveParams = DEFAULT_PARAMS) -> tuple[ShapeDecision, ManagerState]:
    """The next step's shape (module docstring) and the new hysteresis memory: decode's configuration and how many
    steps it has held it. Pure: same inputs, same outputs."""
    current = decode_config(state.current)
    held_steps = held.steps_since_switch if held is not None and held.config == current else 0
    limit = math.inf if state.slo_itl_ms is None else params.margin * state.slo_itl_ms
    if state.pending_tokens == 0:
        d = _nothing_pending(state, costs, correction, params, limit, current, held_steps)
    elif not state.decode_contexts:
        d = _no_decode(state, costs, correction, params, limit)
    elif state.prefill_worker_tokens > 0:
        d = _prefill_busy(state, costs, correction, params, limit, current, held_steps)
    else:
        d = _fused_or_split(state, costs, correction, params, limit, current, held_steps)
    new = decode_config(d.shape)
    return d, ManagerState(new, held_steps + 1 if new == current else 0)


class DuetPolicy:
    """`--policy duet` as a `StepPolicy`: `decide_adaptive` with its memory (hysteresis, the online correction and,
    with `margin` given, the SLO margin adapted to the gaps its steps made: partition/margin.py; None: the fixed
    `params.margin`) kept between steps. `last`: the latest decision, whose `model_ms` the worker copies into that
    step's `StepTiming.predicted_ms`."""

    name = "duet"
    workers = POLICY_SPECS["duet"].workers
    reads_queue_head = True  # it reads no more of the queue than its head (shape.py ShapeState; table-tested)

    def __init__(self, costs: StepCosts, params: AdaptiveParams = DEFAULT_PARAMS,
                 correction: CorrectionParams = DEFAULT_CORRECTION, margin: MarginParams | None = None) -> None:
        self.costs, self.params, self.correction_params = costs, params, correction
        self.correction = Correction()
        self.margin_params = margin
        self.margin = Margin(margin.start) if margin is not None else Margin(params.margin)
        self.slo_itl_ms: float | None = None  # the SLO of the latest decision, which `observe` judges gaps by
        self.held: ManagerState | None = None
        self.last: ShapeDecision | None = None

    def decide(self, state: ShapeState) -> StepShape:
        self.slo_itl_ms = state.slo_itl_ms
        params = self.params
        if self.margin_params is not None and self.margin.margin != params.margin:
            params = replace(params, margin=self.margin.margin)
        self.last, self.held = decide_adaptive(state, self.costs, self.correction, self.held, params)
        return self.last.shape

    def observe(self, timing: StepTiming) -> None:
        self.correction = corrected(self.correction, timing, self.correction_params)
        if self.margin_params is not None:
            self.margin = adapted(self.margin, timing, self.slo_itl_ms, self.margin_params)
