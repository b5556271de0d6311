"""bench/compare.py: the comparison's definitions (pure) and one real run of two systems on CPU."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import shutil
import sys
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
args = _load("compare_args")
servers = _load("compare_servers")


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
    # peak at rate 8: 320 tok/s, 4 requests in 2 s, no TTFT p50 in this summary, p99 TTFT 100, p99 ITL 140
    assert "## fixed 4096:64" in md and "| sys | 320 @ 8 | 2.00 | - | 100 | 140.0 | 300 @ 4 | 100 |" in md
    assert "vs vLLM" not in md  # no vLLM system ran


@pytest.mark.parametrize("text,want", [
    ("4096:64", ["--workload", "fixed", "--input-len", "4096", "--output-len", "64"]),
    ("azure-code", ["--workload", "azure-code"]), (" multiturn", ["--workload", "multiturn"])])
def test_parse_workload(text: str, want: list[str]) -> None:
    assert compare.parse_workload(text) == want


@pytest.mark.parametrize("text", ["4096", "4096:0", "a:b", "sharegpt", "1:2:3"])
def test_parse_workload_errors(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="IN:OUT"):
        compare.parse_workload(text)


def test_select_systems_and_dry_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert compare.main(["--dry-run", "--systems", "rapid-adaptive,hybrid-2048", "--system", "x=--mode rapid",
                         "--serve-args", "--max-model-len 8192", "--port", "8123"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 5 and out[0].startswith("rapid-adaptive: ") and out[0].endswith(
        "--port 8123 --max-model-len 8192 --mode rapid --partition adaptive --policy rapid")
    assert out[1].endswith("--mode hybrid --max-num-batched-tokens 2048") and out[2].endswith("--mode rapid")
    assert out[3:] == ["workload fixed 4096:64: rapidserve bench --workload fixed --input-len 4096 --output-len 64",
                       "workload fixed 4096:1024: rapidserve bench --workload fixed --input-len 4096 --output-len 1024"]
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


# ---------------------------------------------------------------- vLLM and external systems (issue 15, item 0)


def test_parse_systems_ours_vllm_and_external() -> None:
    got = compare.parse_systems("rapid-adaptive, vllm,vllm:--no-enable-prefix-caching,ext:http://10.0.0.1:8000/",
                                ["mine=--mode rapid", "v1024=vllm:--max-num-batched-tokens 1024",
                                 "prod=ext:https://llm.example:443"])
    assert [(s.label, s.kind, s.flags, s.url) for s in got] == [
        ("rapid-adaptive", "rapidserve", compare.SYSTEMS["rapid-adaptive"], ""),
        ("vllm", "vllm", "", ""),
        ("vllm:--no-enable-prefix-caching", "vllm", "--no-enable-prefix-caching", ""),
        ("http://10.0.0.1:8000", "ext", "", "http://10.0.0.1:8000"),
        ("mine", "rapidserve", "--mode rapid", ""),
        ("v1024", "vllm", "--max-num-batched-tokens 1024", ""),
        ("prod", "ext", "", "https://llm.example:443")]
    assert got[2].describe() == "vLLM --no-enable-prefix-caching" and got[6].describe().endswith("llm.example:443")
    assert compare.vllm_baseline(got, None) == "vllm" and compare.vllm_baseline(got, "prod") == "prod"
    assert compare.vllm_baseline(got[:1], None) is None


@pytest.mark.parametrize("names,extra,match", [
    ("nope", [], "unknown nope"), ("", ["noequals"], "LABEL=FLAGS"), ("", [], "no systems"),
    ("ext:ftp://x", [], "not an http"), ("vllm,vllm", [], "two systems are labelled 'vllm'"),
    ("vllm:--x 'open", [], "quotation"), ("rapid-adaptive", ["rapid-adaptive=--mode hybrid"], "two systems")])
def test_parse_systems_errors(names: str, extra: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        compare.parse_systems(names, extra)


def test_shared_serve_flags_and_the_vllm_command() -> None:
    serve = "--device cuda --max-model-len 8192 --gpu-memory-utilization=0.8 --mps off --enforce-eager " \
            "--max-num-seqs 64 --max-num-batched-tokens 4096 --num-kv-blocks 9"
    shared = ["--max-model-len", "8192", "--gpu-memory-utilization", "0.8", "--enforce-eager", "--max-num-seqs", "64",
              "--max-num-batched-tokens", "4096"]
    assert compare.shared_serve_flags(serve) == shared
    assert compare.shared_serve_flags("") == [] and compare.shared_serve_flags("--max-model-len") == []
    script = compare.vllm_command("/m", 8100, serve, "--max-num-batched-tokens 1024 --no-enable-prefix-caching",
                                  "/s/serve_vllm.sh")
    assert script == ["bash", "/s/serve_vllm.sh", "/m", "8100", *shared, "--max-num-batched-tokens", "1024",
                      "--no-enable-prefix-caching"]  # the system's own flags come last and win
    direct = compare.vllm_command("/m", 8100, "", "", None, python="py")
    assert direct == ["py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m", "--load-format", "dummy",
                      "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", "8100"]


def test_find_vllm_serve(tmp_path) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path / "repo"
    root.mkdir()
    assert compare.find_vllm_serve("none", str(root)) is None and compare.find_vllm_serve("", str(root)) is None
    assert compare.find_vllm_serve("/x/serve.sh", str(root)) == "/x/serve.sh"
    assert compare.find_vllm_serve(None, str(root)) is None
    beside = tmp_path / "shared" / "peer_vllm"
    beside.mkdir(parents=True)
    (beside / "serve_vllm.sh").write_text("")
    assert compare.find_vllm_serve(None, str(root)) == str(beside / "serve_vllm.sh")
    inside = root / "shared" / "peer_vllm"
    inside.mkdir(parents=True)
    (inside / "serve_vllm.sh").write_text("")
    assert compare.find_vllm_serve(None, str(root)) == str(inside / "serve_vllm.sh")  # the repo's own first


def test_dry_run_prints_the_vllm_command(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "serve_vllm.sh"
    script.write_text("")
    common = ["--dry-run", "--systems", "vllm,rapid-adaptive", "--system", "nopc=vllm:--no-enable-prefix-caching",
              "--system", "far=ext:http://10.1.2.3:9000", "--vllm-model", "/root/peermodel", "--port", "8100",
              "--serve-args", "--max-model-len 8192 --gpu-memory-utilization 0.8 --mps off"]
    assert compare.main([*common, "--vllm-serve", str(script)]) == 0
    out = capsys.readouterr().out.splitlines()
    vflags = "--max-model-len 8192 --gpu-memory-utilization 0.8"
    assert out[0] == f"vllm: bash {script} /root/peermodel 8100 {vflags}"
    assert out[1].endswith("--port 8100 --max-model-len 8192 --gpu-memory-utilization 0.8 --mps off --mode rapid "
                           "--partition adaptive --policy rapid")
    assert out[2] == f"nopc: bash {script} /root/peermodel 8100 {vflags} --no-enable-prefix-caching"
    assert out[3] == "far: external server at http://10.1.2.3:9000 (not started)"
    assert compare.main([*common, "--vllm-serve", "none"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("-m vllm.entrypoints.openai.api_server --model /root/peermodel --load-format dummy "
                           f"--dtype bfloat16 --host 127.0.0.1 --port 8100 {vflags}")


@pytest.mark.parametrize("argv,match", [
    (["--systems", "vllm"], "needs --vllm-model"),
    (["--systems", "vllm", "--vllm-model", "/m", "--vllm-serve", "/no/such/serve_vllm.sh"], "no such file"),
    (["--systems", "rapid-adaptive", "--vllm-baseline", "vllm"], "none of the systems"),
    (["--systems", "rapid-adaptive", "--workloads", "sharegpt"], "IN:OUT"),
    (["--systems", "rapid-adaptive", "--workload-args", "--workload multiturn --no-such-flag"], "unrecognized"),
    (["--systems", "rapid-adaptive", "--bench-args", "--num-turns 0"], "--num-turns"),
    (["--systems", "rapid-adaptive", "--workloads", "multiturn", "--bench-args", "--workload nope"], "invalid choice"),
])
def test_main_argument_errors(argv: list[str], match: str, capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as ei:
        compare.main(["--dry-run", *argv])
    assert ei.value.code == 2 and match in capsys.readouterr().err


def test_workloads_pass_through_to_the_bench_parser() -> None:
    a = compare.build_parser().parse_args([
        "--workloads", "multiturn,4096:64", "--rates", "2,inf", "--num-prompts", "32", "--warmup", "3",
        "--token-range", "5:900", "--bench-args", "--input-len 2048 --turn-input-len 256 --output-len 64 --num-turns 6",
        "--workload-args", "--workload multiturn --num-turns 2", "--workload-args", "--workload azure-conv"])
    ws = compare.workload_list(a)
    assert [w.title for w in ws] == ["multiturn 2048:64 x6 (+256/turn)", "fixed 4096:64",
                                     "multiturn 2048:64 x2 (+256/turn)", "azure-conv"]
    cfg = args.bench_config(a, ws[0].argv, base_url="http://h:1", label="vllm", deadline=5.0)
    spec = cfg.workload
    assert (spec.name, spec.input_len, spec.turn_input_len, spec.output_len, spec.num_turns) == (
        "multiturn", 2048, 256, 64, 6)
    assert (spec.token_lo, spec.token_hi, cfg.rates, cfg.num_prompts, cfg.warmup) == (5, 900, (2.0, INF), 32, 3)
    assert (cfg.base_url, cfg.label, cfg.deadline, cfg.model) == ("http://h:1", "vllm", 5.0, None)
    fixed = args.bench_config(a, ws[1].argv).workload  # the workload's own flags win over --bench-args
    assert (fixed.name, fixed.input_len, fixed.output_len) == ("fixed", 4096, 64)
    # the same workload twice gets distinct titles; no --workloads nor --workload-args: the two defaults
    twice = compare.build_parser().parse_args(["--workloads", "azure-code,azure-code"])
    assert [w.title for w in compare.workload_list(twice)] == ["azure-code", "azure-code #2"]
    assert [w.title for w in compare.workload_list(compare.build_parser().parse_args([]))] == [
        "fixed 4096:64", "fixed 4096:1024"]


def test_num_prompts_default_caps_the_synthetic_workloads_only() -> None:
    parse = compare.build_parser().parse_args
    assert args.bench_config(parse([]), ["--workload", "multiturn"]).num_prompts == compare.NUM_PROMPTS
    assert args.bench_config(parse(["--num-prompts", "5"]), ["--workload", "multiturn"]).num_prompts == 5
    assert args.bench_config(parse(["--bench-args", "--num-prompts 7"]), []).num_prompts == 7
    trace = os.path.join(ROOT, "tests", "data", "azure_code_2023_excerpt.csv.gz")
    if "trace" in compare.WORKLOADS and os.path.exists(trace):  # the trace workload (issue 15, item 1)
        cfg = args.bench_config(parse(["--bench-args", "--duration-s 30"]),
                                ["--workload", "trace", "--trace", trace])
        assert cfg.workload.name == "trace" and cfg.num_prompts is None  # the window decides, uncapped


def _row(system: str, workload: str = "w", rps: float | None = 10.0, tps: float = 640.0, p50: float | None = 150.0,
         p99: float = 400.0, g100: float | None = 8.0, s50: float | None = 2.0) -> dict[str, Any]:
    return {"system": system, "workload": workload,
            "peak": {"rate": "inf", "output_throughput": tps, "request_throughput": rps, "p99_itl_ms": 40.0,
                     "p50_ttft_ms": p50, "p99_ttft_ms": p99},
            "itl_le_100ms": None,
            "goodput_p99_itl_le_100ms": None if g100 is None else {"goodput": g100, "rate": "inf"},
            "goodput_itl_le_100ms": {"goodput": 1.0, "rate": "inf"},
            "itl_le_50ms": None, "goodput_p99_itl_le_50ms": None,
            "goodput_itl_le_50ms": None if s50 is None else {"goodput": s50, "rate": "inf"}}


def test_versus_vllm_ratios() -> None:
    rows = [_row("rapid", rps=13.0, tps=832.0, p50=120.0, p99=800.0, g100=12.0, s50=3.0),
            _row("vllm", rps=10.0, tps=640.0, p50=150.0, p99=400.0, g100=8.0, s50=0.0),
            _row("hybrid-2048", tps=512.0, p50=None, g100=None, s50=None),
            _row("rapid", workload="no-vllm-here")]
    got = compare.versus_vllm(rows, [100, 50], "vllm")
    assert [x["system"] for x in got] == ["rapid", "hybrid-2048"]  # the baseline itself and other workloads: none
    r, h = got
    assert r["request_throughput"] == pytest.approx(1.3) and r["output_throughput"] == pytest.approx(1.3)
    assert r["ttft_p50_ms"] == pytest.approx(0.8) and r["ttft_p99_ms"] == pytest.approx(2.0)
    assert r["goodput_p99_itl_le_100ms"] == pytest.approx(1.5) and r["goodput_itl_le_100ms"] == pytest.approx(1.0)
    assert r["goodput_p99_itl_le_50ms"] is None  # neither has a figure
    assert r["goodput_itl_le_50ms"] is None  # vLLM's is 0: no ratio
    assert h["ttft_p50_ms"] is None and h["goodput_p99_itl_le_100ms"] is None and h["baseline"] == "vllm"
    assert compare.versus_vllm(rows, [100], None) == [] and compare.versus_vllm(rows, [100], "other") == []
    assert list(r)[3:] == compare.vllm_keys([100, 50])
    md = compare.to_markdown(rows, [100, 50], {"model": "m", "vllm_baseline": "vllm"})
    assert "Versus vLLM (`vllm`)" in md and "| rapid | 1.30x | 1.30x | 0.80x | 2.00x | 1.50x | - | 1.00x | - |" in md
    assert "| hybrid-2048 | 1.00x | 0.80x | - | 1.00x | - | - | 1.00x | - |" in md
    assert md.count("Versus vLLM") == 1  # the workload without vLLM has no vs-vLLM table
    assert "| vllm | 1.25x |" in md  # and vLLM is in the versus-the-best-hybrid table (peak 640 over 512)


def test_ext_system_that_does_not_answer(tmp_path) -> None:  # type: ignore[no-untyped-def]
    url = f"http://127.0.0.1:{servers.free_port()}"
    rc = compare.main(["--systems", f"ext:{url}", "--startup-timeout-s", "1", "--workloads", "8:2",
                       "--out", str(tmp_path), "--name", "ext"])
    data = json.loads((tmp_path / "ext.json").read_text())
    assert rc == 1 and data["systems"][0]["status"].startswith("did not start: the external server does not answer")
    assert data["systems"][0]["label"] == url and data["rows"] == [] and data["vllm_baseline"] is None


FAKE_SERVE_VLLM = """#!/usr/bin/env bash
# serve_vllm.sh's contract (MODEL PORT [flags]; a server in its own session; pid and log in the run dir;
# exit 0 once /health is 200) with a rapidserve CPU server standing in for vLLM
MODEL=$1; PORT=$2; shift 2
echo "fake vllm for $MODEL: $*"
setsid "$FAKE_PY" -m rapidserve.cli serve --model preset:tiny-llama --device cpu --num-kv-blocks 64 \\
  --port "$PORT" "$@" > "$FAKE_RUN_DIR/vllm_$PORT.log" 2>&1 &
echo $! > "$FAKE_RUN_DIR/vllm_$PORT.pid"
for i in $(seq 1 240); do
  sleep 0.5
  "$FAKE_PY" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null \\
    && { echo "healthy"; exit 0; }
  kill -0 "$(cat "$FAKE_RUN_DIR/vllm_$PORT.pid")" 2>/dev/null || { echo "died"; exit 1; }
done
exit 1
"""


@pytest.mark.skipif(shutil.which("setsid") is None or not os.path.isdir("/proc"), reason="needs setsid and /proc")
def test_compare_with_a_vllm_system_through_serve_vllm_sh(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "serve_vllm.sh"
    script.write_text(FAKE_SERVE_VLLM)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.setenv("FAKE_PY", sys.executable)
    monkeypatch.setenv("FAKE_RUN_DIR", str(run_dir))
    rc = compare.main(["--model", "preset:tiny-llama", "--serve-args", "--device cpu --num-kv-blocks 64 "
                       "--max-model-len 256", "--systems", "vllm:--max-num-seqs 8", "--system", "plain=",
                       "--vllm-model", str(tmp_path), "--vllm-serve", str(script), "--vllm-run-dir", str(run_dir),
                       "--workloads", "multiturn", "--bench-args", "--input-len 24 --turn-input-len 8 --output-len 3 "
                       "--num-turns 2", "--rates", "inf", "--num-prompts", "3", "--token-range", "3:1000",
                       "--warmup", "1", "--out", str(tmp_path), "--name", "cmp"])
    assert rc == 0
    data = json.loads((tmp_path / "cmp.json").read_text())
    assert [s["status"] for s in data["systems"]] == ["ok", "ok"] and data["vllm_baseline"] == "vllm:--max-num-seqs 8"
    assert data["systems"][0]["command"].endswith(" --max-model-len 256 --max-num-seqs 8")
    assert [r["system"] for r in data["rows"]] == ["vllm:--max-num-seqs 8", "plain"]
    assert all(r["workload"] == "multiturn 24:3 x2 (+8/turn)" for r in data["rows"])
    (vs,) = data["versus_vllm"]
    assert vs["system"] == "plain" and vs["request_throughput"] > 0 and vs["ttft_p50_ms"] > 0
    assert all(x["summary"]["completed"] == 6 for s in data["sweeps"] for x in s["runs"])  # 3 conversations x 2
    pid = int((run_dir / f"vllm_{data['systems'][0]['url'].rsplit(':', 1)[1]}.pid").read_text())
    assert not servers.group_alive(pid)  # the stop ended the server's whole session
    with open(data["systems"][0]["log"]) as f:
        log = f.read()  # the script's output, then vLLM's own log (here the stand-in's, down to its stop)
    assert "healthy" in log and "(the server's own log)" in log and "SIGTERM: stopping" in log
    assert "Versus vLLM (`vllm:--max-num-seqs 8`)" in (tmp_path / "cmp.md").read_text()


# ---------------------------------------------------------------- rates from the reference's peak
peak = _load("compare_peak")


def test_peak_fraction_helpers() -> None:
    assert peak.fractions_arg("0.9,0.25,0.5") == (0.25, 0.5, 0.9)
    for bad in ("0", "2.5", "x", "0.5,0.5"):
        with pytest.raises(ValueError, match="fraction|number"):
            peak.fractions_arg(bad)
    res = {"runs": [run(2.0, 100, 20), run("inf", 300, 90, completed=8, duration=2.0)]}
    assert peak.closed_peak(res) == 4.0
    assert peak.closed_peak({"runs": [run(2.0, 100, 20)]}) is None
    assert peak.closed_peak({"runs": [run("inf", 0, None, completed=0)]}) is None
    # a multi-turn workload's arrivals are conversations: its peak in conversations/s, the unit of its rates
    turns = {"config": {"workload_spec": {"name": "multiturn", "num_turns": 4}}}
    assert peak.closed_peak({**res, **turns}) == 1.0
    assert peak.closed_peak({**res, "config": {"workload_spec": {"name": "fixed", "num_turns": 4}}}) == 4.0
    assert peak.fraction_rates(4.0, (0.25, 0.5, 0.75), (1.0, 2.0, INF)) == (3.0,)  # 1.0 and 2.0 already run
    assert peak.fraction_rates(None, (0.5,), ()) == ()
    merged = peak.merge_results({"runs": [run("inf", 3, 1)], "config": {"rates": ["inf"]}, "skipped_rates": []},
                                {"runs": [run(3.0, 2, 1), run(1.5, 1, 1)], "config": {"rates": [1.5, 3.0]}})
    assert [r["rate"] for r in merged["runs"]] == [1.5, 3.0, "inf"] and merged["config"]["rates"] == ["inf", 1.5, 3.0]


def test_compare_rates_from_the_reference_peak_on_cpu(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    seen: list[tuple[str | None, int, int, tuple[float, ...]]] = []  # (system, input len, salt base, rates)
    import compare_run  # the module compare.main runs each system with (bench/ is on sys.path once compare is loaded)

    real = compare_run.run_benchmark

    async def spy(cfg):  # type: ignore[no-untyped-def]
        seen.append((cfg.label, cfg.workload.input_len, cfg.salt_base, cfg.rates))
        return await real(cfg)

    monkeypatch.setattr(compare_run, "run_benchmark", spy)
    rc = compare.main(["--model", "preset:tiny-llama", "--serve-args", "--device cpu --num-kv-blocks 64",
                       "--systems", "", "--system", "a=", "--system", "ref=--mode hybrid", "--peak-reference", "ref",
                       "--workloads", "24:4,40:4", "--rates", "inf", "--peak-fractions", "0.5",
                       "--num-prompts", "4", "--token-range", "3:1000", "--warmup", "1", "--out", str(tmp_path),
                       "--name", "pk"])
    assert rc == 0
    data = json.loads((tmp_path / "pk.json").read_text())
    assert [s["label"] for s in data["systems"]] == ["ref", "a"]  # the reference runs first
    assert len(data["peaks"]) == 2 and all(p > 0 for p in data["peaks"].values())
    assert len(data["sweeps"]) == 4
    for sweep in data["sweeps"]:
        half = round(0.5 * data["peaks"][sweep["title"]], 2)
        assert [x["rate"] for x in sweep["runs"]] == [half, "inf"], sweep
    # Every system: the --rates sweep, then the rates from the reference's peak, each with its own prompt salt;
    # each workload's salts apart from the other's (a 40-token prompt would else begin with the 24-token one).
    halves = {24: round(0.5 * data["peaks"]["fixed 24:4"], 2), 40: round(0.5 * data["peaks"]["fixed 40:4"], 2)}
    want = [(label, n, base + k, rates) for label in ("ref", "a")
            for n, base in ((24, 0), (40, args.SALT_STRIDE))
            for k, rates in ((0, (math.inf,)), (1, (halves[n],)))]
    assert seen == want


@pytest.mark.parametrize("argv,match", [
    (["--systems", "rapid-adaptive", "--rates", "1,2", "--peak-fractions", "0.5"], "needs inf"),
    (["--systems", "rapid-adaptive", "--rates", "inf", "--peak-fractions", "0.5", "--peak-reference", "x"],
     "none of the systems"),
    (["--systems", "rapid-adaptive", "--peak-fractions", "3"], "fraction"),
])
def test_peak_fraction_errors(argv: list[str], match: str, capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as ei:
        compare.main(["--dry-run", *argv])
    assert ei.value.code == 2 and match in capsys.readouterr().err


def test_continue_from_an_earlier_run_on_cpu(tmp_path) -> None:  # type: ignore[no-untyped-def]
    common = ["--model", "preset:tiny-llama", "--serve-args", "--device cpu --num-kv-blocks 64", "--systems", "",
              "--workloads", "24:4", "--rates", "inf", "--peak-fractions", "0.5", "--num-prompts", "4",
              "--token-range", "3:1000", "--warmup", "1", "--out", str(tmp_path)]
    first_json = str(tmp_path / "first.json")
    assert compare.main([*common, "--system", "ref=--mode hybrid", "--name", "first"]) == 0
    first = json.loads((tmp_path / "first.json").read_text())
    assert compare.main([*common, "--system", "b=", "--name", "second", "--continue-from", first_json]) == 0
    data = json.loads((tmp_path / "second.json").read_text())
    # The earlier system's rows and sweeps come first, unchanged; its peak set the new system's rates.
    assert [(s["label"], s["status"], s.get("report")) for s in data["systems"]] == [
        ("ref", "ok", first_json), ("b", "ok", None)]
    assert data["peaks"] == first["peaks"] and data["peak_reference"] == "ref"
    assert data["rows"][0] == first["rows"][0] and [r["system"] for r in data["rows"]] == ["ref", "b"]
    half = round(0.5 * first["peaks"]["fixed 24:4"], 2)
    assert [x["rate"] for x in data["sweeps"][1]["runs"]] == [half, "inf"]
    md = (tmp_path / "second.md").read_text()
    assert "| ref |" in md and "| b |" in md
    # Carried on again: each system keeps the report it ran in.
    assert compare.main([*common, "--system", "c=", "--name", "third", "--peak-reference", "ref",
                         "--continue-from", str(tmp_path / "second.json")]) == 0
    third = json.loads((tmp_path / "third.json").read_text())
    assert [s.get("report") for s in third["systems"]] == [first_json, str(tmp_path / "second.json"), None]


def _prior(**over: object) -> dict[str, object]:
    """A report as compare.py writes it for `--workloads 24:4 --rates inf --peak-fractions 0.5` (the argv below)."""
    prior: dict[str, object] = {
        "rows": [{"system": "ref", "workload": "fixed 24:4"}, {"system": "vllm", "workload": "fixed 24:4"}],
        "sweeps": [], "peaks": {"fixed 24:4": 2.0}, "peak_reference": "ref", "vllm_baseline": "vllm",
        "systems": [{"label": "ref", "flags": "", "status": "ok"}, {"label": "vllm", "flags": "", "status": "ok"},
                    {"label": "late", "flags": "", "status": "skipped: duration budget spent"}],
        "model": "preset:qwen3-8b", "serve_args": "--device cpu --num-kv-blocks 64",
        "workloads": [{"title": "fixed 24:4", "flags": "--workload fixed --input-len 24 --output-len 4"}],
        "itl_bounds_ms": [100.0, 50.0], "rates": "inf", "per_rate": "64 requests", "arrival": "poisson", "seed": 0,
        "peak_fractions": [0.5]}
    prior.update(over)
    return prior


PRIOR_ARGV = ["--dry-run", "--systems", "rapid-adaptive", "--serve-args", "--device cpu --num-kv-blocks 64",
              "--workloads", "24:4", "--rates", "inf", "--peak-fractions", "0.5", "--num-prompts", "64"]


@pytest.mark.parametrize("change,match", [
    (["--workloads", "32:4"], "ran with workloads"),
    (["--serve-args", "--device cpu --num-kv-blocks 32"], "ran with serve_args"),
    (["--itl-bounds-ms", "80"], "ran with itl_bounds_ms"),
    (["--num-prompts", "32"], "ran with per_rate"),
    (["--seed", "3"], "ran with seed"),
    (["--peak-fractions", "0.75"], "ran with peak_fractions"),
    (["--system", "ref=--mode hybrid"], "ref already ran"),
    (["--peak-reference", "rapid-adaptive"], "rates came from 'ref'"),
    (["--vllm-baseline", "nobody"], "--vllm-baseline 'nobody' is none of the systems"),
])
def test_continue_from_refuses_a_run_that_does_not_compare(tmp_path, change: list[str], match: str,  # type: ignore[no-untyped-def]
                                                           capsys) -> None:
    path = tmp_path / "prior.json"
    path.write_text(json.dumps(_prior()))
    with pytest.raises(SystemExit) as ei:
        compare.main([*PRIOR_ARGV, "--continue-from", str(path), *change])
    assert ei.value.code == 2 and match in capsys.readouterr().err


def test_continue_from_names_the_search_settings_that_differ(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A report from another search (one setting added since: the ramp rule's cap) is refused with that setting
    named, old and new value, not the two whole settings objects."""
    cont = _load("compare_continue")
    settings = {"shares": [0.9, 0.99], "tolerance": 0.05, "discard": 16}
    path = tmp_path / "prior.json"
    path.write_text(json.dumps(_prior(mode="frontier", search=settings)))
    now = {**_prior(mode="frontier"), "search": {**settings, "max_probe_arrivals": 1024}}
    with pytest.raises(ValueError) as ei:
        cont.load_prior(str(path), now)
    msg = str(ei.value)
    assert "other search settings (max_probe_arrivals: None there, 1024 here)" in msg
    assert "tolerance" not in msg and "shares" not in msg
    assert cont.load_prior(str(path), {**now, "search": settings})["mode"] == "frontier"  # the same settings: taken


@pytest.mark.parametrize("prior,match", [
    ({}, "not a compare.py report"),
    (_prior(systems=[{"label": "ref"}]), "`systems` must be a list of objects with label, flags, status"),
    (_prior(workloads=["fixed 24:4"]), "`workloads` must be a list of objects"),
    (_prior(peaks=[2.0]), "`peaks` must be an object"),
])
def test_continue_from_refuses_a_malformed_report(tmp_path, prior: dict[str, object], match: str,  # type: ignore[no-untyped-def]
                                                  capsys) -> None:
    path = tmp_path / "prior.json"
    path.write_text(json.dumps(prior))
    with pytest.raises(SystemExit) as ei:
        compare.main([*PRIOR_ARGV, "--continue-from", str(path)])
    assert ei.value.code == 2 and match in capsys.readouterr().err
    path.write_text("{not json")
    with pytest.raises(SystemExit):
        compare.main([*PRIOR_ARGV, "--continue-from", str(path)])
    assert "cannot read it as JSON" in capsys.readouterr().err


def test_continue_from_choices() -> None:
    import compare_continue as cc

    prior = _prior()
    # A system of the earlier report that did not run may run now; its old entry is dropped.
    kept = cc.carried_systems(prior, "p.json", ["late", "new"])
    assert [(s["label"], s["report"]) for s in kept] == [("ref", "p.json"), ("vllm", "p.json")]
    # Reference: the earlier report's peaks, unless it has none.
    assert cc.choose_reference(prior, None, ["new"]) == ("ref", True)
    assert cc.choose_reference(prior, "ref", ["new"]) == ("ref", True)
    assert cc.choose_reference(_prior(peaks={}), None, ["new", "x"]) == ("new", False)
    with pytest.raises(ValueError, match="none of the systems"):
        cc.choose_reference(_prior(peaks={}), "ref", ["new"])
    # Baseline: the earlier report's unless another is named; an earlier system may be named.
    assert cc.choose_baseline(prior, None, ["new"], "new-vllm") == "vllm"
    assert cc.choose_baseline(prior, "ref", ["new"], None) == "ref"
    assert cc.choose_baseline(prior, "new", ["new"], "new") == "new"
    assert cc.choose_baseline(None, None, ["new"], "new") == "new"
    assert cc.choose_baseline(_prior(vllm_baseline=None), None, ["new"], "new") == "new"


def test_vs_vllm_summary_table() -> None:
    import vs_vllm_summary

    def sweep(label: str, closed: float, at: float, ttft: float, itl: float) -> dict[str, object]:
        s = {"request_throughput": closed, "itl_ms": {"p99": 30.0}, "ttft_ms": {"median": 900.0}}
        r = {"request_throughput": at, "itl_ms": {"p99": itl}, "ttft_ms": {"median": ttft}}
        return {"label": label, "title": "fixed 8:2",
                "runs": [{"rate": 5.0, "summary": r}, {"rate": "inf", "summary": s}]}

    report = {"vllm_baseline": "vllm", "peaks": {"fixed 8:2": 10.0}, "peak_reference": "vllm",
              "itl_bounds_ms": [100.0, 50.0],
              "systems": [{"label": "vllm", "kind": "vllm"}, {"label": "v2", "kind": "vllm"},
                          {"label": "rapid", "kind": "ours"}],
              "sweeps": [sweep("vllm", 10.0, 4.0, 200.0, 120.0), sweep("v2", 8.0, 4.5, 300.0, 60.0),
                         sweep("rapid", 9.0, 5.0, 100.0, 20.0)],
              "rows": [{"workload": "fixed 8:2", "system": s, "goodput_p99_itl_le_100ms": g}
                       for s, g in (("vllm", None), ("v2", {"goodput": 4.0}), ("rapid", {"goodput": 6.0}))]}
    text = vs_vllm_summary.summary(report, [0.5])
    assert "reference peak 10.00 req/s" in text
    assert "| rapid | 9.00 (0.90x) | 30.0 | 100 | 20.0 | 6.00 (1.50x) |" in text  # 6 over the better vLLM's 4
    assert "| vllm | 10.00 (1.00x) | 30.0 | 200 | 120.0 | - |" in text


def test_vs_vllm_summary_command(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import vs_vllm_summary

    report = {"vllm_baseline": None, "peaks": {}, "peak_fractions": [0.5], "systems": [], "rows": [], "sweeps": []}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    out = tmp_path / "t.md"
    assert vs_vllm_summary.main([str(path), "--out", str(out)]) == 0
    assert "Poisson rates at 0.5" in out.read_text()
    for argv in ([str(path), "--fractions", "3"], [str(tmp_path / "missing.json")]):
        with pytest.raises(SystemExit) as ei:
            vs_vllm_summary.main(argv)
        assert ei.value.code == 2
    assert "give a compare.py report" in capsys.readouterr().err


@pytest.mark.parametrize("argvs,trace_probe,want", [
    ([("--workload", "fixed")], None, "48 Poisson arrivals per probe"),
    ([("--workload", "trace", "--num-prompts", "256")], 64,
     "on a trace (its requests at Poisson arrivals of the probe's rate) the first 64 requests of its window per probe"),
    ([("--workload=trace",)], None, "on a trace (its requests at Poisson arrivals of the probe's rate) its whole "
                                    "window per probe"),
    ([("--workload", "fixed"), ("--workload", "trace")], 64, "48 Poisson arrivals per probe; on a trace"),
])
def test_the_header_says_what_a_probe_sends(argvs: list[tuple[str, ...]], trace_probe: int | None, want: str) -> None:
    """The report's header (`probe_text`): a trace's probe is not --num-prompts arrivals (the old `per_rate`, kept
    for compare_continue.MATCH, said "N Poisson arrivals per probe" there too)."""
    from compare_args import Workload, probe_text

    from rapidserve.benchmark.search_config import SearchConfig

    a = argparse.Namespace(num_prompts=48, search=SearchConfig(trace_probe=trace_probe))
    text = probe_text(a, [Workload(tuple(v), f"w{i}") for i, v in enumerate(argvs)])
    assert text.startswith(want)


@pytest.mark.parametrize("extent", [{"max_probes": 10}, {"only_bounds": [100.0]}, {"min_rate": 2.0, "max_rate": 40.0},
                                    {"budget_s": 300.0, "start_fraction": 0.25, "hints": None}])
def test_reports_whose_searches_differ_only_in_extent_compare(tmp_path, extent: dict[str, object]) -> None:  # type: ignore[no-untyped-def]
    """How far and from where a search looked (its probe count, bounds, limits, start) does not change what a probe
    measures: such reports compare (bench/compare_merge.py joins them); a setting that does (the warm-up) is refused."""
    cont = _load("compare_continue")
    settings = {"shares": [0.9, 0.99], "tolerance": 0.05, "discard": 16, "max_probes": 8, "only_bounds": None}
    path = tmp_path / "prior.json"
    path.write_text(json.dumps(_prior(mode="frontier", search=settings)))
    now = {**_prior(mode="frontier"), "search": {**settings, **extent}}
    assert cont.load_prior(str(path), now)["mode"] == "frontier"
    with pytest.raises(ValueError, match=r"other search settings \(discard: 16 there, 32 here\)"):
        cont.load_prior(str(path), {**_prior(mode="frontier"), "search": {**settings, **extent, "discard": 32}})
    # a start rate skips the closed-loop peak (no probe judged above it); a tolerance sets how exact a settled cell is
    for other, said in (({"start_rate": 7.5}, "start_rate: None there, 7.5 here"),
                        ({"tolerance": 0.5}, "tolerance: 0.05 there, 0.5 here")):
        with pytest.raises(ValueError, match=re.escape(said)):
            cont.load_prior(str(path), {**_prior(mode="frontier"), "search": {**settings, **extent, **other}})


# Every flag's bad value, and every combination that would make compare.py ignore a flag, is refused at parse time
# (exit 2, naming the flag and what is allowed), before any server starts. Each of these was accepted before: an
# empty item dropped (an empty --workloads ran the default workloads), a duplicate ITL bound (a column twice), a port
# past 65535, a --name with a folder in it (the report written at the end, after the GPU time, failed), --rates and
# --itl-bounds-ms with --goodput-search (ignored), --peak-reference without --peak-fractions (ignored),
# --step-traces with no rapidserve system (ignored), --base-url/--label among the bench flags (replaced per system),
# --request-rate/--time-scale among them with --goodput-search (ignored), and unbalanced quotes reported without
# the flag's name.
@pytest.mark.parametrize("argv,match", [
    (["--workloads", "4096:"], "argument --workloads: '4096:' is not IN:OUT"),
    (["--workloads", ""], "argument --workloads: '' has an empty item"),
    (["--workloads", "4096:64,"], "argument --workloads: '4096:64,' has an empty item"),
    (["--workloads", "4096:64,,multiturn"], "has an empty item"),
    (["--workloads", "\u0664:\u0665"], "is not IN:OUT"),  # Arabic-Indic digits: str.isdigit() took them
    (["--rates", "abc"], "argument --rates: 'abc' in 'abc' is not a number"),
    (["--itl-bounds-ms", "100,100"], "argument --itl-bounds-ms: '100' appears twice"),
    (["--itl-bounds-ms", "100,"], "argument --itl-bounds-ms: '' is not a number"),
    (["--port", "65536"], "argument --port: 65536 is not a TCP port: give 1-65535, or 0"),
    (["--name", "a/b"], "argument --name: 'a/b' is not a file name stem"),
    (["--name", ""], "argument --name: '' is not a file name stem"),
    (["--out", ""], "argument --out: '' is not a folder"),
    (["--serve-args", "--api-key 'k"], "argument --serve-args: No closing quotation"),
    (["--bench-args", "--api-key 'k"], "argument --bench-args: No closing quotation"),
    (["--workload-args", "--workload 'multiturn"], "argument --workload-args: No closing quotation"),
    (["--workload-args", " "], "argument --workload-args: no flags"),
    (["--systems", "rapid-adaptive,"], "--systems 'rapid-adaptive,' has an empty item"),
    (["--systems", "", "--system", "x=--mode 'rapid"], "--system \"x=--mode 'rapid\": No closing quotation"),
    (["--systems", "", "--system", "x=ext:ftp://u:pw@h"], "--system 'x=ext:ftp://***@h': 'ftp://***@h' is not"),
    (["--goodput-search", "--rates", "1,2"], "--rates belong to a sweep; --goodput-search sends"),
    (["--goodput-search", "--rates", "1,2,4,8,inf"], "--rates belong to a sweep"),  # given, even at the default
    (["--goodput-search", "--itl-bounds-ms", "50"], "--itl-bounds-ms belong to a sweep; --goodput-search sends "
     "--num-prompts Poisson arrivals per probe at the rates it picks (its ITL bounds: --search-itl-bounds-ms)"),
    (["--peak-reference", "rapid-adaptive"], "--peak-reference names the system whose closed peak"),
    (["--systems", "ext:http://h:1", "--step-traces"], "--step-traces starts rapidserve servers"),
    (["--bench-args", "--base-url http://h:1"], "--base-url: compare.py sets each system's server URL"),
    (["--workload-args", "--workload multiturn --label x"], "--label: compare.py sets"),
    (["--goodput-search", "--bench-args", "--request-rate 3"], "--request-rate sets a sweep's load"),
    (["--goodput-search", "--workload-args", "--workload multiturn --time-scale 2"], "--time-scale sets"),
])
def test_bad_flags_are_refused_by_name(argv: list[str], match: str, capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as ei:
        compare.main(["--dry-run", *(["--systems", "rapidserve"] if "--systems" not in argv else []), *argv])
    err = capsys.readouterr().err
    assert ei.value.code == 2 and match in err, err
    assert "pw@" not in err


def test_good_flags_still_pass() -> None:
    from compare_args import ITL_BOUNDS_MS, RATES

    parse = compare.build_parser().parse_args
    a = parse(["--workloads", " 4096 : 64,multiturn", "--itl-bounds-ms", "100,50,25", "--port", "65535",
               "--name", "run_1.x", "--workload-args", "--workload multiturn"])
    assert a.workloads == [["--workload", "fixed", "--input-len", "4096", "--output-len", "64"],
                           ["--workload", "multiturn"]]
    assert (a.itl_bounds_ms, a.port, a.name) == ([100.0, 50.0, 25.0], 65535, "run_1.x")
    # the defaults are the module's own objects (how --goodput-search tells them from given ones)
    assert parse([]).rates is RATES and parse([]).itl_bounds_ms is ITL_BOUNDS_MS
    # --systems "" with --system: only those systems; the sweep's flags with their defaults go with a search
    assert compare.main(["--dry-run", "--systems", "", "--system", "a=", "--goodput-search"]) == 0
    assert compare.main(["--dry-run", "--systems", "rapidserve", "--peak-fractions", "0.5",
                         "--peak-reference", "rapidserve", "--step-traces"]) == 0


TRACE = "mooncake_conversation_excerpt.jsonl.gz"
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


@pytest.mark.parametrize(("flags", "workload", "refused"), [
    ([], ["--workload", "trace", "--trace", TRACE], None),  # the default rates: not given, nothing to refuse
    (["--rates", "inf"], ["--workload", "trace", "--trace", TRACE], "--rates set Poisson rates"),
    (["--rates", "1,2"], ["--workload", "trace", "--trace", TRACE, "--trace-arrivals", "timestamps"],
     "--rates set Poisson rates"),
    (["--peak-fractions", "0.5", "--rates", "inf"], ["--workload", "trace", "--trace", TRACE],
     "--rates, --peak-fractions set Poisson rates"),
    ([], ["--workload", "trace", "--trace", TRACE, "--request-rate", "2"], "--request-rate set Poisson rates"),
    (["--rates", "1,2"], ["--workload", "trace", "--trace", TRACE, "--trace-arrivals", "poisson"], None),
    (["--rates", "inf"], ["--workload", "fixed", "--input-len", "8", "--output-len", "4"], None),
])
def test_a_sweep_refuses_rates_a_timestamps_trace_would_ignore(flags: list[str], workload: list[str],
                                                                refused: str | None) -> None:
    """A trace replayed at its own timestamps reads no Poisson rate (its load is --time-scale): a sweep's --rates,
    --peak-fractions or a workload's --request-rate given for it are refused by name (they ran the trace at its
    timestamps before, as if not given); with --trace-arrivals poisson, or another workload, they are read."""
    a = compare.build_parser().parse_args(flags)
    workload = [os.path.join(DATA, w) if w == TRACE else w for w in workload]
    if refused is None:
        args.bench_config(a, workload)
        return
    with pytest.raises(ValueError, match=refused):
        args.bench_config(a, workload)
