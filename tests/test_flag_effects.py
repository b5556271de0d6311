"""Flags and `LLM` keywords that were accepted and silently had no effect (the rule: honoured, or refused by name),
each forced here: the flag given, the effect observed or the refusal's message. CPU only; no model loads, no server
starts."""

from __future__ import annotations

from typing import Any

import pytest

from rapidserve.benchmark.cli import check_bench_flags
from rapidserve.cli import build_parser, main
from rapidserve.cli_serve import server_config
from rapidserve.config import ParallelConfig
from rapidserve.launch_config import LaunchConfig
from rapidserve.llm import LLM
from rapidserve.llm_args import LLMArgumentError
from rapidserve.loader import ModelLoadError
from rapidserve.partition_config import PartitionConfig


def usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """`rapidserve ARGV`'s exit-2 message (argparse's or main's)."""
    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = int(e.code or 0)
    assert code == 2
    return capsys.readouterr().err


# `--X ... --no-X`: the NO_OP `--no-X` turns rapidserve's switch off again (the last wins, as in vLLM)
@pytest.mark.parametrize(("flags", "dest", "want"), [
    (["--enforce-eager", "--no-enforce-eager"], "enforce_eager", False),
    (["--no-enforce-eager", "--enforce-eager"], "enforce_eager", True),
    (["--no-enforce-eager"], "enforce_eager", False),
    (["--enable-auto-tool-choice", "--no-enable-auto-tool-choice"], "enable_auto_tool_choice", False),
    (["--trust-request-chat-template", "--no-trust-request-chat-template"], "trust_request_chat_template", False),
    (["--enable-force-include-usage", "--no-enable-force-include-usage"], "enable_force_include_usage", False),
    (["--exclude-tools-when-tool-choice-none", "--no-exclude-tools-when-tool-choice-none"],
     "exclude_tools_when_tool_choice_none", False),
    (["--trust-remote-code", "--no-trust-remote-code"], "trust_remote_code", False),
])
def test_serve_no_flag_turns_the_switch_off(flags: list[str], dest: str, want: bool) -> None:
    assert getattr(build_parser().parse_args(["serve", *flags]), dest) is want


def test_no_enable_auto_tool_choice_reaches_the_server_config() -> None:
    a = build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--no-enable-auto-tool-choice"])
    assert server_config(a, {}).enable_auto_tool_choice is False


# flag combinations whose flag would change nothing: refused by name
@pytest.mark.parametrize(("argv", "needles"), [
    (["serve", "--tool-call-parser", "hermes"], ["--tool-call-parser hermes", "--enable-auto-tool-choice"]),
    (["serve", "--on-worker-death", "shutdown", "--max-restarts", "3"], ["--max-restarts 3", "shutdown"]),
    (["serve", "--on-worker-death", "shutdown", "--restart-window-s", "60"], ["--restart-window-s 60"]),
    (["serve", "--max-restarts", "0", "--restart-window-s", "60"], ["--restart-window-s 60", "--max-restarts above 0"]),
    (["profile", "--device", "cpu", "--tokenizer", "/some/tokenizer"], ["--tokenizer /some/tokenizer", "token ids"]),
    (["profile", "--device", "cpu", "--seed", "7"], ["--seed 7", "samples no tokens"]),
    (["generate", "--prompt", "hi", "--sample-seed", "3"], ["--sample-seed 3", "--temperature 0"]),
])
def test_flag_that_would_change_nothing_exits_2(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                needles: list[str]) -> None:
    err = usage_error(capsys, *argv)
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize("kwargs", [
    dict(enable_auto_tool_choice=True, tool_call_parser="hermes"),
    dict(on_worker_death="shutdown"), dict(max_restarts=0), dict(max_restarts=3, restart_window_s=60.0),
])
def test_the_honoured_combinations_still_build(kwargs: dict[str, Any]) -> None:
    from rapidserve.server_config import ServerConfig

    if "tool_call_parser" in kwargs:
        ServerConfig(**kwargs)
    else:
        LaunchConfig(**kwargs)


def bench_args(*argv: str) -> Any:
    return build_parser().parse_args(["bench", *argv])


@pytest.mark.parametrize(("argv", "needle"), [
    (["--workload", "azure-code", "--input-len", "512"], "--input-len (fixed or multiturn only)"),
    (["--workload", "mooncake", "--output-len", "64"], "--output-len (fixed or multiturn only)"),
    (["--workload", "fixed", "--num-turns", "8"], "--num-turns (multiturn only)"),
    (["--workload", "fixed", "--turn-input-len", "64"], "--turn-input-len (multiturn only)"),
    (["--workload", "trace", "--trace", "t.jsonl", "--input-len", "5"], "whose request lengths come from the trace"),
    (["--goodput-search", "--percentile-metrics", "ttft"], "--percentile-metrics choose"),
    (["--goodput-search", "--metric-percentiles", "50,99"], "--metric-percentiles choose"),
])
def test_bench_flag_the_run_does_not_read_is_refused(argv: list[str], needle: str) -> None:
    with pytest.raises(ValueError) as e:
        check_bench_flags(bench_args(*argv))
    assert needle in str(e.value)


@pytest.mark.parametrize("argv", [
    ["--workload", "fixed", "--input-len", "512", "--output-len", "8"],
    ["--workload", "multiturn", "--num-turns", "3", "--turn-input-len", "16", "--input-len", "64"],
    ["--workload", "azure-code"],
    ["--percentile-metrics", "ttft", "--metric-percentiles", "50,99"],  # a sweep's table reads them
])
def test_bench_flags_the_run_reads_pass(argv: list[str]) -> None:
    check_bench_flags(bench_args(*argv))


@pytest.mark.parametrize(("kwargs", "needle"), [
    (dict(launch=LaunchConfig(step_trace="steps.jsonl")), "LLM(launch="),
    (dict(launch=LaunchConfig(mode="hybrid")), "LLM(launch="),
    (dict(parallel=ParallelConfig(tensor_parallel_size=2)), "-tp N"),
    (dict(partition=PartitionConfig(policy="drift")), "policy='drift'"),
])
def test_llm_serving_sections_it_does_not_read_are_refused(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(LLMArgumentError) as e:
        LLM("/nonexistent", device="cpu", **kwargs)  # refused before the model is looked for
    assert needle in str(e.value) and "in this process" in str(e.value)


@pytest.mark.parametrize("kwargs", [
    dict(launch=LaunchConfig()), dict(parallel=ParallelConfig()), dict(partition=PartitionConfig()),
    dict(launch=None),
])
def test_llm_serving_sections_at_their_defaults_pass_to_the_model_lookup(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ModelLoadError):  # the model's absence, not the keyword
        LLM("/nonexistent", device="cpu", **kwargs)
