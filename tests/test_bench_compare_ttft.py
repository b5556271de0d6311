"""bench/compare.py --search-ttft-rate: the frontier report's TTFT table (bench/compare_ttft.py)."""

from __future__ import annotations

from typing import Any

from tests.test_bench_compare import _load

ttft = _load("compare_ttft")
frontier = _load("compare_frontier")


def summary(p50: float, p99: float = 900.0, itl: float = 45.0, tput: float = 6.2) -> dict[str, Any]:
    return {"ttft_ms": {"median": p50, "p99": p99}, "itl_ms": {"p99": itl}, "request_throughput": tput}


def search(label: str, rate: float | None, probes: list[tuple[float, dict[str, Any]]]) -> dict[str, Any]:
    return {"label": label, "title": "w", "workload": {}, "path": None, "finished": True, "stopped": None,
            "search": {"settings": {"itl_bounds_ms": [50.0], "shares": [0.9], "ttft_rate": rate}},
            "goodput": [{"itl_bound_ms": 50.0, "share": 0.9, "goodput": 5.0, "lo": 5.0, "hi": 5.2,
                         "status": "converged"}],
            "probes": [{"rate": r, "summary": s, **({"ttft_probe": True} if k == len(probes) - 1 else {})}
                       for k, (r, s) in enumerate(probes)]}


META = {"model": "m", "workloads": [], "systems": [
    {"label": "duet", "kind": "rapidserve", "flags": "", "status": "ok"},
    {"label": "vllm", "kind": "vllm", "flags": "", "status": "ok"},
    {"label": "vllm:--max-num-batched-tokens 1024", "kind": "vllm", "flags": "", "status": "ok"}]}


def test_each_systems_ttft_at_the_one_rate_over_vllm_defaults() -> None:
    duet = search("duet", 6.37, [(5.0, summary(100.0)), (6.37, summary(180.0, itl=44.0))])
    vllm = search("vllm", 6.37, [(6.37, summary(400.0, itl=120.0)), (8.0, summary(900.0)), (6.37, summary(200.0))])
    other = search("vllm:--max-num-batched-tokens 1024", 6.37, [(6.37, summary(250.0))])
    none = search("x", None, [(6.37, summary(1.0))])  # no --search-ttft-rate: no row
    assert ttft.ttft_row(none) is None and ttft.ttft_row(search("y", 3.0, [(6.37, summary(1.0))])) is None
    lines = ttft.ttft_lines([duet, vllm, other, none], {"vllm", "vllm:--max-num-batched-tokens 1024"})
    assert "TTFT at 6.37 req/s" in lines[1] and "over `vllm`'s TTFT p50" in lines[1]
    assert lines[5:] == ["| duet | 6.37 | 180 | 900 | 44 | 6.2 | 0.90x |",
                         "| vllm | 6.37 | 200 | 900 | 45 | 6.2 | 1.00x |",  # its latest probe at the rate
                         "| vllm:--max-num-batched-tokens 1024 | 6.37 | 250 | 900 | 45 | 6.2 | 1.25x |"]
    assert ttft.ttft_lines([none], set()) == []
    md = frontier.frontier_markdown([frontier.frontier_record(x) for x in (duet, vllm)], META)
    assert md.rstrip().endswith("| vllm | 6.37 | 200 | 900 | 45 | 6.2 | 1.00x |")
    assert frontier.frontier_record(duet)["probes"][-1]["ttft_probe"] is True
    assert "ttft_probe" not in frontier.frontier_record(duet)["probes"][0]


def test_a_repeated_search_gives_the_median_of_its_repetitions() -> None:
    reps = [search("duet", 6.37, [(6.37, summary(p))]) for p in (100.0, 300.0, 200.0)]
    f = {"label": "duet", "title": "w", "repeats": reps}
    row = ttft.ttft_row(f)
    assert row is not None and row["ttft_p50_ms"] == 200.0 and row["n"] == 3
    (line,) = [x for x in ttft.ttft_lines([f], set()) if x.startswith("| duet")]
    assert line == "| duet (median of 3) | 6.37 | 200 | 900 | 45 | 6.2 | - |"  # no vLLM: no ratio


def test_the_ttft_probe_is_not_counted_among_the_searchs_probes() -> None:
    """It is no goodput probe: the search's notes (probes above its peak, their backlog, short or capped probes) leave
    it out."""
    from rapidserve.benchmark.goodput_report import above_peak, ramp_counts

    f = {"label": "duet", "search": {"peak_request_throughput": 8.0, "max_rate": 12.0, "ceiling": "max_rate"},
         "probes": [{"rate": 10.0, "above_peak": True, "arrivals": 176, "backlog": {"grew": False},
                     "ramp": {"verdict": "ok"}},
                    {"rate": 11.0, "above_peak": True, "arrivals": 176, "backlog": {"grew": True}, "ttft_probe": True,
                     "ramp": {"verdict": "short"}}]}
    assert [p["rate"] for p in above_peak(f)] == [10.0] and ramp_counts(f) == (0, 0, 0)
    assert frontier.ceiling_note(f).endswith("1 probe(s) above it (176 arrivals each), backlog grew in 0")
