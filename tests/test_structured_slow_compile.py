"""A grammar that compiles slowly stalls nobody (CPU, the real workers in this process, channels as lists:
tests/test_worker_faults.py's harness). Each worker's compile is held on the compile pool's thread until the
loop has turned 50 times and a plain request has had 50 tokens meanwhile (a compile as slow as the test says,
on any machine); a turn that waited for the compile would leave it waiting out its gate. Then the structured
request runs and its output follows its grammar. Covered: hybrid (held at admission), rapid with
the slow compile in prefill (the job is passed over) and in decode (the request runs there only once
compiled); an abort while compiling releases everything; a compile that fails fails its request alone, with
the message it had before compiles moved to the pool."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from rapidserve.config_builder import build_engine_config
from rapidserve.engine import messages as m
from rapidserve.loader import resolve_model
from rapidserve.runner import ModelRunner
from rapidserve.sampling_params import SamplingParams, StructuredOutputs
from rapidserve.structured import GrammarBook
from tests.test_structured_workers import REGEX, _texts, tiny_tokenizer_dir
from tests.test_worker_faults import FakeIO, _decode_worker, _fused_worker, _prefill_worker

HELD_TURNS = 50  # loop turns, and tokens of the plain request, while the structured one waits for its compile
GATE_S = 60.0  # the longest a compile waits for the test to let it through (a turn blocked on it: it waits it out)
SO = StructuredOutputs(regex=REGEX)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, ModelRunner, Any]:
    from transformers import AutoTokenizer

    tok = tiny_tokenizer_dir(tmp_path_factory.mktemp("tok"))
    # 1900-token requests: past tiny-llama's 1024 positions (random weights: no text to spoil)
    cfg, _ = build_engine_config("preset:tiny-llama", device="cpu", dtype="float32", num_kv_blocks=160,
                                 block_size=16, max_model_len=2048, tokenizer=tok, allow_long_max_model_len=True)
    source = resolve_model(cfg.model, preset_device=torch.device("cpu"), preset_dtype=torch.float32)
    return cfg, ModelRunner(cfg, source, show_progress=False), AutoTokenizer.from_pretrained(tok)


@dataclass
class SlowCompiles:
    """Every compile of a GrammarBook, held on its thread until the test opens `gate`."""

    gate: threading.Event = field(default_factory=threading.Event)
    threads: list[str] = field(default_factory=list)  # the names of the threads that compiled
    waited_out: list[bool] = field(default_factory=list)  # per compile: its gate never opened (a turn blocked)


def slow_compiles(monkeypatch: pytest.MonkeyPatch, book: GrammarBook) -> SlowCompiles:
    real, slow = book.cache._make, SlowCompiles()

    def make(so: StructuredOutputs) -> Any:
        slow.threads.append(threading.current_thread().name)
        slow.waited_out.append(not slow.gate.wait(GATE_S))
        return real(so)

    monkeypatch.setattr(book.cache, "_make", make)
    return slow


def plain(rid: str = "plain") -> m.NewRequest:
    return m.NewRequest(rid, [3, 4, 5, 6], SamplingParams(temperature=0.0, max_tokens=1900, ignore_eos=True), 0.0)


def structured(rid: str, so: StructuredOutputs = SO) -> m.NewRequest:
    return m.NewRequest(rid, [7, 8, 9], SamplingParams(temperature=1.0, seed=5, max_tokens=40, structured_outputs=so),
                        0.0)


def count(io: FakeIO, rid: str) -> int:
    return sum(1 for label in ("d2r", "p2r") for b in io.of(label, m.TokenBatch) for t in b.tokens if t.req_id == rid)


class Meter:
    """Loop turns and the plain request's tokens while `rid` has none (or no more than `before`): the time its
    grammar held it back. Once both reach HELD_TURNS it lets the held compiles through."""

    def __init__(self, io: FakeIO, rid: str, slow: SlowCompiles, before: int = 0) -> None:
        self.io, self.rid, self.slow, self.before = io, rid, slow, before
        self.turns, self.plain0 = 0, count(io, "plain")
        self.t0 = time.perf_counter()
        self.plain_meanwhile = 0

    def turn(self) -> bool:
        """Count a turn; True while `rid` is still held back."""
        if count(self.io, self.rid) > self.before:
            return False
        self.turns += 1
        self.plain_meanwhile = count(self.io, "plain") - self.plain0
        if self.turns >= HELD_TURNS and self.plain_meanwhile >= HELD_TURNS:
            self.slow.gate.set()  # its compile may finish now
        assert time.perf_counter() - self.t0 < 2 * GATE_S, "the structured request never ran"
        return True

    def check(self) -> None:
        assert self.slow.gate.is_set(), vars(self)  # it waited for its compile, while the loop turned and streamed
        assert self.turns >= HELD_TURNS and self.plain_meanwhile >= HELD_TURNS, vars(self)
        assert self.slow.waited_out and not any(self.slow.waited_out), self.slow  # no turn waited for a compile


def until(pred: Callable[[], bool], turn: Callable[[], None], limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not pred():
        assert time.monotonic() < deadline, "no progress"
        turn()


def test_hybrid_streams_on_while_a_grammar_compiles_and_an_abort_meanwhile_releases_it(
        setup: tuple[Any, ModelRunner, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, runner, hf = setup
    io = FakeIO()
    w = _fused_worker(cfg, runner, io)
    slow = slow_compiles(monkeypatch, w.grammar)
    io.inbox.append(plain())
    def turn() -> None:
        w.turn()

    until(lambda: count(io, "plain") >= 3, turn)
    io.inbox += [structured("json"), structured("gone", StructuredOutputs(regex="[a-z]{4}"))]
    meter = Meter(io, "json", slow)
    while meter.turn():
        turn()
        if meter.turns == 10:
            io.inbox.append(m.Abort("gone"))  # while its compile runs
    meter.check()
    assert "gone" not in w.sched.reqs and "gone" not in w.grammar.compiles
    until(lambda: "json" not in w.sched.reqs, turn)
    text, reason = _texts(io, hf)["json"]
    assert reason == "stop" and re.fullmatch(REGEX, text), (text, reason)
    assert slow.threads == ["grammar-compile"] * 2  # json's and gone's, both on the pool
    io.inbox.append(m.Abort("plain"))
    until(lambda: not w.sched.reqs and not w.inflight, turn)
    w.publish()
    assert len(w.grammar) == 0 and not w.grammar.compiles._running and not w.grammar.compiling()
    assert [(f.req_id, f.reason) for f in io.of("d2r", m.Finished)] == [("gone", "abort"), ("plain", "abort")]


@pytest.mark.parametrize("slow_in", ["prefill", "decode"])
def test_rapid_streams_on_while_a_grammar_compiles(setup: tuple[Any, ModelRunner, Any],
                                                   monkeypatch: pytest.MonkeyPatch, slow_in: str) -> None:
    """The two workers' loops interleaved (they are two processes in the engine): the grammar is slow to
    compile in one of them; the other compiles it at once."""
    cfg, runner, hf = setup
    io = FakeIO()
    w, p = _decode_worker(cfg, runner, io), _prefill_worker(cfg, runner, io)
    slow = slow_compiles(monkeypatch, p.grammar if slow_in == "prefill" else w.grammar)

    def turn() -> None:
        w.step()
        w.publish()
        w.admit()
        for msg in list(io.sent["d2p"]):  # KVReady, Drop
            io.sent["d2p"].remove(msg)
            p.handle(msg)
        io.seat = "prefill"
        p.prefill_step()  # one batch of what is ready (nothing while every job waits for its grammar)
        io.seat = "decode"
        for msg in list(io.sent["p2d"]):
            io.sent["p2d"].remove(msg)
            w.handle(msg)
        if not w.inflight and w.sched.running:  # as the decode loop: a short sleep while all are held
            io.wait(w.grammar.idle_wait(0.0))

    w.handle(plain())
    until(lambda: count(io, "plain") >= 3, turn)
    w.handle(structured("json"))
    w.handle(structured("gone", StructuredOutputs(regex="[a-z]{4}")))
    # prefill holds the job back (no token at all), or decode does (only prefill's first token)
    meter = Meter(io, "json", slow, before=0 if slow_in == "prefill" else 1)
    while meter.turn():
        turn()
        if meter.turns == 10:  # while its compile runs: released in both workers
            w.handle(m.Abort("gone"))
    meter.check()
    assert "gone" not in w.sched.reqs and "gone" not in w.grammar.compiles and "gone" not in p.grammar.compiles
    until(lambda: w.sched.reqs.get("json") is None, turn)
    text, reason = _texts(io, hf)["json"]
    assert reason == "stop" and re.fullmatch(REGEX, text), (text, reason)
    assert slow.threads == ["grammar-compile"] * 2  # json's and gone's
    w.handle(m.Abort("plain"))
    until(lambda: not w.sched.reqs and not w.inflight, turn)
    assert len(w.grammar) == 0 and len(p.grammar) == 0 and not p.waiting_prefill
    assert not w.grammar.compiles._running and not p.grammar.compiles._running  # no future kept
    assert w.sched.blocks.num_free == w.sched.blocks.num_blocks
    assert [(f.req_id, f.reason) for f in io.of("d2r", m.Finished)] == [("gone", "abort"), ("plain", "abort")]


@pytest.mark.parametrize("where", ["prefill", "decode", "hybrid"])
def test_a_compile_that_fails_on_the_pool_fails_its_request_alone_as_before(
        setup: tuple[Any, ModelRunner, Any], monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """The message names the constraint and the compile's error, wherever it failed (it used to read
    "<stage> failed: GrammarError: invalid grammar: ...", which called a regex a grammar and blamed the
    worker), and the fault says it is the request's constraint's (a 400 at the server, not a 503)."""
    from tests.test_structured_workers import fail_compiling
    from tests.test_worker_faults import _prefill_for_decode, _run_ahead

    cfg, runner, hf = setup
    io = FakeIO()
    bad = StructuredOutputs(regex="[a-z]{3}")
    reqs = [structured("ok0"), structured("bad", bad), structured("ok1")]
    if where == "hybrid":
        w = _fused_worker(cfg, runner, io)
        fail_compiling(monkeypatch, w.grammar, bad, "compile blew up")
        io.inbox += reqs
        _run_ahead(w, 400)
    else:
        d, p = _decode_worker(cfg, runner, io), _prefill_worker(cfg, runner, io)
        fail_compiling(monkeypatch, p.grammar if where == "prefill" else d.grammar, bad, "compile blew up")
        for r in reqs:
            d.handle(r)
        deadline = time.monotonic() + 60  # wall clock, not a turn count: the compiles run on a pool thread
        while d.sched.reqs and time.monotonic() < deadline:
            d.admit()
            _prefill_for_decode(cfg, runner, io, d, p)
            d.step()
            d.publish()
            time.sleep(0.001)
        assert len(p.grammar) == 0 and not d.sched.reqs
    fin = io.of("d2r", m.Finished)
    assert [(f.req_id, f.reason, f.message, f.fault) for f in fin] == [
        ("bad", "error", "the grammar engine cannot serve this regex constraint: RuntimeError: compile blew up",
         m.STRUCTURED_FAULT)]
    texts = _texts(io, hf)
    for rid in ("ok0", "ok1"):
        text, reason = texts[rid]
        assert reason == "stop" and re.fullmatch(REGEX, text), (rid, text, reason)
