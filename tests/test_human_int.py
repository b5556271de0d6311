"""vLLM 0.26's human-readable integers (rapidserve/human_int.py), table-tested against the values vLLM's
`human_readable_int` / `human_readable_int_or_auto` give, and the flags that take them (--max-model-len,
--max-num-batched-tokens): parsed to the same numbers, still positive-only, a bad value a usage error naming the
flag."""

from __future__ import annotations

import argparse

import pytest

from rapidserve.cli import build_parser
from rapidserve.human_int import AUTO, human_readable_int, human_readable_int_or_auto

# (text, vLLM 0.26's value)
VALUES = [
    ("1", 1), ("8192", 8192), (" 8192 ", 8192), ("0", 0), ("-5", -5), ("1_000", 1000),  # int()'s own forms
    ("1k", 1000), ("1K", 1024), ("25.6k", 25600), ("32k", 32000), ("32K", 32768), ("128K", 131072),
    ("1m", 10**6), ("1M", 2**20), ("2g", 2 * 10**9), ("2G", 2 * 2**30), ("1t", 10**12), ("1T", 2**40),
    ("0.5k", 500), ("1.5m", 1_500_000), ("0.0001k", 0),  # decimal suffixes: int(float(n) * mult), truncated
    ("1.005k", 1004),  # as vLLM: 1.005 * 1000 is 1004.999... in floating point, truncated
    (" 8k ", 8000),
]


@pytest.mark.parametrize("text,want", VALUES)
def test_values_as_vllm(text: str, want: int) -> None:
    assert human_readable_int(text) == want
    assert human_readable_int_or_auto(text) == want


@pytest.mark.parametrize("text,needle", [
    ("1.5K", "Decimals are not allowed with binary suffixes like K. Did you mean to use 1.5k instead?"),
    ("0.5G", "Did you mean to use 0.5g instead?"),
    ("8kb", "'8kb' is not an integer"), ("8 k", "'8 k' is not an integer"), ("k", "'k' is not an integer"),
    ("1e3", "'1e3' is not an integer"), ("", "'' is not an integer"), ("auto", "'auto' is not an integer"),
    ("-1k", "'-1k' is not an integer"), ("1.5", "'1.5' is not an integer"),
])
def test_refused_as_vllm(text: str, needle: str) -> None:
    with pytest.raises(ValueError) as e:
        human_readable_int(text)
    assert needle in str(e.value)


@pytest.mark.parametrize("text", ["auto", "AUTO", "Auto", " auto ", "-1", " -1"])
def test_or_auto(text: str) -> None:
    assert human_readable_int_or_auto(text) == AUTO == -1


def test_or_auto_passes_the_rest_on() -> None:
    assert human_readable_int_or_auto("-2") == -2  # the flag's bounds refuse it, not the parser (as vLLM)
    with pytest.raises(ValueError, match="Did you mean to use 2.5k instead"):
        human_readable_int_or_auto("2.5K")


def parse(*args: str) -> argparse.Namespace:
    return build_parser().parse_args(["generate", "--prompt", "x", *args])


@pytest.mark.parametrize("flag,dest", [("--max-model-len", "max_model_len"),
                                       ("--max-num-batched-tokens", "max_num_batched_tokens")])
@pytest.mark.parametrize("text,want", [("2048", 2048), ("2k", 2000), ("2K", 2048), ("25.6k", 25600), ("1M", 2**20)])
def test_flags_take_them(flag: str, dest: str, text: str, want: int) -> None:
    assert getattr(parse(flag, text), dest) == want
    assert getattr(parse(f"{flag}={text}"), dest) == want
    assert getattr(build_parser().parse_args(["serve", flag, text]), dest) == want


@pytest.mark.parametrize("flag", ["--max-model-len", "--max-num-batched-tokens"])
@pytest.mark.parametrize("text,needle", [
    ("1.5K", "Did you mean to use 1.5k instead?"),
    ("0", "0 must be an integer >= 1"),
    ("0.0001k", "'0.0001k' (0) must be an integer >= 1"),
    ("-3", "-3 must be an integer >= 1"),
    ("lots", "'lots' is not an integer (e.g. 8192, 8k (8000), 8K (8192)"),
])
def test_flags_refuse_by_name(flag: str, text: str, needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse(flag, text)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err and needle in err
