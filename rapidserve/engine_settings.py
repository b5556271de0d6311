"""The half of building the config tree that needs no model: the settings' sections, and every check on them.

`engine_sections` turns the flat settings (`build_engine_config`'s keywords, the CLI's flags) into the tree's
cache, scheduler, runner, launch and partition sections, refusing by name what rapidserve cannot honour: vLLM's
`--quantization` other than fp8 / none / auto, `--kv-cache-dtype` other than auto / fp8 / fp8_e4m3 / a float
dtype (`check_unsupported_options`; the FP8 scheme and the KV cache's dtype and scales are resolved with the model,
`config_builder.resolve_quantization`, `config_builder.resolve_kv_cache`) and every setting the run
and its policy would not read (`policy_spec.check_settings`). `--generation-config` is checked here too
(`generation_defaults`: vllm, or a folder's generation_config.json read and checked; auto's file is the model's,
read by the builder once the model is resolved). vLLM's `--kv-events-config` becomes the `kv_events` section
(`kv_events_section`: only a server reads it, it needs the prefix cache on and pyzmq installed; the seed of its
block hashes is set by the builder). `config_builder.build_engine_config` calls it before
it resolves the model; `rapidserve serve` calls it before it binds its port, so that a bad flag exits 2 at once,
and builds the tree once the port answers 503 "starting" (server/startup.py).

Layer: plain data (imports only `config`, `generation_config`, `kv_events_config`, `quant_config` and `policy_spec`;
no torch, no loader), so the CLI
imports it in milliseconds.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rapidserve.batch_limits import SERVER_BATCHED_TOKENS, SMALL_MAX_NUM_SEQS
from rapidserve.cache_config import GPU_MEMORY_UTILIZATION
from rapidserve.config import ALLOW_LONG_MAX_MODEL_LEN_ENV, CacheConfig, RunnerConfig, SchedulerConfig
from rapidserve.config_base import ConfigError
from rapidserve.generation_config import (
    GENERATION_CONFIG_FILE,
    GenerationConfigError,
    SamplingDefaults,
    sampling_defaults,
)
from rapidserve.human_int import AUTO
from rapidserve.kv_events_config import KVEventsConfig, KVEventsConfigError
from rapidserve.launch_config import LaunchConfig
from rapidserve.partition_config import PartitionConfig
from rapidserve.policy_spec import RUN_SPECS, check_settings, resolve_policy
from rapidserve.quant_config import KV_CACHE_FLAGS, KV_CACHE_REFUSED

UNSET_CHOICES = (None, "auto", "none")  # --quantization / --kv-cache-dtype left to the model
QUANTIZATION_FLAGS = ("fp8",)  # the --quantization methods served (quant_config.py)


def allow_long_max_model_len(env: Mapping[str, str]) -> bool:
    """$RAPIDSERVE_ALLOW_LONG_MAX_MODEL_LEN from `env` (read once, by the CLI or `LLM`): 1/true allow a max_model_len
    above the model's max_position_embeddings; 0/false/empty/unset refuse it; anything else is a ConfigError."""
    text = env.get(ALLOW_LONG_MAX_MODEL_LEN_ENV, "").strip().lower()
    if text in ("1", "true"):
        return True
    if text in ("", "0", "false"):
        return False
    raise ConfigError(f"{ALLOW_LONG_MAX_MODEL_LEN_ENV}={env[ALLOW_LONG_MAX_MODEL_LEN_ENV]!r}: use 1 to allow a "
                      "--max-model-len above the model's max_position_embeddings, or 0 (or unset it) to refuse one")


def check_unsupported_options(quantization: str | None, kv_cache_dtype: str | None) -> tuple[str | None, str]:
    """(`--quantization` as the builder reads it: "fp8", or None: the model's own, a float or FP8 checkpoint;
    `--kv-cache-dtype` as `quant_config.KV_CACHE_FLAGS` names it: "auto", "fp8" or a float dtype), or a ConfigError
    naming `--quantization` or `--kv-cache-dtype` when it asks for what is not served.

    vLLM takes both (quantizing weights on load, an FP8 KV cache). rapidserve serves `--quantization fp8` (a float
    checkpoint quantized at load, or an FP8 checkpoint's own scheme); any other method is refused by name rather
    than ignored (a checkpoint quantized on disk with one is refused by the loader, `loader/quant.py`). The KV
    cache is the model's dtype (auto, or that dtype named: config_builder checks it is the model's) or fp8 (fp8,
    fp8_e4m3: e4m3 with per-tensor scales); vLLM's other cache dtypes are refused by name (KV_CACHE_REFUSED)."""
    q = quantization.strip().lower() if isinstance(quantization, str) else quantization
    if q not in UNSET_CHOICES and q not in QUANTIZATION_FLAGS:
        raise ConfigError(f"--quantization {quantization!r} (quantization={quantization!r}): rapidserve quantizes "
                          "weights with fp8 only (and serves FP8 checkpoints in compressed-tensors and Hugging Face "
                          "fp8 form as they are): drop the flag and give the unquantized checkpoint, or use "
                          "--quantization fp8")
    kv = kv_cache_dtype.strip().lower() if isinstance(kv_cache_dtype, str) else "auto"
    if kv not in KV_CACHE_FLAGS:
        why = KV_CACHE_REFUSED.get(kv, f"not a KV cache dtype; use one of {', '.join(KV_CACHE_FLAGS)}")
        raise ConfigError(f"--kv-cache-dtype {kv_cache_dtype!r} (kv_cache_dtype={kv_cache_dtype!r}): {why} "
                          "(or drop the flag: auto keeps the model's dtype)")
    return (None if q in UNSET_CHOICES else str(q)), KV_CACHE_FLAGS[kv]


def read_generation_config(path: str, where: str) -> SamplingDefaults:
    """The sampling defaults of the generation_config.json at `path` (`where`: how messages name it); a file that
    cannot be read, is not a JSON object, or holds a bad value is a ConfigError naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read it as JSON ({e}); fix it, or use --generation-config vllm") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: not a JSON object; fix it, or use --generation-config vllm")
    try:
        return sampling_defaults(d, where)
    except GenerationConfigError as e:
        raise ConfigError(str(e)) from None


def generation_defaults(spec: str) -> SamplingDefaults | None:
    """The sampling defaults `--generation-config spec` gives without the model, as vLLM resolves the flag: "vllm"
    none (vLLM's own), a folder its generation_config.json's (which must exist and be good), "auto" None (the
    model folder's file: `config_builder.resolve_generation_config`). Anything else is a ConfigError."""
    if spec == "vllm":
        return SamplingDefaults(source="--generation-config vllm (the model's file ignored)")
    if spec == "auto":
        return None
    if not os.path.isdir(spec):
        raise ConfigError(f"--generation-config {spec!r}: use auto (the model's {GENERATION_CONFIG_FILE}), vllm "
                          f"(vLLM's defaults) or a folder holding a {GENERATION_CONFIG_FILE}")
    path = os.path.join(spec, GENERATION_CONFIG_FILE)
    if not os.path.isfile(path):
        raise ConfigError(f"--generation-config {spec}: the folder has no {GENERATION_CONFIG_FILE}; give a "
                          "folder that has one, auto or vllm")
    return read_generation_config(path, path)


def parse_kv_events(value: object) -> KVEventsConfig:
    """--kv-events-config (JSON text, a mapping or a KVEventsConfig; None: off), parsed: a ConfigError naming an
    unknown key, a wrong type or a bad value."""
    try:
        return KVEventsConfig.parse(value)
    except KVEventsConfigError as e:
        raise ConfigError(str(e)) from None


def kv_events_section(value: object, *, enable_prefix_caching: bool) -> KVEventsConfig:
    """--kv-events-config as the tree's section (`parse_kv_events`), its `none_hash` not yet set
    (`config_builder.resolve_kv_events`). When it publishes, the prefix cache must be on (the events are its
    blocks) and pyzmq installed: a ConfigError saying how to fix it otherwise."""
    cfg = parse_kv_events(value)
    if not cfg.publishing:
        return cfg
    if not enable_prefix_caching:
        raise ConfigError("--kv-events-config publishes the prefix cache's block events, and "
                          "--no-enable-prefix-caching turns the cache off: drop one of them")
    if importlib.util.find_spec("zmq") is None:
        raise ConfigError("--kv-events-config publishes over ZMQ, which needs pyzmq: pip install "
                          "'rapidserve[kv-events]' (or pip install pyzmq)")
    return cfg


@dataclass(frozen=True)
class EngineSections:
    """The sections of the tree that the settings alone give, checked (`engine_sections`)."""

    cache: CacheConfig
    scheduler: SchedulerConfig
    runner: RunnerConfig
    launch: LaunchConfig
    partition: PartitionConfig
    generation: SamplingDefaults | None  # None: --generation-config auto, the model folder's (read with the model)
    kv_events: KVEventsConfig  # checked, its none_hash not yet set (config_builder.resolve_kv_events)
    quantization: str | None = None  # --quantization: "fp8", or None (the model's own: config_builder)
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype as KV_CACHE_FLAGS names it (config_builder.resolve_kv_cache)


def fit_max_model_len(max_model_len: int | str | None) -> tuple[int | None, bool]:
    """`max_model_len` as (the scheduler's max_model_len, fit_max_model_len): vLLM 0.26's -1 and "auto" (any case)
    fit the model's length to the KV pool (SchedulerConfig.fit_max_model_len); another string is a ConfigError
    naming what is allowed."""
    if isinstance(max_model_len, str):
        if max_model_len.strip().lower() in ("auto", "-1"):
            return None, True
        raise ConfigError(f"max_model_len={max_model_len!r}: give a positive integer, -1 or 'auto' (the length that "
                          "fits the KV cache), or leave it unset for the model's max_position_embeddings")
    if max_model_len == AUTO:
        return None, True
    return max_model_len, False


def engine_sections(*, dtype: str = "auto", device: str = "auto", max_model_len: int | str | None = None,
                    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION, block_size: int = 16,
                    num_kv_blocks: int | None = None, kv_cache_memory_bytes: int | None = None,
                    max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                    prefill_batch_tokens: int | None = None, enforce_eager: bool = False,
                    prefill_graph_tokens: Sequence[int] | None = None, seed: int = 0,
                    attention_backend: str = "auto", enable_prefix_caching: bool = True,
                    async_scheduling: bool = True, allow_long_max_model_len: bool = False,
                    quantization: str | None = None, kv_cache_dtype: str | None = "auto",
                    launch: LaunchConfig | None = None, partition: PartitionConfig | None = None,
                    run: str | None = None, generation_config: str = "auto",
                    kv_events_config: object = None) -> EngineSections:
    """The settings as the tree's sections (the keywords are `build_engine_config`'s, which documents them); a
    ConfigError, one line saying how to fix it, for a `--quantization` or `--kv-cache-dtype` not served,
    an unknown `run`, a bad value, a setting that `run` and its policy would not read (policy_spec), or a bad
    `--generation-config` (`generation_defaults`) or `--kv-events-config` (`kv_events_section`)."""
    quant, kv_flag = check_unsupported_options(quantization, kv_cache_dtype)
    max_model_len, fit = fit_max_model_len(max_model_len)
    generation = generation_defaults(generation_config)
    launch = launch or LaunchConfig()
    run = run or launch.mode
    if run not in RUN_SPECS:
        raise ConfigError(f"run={run!r}; use one of {', '.join(RUN_SPECS)}")
    partition = partition or PartitionConfig(policy=resolve_policy(run, None, PartitionConfig().mode))
    cache = CacheConfig(block_size=block_size, gpu_memory_utilization=gpu_memory_utilization,
                        num_blocks=num_kv_blocks, kv_cache_memory_bytes=kv_cache_memory_bytes,
                        enable_prefix_caching=enable_prefix_caching,
                        kv_cache_dtype="fp8" if kv_flag == "fp8" else "auto")
    # None (not given): the field's default here, for the checks; the builder resolves it by device
    # (batch_limits, config_builder.resolve_batch_limits) once the device is known
    scheduler = SchedulerConfig(max_num_seqs=SMALL_MAX_NUM_SEQS if max_num_seqs is None else max_num_seqs,
                                max_num_batched_tokens=(SERVER_BATCHED_TOKENS if max_num_batched_tokens is None
                                                        else max_num_batched_tokens),
                                prefill_batch_tokens=prefill_batch_tokens, max_model_len=max_model_len,
                                fit_max_model_len=fit, async_scheduling=async_scheduling,
                                allow_long_max_model_len=allow_long_max_model_len)
    graphs = {} if prefill_graph_tokens is None else {"prefill_graph_tokens": tuple(prefill_graph_tokens)}
    runner = RunnerConfig(device=device, dtype=dtype, attention_backend=attention_backend,
                          use_cuda_graphs=not enforce_eager, seed=seed, **graphs)
    kv_events = parse_kv_events(kv_events_config)  # a server's only: checked by check_settings before anything else
    check_settings(run, partition.policy, {"scheduler": scheduler, "cache": cache, "runner": runner,
                                           "partition": partition, "launch": launch, "kv_events": kv_events},
                   eager=enforce_eager)
    kv_events = kv_events_section(kv_events, enable_prefix_caching=enable_prefix_caching)
    return EngineSections(cache=cache, scheduler=scheduler, runner=runner, launch=launch, partition=partition,
                          generation=generation, kv_events=kv_events, quantization=quant, kv_cache_dtype=kv_flag)
