"""`rapidserve bench --goodput-search`: its flags, its report and plot, and one search against a real
`rapidserve serve` (CPU, the embedded model)."""

from __future__ import annotations

import json
import re
import sys
import time
from typing import Any

import pytest

from rapidserve.benchmark.goodput import AT_MAX, BELOW_MIN, CONVERGED, NOT_SEARCHED, UNFINISHED
from rapidserve.benchmark.goodput_report import goodput_cell, search_block, search_markdown, write_search_outputs
from rapidserve.benchmark.plot import PLOT_NEEDS
from rapidserve.benchmark.results import frontier_points
from rapidserve.benchmark.search_config import SearchConfig
from rapidserve.cli import build_parser, main
from tests.test_bench_cli import PNG_MAGIC, bench
from tests.test_server import Srv


@pytest.mark.parametrize("args,needle", [
    (["--search-shares", "0.9,1.5"], "not a share in (0, 1]"),
    (["--search-shares", "0.9,0.9"], "twice"),
    (["--search-itl-bounds-ms", "25,-5"], "must be a number > 0"),
    (["--search-max-probes", "0"], ">= 1"),
    (["--search-discard", "-1"], ">= 0"),
    (["--budget-s", "0"], "> 0"),
    (["--search-only-bounds", "50,x"], "'x' is not a number"),
    (["--search-only-bounds", "none,unbounded"], "unbounded appears twice"),
])
def test_bad_search_flags_exit_2(args: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        build_parser().parse_args(["bench", "--goodput-search", *args])
    assert ei.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize("args,needle", [
    (["--search-tolerance", "0.1"], "--search-tolerance only apply with --goodput-search"),
    (["--budget-s", "30"], "--budget-s only apply with --goodput-search"),
    (["--goodput-search", "--request-rate", "1,2"], "--request-rate set a sweep's load"),
    (["--goodput-search", "--duration-s", "10"], "--duration-s set a sweep's load"),
    (["--goodput-search", "--arrival", "fixed"], "Poisson"),
    (["--goodput-search", "--workload", "trace", "--trace", "t.csv"], "--trace-arrivals poisson"),
    # a trace's --duration-s is its window, not a sweep's load: accepted, and the file is read next
    (["--goodput-search", "--workload", "trace", "--trace", "/no/such.csv", "--trace-arrivals", "poisson",
      "--duration-s", "5"], "--trace /no/such.csv: cannot read it"),
    (["--goodput-search", "--search-tolerance", "1.5"], "--search-tolerance 1.5"),
    (["--goodput-search", "--search-start-rate", "8", "--search-max-rate", "4"], "--search-max-rate"),
    (["--goodput-search", "--num-prompts", "10", "--search-discard", "10"], "leaves nothing"),
    (["--goodput-search", "--search-only-bounds", "30"], "--search-only-bounds 30: give one or more of the bounds"),
    (["--search-only-bounds", "50"], "--search-only-bounds only apply with --goodput-search"),
])
def test_search_flag_combinations_exit_2_before_any_request(args: list[str], needle: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    # nothing listens on port 9: a check that passed would fail with exit 1 instead
    assert main(["bench", "--base-url", "http://127.0.0.1:9", *args]) == 2
    assert needle in capsys.readouterr().err


def test_search_flags_make_the_search_config() -> None:
    from rapidserve.benchmark.search_flags import search_from_args

    a = build_parser().parse_args(["bench", "--goodput-search", "--search-itl-bounds-ms", "100,30",
                                   "--search-shares", "0.95", "--search-max-probes", "5", "--budget-s", "60",
                                   "--num-prompts", "40"])
    assert search_from_args(a) == SearchConfig(itl_bounds_ms=(30.0, 100.0), shares=(0.95,), max_probes=5,
                                               budget_s=60.0)
    a = build_parser().parse_args(["bench", "--goodput-search", "--search-only-bounds", "50,unbounded"])
    assert search_from_args(a) == SearchConfig(only_bounds=(None, 50.0))


# a rapidserve server's steps over a probe (benchmark/step_mix.py)
STEPS = {"fused": {"steps": 75, "measured_s": 3.3, "over_slo": 3, "predicted_s": 3.0, "predicted_measured_s": 3.3},
         "split": {"steps": 25, "measured_s": 0.5, "over_slo": 0, "predicted_s": 0.5, "predicted_measured_s": 0.5}}


def result(goodput: list[dict[str, Any]], label: str = "sys") -> dict[str, Any]:
    """A search result as run_goodput_search writes it, with two probes."""
    def probe(rate: float, order: int, att: dict[str, float], **server: Any) -> dict[str, Any]:
        return {"rate": rate, "order": order, "counted": 64, "attainment": att,
                "summary": {"ttft_ms": {"p99": 900.0}, "itl_ms": {"p99": 40.0}, "failed": 0}, **server}

    return {"kind": "goodput_search", "label": label, "base_url": "http://h:1", "model": "m",
            "workload": {"name": "fixed", "input_len": 4096, "output_len": 64}, "created": "now",
            "search": {"settings": {"itl_bounds_ms": [50.0, 100.0], "shares": [0.9, 0.99], "start_fraction": 0.5,
                                    "tolerance": 0.05, "max_probes": 12, "discard": 16},
                       "start_rate": 4.0, "min_rate": 1.0, "max_rate": 32.0, "probe_requests": 80,
                       "peak_request_throughput": 8.0},
            "probes": [probe(4.0, 1, {"unbounded": 1.0, "100": 0.95, "50": 0.5}),
                       probe(8.0, 2, {"unbounded": 0.5, "100": 0.2, "50": 0.0}, server_steps=STEPS)],
            "goodput": goodput, "finished": False, "stopped": "the time budget"}


def g(bound: float | None, share: float, lo: float | None, hi: float | None, status: str) -> dict[str, Any]:
    return {"itl_bound_ms": bound, "share": share, "goodput": lo or 0.0, "lo": lo, "hi": hi, "status": status}


GOODPUT = [g(None, 0.9, 6.0, 6.25, CONVERGED), g(None, 0.99, 4.0, 8.0, UNFINISHED),
           g(100.0, 0.9, 4.0, 4.2, CONVERGED), g(100.0, 0.99, None, 4.0, UNFINISHED),
           g(50.0, 0.9, None, 1.0, BELOW_MIN), g(50.0, 0.99, None, 1.0, BELOW_MIN)]


@pytest.mark.parametrize("e,cell", [
    (g(None, 0.9, 6.0, 6.25, CONVERGED), "6"), (g(None, 0.9, 5.125, 5.3, CONVERGED), "5.12"),
    (g(50.0, 0.9, None, 1.0, BELOW_MIN), "< 1"), (g(None, 0.9, 32.0, None, AT_MAX), ">= 32"),
    (g(None, 0.9, 4.0, 8.0, UNFINISHED), "[4, 8)*"), (g(None, 0.9, None, 4.0, UNFINISHED), "[0, 4)*"),
    (g(None, 0.9, 4.0, None, UNFINISHED), "[4, ?)*"), (None, "-"),
    (g(50.0, 0.9, 4.0, 8.0, NOT_SEARCHED), "-"),  # a bound outside --search-only-bounds: scored, not searched
])
def test_goodput_cell(e: dict[str, Any] | None, cell: str) -> None:
    assert goodput_cell(e) == cell


def test_search_markdown_and_plot(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    res = result(GOODPUT)
    md = search_markdown(res)
    assert "| 50 ms | < 1 | < 1 |" in md and "| 100 ms | 4 | [0, 4)* |" in md and "| unbounded | 6 | [4, 8)* |" in md
    assert "UNFINISHED: the time budget" in md and "0.5 x the closed-loop peak 8 req/s" in md
    assert "not a sweep's `--goodput` column" in md
    assert "reused from" not in md and "reused from" not in search_block(res)
    res["search"]["peak_reused_from"] = "/r/prior.json"  # bench/compare.py --search-peak-from-prior
    assert "0.5 x the closed-loop peak 8 req/s, reused from /r/prior.json" in search_markdown(res)
    assert re.search(r"Closed-loop peak reused from: +prior\.json", search_block(res))
    del res["search"]["peak_reused_from"]
    # attainment, tightest bound first; the server's steps where it counted them (a server without: -)
    assert "| 4 | 1 | 64 | 50.0% | 95.0% | 100.0% | 900 | 40.0 | 0 | - |" in md
    assert ("| 8 | 2 | 64 | 0.0% | 20.0% | 50.0% | 900 | 40.0 | 0 | fused 75% (44.0 ms; 1.10, 4.0%) / split 25% "
            "(20.0 ms; 1.00, 0%) |") in md
    assert "| failed | server steps: kind share (mean step; measured/predicted, over SLO) |" in md
    assert frontier_points(res, 0.9) == [(50.0, 0.0), (100.0, 4.0), (None, 6.0)]
    only = result([{**e, "status": NOT_SEARCHED} if e["itl_bound_ms"] is not None else e for e in GOODPUT])
    only["search"]["settings"]["only_bounds"] = [None]
    assert frontier_points(only, 0.9) == [(50.0, None), (100.0, None), (None, 6.0)]  # no point where not searched
    assert "| 100 ms | - | - |" in search_markdown(only) and "searched at unbounded only; " in search_markdown(only)
    paths, note = write_search_outputs(res, str(tmp_path), "gs")
    assert note is None and (tmp_path / "gs.png").read_bytes()[:8] == PNG_MAGIC
    assert json.loads((tmp_path / "gs.json").read_text())["goodput"][1]["status"] == UNFINISHED
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: the rest is written, and said
    paths, note = write_search_outputs(res, str(tmp_path / "nompl"), "gs")
    assert note == PLOT_NEEDS and "pip install rapidserve[bench]" in note and set(paths) == {"json", "md"}
    assert sorted(p.name for p in (tmp_path / "nompl").iterdir()) == ["gs.json", "gs.md"]


@pytest.fixture(scope="module")
def smol(smol_server: Srv) -> Srv:
    return smol_server  # the embedded SmolLM2 on CPU, --max-model-len 1024, both workers (tests/conftest.py)


def test_goodput_search_against_a_real_server(smol: Srv, tmp_path) -> None:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    r = bench("--goodput-search", "--base-url", smol.url, "--input-len", "16", "--output-len", "4",
              "--num-prompts", "8", "--search-discard", "2", "--search-start-rate", "4", "--search-max-probes", "2",
              "--search-tolerance", "0.5", "--budget-s", "25", "--warmup", "2", "--seed", "1", "--label", "smol",
              "--out-dir", str(tmp_path), "--name", "gs")
    assert r.returncode == 0, r.stderr[-3000:]
    assert time.monotonic() - t0 < 90
    assert {p.name for p in tmp_path.iterdir()} == {"gs.json", "gs.md", "gs.png"}
    assert "probe 1 at 4 req/s: 100%" in r.stderr  # a progress bar per probe
    # and a line as each ends: its warm-up (no lifetime known before it: the discard alone) and lifetime
    assert re.search(r"probe 1 at 4 req/s, \d+ counted: attainment .*; warm-up 2 arrivals \(0 s\), lifetime [0-9.]+ s",
                     r.stdout), r.stdout
    assert "============= Goodput Search Result ==============" in r.stdout  # its table, printed at the end
    # 6 counted a probe: 90% allows no miss either, and the preamble says so for both shares
    assert "share 0.99: with 6 requests counted a probe, 99% allows no miss" in r.stdout, r.stdout
    assert "share 0.9: with 6 requests counted a probe, 90% allows no miss" in r.stdout
    res = json.loads((tmp_path / "gs.json").read_text())
    assert res["kind"] == "goodput_search" and res["label"] == "smol" and res["peak"] is None  # a start rate given
    s = res["search"]
    assert (s["start_rate"], s["min_rate"], s["max_rate"], s["probe_requests"]) == (4.0, 1.0, 32.0, 8)
    probes = res["probes"]
    assert s["max_probe_arrivals"] == 1024 and s["peak_lifetime_s"] is None  # no closed-loop run: no estimate
    firsts = [p for p in probes if not p["ramp"]["rerun"]]  # a short probe's re-run repeats its rate
    assert 1 <= len(probes) <= 2 and probes[0]["rate"] == 4.0 and len({p["rate"] for p in firsts}) == len(firsts)
    for p in probes:
        ramp = p["ramp"]  # the ramp rule: a warm-up of at least the 2 discarded, then the 6 it means to count
        assert ramp["wanted"] == 6 and ramp["warmup"] >= 2 and len(p["requests"]) == ramp["sent"] == ramp["warmup"] + 6
        assert ramp["lifetime_s"] > 0 and p["counted"] == ramp["counted"] == 6 - ramp["cut"]
        assert ramp["verdict"] == ("steady" if ramp["counted"] >= ramp["minimum"] == 6 else "short")
        assert p["summary"]["completed"] == ramp["sent"] and p["summary"]["failed"] == 0
        assert set(p["attainment"]) == {"unbounded", "25", "50", "100", "200"}
        assert all(0.0 <= v <= 1.0 for v in p["attainment"].values())
        att = [p["attainment"][k] for k in ("25", "50", "100", "200", "unbounded")]
        assert att == sorted(att)  # a looser bound is met by at least as many requests
        for q in p["requests"]:
            assert q["output_tokens"] == 4 and len(q["itl_s"]) == 3
    assert len(res["goodput"]) == 10 and res["finished"] == (res["stopped"] is None)
    for e in res["goodput"]:
        assert e["status"] in (CONVERGED, BELOW_MIN, AT_MAX, UNFINISHED)
        rates = {p["rate"] for p in probes}
        assert (e["lo"] is None or e["lo"] in rates) and (e["hi"] is None or e["hi"] in rates)
    for q in (0.9, 0.99):  # goodput never rises as the bound tightens
        gs = [e["goodput"] for b in (None, 200.0, 100.0, 50.0, 25.0) for e in res["goodput"]
              if e["itl_bound_ms"] == b and e["share"] == q]
        assert len(gs) == 5 and gs == sorted(gs, reverse=True)
    md = (tmp_path / "gs.md").read_text()
    head = f"| 4 | 1 | {probes[0]['counted']} | warm-up {probes[0]['ramp']['warmup']} arrivals ("
    assert "| unbounded |" in md and head in md and "rapidserve bench goodput search: smol" in md
    # the server's steps over each probe (its /metrics before and after): rapid mode's decode steps are all split
    # ones. The workers send their counts every 0.25 s, so the scrapes see the steps up to a quarter second late:
    # the first probe (8 arrivals at 4 req/s, ~2 s) counts some on any machine; a later, faster one might not
    first = probes[0]["server_steps"]
    assert set(first) == {"split"} and first["split"]["steps"] > 0 and first["split"]["measured_s"] > 0
    assert first["split"]["predicted_s"] == 0 and 0 <= first["split"]["over_slo"] <= first["split"]["steps"]
    # the host's view: token gaps (a request decoded in consecutive steps: 6 output tokens each) and idle time (none
    # measured on a CPU, where no device events are)
    split = first["split"]
    assert 0 < split["gaps"] <= split["steps"] and split["gap_s"] > 0 and 0 <= split["gaps_over_slo"] <= split["gaps"]
    assert split["idle_s"] == 0 and split["host_s"] > 0
    row = next(line for line in md.splitlines() if line.startswith(head))
    cell = r"\| split 100% \([0-9.]+ ms; -, [0-9.]+%; gaps [0-9.]+% over, idle 0\.0 ms, host [0-9.]+ ms\) \|$"
    assert re.search(cell, row), row
    assert re.search(r"server steps: split 100% \([0-9.]+ ms; -, ", r.stdout)  # said as each probe ends
