"""One sampling step, written once for every engine loop: `EngineCore` (behind `LLM`), the decode worker
(decode rows and fused steps, hybrid mode included) and the prefill worker.

The sequence, for the logits rows of one step:
1. structured-output mask (rapidserve/structured): when a row has a constraint, the book fills the
   bitmask of those rows from the output tokens each request knows (`grammar_rows`, called only then: a
   worker scheduling ahead may first have to wait for the step in flight to know a row's newest token).
   A row whose grammar rejects a token fails alone (`RequestsFailed`, engine/faults.py), before sampling;
2. sampling on the device (`sample_or_blame`: a batched call that raises is retried row by row and only
   the rows that still raise fail). Nothing is added to the penalty slots here: the caller calls
   `runner.record_sampled()` once its step is wholly queued (a step that fails later must not count its
   tokens);
3. the stop check: `stop_rules.check_stop_at`, the one stop check, on the host once the token is there
   (each caller's, since when that is differs: at once, or when a step launched ahead has landed);
4. `retain`: the penalty slots and matchers of requests no longer running are released (and, given the
   requests the engine still knows, the compile states of the others).

`RequestsFailed.reqs` names the caller's requests of the failed rows (`reqs[i]` for row i).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, TypeVar

from rapidserve.engine.faults import RequestsFailed, fill_or_blame, sample_or_blame
from rapidserve.logit_controls import TokenHistory
from rapidserve.runner import ModelRunner
from rapidserve.sampler import SamplerOutput
from rapidserve.sampling_params import SamplingParams
from rapidserve.structured import GrammarBook, GrammarRow

R = TypeVar("R")


def sample_step(runner: ModelRunner, book: GrammarBook | None, logits: Any, reqs: Sequence[R],
                params: Sequence[SamplingParams], index: Sequence[int], eos: tuple[int, ...],
                history: Callable[[int], TokenHistory], grammar_rows: Callable[[], list[GrammarRow]]) -> SamplerOutput:
    """Mask (when a row has a constraint) and sample row i as output token `index[i]` of `reqs[i]`;
    `RequestsFailed` (its `reqs` filled in) when rows fail alone: their grammar rejected a token, or
    their sampling raised. Call `runner.record_sampled()` once the step is wholly queued."""
    mask = None
    if GrammarBook.needed(params):
        assert book is not None, "a structured-output row needs the engine's GrammarBook"
        mask = fill_or_blame(book, grammar_rows(), reqs, pin=runner.device.type == "cuda")
    try:
        return sample_or_blame(runner, logits, params, index, eos, mask, history=history)
    except RequestsFailed as e:
        e.reqs = [reqs[i] for i in e.rows]
        raise


def retain(runner: ModelRunner, book: GrammarBook | None, running: Iterable[tuple[str, Hashable]],
           known: Iterable[str] | None = None) -> None:
    """Free what requests no longer running hold: penalty slots (logit_controls.py; `running` gives each
    running request's id and slot key) and matchers; with `known` (the requests the engine still has),
    the compile states of every other request. Holding none of them (most steps), `running` is not read: a
    generator over the running batch costs nothing then."""
    holder = book if book is not None and len(book) else None  # a book holding matchers or compile states
    if holder is None and not runner.tokens.in_use:
        return
    keep = list(running)
    if runner.tokens.in_use:
        runner.tokens.retain(key for _, key in keep)
    if holder is not None:
        holder.retain((rid for rid, _ in keep), known=known)
