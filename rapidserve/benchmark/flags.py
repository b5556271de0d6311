"""Value parsers for the bench flags (argparse types and actions: a clear error saying what is allowed): numbers
and lists of them, request rates, trace time scales, token-id ranges, base URLs, --goodput SLOs and --extra-body's
JSON object.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from typing import Any

from rapidserve.benchmark.arrivals import parse_rates
from rapidserve.benchmark.stats import parse_slos
from rapidserve.jsonfile import DuplicateKeyError, loads_unique
from rapidserve.redaction import redact_text


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


def rates_arg(text: str) -> tuple[float, ...]:
    try:
        return parse_rates(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def time_scales_arg(text: str) -> tuple[float, ...]:
    """'1,2,4' -> (1.0, 2.0, 4.0): positive finite time scales, each at most once."""
    allowed = ("a comma-separated list of positive numbers (2 = twice as fast: the trace's inter-arrival "
               "times divided by 2), e.g. 1,2,4")
    out: list[float] = []
    for p in text.split(","):
        try:
            v = float(p)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{p.strip()!r} in {text!r} is not a number: expected {allowed}") from None
        if not (math.isfinite(v) and v > 0):
            raise argparse.ArgumentTypeError(f"{p.strip()!r} in {text!r} is not a positive finite number: "
                                             f"expected {allowed}")
        if v in out:
            raise argparse.ArgumentTypeError(f"{p.strip()!r} appears twice in {text!r}")
        out.append(v)
    return tuple(out)


def token_range_arg(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
    if not m or int(m.group(1)) >= int(m.group(2)):
        raise argparse.ArgumentTypeError(f"{text!r} is not LO:HI with integers 0 <= LO < HI (token ids are drawn "
                                         "from [LO, HI)), e.g. 1000:20000")
    return int(m.group(1)), int(m.group(2))


def base_url_arg(text: str) -> str:
    if not re.fullmatch(r"https?://[^\s/]+(/\S*)?", text):
        raise argparse.ArgumentTypeError(f"{redact_text(text)!r} is not an http:// or https:// URL, e.g. http://127.0.0.1:8000")
    return text.rstrip("/")


class SlosAction(argparse.Action):
    """--goodput ttft:MS tpot:MS ...: parsed into {metric: ms} or an argparse error saying what is allowed."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        try:
            setattr(namespace, self.dest, parse_slos(values))
        except ValueError as e:
            parser.error(f"argument {option_string}: {e}")


def extra_body_arg(v: str) -> dict[str, Any]:
    """--extra-body: a JSON object, given inline or as @path."""
    text = v
    if v.startswith("@"):
        try:
            with open(v[1:], encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise argparse.ArgumentTypeError(f"cannot read {v[1:]}: {e}") from None
    try:
        d = loads_unique(text, f"--extra-body {v[1:]}" if v.startswith("@") else "--extra-body")
    except DuplicateKeyError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(d, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"guided_json\": {...}}'")
    return d
