"""`vllm serve`'s flags (vLLM 0.26) that rapidserve does not take as flags of its own: each one is either accepted
where it asks for what rapidserve does anyway (`NO_OP`: the values accepted, and why nothing changes), or refused
by name with why and what to use instead (`REFUSED`; a NO_OP flag's other values too). Nothing is accepted and
ignored unsaid, and no vLLM flag meets argparse's bare "unrecognized arguments".

`add_no_op_flags` puts the NO_OP flags on `rapidserve serve` (their help is the reason); a NO_OP `--no-X` whose
`--X` is one of rapidserve's switches (--no-enforce-eager, --no-enable-auto-tool-choice ...) turns it off, the last
of the two given winning, as vLLM's BooleanOptionalAction has it. `refusal` is what
cli_vllm.CliParser says of a flag argparse did not take. The audit that every vLLM 0.26 flag is one of rapidserve's
own, a NO_OP one or a REFUSED one: tests/test_vllm_surface_flags.py.
"""

from __future__ import annotations

import argparse
from typing import Any

SWITCH: tuple[str, ...] = ()  # a NO_OP flag that takes no value
ANY = None  # a NO_OP flag that takes any one value

_PROXY = "put a reverse proxy (nginx, envoy) in front of rapidserve for it"
_TLS = f"no TLS: {_PROXY}"
_LORA = "no LoRA adapters"
_TEXT = "text-only models (no images, audio or video)"
_EP = "no expert parallelism: a mixture-of-experts model's experts are sliced over the tensor-parallel ranks (-tp)"
_HOST = "one host: tensor (-tp) and data (-dp) parallelism, with the -dp engines behind this one server"
_CP = "no context parallelism: tensor (-tp) and data (-dp) parallelism"
_PP = "no pipeline parallelism: tensor (-tp) and data (-dp) parallelism"
_COMPILE = "no torch.compile (CUDA graphs: --enforce-eager, --prefill-graph-tokens)"
_GRAPHS = "decode graphs cover batches up to --max-num-seqs, prefill graphs the --prefill-graph-tokens buckets"
_METRICS = "rapidserve's metrics are its Prometheus /metrics"
_TRACE = "no OpenTelemetry tracing; rapidserve's metrics are its Prometheus /metrics"
_KERNELS = "the kernels are rapidserve's own (attention: --attention-backend)"
_MAMBA = "no Mamba or other state-space models"
_SPEC = "no speculative decoding"
_PLUGIN = "no plugins: the model code, scheduler and workers are rapidserve's own"
_OFFLOAD = "no weight offloading to CPU memory"
_LOAD = "weights load from the model folder's safetensors (or the .gguf file) as they are"
_LOGS = "rapidserve's logs: --log-level, --uvicorn-log-level, --enable-log-requests / --disable-log-requests"
_DOCS = "the OpenAPI document is /openapi.json (no Swagger UI, no ReDoc)"
_NO_ACCESS_LOG = "rapidserve writes no HTTP access log (the request log line has every request)"
_CHUNKS = ("prompts are chunked by --max-num-batched-tokens (rapid mode: whole prompts batched up to "
           "--prefill-batch-tokens)")
_KV = ("the KV pool is sized by --gpu-memory-utilization, --kv-cache-memory-bytes or --num-kv-blocks and stays in "
       "GPU memory")

# flag -> (the values accepted: SWITCH for a flag without one, ANY for any one value; why they change nothing)
NO_OP: dict[str, tuple[tuple[str, ...] | None, str]] = {
    "--pipeline-parallel-size": (("1",), _PP), "-pp": (("1",), _PP),
    "--decode-context-parallel-size": (("1",), _CP), "-dcp": (("1",), _CP),
    "--prefill-context-parallel-size": (("1",), _CP), "-pcp": (("1",), _CP),
    "--nnodes": (("1",), _HOST), "-n": (("1",), _HOST), "--node-rank": (("0",), _HOST), "-r": (("0",), _HOST),
    "--distributed-executor-backend": (("mp",), "workers are processes of one host (mp; no Ray)"),
    "--api-server-count": (("1",), "one server process, with the -dp engines behind it"),
    "-asc": (("1",), "one server process, with the -dp engines behind it"),
    "--max-logprobs": (("20",), "a request may ask for at most 20 logprobs per token (vLLM's default)"),
    "--stream-interval": (("1",), "every token is streamed as soon as it is sampled"),
    "--response-role": (("assistant",), "the answer's role is assistant"),
    "--chat-template-content-format": (("string",), "a message's content reaches the template as a string (text "
                                                    "parts joined)"),
    "--runner": (("auto", "generate"), "rapidserve runs generative models"),
    "--convert": (("auto", "none"), "models are served as they are (no pooling conversion)"),
    "--config-format": (("auto", "hf"), "the model folder's config.json is read as Hugging Face's"),
    "--fingerprint-mode": (("none",), "responses carry no system_fingerprint"),
    "--hf-token": (ANY, "rapidserve never downloads: a Hub id is read from the local Hugging Face cache"),
    "--code-revision": (ANY, "no model code from a repository is ever run"),
    "--max-log-len": (ANY, "the request log line never shows prompts or token ids"),
    "--disable-access-log-for-endpoints": (ANY, _NO_ACCESS_LOG),
    "--disable-uvicorn-access-log": (SWITCH, _NO_ACCESS_LOG),
    "--enable-prompt-tokens-details": (SWITCH, "usage carries prompt_tokens_details.cached_tokens wherever the "
                                               "engine counts prefix-cache hits, with no flag"),
    "--no-disable-fastapi-docs": (SWITCH, _DOCS),
    "--enable-flash-late-interaction": (SWITCH, "pooling models' scoring only; rapidserve serves generation"),
    "--no-enable-flash-late-interaction": (SWITCH, "pooling models' scoring only; rapidserve serves generation"),
    "--enable-log-deltas": (SWITCH, "outputs are never logged"), "--no-enable-log-deltas": (SWITCH, "outputs are "
                                                                                                  "never logged"),
    "--disable-cascade-attn": (SWITCH, "no cascade attention"),
    "--disable-hybrid-kv-cache-manager": (SWITCH, "every layer keeps every token's KV (no hybrid KV cache manager)"),
    "--disable-nccl-for-dp-synchronization": (SWITCH, "the -dp engines are independent: nothing is synchronized"),
    "--no-disable-nccl-for-dp-synchronization": (SWITCH, "the -dp engines are independent: nothing is "
                                                         "synchronized"),
    "--disable-chunked-mm-input": (SWITCH, _TEXT), "--no-enforce-eager": (SWITCH, "CUDA graphs are on by default"),
    "--no-disable-sliding-window": (SWITCH, "sliding windows apply as the model's config.json says"),
    **{f"--no-{name}": (SWITCH, f"rapidserve has none of it: {why}") for name, why in (
        ("enable-lora", _LORA), ("fully-sharded-loras", _LORA), ("enable-mixed-moe-lora-format", _LORA),
        ("enable-moe-shared-loras", _LORA), ("enable-tower-connector-lora", _LORA), ("specialize-active-lora", _LORA),
        ("enable-expert-parallel", _EP), ("enable-eplb", _EP), ("enable-dbo", _EP), ("enable-elastic-ep", _EP),
        ("enable-ep-weight-filter", _EP), ("enable-bf16x3-router-gemm", _EP), ("enable-sleep-mode", "no sleep mode"),
        ("enable-cumem-allocator", "no sleep mode"), ("enable-prompt-embeds", "prompts are text or token ids"),
        ("enable-return-routed-experts", _EP), ("enable-mm-embeds", _TEXT), ("interleave-mm-strings", _TEXT),
        ("mm-encoder-only", _TEXT), ("skip-mm-profiling", _TEXT), ("language-model-only", _TEXT),
        ("disable-chunked-mm-input", _TEXT), ("calculate-kv-scales", "fp8 KV scales are never computed"),
        ("trust-remote-code", "no code from a repository is ever run"), ("skip-tokenizer-init", "the tokenizer "
                                                                                             "loads"),
        ("allow-deprecated-quantization", "quantization: fp8 only"), ("numa-bind", "no NUMA binding"),
        ("ray-workers-use-nsight", "no Ray"), ("use-fp64-gumbel", "sampling uses no fp64 Gumbel noise"),
        ("kv-sharing-fast-prefill", "no KV sharing between layers"), ("enable-flashinfer-autotune", "no FlashInfer"),
        ("cudagraph-metrics", _METRICS), ("kv-cache-metrics", _METRICS), ("enable-mfu-metrics", _METRICS),
        ("enable-logging-iteration-details", _METRICS), ("enable-layerwise-nvtx-tracing", "no NVTX ranges"),
        ("fail-on-environ-validation", "no VLLM_* variables are read"), ("jit-monitor-verbose", "no JIT monitor"),
        ("enable-mamba-cache-stochastic-rounding", _MAMBA), ("data-parallel-hybrid-lb", _HOST),
        ("data-parallel-external-lb", _HOST), ("enable-auto-tool-choice", "it is off unless given"),
        ("trust-request-chat-template", "it is off unless given"), ("return-tokens-as-token-ids", "logprobs name "
                                                                                                 "tokens by text"),
        ("tokens-only", "every endpoint is served"), ("allow-credentials", "no CORS headers are sent"),
        ("enable-force-include-usage", "usage follows the request's stream_options unless given"),
        ("exclude-tools-when-tool-choice-none", "tools reach the template unless given"),
        ("enable-log-outputs", "outputs are never logged"), ("enable-offline-docs", "no Swagger UI"),
        ("enable-per-request-metrics", "responses carry no timings"), ("enable-request-id-headers", "no "
                                                                                                "X-Request-Id header"),
        ("enable-server-load-tracking", "no load tracking"), ("enable-ssl-refresh", "no TLS"),
        ("enable-tokenizer-info-endpoint", "no /tokenizer_info route"), ("log-error-stack", "as by default"))},
}

# flag -> why rapidserve refuses it, and what to use instead
REFUSED: dict[str, str] = {flag: why for why, flags in (
    (_LORA, "--enable-lora --lora-modules --max-loras --max-lora-rank --max-cpu-loras --lora-dtype "
            "--lora-target-modules --fully-sharded-loras --default-mm-loras --enable-mixed-moe-lora-format "
            "--enable-moe-shared-loras --enable-tower-connector-lora --specialize-active-lora"),
    (_CP, "--cp-kv-cache-interleave-size --dcp-kv-cache-interleave-size --dcp-comm-backend"),
    (_HOST, "--master-addr --master-port --headless --data-parallel-address -dpa "
            "--data-parallel-rpc-port -dpp --data-parallel-backend -dpb --data-parallel-rank -dpn "
            "--data-parallel-start-rank -dpr --data-parallel-size-local -dpl --data-parallel-hybrid-lb -dph "
            "--data-parallel-external-lb -dpe --data-parallel-multi-port-external-lb -dpm "
            "--data-parallel-supervisor-port --dp-supervisor-probe-interval-s --dp-supervisor-probe-timeout-s "
            "--dp-supervisor-probe-failure-threshold"),
    ("workers are processes of one host (no Ray)", "--ray-workers-use-nsight"),
    (_EP, "--enable-expert-parallel -ep --enable-eplb --eplb-config --expert-placement-strategy --all2all-backend "
          "--enable-dbo --dbo-decode-token-threshold --dbo-prefill-token-threshold --ubatch-size --enable-elastic-ep "
          "--enable-ep-weight-filter --enable-bf16x3-router-gemm --enable-return-routed-experts --moe-backend"),
    (_SPEC, "--speculative-config -sc --spec-method --spec-model --spec-tokens"),
    (_OFFLOAD, "--cpu-offload-gb --cpu-offload-params --offload-backend --offload-group-size --offload-num-in-group "
               "--offload-params --offload-prefetch-step"),
    (_KV, "--kv-offloading-backend --kv-offloading-size --swap-space"),
    (_TEXT, "--limit-mm-per-prompt --mm-processor-kwargs --media-io-kwargs --mm-processor-cache-gb "
            "--mm-processor-cache-type --mm-shm-cache-max-object-size-mb --mm-encoder-tp-mode --mm-encoder-only "
            "--mm-encoder-attn-backend --mm-encoder-attn-dtype --mm-encoder-fp8-scale-path "
            "--mm-encoder-fp8-scale-save-path --mm-encoder-fp8-scale-save-margin --mm-ipc-gpu-memory-gb "
            "--mm-tensor-ipc --enable-mm-embeds --interleave-mm-strings --skip-mm-profiling --video-pruning-rate "
            "--allowed-local-media-path --allowed-media-domains --language-model-only --io-processor-plugin "
            "--diffusion-config -dc"),
    (_TLS, "--ssl-keyfile --ssl-certfile --ssl-ca-certs --ssl-cert-reqs --ssl-ciphers --enable-ssl-refresh"),
    (f"no CORS headers: {_PROXY}", "--allowed-origins --allowed-methods --allowed-headers --allow-credentials"),
    (_PROXY, "--root-path"), ("TCP only: --host and --port", "--uds"),
    ("rapidserve runs aiohttp, not an ASGI app: " + _PROXY, "--middleware"),
    ("aiohttp's own limits apply; the body limit is --max-request-bytes", "--h11-max-incomplete-event-size "
                                                                          "--h11-max-header-count"),
    (_COMPILE, "--compilation-config -cc --optimization-level -O"),
    (_GRAPHS, "--max-seq-len-to-capture --cudagraph-capture-sizes --max-cudagraph-capture-size"),
    (_KERNELS, "--attention-config -ac --kernel-config --linear-backend --gdn-prefill-backend --ir-op-priority "
               "--override-attention-dtype --performance-mode"),
    (_MAMBA, "--mamba-backend --mamba-block-size --mamba-cache-dtype --mamba-cache-mode --mamba-cache-philox-rounds "
             "--mamba-ssm-cache-dtype --enable-mamba-cache-stochastic-rounding"),
    (_METRICS, "--cudagraph-metrics --kv-cache-metrics --kv-cache-metrics-sample --enable-mfu-metrics "
               "--show-hidden-metrics-for-version --enable-logging-iteration-details --aggregate-engine-logging "
               "--enable-server-load-tracking --enable-per-request-metrics"),
    (_TRACE, "--otlp-traces-endpoint --collect-detailed-traces --enable-layerwise-nvtx-tracing"),
    (_PLUGIN, "--scheduler-cls --worker-cls --worker-extension-cls --model-class-overrides --model-impl "
              "--additional-config --logits-processors --reasoning-parser-plugin --renderer-num-workers"),
    (_LOAD, "--ignore-patterns --model-loader-extra-config --pt-load-map-location --safetensors-load-strategy "
            "--safetensors-prefetch-block-size --safetensors-prefetch-num-threads --max-parallel-loading-workers "
            "--use-tqdm-on-load --no-use-tqdm-on-load --hf-config-path"),
    ("the model's config.json is read as it is", "--rope-scaling --hf-overrides"),
    (_CHUNKS, "--long-prefill-token-threshold --max-long-partial-prefills --max-num-partial-prefills "
              "--max-num-scheduled-tokens --prefill-schedule-interval --scheduler-reserve-full-isl "
              "--no-scheduler-reserve-full-isl"),
    (_LOGS, "--log-config-file --log-error-stack --enable-log-outputs"),
    (_DOCS, "--disable-fastapi-docs --enable-offline-docs"),
    (_NO_ACCESS_LOG, "--no-disable-uvicorn-access-log"),
    ("no sleep mode", "--enable-sleep-mode --enable-cumem-allocator"),
    ("no weight updates while serving", "--weight-transfer-config"),
    ("disaggregation is --mode disagg (one host)", "--kv-transfer-config --ec-transfer-config"),
    ("no pooling models", "--pooler-config"),
    ("prompts are text or token ids", "--enable-prompt-embeds"),
    ("fp8 KV cache scales are the checkpoint's calibrated ones (a compressed-tensors kv_cache_scheme, e.g. from "
     "llm-compressor) or 1.0, never computed from the first batch", "--calculate-kv-scales"),
    ("--kv-cache-dtype applies to every layer", "--kv-cache-dtype-skip-layers"),
    ("quantization is -q fp8 or the checkpoint's own scheme", "--quantization-config --allow-deprecated-quantization"),
    ("the tokenizer comes from the model's folder, or --tokenizer DIR", "--tokenizer-revision"),
    ("a model without a tokenizer is a preset (token-id prompts only)", "--skip-tokenizer-init"),
    ("logprobs are of the sampled distribution", "--logprobs-mode"),
    ("sliding windows apply as the model's config.json says", "--disable-sliding-window"),
    ("no cascade attention", "--no-disable-cascade-attn"),
    ("every layer keeps every token's KV (no hybrid KV cache manager)", "--no-disable-hybrid-kv-cache-manager"),
    ("all-reduce is NCCL's (RCCL's), never a custom one", "--disable-custom-all-reduce --no-disable-custom-all-reduce"),
    ("no KV sharing between layers", "--kv-sharing-fast-prefill"),
    ("no NUMA binding: run rapidserve under numactl", "--numa-bind --numa-bind-cpus --numa-bind-nodes"),
    ("pick the GPUs with CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES (and --device)", "--device-ids"),
    ("the workers' collectives have no timeout; a hung worker is caught by --heartbeat-timeout-s",
     "--distributed-timeout-seconds --cpu-distributed-timeout-seconds"),
    ("the prefix cache's block hashes are rapidserve's (--kv-events-config publishes vLLM's sha256 ones)",
     "--prefix-caching-hash-algo --prefix-match-unit"),
    ("sampling uses no fp64 Gumbel noise", "--use-fp64-gumbel"), ("no FlashInfer", "--enable-flashinfer-autotune"),
    ("no JIT monitor", "--jit-monitor-mode --jit-monitor-verbose"),
    ("no VLLM_* variables are read", "--fail-on-environ-validation"),
    ("the grammar engine is llguidance, with no options", "--structured-outputs-config"),
    ("unset sampling fields come from --generation-config (auto, vllm or a folder with a generation_config.json); a "
     "request's own fields win", "--override-generation-config"),
    ("the reasoning parsers are built in: --reasoning-parser deepseek_r1|qwen3", "--reasoning-config"),
    ("the tool-call parsers are built in: --tool-call-parser auto|hermes|llama3_json|mistral", "--tool-parser-plugin"),
    ("no built-in tools (browser, code interpreter)", "--tool-server"),
    ("logprobs name tokens by their text; a request's return_token_ids gives the ids", "--return-tokens-as-token-ids"),
    ("every endpoint is served", "--tokens-only"), ("no gRPC: the OpenAI HTTP API only", "--grpc"),
    ("no config file: give the flags", "--config"), ("no /tokenizer_info route (POST /tokenize answers token "
                                                     "strings)", "--enable-tokenizer-info-endpoint"),
    ("no X-Request-Id header: a request's request_id field names its response", "--enable-request-id-headers"),
    ("responses carry no system_fingerprint", "--fingerprint-value"),
    ("usage.prompt_tokens_details is reported wherever the engine counts prefix-cache hits",
     "--no-enable-prompt-tokens-details"),
    ("no watermarking", "--watermark"), ("use `rapidserve profile`, or NVIDIA Nsight", "--profiler-config"),
) for flag in flags.split()}
REFUSED.update({flag: why for flag, (_, why) in NO_OP.items()})  # a NO_OP flag where it is not taken (another
# command; its other values are refused by _Accepted with the same reason)


def refusal(flag: str) -> str | None:
    """Why rapidserve refuses vLLM's `flag` (also -O3-style, --flag=value and vLLM's --json-flag.key form), or None
    when vLLM has no such flag."""
    name = flag.split("=", 1)[0]
    base = name.split(".", 1)[0] if name.startswith("--") else name
    if base in REFUSED:
        return REFUSED[base]
    if name.startswith("-O") and not name.startswith("--"):
        return REFUSED["-O"]
    if base != name:
        return f"vLLM's --flag.key form: give {base} one JSON object"
    return None


class _Refused(argparse.Action):
    """A REFUSED flag that is the start of one of rapidserve's (which argparse would take it as): refused by name."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        flag = self.option_strings[0]
        raise argparse.ArgumentError(self, f"{parser.prog} does not support vLLM's {flag} ({REFUSED[flag]})")


def refuse_prefixes(p: argparse.ArgumentParser) -> None:
    """Make each REFUSED flag that begins one of `p`'s own a flag of `p` that refuses it: argparse would otherwise
    take it as an abbreviation of that one (vLLM's --config as --config-format, -dc as -dcp)."""
    own = list(p._option_string_actions)
    for flag in REFUSED:
        if flag not in p._option_string_actions and any(o.startswith(flag) for o in own):
            p.add_argument(flag, action=_Refused, nargs="?", help=argparse.SUPPRESS,
                           dest=f"vllm_refused_{flag.lstrip('-')}")


class _Accepted(argparse.Action):
    """A NO_OP flag: its accepted values pass, any other is a usage error naming the flag and why."""

    def __init__(self, option_strings: list[str], dest: str, values: tuple[str, ...] | None, why: str,
                 **kwargs: Any) -> None:
        self.accepted, self.why = values, why
        super().__init__(option_strings, dest, nargs=0 if values == SWITCH else None, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if self.accepted and values not in self.accepted:
            raise argparse.ArgumentError(self, f"rapidserve does not support {values!r} ({self.why}): only "
                                               f"{' or '.join(self.accepted)}")
        on = _switch_it_negates(parser, option_string)
        if on is not None:  # `--X --no-X`: the last wins, as vLLM's BooleanOptionalAction has it
            setattr(namespace, on.dest, False)


def _switch_it_negates(parser: argparse.ArgumentParser, flag: str | None) -> argparse.Action | None:
    """The parser's own switch that the NO_OP `--no-X` turns off (`--X`, a store_true: --enforce-eager,
    --enable-auto-tool-choice ...), or None."""
    if not flag or not flag.startswith("--no-"):
        return None
    on = parser._option_string_actions.get("--" + flag[len("--no-"):])
    return on if isinstance(on, argparse._StoreTrueAction) else None


def add_no_op_flags(p: argparse.ArgumentParser) -> None:
    """`NO_OP`'s flags on `p`, in a group of their own; their help says why each changes nothing."""
    g = p.add_argument_group("vLLM flags that ask for what rapidserve does anyway (accepted; any other value is "
                             "refused)")
    for flag, (values, why) in NO_OP.items():
        only = "" if not values else f"only {' or '.join(values)}: "
        g.add_argument(flag, action=_Accepted, values=values, why=why, dest=f"vllm_no_op_{flag.lstrip('-')}",
                       default=None, help=only + why, metavar="VALUE" if values is None else None)
