"""The typed, frozen configuration tree.

Built once (from a model folder, a GGUF file, a preset, CLI flags) and passed down. Nothing below
the engine reads environment variables or globals for its settings: it gets one of these.
Every validation error names the field, the value and what is allowed, so the user can fix it.
Here: the model, the KV cache, the scheduler, the runner, parallelism and the root `EngineConfig`; the other
sections have their own modules (launch_config.py, partition_config.py, server_config.py, generation_config.py,
kv_events_config.py), and `ConfigError` is config_base.py's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from rapidserve.config_base import check as _check
from rapidserve.generation_config import SamplingDefaults
from rapidserve.kv_events_config import KVEventsConfig
from rapidserve.launch_config import LaunchConfig
from rapidserve.moe_config import MoeConfig
from rapidserve.partition_config import PartitionConfig
from rapidserve.quant_config import KV_CACHE_DTYPES, KVScales, QuantizationConfig


def divisors(n: int) -> str:
    """The divisors of `n` up to 16, for messages ("1, 2, 4, 8")."""
    return ", ".join(str(d) for d in range(1, min(n, 16) + 1) if n % d == 0)


Arch = Literal["llama", "qwen2", "qwen3", "mistral", "gemma3", "mixtral", "qwen3_moe"]
ARCHES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "mistral", "gemma3", "mixtral", "qwen3_moe")
# A layer's attention (ModelConfig.layer_types, transformers' names): over every earlier token, or the last
# ModelConfig.sliding_window of them.
LAYER_TYPES: tuple[str, ...] = ("full_attention", "sliding_attention")
ROPE_TYPES: tuple[str, ...] = ("llama3", "linear")
DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")
DTYPE_ALIASES: MappingProxyType[str, str] = MappingProxyType({"half": "float16", "float": "float32"})  # vLLM's
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "torch", "triton", "fa3")
# Read once where a run starts (the CLI, `LLM`; config_builder.allow_long_max_model_len), never below: it becomes
# SchedulerConfig.allow_long_max_model_len (vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN).
ALLOW_LONG_MAX_MODEL_LEN_ENV = "RAPIDSERVE_ALLOW_LONG_MAX_MODEL_LEN"
# How weights are read (vLLM's --load-format): auto (the model's own form), safetensors (a Hugging Face folder),
# gguf (a .gguf file), dummy (the model's architecture with random weights: `dummy:` specs, loader/presets.py).
LOAD_FORMATS: tuple[str, ...] = ("auto", "safetensors", "gguf", "dummy")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: Llama 3.1's "llama3" (every field), or "linear" (every frequency divided by `factor`;
    Gemma 3's global layers). The rope types of ROPE_TYPES are supported."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"

    def __post_init__(self) -> None:
        _check(self.rope_type in ROPE_TYPES,
               f"rope_scaling.rope_type={self.rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
        _check(self.factor >= 1.0, f"rope_scaling.factor={self.factor} must be >= 1")
        _check(self.high_freq_factor > self.low_freq_factor,
               "rope_scaling.high_freq_factor must be greater than low_freq_factor")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer. One set of layers serves these families:

    - llama: Llama 2/3/3.1 (optionally llama3 RoPE scaling), SmolLM2
    - qwen2: q/k/v projections carry a bias
    - qwen3: per-head RMSNorm on q and k before RoPE
    - mistral: Llama's layers, attention over the last `sliding_window` tokens when that is set
    - gemma3: Gemma 3's text model (rapidserve/models/gemma3.py): scaled embeddings, (1 + weight) RMSNorms around
      attention and the MLP, q/k norms, GELU-tanh MLP, sliding-window local layers and global layers
      (`layer_types`) with RoPE bases of their own, `query_pre_attn_scalar`, optional final logit soft-capping
    - mixtral, qwen3_moe: Llama / Qwen3 attention with mixture-of-experts MLPs (`moe`, rapidserve/moe_config.py)
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
    # Sliding-window attention: a query attends to the last `sliding_window` tokens, itself included, in the layers
    # `layer_types` (one of LAYER_TYPES per layer) marks "sliding_attention"; in every layer when it is () (Mistral).
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    # Gemma 3: the attention scale is query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5); its sliding layers'
    # RoPE base (their RoPE is unscaled; rope_theta and rope_scaling are the global layers'); the final logits'
    # tanh soft-cap (None: none).
    query_pre_attn_scalar: float | None = None
    rope_local_theta: float | None = None
    final_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"
    moe: MoeConfig | None = None  # the experts of mixtral / qwen3_moe (None: every MLP dense)

    def __post_init__(self) -> None:
        _check(self.arch in ARCHES, f"model arch={self.arch!r} is not supported; supported: {list(ARCHES)}")
        _check((self.moe is not None) == (self.arch in ("mixtral", "qwen3_moe")),
               f"model arch={self.arch!r} {'needs' if self.moe is None else 'takes no'} moe section")
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, f)
            _check(isinstance(v, int) and v > 0, f"model {f}={v!r} must be a positive integer")
        _check(self.num_heads % self.num_kv_heads == 0,
               f"model num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        _check(self.rms_norm_eps > 0, f"model rms_norm_eps={self.rms_norm_eps} must be > 0")
        _check(self.sliding_window is None or (isinstance(self.sliding_window, int) and self.sliding_window > 0),
               f"model sliding_window={self.sliding_window!r} must be a positive integer or unset (no window)")
        _check(not self.layer_types or (len(self.layer_types) == self.num_layers
                                        and all(t in LAYER_TYPES for t in self.layer_types)),
               f"model layer_types={list(self.layer_types)} must give one of {list(LAYER_TYPES)} for each of the "
               f"{self.num_layers} layers, or be empty")
        _check("sliding_attention" not in self.layer_types or self.sliding_window is not None,
               "model layer_types has sliding_attention layers but sliding_window is unset: give the window")
        for f in ("query_pre_attn_scalar", "rope_local_theta", "final_logit_softcapping"):
            v = getattr(self, f)
            _check(v is None or v > 0, f"model {f}={v!r} must be > 0 or unset")
        _check((self.arch == "gemma3") == (self.rope_local_theta is not None),
               f"model rope_local_theta={self.rope_local_theta!r} is Gemma 3's (arch gemma3) and needed there")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attn_scale(self) -> float:
        """The attention softmax's scale of q.k."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`'s attention (None: it attends to every earlier token)."""
        if self.sliding_window is None or (self.layer_types and self.layer_types[layer] != "sliding_attention"):
            return None
        return self.sliding_window

    def num_params(self) -> int:
        """Parameter count (embedding and lm_head counted once each; once in total when tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        layer = attn + 3 * h * i + (4 if self.arch == "gemma3" else 2) * h  # Gemma 3: norms before and after both
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        if self.moe is not None:  # sparse layers: experts and router instead of the dense MLP
            return self.num_layers * layer + self.moe.num_sparse(self.num_layers) * (
                self.moe.layer_params(h) - 3 * h * i) + emb + h
        return self.num_layers * layer + emb + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.num_layers * 2 * self.kv_size * dtype_bytes

    def replace(self, **kw: object) -> ModelConfig:
        return dataclasses.replace(self, **kw)

    def tp_problem(self, tp: int, flag: str = "--tensor-parallel-size") -> str | None:
        """Why this model cannot be split over `tp` tensor-parallel ranks (None: it can). Attention heads and
        MLP features must divide; KV heads must divide, or (fewer KV heads than ranks) divide tp. `flag`: the
        flag the message names (disagg's prefill side: --prefill-tensor-parallel-size)."""
        if tp < 1:
            return f"{flag} {tp} must be >= 1"
        if self.num_heads % tp:
            return (f"{flag} {tp} must divide the model's {self.num_heads} attention heads; "
                    f"use one of {divisors(self.num_heads)}")
        if self.intermediate_size % tp:
            return f"{flag} {tp} must divide the MLP's {self.intermediate_size} features"
        if self.moe is not None and self.moe.intermediate_size % tp:
            return (f"{flag} {tp} must divide each expert's {self.moe.intermediate_size} features "
                    "(every rank holds a slice of every expert)")
        if self.num_kv_heads >= tp and self.num_kv_heads % tp:
            return (f"{flag} {tp} must divide the model's {self.num_kv_heads} KV heads, or be a "
                    f"multiple of them; use one of {divisors(self.num_kv_heads)}")
        if self.num_kv_heads < tp and tp % self.num_kv_heads:
            return (f"{flag} {tp} is more than the model's {self.num_kv_heads} KV heads and not "
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
    # What the pool holds (--kv-cache-dtype, resolved by config_builder.resolve_kv_cache): "auto" the model's dtype;
    # "fp8" float8 e4m3 (e4m3fnuz on ROCm's gfx94x), each layer's keys and values stored as fp8(x / scale) and read
    # as x8 * scale: half the bytes of bf16, twice the tokens in the same memory (kv_pool.py).
    kv_cache_dtype: str = "auto"
    # fp8 only: the checkpoint's calibrated per-tensor scales (quant_config.KVScales); None: uncalibrated, 1.0.
    kv_scales: KVScales | None = None

    def __post_init__(self) -> None:
        _check(self.block_size in (8, 16, 32, 64, 128),
               f"block_size={self.block_size} is not supported; use one of 8, 16, 32, 64, 128")
        _check(0.0 < self.gpu_memory_utilization <= 1.0,
               f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        _check(self.num_blocks is None or self.num_blocks > 0,
               f"num_blocks={self.num_blocks} must be a positive integer or unset")
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES,
               f"kv_cache_dtype={self.kv_cache_dtype!r}; use one of {', '.join(KV_CACHE_DTYPES)}")
        _check(self.kv_scales is None or self.fp8_kv,
               "kv_scales are the fp8 KV cache's: give them with kv_cache_dtype='fp8' only")

    @property
    def fp8_kv(self) -> bool:
        """Whether the pool stores fp8 (with per-layer scales)."""
        return self.kv_cache_dtype == "fp8"

    def layer_kv_scales(self, num_layers: int) -> tuple[tuple[float, float], ...]:
        """Each layer's (k_scale, v_scale) of an fp8 pool in e4m3fn units: the checkpoint's, else 1.0 each."""
        if self.kv_scales is not None:
            return self.kv_scales.scales
        return ((1.0, 1.0),) * num_layers


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
    # Decode graph buckets; the largest caps the seats (batch_limits.seats), and a worker captures those up to its
    # seats only (batch_limits.decode_graph_buckets). Up to 512, every 32 from 256: vLLM's default max_num_seqs on a
    # GPU >= 70 GiB is 1024, and at 256 a decode-heavy load queued what vLLM runs.
    graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352,
                                          384, 416, 448, 480, 512)
    # Token buckets of the piecewise prefill graphs (rapidserve/runner/prefill_graphs.py); () captures none. On the
    # H100 (Qwen3-8B) a prefill forward launched from Python waits for the host up to ~512 tokens; graphs save
    # 49-59% up to 128 tokens, 34% at 256, 5% at 512, 1% at 1024 (bench/results/h100_1127/prefill_graphs/). The
    # prefill worker and `LLM` capture those up to PREFILL_WORKER_MAX_BUCKET (512); a server's decode worker's fused
    # steps (duet, hybrid) all of them: there an eager launch of a larger step holds back the tokens of the step before.
    # Above 1024 every 128 tokens: duet ends a fused chunk on a bucket or pads it to the next (policies.on_bucket), and
    # at 256 apart that cost its fused steps ~5% of their 45-ms budget (H200, 2048:28, 2026-11-30: 42.5 ms a step where
    # the same server launching them eager filled 44.7); each bucket costs ~0.06 s of capture at start.
    prefill_graph_tokens: tuple[int, ...] = (16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024, 1152, 1280, 1408,
                                             1536, 1664, 1792, 1920, 2048)
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
class ParallelConfig:
    """How many GPUs one server uses (rapidserve.parallel): `tensor_parallel_size` ranks hold a shard of every
    layer each (per rank a decode and a prefill worker in rapid mode, a hybrid worker in hybrid mode);
    `data_parallel_size` independent engines sit behind the one router. The GPUs are `devices` (indices as
    CUDA/ROCm numbers them), default 0 .. tp * dp - 1.

    Disagg mode (engine/disagg.py) runs a prefill side of `prefill_tp` ranks and a decode side of
    `tensor_parallel_size` ranks (decode owns the KV pool), `prefill_tp + tensor_parallel_size` GPUs in all:
    prefill on the first, decode on the next (`disagg_gpus`); `prefill_tensor_parallel_size` (None: the same as
    `tensor_parallel_size`) is read by disagg mode only."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    devices: tuple[int, ...] | None = None
    prefill_tensor_parallel_size: int | None = None  # --prefill-tensor-parallel-size (disagg only)

    def __post_init__(self) -> None:
        _check(self.tensor_parallel_size >= 1,
               f"tensor_parallel_size={self.tensor_parallel_size} must be >= 1 (1: no tensor parallelism)")
        _check(self.data_parallel_size >= 1,
               f"data_parallel_size={self.data_parallel_size} must be >= 1 (1: one engine)")
        _check(self.prefill_tensor_parallel_size is None or self.prefill_tensor_parallel_size >= 1,
               f"--prefill-tensor-parallel-size {self.prefill_tensor_parallel_size} must be >= 1")
        if self.devices is not None:
            _check(len(set(self.devices)) == len(self.devices) and all(d >= 0 for d in self.devices),
                   f"devices={list(self.devices)} must be distinct GPU indices")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def prefill_tp(self) -> int:
        """Disagg's prefill side's tensor-parallel size."""
        return self.prefill_tensor_parallel_size or self.tensor_parallel_size

    def gpus(self) -> tuple[int, ...]:
        """The GPU index of each (dp replica, tp rank), replica-major: engine i's rank r is [i * tp + r]."""
        return self.devices if self.devices is not None else tuple(range(self.world_size))

    def disagg_gpus(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Disagg: (the prefill ranks' GPUs, the decode ranks'): the first prefill_tp of `devices` (default
        0, 1, ...), then the next tensor_parallel_size."""
        n, m = self.prefill_tp, self.tensor_parallel_size
        gpus = self.devices if self.devices is not None else tuple(range(n + m))
        return tuple(gpus[:n]), tuple(gpus[n:n + m])

    def disagg_problem(self, model: ModelConfig) -> str | None:
        """Why disagg mode cannot run this way (None: it can): one prefill and one decode side, each sharded
        whole KV heads per rank (parallel/kv_routes.py), one side's size dividing the other's; `devices`, if given,
        listing every rank's GPU."""
        n, m, k = self.prefill_tp, self.tensor_parallel_size, model.num_kv_heads
        if self.data_parallel_size != 1:
            return (f"--mode disagg runs one prefill and one decode side: it takes no data parallelism "
                    f"(--data-parallel-size {self.data_parallel_size}); use -dp 1, or --mode rapid with -dp")
        for flag, t in (("--tensor-parallel-size", m), ("--prefill-tensor-parallel-size", n)):  # -tp: both's default
            problem = model.tp_problem(t, flag)
            if problem is not None:
                return f"--mode disagg: {problem}"
            if k % t:
                return (f"--mode disagg: {flag} {t} must divide the model's {k} KV heads (each rank holds whole "
                        f"heads of its own, which move to and from the ranks of the other side that hold them; "
                        f"replicated KV heads are not supported in disagg); use one of {divisors(k)}")
        if n % m and m % n:
            return (f"--mode disagg: --prefill-tensor-parallel-size {n} and --tensor-parallel-size {m}: one must "
                    f"divide the other (each rank of the smaller side then pairs with whole ranks of the larger); "
                    f"e.g. {n} and {n}, or {m} and {m}")
        if self.devices is not None and len(self.devices) != n + m:
            return (f"devices={list(self.devices)}: --mode disagg uses {n + m} GPUs (prefill's {n}, then "
                    f"decode's {m}); list {n + m}")
        return None


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
        scales = self.cache.kv_scales
        _check(scales is None or len(scales.scales) == self.model_config.num_layers,
               f"kv_scales has {len(scales.scales) if scales else 0} layers' scales, the model "
               f"{self.model_config.num_layers} layers: build the config from this model")
        sched = self.scheduler  # before anything is sized by it (the RoPE table, the KV pool), in every engine path
        problem = self.model_config.max_model_len_problem(sched.max_model_len, sched.allow_long_max_model_len)
        _check(problem is None, problem or "")
        if self.launch.mode == "disagg":  # a prefill and a decode side, on GPUs of their own (engine/disagg.py)
            problem = par.disagg_problem(self.model_config)
            _check(problem is None, problem or "")
            n, m = par.prefill_tp, par.tensor_parallel_size
            _check(self.runner.device in ("auto", "cpu", "cuda"), f"device={self.runner.device!r} names one GPU but "
                   f"--mode disagg uses {n + m} (prefill on GPUs {list(range(n))}, decode on "
                   f"{list(range(n, n + m))}, or ParallelConfig.devices); use --device cuda (or auto) and pick GPUs "
                   "with CUDA_VISIBLE_DEVICES")
        else:
            _check(par.prefill_tensor_parallel_size is None,
                   f"--prefill-tensor-parallel-size {par.prefill_tensor_parallel_size}: read by --mode disagg only "
                   f"(--mode {self.launch.mode}'s prefill runs on the decode side's ranks, -tp); drop it")
            _check(par.devices is None or len(par.devices) == par.world_size,
                   f"devices={list(par.devices or ())}: mode {self.launch.mode} uses {par.world_size} GPUs "
                   "(tensor_parallel_size x data_parallel_size); list that many")
