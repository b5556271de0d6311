"""Number and list parsers for the bench flags (argparse types: a clear error saying what is allowed)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any


def _number(kind: type, lo: float, lo_open: bool = False) -> Callable[[str], Any]:
    word = "an integer" if kind is int else "a number"

    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {word}") from None
        if not math.isfinite(v) or v < lo or (lo_open and v == lo):
            raise argparse.ArgumentTypeError(f"{text} must be {word} {'>' if lo_open else '>='} {lo:g}")
        return v

    return parse


positive_int = _number(int, 1)
nonneg_int = _number(int, 0)
positive_float = _number(float, 0.0, lo_open=True)
nonneg_float = _number(float, 0.0)


def _number_list(item: Callable[[str], Any], example: str) -> Callable[[str], tuple[float, ...]]:
    def parse(text: str) -> tuple[float, ...]:
        out: list[float] = []
        for part in text.split(","):
            try:
                v = item(part.strip())
            except argparse.ArgumentTypeError as e:
                raise argparse.ArgumentTypeError(f"{e} (in {text!r}: expected e.g. {example})") from None
            if v in out:
                raise argparse.ArgumentTypeError(f"{part.strip()!r} appears twice in {text!r}")
            out.append(v)
        return tuple(sorted(out))

    return parse


def _share(text: str) -> float:
    v = positive_float(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"{text} is not a share in (0, 1]")
    return float(v)


def factor_arg(text: str) -> float:
    """A factor >= 1 (--search-above-peak-factor)."""
    return float(_number(float, 1.0)(text))


bounds_arg = _number_list(positive_float, "25,50,100,200")
shares_arg = _number_list(_share, "0.9,0.99")


UNBOUNDED_WORDS = ("unbounded", "none")  # a bound list's word for no ITL bound (the TTFT rule alone)


def only_bounds_arg(text: str) -> tuple[float | None, ...]:
    """--search-only-bounds: ms bounds and/or `unbounded` (or `none`), comma-separated; unbounded first, then the
    bounds from the smallest up."""
    words = [part.strip() for part in text.split(",")]
    free = [w for w in words if w.lower() in UNBOUNDED_WORDS]
    if len(free) > 1:
        raise argparse.ArgumentTypeError(f"unbounded appears twice in {text!r}")
    rest = ",".join(w for w in words if w.lower() not in UNBOUNDED_WORDS)
    try:
        bounds = bounds_arg(rest) if rest or not free else ()
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e}; each is a bound in ms or unbounded") from None
    return (*([None] if free else []), *bounds)
