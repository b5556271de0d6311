"""The typed, frozen configuration tree: its root `EngineConfig`, and every section's public names re-exported.

Built once (from a model folder, a GGUF file, a preset, CLI flags) and passed down. Nothing below
the engine reads environment variables or globals for its settings: it gets one of these.
Every validation error names the field, the value and what is allowed, so the user can fix it.
Here: the root `EngineConfig` (its checks across sections) and LOAD_FORMATS. Each section has its own module:
model_config.py (`ModelConfig`, `RopeScaling`), cache_config.py, scheduler_config.py, runner_config.py,
parallel_config.py, launch_config.py, partition_config.py, server_config.py, generation_config.py,
kv_events_config.py, quant_config.py; `ConfigError` and `divisors` are config_base.py's. The names of the model,
cache, scheduler, runner and parallel sections are re-exported here, so `from rapidserve.config import ModelConfig`
keeps working.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rapidserve.cache_config import CacheConfig
from rapidserve.config_base import check as _check
from rapidserve.config_base import divisors
from rapidserve.generation_config import SamplingDefaults
from rapidserve.kv_events_config import KVEventsConfig
from rapidserve.launch_config import LaunchConfig
from rapidserve.model_config import (
    ALLOW_LONG_MAX_MODEL_LEN_ENV,
    ARCHES,
    LAYER_TYPES,
    ROPE_TYPES,
    Arch,
    ModelConfig,
    RopeScaling,
)
from rapidserve.parallel_config import ParallelConfig
from rapidserve.partition_config import PartitionConfig
from rapidserve.quant_config import QuantizationConfig
from rapidserve.runner_config import ATTENTION_BACKENDS, DTYPE_ALIASES, DTYPES, RunnerConfig
from rapidserve.scheduler_config import SchedulerConfig

__all__ = [
    "ALLOW_LONG_MAX_MODEL_LEN_ENV", "ARCHES", "ATTENTION_BACKENDS", "DTYPES", "DTYPE_ALIASES", "LAYER_TYPES",
    "LOAD_FORMATS", "ROPE_TYPES", "Arch", "CacheConfig", "EngineConfig", "ModelConfig", "ParallelConfig",
    "RopeScaling", "RunnerConfig", "SchedulerConfig", "divisors",
]

# How weights are read (vLLM's --load-format): auto (the model's own form), safetensors (a Hugging Face folder),
# gguf (a .gguf file), dummy (the model's architecture with random weights: `dummy:` specs, loader/presets.py).
LOAD_FORMATS: tuple[str, ...] = ("auto", "safetensors", "gguf", "dummy")


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
