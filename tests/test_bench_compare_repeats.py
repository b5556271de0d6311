"""bench/compare.py --goodput-search --search-repeats N: the median and spread over repetitions (pure), the report's
cells and ratios from the medians, the repetitions' salts and time shares, the refusals, and one CPU comparison with two
repetitions (the device plan's account of them: tests/test_bench_frontier_tp.py)."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
from typing import Any

import pytest

from rapidserve.benchmark.arrivals import arrival_times, rate_rng
from rapidserve.benchmark.goodput import AT_MAX, BELOW_MIN, CONVERGED, NOT_SEARCHED, UNFINISHED
from rapidserve.benchmark.results import entry
from rapidserve.benchmark.workloads import WorkloadSpec, make_request
from tests.test_bench_compare import _load
from tests.test_bench_frontier_tp import STAND_IN

# the stand-in vLLM, also writing each prompt it is sent (its token ids) to $PROMPT_LOG, a line each
LOGGING_STAND_IN = STAND_IN.replace("import asyncio, json, sys", "import asyncio, json, os, sys").replace(
    "    body = await req.json()\n",
    "    body = await req.json()\n"
    "    open(os.environ[\"PROMPT_LOG\"], \"a\").write(json.dumps(body[\"prompt\"]) + \"\\n\")\n")

compare = _load()
frontier = _load("compare_frontier")
repeats = _load("compare_repeats")
searching = _load("compare_search")
args = _load("compare_args")
cont = _load("compare_continue")
merge = _load("compare_merge")
plot = pytest.importorskip("rapidserve.benchmark.plot")


def g(lo: float | None, hi: float | None, status: str = CONVERGED, bound: float | None = 50.0,
      share: float = 0.9) -> dict[str, Any]:
    return {"itl_bound_ms": bound, "share": share, "goodput": lo or 0.0, "lo": lo, "hi": hi, "status": status}


# ---------------------------------------------------------------- the median over repetitions (pure)

@pytest.mark.parametrize("entries,cell,status,goodput,hi", [
    # every repetition settled: the median value, the least and greatest
    ([g(30.9, 32.0), g(31.0, 32.5), g(33.5, 35.0)], "31 (30.9–33.5, n=3)", CONVERGED, 31.0, 32.5),
    ([g(30.0, 31.0), g(32.0, 33.0)], "31 (30–32, n=2)", CONVERGED, 31.0, 32.0),  # even n: the middle two's mean
    # a bracket among them: the median lies in [median of the lower ends, median of the upper ends]
    ([g(30.0, 31.0), g(20.0, 40.0, UNFINISHED), g(35.0, 36.0)], "[30, 35]* (20–35, n=3, 1 unsettled)", UNFINISHED,
     30.0, 35.0),
    # the settled two pin the median (the third >= 33 lies above both), but it is still marked
    ([g(30.0, 31.0), g(31.0, 32.0), g(33.0, None, AT_MAX)], "31* (30–33, n=3, 1 unsettled)", UNFINISHED, 31.0, 31.0),
    # no upper bound for the median: at least the median of the lower bounds
    ([g(30.0, 31.0), g(33.0, None, AT_MAX)], ">= 31.5* (30–33, n=2, 1 unsettled)", UNFINISHED, 31.5, None),
    # an unfinished search with nothing passed yet: its lower bound is 0, not printed as a figure
    ([g(None, 16.0, UNFINISHED), g(8.0, 9.0), g(None, None, UNFINISHED)], "[0, 16]* (0–8, n=3, 2 unsettled)",
     UNFINISHED, 0.0, 16.0),
    ([g(1.0, None, AT_MAX), g(None, 0.5, BELOW_MIN)], ">= 0.5* (0–1, n=2, 2 unsettled)", UNFINISHED, 0.5, None),
    # every one at its ceiling / below its lowest rate: that kind's cell, of the median X
    ([g(31.0, None, AT_MAX), g(33.0, None, AT_MAX), g(32.0, None, AT_MAX)], ">= 32 (31–33, n=3)", AT_MAX, 32.0, None),
    ([g(None, 0.25, BELOW_MIN), g(None, 1.0, BELOW_MIN), g(None, 0.5, BELOW_MIN)], "< 0.5 (0.25–1, n=3)", BELOW_MIN,
     0.0, 0.5),
    ([g(7.0, 7.3)], "7 (7–7, n=1)", CONVERGED, 7.0, 7.3),  # one repetition left (the others failed): n says so
])
def test_median_entry_and_its_cell(entries: list[dict[str, Any]], cell: str, status: str, goodput: float,
                                   hi: float | None) -> None:
    e = repeats.median_entry(entries)
    assert (repeats.cell(e), e["status"], e["goodput"]) == (cell, status, goodput)
    assert (e["hi"] is None and hi is None) or e["hi"] == pytest.approx(hi)
    assert e["repeats"]["cells"] == [repeats.cell(x) for x in entries] and e["repeats"]["n"] == len(entries)
    assert e["repeats"]["goodput"] == [repeats.entry_bounds(x)[0] for x in entries]


def test_the_median_lies_in_its_bracket() -> None:
    """Whatever values the unsettled repetitions turn out to have inside their brackets, the median of the values lies
    in [the median entry's goodput, its hi] (hi None: unbounded above)."""
    reps = [g(30.0, 31.0), g(20.0, 40.0, UNFINISHED), g(33.0, None, AT_MAX), g(None, 4.0, BELOW_MIN),
            g(25.0, 26.0)]
    e = repeats.median_entry(reps)
    lo, hi = e["goodput"], math.inf if e["hi"] is None else e["hi"]
    for v2 in (20.0, 29.0, 39.9):
        for v3 in (33.0, 50.0, 1e6):
            for v4 in (0.0, 3.9):
                true = statistics.median([30.0, v2, v3, v4, 25.0])
                assert lo <= true <= hi, (v2, v3, v4, true, lo, hi)


@pytest.mark.parametrize("e,want", [
    (g(30.0, 31.0), (30.0, 30.0)), (g(30.0, None, AT_MAX), (30.0, math.inf)),
    (g(None, 0.5, BELOW_MIN), (0.0, 0.5)), (g(2.0, 4.0, UNFINISHED), (2.0, 4.0)),
    (g(None, None, UNFINISHED), (0.0, math.inf)), (g(2.0, None, UNFINISHED), (2.0, math.inf)),
])
def test_entry_bounds(e: dict[str, Any], want: tuple[float, float]) -> None:
    assert repeats.entry_bounds(e) == want


def test_not_searched_stays_not_searched_and_none_is_refused() -> None:
    ns = g(9.9, None, NOT_SEARCHED)
    assert repeats.median_entry([ns, ns]) == ns and repeats.cell(repeats.median_entry([ns, ns])) == "-"
    with pytest.raises(ValueError, match="no repetition"):
        repeats.median_entry([])
    assert repeats.cell(g(2.0, 4.0, UNFINISHED)) == "[2, 4)*"  # an unrepeated entry: its search's own cell


# ---------------------------------------------------------------- the report

def rec(label: str, entries: list[dict[str, Any]], finished: bool = True, bounds: tuple[float, ...] = (50.0,),
        only: list[float | None] | None = None) -> dict[str, Any]:
    return {"label": label, "title": "w", "workload": {}, "path": f"{label}.json", "finished": finished,
            "stopped": None if finished else "the time budget", "goodput": entries,
            "probes": [{"rate": 1.0, "counted": 32}],
            "search": {"settings": {"itl_bounds_ms": list(bounds), "shares": [0.9], "only_bounds": only}}}


def repeated(label: str, reps: list[list[dict[str, Any]]], unfinished: tuple[int, ...] = ()) -> dict[str, Any]:
    return repeats.repeated_record(label, "w", [rec(label, es, k not in unfinished) for k, es in enumerate(reps)])


# ours: unbounded 6, 8, 10 (median 8); 50 ms 3, 3.3, 2.8 (median 3). The better vLLM by median: `vllm` unbounded
# (5, 9, 4: median 5, though one repetition reached 9), `vllm:1024` at 50 ms ([1, 2)*, 1.5, 1.8: a bracket).
OURS = repeated("ours", [[g(6.0, 6.2, bound=None), g(3.0, 3.1)], [g(8.0, 8.3, bound=None), g(3.3, 3.4)],
                         [g(10.0, 10.4, bound=None), g(2.8, 2.9)]])
VLLM = repeated("vllm", [[g(5.0, 5.2, bound=None), g(1.0, 1.1)], [g(9.0, 9.3, bound=None), g(1.2, 1.3)],
                         [g(4.0, 4.1, bound=None), g(1.1, 1.2)]])
VLLM_1024 = repeated("vllm:1024", [[g(4.5, 4.6, bound=None), g(1.0, 2.0, UNFINISHED)],
                                   [g(4.6, 4.7, bound=None), g(1.5, 1.6)],
                                   [g(4.4, 4.5, bound=None), g(1.8, 1.9)]], unfinished=(0,))
META = {"model": "m", "workloads": [], "systems": [
    {"label": "ours", "kind": "rapidserve", "flags": "", "status": "ok"},
    {"label": "vllm", "kind": "vllm", "flags": "", "status": "ok"},
    {"label": "vllm:1024", "kind": "vllm", "flags": "", "status": "ok"}]}


def test_a_repeated_record_keeps_every_repetition_and_its_medians() -> None:
    assert [e["goodput"] for e in OURS["goodput"]] == [8.0, 3.0]
    assert len(OURS["repeats"]) == 3 and OURS["repeats"][0]["probes"] == [{"rate": 1.0, "counted": 32}]
    assert OURS["search"] == {"settings": OURS["repeats"][0]["search"]["settings"], "repeats": 3}
    assert OURS["finished"] and OURS["stopped"] is None and OURS["probes"] == []
    assert not VLLM_1024["finished"] and VLLM_1024["stopped"] == "repetition 1: the time budget"
    assert repeats.searches(OURS) == OURS["repeats"] and repeats.searches(OURS["repeats"][0]) == [OURS["repeats"][0]]
    assert repeats.flatten([OURS, OURS["repeats"][0]]) == [*OURS["repeats"], OURS["repeats"][0]]
    # frontier_record of a repeated result: each repetition's record, then the medians
    res = {"label": "ours", "title": "w", "repeats": [{**r, "kind": "goodput_search", "peak": {}} for r in
                                                      OURS["repeats"]]}
    got = frontier.frontier_record(res)
    assert [e["goodput"] for e in got["goodput"]] == [8.0, 3.0] and got["goodput"] == OURS["goodput"]
    assert [r["probes"][0]["rate"] for r in got["repeats"]] == [1.0] * 3 and "kind" not in got["repeats"][0]


def test_the_better_vllm_and_the_ratios_are_of_the_medians() -> None:
    frontiers = [OURS, VLLM, VLLM_1024]
    vllm = frontier.vllm_labels(META)
    assert frontier.better_vllm(frontiers, vllm, "w", None, 0.9) == {"system": "vllm", "goodput": 5.0,
                                                                     "status": CONVERGED, "lower": 5.0, "upper": 5.0}
    assert frontier.better_vllm(frontiers, vllm, "w", 50.0, 0.9) == {
        "system": "vllm:1024", "goodput": 1.5, "status": UNFINISHED, "lower": 1.5, "upper": 1.8}  # over vllm's 1.1
    vs = {x["itl_bound_ms"]: x for x in frontier.versus_better_vllm(frontiers, vllm)}
    assert vs[None]["ratio"] == 8.0 / 5.0 and vs[None]["exact"]
    assert vs[50.0]["ratio"] == 3.0 / 1.5 and not vs[50.0]["exact"]  # a repetition of vllm:1024 did not settle
    md = frontier.frontier_markdown(frontiers, META)
    assert "| ours | 3 (2.8–3.3, n=3) | 8 (6–10, n=3) | median of 3 repetitions (each below); finished |" in md
    assert ("| vllm:1024 | [1.5, 1.8]* (1–1.8, n=3, 1 unsettled) | 4.5 (4.4–4.6, n=3) | median of 3 repetitions "
            "(each below); unfinished (repetition 1: the time budget) |") in md
    assert ("| **better vLLM** | [1.5, 1.8]* (1–1.8, n=3, 1 unsettled) (`vllm:1024`) | 5 (4–9, n=3) (`vllm`) | |"
            in md)
    assert "| ours / better vLLM | 1.67–2.00x* | 1.60x | |" in md  # 3 over the median's [1.5, 1.8]
    assert "Each repetition (90% of requests; the cells above are their medians):" in md
    assert "| ours | 1 | 3 | 6 | finished |" in md and "| ours | 3 | 2.8 | 10 | finished |" in md
    assert "| vllm:1024 | 1 | [1, 2)* | 4.5 | unfinished (the time budget) |" in md
    assert "Repetitions (`--search-repeats N`)" in md


def test_our_baselines_and_the_composite_read_the_medians() -> None:
    rapid = repeated("rapidserve", [[g(6.0, 6.1, bound=None), g(4.0, 4.1)], [g(7.0, 7.1, bound=None), g(5.0, 5.1)]])
    split = repeated("always-split", [[g(3.0, 3.1, bound=None), g(2.0, 2.1)], [g(5.0, 5.1, bound=None),
                                                                                g(2.0, 2.1)]])
    own = {x["itl_bound_ms"]: x for x in frontier.versus_ours([rapid, split], set())}
    assert own[None]["ratio"] == 6.5 / 4.0 and own[50.0]["ratio"] == 4.5 / 2.0 and own[50.0]["exact"]
    md = frontier.frontier_markdown([rapid, split], {"model": "m", "systems": [], "workloads": []})
    assert "| rapidserve / always-split | 2.25x | 1.62x | |" in md
    # duet@50 repeated: the composite row's cell at 50 ms is its median, with the spread
    duet = repeats.repeated_record("duet@50", "w", [
        rec("duet@50", [g(9.9, None, NOT_SEARCHED, bound=None), g(8.0, 8.1)], only=[50.0]),
        rec("duet@50", [g(9.9, None, NOT_SEARCHED, bound=None), g(9.0, 9.1)], only=[50.0])])
    md = frontier.frontier_markdown([duet], {"model": "m", "systems": [], "workloads": []})
    assert "| **default (SLO = bound)** | 8.5 (8–9, n=2) | - |" in md
    assert ("| duet@50 | 8.5 (8–9, n=2) | - | searched at 50 ms only; median of 2 repetitions (each below); "
            "finished |") in md
    assert "| duet@50 | 2 | 9 | - | searched at 50 ms only; finished |" in md


def test_an_unrepeated_report_is_as_before() -> None:
    plain = [OURS["repeats"][0], VLLM["repeats"][0]]
    md = frontier.frontier_markdown(plain, META)
    assert "| ours | 3 | 6 | finished |" in md and "Each repetition" not in md and "Repetitions (" not in md


def test_the_plot_draws_the_spread_as_error_bars(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pts = [(50.0, 3.0), (None, 8.0)]
    assert plot._spread(OURS, 0.9, pts) == [[pytest.approx(0.2), 2.0], [pytest.approx(0.3), 2.0]]
    assert plot._spread(OURS["repeats"][0], 0.9, [(50.0, 3.0), (None, 6.0)]) is None  # one search: no bars
    if not plot.have_matplotlib():
        pytest.skip(plot.PLOT_NEEDS)
    frontier.write_frontier_report(argparse.Namespace(out=str(tmp_path), name="r"), dict(META), [], plot=True,
                                   prior={"frontiers": [OURS, VLLM]})
    assert (tmp_path / "r__w_frontier.png").read_bytes()[:4] == b"\x89PNG"
    data = json.loads((tmp_path / "r.json").read_text())
    assert [len(f["repeats"]) for f in data["frontiers"]] == [3, 3]
    assert data["frontiers"][0]["goodput"][0]["repeats"]["goodput"] == [6.0, 8.0, 10.0]  # unbounded


# ---------------------------------------------------------------- the repetitions' salts, shares and files

@pytest.mark.parametrize("workloads,n", [(1, 3), (2, 2), (3, 4)])
def test_repetitions_are_salted_apart(workloads: int, n: int) -> None:
    """Every (workload, repetition) gets a stride of its own: its probes' salts (base .. base + max probes) meet no
    other's; repetition 0's is the workload's own (as without repetitions)."""
    spans = {(w, k): range(args.repeat_salt(w, k, workloads), args.repeat_salt(w, k, workloads) + args.SALT_STRIDE)
             for w in range(workloads) for k in range(n)}
    assert all(args.repeat_salt(w, 0, workloads) == args.SALT_STRIDE * w for w in range(workloads))
    starts = sorted(s.start for s in spans.values())
    assert len(set(starts)) == len(starts) and all(
        b - a >= args.SALT_STRIDE for a, b in zip(starts, starts[1:], strict=False))


def _args(argv: list[str], tmp_path: Any) -> argparse.Namespace:
    a = compare.build_parser().parse_args(["--goodput-search", "--out", str(tmp_path), "--name", "t", *argv])
    a.search = compare.search_config(a)
    return a


def test_each_repetition_is_a_search_of_its_own(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    calls: list[tuple[int, float | None]] = []
    fail_at: list[int] = []

    async def fake(cfg: Any, scfg: Any, deadline: Any = None, shared_peak: float | None = None,
                   known_peak: Any = None) -> dict[str, Any]:
        if len(calls) in fail_at:
            raise ConnectionError("server gone")
        calls.append((cfg.salt_base, deadline))
        return {"label": cfg.label, "base_url": cfg.base_url, "workload": {"name": "fixed"}, "search": {}}

    monkeypatch.setattr(searching, "run_goodput_search", fake)
    monkeypatch.setattr(searching, "write_search_outputs", lambda res, d, name, plot: ({"json": f"{name}.json"}, None))
    a = _args(["--workloads", "24:4,32:4", "--search-repeats", "3"], tmp_path)
    ws = compare.workload_list(a)
    system = compare.parse_systems("rapidserve", [], search=True)[0]
    earlier = {"label": "before", "title": "fixed 32:4"}
    results: list[dict[str, Any]] = [earlier]
    assert searching.workload_searches(a, system, "http://h:1", ws[1], 1, 2, 1000.0, ["vllm"], {}, results,
                                       clock=lambda: 0.0) is None
    assert results[0] is earlier and len(results) == 2  # the repetitions joined as one result, after the others
    res = results[1]
    assert [(r["repeat"], r["salt_base"]) for r in res["repeats"]] == [(1, 1000), (2, 3000), (3, 5000)]
    # repetition k of workload 1 of 2: salts 1000 x (1 + 2k); each an even share of what is left after vLLM's
    # start-up (180 s guessed), over the searches left: 3 x (1 workload of this system + 2 of the later one) - k
    assert calls == [(1000, (1000 - 180) / 9), (3000, (1000 - 180) / 8), (5000, (1000 - 180) / 7)]
    assert [r["path"] for r in res["repeats"]] == [f"t__rapidserve__fixed-32-4__rep{k}.json" for k in (1, 2, 3)]
    assert res["label"] == "rapidserve" and res["title"] == "fixed 32:4" and "path" not in res
    assert searching.searches_left(3, 2, 1, 0, 1) == 9 and searching.searches_left(1, 2, 0, 0, 0) == 2
    calls.clear()
    fail_at.append(1)  # the second repetition fails: the first is kept (in the results as it ended), the error says
    results = []
    assert searching.workload_searches(a, system, "http://h:1", ws[0], 0, 2, None, [], {}, results) == (
        "repetition 2 of 3: server gone")
    assert [[r["repeat"] for r in x["repeats"]] for x in results] == [[1]]
    calls.clear()
    fail_at.clear()
    one = _args(["--workloads", "24:4"], tmp_path)  # without the flag: one search, as before
    results = []
    assert searching.workload_searches(one, system, "http://h:1", ws[0], 0, 1, None, [], {}, results) is None
    (res,) = results
    assert calls == [(0, None)] and not {"repeats", "repeat", "salt_base"} & set(res)
    assert res["path"] == "t__rapidserve__fixed-24-4.json"
    calls.clear()
    fail_at.append(0)
    results = []
    assert searching.workload_searches(one, system, "http://h:1", ws[0], 0, 1, None, [], {}, results) == "server gone"
    assert results == []


# ---------------------------------------------------------------- refusals: continue, merge, plan

def _report(tmp_path: Any, name: str, frontiers: list[dict[str, Any]], n: int) -> str:
    meta = {"model": "m", "serve_args": "", "workloads": [], "itl_bounds_ms": [100, 50], "rates": "inf",
            "per_rate": "48 Poisson arrivals per probe", "arrival": "poisson", "seed": 0, "peak_fractions": None,
            "mode": "goodput_search", "search": {"max_probes": 6, **({"repeats": n} if n > 1 else {})}, "peaks": {},
            "vllm_baseline": None, "systems": [s for s in META["systems"] if s["label"] in {f["label"] for f in
                                                                                               frontiers}]}
    frontier.write_frontier_report(argparse.Namespace(out=str(tmp_path), name=name), meta, [], plot=False,
                                   prior={"frontiers": frontiers})
    return str(tmp_path / f"{name}.json")


def test_reports_of_another_repeat_count_are_refused(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    three = _report(tmp_path, "three", [OURS], 3)
    one = _report(tmp_path, "one", [VLLM["repeats"][0]], 1)
    also_three = _report(tmp_path, "also", [VLLM], 3)
    now = json.loads((tmp_path / "three.json").read_text())
    assert cont.search_repeats(now) == 3 and cont.search_repeats(json.loads((tmp_path / "one.json").read_text())) == 1
    with pytest.raises(ValueError, match=r"one.json ran each search 1 time\(s\) \(--search-repeats 1\); this run 3"):
        cont.load_prior(one, now)
    assert cont.load_prior(also_three, now)["frontiers"][0]["label"] == "vllm"
    assert merge.main([three, one, also_three, "--out", str(tmp_path / "m"), "--name", "all", "--no-plot"]) == 0
    err = capsys.readouterr().err
    assert "skipped --continue-from " in err and "one.json ran each search 1 time(s)" in err
    data = json.loads((tmp_path / "m" / "all.json").read_text())
    assert [f["label"] for f in data["frontiers"]] == ["ours", "vllm"] and data["search"]["repeats"] == 3
    assert "| ours / better vLLM | 2.73x | 1.60x | |" in (tmp_path / "m" / "all.md").read_text()  # 3 / 1.1


@pytest.mark.parametrize("argv,match", [
    (["--goodput-search", "--search-repeats", "0"], "argument --search-repeats: 0: give how many times each search"),
    (["--goodput-search", "--search-repeats", "-2"], "argument --search-repeats: -2: give how many times"),
    (["--goodput-search", "--search-repeats", "1.5"], "argument --search-repeats: '1.5' is not an integer"),
    (["--goodput-search", "--search-repeats", "x"], "argument --search-repeats: 'x' is not an integer"),
    (["--search-repeats", "3"], "--search-repeats only apply with --goodput-search"),
    (["--search-repeats", "1"], "--search-repeats only apply with --goodput-search"),
])
def test_search_repeats_refusals(argv: list[str], match: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        compare.main(["--dry-run", "--systems", "rapidserve", *argv])
    assert ei.value.code == 2 and match in capsys.readouterr().err


def test_one_repeat_is_the_report_without_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    def meta(*extra: str) -> dict[str, Any]:
        a = compare.build_parser().parse_args(["--goodput-search", "--workloads", "24:4", *extra])
        a.search = compare.search_config(a)
        m = compare.report_meta(a, compare.workload_list(a))
        return {k: v for k, v in m.items() if k != "created"}

    assert meta("--search-repeats", "1") == meta() and "repeats" not in meta()["search"]
    assert meta("--search-repeats", "4")["search"]["repeats"] == 4
    assert compare.main(["--dry-run", "--goodput-search", "--systems", "rapidserve", "--search-repeats", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == ("each search runs 2 times (--search-repeats), each repetition "
                                                        "with its own arrivals")


# ---------------------------------------------------------------- one CPU comparison, two repetitions

@pytest.mark.skipif(shutil.which("setsid") is None or not os.path.isdir("/proc"), reason="needs setsid and /proc")
def test_two_repetitions_on_cpu(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Ours on a CPU server and a stand-in vLLM (which logs the prompts it is sent), each searched twice from the same
    start rate against one server each: the two repetitions draw other arrivals and prompts (both systems' repetition k
    the same ones), and the report's cells, better vLLM and ratios are the medians of the two."""
    assert "PROMPT_LOG" in LOGGING_STAND_IN
    script, run_dir, prompt_log = tmp_path / "serve_vllm.sh", tmp_path / "run", tmp_path / "prompts.jsonl"
    script.write_text(LOGGING_STAND_IN)
    run_dir.mkdir()
    monkeypatch.setenv("STAND_IN_PY", sys.executable)
    monkeypatch.setenv("STAND_IN_RUN", str(run_dir))
    monkeypatch.setenv("PROMPT_LOG", str(prompt_log))
    assert compare.main([
        "--model", "preset:tiny-llama", "--serve-args", "--device cpu --num-kv-blocks 64 --max-model-len 256",
        "--goodput-search", "--systems", "rapidserve,vllm:", "--vllm-model", str(tmp_path), "--vllm-serve",
        str(script), "--vllm-run-dir", str(run_dir), "--workloads", "24:4", "--num-prompts", "8", "--search-discard",
        "2", "--search-max-probes", "2", "--search-tolerance", "0.5", "--search-start-rate", "4", "--token-range",
        "3:1000", "--warmup", "1", "--search-repeats", "2", "--out", str(tmp_path), "--name", "rep"]) == 0
    data = json.loads((tmp_path / "rep.json").read_text())
    assert data["search"]["repeats"] == 2 and [s["status"] for s in data["systems"]] == ["ok", "ok"]
    assert [f["label"] for f in data["frontiers"]] == ["rapidserve", "vllm"]
    spec = WorkloadSpec(input_len=24, output_len=4, token_lo=3, token_hi=1000)
    for f in data["frontiers"]:
        reps = f["repeats"]
        # repetition k's probes are salted from 1000 k (one workload): each probe i draws from 1000 k + i
        assert [(r["repeat"], r["salt_base"]) for r in reps] == [(1, 0), (2, 1000)] and all(r["probes"] for r in reps)
        assert [os.path.basename(r["path"]) for r in reps] == [f"rep__{f['label']}__fixed-24-4__rep{k}.json"
                                                                for k in (1, 2)]
        runs = []
        for r in reps:
            with open(r["path"]) as fh:
                runs.append(json.load(fh))
        assert runs[0]["base_url"] == runs[1]["base_url"]  # the same server, not restarted between them
        assert [run["probes"][0]["rate"] for run in runs] == [4.0, 4.0]  # both from the same start rate ...
        sent = [len(run["probes"][0]["requests"]) for run in runs]
        offsets = [arrival_times(4.0, "poisson", rate_rng(0, r["salt_base"] + 1), n).tolist()
                   for r, n in zip(reps, sent, strict=True)]
        assert sent[0] >= 6 and offsets[0][:6] != offsets[1][:6]  # ... with other Poisson arrivals
        for e in f["goodput"]:  # the medians of the two repetitions' goodputs
            if e["status"] == NOT_SEARCHED:
                continue
            mine = [entry(r, e["itl_bound_ms"], e["share"]) for r in reps]
            assert e["repeats"]["goodput"] == [repeats.entry_bounds(x)[0] for x in mine]
            assert e["goodput"] == pytest.approx(statistics.median(e["repeats"]["goodput"]))
    # the stand-in was sent each repetition's own prompts (its first probe's: salt + 1), none of the other's
    got = {tuple(json.loads(line)) for line in prompt_log.read_text().splitlines()}
    first = [{tuple(make_request(spec, 0, i, salt + 1).prompt) for i in range(6)} for salt in (0, 1000)]
    assert first[0] <= got and first[1] <= got and not first[0] & first[1]
    medians = {f["label"]: f for f in data["frontiers"]}
    for x in data["versus_better_vllm"]:
        assert x["better_vllm"] == entry(medians["vllm"], x["itl_bound_ms"], x["share"])["goodput"]
        assert x["goodput"] == entry(medians["rapidserve"], x["itl_bound_ms"], x["share"])["goodput"]
    md = (tmp_path / "rep.md").read_text()
    assert ", n=2" in md and "| rapidserve | 2 |" in md and "| vllm | 1 |" in md and "| **better vLLM** |" in md
    assert "median of 2 repetitions" in md and "Repetitions (`--search-repeats N`)" in md
