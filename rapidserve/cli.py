"""The `rapidserve` command line.

Every flag is validated; a bad flag, model path or model file ends with a message that says what
is allowed and exit code 2 (argparse's convention for usage errors).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence

from rapidserve.benchmark.cli import add_bench_parser
from rapidserve.cli_vllm import CliParser, add_source_args, add_vllm_serve_args, dtype_name, serve_model, server_fields
from rapidserve.config import ATTENTION_BACKENDS, DTYPES, EngineConfig, RunnerConfig
from rapidserve.config_base import ConfigError
from rapidserve.engine_settings import allow_long_max_model_len, engine_sections
from rapidserve.launch_config import ENGINE_MODES
from rapidserve.partition_config import POLICIES, PROFILE_LOOKUPS, PartitionConfig
from rapidserve.policy_spec import conflicts, given_settings, resolve_mode, resolve_policy
from rapidserve.server_config import TOOL_CALL_PARSERS, ServerConfig

EXIT_USAGE = 2


def _int_at_least(lo: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{v} must be an integer >= {lo}")
        return v

    return parse


_positive_int = _int_at_least(1)


def _token_buckets(text: str) -> tuple[int, ...]:
    """--prefill-graph-tokens: ascending positive integers separated by commas, or none."""
    if text.strip().lower() == "none":
        return ()
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give ascending token counts such as 16,64,256,1024, "
                                         "or none") from None
    try:
        RunnerConfig(prefill_graph_tokens=out)  # the one rule
    except ConfigError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}; on the command line: 16,64,256,512 or none") from None
    return out


_nonneg_int = _int_at_least(0)


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"{v} must be in (0, 1]")
    return v


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None,
                   help="a Hugging Face model folder, a .gguf file, preset:NAME, or omit for the "
                        "embedded SmolLM2-135M-Instruct")
    g.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="a folder of Hugging Face tokenizer files to use instead of the model's (a preset has "
                        "none: this gives it text prompts and structured outputs)")
    g.add_argument("--dtype", default="auto", type=dtype_name, choices=("auto", *DTYPES))
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="tokens of one request, prompt and output (default and most: the model's "
                        "max_position_embeddings; more only with RAPIDSERVE_ALLOW_LONG_MAX_MODEL_LEN=1 set)")
    g.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9)
    g.add_argument("--block-size", type=int, default=16, choices=(8, 16, 32, 64, 128))
    g.add_argument("--num-kv-blocks", "--num-gpu-blocks-override", type=_positive_int, default=None,
                   help="fix the KV pool size instead of sizing it from free memory")
    g.add_argument("--max-num-seqs", type=_positive_int, default=256)
    g.add_argument("--max-num-batched-tokens", type=_positive_int, default=8192,
                   help="token budget of one forward pass. rapid mode: prompts of one prefill batch (a longer "
                        "prompt is chunked). hybrid mode and generate: each step decodes every running "
                        "request (one token each) and fills the rest with prompt chunks in arrival order; "
                        "at most min(--max-num-seqs, this) requests run at once")
    g.add_argument("--prefill-batch-tokens", type=_positive_int, default=None,
                   help="rapid mode: a prefill batch takes no more whole prompts once it holds this many tokens "
                        "(at most --max-num-batched-tokens; default: --max-num-batched-tokens; not with --mode "
                        "hybrid, --policy drift or generate, which have no such batches)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share the KV blocks of equal prompt prefixes between requests (on by default, as in "
                        "vLLM); --no-enable-prefix-caching recomputes every prompt")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="serve and generate: plan and launch the next step while the last one runs, its sampled "
                        "tokens fed from the device (on by default); --no-async-scheduling waits for each "
                        "step's tokens first")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA/HIP graphs (decode and prefill)")
    g.add_argument("--prefill-graph-tokens", type=_token_buckets, default=None, metavar="N,N,...|none",
                   help="token buckets of the piecewise prefill graphs: a prefill forward of up to the largest "
                        "is padded to the next bucket and replayed as graphs, attention run between them "
                        "(default 16,32,64,128,256,384,512; none: every prefill launched from Python)")
    g.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="auto: FA3 on Hopper where installed, else Triton on GPUs, torch on CPU")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--quantization", "-q", default=None, metavar="METHOD",
                   help="vLLM's: only none/auto here (rapidserve serves bf16/fp16/fp32 checkpoints and GGUF; a "
                        "quantized checkpoint is refused by name)")
    g.add_argument("--kv-cache-dtype", default="auto", metavar="DTYPE",
                   help="vLLM's: only auto here (the KV cache is kept in the model's dtype)")
    add_source_args(g)  # --revision, --download-dir, --load-format


def _partition_text(text: str) -> str:
    try:
        PartitionConfig.parse(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"{v} must be a positive number")
    return v


def _nonneg_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"{v} must be a number >= 0")
    return v


def _drift_model(text: str) -> tuple[float, float]:
    try:
        a, b = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give A_MS,B_MS_PER_TOKEN, e.g. 2.0,0.05") from None
    if not (0 <= a < float("inf") and 0 < b < float("inf")):
        raise argparse.ArgumentTypeError(f"{text!r}: A_MS must be >= 0 and B_MS_PER_TOKEN > 0")
    return a, b


def add_partition_args(p: argparse.ArgumentParser, with_mode: bool = True) -> None:
    g = p.add_argument_group("compute partition (decode / prefill)")
    if with_mode:
        g.add_argument("--partition", default="adaptive", type=_partition_text,
                       help="adaptive (the manager switches configurations from the profile), off (both use "
                            "the whole GPU), or static:<decode share> (e.g. static:0.25)")
        g.add_argument("--profile", default=None,
                       help="profile file for adaptive (default: profiles/<gpu>__<model>.json if present, else "
                            "the one auto-profile measured and cached, else a roofline estimate)")
        g.add_argument("--auto-profile", action=argparse.BooleanOptionalAction, default=True,
                       help="serve, adaptive partition on one GPU per engine (policy rapid or drift), no profile "
                            "given or committed for this GPU and model: measure a short one at start (under a "
                            "minute) and cache it in $XDG_CACHE_HOME/rapidserve/profiles (~/.cache/...), where "
                            "the next start finds it; --no-auto-profile uses the roofline estimate instead")
    g.add_argument("--partition-backend", default="auto", choices=("auto", "cuda-green", "hip-cumask", "none"))
    g.add_argument("--slo-itl-ms", type=_positive_float, default=50.0, help="inter-token latency SLO (ms)")
    if with_mode:
        g.add_argument("--policy", default=None, choices=POLICIES,
                       help="the shape of each step: rapid (always split: the profile's configuration with the most "
                            "prefill throughput within the ITL SLO; the default), duet (DuetServe: fused steps while "
                            "the predicted step meets the SLO, else the split with the most prefill throughput), "
                            "drift (split, prefill a layer block at a time on the split with the most prefill units "
                            "within the SLO; a short request may preempt a long prefill: give --slo-ttft-ms) or fused "
                            "(always one mixed step: --mode hybrid, which it implies). Each reads its own flags; one "
                            "it does not read is refused")
        g.add_argument("--slo-ttft-ms", type=_positive_float, default=None,
                       help="drift: a request's time-to-first-token SLO (ms), plus --slo-ttft-ms-per-1k-tokens x "
                            "its prompt tokens / 1000; without it nothing is preempted")
        g.add_argument("--slo-ttft-ms-per-1k-tokens", type=_nonneg_float, default=0.0,
                       help="drift: what each 1000 prompt tokens add to --slo-ttft-ms (e.g. 1000: 1 s per 1K)")
        g.add_argument("--profile-lookup", default="round-up", choices=PROFILE_LOOKUPS,
                       help="how --policy rapid (and duet's cost model) reads the profile for a decode batch and "
                            "context between its "
                            "buckets: round-up (to the bucket at or above each: conservative, it overstates a step "
                            "by up to a bucket) or interpolate (linearly between them: more prefill throughput, "
                            "but measured over the ITL SLO on 4096-token prompts)")
        g.add_argument("--drift-prefill-model", type=_drift_model, default=None, metavar="A_MS,B_MS_PER_TOKEN",
                       help="drift: the prefill time model a + b x tokens (ms) to use instead of the one fitted "
                            "at start-up from the roofline (one for every configuration)")


def serve_mode(a: argparse.Namespace) -> str:
    """`--mode`, or where it is left out the mode `--policy` runs in (fused: hybrid), else rapid."""
    return resolve_mode(getattr(a, "mode", None), getattr(a, "policy", None))


def partition_config(a: argparse.Namespace) -> PartitionConfig:
    """The partition flags as a PartitionConfig, `--policy` left out resolved to the mode's default (hybrid: fused;
    disagg: rapid). A `--profile` file is read and validated here, before any model loads (ProfileError names the
    file and field), where the partition flags fit the mode and policy (else build_engine_config refuses them, all
    the flags at once, policy_spec.check_settings); the engine checks its GPU and model."""
    from rapidserve.partition.profile import load_profile

    text = getattr(a, "partition", "adaptive")
    policy = resolve_policy(serve_mode(a), getattr(a, "policy", None), text.split(":", 1)[0])
    pcfg = PartitionConfig.parse(text, backend=a.partition_backend,
                                 profile=getattr(a, "profile", None), slo_itl_ms=a.slo_itl_ms,
                                 policy=policy, slo_ttft_ms=getattr(a, "slo_ttft_ms", None),
                                 slo_ttft_ms_per_1k_tokens=getattr(a, "slo_ttft_ms_per_1k_tokens", 0.0),
                                 drift_prefill_model=getattr(a, "drift_prefill_model", None),
                                 profile_lookup=getattr(a, "profile_lookup", "round-up"))
    if pcfg.profile is not None and not conflicts(serve_mode(a), pcfg.policy, given_settings({"partition": pcfg})):
        load_profile(pcfg.profile)  # (with conflicts the builder refuses them all before any file is read)
    return pcfg


def setting_kwargs(a: argparse.Namespace, env: Mapping[str, str] | None = None) -> dict[str, object]:
    """The model flags that need no model, as `engine_settings.engine_sections`' (and build_engine_config's)
    arguments, with $RAPIDSERVE_ALLOW_LONG_MAX_MODEL_LEN read from `env` (default: os.environ) here, where the run
    starts."""
    allow_long = allow_long_max_model_len(os.environ if env is None else env)
    return dict(dtype=a.dtype, device=a.device, max_model_len=a.max_model_len, allow_long_max_model_len=allow_long,
                gpu_memory_utilization=a.gpu_memory_utilization, block_size=a.block_size,
                num_kv_blocks=a.num_kv_blocks, max_num_seqs=a.max_num_seqs,
                max_num_batched_tokens=a.max_num_batched_tokens, prefill_batch_tokens=a.prefill_batch_tokens,
                enforce_eager=a.enforce_eager, prefill_graph_tokens=a.prefill_graph_tokens, seed=a.seed,
                attention_backend=a.attention_backend, kv_events_config=getattr(a, "kv_events_config", None),
                enable_prefix_caching=a.enable_prefix_caching, async_scheduling=a.async_scheduling,
                quantization=a.quantization, kv_cache_dtype=a.kv_cache_dtype,
                generation_config=getattr(a, "generation_config", "auto"))


def engine_kwargs(a: argparse.Namespace, env: Mapping[str, str] | None = None) -> dict[str, object]:
    """The model flags as build_engine_config's arguments: `setting_kwargs` and where the model's files come from."""
    return dict(setting_kwargs(a, env), tokenizer=a.tokenizer, revision=a.revision, download_dir=a.download_dir,
                load_format=a.load_format)


def cmd_generate(a: argparse.Namespace) -> int:
    from rapidserve.llm import LLM
    from rapidserve.sampling_params import SamplingParams

    llm = LLM(a.model, **engine_kwargs(a))
    params = SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens, seed=a.sample_seed)
    prompts = list(a.prompt)
    tok = llm.get_tokenizer()
    if a.chat and tok is not None:
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    for out in llm.generate(prompts, params, use_tqdm=False):
        c = out.outputs[0]
        print(json.dumps({"prompt": out.prompt, "text": c.text, "num_tokens": len(c.token_ids),
                          "finish_reason": c.finish_reason}))
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    """Checks every flag that needs no model (the settings each mode and policy read among them:
    `engine_sections`), then `run`: the port is bound first (busy: exit 1 at once), and the config tree is built
    (`build`: a bad model or --max-model-len exits 2), then auto-profiled, while it answers 503 starting."""
    from rapidserve.config import ParallelConfig
    from rapidserve.launch_config import LaunchConfig
    from rapidserve.server.serve import run
    from rapidserve.server.startup import BindError

    model = serve_model(a)  # MODEL or --model
    scfg = server_config(a)  # before the model loads: a bad key file fails at once
    pcfg = partition_config(a)
    parallel = ParallelConfig(tensor_parallel_size=a.tensor_parallel_size, data_parallel_size=a.data_parallel_size)
    if parallel.world_size > 1 and str(a.device).startswith("cuda:"):  # before the model loads, too
        raise ConfigError(f"--device {a.device} names one GPU but --tensor-parallel-size x --data-parallel-size uses "
                          f"{parallel.world_size}; use --device cuda (or auto) and pick GPUs with CUDA_VISIBLE_DEVICES")
    launch = LaunchConfig(mps=a.mps, on_worker_death=a.on_worker_death, mode=serve_mode(a),
                          max_restarts=a.max_restarts, restart_window_s=a.restart_window_s,
                          heartbeat_timeout_s=a.heartbeat_timeout_s, log_level=a.log_level)
    engine_sections(**setting_kwargs(a), launch=launch, partition=pcfg)  # type: ignore[arg-type]

    def build() -> tuple[object, object]:  # on a thread of `run`, once the port answers (imports torch)
        from rapidserve.config_builder import build_engine_config

        ecfg, source = build_engine_config(model, **engine_kwargs(a), launch=launch,  # type: ignore[arg-type]
                                           partition=pcfg, parallel=parallel)
        return auto_profile(ecfg, a.auto_profile, os.environ), source

    try:
        return run(scfg, build, model)  # type: ignore[arg-type]
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


def api_key(a: argparse.Namespace, env: Mapping[str, str] | None = None) -> str | None:
    """The server's API key: --api-key, else the first line of --api-key-file, else $RAPIDSERVE_API_KEY
    (empty: none). A file that is missing, unreadable or empty is a ConfigError naming it."""
    if a.api_key is not None:
        if not a.api_key.strip():
            raise ConfigError("--api-key is empty; give a key, or leave the flag out")
        return str(a.api_key)
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
    key = (os.environ if env is None else env).get(API_KEY_ENV, "").strip()
    return key or None


def _port(text: str) -> int:
    v = _nonneg_int(text)
    if v > 65535:
        raise argparse.ArgumentTypeError(f"{v} is not a TCP port (0..65535; 0 picks a free one)")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(prog="rapidserve", description=__doc__.splitlines()[0])  # names the flags it refuses
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate completions offline (single process)")
    add_model_args(g)
    g.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    g.add_argument("--max-tokens", type=_positive_int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--sample-seed", type=int, default=None)
    g.set_defaults(func=cmd_generate)

    sv = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API (prefill and decode workers)")
    add_model_args(sv)
    add_vllm_serve_args(sv)  # MODEL, --served-model-name, logs, vLLM's flags that change nothing here
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    sv.add_argument("--port", type=_port, default=8000)
    sv.add_argument("--mode", default=None, choices=ENGINE_MODES,
                    help="(default: rapid, or hybrid with --policy fused) rapid: prefill and decode in two processes "
                         "sharing weights and KV; hybrid: one "
                         "process, Sarathi-Serve/vLLM-style chunked prefill mixed with decodes in one forward "
                         "pass per step under --max-num-batched-tokens (the baseline); disagg: prefill on GPU 0 "
                         "and decode on GPU 1, each with its own copy of the weights, the prompt's KV copied "
                         "into decode's pool over NVLink/PCIe (the 1P1D disaggregated baseline; needs two GPUs, "
                         "no -tp/-dp; on CPU both run on the CPU)")
    par = sv.add_argument_group("parallelism (GPUs picked with CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES)")
    par.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1,
                     help="GPUs each layer is split over (NCCL/RCCL on GPUs, gloo on CPU): per GPU a decode and a "
                          "prefill worker (rapid) or a hybrid worker; must divide the model's attention heads")
    par.add_argument("--data-parallel-size", "-dp", type=_positive_int, default=1,
                     help="independent engines behind this one server, each on its own GPUs (least-loaded "
                          "dispatch)")
    key = sv.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on every route but /health and /openapi.json "
                          "(visible in `ps`: prefer --api-key-file or $RAPIDSERVE_API_KEY, read when neither "
                          "flag is given)")
    key.add_argument("--api-key-file", default=None, metavar="PATH",
                     help="read the API key from the first line of this file")
    sv.add_argument("--metrics-public", action="store_true",
                    help="serve /metrics without the API key (for a Prometheus that cannot send one)")
    sv.add_argument("--max-waiting", type=_nonneg_int, default=512,
                    help="requests queued beyond --max-num-seqs before answering 503")
    sv.add_argument("--default-max-tokens", type=_positive_int, default=None,
                    help="max_tokens of a request that gives none, at most what its context leaves (default: the "
                         "model's generation_config.json max_new_tokens, else 256)")
    sv.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                    help="where unset sampling fields (temperature, top_p, top_k, min_p, repetition_penalty, "
                         "max_tokens) take their defaults from, as vLLM's flag: auto (the model folder's "
                         "generation_config.json; a GGUF file or preset has none), vllm (vLLM's own defaults) or "
                         "a folder holding a generation_config.json; a request's own values win")
    sv.add_argument("--max-request-bytes", type=_int_at_least(1024), default=8 * 1024 * 1024,
                    help="largest request body accepted (larger: 413)")
    sv.add_argument("--shutdown-grace-s", type=_nonneg_float, default=10.0,
                    help="on SIGTERM/SIGINT, seconds requests in flight may take to finish before they are "
                         "ended with an error")
    sv.add_argument("--max-connections", type=_positive_int, default=2048,
                    help="open connections at most; beyond it the oldest idle one is closed, or the new "
                         "one answered 503")
    sv.add_argument("--keepalive-timeout-s", type=_positive_float, default=15.0,
                    help="close a keep-alive connection idle for this long")
    sv.add_argument("--header-timeout-s", type=_positive_float, default=10.0,
                    help="close a connection whose request line and headers take longer than this")
    tools = sv.add_argument_group("tool calling (tool_choice \"required\" and named functions need neither flag)")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="let tool_choice \"auto\" (the default when a request has tools) parse the model's own "
                            "tool calls; without it such requests get 400, as in vLLM")
    tools.add_argument("--tool-call-parser", default="auto", choices=TOOL_CALL_PARSERS,
                       help="the format of the model's tool calls: hermes (<tool_call> JSON: Qwen2/2.5/3, Hermes), "
                            "llama3_json (Llama 3.1/3.2 JSON), or auto: from the chat template, else the model family")
    chat = sv.add_argument_group("chat template")
    chat.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                      help="a Jinja chat template to use instead of the model's: a file, or the template itself "
                           "(as vLLM's flag); checked at start-up")
    chat.add_argument("--trust-request-chat-template", action="store_true",
                      help="let a chat request bring its own 'chat_template' (a template is code the server runs; "
                           "without the flag such requests get 400, as in vLLM)")
    sv.add_argument("--mps", default="auto", choices=("auto", "on", "off"))
    sv.add_argument("--on-worker-death", default="restart", choices=("restart", "shutdown"))
    sv.add_argument("--max-restarts", type=_nonneg_int, default=5,
                    help="worker restarts allowed in any --restart-window-s; one more death and the server "
                         "exits non-zero for its supervisor to restart it (0: never restart)")
    sv.add_argument("--restart-window-s", type=_positive_float, default=600.0)
    sv.add_argument("--heartbeat-timeout-s", type=_positive_float, default=None,
                    help="a worker silent this long is killed as hung (default: 60 on a GPU, 600 on a CPU)")
    add_partition_args(sv)
    sv.set_defaults(func=cmd_serve)

    from rapidserve.partition.profile_cmd import add_profile_parser

    add_profile_parser(sub, add_model_args, add_partition_args, _positive_int)
    add_bench_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from rapidserve.loader import ModelLoadError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (ModelLoadError, ConfigError) as e:
        print(f"rapidserve: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as e:  # invalid sampling parameters and the like
        print(f"rapidserve: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
