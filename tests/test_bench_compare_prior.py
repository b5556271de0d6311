"""bench/compare.py --search-start-from (bench/compare_prior.py): earlier reports' brackets as each search's hints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rapidserve.benchmark.goodput import AT_MAX, BELOW_MIN, CONVERGED, NOT_SEARCHED, UNFINISHED, round_rate
from tests.test_bench_compare import _load

compare = _load()
prior = _load("compare_prior")
searching = _load("compare_search")


def e(bound: float | None, lo: float | None, hi: float | None, status: str, share: float = 0.9) -> dict[str, Any]:
    return {"itl_bound_ms": bound, "share": share, "goodput": lo or 0.0, "lo": lo, "hi": hi, "status": status}


@pytest.mark.parametrize("entry,want", [
    (e(50.0, 3.41, 6.81, UNFINISHED), (50.0, 0.9, 3.41, 6.81)),
    (e(None, 9.97, 10.4, CONVERGED, 0.99), (None, 0.99, 9.97, 10.4)),
    (e(50.0, 36.0, None, AT_MAX), (50.0, 0.9, 36.0, None)),  # passed at its ceiling: no upper end
    (e(50.0, None, 1.25, BELOW_MIN), (50.0, 0.9, None, 1.25)),  # failed at its lowest rate: no lower end
    (e(50.0, 0.0, 4.0, UNFINISHED), (50.0, 0.9, None, 4.0)),  # 0: nothing passed
    (e(50.0, 5.0, 5.0, UNFINISHED), (50.0, 0.9, 5.0, None)),  # no bracket: its lower end alone
    (e(25.0, 2.0, 3.0, NOT_SEARCHED), None), (e(25.0, None, None, UNFINISHED), None),
])
def test_entry_hint(entry: dict[str, Any], want: tuple[Any, ...] | None) -> None:
    assert prior.entry_hint(entry) == want


REPORT = {"frontiers": [
    {"label": "duet", "title": "fixed 4096:64", "goodput": [e(None, 9.97, 12.0, UNFINISHED), e(50.0, 9.97, 12.0,
                                                                                               UNFINISHED)]},
    {"label": "vllm", "title": "fixed 4096:64", "goodput": [e(None, 8.49, 12.2, UNFINISHED),
                                                            e(50.0, 0.0, 4.25, UNFINISHED)]},
    {"label": "vllm", "title": "fixed 1024:256", "goodput": [e(25.0, 1.0, 2.0, NOT_SEARCHED)]},  # nothing: left out
]}


def test_reports_read_into_hints_by_system_and_workload(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "a.json"
    path.write_text(json.dumps(REPORT))
    later = tmp_path / "b.json"
    later.write_text(json.dumps({"frontiers": [{"label": "duet", "title": "fixed 4096:64",
                                                "goodput": [e(None, 10.5, 11.0, CONVERGED)]}]}))
    hints = prior.load_hints([str(path)])
    assert set(hints) == {("duet", "fixed 4096:64"), ("vllm", "fixed 4096:64")}
    assert hints[("vllm", "fixed 4096:64")] == ((None, 0.9, 8.49, 12.2), (50.0, 0.9, None, 4.25))
    assert prior.load_hints([str(path), str(later)])[("duet", "fixed 4096:64")] == ((None, 0.9, 10.5, 11.0),)
    assert prior.hints_text(hints[("vllm", "fixed 4096:64")]) == "unbounded @0.9 [8.49, 12.2), 50 @0.9 [?, 4.25)"
    bad = tmp_path / "bad.json"
    not_one = "not a compare.py goodput-search report"
    for text, match in (("{", "not JSON"), ("[]", not_one), ('{"peaks": {}}', not_one),
                        ('{"frontiers": [{"label": "x"}]}', "a frontier without a label, title or goodput")):
        bad.write_text(text)
        with pytest.raises(ValueError, match=f"--search-start-from {bad}: {match}"):
            prior.load_hints([str(bad)])
    with pytest.raises(ValueError, match="No such file"):
        prior.load_hints([str(tmp_path / "missing.json")])
    assert prior.paths_arg("a.json, b.json") == ("a.json", "b.json")
    with pytest.raises(ValueError, match="comma-separated"):
        prior.paths_arg("a.json,,b.json")


def test_each_search_starts_from_its_own_systems_earlier_brackets(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    seen: list[Any] = []

    async def fake(cfg: Any, scfg: Any, deadline: Any = None, shared_peak: float | None = None,
                   known_peak: Any = None) -> dict[str, Any]:
        seen.append(scfg.hints)
        return {"search": {"peak_request_throughput": 3.0}}

    monkeypatch.setattr(searching, "run_goodput_search", fake)
    path = tmp_path / "a.json"
    path.write_text(json.dumps({"frontiers": [{"label": "rapidserve", "title": "fixed 24:4",
                                               "goodput": [e(50.0, 3.0, 4.0, UNFINISHED)]}]}))
    a = compare.build_parser().parse_args(["--goodput-search", "--workloads", "24:4,32:4",
                                           "--search-start-from", str(path)])
    a.search = compare.search_config(a)
    a.search_hints = prior.load_hints(a.search_start_from)
    w24, w32 = compare.workload_list(a)
    system = compare.parse_systems("rapidserve", [], search=True)[0]
    searching.search(a, w24, "http://h:1", system, 0, None)
    searching.search(a, w32, "http://h:1", system, 0, None)  # no earlier search of this workload: none
    assert seen == [((50.0, 0.9, 3.0, 4.0),), None]
    meta = compare.report_meta(a, [w24, w32])
    assert meta["search_start_from"] == [str(path)] and "hints" in meta["search"] and meta["search"]["hints"] is None


def test_the_flag_needs_a_goodput_search(capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit):
        compare.main(["--dry-run", "--systems", "rapidserve", "--search-start-from", "x.json"])
    assert "--search-start-from only apply with --goodput-search" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compare.main(["--dry-run", "--goodput-search", "--systems", "rapidserve", "--search-start-from", "/nope.json"])
    assert "--search-start-from /nope.json: No such file or directory" in capsys.readouterr().err


def test_a_cpu_server_searched_again_from_its_earlier_report_with_a_ttft_probe(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Two comparisons of one CPU server: the second starts from the first's brackets (its first probe at the first
    searched target's earlier lower end, clamped into its limits) and ends with a probe at --search-ttft-rate, whose
    TTFT the report's table gives. Structure only: CPU timings are not asserted."""
    base = ["--model", "preset:tiny-llama", "--serve-args", "--device cpu --num-kv-blocks 64", "--goodput-search",
            "--systems", "", "--system", "wide=", "--workloads", "24:4", "--num-prompts", "10", "--search-discard",
            "2", "--search-max-probes", "3", "--search-start-fraction", "1", "--search-tolerance", "0.5",
            "--search-itl-bounds-ms", "1000", "--search-shares", "0.9", "--search-only-bounds", "none",
            "--token-range", "3:1000", "--warmup", "1", "--budget-s", "120", "--out", str(tmp_path)]
    assert compare.main([*base, "--name", "first"]) == 0
    first = json.loads((tmp_path / "first.json").read_text())
    (hint,) = [h for h in prior.load_hints([str(tmp_path / "first.json")])[("wide", first["frontiers"][0]["title"])]
               if h[0] is None]
    assert compare.main([*base, "--name", "second", "--search-start-from", str(tmp_path / "first.json"),
                         "--search-ttft-rate", "0.777"]) == 0
    second = json.loads((tmp_path / "second.json").read_text())
    assert second["search_start_from"] == [str(tmp_path / "first.json")]
    (f,) = second["frontiers"]
    s = f["search"]
    lo, hi = hint[2], hint[3]
    want = lo if lo is not None else round_rate(hi / 2)
    assert f["probes"][0]["rate"] == min(max(want, s["min_rate"]), s["max_rate"])
    assert f["probes"][-1]["rate"] == 0.777 and f["probes"][-1]["ttft_probe"] is True
    assert s["settings"]["hints"] is not None and s["settings"]["ttft_rate"] == 0.777
    md = (tmp_path / "second.md").read_text()
    assert "TTFT at 0.777 req/s" in md and "| wide | 0.777 |" in md


# ---------------------------------------------------------------- --search-peak-from-prior: the earlier closed loop


def fr(label: str, peak: float | None, life: float | None = None, **search: Any) -> dict[str, Any]:
    """A frontier of workload 'fixed 24:4' whose search recorded `peak` and `life`."""
    return {"label": label, "title": "fixed 24:4", "goodput": [e(None, 10.0, 20.0, UNFINISHED)],
            "search": {"peak_request_throughput": peak, "peak_lifetime_s": life, **search}}


@pytest.mark.parametrize("frontier,want", [
    (fr("a", 40.0, 0.5), (40.0, 0.5, "r.json")),
    (fr("a", 40.0), (40.0, None, "r.json")),  # a report from before the lifetime was recorded: the peak alone
    (fr("a", None, 0.5), None),  # started from --search-start-rate: no peak
    (fr("a", 0.0), None),
    (fr("a", 40.0, 0.5, peak_reused_from="old.json", peak_measured_in="first.json"), (40.0, 0.5, "first.json")),
    # a repeated search (--search-repeats): the medians of its repetitions'
    ({"label": "a", "title": "fixed 24:4", "goodput": [], "search": {"repeats": 3},
      "repeats": [fr("a", 30.0, 0.4), fr("a", 50.0), fr("a", 40.0, 0.6)]}, (40.0, 0.5, "r.json")),
])
def test_frontier_peak(frontier: dict[str, Any], want: tuple[float, float | None, str] | None) -> None:
    got = prior.frontier_peak(frontier, "r.json")
    assert (got if got is None else (got.request_throughput, got.lifetime_s, got.measured_in)) == want
    assert got is None or got.source == "r.json"


def test_frontier_peak_carries_its_closed_loops_size() -> None:
    """The requests the earlier closed loop sent at once (its search's probe_requests; a repeated one's, shared by
    its repetitions), which run_goodput_search compares with its own; None where not recorded."""
    assert prior.frontier_peak(fr("a", 40.0, 0.5, probe_requests=48), "r.json").probe_requests == 48  # type: ignore[union-attr]
    assert prior.frontier_peak(fr("a", 40.0, 0.5), "r.json").probe_requests is None  # type: ignore[union-attr]
    reps = {"label": "a", "title": "fixed 24:4", "goodput": [], "search": {"repeats": 2},
            "repeats": [fr("a", 30.0, probe_requests=64), fr("a", 50.0, probe_requests=64)]}
    assert prior.frontier_peak(reps, "r.json").probe_requests == 64  # type: ignore[union-attr]


def test_peaks_are_read_with_the_hints_and_say_why_none(tmp_path) -> None:  # type: ignore[no-untyped-def]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"frontiers": [fr("x", 8.0, 2.0), fr("y", 9.0)]}))
    b.write_text(json.dumps({"frontiers": [fr("x", None)]}))  # later: x started from a rate there
    hints, peaks = prior.load_searches([str(a), str(b)])
    assert set(hints) == set(peaks) == {("x", "fixed 24:4"), ("y", "fixed 24:4")}
    cases = [("y", "9.00 req/s, no median E2E recorded, reused from " + str(a)),
             ("x", f"its earlier search in {b} recorded no closed-loop peak (--search-start-rate)"),
             ("z", "no earlier search of z on fixed 24:4 in --search-start-from's reports")]
    for label, says in cases:
        known, why = prior.peak_for(peaks, label, "fixed 24:4")
        assert (known is not None) == (label == "y") and says in why
    assert prior.load_searches([str(a)])[1][("x", "fixed 24:4")].peak.lifetime_s == 2.0  # type: ignore[union-attr]
    a.write_text(json.dumps({"frontiers": [fr("x", "fast")]}))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"--search-start-from {a}: x on fixed 24:4: a closed-loop peak"):
        prior.load_searches([str(a)])



def test_a_multi_turn_peak_recorded_in_turns_per_second_is_reused_in_conversations_per_second(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Before ead0549 (2026-11-30 12:32 UTC) a multi-turn search recorded its closed-loop peak in requests (turns) per
    second, num_turns x the conversations/s its rates are in: such a report's peak is reused over its turns (it
    was reused as it stood: 6 x too high, so the search started and capped far above the server's peak); later
    reports', and other workloads', as they stand."""
    mt = {"name": "multiturn", "input_len": 2048, "output_len": 64, "num_turns": 6, "turn_input_len": 256}

    def report(created: str, workload: dict[str, Any]) -> str:
        path = tmp_path / f"{created[:13]}_{workload['name']}.json"
        path.write_text(json.dumps({"created": created, "frontiers": [{**fr("x", 36.0, 8.0), "workload": workload}]}))
        return str(path)

    for created, workload, want in (("2026-11-30T11:15:43+00:00", mt, 6.0), ("2026-11-30T13:39:04+00:00", mt, 36.0),
                                    ("2026-11-30T11:15:43+00:00", {"name": "fixed"}, 36.0)):
        known, _ = prior.peak_for(prior.load_searches([report(created, workload)])[1], "x", "fixed 24:4")
        assert known is not None and known.request_throughput == pytest.approx(want) and known.lifetime_s == 8.0
    old = Path(__file__).parent.parent / "bench/results/h200x2_1130e/multiturn.json"
    if old.is_file():  # the one such report in the tree: 35.3 turns/s of 6-turn conversations
        known, _ = prior.peak_for(prior.load_searches([str(old)])[1], "duet", "multiturn 2048:64 x6 (+256/turn)")
        assert known is not None and known.request_throughput == pytest.approx(35.28 / 6, rel=1e-3)


def test_a_peak_measured_on_another_server_is_not_reused(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A system's label and a workload's title do not name the server: a report of another model shape or other
    --serve-args (TP, max model length, GPU memory: frontier_parallel.sh's SEARCH_ARGS kept across presets or TP)
    measured another peak, and the search runs its own closed loop, the log saying why; the same server's is reused."""
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"model": "preset:qwen3-8b", "serve_args": "--max-model-len 8192",
                                "frontiers": [fr("rapidserve", 8.0, 2.0)]}))
    peaks = prior.load_searches([str(path)])[1]
    same = {"model": "preset:qwen3-8b", "serve_args": "--max-model-len 8192"}
    assert prior.peak_for(peaks, "rapidserve", "fixed 24:4", same)[0] is not None
    assert prior.peak_for(peaks, "rapidserve", "fixed 24:4")[0] is not None  # no setup given: as before
    tp = {**same, "serve_args": "--max-model-len 8192 --tensor-parallel-size 4"}
    known, why = prior.peak_for(peaks, "rapidserve", "fixed 24:4", tp)
    assert known is None and "serve_args ('--max-model-len 8192' there" in why
    known, why = prior.peak_for(peaks, "rapidserve", "fixed 24:4", {**same, "model": "preset:llama-3.1-70b"})
    assert known is None and "model ('preset:qwen3-8b' there, 'preset:llama-3.1-70b' here)" in why
    seen: list[Any] = []

    async def fake(cfg: Any, scfg: Any, deadline: Any = None, shared_peak: float | None = None,
                   known_peak: Any = None) -> dict[str, Any]:
        seen.append(known_peak)
        return {"label": cfg.label, "workload": {}, "search": {"peak_request_throughput": 3.0}}

    monkeypatch.setattr(searching, "run_goodput_search", fake)
    for model, reused in (("preset:qwen3-8b", True), ("preset:llama-3.1-70b", False)):
        a = compare.build_parser().parse_args(["--goodput-search", "--workloads", "24:4", "--model", model,
                                               "--serve-args", "--max-model-len 8192", "--search-start-from",
                                               str(path), "--search-peak-from-prior", "--out", str(tmp_path)])
        a.search = compare.search_config(a)
        a.search_hints, a.search_peaks = prior.load_searches(a.search_start_from)
        (w,) = compare.workload_list(a)
        res = searching.search(a, w, "http://h:1", compare.parse_systems("rapidserve", [], search=True)[0], 0, None,
                               [])
        assert (seen[-1] is not None) == reused and ("peak_not_reused" in res["search"]) == (not reused)

@pytest.mark.parametrize("argv,says", [
    (["--search-peak-from-prior"], "--search-peak-from-prior only apply with --goodput-search"),
    (["--goodput-search", "--search-peak-from-prior"],
     "--search-peak-from-prior reuses the closed-loop peaks of --search-start-from's reports: give "
     "--search-start-from REPORT.json[,...] too"),
    (["--goodput-search", "--search-peak-from-prior", "--search-start-from", "x.json", "--search-start-rate", "2"],
     "--search-peak-from-prior reuses each system's closed-loop peak to start its search from, and "
     "--search-start-rate starts every search without one: drop one of them"),
])
def test_peak_from_prior_flag_errors(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        compare.main(["--dry-run", "--systems", "rapidserve", *argv])
    assert ei.value.code == 2 and says in capsys.readouterr().err


def test_each_search_and_repetition_is_given_its_own_prior_peak(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """compare_search hands run_goodput_search the system's earlier peak (every repetition alike) or, where there is
    none, no peak and the result says why; without the flag, none. With --search-shared-ceiling a reused peak counts
    among the peers' as a measured one."""
    seen: list[tuple[Any, Any]] = []

    async def fake(cfg: Any, scfg: Any, deadline: Any = None, shared_peak: float | None = None,
                   known_peak: Any = None) -> dict[str, Any]:
        seen.append((known_peak, shared_peak))
        return {"label": cfg.label, "workload": {}, "search": {
            "peak_request_throughput": known_peak.request_throughput if known_peak else 3.0}}

    monkeypatch.setattr(searching, "run_goodput_search", fake)
    monkeypatch.setattr(searching, "write_search_outputs", lambda res, d, name, plot: ({"json": f"{name}.json"}, None))
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"frontiers": [fr("rapidserve", 8.0, 2.0)]}))
    base = ["--goodput-search", "--workloads", "24:4", "--search-start-from", str(path), "--out", str(tmp_path)]
    for flags, want in (([], [None, None]), (["--search-peak-from-prior"], [8.0, 8.0])):
        seen.clear()
        a = compare.build_parser().parse_args([*base, "--search-repeats", "2", *flags])
        a.search = compare.search_config(a)
        a.search_hints, a.search_peaks = prior.load_searches(a.search_start_from)
        (w,) = compare.workload_list(a)
        results: list[dict[str, Any]] = []
        for label in ("rapidserve", "other"):
            system = compare.parse_systems(label, [], search=True)[0] if label == "rapidserve" else \
                compare.parse_systems("", [f"{label}="], search=True)[0]
            assert searching.workload_searches(a, system, "http://h:1", w, 0, 1, None, [], {}, results) is None
        assert [k.request_throughput if k else None for k, _ in seen[:2]] == want  # each repetition
        assert [k for k, _ in seen[2:]] == [None, None]  # `other`: none earlier
        other = results[1]["repeats"]
        assert all(("peak_not_reused" in r["search"]) == bool(flags) for r in other)
        if flags:
            assert "no earlier search of other on fixed 24:4" in other[0]["search"]["peak_not_reused"]
    seen.clear()
    a = compare.build_parser().parse_args([*base, "--search-peak-from-prior", "--search-shared-ceiling"])
    a.search = compare.search_config(a)
    a.search_hints, a.search_peaks = prior.load_searches(a.search_start_from)
    (w,) = compare.workload_list(a)
    peer = {"label": "rapidserve", "title": w.title, "search": {"peak_request_throughput": 8.0,
                                                                "peak_reused_from": str(path)}}
    searching.search(a, w, "http://h:1", compare.parse_systems("", ["other="], search=True)[0], 0, None, [peer])
    assert seen == [(None, 8.0)]


class FastThread:
    """test_bench_trace_run's fake server (every completion answered at once; the bodies recorded) on a thread of its
    own, for compare.main, whose searches run their own event loops."""

    def __init__(self) -> None:
        import asyncio
        import threading

        from aiohttp import web
        from test_bench_trace_run import Fast

        self.fake, self.loop = Fast(8192), asyncio.new_event_loop()
        self.runner = web.AppRunner(self.fake.app())
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        import asyncio

        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def test_a_search_with_a_prior_peak_runs_no_closed_loop(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """Two fake servers: `a`, whose earlier search recorded a peak, gets no closed-loop burst (its server sees the
    warm-up and the probes' requests alone) and its search starts and stops at that peak; `b`, absent from the earlier
    report, runs its closed loop as without the flag, and the log and its result say why. The report records the
    reuse (JSON, markdown) and continues a report without the flag."""
    servers = [FastThread(), FastThread()]
    try:
        path = tmp_path / "prior.json"
        path.write_text(json.dumps({"frontiers": [fr("a", 40.0, 0.05)]}))
        argv = ["--goodput-search", "--systems", "", "--system", f"a=ext:{servers[0].url}", "--system",
                f"b=ext:{servers[1].url}", "--workloads", "24:4", "--num-prompts", "10", "--search-discard", "2",
                "--search-max-probes", "2", "--search-tolerance", "0.5", "--search-itl-bounds-ms", "1000",
                "--search-shares", "0.9", "--search-only-bounds", "none", "--warmup", "1", "--out", str(tmp_path),
                "--name", "second", "--search-start-from", str(path)]
        assert compare.main([*argv, "--search-peak-from-prior"]) == 0
        log = capsys.readouterr().out
        report = json.loads((tmp_path / "second.json").read_text())
        fa, fb = report["frontiers"]
        runs = [json.loads(Path(f["path"]).read_text()) for f in (fa, fb)]
        sent = [sum(len(p["requests"]) for p in r["probes"]) for r in runs]
        assert len(servers[0].fake.bodies) == 1 + sent[0]  # the warm-up, then the probes: no closed loop
        assert len(servers[1].fake.bodies) == 1 + 10 + sent[1]  # b: its closed loop of 10 at once
        s = fa["search"]
        assert (s["peak_request_throughput"], s["peak_lifetime_s"], s["start_rate"], s["max_rate"]) == (
            40.0, 0.05, 20.0, 40.0)
        assert s["peak_reused_from"] == s["peak_measured_in"] == str(path) and runs[0]["peak"] is None
        assert "peak_reused_from" not in fb["search"] and runs[1]["peak"] is not None
        assert "no earlier search of b on fixed 24:4" in fb["search"]["peak_not_reused"]
        assert report["search_peak_from_prior"] is True and "search_peak_from_prior" not in report["search"]
        assert f"closed loop not run: its peak 40.00 req/s, median E2E 0.05 s, reused from {path}" in log
        assert "b on fixed 24:4: no earlier search of b" in log
        assert "closed-loop peak 40 reused from prior.json" in (tmp_path / "second.md").read_text()
        # a report with reused peaks continues (and merges with) one without the flag, and the other way round
        cont = _load("compare_continue")
        plain = compare.build_parser().parse_args(argv)
        plain.search = compare.search_config(plain)
        (w,) = compare.workload_list(plain)
        assert cont.load_prior(str(tmp_path / "second.json"), compare.report_meta(plain, [w]))
    finally:
        for s in servers:
            s.close()


def test_a_peak_of_the_same_title_with_other_workload_flags_is_not_reused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A trace's title names its file only: another window (--num-prompts), start or arrivals gives another closed
    loop, so the report's workload flags must equal this run's (compare.py's header writes them with
    `workload_flags`); the same flags reuse it."""
    title = "trace mooncake_conversation.jsonl.gz"
    flags = prior.workload_flags("", ["--workload", "trace", "--trace", "t.jsonl.gz", "--num-prompts", "256"])
    assert flags == "--workload trace --trace t.jsonl.gz --num-prompts 256"
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"model": "m", "serve_args": "", "workloads": [{"title": title, "flags": flags}],
                                "frontiers": [{**fr("duet", 1.67, 21.9), "title": title}]}))
    peaks = prior.load_searches([str(path)])[1]
    here = {"model": "m", "serve_args": ""}
    assert prior.peak_for(peaks, "duet", title, {**here, "workload": flags})[0] is not None
    other = prior.workload_flags("", ["--workload", "trace", "--trace", "t.jsonl.gz", "--num-prompts", "512"])
    known, why = prior.peak_for(peaks, "duet", title, {**here, "workload": other})
    assert known is None and "workload (" in why and "--num-prompts 512" in why
