"""bench/compare.py --goodput-search: the systems (ours and vLLM's settings), the time budget's shares, the better
vLLM and our ratios (pure), and one comparison on CPU continued by a second run with a stand-in vLLM."""

from __future__ import annotations

import json
import shutil
import sys
from typing import Any

import pytest

from tests.test_bench_compare import FAKE_SERVE_VLLM, _load

compare = _load()
frontier = _load("compare_frontier")


def test_frontier_systems_and_vllm_settings() -> None:
    got = compare.parse_systems("rapidserve,always-fused,always-split,vllm-best", [])
    assert [(s.label, s.kind, s.flags) for s in got] == [
        ("rapidserve", "rapidserve", ""), ("always-fused", "rapidserve", "--mode hybrid"),
        ("always-split", "rapidserve", "--mode rapid --policy rapid"),
        ("vllm", "vllm", ""), ("vllm:--max-num-batched-tokens 1024", "vllm", "--max-num-batched-tokens 1024"),
        ("vllm:--max-num-batched-tokens 2048", "vllm", "--max-num-batched-tokens 2048"),
        ("vllm:--performance-mode interactivity", "vllm", "--performance-mode interactivity")]
    # With --goodput-search a bare `vllm` is every setting; `vllm:` alone is vLLM's defaults; a sweep keeps one.
    assert len(compare.parse_systems("vllm", [], search=True)) == 4
    assert [s.label for s in compare.parse_systems("vllm:", [], search=True)] == ["vllm"]
    assert [s.label for s in compare.parse_systems("vllm", [])] == ["vllm"]
    assert compare.parse_systems("hybrid-8192", [])[0].flags == "--mode hybrid --max-num-batched-tokens 8192"  # kept


def test_dry_run_defaults_to_the_frontier_systems(capsys: pytest.CaptureFixture[str]) -> None:
    assert compare.main(["--dry-run", "--goodput-search", "--workloads", "4096:64", "--port", "8123"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out[:3]] == ["rapidserve", "always-fused", "always-split"]
    assert out[0].endswith("--port 8123") and out[1].endswith("--port 8123 --mode hybrid")
    assert compare.main(["--dry-run", "--workloads", "4096:64"]) == 0  # a sweep: every named system but those three
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines[:-1]] == list(compare.SWEEP_SYSTEMS)
    assert "duet" in compare.SWEEP_SYSTEMS and "rapidserve" not in compare.SWEEP_SYSTEMS
    assert lines[-1].startswith("workload fixed 4096:64")


@pytest.mark.parametrize("argv,match", [
    (["--search-tolerance", "0.1"], "--search-tolerance only apply with --goodput-search"),
    (["--goodput-search", "--peak-fractions", "0.5", "--rates", "inf"], "--peak-fractions belong to a sweep"),
    (["--goodput-search", "--duration-s", "30"], "--duration-s belong to a sweep"),
    (["--goodput-search", "--search-tolerance", "2"], "--search-tolerance 2"),
    (["--goodput-search", "--workload-args", "--workload trace --trace t.csv"], "--trace-arrivals poisson"),
    (["--goodput-search", "--bench-args", "--duration-s 5"], "drop --duration-s"),
    (["--goodput-search", "--search-max-probes", "1000"], "at most 999"),
])
def test_search_flag_errors(argv: list[str], match: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        compare.main(["--dry-run", "--systems", "rapidserve", *argv])
    assert ei.value.code == 2 and match in capsys.readouterr().err


@pytest.mark.parametrize("now,deadline,left,reserve,want", [
    (0.0, None, 3, 0.0, None), (0.0, 300.0, 1, 0.0, 300.0), (0.0, 300.0, 3, 0.0, 100.0),
    (100.0, 400.0, 2, 180.0, 160.0), (100.0, 200.0, 2, 180.0, 100.0),  # nothing left after the reserve: now
])
def test_search_deadline(now: float, deadline: float | None, left: int, reserve: float, want: float | None) -> None:
    assert frontier.search_deadline(now, deadline, left, reserve) == want


def test_startup_reserve() -> None:
    assert frontier.startup_reserve(["vllm", "rapidserve", "ext"]) == 240.0 and frontier.startup_reserve([]) == 0.0


def g(bound: float | None, share: float, lo: float | None, hi: float | None, status: str = "converged") -> dict:
    return {"itl_bound_ms": bound, "share": share, "goodput": lo or 0.0, "lo": lo, "hi": hi, "status": status}


def fr(label: str, title: str, entries: list[dict[str, Any]], finished: bool = True) -> dict[str, Any]:
    return {"label": label, "title": title, "workload": {}, "path": None, "finished": finished,
            "stopped": None if finished else "the time budget", "goodput": entries, "probes": [],
            "search": {"settings": {"itl_bounds_ms": [50.0], "shares": [0.9]}}}


FRONTIERS = [
    fr("ours", "w", [g(None, 0.9, 6.0, 6.2), g(50.0, 0.9, 3.0, 3.1)]),
    fr("vllm", "w", [g(None, 0.9, 8.0, 8.3), g(50.0, 0.9, None, 1.0, "below_min_rate")]),
    fr("vllm:--max-num-batched-tokens 1024", "w", [g(None, 0.9, 7.0, 7.2), g(50.0, 0.9, 2.0, 4.0, "unfinished")],
       finished=False),
    fr("ours", "v", [g(None, 0.9, 1.0, 1.02), g(50.0, 0.9, 0.5, 0.51)]),
    fr("vllm", "v", [g(None, 0.9, None, 0.25, "below_min_rate"), g(50.0, 0.9, None, 0.25, "below_min_rate")]),
]
META = {"model": "m", "systems": [{"label": "ours", "kind": "rapidserve", "flags": "", "status": "ok"},
                                  {"label": "vllm", "kind": "vllm", "flags": "vLLM", "status": "ok"},
                                  {"label": "vllm:--max-num-batched-tokens 1024", "kind": "vllm", "flags": "x",
                                   "status": "ok"}], "workloads": []}


def test_better_vllm_is_the_best_setting_at_each_bound() -> None:
    vllm = frontier.vllm_labels(META)
    assert frontier.better_vllm(FRONTIERS, vllm, "w", None, 0.9) == {"system": "vllm", "goodput": 8.0,
                                                                     "status": "converged"}
    assert frontier.better_vllm(FRONTIERS, vllm, "w", 50.0, 0.9) == {
        "system": "vllm:--max-num-batched-tokens 1024", "goodput": 2.0, "status": "unfinished"}
    assert frontier.better_vllm(FRONTIERS, vllm, "w", 50.0, 0.99) is None  # not searched
    vs = {(x["workload"], x["itl_bound_ms"]): x for x in frontier.versus_better_vllm(FRONTIERS, vllm)}
    assert len(vs) == 4 and all(x["system"] == "ours" for x in vs.values())
    assert vs[("w", None)]["ratio"] == 0.75 and vs[("w", None)]["exact"]
    assert vs[("w", 50.0)]["ratio"] == 1.5 and not vs[("w", 50.0)]["exact"]  # from an unfinished bracket
    assert vs[("v", None)]["ratio"] is None  # the better vLLM's goodput is 0: no ratio
    md = frontier.frontier_markdown(FRONTIERS, META)
    assert "| ours | 3 | 6 | finished |" in md and "| vllm | < 1 | 8 | finished |" in md
    assert "| vllm:--max-num-batched-tokens 1024 | [2, 4)* | 7 | unfinished (the time budget) |" in md
    assert "| **better vLLM** | 2 (`vllm:--max-num-batched-tokens 1024`) | 8 (`vllm`) | |" in md
    assert "| ours / better vLLM | 1.50x* | 0.75x | |" in md and "| ours / better vLLM | - | - | |" in md
    assert md.index("## w") < md.index("## v")


def test_no_vllm_no_better_vllm_row() -> None:
    md = frontier.frontier_markdown(FRONTIERS[:1], {"model": "m", "systems": [], "workloads": []})
    assert "| ours | 3 | 6 | finished |" in md and "better vLLM |" not in md


@pytest.mark.skipif(shutil.which("setsid") is None, reason="needs setsid")
def test_frontier_on_cpu_continued_with_a_stand_in_vllm(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "serve_vllm.sh"
    script.write_text(FAKE_SERVE_VLLM)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.setenv("FAKE_PY", sys.executable)
    monkeypatch.setenv("FAKE_RUN_DIR", str(run_dir))
    common = ["--model", "preset:tiny-llama", "--serve-args", "--device cpu --num-kv-blocks 64", "--goodput-search",
              "--workloads", "24:4", "--num-prompts", "8", "--search-discard", "2", "--search-max-probes", "2",
              "--search-tolerance", "0.5", "--token-range", "3:1000", "--warmup", "1", "--out", str(tmp_path),
              "--vllm-model", str(tmp_path), "--vllm-serve", str(script), "--vllm-run-dir", str(run_dir)]
    assert compare.main([*common, "--systems", "", "--system", "ours=--mode hybrid", "--budget-s", "120",
                         "--name", "first"]) == 0
    first = json.loads((tmp_path / "first.json").read_text())
    assert first["mode"] == "goodput_search" and first["rows"] == [] and len(first["frontiers"]) == 1
    (f,) = first["frontiers"]
    assert f["label"] == "ours" and f["title"] == "fixed 24:4" and len(f["goodput"]) == 10
    assert f["search"]["peak_request_throughput"] > 0  # started from its own closed-loop peak
    assert 1 <= len(f["probes"]) <= 2 and all(p["counted"] == 6 for p in f["probes"])
    with open(f["path"]) as fh:
        assert len(json.load(fh)["probes"][0]["requests"]) == 8  # every request in the search's own file
    assert compare.main([*common, "--systems", "vllm:", "--continue-from", str(tmp_path / "first.json"),
                         "--name", "second"]) == 0
    data = json.loads((tmp_path / "second.json").read_text())
    assert [(s["label"], s["status"]) for s in data["systems"]] == [("ours", "ok"), ("vllm", "ok")]
    assert [x["label"] for x in data["frontiers"]] == ["ours", "vllm"] and data["frontiers"][0] == f
    vs = data["versus_better_vllm"]
    assert len(vs) == 10 and all(x["system"] == "ours" and x["better_vllm_system"] == "vllm" for x in vs)
    md = (tmp_path / "second.md").read_text()
    assert "| **better vLLM** |" in md and "| ours / better vLLM |" in md
    png = tmp_path / "second__fixed-24-4_frontier.png"
    assert data["plots"] == {"fixed 24:4": str(png)} and png.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit):  # a sweep cannot continue a search's report
        compare.main(["--model", "preset:tiny-llama", "--serve-args", "--device cpu --num-kv-blocks 64",
                      "--workloads", "24:4", "--systems", "rapid-adaptive", "--continue-from",
                      str(tmp_path / "second.json"), "--out", str(tmp_path), "--dry-run"])
