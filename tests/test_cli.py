"""The command line: usage errors exit 2 with a message that names what is wrong (checked in this process);
generate works (a real `python -m rapidserve.cli` process)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rapidserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def usage_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """`rapidserve ARGS` in this process (a process each only repeats `sys.exit(main())`, which
    test_generate_chat_with_default_model and the other files' CLI tests run): it must exit 2 with a
    message, and no exception may escape it (a traceback); its stderr. A missed check fails at once
    instead of serving forever: here `serve` cannot reach the server (its `run` builds the config tree,
    as the real one does once the port is bound, then fails the test)."""
    from unittest import mock

    from rapidserve.cli import main

    def run(scfg: object, build: Any, model: object, start: object = None) -> int:
        build()
        raise AssertionError("serve got past its checks")

    capsys.readouterr()
    with mock.patch("rapidserve.server.serve.run", side_effect=run):
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
    # past the model's positions: refused when the config is built, before anything is sized by it
    (["--model", "preset:tiny-llama", "--device", "cpu", "--max-model-len", "1025"],
     "--max-model-len 1025 is more than the model's max_position_embeddings=1024 (tiny-llama)"),
    (["--model", "preset:tiny-llama", "--device", "cpu", "--max-model-len", str(10**12)],
     "Lower --max-model-len to at most 1024"),
])
def test_usage_errors_exit_2(args: list[str], needle: str, capsys: pytest.CaptureFixture[str],
                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LONG_ENV, raising=False)
    assert needle in usage_error(capsys, "generate", "--prompt", "hi", *args)


LONG_ENV = "RAPIDSERVE_ALLOW_LONG_MAX_MODEL_LEN"


@pytest.mark.parametrize("args,needle", [
    # 1M tokens: past the CPU pool's ~700K
    (["--max-model-len", "1000000"], "KV cache"),
    # refused before anything is sized by it (a RoPE table of 10^12 rows), saying what is allowed
    (["--max-model-len", str(10**12)], "use --max-model-len <= 699040"),
])
def test_the_cpu_pool_refuses_what_it_cannot_hold(args: list[str], needle: str, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the model's positions, allowed by the environment: the KV pool's own check still refuses these."""
    monkeypatch.setenv(LONG_ENV, "1")
    assert needle in usage_error(capsys, "generate", "--prompt", "hi", "--model", "preset:tiny-llama", "--device",
                                 "cpu", *args)


@pytest.mark.parametrize("args", [
    ["serve"],
    ["serve", "--mode", "hybrid"],
    ["serve", "--mode", "disagg"],
    ["serve", "-tp", "2"],
    ["serve", "--mode", "hybrid", "-tp", "2"],
    ["serve", "-dp", "2"],
    ["profile"],
])
def test_max_model_len_past_the_model_exits_2_in_every_mode(args: list[str], capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LONG_ENV, raising=False)
    err = usage_error(capsys, *args, "--model", "preset:tiny-llama", "--device", "cpu", "--max-model-len", "4096")
    assert ("--max-model-len 4096 is more than the model's max_position_embeddings=1024" in err
            and f"{LONG_ENV}=1" in err), err
    monkeypatch.setenv(LONG_ENV, "sure")
    err = usage_error(capsys, *args, "--model", "preset:tiny-llama", "--device", "cpu")
    assert f"{LONG_ENV}='sure': use 1" in err


@pytest.mark.parametrize("value,allowed", [("1", True), ("0", False), (None, False)])
def test_serve_takes_the_env_override_into_the_config(value: str | None, allowed: bool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Read once by the CLI and carried by the config tree (nothing below reads the environment)."""
    from unittest import mock

    from rapidserve.cli import main

    if value is None:
        monkeypatch.delenv(LONG_ENV, raising=False)
    else:
        monkeypatch.setenv(LONG_ENV, value)
    with mock.patch("rapidserve.server.serve.run", return_value=0) as run_:
        assert main(["serve", "--model", "preset:tiny-llama", "--device", "cpu", "--mode", "hybrid", "-tp", "2",
                     "--max-model-len", "1024"]) == 0
    ecfg, _ = run_.call_args.args[1]()  # `build`, which `run` calls once the port is bound
    assert ecfg.max_model_len == 1024 and ecfg.scheduler.allow_long_max_model_len is allowed
    assert ecfg.parallel.tensor_parallel_size == 2 and ecfg.launch.mode == "hybrid"


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
    from rapidserve.cli import build_parser
    from rapidserve.cli_serve import server_config

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
    (["--tool-call-parser", "pythonic"], "llama3_json"),
])
def test_serve_usage_errors_exit_2(args: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert needle in usage_error(capsys, "serve", *args)


SLO_NUMBER = "must be a positive, finite number of ms, or none for no ITL SLO"
SLO_WORD = "is not a number of ms; give one (e.g. 50), or none for no ITL SLO"


@pytest.mark.parametrize(("text", "want"), [
    ("none", None), ("None", None), (" NONE ", None),  # no ITL SLO
    ("50", 50.0), ("0.5", 0.5), ("1e3", 1000.0),
    ("0", f"'0' {SLO_NUMBER}"), ("-1", f"'-1' {SLO_NUMBER}"), ("inf", f"'inf' {SLO_NUMBER}"),
    ("nan", f"'nan' {SLO_NUMBER}"),
    ("abc", f"'abc' {SLO_WORD}"), ("off", f"'off' {SLO_WORD}"), ("", f"'' {SLO_WORD}"),  # one spelling: none
])
@pytest.mark.parametrize("command", ["serve", "profile"])
def test_slo_itl_ms_is_a_number_of_ms_or_none(command: str, text: str, want: float | str | None,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """--slo-itl-ms as argparse parses it for both commands that take it: the value, or a usage error (exit 2)
    naming the flag, what was given and what is allowed."""
    from rapidserve.cli import build_parser

    parser = build_parser()
    assert parser.parse_args([command]).slo_itl_ms == 50.0  # the default
    if not isinstance(want, str):
        assert parser.parse_args([command, "--slo-itl-ms", text]).slo_itl_ms == want
        return
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        parser.parse_args([command, f"--slo-itl-ms={text}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument --slo-itl-ms: {want}" in err, err


@pytest.mark.parametrize("argv,env,want", [
    ([], {"VLLM_API_KEY": "v"}, "v"),  # a vLLM user's key in the environment: the server is not left open
    ([], {"RAPIDSERVE_API_KEY": "r", "VLLM_API_KEY": "r"}, "r"),
    ([], {"RAPIDSERVE_API_KEY": "r", "VLLM_API_KEY": " "}, "r"),
    (["--api-key", "flag"], {"VLLM_API_KEY": "v", "RAPIDSERVE_API_KEY": "r"}, "flag"),  # the flag first, as vLLM
    ([], {"VLLM_API_KEY": ""}, None),
    ([], {"RAPIDSERVE_API_KEY": "r", "VLLM_API_KEY": "v"}, "different keys"),
])
def test_the_api_key_from_vllms_environment_variable(argv: list[str], env: dict[str, str], want: str | None) -> None:
    from rapidserve.cli import build_parser
    from rapidserve.cli_serve import server_config
    from rapidserve.config_base import ConfigError

    a = build_parser().parse_args(["serve", *argv])
    if want == "different keys":
        with pytest.raises(ConfigError, match=r"\$RAPIDSERVE_API_KEY and \$VLLM_API_KEY are set to different keys"):
            server_config(a, env)
    else:
        assert server_config(a, env).api_key == want
