"""bench/compare.py's flag value parsers: each turns one flag's text into its value or refuses it with an
argparse error naming what is allowed (the workload shorthand IN:OUT, ITL bounds, port, report stem and folder,
quoted flag strings, search repeats, report paths, peak fractions). bench/compare_args.py builds the parser."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from collections.abc import Callable
from typing import TypeVar

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compare_peak import fractions_arg  # noqa: E402
from compare_prior import paths_arg  # noqa: E402

from rapidserve.benchmark.flags import nonneg_int, positive_float  # noqa: E402
from rapidserve.benchmark.workloads import WORKLOADS  # noqa: E402

T = TypeVar("T")

_IN_OUT = re.compile(r"\s*([0-9]+)\s*:\s*([0-9]+)\s*")  # ASCII digits only (str.isdigit takes '²' and '٤')


def parse_workload(text: str) -> list[str]:
    """'4096:64' (fixed input:output) or a `rapidserve bench --workload` name, as bench flags."""
    t = text.strip()
    if t in WORKLOADS:
        return ["--workload", t]
    m = _IN_OUT.fullmatch(t)
    if m and all(int(g) > 0 for g in m.groups()):
        return ["--workload", "fixed", "--input-len", str(int(m.group(1))), "--output-len", str(int(m.group(2)))]
    raise argparse.ArgumentTypeError(f"{text!r} is not IN:OUT (positive token counts, e.g. 4096:64) or one of "
                                     f"{', '.join(WORKLOADS)} (or give its flags with --workload-args)")


def workloads_arg(text: str) -> list[list[str]]:
    """--workloads: comma-separated IN:OUT or workload names, none empty (a stray comma, or an empty value that
    would silently run the default workloads, is refused)."""
    parts = text.split(",")
    if not text.strip() or any(not x.strip() for x in parts):
        raise argparse.ArgumentTypeError(f"{text!r} has an empty item: give comma-separated IN:OUT (e.g. 4096:64) or "
                                         f"workload names ({', '.join(WORKLOADS)}); leave the flag out for the "
                                         "defaults, or give only --workload-args")
    return [parse_workload(x) for x in parts]


def itl_bounds_arg(text: str) -> list[float]:
    """--itl-bounds-ms: comma-separated positive bounds in ms, each once, in the order given."""
    out: list[float] = []
    for part in text.split(","):
        try:
            v = float(positive_float(part.strip()))
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{e} (in {text!r}: expected positive bounds in ms, e.g. 100,50)") \
                from None
        if v in out:
            raise argparse.ArgumentTypeError(f"{part.strip()!r} appears twice in {text!r}: give each bound once")
        out.append(v)
    return out


def port_arg(text: str) -> int:
    """--port: 0 (a free one) or a TCP port, 1-65535."""
    v = int(nonneg_int(text))
    if v > 65535:
        raise argparse.ArgumentTypeError(f"{v} is not a TCP port: give 1-65535, or 0 for a free one")
    return v


def stem_arg(text: str) -> str:
    """--name: the reports' file stem (<out>/<name>.json ...): not empty, no folder in it."""
    if not text.strip() or text in (".", "..") or "/" in text or os.sep in text or "\0" in text:
        raise argparse.ArgumentTypeError(f"{text!r} is not a file name stem: give a name without '/' (the files "
                                         "go in --out), e.g. compare")
    return text


def folder_arg(text: str) -> str:
    """--out: a folder path, not empty."""
    if not text.strip():
        raise argparse.ArgumentTypeError("'' is not a folder: give the folder the reports go in, e.g. bench/results")
    return text


def flags_arg(text: str) -> str:
    """A flag string (--serve-args, --bench-args, --workload-args) that the shell would split: unbalanced quotes are
    refused here, naming the flag (not its text: it may hold an --api-key)."""
    try:
        shlex.split(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e} (the flags are split as the shell splits them)") from None
    return text


def workload_flags_arg(text: str) -> str:
    """--workload-args: one workload's `rapidserve bench` flags, not empty."""
    if not shlex.split(flags_arg(text)):
        raise argparse.ArgumentTypeError("no flags: give a workload's `rapidserve bench` flags, e.g. '--workload "
                                         "multiturn --num-turns 6'")
    return text


def _said(parse: Callable[[str], T]) -> Callable[[str], T]:
    """`parse` as a flag type whose ValueError message argparse shows (it hides a plain ValueError's text)."""
    def flag(text: str) -> T:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return flag


start_from_arg = _said(paths_arg)  # --search-start-from's report paths (read later, by compare.py: load_hints)
fractions_flag = _said(fractions_arg)  # --peak-fractions


def repeats_arg(text: str) -> int:
    """--search-repeats' N: an integer >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer: give how many times each search runs, "
                                         ">= 1") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: give how many times each search runs, an integer >= 1 (1: once)")
    return n
