"""bench/compare.py --goodput-search --search-shared-ceiling: every system's search may go up to the highest
closed-loop peak measured so far in the comparison (bench/compare_peak.py), the flags that go with it, what the
report says of it (bench/compare_frontier.py), bench/frontier_plan.py's probe lengths (the longer ones above the
peak, and every probe's warm-up: the ramp rule), and one comparison of two CPU servers sharing one ceiling."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rapidserve.benchmark import sustain
from rapidserve.benchmark.goodput import OWN_PEAK, SHARED_PEAK, round_rate
from rapidserve.benchmark.search_config import SearchConfig
from tests.test_bench_compare import _load

compare = _load()
peak = _load("compare_peak")
frontier = _load("compare_frontier")
plan = _load("frontier_plan")
searching = _load("compare_search")


def fr(label: str, title: str, p: float | None) -> dict[str, Any]:
    return {"label": label, "title": title, "search": {"peak_request_throughput": p}}


@pytest.mark.parametrize("searches,title,want", [
    ([], "w", None),
    ([fr("a", "w", 8.57)], "w", (8.57, "a")),
    ([fr("a", "w", 8.57), fr("b", "w", 11.9), fr("c", "w", 10.0)], "w", (11.9, "b")),  # the highest
    ([fr("a", "w", 8.57), fr("b", "other", 11.9)], "w", (8.57, "a")),  # per workload
    ([fr("a", "w", None), fr("b", "w", 5.0)], "w", (5.0, "b")),  # a search from a given start rate measured none
    ([fr("a", "w", 9.0), fr("b", "w", 9.0)], "w", (9.0, "a")),  # the first to reach it
    ([{"label": "sweep", "title": "w"}], "w", None),  # no search at all
])
def test_highest_peak(searches: list[dict[str, Any]], title: str, want: tuple[float, str] | None) -> None:
    assert peak.highest_peak(searches, title) == want


def test_each_search_is_given_the_highest_peak_of_the_searches_before_it(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    seen: list[float | None] = []

    async def fake(cfg: Any, scfg: Any, deadline: Any = None, shared_peak: float | None = None,
                   known_peak: Any = None) -> dict[str, Any]:
        seen.append(shared_peak)
        return {"search": {"peak_request_throughput": 3.0}}

    monkeypatch.setattr(searching, "run_goodput_search", fake)
    a = compare.build_parser().parse_args(["--goodput-search", "--search-shared-ceiling", "--workloads", "24:4"])
    a.search = compare.search_config(a)
    (w,) = compare.workload_list(a)
    system = compare.parse_systems("rapidserve", [], search=True)[0]
    peers = [fr("carried", w.title, 11.9), fr("ran", w.title, 8.57), fr("elsewhere", "other", 20.0)]
    res = searching.search(a, w, "http://h:1", system, 0, None, peers)
    assert seen == [11.9] and res["search"]["shared_peak_system"] == "carried"
    searching.search(a, w, "http://h:1", system, 0, None, [])  # the first system: its own peak alone
    a.search_shared_ceiling = False
    searching.search(a, w, "http://h:1", system, 0, None, peers)  # without the flag: nobody's
    assert seen == [11.9, None, None]


@pytest.mark.parametrize("argv,match", [
    (["--search-shared-ceiling"], "--search-shared-ceiling only apply with --goodput-search"),
    (["--goodput-search", "--search-shared-ceiling", "--search-max-rate", "20"],
     "--search-shared-ceiling takes the ceiling from the systems' peaks, --search-max-rate gives one: drop one"),
    (["--goodput-search", "--search-shared-ceiling", "--search-start-rate", "2"],
     "--search-shared-ceiling needs each system's closed-loop peak"),
    (["--goodput-search", "--search-above-peak-factor", "4"],
     "--search-above-peak-factor 4 lengthens the probes above the closed-loop peak, and with the peak as the ceiling "
     "there are none: give a ceiling above it, --search-max-rate R or --search-shared-ceiling"),
    (["--goodput-search", "--search-shared-ceiling", "--search-above-peak-factor", "4", "--workload-args",
      "--workload trace --trace t.jsonl --trace-arrivals poisson"],
     "each probe replays the trace's whole window: give --search-trace-probe N"),
    (["--goodput-search", "--search-max-probe-arrivals", "400", "--workload-args",
      "--workload trace --trace t.jsonl --trace-arrivals poisson"],
     "--search-max-probe-arrivals caps a probe's arrivals, but a trace's window is its cap"),
])
def test_shared_ceiling_flag_errors(argv: list[str], match: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        compare.main(["--dry-run", "--systems", "rapidserve", *argv])
    assert ei.value.code == 2 and match in capsys.readouterr().err


def test_shared_ceiling_flags_that_go(capsys: pytest.CaptureFixture[str]) -> None:
    for extra in (["--search-shared-ceiling", "--search-above-peak-factor", "4"],
                  ["--search-max-rate", "20", "--search-above-peak-factor", "4"], ["--search-shared-ceiling"]):
        assert compare.main(["--dry-run", "--systems", "rapidserve", "--goodput-search", "--workloads", "24:4",
                             *extra]) == 0
    a = compare.build_parser().parse_args(["--goodput-search", "--search-shared-ceiling", "--search-above-peak-factor",
                                           "4"])
    a.search = compare.search_config(a)
    meta = compare.report_meta(a, [])
    assert meta["search"]["shared_ceiling"] is True and meta["search"]["above_peak_factor"] == 4.0
    a = compare.build_parser().parse_args(["--goodput-search"])
    a.search = compare.search_config(a)
    assert "shared_ceiling" not in compare.report_meta(a, [])["search"]  # as before: a continuation still matches


def search_of(top: float, source: str, own: float | None, probes: list[dict[str, Any]],
              whose: str | None = None) -> dict[str, Any]:
    return {"label": "duet@50", "title": "w", "probes": probes,
            "search": {"max_rate": top, "ceiling": source, "shared_peak_system": whose, "peak_request_throughput": own}}


ABOVE = {"rate": 10.2, "above_peak": True, "arrivals": 144,
         "backlog": {"first": 0.05, "last": 0.06, "projected": 0.07, "requests": 128, "grew": False}}
GREW = {**ABOVE, "rate": 11.9, "backlog": {**ABOVE["backlog"], "projected": 1.3, "grew": True}}  # type: ignore[dict-item]


@pytest.mark.parametrize("f,want", [
    (search_of(8.57, OWN_PEAK, 8.571, [{"rate": 8.57}]), ""),  # its own peak: nothing to say
    (search_of(11.9, SHARED_PEAK, 8.571, [{"rate": 8.57}, GREW, ABOVE], "always-fused"),
     "ceiling 11.9 req/s (always-fused's peak) above its own peak 8.57: 2 probe(s) above it (144 arrivals each), "
     "backlog grew in 1"),
    (search_of(20.0, "max_rate", 8.571, []), "ceiling 20 req/s (--search-max-rate) above its own peak 8.57: "
                                              "0 probe(s) above it, backlog grew in 0"),
    (search_of(6.0, "max_rate", 8.571, []), ""),  # a given ceiling below the peak: nothing above it
    (search_of(32.0, "start_x8", None, []), ""),  # no peak measured
])
def test_ceiling_note(f: dict[str, Any], want: str) -> None:
    assert frontier.ceiling_note(f) == want


def test_frontier_record_keeps_what_the_probes_above_the_peak_add() -> None:
    res = {"label": "x", "title": "w", "workload": {}, "search": {}, "goodput": [], "finished": True, "stopped": None,
           "probes": [{"rate": 8.57, "order": 1, "requests": []}, {**GREW, "order": 2, "requests": []}]}
    below, above = frontier.frontier_record(res)["probes"]
    assert "above_peak" not in below and "requests" not in below and below["rate"] == 8.57
    assert (above["above_peak"], above["arrivals"], above["backlog"]["grew"]) == (True, 144, True)


@pytest.mark.parametrize("wanted,factor,want", [
    (5, 1.0, 50.0),  # as before: every probe as long
    (5, 4.0, 2 * 10.0 + 3 * 16.0),  # ABOVE_PEAK_PROBES of them long
    (2, 4.0, 2 * 16.0),  # no more than the search wants
])
def test_plan_search_seconds(wanted: int, factor: float, want: float) -> None:
    assert plan.search_s(wanted, 10.0, 16.0, factor) == want


def test_the_plan_counts_longer_probes_above_the_peak() -> None:
    cfg = plan._model("qwen3-8b")
    short = plan.group_call("ours-slo", ["duet@50"], 8.5, 48, 10, 540, False)
    long = plan.group_call("ours-slo", ["duet@50"], 8.5, 48, 10, 540, False, above_peak_factor=4.0)
    # 144 arrivals at 1.2 x 8.5 req/s + 2 s = ~16 s instead of ~11 s, three times
    assert long.seconds - short.seconds == pytest.approx(3 * ((16 + 4 * 32) / (1.2 * 8.5) - 1.6 * 48 / 8.5))
    assert "above the peak" not in short.detail and "up to 3 a search above the peak ~16 s each (144 arrivals)" in \
        long.detail
    lines = plan.plan(cfg, "qwen3-8b", 2, 1, ["ours-slo", "baselines"], num_prompts=48, max_probes=10, stashed=True,
                      above_peak_factor=4.0)
    assert "(cut from 5 by BUDGET_S 540)" in lines[3]  # five one-bound searches with long probes: split the group


def test_the_plan_shares_the_ramp_rules_numbers() -> None:
    """bench/frontier_plan.py runs without the bench client's packages, so it keeps its own copy of these."""
    assert (plan.RAMP_MARGIN, plan.DEFAULT_MAX_PROBE_ARRIVALS) == (sustain.RAMP_MARGIN,
                                                                   sustain.DEFAULT_MAX_PROBE_ARRIVALS)
    assert SearchConfig().discard == plan.SEARCH_DISCARD


@pytest.mark.parametrize("rate,counted,life,cap,want", [
    (10.0, 32, None, 1024, (48 / 10 + 2, 16)),  # as before the ramp rule: the discard, then 2 s to drain
    (10.0, 32, 1.0, 1024, (48 / 10 + 2, 16)),  # a short lifetime: the discard covers it, drained in 2 s
    (30.0, 64, 6.0, 1024, ((225 + 64) / 30 + 6, 225)),  # 1024:256: 7.5 s of warm-up, 6 s to drain
    (40.0, 256, 8.0, 300, (300 / 40 + 8, 400)),  # capped: no longer than the cap
])
def test_probe_seconds(rate: float, counted: int, life: float | None, cap: int, want: tuple[float, int]) -> None:
    got = plan.probe_seconds(rate, counted, life, cap)
    assert got[0] == pytest.approx(want[0]) and got[1] == want[1]


def test_the_plan_counts_the_warm_up() -> None:
    # 1024:256 (lifetime guess 0.3 + 256 x 25 ms = 6.7 s) at the 80 arrivals a probe of a default search
    assert plan.lifetime_guess(256) == pytest.approx(6.7) and plan.lifetime_guess(28) == pytest.approx(1.0)
    before = plan.group_call("baselines", ["always-fused"], 30.0, 80, 10, 540, False)
    ramp = plan.group_call("baselines", ["always-fused"], 30.0, 80, 10, 540, False, lifetime_s=6.7)
    # probes at ~peak / 1.6: 1.25 x 6.7 s of warm-up (126 arrivals) then 64, and 6.7 s to drain, against 80 and 2 s
    warm = -(-18.75 * 8.375 // 1)
    assert ramp.seconds - before.seconds == pytest.approx(10 * ((warm - 16) / 18.75 + 6.7 - 2))
    assert "(warm-up ~158 arrivals, lifetime 6.7 s)" in ramp.detail and "warm-up" not in before.detail
    cfg = plan._model("qwen3-8b")
    lines = plan.plan(cfg, "qwen3-8b", 2, 1, ["baselines"], prompt=1024, num_prompts=80, max_probes=10,
                      stashed=True, lifetime_s=6.7)
    assert "request lifetime 6.7 s (the probes' warm-ups: the ramp rule)" in lines[1]
    assert "request lifetime" not in plan.plan(cfg, "qwen3-8b", 2, 1, ["baselines"], stashed=True)[1]


def test_two_cpu_servers_share_one_ceiling(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`wide` (the default batch) then `narrow` (--max-num-seqs 1: one request at a time, a far lower closed-loop
    peak): narrow's search may go up to wide's peak, its probes above its own peak twice as long and judged by their
    backlog; wide's stops at its own peak, the highest. Structure only: CPU timings are not asserted."""
    rc = compare.main(["--model", "preset:tiny-llama", "--serve-args", "--device cpu --num-kv-blocks 64",
                       "--goodput-search", "--systems", "", "--system", "wide=", "--system", "narrow=--max-num-seqs 1",
                       "--workloads", "24:4", "--num-prompts", "10", "--search-discard", "2", "--search-max-probes",
                       "3", "--search-start-fraction", "1", "--search-tolerance", "0.5", "--search-itl-bounds-ms",
                       "1000", "--search-shares", "0.9", "--search-shared-ceiling", "--search-above-peak-factor", "2",
                       "--token-range", "3:1000", "--warmup", "1", "--budget-s", "120", "--out", str(tmp_path),
                       "--name", "sh"])
    assert rc == 0
    data = json.loads((tmp_path / "sh.json").read_text())
    assert data["search"]["shared_ceiling"] is True and data["search"]["above_peak_factor"] == 2.0
    wide, narrow = data["frontiers"]
    pw, pn = (f["search"]["peak_request_throughput"] for f in (wide, narrow))
    assert pn < pw  # one request at a time against a batch of ten
    assert (wide["search"]["ceiling"], wide["search"]["max_rate"]) == (OWN_PEAK, round_rate(pw))
    assert not any("above_peak" in p for p in wide["probes"])  # nothing above its own peak
    s = narrow["search"]
    assert (s["ceiling"], s["max_rate"], s["shared_peak"], s["shared_peak_system"]) == (
        SHARED_PEAK, round_rate(pw), pw, "wide")
    own = round_rate(pn)
    assert narrow["probes"][0]["rate"] == own and "above_peak" not in narrow["probes"][0]  # the start: its own peak
    above = [p for p in narrow["probes"] if p["rate"] > own]
    # above its own peak a probe means to count 2 x 8, after its warm-up (the ramp rule: at least the 2 discarded;
    # its length and what its lifetime leaves are CPU timings), and its backlog is judged on what it counted
    assert narrow["probes"][0]["ramp"]["wanted"] == 8
    assert above and all(p["above_peak"] and p["ramp"]["wanted"] == 16 and p["ramp"]["warmup"] >= 2 for p in above)
    assert all(p["arrivals"] == p["ramp"]["sent"] == p["ramp"]["warmup"] + 16 for p in above)
    assert all(p["counted"] == p["ramp"]["counted"] for p in above)
    assert all(p["backlog"] is None if p["counted"] < 8 else p["backlog"]["requests"] == p["counted"]
               and isinstance(p["backlog"]["grew"], bool) for p in above)
    with open(narrow["path"]) as f:  # the search's own file: every request of a long probe
        assert [len(p["requests"]) for p in json.load(f)["probes"]] == [p["ramp"]["sent"] for p in narrow["probes"]]
    md = (tmp_path / "sh.md").read_text()
    each = ", ".join(str(n) for n in sorted({p["arrivals"] for p in above}))
    assert f"ceiling {round_rate(pw):g} req/s (wide's peak) above its own peak {pn:.3g}: {len(above)} probe(s) " \
           f"above it ({each} arrivals each)" in md
    assert "- Above the peak: a probe at a rate above the server's own closed-loop peak" in md
