"""A worker's grammar matchers: one per request, kept in step with the request's known tokens.

`GrammarBook.fill(rows)` is called once per step that samples a grammar row, after the step's
forward was queued on the device and before sampling: for each row it brings the request's matcher
up to the tokens known so far (creating it from the compiled grammar, or replaying the tokens when
it is behind or out of step), then fills the row's bitmask on the CPU (llguidance's thread pool for
several rows). Replaying is how a matcher crosses processes: the RAPID prefill worker masks the
first token; the decode worker builds its own matcher from the tokens it knows (the first token,
or every output after a preemption) and advances it per step.

Termination: once the grammar is complete the mask allows only EOS (the engine's EOS ids), so the
request ends with finish_reason "stop"; `check_stop_at` ends a grammar request on EOS even below
`min_tokens`, which only bans EOS while the grammar can still go on. A matcher that has consumed
EOS (`ignore_eos`) leaves the row unconstrained, as vLLM does. A token the matcher rejects (it was
sampled without the mask) fails that request only: `fill` returns it in `failed`.

A constraint that allows no token at some point (an unsatisfiable schema, which llguidance may only
find out while generating) allows EOS there: the request ends ("stop") with the text so far, rather
than sampling from an all -inf row.

Matchers are released with `release` / `retain` (preemption, abort, finish, failure); correctness
never depends on it, since a matcher out of step with its request is rebuilt by replay.

Compiling off the loop (`compiles.py`): a worker calls `prepare(key, constraint)` when it first
learns of a request, which compiles it on a background thread (a cached constraint is ready at once),
and leaves every key in `compiling()` out of the steps that need its mask. A prepared request's
matcher is made from its own compiled grammar: `fill` never compiles on the loop for it (a compile
that failed fails its row with the message compiling in place would have given). An unprepared
request (the unit tests) compiles in place, as before. `release` drops a request's compile state with
its matcher; `retain(keys, known)` drops matchers outside `keys` and compile state outside `known`.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rapidserve.sampling_params import SamplingParams, StructuredOutputs
from rapidserve.structured.bitmask import GrammarMask
from rapidserve.structured.compiles import CompilePool, Compiles
from rapidserve.structured.grammars import GrammarCache, GrammarError, _llguidance, check, engine_error


@dataclass(frozen=True)
class GrammarRow:
    """A logits row to mask: its request, and the request's output tokens known so far (every
    output before the token this row samples)."""

    row: int
    key: str
    params: SamplingParams
    tokens: Sequence[int]


@dataclass
class _Matcher:
    so: StructuredOutputs
    m: Any  # llguidance.LLMatcher
    tokens: list[int] = field(default_factory=list)  # consumed so far
    eos_seen: bool = False  # EOS consumed (kept going under ignore_eos): unconstrained from here on
    dead: bool = False  # the grammar allowed no token (an unsatisfiable schema): EOS ends the request


class GrammarBook:
    """The matchers of one worker. `hf_tokenizer` is called once, at the first constraint (loading
    llguidance's tokenizer view takes a second or two; free-text serving never pays it)."""

    def __init__(self, hf_tokenizer: Callable[[], Any], vocab_size: int, eos: tuple[int, ...],
                 cache_size: int = 256, threads: int | None = None, compile_threads: int = 2) -> None:
        self._hf_tokenizer, self.vocab_size, self.eos = hf_tokenizer, vocab_size, eos
        self.cache = GrammarCache(self._compile, cache_size)
        self.compiles = Compiles(self.cache, CompilePool(compile_threads))
        # llguidance's fill pool: 3/4 of the cores, at most 12 (the rest: the loop, torch, the other processes)
        self._threads = threads or max(1, min(12, (os.cpu_count() or 2) * 3 // 4))
        self._tok: Any = None
        self._tok_lock = threading.Lock()
        self._executor: Any = None
        self._matchers: dict[str, _Matcher] = {}

    @classmethod
    def for_model(cls, model: str | None, vocab_size: int, eos: tuple[int, ...],
                  tokenizer: str | None = None) -> GrammarBook:
        """A worker's book for the model spec of the config tree, or the `tokenizer` folder that replaces
        the model's (`--tokenizer`). The tokenizer is loaded at the first constraint; presets have none
        without `--tokenizer`, so their structured-output requests fail, saying so."""

        def hf_tokenizer() -> Any:
            if tokenizer is not None:
                from transformers import AutoTokenizer

                return AutoTokenizer.from_pretrained(tokenizer)
            if model is not None and model.startswith("preset:"):
                return None
            from rapidserve.loader import load_hf_tokenizer, resolve_model

            return load_hf_tokenizer(resolve_model(model))

        return cls(hf_tokenizer, vocab_size, eos)

    def __len__(self) -> int:
        """Requests with a matcher or compile state here (0 once every request has been released)."""
        if not len(self.compiles):
            return len(self._matchers)
        return len(self._matchers.keys() | self.compiles.keys())

    @staticmethod
    def needed(params: Iterable[SamplingParams]) -> bool:
        return any(p.structured_outputs is not None for p in params)

    # ---- compiling off the loop (compiles.py) --------------------------------------------------
    def prepare(self, key: str, so: StructuredOutputs | None) -> bool:
        """Start compiling request `key`'s constraint in the background (nothing without one); whether
        it is ready now (no constraint, cached, or compiled already)."""
        return self.compiles.prepare(key, so)

    def compiling(self) -> frozenset[str]:
        """The prepared requests whose grammar is still compiling: a cheap, non-blocking query for the
        schedulers, which leave them out of any step that needs their mask."""
        return self.compiles.compiling()

    def idle_wait(self, default: float) -> float:
        """How long an idle loop may sleep: `default`, or a few ms while a compile is under way."""
        return self.compiles.idle_wait(default)

    # ---- matchers ---------------------------------------------------------------------------
    def warm(self) -> None:
        """Load the grammar engine's tokenizer view now, on a background thread, so the first
        structured-output request does not stall the worker's loop for it (seconds: the tokenizer and
        llguidance's view of its vocabulary). Nothing happens without the grammar engine installed;
        a model without a tokenizer fails later, at its first constraint, as without warming."""
        try:
            _llguidance()
        except GrammarError:
            return

        def load() -> None:
            with contextlib.suppress(Exception):  # the first constraint reports it, as it would unwarmed
                self._tokenizer()

        threading.Thread(target=load, name="grammar-warm", daemon=True).start()

    def _tokenizer(self) -> Any:
        with self._tok_lock:  # once, whichever of `warm`'s thread and the loop comes first
            return self._load_tokenizer()

    def _load_tokenizer(self) -> Any:
        if self._tok is None:
            llg = _llguidance()
            import llguidance.hf

            hf = self._hf_tokenizer()
            if hf is None:
                raise GrammarError("engine", "structured outputs need the model's tokenizer, and this model has "
                                   "none (a preset?): serve a model folder or GGUF file with its tokenizer")
            try:
                self._tok = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=list(self.eos))
            except TypeError as e:  # llguidance < 1.7 takes a single EOS id
                version = getattr(llg, "__version__", "?")
                raise GrammarError("engine", f"llguidance {version} is too old for structured outputs ({e}): "
                                   "they need llguidance>=1.7 (pip install -U 'llguidance>=1.7')") from e
            self._executor = llg.LLExecutor(self._threads)
        return self._tok

    def _compile(self, so: StructuredOutputs) -> Any:
        """A template matcher of the constraint; each request gets a copy (compiled once)."""
        llg = _llguidance()
        m = llg.LLMatcher(self._tokenizer(), check(so, self._tokenizer()))
        if m.is_error():
            raise GrammarError(so.kind, f"invalid {so.kind}: {m.get_error()[:500]}")
        return m

    def _synced(self, r: GrammarRow) -> _Matcher:
        """The request's matcher, having consumed exactly `r.tokens` (GrammarError if one is rejected)."""
        so = r.params.structured_outputs
        assert so is not None
        mt = self._matchers.get(r.key)
        n = len(mt.tokens) if mt is not None else 0
        if mt is None or mt.so != so or n > len(r.tokens) or (n and mt.tokens[-1] != r.tokens[n - 1]):
            mt = self._matchers[r.key] = _Matcher(so, self.compiles.template(r.key, so).deep_copy())
            n = 0
        for t in r.tokens[n:]:
            if mt.m.is_stopped() or mt.dead:  # complete (or dead): only EOS was allowed; after it, free text
                mt.eos_seen |= t in self.eos
                mt.tokens.append(t)
                continue
            mt.eos_seen |= t in self.eos
            if t in self.eos and not mt.m.is_accepting():
                # EOS reaches a grammar row only when its mask allowed it: complete (accepting) or dead
                # (nothing allowed, see `fill`). Replaying a dead one (another worker saw it die) ends here.
                mt.dead = True
                mt.tokens.append(t)
                continue
            if not mt.m.consume_token(t) or mt.m.is_error():
                del self._matchers[r.key]
                raise GrammarError(so.kind, f"token {t} does not continue the {so.kind} constraint: "
                                   f"{mt.m.get_error()[:300] or 'rejected'}")
            mt.tokens.append(t)
        return mt

    def release(self, key: str) -> None:
        """The request ended (or left this worker): its matcher and compile state go."""
        self._matchers.pop(key, None)
        self.compiles.forget(key)

    def retain(self, keys: Iterable[str], known: Iterable[str] | None = None) -> None:
        """Drop every matcher whose request is not in `keys` (ended, preempted, failed) and, with
        `known`, the compile state of every request not in `known` (ended: no longer in the worker)."""
        if self._matchers:
            keep = set(keys)
            for k in [k for k in self._matchers if k not in keep]:
                del self._matchers[k]
        if known is not None:
            self.compiles.retain(known)

    # ---- one step -----------------------------------------------------------------------------
    def fill(self, rows: Sequence[GrammarRow], pin: bool) -> tuple[GrammarMask, dict[int, str]]:
        """The step's mask for `rows` (rows whose matcher has ended are left out: unconstrained), and
        the rows that failed (logits row -> message). Never raises for one request's grammar."""
        failed: dict[int, str] = {}
        live: list[tuple[GrammarRow, _Matcher]] = []
        for r in rows:
            try:
                mt = self._synced(r)
            except BaseException as e:  # noqa: BLE001 - one request's grammar never takes the worker down
                self._matchers.pop(r.key, None)
                failed[r.row] = str(e if isinstance(e, GrammarError) else engine_error("grammar", e))
                continue
            if not mt.eos_seen:
                live.append((r, mt))
        mask = GrammarMask.new(len(live), self.vocab_size, pin, fill=False)  # every live row is written below
        if live:
            words = mask.words
            todo = [(mt.m, i) for i, (_, mt) in enumerate(live) if not mt.m.is_stopped() and not mt.dead]
            try:
                # The grammar engine writes the rows in place (what llguidance.torch's wrappers do; that
                # module is not imported: it builds a torch.compile kernel at import, seconds of stall).
                row_bytes = mask.num_words * 4
                if len(todo) == 1:
                    todo[0][0].unsafe_compute_mask_ptr(words[todo[0][1]].data_ptr(), row_bytes)
                elif todo:
                    self._executor.unsafe_compute_mask_ptr(todo, words.data_ptr(), row_bytes, len(live))
            except BaseException as e:  # noqa: BLE001 - those rows fail, the worker lives
                err = str(engine_error("grammar", e))
                for i in (i for _, i in todo):
                    failed[live[i][0].row] = err
                    self._matchers.pop(live[i][0].key, None)
                    words[i].fill_(-1)  # the row fails anyway; its words must not be left unset
            empty = ~words.numpy().any(axis=1)  # one pass over the step's words, not a call per row
            for i, (r, mt) in enumerate(live):
                if empty[i] and not mt.dead and not mt.m.is_stopped():
                    mt.dead = True  # nothing can follow (an unsatisfiable constraint): end it, as "stop"
                if mt.m.is_stopped() or mt.dead:  # the grammar is complete and cannot go on: EOS only
                    self._only_eos(words[i])
                elif len(r.tokens) < r.params.min_tokens:
                    self._ban_early_stop(words[i], r.params)
            mask.row_ids.copy_(torch.tensor([r.row for r, _ in live], dtype=torch.int32))
        return mask, failed

    def _only_eos(self, words: Any) -> None:
        w = words.numpy().view(np.uint32)
        w[:] = 0
        for t in self.eos:
            if t < self.vocab_size:
                w[t // 32] |= np.uint32(1 << (t % 32))

    def _ban_early_stop(self, words: Any, p: SamplingParams) -> None:
        """Below min_tokens: clear the stop tokens' bits, unless they are all the grammar allows (a
        complete grammar ends the request anyway)."""
        banned = [t for t in {*p.stop_token_ids, *(() if p.ignore_eos else self.eos)} if t < self.vocab_size]
        if not banned:
            return
        w = words.numpy().view(np.uint32)
        saved = w.copy()
        for t in banned:
            w[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
        if not w.any():
            w[:] = saved
