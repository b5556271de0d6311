"""The flags the `rapidserve` commands share, and their translation into sections of the config tree.

The argument types (each flag validated as argparse parses it: a bad value is a usage error naming the flag),
the model flags (`add_model_args`: generate, serve, profile), the partition flags (`add_partition_args`: serve,
profile) and what they become: `partition_config`, `setting_kwargs` / `engine_kwargs` (build_engine_config's
arguments), `serve_mode`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from rapidserve.cache_config import GPU_MEMORY_UTILIZATION
from rapidserve.cli_vllm import add_source_args, dtype_name
from rapidserve.config import ATTENTION_BACKENDS, DTYPES, RunnerConfig
from rapidserve.config_base import ConfigError
from rapidserve.engine_settings import allow_long_max_model_len
from rapidserve.human_int import AUTO, EXAMPLES, human_readable_int, human_readable_int_or_auto
from rapidserve.partition_config import POLICIES, PROFILE_LOOKUPS, STEP_CORRECTIONS, PartitionConfig
from rapidserve.policy_spec import conflicts, given_settings, resolve_mode, resolve_policy

if TYPE_CHECKING:
    from rapidserve.partition.profile import Profile


def int_at_least(lo: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{v} must be an integer >= {lo}")
        return v

    return parse


positive_int = int_at_least(1)


def human_int_at_least(lo: int) -> Callable[[str], int]:
    """An argument type for a flag vLLM 0.26 types `human_readable_int` (human_int.py: 8k, 8K, 25.6k, a plain
    integer), at least `lo`; argparse names the flag in the usage error."""
    def parse(text: str) -> int:
        try:
            v = human_readable_int(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if v < lo:
            shown = str(v) if text.strip() == str(v) else f"{text.strip()!r} ({v})"
            raise argparse.ArgumentTypeError(f"{shown} must be an integer >= {lo} ({EXAMPLES})")
        return v

    return parse


positive_human_int = human_int_at_least(1)


def positive_human_int_or_auto(text: str) -> int:
    """`positive_human_int`, or AUTO (-1) for 'auto' / '-1' (vLLM 0.26's --max-model-len: fit it to the KV cache)."""
    try:
        value = human_readable_int_or_auto(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e}, or auto / -1 (the length that fits the KV cache)") from None
    if value != AUTO and value < 1:
        shown = str(value) if text.strip() == str(value) else f"{text.strip()!r} ({value})"
        raise argparse.ArgumentTypeError(f"{shown} must be an integer >= 1 ({EXAMPLES}), or auto / -1")
    return value


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


nonneg_int = int_at_least(0)


def fraction(text: str) -> float:
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
    g.add_argument("--max-model-len", type=positive_human_int_or_auto, default=None,
                   help="tokens of one request, prompt and output (default and most: the model's "
                        "max_position_embeddings; more only with RAPIDSERVE_ALLOW_LONG_MAX_MODEL_LEN=1 set); as "
                        "vLLM's, 32k = 32000, 32K = 32768; auto or -1: the model's length where the KV cache "
                        "holds one sequence of it, else what the KV cache holds (said at start)")
    g.add_argument("--gpu-memory-utilization", type=fraction, default=GPU_MEMORY_UTILIZATION,
                   help=f"the share of the GPU's memory this engine takes, its KV pool sized to what the weights and "
                        f"the activation peak leave of it (default {GPU_MEMORY_UTILIZATION}, vLLM 0.26's; per engine, "
                        "as vLLM's is per instance). Not read for the pool with --num-kv-blocks or "
                        "--kv-cache-memory-bytes")
    g.add_argument("--block-size", type=int, default=16, choices=(8, 16, 32, 64, 128))
    g.add_argument("--num-kv-blocks", "--num-gpu-blocks-override", type=positive_int, default=None,
                   help="fix the KV pool size instead of sizing it from free memory")
    g.add_argument("--kv-cache-memory-bytes", type=positive_human_int, default=None, metavar="BYTES",
                   help="vLLM's: the KV pool's bytes on each GPU (each tensor-parallel rank), as given: no memory "
                        "profiling, and --gpu-memory-utilization is not used for the pool (8G = 8 GiB, 8g = 8e9 "
                        "bytes); it must hold one --max-model-len sequence. On a CPU: the pool's bytes. Not with "
                        "--num-kv-blocks")
    g.add_argument("--max-num-seqs", type=positive_int, default=None,
                   help="most requests running at once (default, as vLLM's: 1024 on a GPU with >= 70 GiB that is "
                        "not an A100, such as the H100, H200 and MI300X; else 256, the CPU too). At most the "
                        "largest decode graph batch (512) and --max-num-batched-tokens run at once")
    g.add_argument("--max-num-batched-tokens", type=positive_human_int, default=None,
                   help="token budget of one forward pass (default 8192; generate, as vLLM's LLM: 16384 on a GPU "
                        "with >= 70 GiB that is not an A100). rapid mode: prompts of one prefill batch (a longer "
                        "prompt is chunked). hybrid mode and generate: each step decodes every running "
                        "request (one token each) and fills the rest with prompt chunks in arrival order; "
                        "at most min(--max-num-seqs, this) requests run at once. As vLLM's, 8k = 8000, 8K = 8192")
    g.add_argument("--prefill-batch-tokens", type=positive_int, default=None,
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
                        "(default 16,32,64,128,256,384,512,640,768,896,1024, then every 128 to 2048: the prefill "
                        "worker captures those up to 512, the decode worker's fused steps all; none: every prefill "
                        "launched from Python)")
    g.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="auto: FA3 on Hopper where installed, else Triton on GPUs, torch on CPU")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--quantization", "-q", default=None, metavar="METHOD",
                   help="vLLM's: fp8 quantizes a float checkpoint or preset at load (per-channel weight scales, "
                        "dynamic per-token activations); an FP8 checkpoint (compressed-tensors, HF fp8) runs "
                        "its own scheme with none/auto/fp8; any other method is refused by name")
    g.add_argument("--kv-cache-dtype", default="auto", metavar="DTYPE",
                   help="vLLM's: auto (the model's dtype, or fp8 when the checkpoint declares a kv_cache_scheme), "
                        "fp8 / fp8_e4m3 (float8 e4m3 with per-layer k/v scales: the checkpoint's calibrated ones, "
                        "else 1.0; twice the tokens in the same memory; needs NVIDIA sm_89+ or AMD MI300), or the "
                        "model's dtype by name (bfloat16 ...); fp8_e5m2 and others are refused by name")
    add_source_args(g)  # --revision, --download-dir, --load-format


def _partition_text(text: str) -> str:
    try:
        PartitionConfig.parse(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"{v} must be a positive number")
    return v


NO_SLO = "none"  # --slo-itl-ms's word for no ITL SLO (vLLM has no such flag; --prefill-graph-tokens spells its none so)


def slo_ms(text: str) -> float | None:
    """--slo-itl-ms: a positive, finite number of ms, or none (None: no ITL SLO)."""
    if text.strip().lower() == NO_SLO:
        return None
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of ms; give one (e.g. 50), or {NO_SLO} for no "
                                         "ITL SLO") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive, finite number of ms, or {NO_SLO} for no ITL "
                                         "SLO")
    return v


def nonneg_float(text: str) -> float:
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


def _slo_margin(text: str) -> float | None:
    """--slo-margin: auto (None: adapted) or a share in (0, 1]."""
    if text == "auto":
        return None
    try:
        return fraction(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e}: give auto or a share of the ITL SLO in (0, 1], e.g. 0.9") from None


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
                       help="serve, adaptive partition on one GPU per engine (policy duet with an ITL SLO, rapid or "
                            "drift), no profile given or committed for this GPU and model: measure a short one at "
                            "start (under a minute) and cache it in $XDG_CACHE_HOME/rapidserve/profiles "
                            "(~/.cache/...), where the next start finds it; --no-auto-profile uses the roofline "
                            "estimate instead")
    g.add_argument("--partition-backend", default="auto", choices=("auto", "cuda-green", "hip-cumask", "none"))
    g.add_argument("--slo-itl-ms", type=slo_ms, default=50.0, metavar="MS|none",
                   help="inter-token latency SLO (ms) the adaptive policies decide with (default 50), or none: no ITL "
                        "SLO, maximise throughput. --policy duet then runs every step fused with the whole "
                        "--max-num-batched-tokens budget (never split); --policy fused, --mode hybrid and a fixed or "
                        "no --partition read no SLO anyway; --policy rapid and drift (and `rapidserve profile`) "
                        "choose their split by the SLO and refuse none")
    if with_mode:
        g.add_argument("--policy", default=None, choices=POLICIES,
                       help="the shape of each step: rapid (always split: the profile's configuration with the most "
                            "prefill throughput within the ITL SLO), duet (DuetServe, the default: fused steps while "
                            "the predicted step meets the SLO, else the split with the most prefill throughput), "
                            "drift (split, prefill a layer block at a time on the split with the most prefill units "
                            "within the SLO; a short request may preempt a long prefill: give --slo-ttft-ms) or fused "
                            "(always one mixed step: --mode hybrid, which it implies). Each reads its own flags; one "
                            "it does not read is refused")
        g.add_argument("--slo-ttft-ms", type=positive_float, default=None,
                       help="drift: a request's time-to-first-token SLO (ms), plus --slo-ttft-ms-per-1k-tokens x "
                            "its prompt tokens / 1000; without it nothing is preempted")
        g.add_argument("--slo-ttft-ms-per-1k-tokens", type=nonneg_float, default=0.0,
                       help="drift: what each 1000 prompt tokens add to --slo-ttft-ms (e.g. 1000: 1 s per 1K)")
        g.add_argument("--profile-lookup", default="auto", choices=PROFILE_LOOKUPS,
                       help="how --policy rapid and duet's cost model read the profile for a decode batch and "
                            "context between its buckets: round-up (to the bucket at or above each: conservative, "
                            "it overstates a step by up to a bucket), interpolate (linearly between them: more "
                            "prefill throughput, but splits measured over the ITL SLO on 4096-token prompts) or auto "
                            "(the default: round-up for splits and decode alone, interpolate for duet's fused steps, "
                            "whose one correction ratio would otherwise carry the rounding's bias into their chunks)")
        g.add_argument("--slo-margin", type=_slo_margin, default=None, metavar="auto|SHARE",
                       help="duet: the share of --slo-itl-ms each step is planned within: auto (the default: adapted "
                            "between 0.8 and 0.97 to how often its steps made a token gap over the SLO, holding that "
                            "under 1%%) or a fixed share in (0, 1], e.g. 0.9")
        g.add_argument("--step-correction", default="by-shape", choices=STEP_CORRECTIONS,
                       help="duet: how its online correction of the cost model is kept: by-shape (the default: a "
                            "fused step's ratio by its size, decode on a split's by configuration) or per-kind (one "
                            "ratio for all fused steps, one for all splits, as before 2026-11-30)")
        g.add_argument("--drift-prefill-model", type=_drift_model, default=None, metavar="A_MS,B_MS_PER_TOKEN",
                       help="drift: the prefill time model a + b x tokens (ms) to use instead of the one fitted "
                            "at start-up from the roofline (one for every configuration)")


def serve_mode(a: argparse.Namespace) -> str:
    """`--mode`, or where it is left out the mode `--policy` runs in (fused: hybrid), else rapid."""
    return resolve_mode(getattr(a, "mode", None), getattr(a, "policy", None))


def partition_config(a: argparse.Namespace) -> PartitionConfig:
    """The partition flags as a PartitionConfig, `--policy` left out resolved to the mode's default (hybrid: fused;
    disagg: rapid). The `--profile` file is read by `given_profile`."""
    text = getattr(a, "partition", "adaptive")
    policy = resolve_policy(serve_mode(a), getattr(a, "policy", None), text.split(":", 1)[0])
    pcfg = PartitionConfig.parse(text, backend=a.partition_backend,
                                 profile=getattr(a, "profile", None), slo_itl_ms=a.slo_itl_ms,
                                 policy=policy, slo_ttft_ms=getattr(a, "slo_ttft_ms", None),
                                 slo_ttft_ms_per_1k_tokens=getattr(a, "slo_ttft_ms_per_1k_tokens", 0.0),
                                 drift_prefill_model=getattr(a, "drift_prefill_model", None),
                                 profile_lookup=getattr(a, "profile_lookup", "auto"),
                                 slo_margin=getattr(a, "slo_margin", None),
                                 step_correction=getattr(a, "step_correction", "by-shape"))
    return pcfg


def given_profile(a: argparse.Namespace, pcfg: PartitionConfig) -> Profile | None:
    """The `--profile` file, read, parsed and validated before any model loads (ProfileError names the file and
    field), where the partition flags fit the mode and policy (else build_engine_config refuses them, all the flags
    at once, policy_spec.check_settings, before any file is read): the one parse of a start-up, handed down to the
    engine (server.serve.start_engine), whose decode worker checks it against its GPU and model. None: no
    --profile, or flags the builder refuses."""
    from rapidserve.partition.profile import read_profile

    if pcfg.profile is None or conflicts(serve_mode(a), pcfg.policy, given_settings({"partition": pcfg})):
        return None
    return read_profile(pcfg.profile)


def setting_kwargs(a: argparse.Namespace, env: Mapping[str, str] | None = None) -> dict[str, object]:
    """The model flags that need no model, as `engine_settings.engine_sections`' (and build_engine_config's)
    arguments, with $RAPIDSERVE_ALLOW_LONG_MAX_MODEL_LEN read from `env` (default: os.environ) here, where the run
    starts."""
    allow_long = allow_long_max_model_len(os.environ if env is None else env)
    return dict(dtype=a.dtype, device=a.device, max_model_len=a.max_model_len, allow_long_max_model_len=allow_long,
                gpu_memory_utilization=a.gpu_memory_utilization, block_size=a.block_size,
                num_kv_blocks=a.num_kv_blocks, kv_cache_memory_bytes=a.kv_cache_memory_bytes,
                max_num_seqs=a.max_num_seqs,
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
