"""How a worker survives a request that raises: which errors are fatal, and who is to blame.

Rule: a request must never take a worker down. An exception while a worker handles one request
fails that request (its stream ends with the error) and the worker goes on serving the rest. Only
errors that leave the process unusable (`is_fatal`: a CUDA/HIP error or device-side assert breaks
the context) end the worker; the router then restarts it.

Blame: a request's own parameters first reach device code when its next token is sampled, so a
batched sampling call that raises is retried row by row (`sample_or_blame`) and only the rows that
raise alone fail (`RequestsFailed`). The prefill worker also re-runs a failed batch one request at
a time; a decode step that fails for no single row fails its whole batch.

Structured outputs: a request whose constraint the grammar engine cannot serve (its compile failed in
this worker, its matcher erred or rejected a token) fails alone, with its own message (`fill_or_blame`:
each row's, never another request's, which may quote that request's grammar) and the fault
STRUCTURED_FAULT (`Finished.fault`), which the server answers as the request's error (400 naming its
field), not the engine's (503). Never is such a row sampled unconstrained and kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rapidserve.engine.messages import STRUCTURED_FAULT
from rapidserve.sampling_params import SamplingParams
from rapidserve.structured.grammars import GrammarError


class RequestsFailed(Exception):
    """These rows of a batch (indices) failed by themselves with `error` (or each with its own, `errors`:
    row -> exception); the rest did not run."""

    def __init__(self, rows: list[int], error: BaseException, errors: dict[int, BaseException] | None = None) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.rows, self.error, self.errors = rows, error, errors or {}
        self.reqs: list[Any] = []  # the requests of those rows, filled in by the worker

    def blame(self, where: str) -> list[tuple[Any, str, str]]:
        """(request, message, fault) of each failed row, its own error's (`describe`, `fault_of`)."""
        out = []
        for row, req in zip(self.rows, self.reqs, strict=True):
            e = self.errors.get(row, self.error)
            out.append((req, describe(e, where), fault_of(e)))
        return out


def fill_or_blame(book: Any, rows: Sequence[Any], batch: Sequence[Any], pin: bool) -> Any:
    """The structured-output mask of `rows` (`GrammarBook.fill`); RequestsFailed naming the requests of
    `batch` whose grammar failed, each with its own GrammarError (they fail alone: the rest of the step
    goes on)."""
    mask, failed = book.fill(rows, pin=pin)
    if failed:
        errors: dict[int, BaseException] = {}
        for r in rows:
            if r.row in failed:
                so = r.params.structured_outputs
                errors[r.row] = GrammarError(so.kind if so is not None else "grammar", failed[r.row])
        order = sorted(failed)
        e = RequestsFailed(order, errors[order[0]], errors)
        e.reqs = [batch[i] for i in e.rows]
        raise e
    return mask


def fault_of(e: BaseException) -> str:
    """Whose fault a request's failure with `e` is: STRUCTURED_FAULT for its constraint, "" otherwise."""
    return STRUCTURED_FAULT if isinstance(e, GrammarError) else ""


def is_fatal(e: BaseException) -> bool:
    """Whether a worker must die of `e` rather than fail the request(s) it was working on: errors
    from the device runtime (the context is unusable afterwards) and interpreter-level exits.
    Anything else, an out-of-memory error included, fails the request(s) and the worker goes on."""
    if not isinstance(e, Exception) or getattr(e, "fatal", False):  # e.g. runner.RanksDiverged
        return True
    text = f"{type(e).__name__}: {e}"
    return type(e).__name__ == "AcceleratorError" or any(
        k in text for k in ("CUDA error", "HIP error", "device-side assert", "illegal memory access"))


def describe(e: BaseException, where: str) -> str:
    """The message a failed request's client gets (bounded: it travels in a ring message). A constraint's
    failure is its own message (it names the constraint), not the worker's."""
    if isinstance(e, GrammarError):
        return str(e)[:2000]
    return f"{where} failed: {type(e).__name__}: {e}"[:2000]


def sample_or_blame(runner: Any, logits: Any, params: Sequence[SamplingParams], index: Sequence[int],
                    eos: tuple[int, ...], grammar: Any = None, history: Callable[[int], Any] | None = None) -> Any:
    """`runner.sample_next` over the batch (`grammar`: the step's structured-output mask, or None);
    if it raises (not fatally), sample each row alone and raise `RequestsFailed` with the rows that
    still raise (all rows if none does alone). Nothing is added to the penalty slots (`record=False`):
    the caller calls `runner.record_sampled()` once its step is wholly queued, and never after a retry
    (its step is not taken)."""
    try:
        return runner.sample_next(logits, params, index, eos, grammar, history=history, record=False)
    except Exception as e:  # noqa: BLE001 - blamed below
        if is_fatal(e):
            raise
        first = e
    blamed: dict[int, BaseException] = {}
    for i in range(len(params)):
        row_history = None if history is None else (lambda _j, i=i: history(i))
        try:
            runner.sample_next(logits[i : i + 1], [params[i]], [index[i]], eos,
                               None if grammar is None else grammar.for_row(i), history=row_history, record=False,
                               share=False)  # never carried: this step is not taken
        except Exception as e:  # noqa: BLE001 - this row fails alone
            if is_fatal(e):
                raise
            blamed[i] = e
    raise RequestsFailed(sorted(blamed) or list(range(len(params))), first, blamed)
