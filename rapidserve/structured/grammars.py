"""A `StructuredOutputs` constraint as llguidance grammar text, checked up front, and the LRU of
compiled grammars.

Why llguidance (not xgrammar): measured on this corpus and a 152k vocabulary its p99 bitmask fill is
8x shorter (2.4 vs 19 ms) and its worst cold compile 30x cheaper (9 vs 303 ms); see
bench/results/grammar_engines.md. Both are CPU-only; masks are applied by `bitmask.py` in torch.

How each constraint becomes a grammar:
- json: the JSON schema text (llguidance's JSON-schema front end, compact separators);
- json_object: the schema `{"type": "object"}`;
- regex: the regular expression, matched against the whole output;
- choice: a Lark grammar whose start rule is the alternation of the (JSON-quoted) literals;
- grammar: Lark text as is; GBNF (`::=` rules, llama.cpp style) converted to Lark first.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from rapidserve.sampling_params import StructuredOutputs

# Field names of vLLM's request body per constraint kind, for error messages.
FIELD_OF_KIND = {"json": "json", "json_object": "json_object", "regex": "regex", "choice": "choice",
                 "grammar": "grammar"}
INSTALL_HINT = "structured outputs need the llguidance package: pip install 'llguidance>=1.0'"


class GrammarError(ValueError):
    """A constraint that cannot be compiled (an invalid schema, regex or grammar), or no grammar engine.
    `kind` names the constraint (`StructuredOutputs.kind`); the message says what is wrong."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as e:
        raise GrammarError("engine", f"{INSTALL_HINT} ({e})") from None
    return llguidance


def grammar_text(so: StructuredOutputs) -> str:
    """The llguidance grammar (its JSON grammar format) for the constraint; GrammarError when the
    schema is not JSON or the grammar engine is missing. Not yet validated: see `check`."""
    llg = _llguidance()
    kind = so.kind
    try:
        if kind == "json":
            assert so.json is not None
            json.loads(so.json)  # a readable message for text that is not JSON at all
            return llg.LLMatcher.grammar_from_json_schema(so.json, defaults={"whitespace_flexible": False})
        if kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema('{"type": "object"}',
                                                          defaults={"whitespace_flexible": False})
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(so.regex)
        if kind == "choice":
            assert so.choice is not None
            alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in so.choice)
            return llg.LLMatcher.grammar_from_lark(f"start: {alts}\n")
        assert so.grammar is not None
        if "::=" in so.grammar:
            from llguidance.gbnf_to_lark import gbnf_to_lark

            return llg.LLMatcher.grammar_from_lark(gbnf_to_lark(so.grammar))
        return llg.LLMatcher.grammar_from_lark(so.grammar)
    except GrammarError:
        raise
    except json.JSONDecodeError as e:
        raise GrammarError(kind, f"the JSON schema is not valid JSON: {e}") from None
    except BaseException as e:  # noqa: BLE001 - the engine's message; a Rust panic is a BaseException
        raise engine_error(kind, e) from None


def engine_error(kind: str, e: BaseException) -> GrammarError:
    """The grammar engine raised (or panicked: pyo3's PanicException is a BaseException) on `kind`:
    a GrammarError for that request; interpreter exits propagate."""
    if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
        raise e
    return GrammarError(kind, f"invalid {kind}: {str(e)[:500]}")


def check(so: StructuredOutputs, tokenizer: Any = None) -> str:
    """Compile and validate the constraint (against `tokenizer`, an llguidance LLTokenizer, when
    given); the grammar text, or GrammarError saying what is wrong. The server calls this at
    admission (no tokenizer: cheap, on the event loop), then `trial.build` with the model's tokenizer
    (off the loop), so a grammar the engine cannot serve never reaches a worker."""
    llg = _llguidance()
    text = grammar_text(so)
    try:
        is_error, msgs = llg.LLMatcher.validate_grammar_with_warnings(text, tokenizer)
    except BaseException as e:  # noqa: BLE001 - see engine_error
        raise engine_error(so.kind, e) from None
    if is_error:
        raise GrammarError(so.kind, f"invalid {so.kind}: {'; '.join(msgs)[:500]}")
    return text


class _Failed:
    """A constraint the grammar engine refused (its GrammarError), kept in the cache in its place."""

    __slots__ = ("error",)

    def __init__(self, error: GrammarError) -> None:
        self.error = error


class GrammarCache:
    """Compiled grammars keyed by the constraint (a frozen, hashable `StructuredOutputs`), bounded LRU.

    `compile(so)` builds the value once per constraint (`make`: the worker's compiler, e.g. a template
    matcher that each request copies); later requests of the same constraint reuse it.

    Failures are remembered as failures, never as a grammar: a `GrammarError` from `make` (the grammar
    engine's verdict on the constraint) is cached in the constraint's place and raised again by `get` and
    `compile`, without compiling again; `fail(so, error)` turns a cached grammar into such a failure (the
    engine broke on it while generating: lexers.py's shared lexer is then unusable for every copy). Other
    exceptions (no thread, out of memory, a test's injected fault) are not cached: the next request of that
    constraint compiles again. `on_evict(value)` is called for each compiled value that leaves the cache
    (evicted, failed, or replaced by a second compile of the same constraint), outside the cache's lock."""

    def __init__(self, make: Callable[[StructuredOutputs], Any], capacity: int = 256,
                 on_evict: Callable[[Any], None] | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity} must be >= 1")
        self._make, self.capacity, self._on_evict = make, capacity, on_evict
        self._items: OrderedDict[StructuredOutputs, Any] = OrderedDict()
        self.hits = self.misses = 0
        self._lock = threading.Lock()  # the server may check large bodies in executor threads

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, so: object) -> bool:
        """Whether the constraint's verdict is cached (a grammar or a failure)."""
        with self._lock:
            return so in self._items

    def get(self, so: StructuredOutputs) -> Any | None:
        """The compiled value if cached (a hit), else None; a remembered failure raises its GrammarError.
        Never builds (see `compiles.Compiles`)."""
        with self._lock:
            got = self._items.get(so)
            if got is not None:
                self._items.move_to_end(so)
                self.hits += 1
        if isinstance(got, _Failed):
            raise GrammarError(got.error.kind, str(got.error))  # a new one: raised by several threads at once
        return got

    def compile(self, so: StructuredOutputs) -> Any:
        got = self.get(so)
        if got is not None:
            return got
        with self._lock:
            self.misses += 1
        try:
            value = self._make(so)  # outside the lock: two threads may both compile a new constraint once
        except GrammarError as e:
            self._put(so, _Failed(e))
            raise
        self._put(so, value)
        return value

    def fail(self, so: StructuredOutputs, error: GrammarError) -> None:
        """Remember `so` as failed with `error` from now on (its compiled value, if any, is evicted)."""
        self._put(so, _Failed(error))

    def _put(self, so: StructuredOutputs, value: Any) -> None:
        gone: list[Any] = []
        with self._lock:
            old = self._items.get(so)
            if old is not None and old is not value:
                gone.append(old)
            self._items[so] = value
            self._items.move_to_end(so)
            while len(self._items) > self.capacity:
                gone.append(self._items.popitem(last=False)[1])
        if self._on_evict is not None:
            for v in gone:
                if not isinstance(v, _Failed):
                    self._on_evict(v)
