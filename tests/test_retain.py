"""`sampling_step.retain` (what publish frees each step): it reads the running batch only when something is held."""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from types import SimpleNamespace

from rapidserve.engine.sampling_step import retain
from rapidserve.logit_controls import TokenHistory, TokenState


def test_retain_reads_the_running_batch_only_when_a_slot_or_matcher_is_held() -> None:
    runner = SimpleNamespace(tokens=TokenState("cpu"))
    read: list[str] = []

    def running() -> Iterator[tuple[str, Hashable]]:
        for rid in ("a",):
            read.append(rid)
            yield rid, (rid, 0)

    retain(runner, None, running())  # type: ignore[arg-type]
    assert read == []  # nothing held: the generator over the batch is never run
    for rid in ("a", "b"):
        runner.tokens.slot(TokenHistory((rid, 0), [1, 2], []), 8)
    retain(runner, None, running())  # type: ignore[arg-type]
    assert read == ["a"] and runner.tokens.in_use == 1  # b's slot freed, a's kept
