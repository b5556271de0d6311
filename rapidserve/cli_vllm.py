"""What vLLM's users type, on rapidserve's command line: accepted and honoured, or refused by name.

- `rapidserve serve MODEL` (positional, as `vllm serve MODEL`) or `--model MODEL`; both and different: an
  error. A Hub id (`Qwen/Qwen3-8B`) is read from the local Hugging Face cache (`--revision`,
  `--download-dir`; never downloaded: loader/hub.py). `--load-format dummy`: the model's shapes with
  random weights.
- `--served-model-name A B ...` (the first is reported), `--disable-log-requests` / `--enable-log-requests`,
  `--log-level`, `--uvicorn-log-level` (the HTTP server's own log: rapidserve runs aiohttp, not uvicorn),
  `--dtype half|float` (vLLM's aliases), `--num-gpu-blocks-override` (= --num-kv-blocks).
- `--kv-events-config JSON`: the prefix cache's block events over ZMQ for a KV-aware router, vLLM's keys and
  wire (kv_events_config.py; its block hashes seeded by $PYTHONHASHSEED, as vLLM's).
- `--reasoning-parser deepseek_r1|qwen3`: chat answers split into `reasoning_content` (and vLLM's newer name,
  `reasoning`) and `content` (server/reasoning_parsers.py); any other name: exit 2 listing these.
- Flags that change nothing here, accepted with what they mean on rapidserve (the help says it):
  `--trust-remote-code` (no model code is ever run from a repository), `--disable-log-stats` (no
  periodic stats lines are logged), `--enable-chunked-prefill` (prompts are always chunked),
  `--scheduling-policy fcfs`, `--tokenizer-mode auto`. (`--quantization` / `-q` and `--kv-cache-dtype` are every
  command's: fp8 / none / auto and auto / fp8 / fp8_e4m3 / the model's dtype accepted, anything else refused by
  name, `engine_settings.check_unsupported_options`.)
- Any other flag: argparse refuses it; `CliParser` rewrites that message to name each flag and say that
  rapidserve does not support it, with the reason for vLLM's common ones (`UNSUPPORTED`).
"""

from __future__ import annotations

import argparse
import re
from typing import Any, NoReturn

from rapidserve.config import LOAD_FORMATS
from rapidserve.config_base import LOG_LEVELS, ConfigError
from rapidserve.server_config import REASONING_PARSERS

_PROXY = "put a reverse proxy (nginx, envoy) in front of rapidserve for it"
UNSUPPORTED: dict[str, str] = {  # vLLM serve flags rapidserve lacks -> why (or what to use instead)
    "--pipeline-parallel-size": "only tensor (-tp) and data (-dp) parallelism",
    "-pp": "only tensor (-tp) and data (-dp) parallelism",
    "--enable-lora": "no LoRA adapters", "--lora-modules": "no LoRA adapters", "--max-loras": "no LoRA adapters",
    "--max-lora-rank": "no LoRA adapters",
    "--speculative-config": "no speculative decoding",
    "--cpu-offload-gb": "no weight offloading to CPU memory",
    "--swap-space": "preempted requests are recomputed, never swapped to CPU memory",
    "--distributed-executor-backend": "workers are processes of one host (no Ray)",
    "--limit-mm-per-prompt": "text-only models", "--mm-processor-kwargs": "text-only models",
    "--ssl-keyfile": f"no TLS: {_PROXY}", "--ssl-certfile": f"no TLS: {_PROXY}", "--ssl-ca-certs": f"no TLS: {_PROXY}",
    "--root-path": _PROXY, "--allowed-origins": f"no CORS headers: {_PROXY}",
    "--uds": "TCP only: --host and --port",
    "--rope-scaling": "the model's config.json is read as it is", "--hf-overrides": "the model's config.json is "
                                                                                    "read as it is",
    "--max-seq-len-to-capture": "decode graphs cover batches up to --max-num-seqs, prefill graphs the "
                                "--prefill-graph-tokens buckets",
    "--compilation-config": "no torch.compile (CUDA graphs: --enforce-eager, --prefill-graph-tokens)",
    "-O": "no torch.compile (CUDA graphs: --enforce-eager, --prefill-graph-tokens)",
    "--tokenizer-revision": "the tokenizer comes from the model's folder, or --tokenizer DIR",
    "--max-logprobs": "the limit is fixed (20 per token)",
    "--enable-sleep-mode": "no sleep mode", "--kv-transfer-config": "disaggregation is --mode disagg (one host)",
    "--enable-expert-parallel": "no expert parallelism: a mixture-of-experts model's experts are each sliced over "
                                "the tensor-parallel ranks (-tp)",
    "--api-server-count": "one server process (with --data-parallel-size engines behind it)",
    "--enable-prompt-embeds": "prompts are text or token ids",
    "--calculate-kv-scales": "fp8 KV cache scales are the checkpoint's calibrated ones (a compressed-tensors "
                             "kv_cache_scheme, e.g. from llm-compressor) or 1.0, never computed from the first batch",
}


class CliParser(argparse.ArgumentParser):
    """argparse, with unknown flags refused by name: "rapidserve does not support --X (why)"."""

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        """As argparse's, but the command whose flags were given reports what it does not take (not the top)."""
        ns, extra = self.parse_known_args(args, namespace)
        if extra:
            sub = next((a.choices.get(getattr(ns, "command", None) or "") for a in self._actions
                        if isinstance(a, argparse._SubParsersAction)), None)
            (sub or self).error("unrecognized arguments: " + " ".join(extra))
        return ns

    def error(self, message: str) -> NoReturn:
        m = re.fullmatch(r"unrecognized arguments: (.*)", message)
        if m:
            flags = [w.split("=", 1)[0] for w in m[1].split() if w.startswith("-")]
            if flags:
                message = ("; ".join(_refusal(self.prog, f) for f in flags)
                           + f". See `{self.prog} --help` for the flags it takes")
        super().error(message)


def _refusal(prog: str, flag: str) -> str:
    why = UNSUPPORTED.get(flag) or next((w for f, w in UNSUPPORTED.items() if f.startswith("-") and len(f) == 2
                                         and flag.startswith(f) and not flag.startswith("--")), None)
    return f"{prog} does not support {flag}" + (f" ({why})" if why else "")


def dtype_name(text: str) -> str:
    """--dtype with vLLM's aliases: half -> float16, float -> float32 (the choices are checked after)."""
    return {"half": "float16", "float": "float32"}.get(text, text)


def add_source_args(g: Any) -> None:
    """Where the model's files come from (every command that loads a model)."""
    g.add_argument("--revision", default=None,
                   help="a Hub id's revision in the local Hugging Face cache: a branch, tag or commit (default main)")
    g.add_argument("--download-dir", default=None, metavar="DIR",
                   help="the Hugging Face cache folder to find a Hub id in (default: $HF_HUB_CACHE, $HF_HOME/hub or "
                        "~/.cache/huggingface/hub); rapidserve never downloads")
    g.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                   help="auto (the model's form), safetensors or gguf (check the model is one), or dummy: the "
                        "model's architecture (a folder's config.json) with random weights, for testing")


def add_vllm_serve_args(sv: argparse.ArgumentParser) -> None:
    """`rapidserve serve`'s vLLM flags (see the module docstring)."""
    sv.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                    help="the model, as --model (a Hub id in the local cache, a folder, a .gguf file, preset:NAME)")
    sv.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                    help="the names the model answers to: the first is reported in responses and metrics, requests "
                         "may name any (default: the Hub id as given, else the model's folder or file name)")
    logs = sv.add_argument_group("logs")
    logs.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                      help="rapidserve's log, in the server and its workers")
    logs.add_argument("--uvicorn-log-level", default="info", choices=(*LOG_LEVELS, "trace"),
                      help="the HTTP server's own log (vLLM's flag; the HTTP server is aiohttp; trace = debug)")
    req = logs.add_mutually_exclusive_group()
    req.add_argument("--disable-log-requests", dest="log_requests", action="store_false", default=True,
                     help="no log line per request")
    req.add_argument("--enable-log-requests", dest="log_requests", action="store_true",
                     help="a log line per request (the default)")
    sv.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                    help="split chat answers into the model's reasoning (message.reasoning_content and .reasoning, "
                         "and the same in stream deltas) and its content: deepseek_r1 (DeepSeek-R1, QwQ: the answer "
                         "begins inside <think>) or qwen3 (Qwen3: the same, unless the request sends "
                         "chat_template_kwargs {\"enable_thinking\": false}); tool calls are read from the content")
    sv.add_argument("--kv-events-config", default=None, metavar="JSON",
                    help="publish the prefix cache's block events as vLLM does, for KV-aware routers: vLLM's JSON, "
                         "e.g. '{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\"}' (keys: "
                         "publisher, endpoint, replay_endpoint, topic, buffer_steps, hwm, max_queue_size); block "
                         "hashes are vLLM's sha256 ones, seeded by $PYTHONHASHSEED; needs pyzmq (the kv-events extra)")
    same = sv.add_argument_group("vLLM flags that change nothing on rapidserve (accepted)")
    same.add_argument("--trust-remote-code", action="store_true",
                      help="rapidserve never runs code from a model repository (its model code is its own)")
    same.add_argument("--disable-log-stats", action="store_true", help="rapidserve logs no periodic stats")
    same.add_argument("--enable-chunked-prefill", action=_AlwaysOn, nargs=0,
                      help="prompts longer than --max-num-batched-tokens are always chunked "
                           "(--no-enable-chunked-prefill is refused)")
    same.add_argument("--no-enable-chunked-prefill", action=_AlwaysOn, nargs=0, help=argparse.SUPPRESS)
    same.add_argument("--scheduling-policy", default="fcfs", choices=("fcfs",), help="requests are served in arrival "
                                                                                     "order")
    same.add_argument("--tokenizer-mode", default="auto", choices=("auto",), help="the Hugging Face tokenizer")


class _AlwaysOn(argparse.Action):
    """--enable-chunked-prefill: accepted; --no-enable-chunked-prefill: refused (rapidserve always chunks)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if option_string and option_string.startswith("--no-"):
            raise argparse.ArgumentError(self, "rapidserve always chunks prompts longer than --max-num-batched-tokens; "
                                               "drop the flag")


def server_fields(a: argparse.Namespace) -> dict[str, Any]:
    """The ServerConfig fields of `rapidserve serve`'s vLLM flags."""
    return {"served_model_name": tuple(a.served_model_name or ()), "log_level": a.log_level,
            "http_log_level": a.uvicorn_log_level, "log_requests": a.log_requests,
            "reasoning_parser": a.reasoning_parser}


def serve_model(a: argparse.Namespace) -> str | None:
    """The model of `rapidserve serve`: the positional MODEL or --model (ConfigError when both differ)."""
    tag, flag = getattr(a, "model_tag", None), a.model
    if tag is not None and flag is not None and tag != flag:
        raise ConfigError(f"the model is given twice, as MODEL {tag!r} and as --model {flag!r}: give one")
    return tag if tag is not None else flag

