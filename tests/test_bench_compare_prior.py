"""bench/compare.py --search-start-from (bench/compare_prior.py): earlier reports' brackets as each search's hints."""

from __future__ import annotations

import json
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

    async def fake(cfg: Any, scfg: Any, deadline: Any = None, shared_peak: float | None = None) -> dict[str, Any]:
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
