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
- `--default-chat-template-kwargs`, `--exclude-tools-when-tool-choice-none`, `--enable-force-include-usage`
  (vLLM's), `--no-enable-log-requests` (= --disable-log-requests), `--shutdown-timeout` (= --shutdown-grace-s).
- vLLM's flags that ask for what rapidserve does anyway (`-pp 1`, `--no-enable-lora`...): accepted, their help
  says why (vllm_serve_flags.NO_OP; another value is refused with the same reason).
- A switch pair given together, `--X ... --no-X`: the last wins, as vLLM's BooleanOptionalAction has it
  (`last_switch_wins`), also where `--X` alone is refused: `--enable-lora --no-enable-lora` is LoRA off, accepted.
- Any other flag: argparse refuses it; `CliParser` rewrites that message to name each flag and say that
  rapidserve does not support it, with the reason and what to use instead for every vLLM 0.26 flag
  (vllm_serve_flags.REFUSED). Flags may be spelled with underscores (--max_model_len), as vLLM's parser allows.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any, NoReturn

from rapidserve.config import DTYPE_ALIASES, LOAD_FORMATS
from rapidserve.config_base import LOG_LEVELS, ConfigError
from rapidserve.jsonfile import DuplicateKeyError, loads_unique
from rapidserve.server_config import REASONING_PARSERS
from rapidserve.vllm_serve_flags import add_no_op_flags, refusal


class CliParser(argparse.ArgumentParser):
    """argparse, with unknown flags refused by name: "rapidserve does not support --X (why)"."""

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        """As argparse's, but the command whose flags were given reports what it does not take (not the top), and
        a flag may be spelled with underscores (--max_model_len), as vLLM's parser takes it."""
        argv = last_switch_wins(self, dashed(sys.argv[1:] if args is None else list(args)))
        ns, extra = self.parse_known_args(argv, namespace)
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
    why = refusal(flag)
    if why is None:  # `serve` is the command vLLM's flags are for; another command's unknown flag may be serve's
        return f"{prog} does not support {flag}" + (" (neither a rapidserve flag nor one of vLLM 0.26's)"
                                                    if prog.endswith(" serve") else "")
    return f"{prog} does not support vLLM's {flag} ({why})"


def last_switch_wins(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """`args` with each vLLM switch pair given together, `--X` and `--no-X` (vLLM's BooleanOptionalAction), cut to
    the last of them: the last wins, as in vLLM. So `--enable-lora --no-enable-lora` is LoRA off, accepted (the
    NO_OP --no-enable-lora) where --enable-lora alone is refused by name, `--no-enable-chunked-prefill
    --enable-chunked-prefill` is chunking on, and `--no-enable-lora --enable-lora` is still refused at
    --enable-lora. A pair is one where the command (the first word of `args`) takes `--no-X` as a switch and
    `--X` is its switch too, or a vLLM flag it refuses (vllm_serve_flags.REFUSED: --enable-lora, --enable-eplb...);
    nothing after `--` is touched."""
    sub = next((a.choices.get(args[0]) for a in parser._actions
                if isinstance(a, argparse._SubParsersAction)), None) if args else None
    if sub is None:
        return args
    opts = sub._option_string_actions
    end = args.index("--") if "--" in args else len(args)

    def pair(flag: str) -> str | None:
        """The pair's `--no-X` for a token of one, else None."""
        neg = flag if flag.startswith("--no-") else "--no-" + flag[2:]
        on = "--" + neg[len("--no-"):]
        if neg not in opts or opts[neg].nargs != 0:
            return None
        own = opts.get(on)
        if own is None or own.dest.startswith("vllm_refused_"):  # not the command's: vLLM's switch, refused by name
            return neg if refusal(on) is not None else None
        return neg if own.nargs == 0 else None

    last: dict[str, int] = {}
    for i, t in enumerate(args[:end]):
        key = pair(t) if t.startswith("--") and "=" not in t else None
        if key is not None:
            last[key] = i
    keep = set(last.values())
    return [t for i, t in enumerate(args)
            if i >= end or i in keep or not (t.startswith("--") and "=" not in t and pair(t) in last)]


def dashed(args: list[str]) -> list[str]:
    """`args` with each flag's underscores as dashes (--max_model_len=8 -> --max-model-len=8), as vLLM spells them;
    values are left alone."""
    return [re.sub(r"^--[^=]*", lambda m: m[0].replace("_", "-"), a) if a.startswith("--") else a for a in args]


def dtype_name(text: str) -> str:
    """--dtype with vLLM's aliases: half -> float16, float -> float32 (the choices are checked after)."""
    return DTYPE_ALIASES.get(text, text)


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
    # not mutually exclusive: the last of them wins, as vLLM's --enable-log-requests / --no-enable-log-requests
    logs.add_argument("--disable-log-requests", "--no-enable-log-requests", dest="log_requests",
                      action="store_false", default=True, help="no log line per request (the last of these wins)")
    logs.add_argument("--enable-log-requests", dest="log_requests", action="store_true",
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
    chat = sv.add_argument_group("vLLM's chat and usage flags")
    chat.add_argument("--default-chat-template-kwargs", type=_template_kwargs, default=None, metavar="JSON",
                      help="chat template variables every chat request gets unless it sets them itself (in "
                           "chat_template_kwargs, or through reasoning_effort), e.g. '{\"enable_thinking\": false}'")
    chat.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                      help="a request's tools do not reach the chat template when its tool_choice is \"none\"")
    chat.add_argument("--enable-force-include-usage", action="store_true",
                      help="every answer carries usage, streamed ones too (as if stream_options.include_usage)")
    add_no_op_flags(sv)
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


def _template_kwargs(text: str) -> dict[str, Any]:
    """--default-chat-template-kwargs: a JSON object of template variables the renderer does not own."""
    from rapidserve.tokenizer import RENDERER_OWNS  # (jinja2: only when the flag is given)

    try:
        v = loads_unique(text, "--default-chat-template-kwargs")
    except DuplicateKeyError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({e}): give an object, e.g. "
                                         "'{\"enable_thinking\": false}'") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: give a JSON object of template variables")
    owned = sorted(RENDERER_OWNS & v.keys())
    if owned:
        raise argparse.ArgumentTypeError(f"{', '.join(owned)}: the renderer or the request owns "
                                         f"{'them' if len(owned) > 1 else 'it'}, not a server default")
    return v


def server_fields(a: argparse.Namespace) -> dict[str, Any]:
    """The ServerConfig fields of `rapidserve serve`'s vLLM flags."""
    return {"served_model_name": tuple(a.served_model_name or ()), "log_level": a.log_level,
            "http_log_level": a.uvicorn_log_level, "log_requests": a.log_requests,
            "reasoning_parser": a.reasoning_parser, "default_chat_template_kwargs": a.default_chat_template_kwargs,
            "exclude_tools_when_tool_choice_none": a.exclude_tools_when_tool_choice_none,
            "force_include_usage": a.enable_force_include_usage}


def serve_model(a: argparse.Namespace) -> str | None:
    """The model of `rapidserve serve`: the positional MODEL or --model (ConfigError when both differ)."""
    tag, flag = getattr(a, "model_tag", None), a.model
    if tag is not None and flag is not None and tag != flag:
        raise ConfigError(f"the model is given twice, as MODEL {tag!r} and as --model {flag!r}: give one")
    return tag if tag is not None else flag

