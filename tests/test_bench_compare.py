"""bench/compare.py: the comparison's definitions (pure) and one real run of two systems on CPU."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
from types import ModuleType
from typing import Any

import pytest

from tests.test_server import ROOT

INF = math.inf


def _load(name: str = "compare") -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(ROOT, "bench", f"{name}.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


compare = _load()


def req(ok: bool = True, prompt: int = 1000, ttft: float = 0.5, itl: tuple[float, ...] = (0.01,)) -> dict[str, Any]:
    return {"index": 0, "prompt_tokens": prompt, "requested_output_tokens": 2, "success": ok, "output_tokens": 2,
            "ttft_s": ttft if ok else None, "e2e_s": 1.0, "itl_s": list(itl), "error": "" if ok else "x"}


def run(rate: float | str, out_tps: float, p99_itl: float | None, failed: int = 0, completed: int = 4,
        requests: list[dict[str, Any]] | None = None, duration: float = 2.0) -> dict[str, Any]:
    return {"rate": rate, "requests": requests or [], "summary": {
        "completed": completed, "failed": failed, "duration_s": duration, "output_throughput": out_tps,
        "request_throughput": completed / duration, "itl_ms": {"p99": p99_itl}, "ttft_ms": {"p99": 100.0}}}


SWEEP = [run(1.0, 100, 20), run(2.0, 190, 45), run(4.0, 300, 80), run(8.0, 320, 140), run("inf", 310, 90, failed=1)]


@pytest.mark.parametrize("bound,rate,tps", [(100, 4.0, 300), (50, 2.0, 190), (45, 2.0, 190), (10, None, None),
                                            (1000, 8.0, 320)])
def test_best_under_itl(bound: float, rate: float | None, tps: float | None) -> None:
    got = compare.best_under_itl(SWEEP, bound)
    assert (got is None and rate is None) or (got["rate"] == rate and got["output_throughput"] == tps)


def test_peak() -> None:
    assert compare.peak(SWEEP)["rate"] == 8.0
    assert compare.peak([run(1.0, 0, None, completed=0)]) is None and compare.peak([]) is None


def test_request_goodput_counts_itl_and_the_rapid_ttft_rule() -> None:
    requests = [req(), req(itl=(0.01, 0.06)), req(prompt=100, ttft=0.2), req(ok=False), req(prompt=4000, ttft=3.9)]
    r = run(1.0, 10, 30, requests=requests, duration=2.0)
    assert compare.request_goodput(r, 100) == pytest.approx(3 / 2)  # all but the slow TTFT and the failure
    assert compare.request_goodput(r, 50) == pytest.approx(2 / 2)  # ... and the one with a 60 ms gap
    best = compare.best_goodput([r, run(2.0, 10, 30, requests=requests[:1], duration=0.5)], 50)
    assert best == {"goodput": pytest.approx(2.0), "rate": 2.0}


def test_goodput_at_p99_itl_takes_the_best_rate_within_the_bound() -> None:
    slow_ttft = req(prompt=1000, ttft=1.5)
    sweep = [run(1.0, 100, 20, requests=[req(), req()], duration=2.0),  # 1.0 req/s
             run(2.0, 190, 45, requests=[req(), req(), req(), slow_ttft], duration=2.0),  # 1.5 (TTFT rule)
             run(4.0, 300, 80, requests=[req()] * 8, duration=2.0),  # 4.0 but p99 ITL 80
             run(8.0, 320, 40, requests=[req()] * 9, failed=1, duration=2.0)]  # a failure: not counted
    assert compare.request_goodput(sweep[1]) == pytest.approx(1.5)
    assert compare.best_goodput_p99(sweep, 50) == {"goodput": pytest.approx(1.5), "rate": 2.0}
    assert compare.best_goodput_p99(sweep, 100) == {"goodput": pytest.approx(4.0), "rate": 4.0}
    assert compare.best_goodput_p99(sweep, 10) is None


def test_versus_best_hybrid() -> None:
    def row(system: str, peak: float, g100: float | None, g50: float | None) -> dict[str, Any]:
        return {"system": system, "workload": "w", "peak": {"output_throughput": peak, "rate": 4.0,
                                                             "p99_ttft_ms": 1.0},
                "goodput_p99_itl_le_100ms": None if g100 is None else {"goodput": g100, "rate": 4.0},
                "goodput_itl_le_100ms": {"goodput": 1.0, "rate": 4.0}}
    rows = [row("rapid", 400, 6.0, None), row("hybrid-512", 300, 3.0, None), row("hybrid-8192", 440, 4.0, None),
            {**row("other", 1, 1, None), "workload": "v"}]
    got = compare.versus_best_hybrid(rows, [100])
    assert got == [{"system": "rapid", "workload": "w", "peak": pytest.approx(400 / 440),
                    "goodput_p99_itl_le_100ms": pytest.approx(1.5), "goodput_itl_le_100ms": pytest.approx(1.0)}]
    md = compare.to_markdown([{**r, "itl_le_100ms": None} for r in rows[:3]], [100], {"model": "m"})
    assert "| rapid | 0.91x | 1.50x | 1.00x |" in md


def test_table_row_and_markdown() -> None:
    result = {"label": "sys", "workload": {"name": "fixed", "input_len": 4096, "output_len": 64}, "runs": SWEEP,
              "skipped_rates": [16.0]}
    row = compare.table_row("sys", result, [100, 50])
    assert row["workload"] == "fixed 4096:64" and row["itl_le_100ms"]["rate"] == 4.0
    assert row["itl_le_50ms"]["rate"] == 2.0 and row["skipped_rates"] == [16.0]
    md = compare.to_markdown([row], [100, 50], {"model": "m", "systems": [{"label": "sys", "flags": "-x",
                                                                          "status": "ok"}]})
    assert "## fixed 4096:64" in md and "| sys | 320 @ 8 | 100 | 300 @ 4 | 100 |" in md


@pytest.mark.parametrize("text,want", [("4096:64", ("fixed", 4096, 64)), ("azure-code", ("azure-code", 1024, 128))])
def test_parse_workload(text: str, want: tuple[str, int, int]) -> None:
    w = compare.parse_workload(text)
    assert (w.name, w.input_len, w.output_len) == want


@pytest.mark.parametrize("text", ["4096", "4096:0", "a:b", "sharegpt", "1:2:3"])
def test_parse_workload_errors(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="IN:OUT"):
        compare.parse_workload(text)


def test_select_systems_and_dry_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert compare.main(["--dry-run", "--systems", "rapid-adaptive,hybrid-2048", "--system", "x=--mode rapid",
                         "--serve-args", "--max-model-len 8192", "--port", "8123"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and out[0].startswith("rapid-adaptive: ") and out[0].endswith(
        "--port 8123 --max-model-len 8192 --mode rapid --partition adaptive")
    assert out[1].endswith("--mode hybrid --max-num-batched-tokens 2048") and out[2].endswith("--mode rapid")
    for bad in (["--systems", "nope"], ["--system", "noequals"], ["--systems", ""]):
        with pytest.raises(SystemExit) as ei:
            compare.main(["--dry-run", *bad])
        assert ei.value.code == 2


def test_compare_two_systems_on_cpu(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # a tokenizer-less preset (token ids in and out), one system that serves and one that cannot start
    rc = compare.main(["--model", "preset:tiny-llama", "--serve-args", "--device cpu --num-kv-blocks 64",
                       "--systems", "", "--system", "plain=", "--system", "broken=--mode no-such-mode",
                       "--workloads", "24:4", "--rates", "20,inf", "--num-prompts", "4", "--token-range", "3:1000",
                       "--warmup", "1", "--out", str(tmp_path), "--name", "cmp"])
    assert rc == 1  # one system did not start
    data = json.loads((tmp_path / "cmp.json").read_text())
    status = {s["label"]: s["status"] for s in data["systems"]}
    assert status["plain"] == "ok" and status["broken"].startswith("did not start: the server exited with code 2")
    assert [r["system"] for r in data["rows"]] == ["plain"] and data["rows"][0]["peak"]["output_throughput"] > 0
    (sweep,) = data["sweeps"]
    assert [x["summary"]["completed"] for x in sweep["runs"]] == [4, 4] and os.path.exists(sweep["path"])
    assert (tmp_path / "cmp.png").read_bytes()[:4] == b"\x89PNG" and "| plain |" in (tmp_path / "cmp.md").read_text()
    assert (tmp_path / "compare_logs" / "cmp__broken.log").read_text()  # the server's error is kept


def test_gap_report_splits_first_and_later_gaps(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    gaps = _load("gap_report")
    requests = [req(itl=(0.06, 0.01, 0.01)), req(itl=(0.01, 0.01, 0.07)), req(itl=(0.02, 0.02, 0.02)),
                req(ok=False), req(itl=(0.01,))]  # the failure and the one-gap request are left out
    result = {"label": "sys", "runs": [run(2.0, 10, 30, requests=requests)]}
    rows = gaps.gap_rows("sys", result, 50)
    assert len(rows) == 1 and rows[0][:3] == ["sys", "2", "3"]
    assert rows[0][-2:] == ["33%", "33%"]  # one first gap over 50 ms, one request with a later one
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(result))
    assert gaps.main([str(path), "--bound-ms", "50"]) == 0
    assert "| sys | 2 | 3 |" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text('{"label": "x"}')
    for argv in ([str(tmp_path / "bad.json")], [str(tmp_path / "missing.json")], [str(path), "--bound-ms", "-1"]):
        with pytest.raises(SystemExit) as e:
            gaps.main(argv)
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "no 'runs' list" in err and "not a readable sweep result" in err and "--bound-ms" in err
