"""`rapidserve serve`: its flags, what they become (the `ServerConfig`, the API key) and the command itself."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Mapping
from typing import Any

from rapidserve.cli_args import (
    add_model_args,
    add_partition_args,
    engine_kwargs,
    given_profile,
    int_at_least,
    nonneg_float,
    nonneg_int,
    partition_config,
    positive_float,
    positive_int,
    serve_mode,
    setting_kwargs,
)
from rapidserve.cli_vllm import add_vllm_serve_args, serve_model, server_fields
from rapidserve.config import EngineConfig
from rapidserve.config_base import ConfigError
from rapidserve.engine_settings import engine_sections
from rapidserve.launch_config import ENGINE_MODES
from rapidserve.server_config import TOOL_CALL_PARSERS, ServerConfig


def add_serve_parser(sub: Any) -> None:
    """Add `serve` to the `rapidserve` subcommands (`sub` from ArgumentParser.add_subparsers)."""
    sv = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API (prefill and decode workers)")
    add_model_args(sv)
    add_vllm_serve_args(sv)  # MODEL, --served-model-name, logs, vLLM's flags that change nothing here
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    sv.add_argument("--port", type=_port, default=8000)
    sv.add_argument("--mode", default=None, choices=ENGINE_MODES,
                    help="(default: rapid, or hybrid with --policy fused) rapid: prefill and decode in two processes "
                         "sharing weights and KV; hybrid: one "
                         "process, Sarathi-Serve/vLLM-style chunked prefill mixed with decodes in one forward "
                         "pass per step under --max-num-batched-tokens (the baseline); disagg: a prefill side on "
                         "the first N GPUs (N = --prefill-tensor-parallel-size, default -tp) and a decode side on "
                         "the next M (M = -tp), each with its own copy of the weights sharded over its GPUs, the "
                         "prompt's KV copied into decode's pool over NVLink/PCIe, each rank its own KV heads "
                         "(the NPMD disaggregated baseline; 1P1D by default, on two GPUs; N and M must divide the "
                         "model's KV heads and one the other; no -dp; on CPU every rank runs on the CPU)")
    par = sv.add_argument_group("parallelism (GPUs picked with CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES)")
    par.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1,
                     help="GPUs each layer is split over (NCCL/RCCL on GPUs, gloo on CPU): per GPU a decode and a "
                          "prefill worker (rapid) or a hybrid worker; must divide the model's attention heads")
    par.add_argument("--prefill-tensor-parallel-size", "--prefill-tp", type=positive_int, default=None,
                     help="--mode disagg only: GPUs the prefill side's layers are split over (default: -tp, the "
                          "decode side's); prefill takes the first N GPUs, decode the next -tp")
    par.add_argument("--data-parallel-size", "-dp", type=positive_int, default=1,
                     help="independent engines behind this one server, each on its own GPUs (least-loaded "
                          "dispatch)")
    key = sv.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=None, nargs="+", metavar="KEY",
                     help="require 'Authorization: Bearer KEY' on every route but /health and /openapi.json "
                          "(visible in `ps`: prefer --api-key-file or $RAPIDSERVE_API_KEY, else vLLM's $VLLM_API_KEY, "
                          "read when neither flag is given); one key (vLLM takes several: more is refused)")
    key.add_argument("--api-key-file", default=None, metavar="PATH",
                     help="read the API key from the first line of this file")
    sv.add_argument("--metrics-public", action="store_true",
                    help="serve /metrics without the API key (for a Prometheus that cannot send one)")
    sv.add_argument("--max-waiting", type=nonneg_int, default=512,
                    help="requests queued beyond --max-num-seqs before answering 503")
    sv.add_argument("--default-max-tokens", type=positive_int, default=None,
                    help="max_tokens of a request that gives none, at most what its context leaves (default: the "
                         "model's generation_config.json max_new_tokens, else 256)")
    sv.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                    help="where unset sampling fields (temperature, top_p, top_k, min_p, repetition_penalty, "
                         "max_tokens) take their defaults from, as vLLM's flag: auto (the model folder's "
                         "generation_config.json; a GGUF file or preset has none), vllm (vLLM's own defaults) or "
                         "a folder holding a generation_config.json; a request's own values win")
    sv.add_argument("--max-request-bytes", type=int_at_least(1024), default=8 * 1024 * 1024,
                    help="largest request body accepted (larger: 413)")
    sv.add_argument("--shutdown-grace-s", "--shutdown-timeout", type=nonneg_float, default=10.0,
                    help="on SIGTERM/SIGINT, seconds requests in flight may take to finish before they are "
                         "ended with an error (--shutdown-timeout: vLLM's name)")
    sv.add_argument("--max-connections", type=positive_int, default=2048,
                    help="open connections at most; beyond it the oldest idle one is closed, or the new "
                         "one answered 503")
    sv.add_argument("--keepalive-timeout-s", type=positive_float, default=15.0,
                    help="close a keep-alive connection idle for this long")
    sv.add_argument("--header-timeout-s", type=positive_float, default=10.0,
                    help="close a connection whose request line and headers take longer than this")
    tools = sv.add_argument_group("tool calling (tool_choice \"required\" and named functions need neither flag)")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="let tool_choice \"auto\" (the default when a request has tools) parse the model's own "
                            "tool calls; without it such requests get 400, as in vLLM")
    tools.add_argument("--tool-call-parser", default="auto", choices=TOOL_CALL_PARSERS,
                       help="with --enable-auto-tool-choice (else refused), the format of the model's tool calls: "
                            "hermes (<tool_call> JSON: Qwen2/2.5/3, Hermes), llama3_json (Llama 3.1/3.2 JSON), mistral "
                            "([TOOL_CALLS]: Mistral), or auto: from the chat template, else the model family")
    chat = sv.add_argument_group("chat template")
    chat.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                      help="a Jinja chat template to use instead of the model's: a file, or the template itself "
                           "(as vLLM's flag); checked at start-up")
    chat.add_argument("--trust-request-chat-template", action="store_true",
                      help="let a chat request bring its own 'chat_template' (a template is code the server runs; "
                           "without the flag such requests get 400, as in vLLM)")
    sv.add_argument("--mps", default="auto", choices=("auto", "on", "off"))
    sv.add_argument("--on-worker-death", default="restart", choices=("restart", "shutdown"))
    sv.add_argument("--max-restarts", type=nonneg_int, default=5,
                    help="--on-worker-death restart: worker restarts allowed in any --restart-window-s; one more "
                         "death and the server exits non-zero for its supervisor to restart it (0: never restart)")
    sv.add_argument("--restart-window-s", type=positive_float, default=600.0)
    sv.add_argument("--heartbeat-timeout-s", type=positive_float, default=None,
                    help="a worker silent this long is killed as hung (default: 60 on a GPU, 600 on a CPU)")
    sv.add_argument("--step-trace", metavar="PATH", default=None,
                    help="append every landed step of the decode worker to PATH, a JSON line each: its shape, rows, "
                         "contexts, prompt chunks, the policy's prediction and the measured time (for "
                         "bench/step_fit.py; -dp N: one file per engine, .dp<i> before the suffix: steps.jsonl -> "
                         "steps.dp1.jsonl); a diagnostic, ~250 bytes a step")
    add_partition_args(sv)
    sv.set_defaults(func=cmd_serve)


def cmd_serve(a: argparse.Namespace) -> int:
    """Checks every flag that needs no model (the settings each mode and policy read among them:
    `engine_sections`), then `run`: the port is bound first (busy: exit 1 at once), and the config tree is built
    (`build`: a bad model or --max-model-len exits 2), then auto-profiled, while it answers 503 starting."""
    from rapidserve.config import ParallelConfig
    from rapidserve.engine.step_trace import check_trace_path
    from rapidserve.launch_config import LaunchConfig
    from rapidserve.server.serve import run, start_engine
    from rapidserve.server.startup import BindError

    model = serve_model(a)  # MODEL or --model
    scfg = server_config(a)  # before the model loads: a bad key file fails at once
    pcfg = partition_config(a)
    profile = given_profile(a, pcfg)  # --profile parsed once, here: the engine's decode workers get this object
    parallel = ParallelConfig(tensor_parallel_size=a.tensor_parallel_size, data_parallel_size=a.data_parallel_size,
                              prefill_tensor_parallel_size=a.prefill_tensor_parallel_size)
    if parallel.world_size > 1 and str(a.device).startswith("cuda:"):  # before the model loads, too
        raise ConfigError(f"--device {a.device} names one GPU but --tensor-parallel-size x --data-parallel-size uses "
                          f"{parallel.world_size}; use --device cuda (or auto) and pick GPUs with CUDA_VISIBLE_DEVICES")
    if a.step_trace is not None:
        check_trace_path(a.step_trace)  # before the model loads: a bad path fails at once
    launch = LaunchConfig(mps=a.mps, on_worker_death=a.on_worker_death, mode=serve_mode(a),
                          max_restarts=a.max_restarts, restart_window_s=a.restart_window_s,
                          heartbeat_timeout_s=a.heartbeat_timeout_s, log_level=a.log_level,
                          step_trace=a.step_trace)
    engine_sections(**setting_kwargs(a), launch=launch, partition=pcfg)  # type: ignore[arg-type]

    def build() -> tuple[object, object]:  # on a thread of `run`, once the port answers (imports torch)
        from rapidserve.config_builder import build_engine_config

        ecfg, source = build_engine_config(model, **engine_kwargs(a), launch=launch,  # type: ignore[arg-type]
                                           partition=pcfg, parallel=parallel)
        return auto_profile(ecfg, a.auto_profile, os.environ), source

    try:
        return run(scfg, build, model, start=functools.partial(start_engine, profile=profile))  # type: ignore[arg-type]
    except BindError as e:
        print(f"rapidserve: error: {e}", file=sys.stderr)
        return 1


def auto_profile(ecfg: EngineConfig, auto: bool, env: Mapping[str, str]) -> EngineConfig:
    """`ecfg` with the profile measured or cached for this GPU at start (partition/autoprofile.py), logged
    through the server's logging (`run` configures it before `build` runs); unchanged where auto-profiling does
    not apply (then nothing is started)."""
    from rapidserve.partition.autoprofile import profile_cache_dir, with_auto_profile

    return with_auto_profile(ecfg, auto=auto, cache_dir=profile_cache_dir(env))


def server_config(a: argparse.Namespace, env: Mapping[str, str] | None = None) -> ServerConfig:
    """The serve flags as a ServerConfig (the API key as `api_key` resolves it; the --chat-template read
    and checked: a ConfigError when it cannot be read or does not parse)."""
    from rapidserve.tokenizer import ChatTemplateError, load_chat_template

    try:
        template = None if a.chat_template is None else load_chat_template(a.chat_template)
    except ChatTemplateError as e:
        raise ConfigError(str(e)) from None
    return ServerConfig(host=a.host, port=a.port, api_key=api_key(a, env), metrics_public=a.metrics_public,
                        max_waiting=a.max_waiting, max_body_bytes=a.max_request_bytes,
                        default_max_tokens=a.default_max_tokens, shutdown_grace_s=a.shutdown_grace_s,
                        max_connections=a.max_connections, keepalive_timeout_s=a.keepalive_timeout_s,
                        header_timeout_s=a.header_timeout_s, enable_auto_tool_choice=a.enable_auto_tool_choice,
                        tool_call_parser=a.tool_call_parser, chat_template=template,
                        trust_request_chat_template=a.trust_request_chat_template, **server_fields(a))


API_KEY_ENV = "RAPIDSERVE_API_KEY"
VLLM_API_KEY_ENV = "VLLM_API_KEY"  # vLLM's: its server reads it where --api-key is not given


def api_key(a: argparse.Namespace, env: Mapping[str, str] | None = None) -> str | None:
    """The server's API key: --api-key, else the first line of --api-key-file, else $RAPIDSERVE_API_KEY, else
    $VLLM_API_KEY, as vLLM reads it (empty: none; a vLLM user's key in the environment must not leave the server
    open). A file that is missing, unreadable or empty is a ConfigError naming it, and so are the two variables set
    to different keys."""
    if a.api_key is not None:
        keys = [a.api_key] if isinstance(a.api_key, str) else list(a.api_key)
        if len(keys) > 1:
            raise ConfigError(f"--api-key: rapidserve takes one key, not {len(keys)} (vLLM's flag takes several): "
                              "give one, and that one to every client (a model given after the key: put MODEL "
                              "first, or use --model)")
        if not keys[0].strip():
            raise ConfigError("--api-key is empty; give a key, or leave the flag out")
        return str(keys[0])
    if a.api_key_file is not None:
        try:
            with open(a.api_key_file, encoding="utf-8") as f:
                key = f.readline().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--api-key-file {a.api_key_file}: cannot read it ({e}); give a readable file "
                              "whose first line is the key") from None
        if not key:
            raise ConfigError(f"--api-key-file {a.api_key_file}: the file is empty; its first line must be the key")
        return key
    env = os.environ if env is None else env
    ours, vllms = env.get(API_KEY_ENV, "").strip(), env.get(VLLM_API_KEY_ENV, "").strip()
    if ours and vllms and ours != vllms:
        raise ConfigError(f"${API_KEY_ENV} and ${VLLM_API_KEY_ENV} are set to different keys: rapidserve takes one; "
                          f"unset one of them, or pass --api-key-file PATH")
    return ours or vllms or None


def _port(text: str) -> int:
    v = nonneg_int(text)
    if v > 65535:
        raise argparse.ArgumentTypeError(f"{v} is not a TCP port (0..65535; 0 picks a free one)")
    return v
