"""`rapidserve bench` as vLLM's users run it, in process against a fake OpenAI-compatible server (a thread): vLLM's
flag names mapped or refused by name, the printed tables and progress bars, and files written only where asked
(--out-dir, --save-result and its flags)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from rapidserve.benchmark.cli import config_from_args
from rapidserve.benchmark.vllm_flags import resolve_vllm_flags
from rapidserve.cli import build_parser, main

BLOCK = "============ Serving Benchmark Result ============"


class FakeServer:
    """Streams one text token per event, 1 ms apart; a prompt whose first id is a multiple of 5 gets an HTTP 400."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "org/fake-model", "max_model_len": 512}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body["prompt"][0] % 5 == 0:
            return web.json_response({"error": {"message": "no thanks", "type": "invalid_request_error"}}, status=400)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(body["max_tokens"]):
            await resp.write(b"data: " + json.dumps({"choices": [{"index": 0, "text": f"t{i} "}]}).encode() + b"\n\n")
            await asyncio.sleep(0.001)
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n")
        return resp

    async def _start(self) -> str:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    def __enter__(self) -> FakeServer:
        self.thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.runner is not None
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeServer]:
    with FakeServer() as f:
        yield f


def port_of(url: str) -> str:
    return url.rsplit(":", 1)[1]


SMALL = ("--random-input-len", "16", "--random-output-len", "4", "--num-prompts", "6", "--seed", "3")


def bench(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["bench", *args])
    out, err = capsys.readouterr()
    return code, out, err


def parse(*args: str) -> Any:
    a = build_parser().parse_args(["bench", *args])
    resolve_vllm_flags(a)
    return a


@pytest.mark.parametrize("args,check", [
    (["--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "8"],
     lambda c: (c.workload.name, c.workload.input_len, c.workload.output_len) == ("fixed", 64, 8)),
    (["--input-len", "64", "--random-input-len", "64"], lambda c: c.workload.input_len == 64),
    ([], lambda c: (c.workload.input_len, c.workload.output_len, c.base_url, c.warmup, c.progress, c.burstiness)
     == (1024, 128, "http://127.0.0.1:8000", 0, True, 1.0)),
    (["--host", "10.0.0.2", "--port", "9000"], lambda c: c.base_url == "http://10.0.0.2:9000"),
    (["--port", "9000"], lambda c: c.base_url == "http://127.0.0.1:9000"),
    (["--num-warmups", "3"], lambda c: c.warmup == 3),
    (["--backend", "vllm", "--endpoint", "/v1/completions", "--ignore-eos", "--random-range-ratio", "0",
      "--random-prefix-len", "0"], lambda c: c.workload.name == "fixed"),
    (["--percentile-metrics", "ttft,e2el_including_client_queue", "--metric-percentiles", "50,99.9"],
     lambda c: (c.percentile_metrics, c.metric_percentiles) == (("ttft", "e2el_including_client_queue"), (50.0, 99.9))),
    (["--burstiness", "0.5", "--max-concurrency", "8"], lambda c: (c.burstiness, c.max_concurrency) == (0.5, 8)),
    (["--disable-tqdm"], lambda c: not c.progress),
    (["--quiet"], lambda c: not c.progress and c.quiet),
])
def test_vllm_flag_names_map_to_ours(args: list[str], check: Any) -> None:
    assert check(config_from_args(parse(*args)))


@pytest.mark.parametrize("args,needle", [
    (["--dataset-name", "sharegpt"], "--dataset-name sharegpt: rapidserve bench generates vLLM's 'random'"),
    (["--dataset-name", "random", "--workload", "azure-code"], "--dataset-name random is --workload fixed"),
    (["--dataset-path", "x.json"], "--dataset-path: rapidserve bench reads no dataset file"),
    (["--tokenizer", "Qwen/Qwen3-8B"], "--tokenizer: rapidserve bench uses no tokenizer"),
    (["--random-input-len", "6", "--workload", "multiturn"], "--random-input-len is for vLLM's random dataset"),
    (["--input-len", "5", "--random-input-len", "6"], "--input-len 5 and --random-input-len 6 disagree"),
    (["--warmup", "1", "--num-warmups", "2"], "--warmup 1 and --num-warmups 2 disagree"),
    (["--random-range-ratio", "0.5"], "--random-range-ratio 0.5: rapidserve bench's random prompts have fixed"),
    (["--random-prefix-len", "64"], "--random-prefix-len 64"),
    (["--host", "h", "--base-url", "http://h:1"], "--host/--port and --base-url both name the server"),
    (["--backend", "openai-chat"], "--backend openai-chat"),
    (["--endpoint", "/v1/chat/completions"], "--endpoint /v1/chat/completions"),
    (["--burstiness", "0.5", "--arrival", "fixed"], "--burstiness shapes Poisson arrivals"),
    (["--goodput-search", "--burstiness", "2"], "--goodput-search measures Poisson arrivals: drop --burstiness"),
    (["--name", "x"], "--name names or leaves out files of --out-dir"),
    (["--no-plot"], "--no-plot names or leaves out files of --out-dir"),
    (["--goodput-search", "--save-result"], "--save-result: vllm bench serve's result is one run's"),
    (["--goodput-search", "--result-dir", "d"], "--result-dir: vllm bench serve's result is one run's"),
    (["--request-rate", "1,2", "--result-filename", "r.json"], "holds one run, and this sweep has 2"),
])
def test_vllm_flags_refused_by_name_before_any_request(args: list[str], needle: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    base = [] if "--host" in args else ["--base-url", "http://127.0.0.1:9"]  # nothing listens there: exit 1 if sent
    code, _, err = bench(capsys, *base, *args)
    assert code == 2 and needle in err, err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("args,needle", [
    (["--percentile-metrics", "ttft,goodput"], "'goodput' in 'ttft,goodput' is not one of ttft, tpot"),
    (["--percentile-metrics", "ttft,ttft"], "appears twice"),
    (["--metric-percentiles", "101"], "is not in [0, 100]"),
    (["--metric-percentiles", "p99"], "is not a number"),
    (["--metadata", "novalue"], "'novalue' is not KEY=VALUE"),
    (["--burstiness", "0"], "> 0"),
    (["--port", "http"], "not an integer"),
    (["--temperature", "0"], "does not support --temperature"),
])
def test_bad_values_exit_2_naming_the_flag(args: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        main(["bench", *args])
    assert ei.value.code == 2 and needle in capsys.readouterr().err


def test_a_sweep_prints_vllms_tables_and_bars_and_writes_nothing(fake: FakeServer, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = bench(capsys, "--port", port_of(fake.url), *SMALL, "--request-rate", "200,inf",
                           "--max-concurrency", "2", "--goodput", "ttft:60000")
    assert code == 0 and not list(tmp_path.iterdir())  # nothing written unless asked
    assert out.count(BLOCK) == 2 and "Traffic request rate: 200.0" in out and "Traffic request rate: inf" in out
    assert "Burstiness factor: 1.0 (Poisson process)" in out and "Maximum request concurrency: 2" in out
    tables = out.split(BLOCK)[1:]
    for t in tables:
        ok, failed = (int(re.search(rf"{k} requests:\s+(\d+)", t).group(1)) for k in ("Successful", "Failed"))
        assert ok + failed == 6 and ok > 0
        assert re.search(r"Total generated tokens:\s+(\d+)", t).group(1) == str(4 * ok)
        for section in ("Time to First Token", "Time per Output Token (excl. 1st token)", "Inter-token Latency",
                        "End-to-end Latency"):
            assert section in t
        assert "P99 E2EL (ms):" in t and "Request goodput (req/s):" in t
    assert "Request rate configured (RPS):           200.00" in tables[0]
    assert "Request rate configured" not in tables[1]
    assert "rate 200: 100%" in err and "rate inf: 100%" in err and "6/6" in err  # a bar per rate, on stderr


def test_save_result_writes_vllms_json_per_rate(fake: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = bench(capsys, "--port", port_of(fake.url), *SMALL, "--request-rate", "200,inf",
                           "--save-result", "--label", "lab", "--disable-tqdm", "--metadata", "tp=1", "gpu=cpu")
    assert code == 0 and err == ""  # no bars with --disable-tqdm
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 2 and all(re.fullmatch(r"lab-(200\.0|inf)qps-fake-model-\d{8}-\d{6}\.json", f) for f in files)
    assert "wrote " in out
    by_rate = {}
    for f in files:
        d = json.loads((tmp_path / f).read_text())
        by_rate[d["request_rate"]] = d
        assert (d["backend"], d["label"], d["model_id"], d["tp"], d["gpu"]) == ("openai", "lab", "org/fake-model",
                                                                                "1", "cpu")
        assert d["completed"] + d["failed"] == 6 == d["num_prompts"] and d["total_output_tokens"] == 4 * d["completed"]
        assert "ttfts" not in d and len(d["latencies"]) == 6 and d["p99_e2el_ms"] > 0  # lists only with --save-detailed
    assert set(by_rate) == {200.0, "inf"}


def test_append_result_and_save_detailed(fake: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "sub" / "all.json"
    code, _, _ = bench(capsys, "--port", port_of(fake.url), *SMALL, "--request-rate", "200,inf", "--quiet",
                       "--result-dir", str(tmp_path / "sub"), "--result-filename", "all.json", "--append-result",
                       "--save-detailed", "--percentile-metrics", "ttft,client_queue_time", "--metric-percentiles",
                       "50,99.9")
    assert code == 0 and sorted(os.listdir(tmp_path)) == ["sub"] and os.listdir(tmp_path / "sub") == ["all.json"]
    docs = [json.loads(line) for line in target.read_text().splitlines()]
    assert [d["request_rate"] for d in docs] == [200.0, "inf"]
    assert sum(d["failed"] for d in docs) > 0  # seed 3 draws prompts the fake refuses: failures are recorded too
    for d in docs:
        assert len(d["ttfts"]) == len(d["itls"]) == len(d["generated_texts"]) == len(d["errors"]) == 6
        ok = [i for i, e in enumerate(d["errors"]) if e == ""]
        assert all(d["generated_texts"][i] == "t0 t1 t2 t3 " and len(d["itls"][i]) == 3 for i in ok)
        failed = [i for i in range(6) if i not in ok]
        assert all(d["errors"][i] == "HTTP 400: no thanks" and d["output_lens"][i] == 0 for i in failed)
        assert {k for k in d if k.endswith("_ms")} == {f"{s}_{m}_ms" for s in ("mean", "median", "std", "p50", "p99.9")
                                                       for m in ("ttft", "client_queue_time")}


def test_out_dir_without_matplotlib_says_so_in_one_line(fake: FakeServer, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    code, out, _ = bench(capsys, "--base-url", fake.url, *SMALL, "--out-dir", str(tmp_path), "--name", "r")
    assert code == 0 and sorted(os.listdir(tmp_path)) == ["r.json", "r.md"]
    said = [line for line in out.splitlines() if "matplotlib" in line]
    assert said == [f"rapidserve bench: no {tmp_path / 'r'}.png: the plot needs matplotlib: "
                    "pip install rapidserve[bench]"]


def test_multiturn_bar_counts_turns(fake: FakeServer, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = bench(capsys, "--base-url", fake.url, "--workload", "multiturn", "--input-len", "8",
                           "--output-len", "2", "--num-turns", "3", "--turn-input-len", "4", "--num-prompts", "4",
                           "--seed", "3")
    assert code == 0 and out.count(BLOCK) == 1 and "12/12" in err  # a conversation cut short by an error counts


def test_goodput_search_prints_a_bar_per_probe_and_its_table(fake: FakeServer, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = bench(capsys, "--goodput-search", "--base-url", fake.url, "--input-len", "8", "--output-len", "3",
                           "--num-prompts", "6", "--search-discard", "1", "--search-start-rate", "100",
                           "--search-max-probes", "2", "--seed", "3")
    assert code == 0 and not list(tmp_path.iterdir())
    assert "probe 1 at 100 req/s: 100%" in err and "probe 2 at" in err
    table = out[out.index("============= Goodput Search Result =============="):].splitlines()
    assert table[-1] == "=" * 50 and any(line.startswith("Start rate (req/s):") for line in table)
    assert sum(line.startswith(("ITL <= ", "no ITL bound")) for line in table) == 10  # 5 bounds x 2 shares
