"""Structured outputs in the real decode and prefill workers (hybrid mode: the decode worker alone, fused
steps), in this process (the channels are lists: tests/test_worker_faults.py's harness), on a tiny preset given
a small trained tokenizer (`--tokenizer`): outputs follow the grammar across the prefill -> decode hand-off
(decode replays the tokens it knows into its own matcher), under preemption by recompute, and every matcher is
released once its request stops running (finished, aborted, preempted); a request whose grammar cannot compile
in a worker fails alone."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rapidserve.config_builder import build_engine_config
from rapidserve.engine import messages as m
from rapidserve.loader import resolve_model
from rapidserve.runner import ModelRunner
from rapidserve.sampling_params import SamplingParams, StructuredOutputs
from tests.test_worker_faults import (
    FakeIO,
    _decode_worker,
    _fused_worker,
    _prefill_for_decode,
    _prefill_worker,
    _run_ahead,
    _submit,
)

REGEX = "[0-9]{6}-[a-z]{2}"


def tiny_tokenizer_dir(path: Path) -> str:
    """A 600-token byte-level BPE tokenizer folder at `path` (gives a random-weight preset text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(["the quick brown fox 0123456789 jumps over the lazy dog {}[]\":,"] * 50, trainer)
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", bos_token="<s>",
                            unk_token="<unk>").save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, ModelRunner, Any]:
    from transformers import AutoTokenizer

    tok = tiny_tokenizer_dir(tmp_path_factory.mktemp("tok"))
    # 6 blocks of 16 tokens: three requests of 6 + ~10 tokens each fit; five preempt each other
    cfg, _ = build_engine_config("preset:tiny-llama", device="cpu", dtype="float32", num_kv_blocks=6,
                                 block_size=16, max_model_len=96, tokenizer=tok)
    source = resolve_model(cfg.model, preset_device=torch.device("cpu"), preset_dtype=torch.float32)
    return cfg, ModelRunner(cfg, source, show_progress=False), AutoTokenizer.from_pretrained(tok)


def req(rid: str, so: StructuredOutputs, seed: int, prompt_len: int = 6) -> m.NewRequest:
    return m.NewRequest(rid, list(range(3, 3 + prompt_len)),
                        SamplingParams(temperature=1.0, seed=seed, max_tokens=40, structured_outputs=so), 0.0)


def _texts(io: FakeIO, hf: Any) -> dict[str, tuple[str, str | None]]:
    toks: dict[str, list[int]] = {}
    reason: dict[str, str | None] = {}
    for label in ("d2r", "p2r"):
        for b in io.of(label, m.TokenBatch):
            for t in b.tokens:
                toks.setdefault(t.req_id, []).append(t.token_id)
                reason[t.req_id] = t.finish_reason or reason.get(t.req_id)
    return {k: (hf.decode([t for t in v if t != 2]), reason[k]) for k, v in toks.items()}


def fail_compiling(monkeypatch: pytest.MonkeyPatch, book: Any, bad: StructuredOutputs, message: str) -> None:
    """Make `book` fail to compile `bad` (raising `message`), as a grammar the server let through might."""
    real = book.cache._make

    def make(so: StructuredOutputs) -> Any:
        if so == bad:
            raise RuntimeError(message)
        return real(so)

    monkeypatch.setattr(book.cache, "_make", make)

def _compiled(book: Any, timeout_s: float = 60.0) -> None:
    """Wait until `book` compiles nothing (grammars compile off the loop, GrammarBook.prepare)."""
    deadline = time.monotonic() + timeout_s
    while book.compiling():
        assert time.monotonic() < deadline, "grammars still compiling"
        time.sleep(0.01)


def test_rapid_decode_follows_the_grammar_across_preemption_and_releases_every_matcher(
        setup: tuple[Any, ModelRunner, Any]) -> None:
    cfg, runner, hf = setup
    io = FakeIO()
    w, p = _decode_worker(cfg, runner, io), _prefill_worker(cfg, runner, io)
    so = StructuredOutputs(regex=REGEX)
    reqs = [req(f"r{i}", so, seed=i, prompt_len=30) for i in range(4)]
    _submit(cfg, runner, io, w, p, *reqs, req("gone", so, seed=9))
    _compiled(w.grammar)  # every request runs from the first step (a loaded machine compiles slowly): preemptions
    for i in range(80):
        w.step()
        if i == 1:
            w.handle(m.Abort("gone"))
        w.publish()
        w.admit()
        _prefill_for_decode(cfg, runner, io, w, p)
        if not w.sched.reqs:
            break
    assert w.sched.num_preemptions > 0  # the pool was too small: some requests were recomputed
    texts = _texts(io, hf)
    for r in reqs:
        text, reason = texts[r.req_id]
        assert reason == "stop" and re.fullmatch(REGEX, text), (r.req_id, text, reason)
    assert len(w.grammar) == 0 and len(p.grammar) == 0  # every matcher released
    assert w.sched.blocks.num_free == w.sched.blocks.num_blocks


def test_hybrid_ahead_follows_the_grammar_and_releases_matchers_on_abort(setup: tuple[Any, ModelRunner, Any]) -> None:
    cfg, runner, hf = setup
    io = FakeIO()
    w = _fused_worker(cfg, runner, io)
    so = StructuredOutputs(regex=REGEX)
    w.grammar.prepare("warm", so)  # compiled and cached first: the requests are ready on arrival, whatever the load
    _compiled(w.grammar)
    w.grammar.release("warm")
    io.inbox += [req(f"h{i}", so, seed=10 + i, prompt_len=30) for i in range(4)] + [req("gone", so, seed=3)]

    def before(i: int) -> None:
        if i == 3:
            io.inbox.append(m.Abort("gone"))

    _run_ahead(w, 200, before)
    assert w.sched.num_preemptions > 0
    texts = _texts(io, hf)
    for i in range(4):
        text, reason = texts[f"h{i}"]
        assert reason == "stop" and re.fullmatch(REGEX, text), (text, reason)
    assert [(f.req_id, f.reason) for f in io.of("d2r", m.Finished)] == [("gone", "abort")]
    w.publish()
    assert len(w.grammar) == 0


def free_text(rid: str, n: int = 6) -> m.NewRequest:
    """An unconstrained request of `n` tokens (ignore_eos: it ends by length)."""
    return m.NewRequest(rid, list(range(3, 9)), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), 0.0)


def _failed_as_constraint(io: FakeIO, rid: str, why: str) -> None:
    """`rid` alone ended with an error the router takes as its constraint's (a 400 at the server, not a 503)."""
    fin = io.of("d2r", m.Finished)
    assert [(f.req_id, f.reason, f.fault) for f in fin] == [(rid, "error", m.STRUCTURED_FAULT)], fin
    assert why in fin[0].message and "regex constraint" in fin[0].message, fin[0].message


def test_a_grammar_that_fails_in_a_worker_fails_only_its_request(setup: tuple[Any, ModelRunner, Any],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The server checks constraints before admission; should one still fail in a worker (here: its
    compile raises), that request ends with an error (its constraint's fault) and the others go on: a
    constrained one and an unconstrained one."""
    cfg, runner, hf = setup
    io = FakeIO()
    w = _fused_worker(cfg, runner, io)
    bad = StructuredOutputs(regex="[a-z]{3}")
    fail_compiling(monkeypatch, w.grammar, bad, "compile blew up")
    io.inbox += [req("ok", StructuredOutputs(regex=REGEX), seed=1), req("bad", bad, seed=2), free_text("free")]
    _run_ahead(w, 100)
    _failed_as_constraint(io, "bad", "compile blew up")
    texts = _texts(io, hf)
    assert texts["ok"][1] == "stop" and re.fullmatch(REGEX, texts["ok"][0])
    assert texts["free"][1] == "length" and "bad" not in texts
    w.publish()
    assert len(w.grammar) == 0 and w.sched.blocks.num_free == w.sched.blocks.num_blocks


def test_a_grammar_that_fails_in_the_decode_worker_frees_its_blocks_and_the_rest_go_on(
        setup: tuple[Any, ModelRunner, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A row whose grammar fails in the decode worker (with a step in flight) fails alone: its blocks
    come back, the others keep their grammar."""
    cfg, runner, hf = setup
    io = FakeIO()
    w, p = _decode_worker(cfg, runner, io), _prefill_worker(cfg, runner, io)
    bad = StructuredOutputs(regex="[a-z]{3}")
    fail_compiling(monkeypatch, w.grammar, bad, "compile blew up in decode")  # prefill's own book compiles it
    so = StructuredOutputs(regex=REGEX)
    _submit(cfg, runner, io, w, p, req("ok0", so, seed=1), req("bad", bad, seed=2), req("ok1", so, seed=3),
            free_text("free"))
    for _ in range(60):
        w.step()
        w.publish()
        w.admit()
        _prefill_for_decode(cfg, runner, io, w, p)
        if not w.sched.reqs:
            break
    _failed_as_constraint(io, "bad", "compile blew up in decode")
    texts = _texts(io, hf)
    for rid in ("ok0", "ok1"):
        text, reason = texts[rid]
        assert reason == "stop" and re.fullmatch(REGEX, text), (rid, text, reason)
    assert len(w.grammar) == 0 and w.sched.blocks.num_free == w.sched.blocks.num_blocks


def test_rapid_a_grammar_that_fails_in_both_workers_fails_in_prefill_alone_and_free_text_goes_on(
        setup: tuple[Any, ModelRunner, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A constraint that cannot compile in either worker (as one the server let through would): prefill
    fails it (PrefillFailed, its constraint's fault, never sampled unconstrained), decode frees its blocks
    and ends it so; an unconstrained request and a constrained one batched with it finish normally."""
    cfg, runner, hf = setup
    io = FakeIO()
    w, p = _decode_worker(cfg, runner, io), _prefill_worker(cfg, runner, io)
    bad = StructuredOutputs(regex="[a-z]{3}")
    for book in (w.grammar, p.grammar):
        fail_compiling(monkeypatch, book, bad, "compile blew up")
    so = StructuredOutputs(regex=REGEX)
    _submit(cfg, runner, io, w, p, req("ok", so, seed=1), req("bad", bad, seed=2), free_text("free"))
    w.publish()  # before any decode step: prefill failed it (PrefillFailed carries the fault to decode)
    assert "bad" not in w.sched.reqs and [(f.req_id, f.fault) for f in io.of("d2r", m.Finished)] == \
        [("bad", m.STRUCTURED_FAULT)]
    for _ in range(60):
        w.step()
        w.publish()
        w.admit()
        _prefill_for_decode(cfg, runner, io, w, p)
        if not w.sched.reqs:
            break
    _failed_as_constraint(io, "bad", "compile blew up")
    texts = _texts(io, hf)
    assert texts["ok"][1] == "stop" and re.fullmatch(REGEX, texts["ok"][0])
    assert texts["free"][1] == "length" and "bad" not in texts
    assert len(w.grammar) == 0 and len(p.grammar) == 0 and w.sched.blocks.num_free == w.sched.blocks.num_blocks
