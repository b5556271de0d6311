"""Whether the grammar engine can serve a constraint with the model's tokenizer: compile it, then try it.

Why a trial: llguidance builds a matcher lazily. A constraint within its syntax and grammar-size checks
(`grammars.check`) can still be beyond its lexer's limits, which only show once a mask is computed: for
`(b{1000}){1000}`, `b{300000}` or a JSON schema with such a `pattern`, the matcher is made in
milliseconds, the first mask runs the lexer out of fuel (`step_lexer_fuel`), and consuming any token then
fails with "lexer error: too many expressions constructed" (measured on SmolLM2's tokenizer). That error
is sticky in the lexer, which every copy of the compiled grammar shares (lexers.py). So `build` computes
the first TRIAL_STEPS masks on a copy, consuming the lowest allowed token that is not special each time,
and refuses the constraint if the engine errs: at admission in the server (a 400 naming the field), in
`LLM.generate` (a ValueError), and in every worker's compile (off the loop), where the request then fails
alone. A limit reached later in a generation (a huge pattern deep in a schema) is caught where it happens:
the request's row fails (matchers.py), never its output unconstrained.

Cost: one compile plus TRIAL_STEPS masks, all in native code that releases the GIL. For an ordinary
constraint on SmolLM2 the first mask is 0.1-0.2 s on a loaded 2-core host (the worker used to pay it at the
request's first step, on its loop; now the compile thread does, and warms the shared lexer for the requests);
for the constraints above it is 2-7 s, all of it off any event loop.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

from rapidserve.sampling_params import StructuredOutputs
from rapidserve.structured.grammars import GrammarCache, GrammarError, _llguidance, check, engine_error

TRIAL_STEPS = 2  # masks computed (and tokens consumed) when a constraint is built
MESSAGE_CHARS = 300  # the engine's reason, cut to this (it can quote the grammar)
# llguidance's error once a mask allows nothing (the grammar's language is empty from here): not a failure
# of the engine but a dead end of the constraint, which matchers.py ends as "stop" (its docstring)
DEAD_END = "NoExtensionBias"


def ll_tokenizer(hf: Any, vocab_size: int, eos: Sequence[int]) -> Any:
    """llguidance's view of the HF tokenizer `hf` (`eos`: the ids that end a generation; none: the
    tokenizer's own). Seconds for a large vocabulary, mostly Python holding the GIL: load it once, off any
    event loop, ahead of traffic where possible (`GrammarBook.warm`, `GrammarTrials.warm`). GrammarError
    ("engine") for a model without one (None), a grammar engine too old for several EOS ids, or a
    tokenizer llguidance cannot read."""
    llg = _llguidance()
    import llguidance.hf

    if hf is None:
        raise GrammarError("engine", "structured outputs need the model's tokenizer, and this model has "
                           "none (a preset?): serve a model folder or GGUF file with its tokenizer")
    try:
        return llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=list(eos) or None)
    except TypeError as e:  # llguidance < 1.7 takes a single EOS id
        version = getattr(llg, "__version__", "?")
        raise GrammarError("engine", f"llguidance {version} is too old for structured outputs ({e}): "
                           "they need llguidance>=1.7 (pip install -U 'llguidance>=1.7')") from e
    except Exception as e:  # noqa: BLE001 - said as the engine's trouble, never a crash of the caller
        raise GrammarError("engine", f"the grammar engine cannot read this model's tokenizer: "
                           f"{type(e).__name__}: {str(e)[:MESSAGE_CHARS]}") from e


def reason(m: Any) -> str:
    """Why matcher `m` is in error: the engine's first line, bounded."""
    return (m.get_error() or "unknown error").splitlines()[0][:MESSAGE_CHARS]


def dead_end(m: Any) -> bool:
    """Whether matcher `m` (in error) only found that its grammar allows nothing more (DEAD_END)."""
    return reason(m) == DEAD_END


def cannot_serve(so: StructuredOutputs, why: str) -> GrammarError:
    """The error of a constraint the grammar engine cannot serve (`why`: its reason)."""
    return GrammarError(so.kind, f"the grammar engine cannot serve this {so.kind} constraint: {why}")


def build(so: StructuredOutputs, tokenizer: Any, text: str | None = None) -> Any:
    """A template matcher of `so` (`text`: its grammar, checked already) compiled against `tokenizer` (an
    llguidance LLTokenizer) and tried (`try_first_steps`); GrammarError when the engine cannot serve it."""
    llg = _llguidance()
    if text is None:
        text = check(so, tokenizer)
    try:
        m = llg.LLMatcher(tokenizer, text, log_level=0, limits=llg.LLParserLimits(verbose_errors=False))
        if m.is_error():
            raise GrammarError(so.kind, f"invalid {so.kind}: {reason(m)}")
        try_first_steps(so, m.deep_copy(), tokenizer)
    except GrammarError:
        raise
    except BaseException as e:  # noqa: BLE001 - see grammars.engine_error
        raise engine_error(so.kind, e) from None
    return m


def try_first_steps(so: StructuredOutputs, m: Any, tokenizer: Any, steps: int = TRIAL_STEPS) -> None:
    """Compute `m`'s first `steps` masks, consuming the lowest allowed token that is not special after
    each (a copy of the template: the state it leaves is only the shared lexer's cache); GrammarError if
    the engine errs, or if the grammar allows no output at all. Stops early once the grammar is complete,
    allows only special tokens, or meets a dead end on this path (a later one is the request's own)."""
    import numpy as np

    for step in range(steps):
        mask = np.frombuffer(m.compute_bitmask(), dtype=np.uint32)
        if m.is_error() and dead_end(m):
            if step == 0:
                raise GrammarError(so.kind, f"invalid {so.kind}: it allows no output (no token can start it)")
            return
        if m.is_error():
            raise cannot_serve(so, reason(m))
        if m.is_stopped():
            return
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
        t = next((int(t) for t in allowed if not tokenizer.is_special_token(int(t))), None)
        if t is None:
            return
        if not m.consume_token(t) or m.is_error():
            raise cannot_serve(so, reason(m))


class GrammarTrials:
    """The server's verdicts: can the grammar engine serve a constraint with the model's tokenizer? One
    `build` per constraint, its verdict (success or failure) kept in a bounded LRU; the template matcher
    is not kept (the server never masks). llguidance's view of the tokenizer is loaded once (`warm`, or
    the first constraint), under a lock: other threads wait for it rather than load it again; so do the
    requests of a constraint under trial (many clients sending one schema at once cost one trial)."""

    def __init__(self, hf_tokenizer: Callable[[], Any], vocab_size: int, eos: Sequence[int],
                 capacity: int = 256) -> None:
        self._hf_tokenizer, self.vocab_size, self.eos = hf_tokenizer, vocab_size, tuple(eos)
        self._tok: Any = None
        self._tok_lock = threading.Lock()
        self.verdicts = GrammarCache(self._try, capacity)
        self._lock = threading.Lock()
        self._running: dict[StructuredOutputs, threading.Event] = {}  # the trials under way

    def warm(self) -> None:
        """Load the tokenizer view now (blocking: `serve` runs it on a thread while the engine starts, when
        the server's loop serves nothing yet), so the first constraint neither waits for it nor stalls the
        loop on its GIL time. Nothing without the grammar engine; a failure is reported by the first
        constraint, as without warming."""
        with contextlib.suppress(GrammarError):
            _llguidance()
            self._tokenizer()

    def _tokenizer(self) -> Any:
        with self._tok_lock:
            if self._tok is None:
                self._tok = ll_tokenizer(self._hf_tokenizer(), self.vocab_size, self.eos)
            return self._tok

    def known(self, so: StructuredOutputs) -> bool:
        """Whether `so`'s verdict is cached (`check` then answers at once)."""
        return so in self.verdicts

    def check(self, so: StructuredOutputs) -> None:
        """GrammarError if the grammar engine cannot serve `so` (slow the first time: run it off the loop)."""
        with self._lock:
            done = self._running.get(so)
            mine = done is None and so not in self.verdicts
            if mine:
                done = self._running[so] = threading.Event()
        if not mine:
            if done is not None:
                done.wait()  # another thread's trial of it: its verdict lands in the cache
            self.verdicts.compile(so)  # the verdict (or, after an error not cached, a trial of its own)
            return
        try:
            self.verdicts.compile(so)
        finally:
            with self._lock:
                del self._running[so]
            done.set()

    def _try(self, so: StructuredOutputs) -> bool:
        build(so, self._tokenizer())
        return True
