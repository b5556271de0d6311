"""Grammars compiled off the loop (rapidserve/structured/compiles.py), on CPU without a grammar engine:
table tests of each request's readiness (`prepare`, `compiling`, `template`, `forget`, `retain`) over a
pool the test runs by hand, then the real thread pool (daemon threads, on demand, cancellation), then
`GrammarBook` with llguidance: a prepared request's matcher is made without compiling on the caller's
thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest

from rapidserve.sampling_params import SamplingParams, StructuredOutputs
from rapidserve.structured import GrammarCache, GrammarError
from rapidserve.structured.compiles import POLL_S, CompilePool, Compiles


class ManualPool:
    """Submitted calls wait until the test runs them: `start` (running, not ended) then `finish`."""

    def __init__(self) -> None:
        self.queued: list[tuple[Future[Any], Callable[[], Any]]] = []
        self.started: list[tuple[Future[Any], Callable[[], Any]]] = []

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        f: Future[Any] = Future()
        self.queued.append((f, fn))
        return f

    def start(self) -> None:
        self.started += [(f, fn) for f, fn in self.queued if f.set_running_or_notify_cancel()]
        self.queued.clear()

    def finish(self) -> None:
        self.start()
        for f, fn in self.started:
            try:
                f.set_result(fn())
            except Exception as e:  # noqa: BLE001 - the request's error
                f.set_exception(e)
        self.started.clear()


class WaitedOnFuture(Future[Any]):
    """A Future that sets `waited` when someone asks for its outcome (`result` / `exception`)."""

    def __init__(self, waited: threading.Event) -> None:
        super().__init__()
        self.waited = waited

    def result(self, timeout: float | None = None) -> Any:
        self.waited.set()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self.waited.set()
        return super().exception(timeout)


class WaitedOnPool:
    """A CompilePool(1) whose futures say when someone waits on them (`waited`)."""

    def __init__(self) -> None:
        self.pool, self.waited = CompilePool(1), threading.Event()

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        f = WaitedOnFuture(self.waited)
        f.set_running_or_notify_cancel()

        def run() -> None:
            try:
                f.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - the compile's error, for the waiter
                f.set_exception(e)

        self.pool.submit(run)
        return f


def so(regex: str) -> StructuredOutputs:
    return StructuredOutputs(regex=regex)


def make_compiles() -> tuple[Compiles, ManualPool, list[str]]:
    made: list[str] = []

    def make(c: StructuredOutputs) -> str:
        assert c.regex is not None
        made.append(c.regex)
        if c.regex == "bad":
            raise RuntimeError("compile blew up")
        if c.regex == "refused":  # the grammar engine's verdict on the constraint
            raise GrammarError("regex", "cannot serve refused")
        return f"grammar of {c.regex}"

    pool = ManualPool()
    return Compiles(GrammarCache(make, capacity=4), pool), pool, made


# Each step: an operation, what `prepare` returns (None for other operations), then `compiling()`.
#   "prepare KEY REGEX" (REGEX "-": no constraint), "start" / "finish" (the pool's queued calls),
#   "forget KEY", "retain KEY,KEY".
READINESS = [
    ("no constraint: ready, nothing kept",
     [("prepare a -", True, "")], [], {}),
    ("a new constraint compiles in the background until its compile ends",
     [("prepare a x", False, "a"), ("start", None, "a"), ("finish", None, "")], ["x"], {"a": "grammar of x"}),
    ("a cached constraint is ready at once",
     [("prepare a x", False, "a"), ("finish", None, ""), ("prepare b x", True, "")], ["x"],
     {"a": "grammar of x", "b": "grammar of x"}),
    ("requests of one constraint share one compile",
     [("prepare a x", False, "a"), ("prepare b x", False, "a,b"), ("prepare c y", False, "a,b,c"),
      ("finish", None, "")], ["x", "y"], {"a": "grammar of x", "b": "grammar of x", "c": "grammar of y"}),
    ("a failed compile: ready, and its template raises the compile's error every time",
     [("prepare a bad", False, "a"), ("finish", None, "")], ["bad"], {"a": "!compile blew up"}),
    ("after a failure the next request of that constraint compiles again (errors are not cached)",
     [("prepare a bad", False, "a"), ("finish", None, ""), ("forget a", None, ""), ("prepare b bad", False, "b"),
      ("finish", None, "")], ["bad", "bad"], {"b": "!compile blew up"}),
    ("the grammar engine's verdict (GrammarError) is remembered: the next request of it is ready at once and fails",
     [("prepare a refused", False, "a"), ("finish", None, ""), ("forget a", None, ""),
      ("prepare b refused", True, "")], ["refused"], {"b": "!cannot serve refused"}),
    ("forgotten before its compile started: cancelled, never compiled",
     [("prepare a x", False, "a"), ("forget a", None, ""), ("finish", None, "")], [], {}),
    ("forgotten while compiling: the compile ends into the cache, nothing is kept",
     [("prepare a x", False, "a"), ("start", None, "a"), ("forget a", None, ""), ("finish", None, ""),
      ("prepare b x", True, "")], ["x"], {"b": "grammar of x"}),
    ("one of two sharers forgotten: the other still gets the compile",
     [("prepare a x", False, "a"), ("prepare b x", False, "a,b"), ("forget a", None, "b"), ("finish", None, "")],
     ["x"], {"b": "grammar of x"}),
    ("retain keeps only the known requests, compiling or not",
     [("prepare a x", False, "a"), ("finish", None, ""), ("prepare b y", False, "b"), ("prepare c z", False, "b,c"),
      ("retain a,c", None, "c"), ("finish", None, "")], ["x", "z"], {"a": "grammar of x", "c": "grammar of z"}),
    ("prepared again with its constraint: nothing new; with another: replaced",
     [("prepare a x", False, "a"), ("prepare a x", False, "a"), ("prepare a y", False, "a"), ("finish", None, "")],
     ["y"], {"a": "grammar of y"}),
    ("readiness only moves forward: prepared again once ready, still ready",
     [("prepare a x", False, "a"), ("finish", None, ""), ("prepare a x", True, "")], ["x"], {"a": "grammar of x"}),
]


@pytest.mark.parametrize("name,steps,made_want,templates", READINESS, ids=[c[0] for c in READINESS])
def test_readiness(name: str, steps: list[tuple[str, bool | None, str]], made_want: list[str],
                   templates: dict[str, str]) -> None:
    c, pool, made = make_compiles()
    for op, ready, compiling in steps:
        words = op.split()
        got = None
        if words[0] == "prepare":
            got = c.prepare(words[1], None if words[2] == "-" else so(words[2]))
        elif words[0] == "start":
            pool.start()
        elif words[0] == "finish":
            pool.finish()
        elif words[0] == "forget":
            c.forget(words[1])
        elif words[0] == "retain":
            c.retain(words[1].split(","))
        assert got == ready, op
        assert c.compiling() == frozenset(k for k in compiling.split(",") if k), op
        assert c.idle_wait(0.1) == (POLL_S if compiling else 0.1), op
    assert made == made_want
    assert len(c) == len(templates)  # what is kept: exactly the live requests
    for key, want in templates.items():
        regex = next(w.split()[2] for w, _, _ in reversed(steps) if w.startswith(f"prepare {key} "))
        for _ in range(2):
            if want.startswith("!"):
                with pytest.raises((RuntimeError, GrammarError), match=want[1:]):
                    c.template(key, so(regex))
            else:
                assert c.template(key, so(regex)) == want
    assert made == made_want  # asking for templates never compiled anything


def test_the_cache_remembers_failures_as_failures_never_as_a_grammar() -> None:
    """A GrammarError verdict is cached in the constraint's place (raised by get and compile, no second
    compile); `fail` turns a cached grammar into a failure (evicting it); other errors are not cached."""
    made: list[str] = []
    evicted: list[Any] = []

    def make(c: StructuredOutputs) -> str:
        assert c.regex is not None
        made.append(c.regex)
        if c.regex == "refused":
            raise GrammarError("regex", "cannot serve refused")
        if c.regex == "flaky":
            raise MemoryError("no room now")
        return f"grammar of {c.regex}"

    cache = GrammarCache(make, capacity=4, on_evict=evicted.append)
    for _ in range(2):
        with pytest.raises(GrammarError, match="cannot serve refused"):
            cache.compile(so("refused"))
        with pytest.raises(GrammarError, match="cannot serve refused"):
            cache.get(so("refused"))
    assert made == ["refused"] and so("refused") in cache
    for _ in range(2):
        with pytest.raises(MemoryError):
            cache.compile(so("flaky"))
    assert made == ["refused", "flaky", "flaky"] and so("flaky") not in cache  # compiled again each time
    assert cache.compile(so("x")) == "grammar of x" and cache.get(so("x")) == "grammar of x"
    cache.fail(so("x"), GrammarError("regex", "lexer broke on x"))
    assert evicted == ["grammar of x"]
    with pytest.raises(GrammarError, match="lexer broke on x"):
        cache.get(so("x"))
    with pytest.raises(GrammarError, match="lexer broke on x"):
        cache.compile(so("x"))
    c = Compiles(cache, ManualPool())
    assert c.prepare("k", so("x")) is True and c.compiling() == frozenset()  # ready at once: it fails
    with pytest.raises(GrammarError, match="lexer broke on x"):
        c.template("k", so("x"))
    assert made.count("x") == 1


def test_template_of_an_unprepared_request_compiles_in_place_and_an_early_one_waits() -> None:
    c, _, made = make_compiles()
    assert c.template("never-prepared", so("x")) == "grammar of x" and made == ["x"]  # in place, cached
    # The compile under way on the pool's thread ends only once `template` waits for it: forced, not timed.
    pool = WaitedOnPool()
    threads: list[str] = []

    def slow(s: StructuredOutputs) -> str:
        threads.append(threading.current_thread().name)
        assert pool.waited.wait(60), "nobody waited for the compile under way"
        return f"slow {s.regex}"

    real = Compiles(GrammarCache(slow), pool)
    assert not real.prepare("a", so("y")) and real.compiling() == {"a"}
    assert real.template("a", so("y")) == "slow y"  # waits for the compile under way (the LLM path)
    assert threads == ["grammar-compile"] and real.compiling() == frozenset()  # compiled once, not in place


def test_pool_runs_in_daemon_threads_on_demand_and_lets_idle_threads_end() -> None:
    pool = CompilePool(threads=2, idle_s=0.2)
    gate = threading.Event()
    names: list[str] = []

    def job(i: int) -> int:
        names.append(threading.current_thread().name)
        assert threading.current_thread().daemon
        assert gate.wait(60)
        return i

    futs = [pool.submit(lambda i=i: job(i)) for i in range(3)]
    assert pool.live == 2  # two threads started, no more
    deadline = time.monotonic() + 30
    while len(names) < 2:  # both threads took a job (and hold it until the gate opens)
        assert time.monotonic() < deadline, f"jobs started: {names}"
        time.sleep(0.001)
    assert futs[0].running() and futs[1].running() and not futs[2].running()
    assert futs[2].cancel()  # not started: cancelled, never runs
    gate.set()
    assert [f.result(30) for f in futs[:2]] == [0, 1] and len(names) == 2
    deadline = time.monotonic() + 30
    while pool.live and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pool.live == 0  # idle threads ended
    assert pool.submit(lambda: 7).result(5) == 7  # and start again on demand
    boom = pool.submit(lambda: (_ for _ in ()).throw(ValueError("bad grammar")))
    with pytest.raises(ValueError, match="bad grammar"):
        boom.result(5)


def test_book_prepares_in_the_background_and_fills_without_compiling_on_the_caller(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("llguidance")
    from rapidserve.loader import load_hf_tokenizer, resolve_model
    from rapidserve.structured import GrammarBook, GrammarRow

    hf = load_hf_tokenizer(resolve_model(None))
    book = GrammarBook(lambda: hf, 49152, (2, 0))
    real = book.cache._make
    threads: list[str] = []

    def make(c: StructuredOutputs) -> Any:
        threads.append(threading.current_thread().name)
        time.sleep(0.3)
        return real(c)

    monkeypatch.setattr(book.cache, "_make", make)
    p = SamplingParams(structured_outputs=so("[0-9]{3}"), max_tokens=8)
    assert book.prepare("r", p.structured_outputs) is False and book.compiling() == {"r"} and len(book) == 1
    deadline = time.monotonic() + 30
    while book.compiling() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert book.compiling() == frozenset() and threads == ["grammar-compile"]
    mask, failed = book.fill([GrammarRow(0, "r", p, [])], pin=False)
    assert not failed and set(mask.allowed(0, 49152)) and threads == ["grammar-compile"]  # nothing compiled here
    assert book.prepare("r2", p.structured_outputs) is True  # cached: ready at once
    book.retain(["r"], known=["r"])
    assert len(book) == 1  # r (its matcher and its compile state); r2 was not known
    book.release("r")
    assert len(book) == 0
