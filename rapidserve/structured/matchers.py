"""A worker's grammar matchers: one per request, kept in step with the request's known tokens.

`GrammarBook.fill(rows)` is called once per step that samples a grammar row, after the step's
forward was queued on the device and before sampling: for each row it brings the request's matcher
up to the tokens known so far (creating it from the compiled grammar, or replaying the tokens when
it is behind or out of step), then fills the row's bitmask on the CPU (llguidance's thread pool for
several rows). Replaying is how a matcher crosses processes: the RAPID prefill worker masks the
first token; the decode worker builds its own matcher from the tokens it knows (the first token,
or every output after a preemption) and advances it per step.

Host cost per step (bench/structured_host_overhead.py, bench/results/structured_host_overhead.md): in
the steady state each matcher consumes one token (a few attribute checks and one native call per row),
then ONE executor call fills every row's mask; rows are replayed token by token (`_synced`) only when
new, out of step, at EOS or past their grammar's end. Every request's matcher is a `deep_copy` of its
compiled grammar, and llguidance's copies share the grammar's lexer (its DFA cache, which spares each
request the lexer work another has done) behind one mutex, held through each fill and each consume:
the executor's threads fill the rows of ONE compile one after another, not in parallel. So a popular
constraint is compiled again in the background, up to one compile per fill thread, and its requests
are spread over those compiles (lexers.py).

Termination: once the grammar is complete the mask allows only EOS (the engine's EOS ids), so the
request ends with finish_reason "stop"; `check_stop_at` ends a grammar request on EOS even below
`min_tokens`, which only bans EOS while the grammar can still go on. A matcher that has consumed
EOS (`ignore_eos`) leaves the row unconstrained, as vLLM does. A token the matcher rejects (it was
sampled without the mask) fails that request only: `fill` returns it in `failed`.

Failures (trial.py): llguidance reports a matcher in error as stopped too; here an error is never taken
for a complete grammar. A matcher the engine fails on (a lexer out of fuel, a parser over its item limit,
a panic) fails its row with the engine's reason, whether it shows on a fresh copy, on consuming a token
or after computing the mask (whose words are then not used). A lexer error breaks the compile the matcher
was copied from (the lexer is shared), so the constraint is remembered as failed in the grammar cache
(`GrammarCache.fail`): requests of it fail at once from then on instead of copying a broken grammar.

A constraint that allows no token at some point (llguidance's dead end, `NoExtensionBias`: an
unsatisfiable branch, which it may only find out while generating) allows EOS there: the request ends
("stop") with the text so far, rather than sampling from an all -inf row. A constraint that allows no
output at all is refused when it is compiled.

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
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from rapidserve.sampling_params import SamplingParams, StructuredOutputs
from rapidserve.structured.bitmask import GrammarMask
from rapidserve.structured.compiles import CompilePool, Compiles
from rapidserve.structured.grammars import GrammarCache, GrammarError, _llguidance, check
from rapidserve.structured.lexers import LexerShards, ShardBudget
from rapidserve.structured.trial import MESSAGE_CHARS, build, cannot_serve, dead_end, ll_tokenizer, reason


class GrammarRow(NamedTuple):
    """A logits row to mask: its request, and the request's output tokens known so far (every
    output before the token this row samples). `last`: the newest of them when `tokens` ends with a
    stand-in for it (a token still in flight when the row was made: the hybrid worker's placeholder);
    the known tokens are then `tokens[:-1] + [last]`, without copying the request's list."""

    row: int
    key: str
    params: SamplingParams
    tokens: Sequence[int]
    last: int | None = None

    def known(self) -> Sequence[int]:
        """The known tokens, as one sequence."""
        return self.tokens if self.last is None else [*self.tokens[:-1], self.last]


@dataclass(slots=True)
class _Matcher:
    so: StructuredOutputs
    m: Any  # llguidance.LLMatcher
    count: int = 0  # tokens consumed so far (EOS and the tokens after it included)
    last: int = -1  # the last of them (checked against the request's tokens: still in step?)
    eos_seen: bool = False  # EOS consumed (kept going under ignore_eos): unconstrained from here on
    dead: bool = False  # the grammar allowed no token (an unsatisfiable schema): EOS ends the request


class GrammarBook:
    """The matchers of one worker. `hf_tokenizer` is called once, at the first constraint (loading
    llguidance's tokenizer view takes a second or two; free-text serving never pays it)."""

    def __init__(self, hf_tokenizer: Callable[[], Any], vocab_size: int, eos: tuple[int, ...],
                 cache_size: int = 256, threads: int | None = None, compile_threads: int = 2,
                 lexers: int | None = None) -> None:
        self._hf_tokenizer, self.vocab_size, self.eos = hf_tokenizer, vocab_size, eos
        self.cache = GrammarCache(self._compile, cache_size, on_evict=_release_shards)
        self.compiles = Compiles(self.cache, CompilePool(compile_threads))
        # llguidance's fill pool: 3/4 of the cores, at most 12 (the rest: the loop, torch, the other processes)
        self._threads = threads or max(1, min(12, (os.cpu_count() or 2) * 3 // 4))
        # independent compiles per popular constraint (lexers.py): one per fill thread, so the threads
        # do not queue on one shared lexer
        self._lexers = lexers or self._threads
        # over all constraints: 4 constraints' worth of extra compiles (each holds its own lexer cache)
        self._shard_budget = ShardBudget(4 * (self._lexers - 1))
        self._shard_pool = CompilePool(1, name="grammar-shard")  # apart from the requests' compiles
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
            self._tok = ll_tokenizer(self._hf_tokenizer(), self.vocab_size, self.eos)
            self._executor = _llguidance().LLExecutor(self._threads)
        return self._tok

    def _compile(self, so: StructuredOutputs) -> LexerShards:
        """The constraint's compile that requests copy. More compiles of it are made once it is popular
        (lexers.py), on their own single low-priority thread, so they never hold up the compile of a
        grammar a request is waiting for; they reuse the grammar text checked here."""
        text = check(so, self._tokenizer())
        return LexerShards(self._matcher(so, text), lambda: self._matcher(so, text), self._shard_pool,
                           limit=self._lexers, budget=self._shard_budget)

    def _matcher(self, so: StructuredOutputs, text: str) -> Any:
        """A template matcher of the checked grammar `text` (one compile, with its own lexer), tried on its
        first steps (trial.py): GrammarError if the grammar engine cannot serve it."""
        return build(so, self._tokenizer(), text)

    def _failed(self, so: StructuredOutputs, m: Any, t: int | None = None) -> str:
        """Why request matcher `m` of `so` is in error (`t`: the token it was given), for its row. A lexer
        error breaks the compile it was copied from (its lexer is shared and stays in error), so `so` is
        remembered as failed: later requests of it fail at once rather than copy a broken grammar."""
        why = reason(m)
        if why.lower().startswith("lexer error"):
            err = cannot_serve(so, why)
            self.cache.fail(so, err)
            return str(err)
        if t is not None:
            return f"token {t} does not continue the {so.kind} constraint: {why}"
        return str(cannot_serve(so, why))

    def _synced(self, r: GrammarRow) -> _Matcher:
        """The request's matcher, having consumed exactly its known tokens (GrammarError if one is
        rejected), one token at a time: a new request, one out of step (replayed), EOS, a complete grammar."""
        so = r.params.structured_outputs
        assert so is not None
        tokens = r.known()
        mt = self._matchers.get(r.key)
        n = mt.count if mt is not None else 0
        if mt is None or mt.so != so or n > len(tokens) or (n and mt.last != tokens[n - 1]):
            mt = self._matchers[r.key] = _Matcher(so, self.compiles.template(r.key, so).deep_copy())
            n = 0
        for t in tokens[n:]:
            mt.count, mt.last = mt.count + 1, t
            if mt.m.is_error() and not mt.dead:  # (llguidance says "stopped" too): never taken for complete
                del self._matchers[r.key]
                raise GrammarError(so.kind, self._failed(so, mt.m))
            if mt.m.is_stopped() or mt.dead:  # complete (or dead): only EOS was allowed; after it, free text
                mt.eos_seen |= t in self.eos
                continue
            mt.eos_seen |= t in self.eos
            if t in self.eos and not mt.m.is_accepting():
                # EOS reaches a grammar row only when its mask allowed it: complete (accepting) or dead
                # (nothing allowed, see `fill`). Replaying a dead one (another worker saw it die) ends here.
                mt.dead = True
                continue
            if not mt.m.consume_token(t) or mt.m.is_error():
                del self._matchers[r.key]
                raise GrammarError(so.kind, self._failed(so, mt.m, t))
        if mt.m.is_error() and not mt.dead:
            del self._matchers[r.key]
            raise GrammarError(so.kind, self._failed(so, mt.m))
        return mt

    def _advance(self, rows: Sequence[GrammarRow], failed: dict[int, str]) -> list[tuple[GrammarRow, _Matcher]]:
        """Every row's matcher brought up to the row's known tokens, as `_synced` would, the common case
        inline: a matcher exactly one token behind, in step, not ended, whose new token is not EOS, just
        consumes it (a few attribute checks, one native call); the other rows go through `_synced`. Rows
        whose grammar fails go to `failed`; returned: the rows left to mask, in order, with their matchers.

        One native call per row, not llguidance's `consume_token_par`: that was slower on the CPU (128
        rows: 0.43 vs 0.27 ms), and every copy of one compiled grammar shares its lexer behind one mutex,
        which parallel threads would queue on (see the module's docstring)."""
        kept: list[tuple[GrammarRow, _Matcher]] = []
        eos = self.eos
        for r in rows:
            mt = self._matchers.get(r.key)
            n = len(r.tokens)
            if mt is not None and mt.count == n - 1 and not (mt.dead or mt.eos_seen) and \
                    (n == 1 or mt.last == r.tokens[n - 2]) and \
                    (mt.so is r.params.structured_outputs or mt.so == r.params.structured_outputs):
                t = r.tokens[-1] if r.last is None else r.last
                if t not in eos and not mt.m.is_stopped():
                    try:
                        ok = mt.m.consume_token(t) and not mt.m.is_error()  # as `_synced` checks
                        err = None if ok else self._failed(mt.so, mt.m, t)
                    except BaseException as e:  # noqa: BLE001 - one request's grammar never takes the worker down
                        err = _crashed(mt.so, e)
                    if err is not None:
                        del self._matchers[r.key]
                        failed[r.row] = err
                        continue
                    mt.count, mt.last = n, t
                    kept.append((r, mt))
                    continue
            try:
                mt = self._synced(r)
            except BaseException as e:  # noqa: BLE001 - one request's grammar never takes the worker down
                self._matchers.pop(r.key, None)
                so = r.params.structured_outputs
                assert so is not None
                if not isinstance(e, GrammarError):
                    failed[r.row] = _crashed(so, e)
                elif e.kind == "engine":  # no grammar engine, no tokenizer...: say which constraint it refused
                    failed[r.row] = f"the {so.kind} constraint cannot be served: {e}"
                else:
                    failed[r.row] = str(e)
                continue
            if not mt.eos_seen:
                kept.append((r, mt))
        return kept

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
        live = self._advance(rows, failed)
        # every live row is written below
        mask = GrammarMask.new(len(live), self.vocab_size, pin, fill=False, rows=[r.row for r, _ in live])
        if not live:
            return mask, failed
        words = mask.words
        host = words.numpy()
        todo: list[tuple[Any, int]] = []
        for i, (_, mt) in enumerate(live):
            if mt.dead or mt.m.is_stopped():  # the grammar is complete and cannot go on: EOS only
                # (a matcher in error says "stopped" too, but none is live: `_advance` failed its row)
                self._only_eos(host[i])
            else:
                todo.append((mt.m, i))
        if not todo:
            return mask, failed
        try:
            # The grammar engine writes the rows in place (what llguidance.torch's wrappers do; that
            # module is not imported: it builds a torch.compile kernel at import, seconds of stall).
            row_bytes = mask.num_words * 4
            if len(todo) == 1:
                todo[0][0].unsafe_compute_mask_ptr(words[todo[0][1]].data_ptr(), row_bytes)
            else:
                self._executor.unsafe_compute_mask_ptr(todo, words.data_ptr(), row_bytes, len(live))
        except BaseException as e:  # noqa: BLE001 - those rows fail, the worker lives
            for _, i in todo:
                r, mt = live[i]
                failed[r.row] = _crashed(mt.so, e)
                self._matchers.pop(r.key, None)
                host[i] = -1  # the row fails anyway; its words must not be left unset
            return mask, failed
        # one pass over the step's words for the rows left empty, not a call per row
        empty = set(np.flatnonzero(np.bitwise_or.reduce(host, axis=1) == 0).tolist())
        for m, i in todo:
            r, mt = live[i]
            if m.is_error() and not dead_end(m):  # the engine failed on it (whatever it wrote): the row fails,
                failed[r.row] = self._failed(mt.so, m)  # never "stop" with its text unconstrained
                self._matchers.pop(r.key, None)
                host[i] = -1
            elif i in empty or m.is_error():  # nothing can follow (the constraint's dead end): end it, as "stop"
                mt.dead = True
                self._only_eos(host[i])
            elif m.is_stopped():  # the fill found the grammar ended: EOS only
                self._only_eos(host[i])
            elif len(r.tokens) < r.params.min_tokens and (r.params.stop_token_ids or not r.params.ignore_eos):
                self._ban_early_stop(host[i], r.params)
        return mask, failed

    def _only_eos(self, words: np.ndarray) -> None:
        w = words.view(np.uint32)
        w[:] = 0
        for t in self.eos:
            if t < self.vocab_size:
                w[t // 32] |= np.uint32(1 << (t % 32))

    def _ban_early_stop(self, words: np.ndarray, p: SamplingParams) -> None:
        """Below min_tokens: clear the stop tokens' bits, unless they are all the grammar allows (a
        complete grammar ends the request anyway)."""
        banned = [t for t in {*p.stop_token_ids, *(() if p.ignore_eos else self.eos)} if t < self.vocab_size]
        if not banned:
            return
        w = words.view(np.uint32)
        saved = w.copy()
        for t in banned:
            w[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
        if not w.any():
            w[:] = saved


def _release_shards(value: Any) -> None:
    """A compiled constraint left the grammar cache: its extra compiles go back to the budget."""
    if isinstance(value, LexerShards):
        value.release()


def _crashed(so: StructuredOutputs, e: BaseException) -> str:
    """The message of a row whose grammar engine call raised `e` (or panicked: pyo3's PanicException is a
    BaseException); interpreter exits propagate."""
    if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
        raise e
    return str(cannot_serve(so, f"{type(e).__name__}: {e}"[:MESSAGE_CHARS]))
