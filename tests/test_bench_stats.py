"""rapidserve.benchmark.stats: percentiles, ITL splitting, TPOT, goodput and run summaries."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from rapidserve.benchmark.stats import (
    RequestRecord,
    chunk_itls,
    describe_ms,
    meets_rapid_ttft,
    meets_slos,
    parse_slos,
    percentile,
    reconcile_chunk_tokens,
    run_duration,
    summarize,
    top_errors,
    tpot,
)


@pytest.mark.parametrize("xs", [[1.0], [3.0, 1.0], [5.0, 1.0, 4.0, 2.0, 3.0],
                                list(np.random.default_rng(0).random(101)),
                                list(np.random.default_rng(1).exponential(size=37))])
@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
def test_percentile_matches_numpy(xs: list[float], q: float) -> None:
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_percentile_edges() -> None:
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_describe_ms() -> None:
    d = describe_ms([0.001, 0.002, 0.003, 0.004, math.nan])
    assert d["mean"] == pytest.approx(2.5) and d["median"] == pytest.approx(2.5)
    assert d["p90"] == pytest.approx(3.7) and d["p99"] == pytest.approx(3.97)
    assert describe_ms([]) == {"mean": None, "median": None, "p90": None, "p99": None}


@pytest.mark.parametrize("e2e,ttft,n,want", [
    (1.0, 0.1, 10, 0.1), (0.5, 0.5, 2, 0.0), (1.0, 0.2, 1, math.nan), (1.0, 0.2, 0, math.nan),
    (math.nan, 0.2, 5, math.nan),
])
def test_tpot(e2e: float, ttft: float, n: int, want: float) -> None:
    got = tpot(e2e, ttft, n)
    assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want)


@pytest.mark.parametrize("counts,total,want", [
    ([1, 1, 1], 3, [1, 1, 1]),  # one token per chunk: nothing to fix
    ([1, 1, 1], None, [1, 1, 1]),  # no usage: keep
    ([1, 1, 1], 7, [1, 3, 3]),  # 4 uncounted tokens over the 2 chunks after the first
    ([1, 1, 1, 1], 6, [1, 2, 2, 1]),  # uneven surplus: earlier chunks first
    ([1], 4, [4]),  # a single chunk takes it all
    ([2, 3], 5, [2, 3]),  # counts from token_ids, consistent
    ([1, 1, 1], 2, [1, 1, 1]),  # usage says fewer: keep what was seen
    ([], 5, []),
])
def test_reconcile_chunk_tokens(counts: list[int], total: int | None, want: list[int]) -> None:
    assert reconcile_chunk_tokens(counts, total) == want


@pytest.mark.parametrize("times,counts,want", [
    ([0.0], [1], []),
    ([0.0, 0.1, 0.3], [1, 1, 1], [0.1, 0.2]),
    ([0.0, 0.1, 0.4], [5, 1, 3], [0.1, 0.1, 0.1, 0.1]),  # first chunk's extra tokens have no ITL
    ([1.0, 1.2], [1, 4], [0.05] * 4),
])
def test_chunk_itls(times: list[float], counts: list[int], want: list[float]) -> None:
    assert chunk_itls(times, counts) == pytest.approx(want)


def test_chunk_itls_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        chunk_itls([0.0, 1.0], [1])
    with pytest.raises(ValueError):
        chunk_itls([0.0, 1.0], [1, 0])


@pytest.mark.parametrize("items,want", [
    ([], {}), (["ttft:500"], {"ttft": 500.0}), (["ttft:500", "tpot:50", "itl:100", "e2el:3000.5"],
                                                {"ttft": 500.0, "tpot": 50.0, "itl": 100.0, "e2el": 3000.5}),
])
def test_parse_slos(items: list[str], want: dict[str, float]) -> None:
    assert parse_slos(items) == want


@pytest.mark.parametrize("items,needle", [
    (["ttft"], "METRIC:MS"), (["foo:1"], "ttft, tpot, itl, e2el"), (["ttft:abc"], "not a number"),
    (["ttft:-1"], "positive"), (["ttft:0"], "positive"), (["ttft:inf"], "positive"), (["ttft:1", "ttft:2"], "twice"),
])
def test_parse_slos_errors(items: list[str], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        parse_slos(items)


def rec(i: int = 0, ok: bool = True, prompt: int = 1000, out: int = 5, ttft: float = 0.1, e2e: float = 0.5,
        itl: list[float] | None = None, start: float = 0.0, error: str = "") -> RequestRecord:
    return RequestRecord(i, prompt, 5, start_s=start, scheduled_s=start, success=ok, error=error, output_tokens=out,
                         ttft_s=ttft if ok else math.nan, e2e_s=e2e,
                         itl_s=itl if itl is not None else [0.1, 0.1, 0.1, 0.1])


@pytest.mark.parametrize("r,slos,want", [
    (rec(), {}, True),
    (rec(), {"ttft": 100}, True),  # bounds are inclusive
    (rec(ttft=0.1001), {"ttft": 100}, False),
    (rec(), {"tpot": 100}, True),  # (0.5 - 0.1) / 4 = 0.1
    (rec(e2e=0.6), {"tpot": 100}, False),
    (rec(itl=[0.01, 0.2, 0.01]), {"itl": 150}, False),  # itl: the request's largest gap
    (rec(itl=[0.01, 0.14, 0.01]), {"itl": 150}, True),
    (rec(), {"e2el": 499}, False),
    (rec(out=1, itl=[]), {"tpot": 1, "itl": 1}, True),  # one token: no TPOT, no ITL
    (rec(ok=False, error="x"), {}, False),
])
def test_meets_slos(r: RequestRecord, slos: dict[str, float], want: bool) -> None:
    assert meets_slos(r, slos) is want


@pytest.mark.parametrize("prompt,ttft,ok,want", [
    (1000, 1.0, True, True), (1000, 1.01, True, False), (4096, 4.0, True, True), (32, 0.033, True, False),
    (32, 0.03, True, True), (1000, 0.1, False, False),
])
def test_rapid_ttft_rule(prompt: int, ttft: float, ok: bool, want: bool) -> None:
    assert meets_rapid_ttft(rec(prompt=prompt, ttft=ttft, ok=ok)) is want


def test_summarize() -> None:
    records = [
        rec(0, start=0.0, ttft=0.1, e2e=0.5),
        rec(1, start=1.0, ttft=0.3, e2e=1.0, itl=[0.2, 0.1, 0.2, 0.2]),  # ends at 2.0
        rec(2, start=0.5, out=4, ttft=0.1, e2e=0.4, itl=[0.1, 0.1, 0.1]),  # short output
        rec(3, ok=False, start=0.2, e2e=0.01, error="HTTP 503: busy", itl=[]),
    ]
    s = summarize(records, {"ttft": 200, "itl": 150})
    assert s["completed"] == 3 and s["failed"] == 1 and s["duration_s"] == pytest.approx(2.0)
    assert s["total_input_tokens"] == 3000 and s["total_output_tokens"] == 14
    assert s["request_throughput"] == pytest.approx(1.5) and s["output_throughput"] == pytest.approx(7.0)
    assert s["total_token_throughput"] == pytest.approx(1507.0)
    assert s["goodput"] == pytest.approx(1.0)  # records 0 and 2
    assert s["goodput_rapid_ttft"] == pytest.approx(1.5)  # 1000-token prompts: TTFT <= 1 s
    assert s["output_len_mismatches"] == 1 and s["errors"] == {"HTTP 503: busy": 1}
    assert s["ttft_ms"]["median"] == pytest.approx(100.0) and s["ttft_ms"]["p99"] >= s["ttft_ms"]["median"]
    assert s["itl_ms"]["mean"] == pytest.approx(1e3 * 1.4 / 11)
    assert s["tpot_ms"]["median"] == pytest.approx(100.0)
    assert summarize(records)["goodput"] is None
    empty = summarize([])
    assert empty["completed"] == 0 and empty["request_throughput"] == 0.0 and empty["ttft_ms"]["p99"] is None


def test_run_duration_and_top_errors() -> None:
    assert run_duration([]) == 0.0
    assert run_duration([rec(start=1.0, e2e=0.5), rec(start=2.0, e2e=0.25)]) == pytest.approx(1.25)
    c = Counter({f"e{i}": 20 - i for i in range(12)})
    top = top_errors(c, 10)
    assert len(top) == 11 and top["e0"] == 20 and top["(2 other error texts)"] == 10 + 9


def test_record_json_roundtrip() -> None:
    r = rec(ok=False, error="boom", itl=[])
    d = r.to_json()
    assert d["ttft_s"] is None and d["tpot_s"] is None and d["error"] == "boom"
    back = RequestRecord.from_json(d)
    assert math.isnan(back.ttft_s) and back.error == "boom" and back.e2e_s == pytest.approx(0.5)
