"""`rapidserve bench`: flag validation, and a real sweep against a real `rapidserve serve` (CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from rapidserve.benchmark.plot import plot_sweeps, x_positions
from rapidserve.cli import build_parser, main
from tests.test_server import ROOT, Srv

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "rapidserve.cli", "bench", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.parametrize("args,needle", [
    (["--request-rate", "0"], "not positive"),
    (["--request-rate", "1,fast"], "not a number"),
    (["--request-rate", "2,2"], "twice"),
    (["--num-prompts", "0"], "must be an integer >= 1"),
    (["--num-prompts", "many"], "not an integer"),
    (["--max-concurrency", "-1"], ">= 1"),
    (["--duration-s", "0"], "> 0"),
    (["--duration-s", "nan"], "> 0"),
    (["--seed", "-3"], ">= 0"),
    (["--workload", "sharegpt"], "invalid choice"),
    (["--arrival", "gamma"], "invalid choice"),
    (["--token-range", "20000:1000"], "LO:HI"),
    (["--token-range", "5"], "LO:HI"),
    (["--base-url", "localhost:8000"], "http:// or https://"),
    (["--goodput", "ttft"], "METRIC:MS"),
    (["--goodput", "latency:5"], "ttft, tpot, itl, e2el"),
    (["--goodput", "ttft:-5"], "positive"),
    (["--goodput", "tpot:5", "tpot:6"], "twice"),
    (["--input-len", "0"], ">= 1"),
    (["--timeout-s", "0"], "> 0"),
    (["--time-scale", "0"], "not a positive finite number"),
    (["--time-scale", "1,inf"], "not a positive finite number"),
    (["--time-scale", "fast"], "not a number"),
    (["--time-scale", "2,2"], "twice"),
    (["--trace-start", "-1"], ">= 0"),
    (["--trace-arrivals", "now"], "invalid choice"),
    (["--trace-overflow", "wrap"], "invalid choice"),
    (["--block-size", "0"], ">= 1"),
])
def test_bad_flags_exit_2_saying_what_is_allowed(args: list[str], needle: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        build_parser().parse_args(["bench", *args])
    assert ei.value.code == 2
    assert needle in capsys.readouterr().err


def test_good_flags_parse() -> None:
    a = build_parser().parse_args(["bench", "--request-rate", "1,2,inf", "--goodput", "ttft:500", "itl:50",
                                   "--token-range", "3:1000", "--base-url", "http://h:1/"])
    assert a.request_rate == (1.0, 2.0, float("inf")) and a.goodput == {"ttft": 500.0, "itl": 50.0}
    assert a.token_range == (3, 1000) and a.base_url == "http://h:1" and a.func.__name__ == "cmd_bench"


@pytest.mark.parametrize("args,needle,code", [
    (["--request-rate", "1,inf", "--duration-s", "5"], "needs --num-prompts", 2),  # checked before any request
    (["--input-len", "1000", "--output-len", "100", "--max-model-len", "1024"], "needs 1100 tokens", 2),
    (["--base-url", "http://127.0.0.1:9", "--num-prompts", "1"], "cannot benchmark", 1),  # nothing listens
    (["--workload", "trace", "--trace", "/no/such/trace.csv"], "--trace /no/such/trace.csv: cannot read it", 2),
])
def test_combinations_and_unreachable_server(args: list[str], needle: str, code: int, tmp_path,  # type: ignore[no-untyped-def]
                                             capsys: pytest.CaptureFixture[str]) -> None:
    # `rapidserve bench` in this process (a process each would only repeat `sys.exit(main())` after importing it;
    # the tests against a real server below run the command as a process)
    try:
        got = main(["bench", *args, "--out-dir", str(tmp_path)])
    except SystemExit as e:  # argparse's usage errors
        got = e.code
    err = capsys.readouterr().err
    assert got == code, err
    assert needle in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())


def test_x_positions_put_inf_right_of_the_largest_rate() -> None:
    assert x_positions([1.0, 4.0, float("inf")]) == {1.0: 1.0, 4.0: 4.0, float("inf"): 8.0}
    assert x_positions([float("inf")]) == {float("inf"): 1.0}


def test_plot_several_systems(tmp_path) -> None:  # type: ignore[no-untyped-def]
    def result(label: str, scale: float, workload: dict[str, object]) -> dict[str, object]:
        runs = [{"rate": r, "summary": {"output_throughput": scale * i, "itl_ms": {"p99": 10.0 * i},
                                        "ttft_ms": {"p99": None if i == 3 else 5.0 * i}}}
                for i, r in enumerate([1.0, 2.0, "inf"], 1)]
        return {"label": label, "workload": workload, "runs": runs}

    a, b = {"name": "fixed", "input_len": 4096, "output_len": 64}, {"name": "azure-code"}
    (tmp_path / "y.json").write_text(json.dumps(result("y", 2, a)))  # a result file, as bench writes it
    path = plot_sweeps([result("x", 1, a), str(tmp_path / "y.json"), result("x", 3, b)], str(tmp_path / "p.png"),
                       title="t", itl_bounds_ms=[50, 100])
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC


@pytest.fixture(scope="module")
def smol(smol_server: Srv) -> Srv:
    return smol_server  # the embedded SmolLM2 on CPU, --max-model-len 1024, both workers (tests/conftest.py)


def test_bench_sweep_against_a_real_server(smol: Srv, tmp_path) -> None:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    own, vllm = tmp_path / "own", tmp_path / "vllm"
    r = bench("--base-url", smol.url, "--input-len", "32", "--output-len", "8", "--request-rate", "8,inf",
              "--num-prompts", "6", "--seed", "1", "--goodput", "ttft:20000", "itl:10000", "--label", "smol",
              "--out-dir", str(own), "--name", "e2e", "--warmup", "1", "--save-result", "--result-dir", str(vllm))
    assert r.returncode == 0, r.stderr[-3000:]
    assert time.monotonic() - t0 < 90
    files = {p.name for p in own.iterdir()}
    assert files == {"e2e.json", "e2e.md", "e2e.png"}
    assert (own / "e2e.png").read_bytes()[:8] == PNG_MAGIC
    res = json.loads((own / "e2e.json").read_text())
    # what vllm bench serve prints and saves: a bar per run, its table per run, its JSON per run
    assert r.stdout.count("============ Serving Benchmark Result ============") == 2
    assert "Successful requests:                     6" in r.stdout and "Total generated tokens:                  48" \
        in r.stdout
    assert "warm-up: 100%" in r.stderr and "rate 8: 100%" in r.stderr and "rate inf: 100%" in r.stderr
    saved = {json.loads(p.read_text())["request_rate"]: json.loads(p.read_text()) for p in vllm.iterdir()}
    assert set(saved) == {8.0, "inf"} and len(list(vllm.iterdir())) == 2
    for run in res["runs"]:
        v, s = saved[run["rate"]], run["summary"]
        assert (v["completed"], v["failed"], v["total_output_tokens"], v["model_id"]) == (6, 0, 48,
                                                                                        "SmolLM2-135M-Instruct")
        assert v["request_throughput"] == pytest.approx(s["request_throughput"])
        assert v["mean_ttft_ms"] == pytest.approx(s["ttft_ms"]["mean"], abs=0.01)  # the same records, rounded to 1 us
        assert v["p99_itl_ms"] == pytest.approx(s["itl_ms"]["p99"], abs=0.01) and v["request_goodput"] > 0
    assert res["label"] == "smol" and res["model"] == "SmolLM2-135M-Instruct"
    assert res["workload"]["max_model_len"] == 1024  # from /v1/models
    assert [run["rate"] for run in res["runs"]] == [8.0, "inf"]
    for run in res["runs"]:
        s = run["summary"]
        assert s["completed"] == 6 and s["failed"] == 0 and s["errors"] == {} and s["output_len_mismatches"] == 0
        assert s["total_output_tokens"] == 48 and s["total_input_tokens"] == 6 * 32
        assert s["request_throughput"] > 0 and s["output_throughput"] > 0 and s["duration_s"] > 0
        assert s["total_token_throughput"] > s["output_throughput"]
        assert s["goodput"] == pytest.approx(s["request_throughput"])  # generous bounds: every request is good
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            d = s[key]
            assert 0 < d["median"] <= d["p90"] <= d["p99"] and d["mean"] > 0, (key, d)
        assert s["e2el_ms"]["median"] >= s["ttft_ms"]["median"]
        for q in run["requests"]:
            assert q["success"] and q["prompt_tokens"] == 32 and q["output_tokens"] == 8  # ignore_eos honoured
            assert len(q["itl_s"]) == 7 and q["ttft_s"] > 0 and q["e2e_s"] >= q["ttft_s"]
            assert q["start_s"] >= q["scheduled_s"] >= 0
    md = (own / "e2e.md").read_text()
    assert "| 8 | 6 | 0 |" in md and "| inf | 6 | 0 |" in md and "| inf | ITL |" in md


def test_bench_trace_replay_against_a_real_server(smol: Srv, tmp_path) -> None:  # type: ignore[no-untyped-def]
    trace = os.path.join(ROOT, "tests", "data", "azure_code_2023_excerpt.csv.gz")
    r = bench("--base-url", smol.url, "--workload", "trace", "--trace", trace, "--time-scale", "10",
              "--max-model-len", "64", "--trace-overflow", "skip", "--num-prompts", "2", "--label", "smol",
              "--out-dir", str(tmp_path), "--name", "tr", "--no-plot")
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "tr.json").read_text())
    t = res["trace"]
    assert (t["replayed"], t["skipped"], t["clipped"], t["format"]) == (2, 6, 0, "azure")  # lines 6 and 9 fit
    [run] = res["runs"]
    assert run["time_scale"] == 10.0 and run["summary"]["completed"] == 2 and run["summary"]["failed"] == 0
    assert sorted((q["prompt_tokens"], q["output_tokens"]) for q in run["requests"]) == [(34, 12), (34, 23)]
    md = (tmp_path / "tr.md").read_text()
    assert "azure_code_2023_excerpt.csv.gz (azure)" in md and "(x10)" in md and "6 skipped" in md
