"""Progress bars of `rapidserve bench`: one tqdm bar per run (a rate of a sweep, the warm-up, a probe of the goodput
search), counting finished requests (a multi-turn run: turns), on stderr as vLLM's `bench serve` draws its own.

`request_bar(enabled, total, desc)` returns a bar, or a stand-in that does nothing when bars are off (`--quiet`,
`--disable-tqdm`, or an in-process caller such as bench/compare.py that leaves `BenchConfig.progress` False).
"""

from __future__ import annotations

from typing import Protocol


class Bar(Protocol):
    def update(self, n: int = 1) -> object: ...

    def close(self) -> None: ...


class NoBar:
    """A bar that draws nothing."""

    def update(self, n: int = 1) -> object:
        return None

    def close(self) -> None:
        return None


def request_bar(enabled: bool, total: int, desc: str) -> Bar:
    """A bar of `total` requests labelled `desc` (tqdm, on stderr), or NoBar when not enabled."""
    if not enabled:
        return NoBar()
    from tqdm import tqdm

    bar: Bar = tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True, leave=True)
    return bar
