"""The ramp rule's traces in what a goodput search writes and takes (rapidserve/benchmark/sustain.py): each probe's
warm-up and verdict in the report, the JSON and bench/compare.py's frontier table, and the
--search-max-probe-arrivals flag (bench and compare.py)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from rapidserve.benchmark import sustain
from rapidserve.benchmark.goodput import CONVERGED
from rapidserve.benchmark.goodput_report import (
    RAMP_COLUMN,
    RAMP_LEGEND,
    TRACE_CAP,
    cap_name,
    has_ramp,
    ramp_cell,
    ramp_counts,
    search_block,
    search_line,
    search_markdown,
    write_search_outputs,
)
from rapidserve.benchmark.search_config import SearchConfig
from rapidserve.benchmark.sustain import RERUN, Ramp, plan_probe
from rapidserve.cli import build_parser, main
from tests.test_bench_compare import _load

compare = _load()
frontier = _load("compare_frontier")

P10 = plan_probe(10.0, 64, 16, None, 1024)  # no lifetime known: the discard alone
FIRST = Ramp(P10, 6.0, 47, 17, RERUN)  # lived 6 s: 47 of its 64 came before, fewer than 32 left: short, re-run
REDO = Ramp(sustain.rerun_plan(FIRST, 16), 6.1, 1, 63)  # 75 + 64 sent: steady
AT20 = Ramp(plan_probe(20.0, 64, 16, 6.1, 1024), 6.4, 3, 61)
CAPPED = Ramp(plan_probe(40.0, 64, 16, 6.4, 300), 9.0, 64, 0, "")


def result(ramps: list[tuple[float, Ramp | None]], trace: bool = False) -> dict[str, Any]:
    """A search result as run_goodput_search writes it: 80 arrivals a probe, 16 discarded, a probe per (rate, ramp)."""
    probes = []
    for i, (rate, ramp) in enumerate(ramps):
        att = 0.0 if ramp is not None and ramp.short else 1.0
        probes.append({"rate": rate, "order": i + 1, "counted": ramp.counted if ramp else 64,
                       "attainment": {"unbounded": att, "50": att},
                       "summary": {"ttft_ms": {"p99": 300.0}, "itl_ms": {"p99": 40.0}, "failed": 0},
                       **({"ramp": ramp.to_json()} if ramp is not None else {})})
    return {"kind": "goodput_search", "label": "duet@50", "base_url": "http://h:1", "model": "m",
            "workload": {"name": "fixed", "input_len": 1024, "output_len": 256}, "created": "now",
            **({"trace": {"name": "t"}} if trace else {}),
            "search": {"settings": {"itl_bounds_ms": [50.0], "shares": [0.9], "start_fraction": 0.5,
                                    "tolerance": 0.05, "max_probes": 12, "discard": 16, "max_probe_arrivals": 300},
                       "start_rate": 10.0, "min_rate": 2.5, "max_rate": 40.0, "probe_requests": 80,
                       "peak_request_throughput": 40.0, "ceiling": "own_peak", "shared_peak": None,
                       "peak_lifetime_s": None, "max_probe_arrivals": 300},
            "probes": probes, "peak": None,
            "goodput": [{"itl_bound_ms": b, "share": 0.9, "goodput": 20.0, "lo": 20.0, "hi": 40.0,
                         "status": CONVERGED} for b in (None, 50.0)],
            "finished": True, "stopped": None}


RESULT = result([(10.0, FIRST), (10.0, REDO), (20.0, AT20), (40.0, CAPPED)])


def test_the_report_says_each_probes_warm_up_and_verdict(tmp_path) -> None:  # type: ignore[no-untyped-def]
    md = search_markdown(RESULT)
    assert f"| rate (req/s) | probe | counted | {RAMP_COLUMN} | 50 ms | unbounded |" in md and RAMP_LEGEND in md
    assert ("| 10 | 1 | 17 | warm-up 16 arrivals (0 s), lifetime 6 s, 47 arrivals before it left out; SHORT: 17 "
            "counted, minimum 32: re-run | 0.0% | 0.0% |") in md
    assert "| 10 | 2 (re-run) | 63 | re-run: warm-up 75 arrivals (7.5 s), lifetime 6.1 s, 1 arrivals before it " \
           "left out | 100.0% | 100.0% |" in md
    assert ("| 40 | 4 | 0 | warm-up 236 arrivals (8 s), lifetime 9 s, 64 arrivals before it left out; needed 384 "
            "arrivals, sent 300 (--search-max-probe-arrivals 300); CAPPED: 0 counted, minimum 32: steady state not "
            "reached within --search-max-probe-arrivals 300: fails every target |") in md
    assert ("at most 12 probes of Poisson arrivals, 64 counted after a warm-up of at least 16 (the ramp rule: 1.25 "
            "request lifetimes; at most 300 arrivals a probe)") in search_line(RESULT)
    block = search_block(RESULT)
    assert re.search(r"Probes short, capped, re-run: +1, 1, 1", block)
    assert re.search(r"Counted per probe, warm-up: +64, 16-236 arrivals", block)
    assert ramp_counts(RESULT) == (1, 1, 1) and has_ramp(RESULT)
    # a trace's probes are capped by its window, and say so
    traced = result([(40.0, CAPPED)], trace=True)
    assert cap_name(traced) == TRACE_CAP and cap_name(RESULT) == "--search-max-probe-arrivals"
    assert f"steady state not reached within {TRACE_CAP} 300" in ramp_cell(traced["probes"][0], cap_name(traced))
    assert ramp_cell({"rate": 4.0}) == "-"
    # the JSON keeps the per-probe fields, and reads back to the same report
    paths, _ = write_search_outputs(RESULT, str(tmp_path), "gs", plot=False)
    back = json.loads((tmp_path / "gs.json").read_text())
    assert back["probes"][0]["ramp"]["then"] == RERUN and back["probes"][3]["ramp"]["verdict"] == "capped"
    assert search_markdown(back) == md


def test_a_result_from_before_the_ramp_rule_still_reads() -> None:
    old = result([(10.0, None), (20.0, None)])
    del old["search"]["settings"]["max_probe_arrivals"], old["search"]["max_probe_arrivals"]
    md = search_markdown(old)
    assert RAMP_COLUMN not in md and RAMP_LEGEND not in md and not has_ramp(old)
    assert "at most 12 probes of 80 Poisson arrivals (the first 16 discarded as warm-up)" in md
    assert "| 10 | 1 | 64 | 100.0% | 100.0% | 300 | 40.0 | 0 | - |" in md
    assert "Probes short" not in search_block(old) and re.search(r"Arrivals per probe, counted: +80, 64",
                                                                  search_block(old))


def test_the_frontier_table_counts_short_and_capped_probes() -> None:
    res = {**RESULT, "title": "w", "path": None}
    rec = frontier.frontier_record(res)
    assert rec["probes"][0]["ramp"]["then"] == RERUN and "ramp" not in frontier.frontier_record(
        {**result([(10.0, None)]), "title": "w"})["probes"][0]
    assert frontier.ramp_note(rec) == "1 probe(s) short, 1 capped (failed every target), 1 re-run"
    assert frontier.ramp_note({"probes": [{"ramp": AT20.to_json()}]}) == ""
    meta = {"model": "m", "workloads": [], "systems": [{"label": "duet@50", "kind": "rapidserve", "flags": "",
                                                         "status": "ok"}]}
    md = frontier.frontier_markdown([rec], meta)
    assert f"- {RAMP_LEGEND} The `search` column counts the probes short or capped." in md
    assert "1 probe(s) short, 1 capped (failed every target), 1 re-run; finished" in md
    assert RAMP_LEGEND not in frontier.frontier_markdown([frontier.frontier_record(
        {**result([(10.0, None)]), "title": "w"})], meta)


# ---------------------------------------------------------------- the flag


@pytest.mark.parametrize("args,needle", [
    (["--goodput-search", "--search-max-probe-arrivals", "50", "--num-prompts", "80"],
     "--search-max-probe-arrivals 50 is below the 80 arrivals of a probe (--num-prompts) before any warm-up for the "
     "ramp: give at least 80 (default 1024), or fewer --num-prompts"),
    (["--search-max-probe-arrivals", "500"], "--search-max-probe-arrivals only apply with --goodput-search"),
    (["--goodput-search", "--search-max-probe-arrivals", "200", "--search-max-rate", "20",
      "--search-above-peak-factor", "4", "--num-prompts", "80"],
     "--search-max-probe-arrivals 200 is below the 272 arrivals of a probe above the peak"),
])
def test_bad_cap_flags_exit_2_before_any_request(args: list[str], needle: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--base-url", "http://127.0.0.1:9", *args]) == 2  # nothing listens on port 9
    assert needle in capsys.readouterr().err


def test_the_cap_flag_makes_the_search_config(capsys: pytest.CaptureFixture[str]) -> None:
    from rapidserve.benchmark.search_flags import search_from_args

    with pytest.raises(SystemExit) as ei:
        build_parser().parse_args(["bench", "--goodput-search", "--search-max-probe-arrivals", "0"])
    assert ei.value.code == 2 and "--search-max-probe-arrivals" in capsys.readouterr().err
    a = build_parser().parse_args(["bench", "--goodput-search", "--search-max-probe-arrivals", "2048"])
    assert search_from_args(a) == SearchConfig(max_probe_arrivals=2048)
    assert SearchConfig().max_probe_arrivals == sustain.DEFAULT_MAX_PROBE_ARRIVALS == 1024
    # bench/compare.py takes it too, checked against its probes' size
    assert compare.main(["--dry-run", "--systems", "rapidserve", "--goodput-search", "--workloads", "24:4",
                         "--search-max-probe-arrivals", "2048"]) == 0
    a = compare.build_parser().parse_args(["--goodput-search", "--search-max-probe-arrivals", "2048"])
    assert compare.search_config(a).max_probe_arrivals == 2048
    for argv, needle in ((["--goodput-search", "--num-prompts", "80", "--search-max-probe-arrivals", "60"],
                          "--search-max-probe-arrivals 60 is below the 80 arrivals"),
                         (["--search-max-probe-arrivals", "60"], "only apply with --goodput-search")):
        with pytest.raises(SystemExit) as ei:
            compare.main(["--dry-run", "--systems", "rapidserve", *argv])
        assert ei.value.code == 2 and needle in capsys.readouterr().err
