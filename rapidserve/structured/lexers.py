"""A constraint's compiled grammar, in up to K independent compiles ("shards") that requests copy.

Why: every `deep_copy` of one llguidance matcher shares the original's lexer (its DFA cache) behind
one mutex, which each mask computation holds for its whole length. So the fill pool's threads fill the
rows of one constraint one after another: on the H100 host (12 fill threads, 152K vocabulary, 128
rows of one JSON schema) a step's fill took 11.0 ms with one compile and 4.1 ms with the requests
spread over 8 (bench/results/structured_host_overhead.md, "the lexer lock").

How: a constraint starts with the one compile the worker made (nothing extra for a one-off schema).
Once many requests have copied it (`per_shard` copies per shard made or under way), one more compile
of the same grammar is submitted to a pool of its own (one thread: these never delay the compile of a
grammar a request waits for), up to `limit` shards. Requests take the shards
round robin. A compile that fails stops the growth (the first compile succeeded, so this is the
engine's trouble, not the request's): the shards made so far keep serving.

Memory: each extra compile holds its own lexer cache, so the extra compiles of a worker's cached
constraints are bounded by one `ShardBudget` (a constraint grows only while the budget has room). A
constraint that leaves the grammar cache drops its extra compiles and gives them back (`release`; one
still compiling gives its share back when it ends, and is not kept); a dropped compile lives on only in
the copies of requests already running, until they end.

Invariants: `deep_copy` never blocks and never compiles on the caller's thread; `shards` only grows;
every shard is a compile of the same grammar, so every copy accepts and masks exactly the same tokens.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from rapidserve.structured.compiles import Pool

PER_SHARD = 16  # copies made per shard before one more is compiled


class ShardBudget:
    """How many extra compiles (beyond each constraint's first) one worker may hold at once."""

    def __init__(self, total: int) -> None:
        if total < 0:
            raise ValueError(f"total={total} must be >= 0")
        self.total, self.used = total, 0
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self.used >= self.total:
                return False
            self.used += 1
            return True

    def give(self, n: int = 1) -> None:
        with self._lock:
            self.used -= n
            assert self.used >= 0, "gave back more extra compiles than were taken"


class LexerShards:
    """The compiles of one constraint that its requests' matchers are copied from."""

    def __init__(self, first: Any, compile_one: Callable[[], Any] | None = None, pool: Pool | None = None,
                 limit: int = 1, per_shard: int = PER_SHARD, budget: ShardBudget | None = None) -> None:
        if limit < 1 or per_shard < 1:
            raise ValueError(f"limit={limit} and per_shard={per_shard} must be >= 1")
        self.shards: list[Any] = [first]
        self._compile_one, self._pool = compile_one, pool
        self.limit = limit if compile_one is not None and pool is not None else 1
        self.per_shard = per_shard
        self.copies = 0
        self._budget = budget
        self._pending = 0
        self._released = False
        self._lock = threading.Lock()

    def deep_copy(self) -> Any:
        """A fresh matcher of the constraint, from the next shard (round robin)."""
        n = self.copies
        self.copies = n + 1
        with self._lock:
            growing = len(self.shards) + self._pending
            grow = growing < self.limit and n + 1 >= self.per_shard * growing and not self._released \
                and (self._budget is None or self._budget.take())
            if grow:
                self._pending += 1
        if grow:
            assert self._pool is not None
            try:
                self._pool.submit(self._grow)
            except BaseException:  # noqa: BLE001 - no thread for it (e.g. none can start): growth stops
                self._grown_none()
        shards = self.shards
        return shards[n % len(shards)].deep_copy()

    def release(self) -> None:
        """The constraint left the cache: its extra compiles are dropped (requests still holding this
        object copy the first one from now on; their existing copies keep working and keep an extra
        compile alive only until they end) and go back to the budget (one still compiling gives its
        share back when it ends)."""
        with self._lock:
            if self._released:
                return
            self._released = True
            extra = len(self.shards) - 1
            self.shards = self.shards[:1]
        if self._budget is not None and extra:
            self._budget.give(extra)

    def _grown_none(self) -> None:
        """A compile asked for did not come: growth stops here, its share goes back."""
        with self._lock:
            self._pending -= 1
            self.limit = len(self.shards) + self._pending
        if self._budget is not None:
            self._budget.give()

    def _grow(self) -> None:
        assert self._compile_one is not None
        try:
            m = self._compile_one()
        except BaseException:  # noqa: BLE001 - growth stops; the shards made so far keep serving
            self._grown_none()
            return
        with self._lock:
            self._pending -= 1
            released = self._released
            if not released:
                self.shards = [*self.shards, m]  # a new list: a reader holding the old one stays consistent
        if released and self._budget is not None:
            self._budget.give()
