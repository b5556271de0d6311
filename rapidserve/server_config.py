"""The `ServerConfig` section of the config tree: the OpenAI-compatible HTTP server (`rapidserve serve`).

Plain data, checked field by field when built (config_base.ConfigError): address and port, the API key,
served model names, admission, body and connection limits, the shutdown grace, tool-call and reasoning
parsers, chat templates and the server's logs. Not a field of `EngineConfig`: only the server reads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rapidserve.config_base import LOG_LEVELS, check
from rapidserve.generation_config import SamplingDefaults

# auto: from the chat template / family
TOOL_CALL_PARSERS: tuple[str, ...] = ("auto", "hermes", "llama3_json", "mistral")
REASONING_PARSERS: tuple[str, ...] = ("deepseek_r1", "qwen3")  # vLLM's --reasoning-parser (server/reasoning_parsers.py)
FALLBACK_MAX_TOKENS = 256  # the server's max_tokens of a request that gives none, without flag or model default


@dataclass(frozen=True)
class ServerConfig:
    """The OpenAI-compatible HTTP server (`rapidserve serve`).

    api_key: required as `Authorization: Bearer KEY` on every route but /health and /openapi.json (and /metrics with
    `metrics_public`). shutdown_grace_s: on SIGTERM/SIGINT in-flight requests may finish for this long, then the rest
    end with an error. Connections: a new one must send its request line and headers within `header_timeout_s`; an
    idle keep-alive one is closed after `keepalive_timeout_s`; beyond `max_connections` the oldest idle one is
    closed, or the new one is answered 503 when none is idle.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = field(default=None, repr=False)  # never in a repr (a log line, an error message)
    metrics_public: bool = False  # /metrics without the API key (for scrapers that cannot send one)
    # The names the model answers to (vLLM's --served-model-name A B...): the first is the one responses and
    # metrics report, a request naming any of them is served, /v1/models lists them all. (): the model's own name.
    served_model_name: tuple[str, ...] = ()
    max_waiting: int = 512  # requests queued beyond max_num_seqs (x data_parallel_size) before the server answers 503
    max_body_bytes: int = 8 * 1024 * 1024
    # max_tokens of a request that gives none (at most what its context leaves); None: the model's
    # generation_config max_new_tokens, else FALLBACK_MAX_TOKENS
    default_max_tokens: int | None = None
    shutdown_grace_s: float = 10.0
    max_connections: int = 2048
    keepalive_timeout_s: float = 15.0
    header_timeout_s: float = 10.0
    enable_auto_tool_choice: bool = False  # tool_choice "auto" parses the model's own calls (as vLLM's flag)
    tool_call_parser: str = "auto"  # the format of those calls: one of TOOL_CALL_PARSERS
    chat_template: str | None = None  # a chat template (its text) used instead of the model's (--chat-template)
    trust_request_chat_template: bool = False  # a chat request may bring its own `chat_template` (vLLM's flag)
    reasoning_parser: str | None = None  # chat answers split into reasoning and content (vLLM's); None: no split
    # chat template variables a chat request gets unless it sets them (vLLM's --default-chat-template-kwargs)
    default_chat_template_kwargs: Mapping[str, Any] | None = None
    exclude_tools_when_tool_choice_none: bool = False  # tool_choice "none": no tools to the template (vLLM's flag)
    force_include_usage: bool = False  # every answer carries usage (vLLM's --enable-force-include-usage)
    # The server process's logs (server/startup.py configure_logging): rapidserve's level (LOG_LEVELS), the HTTP
    # server's own (LOG_LEVELS or "trace", vLLM's --uvicorn-log-level), and the one line per request.
    log_level: str = "info"
    http_log_level: str = "info"
    log_requests: bool = True

    def max_tokens_default(self, generation: SamplingDefaults) -> int:
        """A request's max_tokens when it gives none: --default-max-tokens, else the model's max_new_tokens,
        else FALLBACK_MAX_TOKENS (each capped by what the request's context leaves)."""
        return self.default_max_tokens or generation.max_tokens or FALLBACK_MAX_TOKENS

    def __post_init__(self) -> None:
        check(0 <= self.port <= 65535, f"port={self.port} must be in 0..65535 (0: any free port)")
        check(self.max_waiting >= 0, f"max_waiting={self.max_waiting} must be >= 0")
        check(self.max_body_bytes >= 1024, f"max_body_bytes={self.max_body_bytes} must be >= 1024")
        check(self.default_max_tokens is None or self.default_max_tokens >= 1,
               f"default_max_tokens={self.default_max_tokens} must be >= 1 or None")
        check(self.shutdown_grace_s >= 0, f"shutdown_grace_s={self.shutdown_grace_s} must be >= 0")
        check(self.api_key is None or len(self.api_key) > 0, "api_key must not be empty")
        check(self.max_connections >= 1, f"max_connections={self.max_connections} must be >= 1")
        check(self.keepalive_timeout_s > 0, f"keepalive_timeout_s={self.keepalive_timeout_s} must be > 0")
        check(self.header_timeout_s > 0, f"header_timeout_s={self.header_timeout_s} must be > 0")
        check(all(isinstance(n, str) and n.strip() for n in self.served_model_name)
               and len(set(self.served_model_name)) == len(self.served_model_name),
               f"served_model_name={list(self.served_model_name)}: give distinct, non-empty names")
        for name, ok in (("log_level", LOG_LEVELS), ("http_log_level", (*LOG_LEVELS, "trace")),
                         ("tool_call_parser", TOOL_CALL_PARSERS), ("reasoning_parser", (None, *REASONING_PARSERS))):
            value = getattr(self, name)
            check(value in ok, f"{name}={value!r}; use one of {', '.join(map(str, ok))}")
        check(self.enable_auto_tool_choice or self.tool_call_parser == "auto",
              f"--tool-call-parser {self.tool_call_parser} (tool_call_parser): read only with "
              "--enable-auto-tool-choice (enable_auto_tool_choice), which parses the model's own tool calls for "
              "tool_choice \"auto\" (\"required\" and named functions need neither flag); add "
              "--enable-auto-tool-choice, or drop --tool-call-parser")
