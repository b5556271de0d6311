"""The typed, frozen configuration tree.

Built once (from a model folder, a GGUF file, a preset, CLI flags) and passed down. Nothing below
the engine reads environment variables or globals for its settings: it gets one of these.
Every validation error names the field, the value and what is allowed, so the user can fix it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from rapidserve.generation_config import SamplingDefaults
from rapidserve.kv_events_config import KVEventsConfig
from rapidserve.quant_config import QuantizationConfig

Arch = Literal["llama", "qwen2", "qwen3"]
# rapid: decode and prefill workers sharing weights and KV; hybrid: one worker, chunked prefill
# mixed with decodes under the token budget (Sarathi-Serve / vLLM), the baseline; disagg: prefill on
# one GPU and decode on another, each with its own weights, KV moved between their pools (DistServe /
# Dynamo 1P1D, the disaggregated baseline; engine/disagg.py).
EngineMode = Literal["rapid", "hybrid", "disagg"]
ENGINE_MODES: tuple[str, ...] = ("rapid", "hybrid", "disagg")
ARCHES: tuple[str, ...] = ("llama", "qwen2", "qwen3")
DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "torch", "triton", "fa3")
TOOL_CALL_PARSERS: tuple[str, ...] = ("auto", "hermes", "llama3_json")  # auto: from the chat template / family
REASONING_PARSERS: tuple[str, ...] = ("deepseek_r1", "qwen3")  # vLLM's --reasoning-parser (server/reasoning_parsers.py)
# Read once where a run starts (the CLI, `LLM`; config_builder.allow_long_max_model_len), never below: it becomes
# SchedulerConfig.allow_long_max_model_len (vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN).
ALLOW_LONG_MAX_MODEL_LEN_ENV = "RAPIDSERVE_ALLOW_LONG_MAX_MODEL_LEN"
FALLBACK_MAX_TOKENS = 256  # the server's max_tokens of a request that gives none, without flag or model default
# How weights are read (vLLM's --load-format): auto (the model's own form), safetensors (a Hugging Face folder),
# gguf (a .gguf file), dummy (the model's architecture with random weights: `dummy:` specs, loader/presets.py).
LOAD_FORMATS: tuple[str, ...] = ("auto", "safetensors", "gguf", "dummy")
LOG_LEVELS: tuple[str, ...] = ("debug", "info", "warning", "error", "critical")


class ConfigError(ValueError):
    """A configuration value is invalid; the message says which field and what is allowed."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 ("llama3") RoPE frequency scaling. `rope_type` 'llama3' is the only one supported."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"

    def __post_init__(self) -> None:
        _check(self.rope_type == "llama3",
               f"rope_scaling.rope_type={self.rope_type!r} is not supported; supported: 'llama3'")
        _check(self.factor >= 1.0, f"rope_scaling.factor={self.factor} must be >= 1")
        _check(self.high_freq_factor > self.low_freq_factor,
               "rope_scaling.high_freq_factor must be greater than low_freq_factor")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer. One set of layers serves all three families:

    - llama: Llama 2/3/3.1 (optionally llama3 RoPE scaling), SmolLM2
    - qwen2: q/k/v projections carry a bias
    - qwen3: per-head RMSNorm on q and k before RoPE
    """

    arch: Arch
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"

    def __post_init__(self) -> None:
        _check(self.arch in ARCHES, f"model arch={self.arch!r} is not supported; supported: {list(ARCHES)}")
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, f)
            _check(isinstance(v, int) and v > 0, f"model {f}={v!r} must be a positive integer")
        _check(self.num_heads % self.num_kv_heads == 0,
               f"model num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        _check(self.rms_norm_eps > 0, f"model rms_norm_eps={self.rms_norm_eps} must be > 0")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameter count (embedding and lm_head counted once each; once in total when tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        layer = attn + 3 * h * i + 2 * h
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + emb + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.num_layers * 2 * self.kv_size * dtype_bytes

    def replace(self, **kw: object) -> ModelConfig:
        return dataclasses.replace(self, **kw)

    def tp_problem(self, tp: int) -> str | None:
        """Why this model cannot be split over `tp` tensor-parallel ranks (None: it can). Attention heads and
        MLP features must divide; KV heads must divide, or (fewer KV heads than ranks) divide tp."""
        def divisors(n: int) -> str:
            return ", ".join(str(d) for d in range(1, min(n, 16) + 1) if n % d == 0)

        if tp < 1:
            return f"--tensor-parallel-size {tp} must be >= 1"
        if self.num_heads % tp:
            return (f"--tensor-parallel-size {tp} must divide the model's {self.num_heads} attention heads; "
                    f"use one of {divisors(self.num_heads)}")
        if self.intermediate_size % tp:
            return f"--tensor-parallel-size {tp} must divide the MLP's {self.intermediate_size} features"
        if self.num_kv_heads >= tp and self.num_kv_heads % tp:
            return (f"--tensor-parallel-size {tp} must divide the model's {self.num_kv_heads} KV heads, or be a "
                    f"multiple of them; use one of {divisors(self.num_kv_heads)}")
        if self.num_kv_heads < tp and tp % self.num_kv_heads:
            return (f"--tensor-parallel-size {tp} is more than the model's {self.num_kv_heads} KV heads and not "
                    "a multiple of them: each KV head must be replicated on a whole number of ranks")
        return None

    def max_model_len_problem(self, max_model_len: int | None, allow_long: bool) -> str | None:
        """Why `max_model_len` cannot be used with this model (None: it can), as vLLM decides: not above
        max_position_embeddings (the positions it was trained on; the RoPE table and the KV pool are sized by
        max_model_len) unless `allow_long` (RAPIDSERVE_ALLOW_LONG_MAX_MODEL_LEN=1)."""
        limit = self.max_position_embeddings
        if max_model_len is None or max_model_len <= limit or allow_long:
            return None
        return (f"--max-model-len {max_model_len} is more than the model's max_position_embeddings={limit} "
                f"({self.name}): it was not trained on positions past {limit}. Lower --max-model-len to at most "
                f"{limit} (or leave it out: it defaults to {limit}), or set the environment variable "
                f"{ALLOW_LONG_MAX_MODEL_LEN_ENV}=1 to allow it anyway (as vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN; "
                f"outputs past position {limit} may be garbage)")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool. `num_blocks=None` sizes it from free device memory."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_blocks: int | None = None
    # On CPU there is no "free device memory": the pool takes this many bytes unless num_blocks is set.
    cpu_kv_bytes: int = 512 * 1024 * 1024
    # Share the K/V of equal prompt prefixes between requests (block_manager.py), as vLLM does by default.
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _check(self.block_size in (8, 16, 32, 64, 128),
               f"block_size={self.block_size} is not supported; use one of 8, 16, 32, 64, 128")
        _check(0.0 < self.gpu_memory_utilization <= 1.0,
               f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        _check(self.num_blocks is None or self.num_blocks > 0,
               f"num_blocks={self.num_blocks} must be a positive integer or unset")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # rapid mode's prefill worker: a batch stops taking more whole prompts once it holds this many
    # tokens (None: only max_num_batched_tokens bounds it). Smaller batches answer the prompts of a
    # queue one batch sooner each (TTFT) once a forward is big enough to keep the GPU's GEMMs busy.
    prefill_batch_tokens: int | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # A max_model_len above the model's max_position_embeddings is refused unless this is set (from
    # $RAPIDSERVE_ALLOW_LONG_MAX_MODEL_LEN at the CLI / `LLM`; EngineConfig checks it).
    allow_long_max_model_len: bool = False
    # The decode worker (every mode: its one step loop) plans and launches the next step before the last
    # one's tokens reach the host (as vLLM's --async-scheduling); False: each step is recorded first.
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        _check(self.max_num_seqs > 0, f"max_num_seqs={self.max_num_seqs} must be > 0")
        _check(self.max_num_batched_tokens > 0,
               f"max_num_batched_tokens={self.max_num_batched_tokens} must be > 0")
        _check(self.prefill_batch_tokens is None or 0 < self.prefill_batch_tokens <= self.max_num_batched_tokens,
               f"prefill_batch_tokens={self.prefill_batch_tokens} must be between 1 and max_num_batched_tokens="
               f"{self.max_num_batched_tokens}, or unset for max_num_batched_tokens")
        _check(self.max_model_len is None or self.max_model_len > 0,
               f"max_model_len={self.max_model_len} must be a positive integer, or unset for the model's "
               "max_position_embeddings")


@dataclass(frozen=True)
class RunnerConfig:
    """How the model runs: device, dtype, attention backend, decode and prefill graphs."""

    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16 (auto: bf16 on GPU, fp32 on CPU)
    attention_backend: str = "auto"  # ATTENTION_BACKENDS
    use_cuda_graphs: bool = True
    graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
    # Token buckets of the piecewise prefill graphs (rapidserve/runner/prefill_graphs.py); () captures none. On the
    # H100 (Qwen3-8B) a prefill forward launched from Python waits for the host up to ~512 tokens; graphs save
    # 49-59% up to 128 tokens, 34% at 256, 5% at 512, 1% at 1024 (bench/results/h100_1127/prefill_graphs/).
    prefill_graph_tokens: tuple[int, ...] = (16, 32, 64, 128, 256, 384, 512)
    seed: int = 0

    def __post_init__(self) -> None:
        _check(self.dtype == "auto" or self.dtype in DTYPES,
               f"dtype={self.dtype!r} is not supported; use auto or one of {list(DTYPES)}")
        _check(self.attention_backend in ATTENTION_BACKENDS,
               f"attention_backend={self.attention_backend!r}; use one of {', '.join(ATTENTION_BACKENDS)}")
        _check(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
               f"device={self.device!r}; use auto, cpu, cuda or cuda:N")
        _check(len(self.graph_batch_sizes) > 0 and list(self.graph_batch_sizes) == sorted(self.graph_batch_sizes),
               "graph_batch_sizes must be a non-empty ascending tuple")
        _check(all(isinstance(t, int) and not isinstance(t, bool) and t > 0 for t in self.prefill_graph_tokens)
               and list(self.prefill_graph_tokens) == sorted(set(self.prefill_graph_tokens)),
               f"prefill_graph_tokens={list(self.prefill_graph_tokens)} must be positive integers, unique and "
               "ascending, e.g. (16, 64, 256, 512), or empty for no prefill graphs")


@dataclass(frozen=True)
class LaunchConfig:
    """How the two-process engine starts, is supervised and talks (rapidserve.engine)."""

    mps: str = "auto"  # auto | on | off (NVIDIA only)
    on_worker_death: str = "restart"  # restart | shutdown
    # Restart budget: at most `max_restarts` restarts in any `restart_window_s` seconds; one more
    # death inside the window and the engine gives up (the server then exits non-zero, so its
    # supervisor, systemd / Kubernetes / Slurm, starts it afresh).
    max_restarts: int = 5
    restart_window_s: float = 600.0
    # A worker that sends nothing (its loop publishes Stats or a Heartbeat every `stats_interval_s`)
    # for this long is taken as hung: killed and handled as a death. None: 60 s on a GPU, 600 s on
    # a CPU, where one prefill forward of a long prompt can take minutes.
    heartbeat_timeout_s: float | None = None
    startup_timeout_s: float = 900.0
    ring_slots: int = 1024
    ring_slot_size: int = 1024
    stats_interval_s: float = 0.25
    mode: EngineMode = "rapid"  # which workers start (ENGINE_MODES); hybrid and disagg use no MPS
    log_level: str = "info"  # the workers' logging (LOG_LEVELS): their start-up steps are logged at info

    def __post_init__(self) -> None:
        _check(self.mps in ("auto", "on", "off"), f"mps={self.mps!r}; use auto, on or off")
        _check(self.log_level in LOG_LEVELS, f"log_level={self.log_level!r}; use one of {', '.join(LOG_LEVELS)}")
        _check(self.mode in ENGINE_MODES, f"mode={self.mode!r}; use one of {list(ENGINE_MODES)}")
        _check(self.on_worker_death in ("restart", "shutdown"),
               f"on_worker_death={self.on_worker_death!r}; use restart or shutdown")
        _check(self.startup_timeout_s > 0, f"startup_timeout_s={self.startup_timeout_s} must be > 0")
        _check(self.max_restarts >= 0, f"max_restarts={self.max_restarts} must be >= 0 (0: never restart)")
        _check(self.restart_window_s > 0, f"restart_window_s={self.restart_window_s} must be > 0 seconds")
        _check(self.heartbeat_timeout_s is None or self.heartbeat_timeout_s >= 10 * self.stats_interval_s,
               f"heartbeat_timeout_s={self.heartbeat_timeout_s} must be at least 10 x stats_interval_s "
               f"({10 * self.stats_interval_s:g} s), or None for the default")
        _check(self.ring_slots >= 8 and self.ring_slot_size >= 64 and self.ring_slot_size % 8 == 0,
               "ring_slots must be >= 8 and ring_slot_size >= 64 and a multiple of 8")


@dataclass(frozen=True)
class ParallelConfig:
    """How many GPUs one server uses (rapidserve.parallel): `tensor_parallel_size` ranks hold a shard of every
    layer each (per rank a decode and a prefill worker in rapid mode, a hybrid worker in hybrid mode);
    `data_parallel_size` independent engines sit behind the one router. The GPUs are `devices` (indices as
    CUDA/ROCm numbers them), default 0 .. tp * dp - 1."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    devices: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _check(self.tensor_parallel_size >= 1,
               f"tensor_parallel_size={self.tensor_parallel_size} must be >= 1 (1: no tensor parallelism)")
        _check(self.data_parallel_size >= 1,
               f"data_parallel_size={self.data_parallel_size} must be >= 1 (1: one engine)")
        if self.devices is not None:
            _check((len(self.devices) == self.world_size or self.world_size == 1 and len(self.devices) == 2)
                   and len(set(self.devices)) == len(self.devices) and all(d >= 0 for d in self.devices),
                   f"devices={list(self.devices)} must be {self.world_size} distinct GPU indices "
                   f"(tensor_parallel_size x data_parallel_size), or two for --mode disagg (prefill, decode)")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    def gpus(self) -> tuple[int, ...]:
        """The GPU index of each (dp replica, tp rank), replica-major: engine i's rank r is [i * tp + r]."""
        return self.devices if self.devices is not None else tuple(range(self.world_size))


# The policies (rapidserve/policy_spec.py declares what each uses and reads; partition/ holds their decisions):
# rapid (always split, the profile's choice), duet (fused when a step fits the ITL SLO, else split), drift (split,
# prefill block-wise), fused (always one mixed step: --mode hybrid's).
POLICIES = ("rapid", "duet", "drift", "fused")
# What `--mode rapid --partition adaptive` runs when --policy is left out. The adaptive policy is `duet` (DuetServe's
# design); it becomes the default once the decode worker carries out fused steps itself (issue 37's engine change):
# until then `duet` in the engine is the two-process approximation (partition/duet.py), so the default stays rapid.
DEFAULT_POLICY = "rapid"
PROFILE_LOOKUPS = ("interpolate", "round-up")  # how the manager reads a profile between buckets: profile.estimate


@dataclass(frozen=True)
class PartitionConfig:
    """How decode and prefill split the GPU's compute (rapidserve.partition).

    mode: adaptive (the manager picks a configuration each decode step from the profile), off (both
    use the whole GPU), static (a fixed split giving decode `static_decode_share` of the units).
    policy (POLICIES; rapidserve/policy_spec.py declares the workers, partition modes and settings of each):
    rapid (RAPID-Serve: the profile's configuration with the most prefill throughput within the ITL SLO;
    any mode), duet (DuetServe: fused steps while the predicted step meets the SLO, else the split that
    maximises prefill throughput; adaptive), drift (DRIFT: prefill launched a layer block at a time on the
    configuration with the most prefill units within the ITL SLO; a short request may preempt a long prefill
    batch at a block boundary; adaptive) or fused (always one mixed step: --mode hybrid's worker).
    profile_lookup (rapid policy, duet's cost model): how a decode batch and context between the profile's
    buckets are read: round-up (to the bucket at or above each) or interpolate (linearly between the buckets around
    them;
    partition/profile.py `estimate`). round-up stays the default: on the H100, 4096:64 all at once, interpolate
    ran 6% more requests/s but p99 ITL 63 ms against the 50 ms SLO (bench/results/issue16.md, 2026-11-27).
    drift only: slo_ttft_ms (+ slo_ttft_ms_per_1k_tokens x prompt tokens / 1000) is a request's TTFT SLO,
    without which nothing is preempted; drift_prefill_model (a_ms, b_ms_per_token) replaces the prefill
    time model fitted at start-up (one for every configuration).
    Here each field is checked alone; which fields a policy, a partition mode and a run read together is
    `policy_spec.conflicts`, run on the tree `config_builder.build_engine_config` builds.
    """

    mode: str = "adaptive"  # adaptive | off | static
    static_decode_share: float | None = None
    backend: str = "auto"  # auto | cuda-green | hip-cumask | none
    profile: str | None = None  # a profile file; None: profiles/<gpu>__<model>.json if present, else roofline
    slo_itl_ms: float = 50.0
    hysteresis_steps: int = 8
    decode_shares: tuple[float, ...] = (0.125, 0.25, 0.375, 0.5)
    policy: str = "rapid"
    slo_ttft_ms: float | None = None
    slo_ttft_ms_per_1k_tokens: float = 0.0
    drift_prefill_model: tuple[float, float] | None = None
    profile_lookup: str = "round-up"

    def __post_init__(self) -> None:
        _check(self.mode in ("adaptive", "off", "static"),
               f"partition mode={self.mode!r}; use adaptive, off or static:<decode share>")
        _check((self.mode == "static") == (self.static_decode_share is not None),
               "a static partition needs its decode share (static:0.25), and only a static one has it")
        _check(self.static_decode_share is None or 0.0 < self.static_decode_share < 1.0,
               f"static decode share {self.static_decode_share} must be in (0, 1), e.g. static:0.25")
        _check(self.backend in ("auto", "cuda-green", "hip-cumask", "none"),
               f"partition backend={self.backend!r}; use auto, cuda-green, hip-cumask or none")
        _check(self.slo_itl_ms > 0, f"slo_itl_ms={self.slo_itl_ms} must be > 0")
        _check(self.policy in POLICIES, f"policy={self.policy!r}; use one of {', '.join(POLICIES)}")
        _check(self.hysteresis_steps >= 0, f"hysteresis_steps={self.hysteresis_steps} must be >= 0")
        _check(self.slo_ttft_ms is None or 0 < self.slo_ttft_ms < float("inf"),
               f"slo_ttft_ms={self.slo_ttft_ms} must be a positive number")
        _check(0 <= self.slo_ttft_ms_per_1k_tokens < float("inf"),
               f"slo_ttft_ms_per_1k_tokens={self.slo_ttft_ms_per_1k_tokens} must be >= 0")
        _check(self.slo_ttft_ms_per_1k_tokens == 0 or self.slo_ttft_ms is not None,
               "--slo-ttft-ms-per-1k-tokens adds to --slo-ttft-ms: give --slo-ttft-ms too")
        m = self.drift_prefill_model
        _check(m is None or (len(m) == 2 and 0 <= m[0] < float("inf") and 0 < m[1] < float("inf")),
               f"drift_prefill_model={m} must be (a_ms >= 0, b_ms_per_token > 0)")
        _check(self.profile_lookup in PROFILE_LOOKUPS,
               f"profile_lookup={self.profile_lookup!r}; use one of {', '.join(PROFILE_LOOKUPS)}")
        _check(len(self.decode_shares) > 0 and all(0.0 < s < 1.0 for s in self.decode_shares),
               f"decode_shares={self.decode_shares} must be a non-empty tuple of shares in (0, 1)")

    @classmethod
    def parse(cls, text: str, **kw: object) -> PartitionConfig:
        """`adaptive`, `off` or `static:<decode share>` (e.g. static:0.25), as given to --partition."""
        if text in ("adaptive", "off"):
            return cls(mode=text, **kw)  # type: ignore[arg-type]
        if text.startswith("static:"):
            try:
                share = float(text.split(":", 1)[1])
            except ValueError:
                raise ConfigError(f"--partition {text!r}: the share after static: must be a number in (0, 1), "
                                  "e.g. static:0.25") from None
            return cls(mode="static", static_decode_share=share, **kw)  # type: ignore[arg-type]
        raise ConfigError(f"--partition {text!r}; use adaptive, off or static:<decode share in (0, 1)>")


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
    api_key: str | None = None
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
        _check(0 <= self.port <= 65535, f"port={self.port} must be in 0..65535 (0: any free port)")
        _check(self.max_waiting >= 0, f"max_waiting={self.max_waiting} must be >= 0")
        _check(self.max_body_bytes >= 1024, f"max_body_bytes={self.max_body_bytes} must be >= 1024")
        _check(self.default_max_tokens is None or self.default_max_tokens >= 1,
               f"default_max_tokens={self.default_max_tokens} must be >= 1 or None")
        _check(self.shutdown_grace_s >= 0, f"shutdown_grace_s={self.shutdown_grace_s} must be >= 0")
        _check(self.api_key is None or len(self.api_key) > 0, "api_key must not be empty")
        _check(self.max_connections >= 1, f"max_connections={self.max_connections} must be >= 1")
        _check(self.keepalive_timeout_s > 0, f"keepalive_timeout_s={self.keepalive_timeout_s} must be > 0")
        _check(self.header_timeout_s > 0, f"header_timeout_s={self.header_timeout_s} must be > 0")
        _check(all(isinstance(n, str) and n.strip() for n in self.served_model_name)
               and len(set(self.served_model_name)) == len(self.served_model_name),
               f"served_model_name={list(self.served_model_name)}: give distinct, non-empty names")
        for name, ok in (("log_level", LOG_LEVELS), ("http_log_level", (*LOG_LEVELS, "trace")),
                         ("tool_call_parser", TOOL_CALL_PARSERS), ("reasoning_parser", (None, *REASONING_PARSERS))):
            value = getattr(self, name)
            _check(value in ok, f"{name}={value!r}; use one of {', '.join(map(str, ok))}")


@dataclass(frozen=True)
class EngineConfig:
    """The root of the tree: what to load and how to run it."""

    model: str
    model_config: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # A folder of tokenizer files used instead of the model's (--tokenizer): gives a preset (random
    # weights, no tokenizer) text prompts and structured outputs.
    tokenizer: str | None = None
    # The model's recommended sampling defaults (generation_config.json; --generation-config), which a
    # request's unset fields take at the edges (the server, LLM); workers never read them.
    generation: SamplingDefaults = field(default_factory=SamplingDefaults)
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)  # --kv-events-config (kv_events_config.py)
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)  # fp8 weights (quant_config.py)

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len or self.model_config.max_position_embeddings

    def __post_init__(self) -> None:
        par = self.parallel
        problem = self.model_config.tp_problem(par.tensor_parallel_size)
        _check(problem is None, problem or "")
        sched = self.scheduler  # before anything is sized by it (the RoPE table, the KV pool), in every engine path
        problem = self.model_config.max_model_len_problem(sched.max_model_len, sched.allow_long_max_model_len)
        _check(problem is None, problem or "")
        if self.launch.mode == "disagg":  # one prefill and one decode instance, a GPU each (engine/disagg.py)
            _check(par.world_size == 1, f"--mode disagg runs one prefill and one decode instance on a GPU each: it "
                   f"takes no tensor or data parallelism (tensor_parallel_size={par.tensor_parallel_size}, "
                   f"data_parallel_size={par.data_parallel_size}); use 1 and 1")
            _check(self.runner.device in ("auto", "cpu", "cuda"), f"device={self.runner.device!r} names one GPU but "
                   "--mode disagg uses two (prefill on GPU 0, decode on GPU 1, or ParallelConfig.devices); use "
                   "--device cuda (or auto) and pick GPUs with CUDA_VISIBLE_DEVICES")
        else:
            _check(par.devices is None or len(par.devices) == par.world_size,
                   f"devices={list(par.devices or ())}: two GPUs for one engine are for --mode disagg (prefill, "
                   f"decode); mode {self.launch.mode} uses {par.world_size}")
