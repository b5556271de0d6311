"""The command line: usage errors exit 2 with a message that names what is wrong (checked in this process);
generate works (a real `python -m rapidserve.cli` process)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rapidserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def usage_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """`rapidserve ARGS` in this process (a process each only repeats `sys.exit(main())`, which
    test_generate_chat_with_default_model and the other files' CLI tests run): it must exit 2 with a
    message, and no exception may escape it (a traceback); its stderr. A missed check fails at once
    instead of serving forever: here `serve` cannot reach the server."""
    from unittest import mock

    from rapidserve.cli import main

    capsys.readouterr()
    with mock.patch("rapidserve.server.serve.run", side_effect=AssertionError("serve got past its checks")):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's usage errors
            code = e.code
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("args,needle", [
    (["--model", "/no/such/model"], "/no/such/model"),
    (["--model", "preset:no-such-preset"], "no-such-preset"),
    (["--dtype", "float64"], "float64"),
    (["--gpu-memory-utilization", "1.5"], "1.5"),
    (["--device", "tpu"], "tpu"),
    (["--max-num-seqs", "0"], "0"),
    (["--model", "preset:tiny-llama", "--device", "cpu"], "no tokenizer"),  # string prompt, no tokenizer
    # 1M tokens: past the CPU pool's ~700K
    (["--model", "preset:tiny-llama", "--device", "cpu", "--max-model-len", "1000000"], "KV cache"),
    # refused before anything is sized by it (a RoPE table of 10^12 rows), saying what is allowed
    (["--model", "preset:tiny-llama", "--device", "cpu", "--max-model-len", str(10**12)],
     "use --max-model-len <= 699040"),
])
def test_usage_errors_exit_2(args: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert needle in usage_error(capsys, "generate", "--prompt", "hi", *args)


def test_unsupported_model_file_lists_supported_forms(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "model.bin"
    bad.write_bytes(b"\\x00" * 100)
    err = usage_error(capsys, "generate", "--prompt", "hi", "--model", str(bad))
    assert str(bad) in err and "preset:" in err


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
def test_serve_usage_errors_exit_2(args: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert needle in usage_error(capsys, "serve", *args)
