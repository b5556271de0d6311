"""Grammars compiled off the worker's loop: each request's compile runs on a few background threads.

A worker calls `prepare(key, constraint)` when it first learns of a request (NewRequest, KVReady),
and its schedulers leave out of any step that would need the request's mask every key in
`compiling()`, a cheap non-blocking query (a dict lookup per compile under way, nothing when none
is). Other requests keep stepping meanwhile: llguidance's compile runs in native code and releases
the GIL (measured: bench/results/grammar_compile_stall.md), so the loop loses only CPU time to it.

Invariants:
- A key is in `compiling()` from `prepare` until its compile has ended (with a grammar or an error),
  and then never again while it is kept: readiness only moves forward, so a request that has run once
  is never held back again. A constraint found in the cache is ready at once (no thread involved), and so
  is one the cache remembers as failed (its template raises that failure: never a grammar).
- Requests of the same constraint share one compile; its result lands in the `GrammarCache`, so
  later requests of that constraint hit the cache.
- `template(key, constraint)` never compiles on the caller's thread for a prepared key: it returns the
  compiled grammar, raises the compile's error (the same exception every time it is asked, so a
  request fails with the message it would have had compiling in place), or, if asked early, waits
  for the compile under way (a caller that does not hold requests back; every engine loop does now). An
  unprepared key compiles in place through the cache, as before.
- `forget(key)` / `retain(keys)` drop a key's state (its request ended); a compile no other kept key
  shares is cancelled if it has not started (one that has ends into the cache). Nothing else holds a
  future, so a dropped key leaks nothing.
- The threads are daemons, started on demand and ended after `idle_s` without work: a worker told to
  stop never waits for a compile.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, KeysView
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from rapidserve.sampling_params import StructuredOutputs
from rapidserve.structured.grammars import GrammarCache, GrammarError

POLL_S = 0.002  # an idle loop's sleep while a compile is under way (its end rings no doorbell)


class Pool(Protocol):
    def submit(self, fn: Callable[[], Any]) -> Future[Any]: ...


class CompilePool:
    """At most `threads` daemon threads running submitted calls in order; each ends after `idle_s`
    without work and is started again on demand."""

    def __init__(self, threads: int = 2, idle_s: float = 30.0, name: str = "grammar-compile") -> None:
        if threads < 1:
            raise ValueError(f"threads={threads} must be >= 1")
        self.threads, self.idle_s, self.name = threads, idle_s, name
        self._q: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.live = 0  # threads running now

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        f: Future[Any] = Future()
        self._q.put((f, fn))
        with self._lock:  # after the put: a thread ending now sees the item, or this starts another
            if self.live < self.threads:
                self.live += 1
                threading.Thread(target=self._run, name=self.name, daemon=True).start()
        return f

    def _run(self) -> None:
        while True:
            try:
                f, fn = self._q.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:
                    if self._q.empty():
                        self.live -= 1
                        return
                continue
            if not f.set_running_or_notify_cancel():  # cancelled before it started
                continue
            try:
                f.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - the request's error, reported by `template`
                f.set_exception(e)


@dataclass
class _Prep:
    so: StructuredOutputs
    future: Future[Any] | None  # the compile under way (shared by the keys of the same constraint)
    template: Any = None  # the compiled grammar, once the compile succeeded
    error: BaseException | None = None  # or why it failed


class Compiles:
    """The compiled grammar of each prepared request (by key), compiled through `cache` on `pool`."""

    def __init__(self, cache: GrammarCache, pool: Pool) -> None:
        self.cache, self.pool = cache, pool
        self._preps: dict[str, _Prep] = {}
        self._pending: dict[str, _Prep] = {}  # the keys whose compile is under way (or ended, not yet seen)
        self._running: dict[StructuredOutputs, Future[Any]] = {}  # one compile per constraint

    def __len__(self) -> int:
        return len(self._preps)

    def __contains__(self, key: object) -> bool:
        return key in self._preps

    def keys(self) -> KeysView[str]:
        """The prepared requests' keys."""
        return self._preps.keys()

    def prepare(self, key: str, so: StructuredOutputs | None) -> bool:
        """Start compiling `so` for request `key` unless it is cached or under way; whether it is ready
        now. No constraint, or `key` already prepared for `so`: nothing to do."""
        if so is None:
            return True
        p = self._preps.get(key)
        if p is not None and p.so == so:
            return key not in self._pending
        if p is not None:
            self.forget(key)
        try:
            hit = self.cache.get(so)
        except GrammarError as e:  # remembered as failed: ready at once, its template raises the error
            self._preps[key] = _Prep(so, None, error=e)
            return True
        if hit is not None:
            self._preps[key] = _Prep(so, None, template=hit)
            return True
        fut = self._running.get(so)
        if fut is None:
            fut = self._running[so] = self.pool.submit(lambda: self.cache.compile(so))
        self._preps[key] = self._pending[key] = _Prep(so, fut)
        return False

    def compiling(self) -> frozenset[str]:
        """The keys whose compile is still under way (non-blocking; empty at once when none is)."""
        if not self._pending:
            return frozenset()
        for key in [k for k, p in self._pending.items() if p.future is not None and p.future.done()]:
            self._settle(key)
        return frozenset(self._pending)

    def idle_wait(self, default: float) -> float:
        """How long an idle loop may sleep: `default`, or POLL_S while a compile is under way."""
        return POLL_S if self._pending else default

    def template(self, key: str, so: StructuredOutputs) -> Any:
        """The compiled grammar of `key` (see the module's invariants); raises the compile's error."""
        p = self._preps.get(key)
        if p is None or p.so != so:
            return self.cache.compile(so)  # not prepared (the tests, a constraint changed): in place
        if p.future is not None:
            p.future.exception()  # waits, only if the caller did not hold the request back
            self._settle(key)
        if p.error is not None:
            raise p.error.with_traceback(None)  # (its traceback would grow with every raise)
        return p.template

    def _settle(self, key: str) -> None:
        p = self._pending.pop(key)
        fut, p.future = p.future, None
        assert fut is not None and fut.done()
        if self._running.get(p.so) is fut:
            del self._running[p.so]
        err = fut.exception()  # a future is cancelled only once no kept key shares it: never here
        if err is None:
            p.template = fut.result()
        else:
            p.error = err

    def forget(self, key: str) -> None:
        """Drop `key`'s state; its compile is cancelled if not started and no other key shares it."""
        p = self._preps.pop(key, None)
        if p is None or self._pending.pop(key, None) is None or p.future is None:
            return
        if any(q.future is p.future for q in self._pending.values()):
            return
        p.future.cancel()  # False once started: it ends into the cache
        if self._running.get(p.so) is p.future:
            del self._running[p.so]

    def retain(self, keys: Iterable[str]) -> None:
        """Drop the state of every key not in `keys` (their requests ended)."""
        if self._preps:
            keep = set(keys)
            for k in [k for k in self._preps if k not in keep]:
                self.forget(k)
