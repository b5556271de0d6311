"""The audit of `vllm serve`'s flags (vLLM 0.26, tests/data/vllm_0_26_surface.json), pinned: each one, given to
`rapidserve serve` (the real parser; nothing runs), is one of:

- rapidserve's own flag, taken by its exact name (never as an abbreviation of another), documented, and setting
  something (the parsed flags differ from those without it), or in the group of vLLM flags that change nothing;
- accepted because it asks for what rapidserve does anyway (vllm_serve_flags.NO_OP: its help says why), any other
  value refused naming the flag;
- refused by name: exit 2, the message naming the flag as vLLM's with why and what to use instead
  (vllm_serve_flags.REFUSED), never argparse's bare "unrecognized arguments".
The flags rapidserve honours newly for vLLM's users reach the ServerConfig (the last tests).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from rapidserve.cli import build_parser
from rapidserve.cli_serve import server_config
from rapidserve.vllm_serve_flags import NO_OP, REFUSED, SWITCH, _Refused

SURFACE = json.loads((Path(__file__).parent / "data" / "vllm_0_26_surface.json").read_text())
FLAGS = sorted({*SURFACE["serve_flags"]["frontend"], *SURFACE["serve_flags"]["engine"]})
BASE = ["serve", "preset:tiny-llama"]
PARSER = build_parser()  # parsing leaves it as it was: one for every case
SAME_GROUP = "vLLM flags that change nothing on rapidserve (accepted)"
# on by default, as in vLLM (the request log line: on by default here; its --no- form turns it off)
DEFAULT_FORMS = ("--async-scheduling", "--enable-prefix-caching", "--enable-chunked-prefill", "--enable-log-requests")
# a value for each of rapidserve's own flags that takes one and has no choices
SAMPLES: dict[str, str] = {
    "--api-key": "k", "--chat-template": "{{ messages[0].content }}", "--host": "0.0.0.0", "--port": "8001",
    "--data-parallel-size": "2", "-dp": "2", "--tensor-parallel-size": "2", "-tp": "2", "--download-dir": "/tmp",
    "--generation-config": "vllm", "--gpu-memory-utilization": "0.5", "--kv-cache-dtype": "fp8",
    "--kv-events-config": '{"enable_kv_cache_events": true}', "--max-model-len": "64",
    "--max-num-batched-tokens": "128", "--max-num-seqs": "4", "--model": "preset:tiny-llama",
    "--num-gpu-blocks-override": "40", "--quantization": "fp8", "-q": "fp8", "--revision": "v1", "--seed": "3",
    "--served-model-name": "a", "--tokenizer": "/tmp", "--default-chat-template-kwargs": '{"enable_thinking": false}',
    "--shutdown-timeout": "5", "--dtype": "half", "--kv-cache-memory-bytes": "8G",
}


@pytest.fixture(scope="module")
def serve() -> argparse.ArgumentParser:
    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def parse(args: list[str]) -> argparse.Namespace | str:
    """The parsed `rapidserve serve` flags, or the usage error's message (exit 2)."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return PARSER.parse_args([*BASE, *args])
        except SystemExit as e:
            assert e.code == 2
    return err.getvalue()


def value_for(action: argparse.Action, flag: str) -> list[str]:
    if action.nargs == 0:
        return []
    if getattr(action, "accepted", SWITCH) is None:  # a NO_OP flag taking any value
        return ["x"]
    accepted = getattr(action, "accepted", None)
    if accepted:
        return [accepted[0]]
    if action.choices:
        return [next((str(c) for c in action.choices if c != action.default), str(next(iter(action.choices))))]
    return [SAMPLES[flag]]


@pytest.mark.parametrize("flag", FLAGS)
def test_each_vllm_flag_is_taken_accepted_or_refused_by_name(serve: argparse.ArgumentParser, flag: str) -> None:
    action = serve._option_string_actions.get(flag)
    if action is None or isinstance(action, _Refused):  # refused: named, as vLLM's, with why (argparse would take
        #                                                  one that begins a rapidserve flag as its abbreviation)
        why = REFUSED.get(flag)
        assert why is not None, f"{flag}: vLLM's flag, neither taken nor in vllm_serve_flags.REFUSED"
        got = parse([flag, "1"])
        assert isinstance(got, str), f"{flag}: accepted, as an abbreviation of another flag"
        assert f"does not support vLLM's {flag} ({why})" in got, got
        return
    got = parse([flag, *value_for(action, flag)])
    if flag == "--no-enable-chunked-prefill":  # rapidserve always chunks: refused naming it
        assert isinstance(got, str) and "always chunks" in got
        return
    assert isinstance(got, argparse.Namespace), f"{flag}: {got}"
    if flag in NO_OP:
        values, why = NO_OP[flag]
        assert action.help.endswith(why)  # type: ignore[union-attr]
        if values:  # another value: refused, naming the flag and why
            bad = parse([flag, "other"])
            assert isinstance(bad, str) and flag in bad and f"does not support 'other' ({why})" in bad, bad
        return
    group = next(g.title for g in serve._action_groups if action in g._group_actions)
    assert group == SAME_GROUP or flag in DEFAULT_FORMS or vars(got) != vars(parse([])), f"{flag}: nothing set"


def test_no_op_and_refused_flags_are_vllm_flags() -> None:
    """The tables name vLLM's flags (0.26's, and a few older ones users still type), not typos."""
    older = {"--max-seq-len-to-capture", "--rope-scaling", "--swap-space", "-O", "--no-use-tqdm-on-load"}
    assert set(NO_OP) - set(FLAGS) == set()
    assert set(REFUSED) - set(FLAGS) - older == set()


def test_unknown_flags_and_vllm_spellings() -> None:
    got = parse(["--frobnicate", "1"])
    assert isinstance(got, str) and "does not support --frobnicate (neither a rapidserve flag nor one of vLLM" in got
    for args, needle in ((["-O3"], "vLLM's -O3 (no torch.compile"), (["--enable_lora"], "vLLM's --enable-lora (no "
                                                                                        "LoRA"),
                         (["--compilation-config.level", "3"], "vLLM's --compilation-config.level (no torch.compile"),
                         (["--kv-events-config.endpoint", "x"], "give --kv-events-config one JSON object")):
        got = parse(args)
        assert isinstance(got, str) and needle in got, got
    ns = parse(["--max_model_len", "64", "--max_num_seqs=4", "--served-model-name", "a_b"])  # vLLM's underscores
    assert isinstance(ns, argparse.Namespace) and (ns.max_model_len, ns.max_num_seqs) == (64, 4)
    assert ns.served_model_name == ["a_b"]  # a value keeps its underscores


def scfg(*args: str) -> Any:
    ns = parse(list(args))
    assert isinstance(ns, argparse.Namespace), ns
    return server_config(ns, env={})


def test_newly_honoured_flags_reach_the_server_config() -> None:
    base = scfg()
    assert (base.default_chat_template_kwargs, base.exclude_tools_when_tool_choice_none, base.force_include_usage,
            base.log_requests, base.shutdown_grace_s) == (None, False, False, True, 10.0)
    got = scfg("--default-chat-template-kwargs", '{"enable_thinking": false}', "--exclude-tools-when-tool-choice-none",
               "--enable-force-include-usage", "--no-enable-log-requests", "--shutdown-timeout", "3")
    assert (got.default_chat_template_kwargs, got.exclude_tools_when_tool_choice_none, got.force_include_usage,
            got.log_requests, got.shutdown_grace_s) == ({"enable_thinking": False}, True, True, False, 3.0)
    for bad, needle in (("[1]", "JSON object"), ("{x", "not JSON"), ('{"tools": []}', "tools: the renderer")):
        got = parse(["--default-chat-template-kwargs", bad])
        assert isinstance(got, str) and "--default-chat-template-kwargs" in got and needle in got, got


def test_several_api_keys_are_refused_by_name() -> None:
    """vLLM's --api-key takes several keys; rapidserve's one: more is a ConfigError naming the flag."""
    from rapidserve.config_base import ConfigError

    assert scfg("--api-key", "k").api_key == "k"
    with pytest.raises(ConfigError, match="--api-key: rapidserve takes one key, not 2"):
        scfg("--api-key", "k1", "k2")
