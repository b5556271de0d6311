"""The command line: usage errors exit 2 with a message that names what is wrong; generate works."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rapidserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("args,needle", [
    (["--model", "/no/such/model"], "/no/such/model"),
    (["--model", "preset:no-such-preset"], "no-such-preset"),
    (["--dtype", "float64"], "float64"),
    (["--gpu-memory-utilization", "1.5"], "1.5"),
    (["--device", "tpu"], "tpu"),
    (["--max-num-seqs", "0"], "0"),
    (["--model", "preset:tiny-llama", "--device", "cpu"], "no tokenizer"),  # string prompt, no tokenizer
    # 1M tokens: past the CPU pool's ~700K; a larger value only spends time building the RoPE table first
    (["--model", "preset:tiny-llama", "--device", "cpu", "--max-model-len", "1000000"], "KV cache"),
])
def test_usage_errors_exit_2(args: list[str], needle: str) -> None:
    r = run("generate", "--prompt", "hi", *args)
    assert r.returncode == 2, r.stderr[-2000:]
    assert needle in r.stderr
    assert "Traceback" not in r.stderr


def test_unsupported_model_file_lists_supported_forms(tmp_path) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "model.bin"
    bad.write_bytes(b"\\x00" * 100)
    r = run("generate", "--prompt", "hi", "--model", str(bad))
    assert r.returncode == 2 and str(bad) in r.stderr and "preset:" in r.stderr


def test_generate_chat_with_default_model() -> None:
    r = run("generate", "--chat", "--device", "cpu", "--prompt", "What is the capital of France?")
    assert r.returncode == 0, r.stderr[-2000:]
    line = json.loads(r.stdout.strip().splitlines()[-1])
    assert "Paris" in line["text"] and line["finish_reason"] == "stop"


def test_serve_flags_map_to_the_server_config() -> None:
    from rapidserve.cli import build_parser, server_config

    a = build_parser().parse_args(["serve", "--max-request-bytes", "4096", "--shutdown-grace-s", "2.5",
                                   "--max-connections", "20", "--keepalive-timeout-s", "5", "--header-timeout-s",
                                   "3", "--metrics-public"])
    cfg = server_config(a, {})
    assert (cfg.host, cfg.max_body_bytes, cfg.shutdown_grace_s, cfg.max_connections) == ("127.0.0.1", 4096, 2.5, 20)
    assert (cfg.keepalive_timeout_s, cfg.header_timeout_s, cfg.metrics_public, cfg.api_key) == (5, 3, True, None)
    assert server_config(build_parser().parse_args(["serve"]), {"RAPIDSERVE_API_KEY": "k"}).api_key == "k"
    tools = server_config(build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser",
                                                     "llama3_json"]), {})
    assert (tools.enable_auto_tool_choice, tools.tool_call_parser) == (True, "llama3_json")
    assert (cfg.enable_auto_tool_choice, cfg.tool_call_parser) == (False, "auto")


@pytest.mark.parametrize("args,needle", [
    (["--max-request-bytes", "100"], "--max-request-bytes"),
    (["--shutdown-grace-s", "-1"], "--shutdown-grace-s"),
    (["--max-connections", "0"], "--max-connections"),
    (["--keepalive-timeout-s", "0"], "--keepalive-timeout-s"),
    (["--header-timeout-s", "soon"], "--header-timeout-s"),
    (["--api-key", "a", "--api-key-file", "b"], "--api-key-file"),
    (["--api-key-file", "/no/such/key-file"], "/no/such/key-file"),
    (["--tool-call-parser", "mistral"], "llama3_json"),
])
def test_serve_usage_errors_exit_2(args: list[str], needle: str) -> None:
    r = run("serve", *args, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert needle in r.stderr and "Traceback" not in r.stderr
