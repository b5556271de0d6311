"""The grammar module (rapidserve/structured) on CPU: compiling and checking constraints, the LRU of
compiled grammars, masks, termination, replay, failures, releasing matchers; the stop rule of a
grammar request; and matchers released after preemption and abort in the single-process engine."""

from __future__ import annotations

import json
import math
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rapidserve.loader import load_hf_tokenizer, resolve_model
from rapidserve.sampling_params import SamplingParams, StructuredOutputs
from rapidserve.stop_rules import check_stop_at
from rapidserve.structured import (
    GrammarBook,
    GrammarCache,
    GrammarError,
    GrammarMask,
    GrammarRow,
    apply_grammar_mask,
    check,
)
from rapidserve.structured.trial import build

CORPUS = Path(__file__).parent / "data" / "json_schemas.json"
VOCAB = 49152
EOS = (2, 0)


@pytest.fixture(scope="module")
def hf() -> Any:
    return load_hf_tokenizer(resolve_model(None))


@pytest.fixture(scope="module")
def view(hf: Any) -> Any:
    """llguidance's view of the tokenizer (`trial.ll_tokenizer`, about a CPU-second for SmolLM2's vocabulary)."""
    from rapidserve.structured.trial import ll_tokenizer

    return ll_tokenizer(hf, VOCAB, EOS)


@pytest.fixture()
def book(hf: Any, view: Any, monkeypatch: pytest.MonkeyPatch) -> GrammarBook:
    """A fresh book (no matchers, nothing compiled) that loads the module's tokenizer view, as one engine's books
    share theirs (read-only), instead of building its own; the tests that check how a book loads its view make
    their own books."""
    from rapidserve.structured import matchers

    real = matchers.ll_tokenizer
    monkeypatch.setattr(matchers, "ll_tokenizer", lambda tok, vocab_size, eos: view if (
        tok is hf and vocab_size == VOCAB and tuple(eos) == EOS) else real(tok, vocab_size, eos))
    return GrammarBook(lambda: hf, VOCAB, EOS, cache_size=2)


def params(**kw: Any) -> SamplingParams:
    return SamplingParams(structured_outputs=StructuredOutputs(**kw), max_tokens=64)


def greedy(book: GrammarBook, p: SamplingParams, key: str = "r", steps: int = 40,
           logits_of: Any = None) -> list[int]:
    """Generate under the book's masks from random (seeded) logits until EOS."""
    gen = torch.Generator().manual_seed(0)
    toks: list[int] = []
    for _ in range(steps):
        mask, failed = book.fill([GrammarRow(0, key, p, list(toks))], pin=False)
        assert not failed
        logits = torch.randn(1, VOCAB, generator=gen) if logits_of is None else logits_of(toks)
        apply_grammar_mask(logits, mask)
        t = int(logits.argmax())
        toks.append(t)
        if t in EOS:
            break
    return toks


@pytest.mark.parametrize("so", [
    StructuredOutputs(json='{"type": "objekt"}'), StructuredOutputs(json="{not json"),
    StructuredOutputs(regex="a(b"), StructuredOutputs(grammar="start: ("),
    StructuredOutputs(json='{"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}'),
])
def test_invalid_constraints_raise_grammar_error_naming_the_kind(so: StructuredOutputs) -> None:
    with pytest.raises(GrammarError) as ei:
        check(so)
    assert ei.value.kind == so.kind and str(ei.value)


def test_valid_constraints_check_and_gbnf_is_converted() -> None:
    for so in (StructuredOutputs(json='{"type": "integer"}'), StructuredOutputs(json_object=True),
               StructuredOutputs(regex="[0-9]+"), StructuredOutputs(choice=("a b", 'q"uote')),
               StructuredOutputs(grammar='start: "x"+'), StructuredOutputs(grammar='root ::= "x" | "y"')):
        assert isinstance(check(so), str)


def test_cache_compiles_once_per_constraint_and_is_bounded() -> None:
    made: list[StructuredOutputs] = []
    cache = GrammarCache(lambda so: made.append(so) or len(made), capacity=2)
    a, b, c = StructuredOutputs(regex="a"), StructuredOutputs(regex="b"), StructuredOutputs(regex="c")
    assert cache.compile(a) == 1 and cache.compile(StructuredOutputs(regex="a")) == 1  # equal constraint: a hit
    assert cache.compile(b) == 2 and cache.compile(a) == 1  # a is now the most recent
    assert cache.compile(c) == 3 and len(cache) == 2  # b evicted, a kept
    assert cache.compile(a) == 1 and cache.compile(b) == 4
    assert (cache.hits, cache.misses) == (3, 4)
    with pytest.raises(ValueError):
        GrammarCache(lambda so: 0, capacity=0)


def test_choice_mask_then_eos_only_once_complete(book: GrammarBook, hf: Any) -> None:
    p = params(choice=("yes", "no"))
    toks = greedy(book, p)
    assert toks[-1] in EOS and hf.decode(toks[:-1]) in ("yes", "no")
    # once complete, the mask allows exactly the EOS ids
    mask, _ = book.fill([GrammarRow(3, "r", p, toks[:-1])], pin=False)
    assert mask.rows == [3] and set(mask.allowed(0, VOCAB)) == set(EOS)
    assert book.cache.misses == 1 and len(book) == 1


def test_every_json_schema_of_the_corpus_yields_valid_json(book: GrammarBook, hf: Any) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    corpus = json.loads(CORPUS.read_text())
    assert len(corpus) >= 20
    for i, item in enumerate(corpus):
        p = params(json=json.dumps(item["schema"]))
        gen = torch.Generator().manual_seed(i)
        # logits favouring short tokens' ends: random, so every schema walks a different path
        toks = greedy(book, p, key=item["name"], steps=200,
                      logits_of=lambda _t, g=gen: torch.randn(1, VOCAB, generator=g))
        assert toks[-1] in EOS, (item["name"], hf.decode(toks))
        jsonschema.validate(json.loads(hf.decode(toks[:-1])), item["schema"])


def test_replay_rebuilds_a_matcher_out_of_step_and_retain_releases(book: GrammarBook, hf: Any) -> None:
    p = params(regex="[a-c]{4}")
    toks = greedy(book, p, key="x")
    # a different history under the same key (a preempted request recomputed elsewhere) is replayed
    other = hf.encode("ca", add_special_tokens=False)
    mask, failed = book.fill([GrammarRow(0, "x", p, other)], pin=False)
    assert not failed and all(hf.decode([t]) and set(hf.decode(other + [t])) <= set("abc")
                              for t in mask.allowed(0, VOCAB))
    assert toks[-1] in EOS
    book.fill([GrammarRow(0, "y", p, [])], pin=False)
    assert len(book) == 2
    book.retain(["y"])
    assert len(book) == 1
    book.release("y")
    assert len(book) == 0


def test_a_rejected_token_fails_only_its_row(book: GrammarBook, hf: Any) -> None:
    p = params(regex="[0-9]+")
    letters = hf.encode("abc", add_special_tokens=False)
    mask, failed = book.fill([GrammarRow(0, "bad", p, letters), GrammarRow(1, "good", p, [])], pin=False)
    assert list(failed) == [0] and "does not continue" in failed[0]
    assert mask.rows == [1] and len(book) == 1


def test_min_tokens_bans_eos_only_while_the_grammar_can_go_on(book: GrammarBook, hf: Any) -> None:
    p = SamplingParams(structured_outputs=StructuredOutputs(regex="[0-9]+"), min_tokens=5, max_tokens=8)
    one = hf.encode("7", add_special_tokens=False)
    mask, _ = book.fill([GrammarRow(0, "m", p, one)], pin=False)
    assert not set(mask.allowed(0, VOCAB)) & set(EOS)  # "7" could end, but min_tokens says go on
    done = SamplingParams(structured_outputs=StructuredOutputs(choice=("no",)), min_tokens=5, max_tokens=8)
    mask, _ = book.fill([GrammarRow(0, "d", done, hf.encode("no", add_special_tokens=False))], pin=False)
    assert set(mask.allowed(0, VOCAB)) == set(EOS)  # complete: EOS anyway
    # and a grammar request stops on EOS below min_tokens; a free-text one does not
    assert check_stop_at(done, 2, 2, 10, EOS, 100) == "stop"
    assert check_stop_at(done.replace(structured_outputs=None), 2, 2, 10, EOS, 100) is None


def test_apply_grammar_mask_touches_only_masked_rows_and_for_row() -> None:
    mask = GrammarMask.new(1, 70, pin=False)
    mask.words.zero_()
    mask.words[0, 0] = 1 << 5  # token 5
    mask.words[0, 2] = 1 << 1  # token 65
    mask.row_ids.fill_(1)
    logits = torch.zeros(3, 70)
    apply_grammar_mask(logits, mask)
    assert torch.equal(logits[0], torch.zeros(70)) and torch.equal(logits[2], torch.zeros(70))
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [5, 65]
    assert logits[1, 0] == -math.inf
    alone = mask.for_row(1)
    assert alone.rows == [0] and alone.allowed(0, 70) == [5, 65]
    assert mask.for_row(0).num_rows == 0
    with pytest.raises(ValueError, match="covers 32 tokens"):
        apply_grammar_mask(torch.zeros(1, 70), GrammarMask.new(1, 20, pin=False))


def test_a_model_without_tokenizer_fails_the_row_saying_so() -> None:
    book = GrammarBook(lambda: None, VOCAB, EOS)
    _, failed = book.fill([GrammarRow(0, "p", params(regex="a"), [])], pin=False)
    assert "tokenizer" in failed[0]


def test_an_llguidance_too_old_for_several_eos_ids_fails_the_row_saying_which_to_install(
        hf: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import llguidance.hf

    real = llguidance.hf.from_tokenizer

    def single_eos(tok: Any, n_vocab: int | None = None, eos_token: int | None = None) -> Any:  # llguidance 1.6
        if isinstance(eos_token, list):
            raise TypeError("argument 'eos_token': 'list' object cannot be interpreted as an integer")
        return real(tok, n_vocab=n_vocab, eos_token=eos_token)

    monkeypatch.setattr(llguidance.hf, "from_tokenizer", single_eos)
    book = GrammarBook(lambda: hf, VOCAB, EOS)
    _, failed = book.fill([GrammarRow(0, "p", params(regex="a"), [])], pin=False)
    assert "too old" in failed[0] and "llguidance>=1.7" in failed[0]


def test_llm_preemption_and_abort_release_matchers() -> None:
    from rapidserve import LLM

    # a pool of 8 blocks of 16 tokens: four requests of ~50 tokens preempt each other (digits are one token each)
    llm = LLM(show_progress=False, max_model_len=256, num_kv_blocks=8)
    tok = llm.get_tokenizer()
    assert tok is not None
    p = SamplingParams(structured_outputs=StructuredOutputs(regex="[0-9]{28}"), max_tokens=32, temperature=0.9,
                       seed=1)
    outs = llm.generate([tok.encode("Count: " * 8)] * 4, p, use_tqdm=False)
    assert llm.engine.num_preemptions > 0
    for o in outs:
        assert len(o.outputs[0].text) == 28 and o.outputs[0].text.isdigit() and o.outputs[0].finish_reason == "stop"
    assert len(llm.engine.grammar) == 0  # every matcher released
    seq = llm.engine.add("a", tok.encode("Hello"), p)
    llm.engine.step()
    llm.engine.step()
    assert len(llm.engine.grammar) == 1
    llm.engine.abort(seq)
    llm.engine.step()
    assert len(llm.engine.grammar) == 0 and not llm.engine.has_work


def test_a_preset_gets_structured_outputs_from_a_tokenizer_folder(tmp_path: Path) -> None:
    """`--tokenizer DIR` (how the GPU bench serves structured outputs on a random-weight preset)."""
    from rapidserve import LLM
    from tests.test_structured_workers import tiny_tokenizer_dir

    tiny_tokenizer_dir(tmp_path)
    llm = LLM("preset:tiny-llama", device="cpu", dtype="float32", tokenizer=str(tmp_path), show_progress=False)
    p = SamplingParams(structured_outputs=StructuredOutputs(regex="[0-9]{4}-[a-z]{2}"), max_tokens=16,
                       temperature=1.0, seed=3)
    out = llm.generate(["the fox"], p, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and re.fullmatch("[0-9]{4}-[a-z]{2}", out.text), out


def test_without_the_grammar_engine_a_constraint_is_a_501_naming_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    from rapidserve.server.errors import APIError
    from rapidserve.server.schemas import CompletionRequest
    from rapidserve.server.structured_fields import structured_outputs_of

    monkeypatch.setitem(__import__("sys").modules, "llguidance", None)  # import llguidance -> ImportError
    body = CompletionRequest(prompt="hi", guided_regex="a+")
    with pytest.raises(APIError) as ei:
        structured_outputs_of(body, GrammarCache(check))
    assert ei.value.status == 501 and ei.value.param == "guided_regex" and "pip install" in ei.value.message
    assert structured_outputs_of(CompletionRequest(prompt="hi"), GrammarCache(check)) is None  # free text: fine


def test_a_dead_end_ends_the_request_and_a_constraint_allowing_nothing_is_refused(book: GrammarBook, hf: Any) -> None:
    """A grammar whose language is empty from the start is refused when it is compiled (trial.py: a 400
    at the server) rather than answered with an empty "stop"; one that meets a dead end while generating
    (after "a" below nothing can follow) allows EOS there: the request ends ("stop"), never sampling from an
    all -inf row. (Until the trial, the first case also ended as "stop" with no text.)"""
    empty = params(grammar='start: a\na: a "x"')
    check(empty.structured_outputs)  # type: ignore[arg-type]  (the grammar itself is well formed)
    _, failed = book.fill([GrammarRow(0, "u", empty, [])], pin=False)
    assert "allows no output" in failed[0]
    p = params(grammar='start: "a" b | "c"\nb: b "x"')
    a = hf.encode("a", add_special_tokens=False)
    assert len(a) == 1
    mask, failed = book.fill([GrammarRow(0, "d", p, [])], pin=False)
    assert not failed and a[0] in mask.allowed(0, VOCAB)
    mask, failed = book.fill([GrammarRow(0, "d", p, a)], pin=False)
    assert not failed and set(mask.allowed(0, VOCAB)) == set(EOS)  # EOS only, never an all -inf row
    mask, failed = book.fill([GrammarRow(0, "d", p, [a[0], EOS[0]])], pin=False)
    assert not failed and mask.num_rows == 0  # ended (under ignore_eos it would go on unconstrained)
    # another worker replaying the request (RAPID decode after prefill; ignore_eos kept it going)
    replay = SamplingParams(structured_outputs=p.structured_outputs, ignore_eos=True, max_tokens=8)
    mask, failed = book.fill([GrammarRow(0, "d2", replay, [a[0], EOS[0]])], pin=False)
    assert not failed and mask.num_rows == 0  # after EOS under ignore_eos: unconstrained


class SeenLock:
    """A lock that counts the threads that came to it (`comers`), so a test can wait until a thread is at it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.comers: list[str] = []

    def __enter__(self) -> SeenLock:
        self.comers.append(threading.current_thread().name)
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def until(ok: Any, what: str, timeout: float = 30.0) -> None:
    """Poll `ok()` until it is true; fail after `timeout` s saying `what` never happened."""
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        time.sleep(0.001)


def test_warm_loads_the_tokenizer_once_in_the_background_and_fills_never_import_llguidance_torch(hf: Any) -> None:
    """Workers on a GPU call `warm` at start, so the first constraint does not stall their loop on the
    tokenizer; a fill racing the warming thread waits for it, and the loader runs once. Filling does
    not import llguidance.torch (its import builds a torch.compile kernel: seconds of stall)."""
    import subprocess
    import sys

    calls: list[str] = []
    gate = threading.Event()

    def slow_loader() -> Any:
        calls.append(threading.current_thread().name)
        assert gate.wait(60)
        return hf

    book = GrammarBook(slow_loader, VOCAB, EOS)
    book._tok_lock = SeenLock()  # type: ignore[assignment]
    book.warm()
    until(lambda: calls == ["grammar-warm"], "the warming thread inside the loader")
    filled: list[Any] = []
    racer = threading.Thread(target=lambda: filled.append(book.fill([GrammarRow(0, "r", params(regex="[0-9]+"), [])],
                                                                     pin=False)))
    racer.start()
    until(lambda: len(book._tok_lock.comers) == 2, "the fill at the tokenizer's lock")  # type: ignore[attr-defined]
    gate.set()  # only now does the load end: the fill raced it and waited
    racer.join(30)
    mask, failed = filled[0]
    assert not failed and calls == ["grammar-warm"]  # loaded once, by the warming thread
    assert set(mask.allowed(0, VOCAB)) <= set(range(VOCAB)) and mask.allowed(0, VOCAB)

    unwarmable = GrammarBook(lambda: None, VOCAB, EOS)
    unwarmable.warm()  # a model without a tokenizer: nothing raises here...
    _, failed = unwarmable.fill([GrammarRow(0, "p", params(regex="a"), [])], pin=False)
    assert "tokenizer" in failed[0]  # ...its first constraint says so

    probe = ("import sys; from rapidserve.loader import load_hf_tokenizer, resolve_model; "
             "from rapidserve.structured import GrammarBook, GrammarRow; "
             "from rapidserve.sampling_params import SamplingParams, StructuredOutputs; "
             "hf = load_hf_tokenizer(resolve_model(None)); b = GrammarBook(lambda: hf, 49152, (2,)); "
             "p = SamplingParams(structured_outputs=StructuredOutputs(regex='[0-9]+')); "
             "m, f = b.fill([GrammarRow(0, 'a', p, []), GrammarRow(1, 'b', p, [])], pin=False); "
             "assert not f and m.num_rows == 2; print('llguidance.torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


# A JSON schema the grammar engine compiles and tries fine (trial.py), whose "b" pattern runs its lexer out of
# fuel once a generation reaches that string: a limit met mid-generation (measured on SmolLM2's tokenizer).
LATE_FAILING_SCHEMA = {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 9},
    "b": {"type": "string", "pattern": "^(b{1000}){1000}$"}}, "required": ["a", "b"]}


def test_a_constraint_beyond_the_engine_lexer_limits_is_refused_when_compiled_and_remembered(book: GrammarBook) -> None:
    """`b{300000}` compiles (llguidance builds matchers lazily) but its first mask runs the lexer out of fuel:
    the trial finds it, so its row fails with the engine's reason instead of ending as "stop" with
    unconstrained (empty) text; the failure is cached, so the next request of it fails without a compile."""
    p = params(regex="b{300000}")
    _, failed = book.fill([GrammarRow(0, "x", p, [])], pin=False)
    assert "cannot serve this regex constraint" in failed[0] and "lexer error" in failed[0], failed
    misses = book.cache.misses
    assert book.prepare("y", p.structured_outputs) is True  # the remembered failure: ready at once
    _, failed = book.fill([GrammarRow(3, "y", p, [])], pin=False)
    assert "lexer error" in failed[3] and book.cache.misses == misses
    with pytest.raises(GrammarError, match="lexer error"):
        build(p.structured_outputs, book._tokenizer())  # type: ignore[arg-type]


def test_a_matcher_that_errs_mid_generation_fails_its_row_never_stop_and_the_constraint_is_remembered(
        book: GrammarBook, hf: Any) -> None:
    """Reaching LATE_FAILING_SCHEMA's "b" string breaks the lexer every copy of the compile shares: that row
    fails (before the fix its matcher counted as complete, EOS only, and the request ended "stop" with
    '{"a":1,"' for text); the constraint is remembered as failed, and another request of it (a copy of the
    broken compile) fails at once, while a row of another constraint in the same fill goes on."""
    p = params(json=json.dumps(LATE_FAILING_SCHEMA))
    ok = params(regex="[0-9]+")
    toks = hf.encode('{"a":1,"b":"', add_special_tokens=False)
    failed: dict[int, str] = {}
    for k in range(len(toks) + 1):
        mask, failed = book.fill([GrammarRow(0, "late", p, toks[:k]), GrammarRow(1, "ok", ok, [])], pin=False)
        if failed:
            break
        assert toks[k] in mask.allowed(0, VOCAB)  # the path is the grammar's until the lexer breaks
    assert list(failed) == [0] and "cannot serve this json constraint: lexer error" in failed[0], failed
    assert 1 in mask.rows  # the other row was masked in the same fill
    _, failed = book.fill([GrammarRow(0, "again", p, [])], pin=False)
    assert "lexer error" in failed[0]


def test_llm_refuses_a_constraint_the_engine_cannot_serve_and_fails_only_the_request_whose_grammar_breaks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """LLM.generate: a constraint beyond the engine's limits is a ValueError naming the field, raised before
    any request runs (its verdict cached: the engine never compiles it again). A constraint that breaks
    while generating (LATE_FAILING_SCHEMA), or whose compile fails in the engine (a request added past
    generate's check), ends that request alone with "error" and a message naming the constraint, never
    with its text unconstrained; a free-text request beside it completes."""
    from rapidserve import LLM

    llm = LLM(show_progress=False, max_model_len=256)
    bad = SamplingParams(structured_outputs=StructuredOutputs(regex="b{300000}"), max_tokens=8)
    free = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with pytest.raises(ValueError, match=r"structured_outputs\.regex: .*lexer error"):
        llm.generate(["Hi", "Hello"], [free, bad], use_tqdm=False)
    assert not llm.engine.has_work  # nothing was added
    late = SamplingParams(structured_outputs=StructuredOutputs(json=json.dumps(LATE_FAILING_SCHEMA)), max_tokens=24,
                          temperature=0.0)
    out = llm.generate(["Give JSON:", "Tell me a story"], [late, free], use_tqdm=False)
    broken, story = out[0].outputs[0], out[1].outputs[0]
    assert broken.finish_reason == "error" and broken.error is not None, broken
    assert "cannot serve this json constraint: lexer error" in broken.error
    assert story.finish_reason == "length" and len(story.token_ids) == 6 and story.error is None
    monkeypatch.setattr(llm.engine.grammar.cache, "_make", lambda so: (_ for _ in ()).throw(RuntimeError("no way")))
    tok = llm.get_tokenizer()
    assert tok is not None
    odd = SamplingParams(structured_outputs=StructuredOutputs(regex="[a-z]{3}"), max_tokens=8)
    seqs = [llm.engine.add("odd", tok.encode("Hi"), odd), llm.engine.add("free", tok.encode("Hi"), free)]
    events = []
    while llm.engine.has_work:
        events += [e for e in llm.engine.step() if e.finish_reason is not None]
    assert [(e.seq.seq_id, e.finish_reason) for e in events] == [("odd", "error"), ("free", "length")]
    assert "regex constraint" in events[0].message and "no way" in events[0].message
    assert seqs[0].output_token_ids == [] and len(seqs[1].output_token_ids) == 6
    assert len(llm.engine.grammar) == 0


def test_server_trials_load_the_tokenizer_once_and_remember_each_verdict(hf: Any,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's GrammarTrials: llguidance's view of the tokenizer is loaded once (warm and concurrent
    first constraints wait for one load; no EOS ids: the tokenizer's own), and each constraint's verdict,
    success or failure, is cached: asked again it answers at once, without a compile."""
    import types

    import rapidserve.structured.trial as trial_module
    from rapidserve.structured import GrammarTrials

    loads: list[int] = []
    gate = threading.Event()

    def loader() -> Any:
        loads.append(1)
        gate.wait(30)  # every check below arrives while the tokenizer is still loading
        return hf

    class SeenEvent(threading.Event):
        """The trial's Event, counting the threads that wait for its verdict."""

        def __init__(self) -> None:
            super().__init__()
            self.waiters: list[str] = []

        def wait(self, timeout: float | None = None) -> bool:
            self.waiters.append(threading.current_thread().name)
            return super().wait(timeout)

    monkeypatch.setattr(trial_module, "threading", types.SimpleNamespace(Lock=threading.Lock, Event=SeenEvent))
    trials = GrammarTrials(loader, VOCAB, ())
    trials._tok_lock = SeenLock()  # type: ignore[assignment]
    threading.Thread(target=trials.warm, daemon=True).start()  # as `serve` does while the engine starts
    until(lambda: loads == [1], "the warming thread inside the loader")
    ok = StructuredOutputs(regex="[0-9]+")
    assert not trials.known(ok)
    threads = [threading.Thread(target=trials.check, args=(ok,)) for _ in range(3)]
    for t in threads:
        t.start()

    def settled() -> bool:  # one trial at the tokenizer's lock (the load holds it), two waiting for its verdict
        running = dict(trials._running)
        return len(trials._tok_lock.comers) == 2 and ok in running and len(running[ok].waiters) == 2  # type: ignore

    until(settled, f"one trial under way, two waiting: {trials._running}, {trials._tok_lock.comers}")  # type: ignore
    assert list(trials._running) == [ok]  # one trial under way; the other two wait for its verdict
    gate.set()
    for t in threads:
        t.join(60)
    assert loads == [1] and trials.known(ok) and not trials._running
    bad = StructuredOutputs(regex="b{300000}")
    for _ in range(2):
        with pytest.raises(GrammarError, match="cannot serve this regex constraint: lexer error"):
            trials.check(bad)
    assert trials.known(bad) and trials.verdicts.misses == 2  # ok and bad, each tried once (not once a thread)
