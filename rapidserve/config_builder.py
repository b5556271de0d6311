"""`build_engine_config`: resolve `--model` and assemble the frozen `EngineConfig` tree (the one place it is built).

Used by `rapidserve.LLM`, the CLI, the server and `rapidserve profile`. Layer: above the loader and
the runner (whose device and dtype rules it applies), below `rapidserve.partition` and everything
that starts an engine.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence

from rapidserve.config import (
    ALLOW_LONG_MAX_MODEL_LEN_ENV,
    CacheConfig,
    ConfigError,
    EngineConfig,
    KVEventsConfig,
    LaunchConfig,
    ParallelConfig,
    PartitionConfig,
    RunnerConfig,
    SchedulerConfig,
)
from rapidserve.kv_events import make_none_hash
from rapidserve.loader import resolve_model
from rapidserve.policy_spec import RUN_SPECS, check_settings, resolve_policy

log = logging.getLogger("rapidserve.config")


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


def resolve_kv_events(value: object, *, enable_prefix_caching: bool, hash_seed: str | None) -> KVEventsConfig:
    """--kv-events-config (JSON text, a mapping or a KVEventsConfig; None: off) as the tree's section. When it
    publishes: the prefix cache must be on (the events are its blocks), pyzmq must be installed, and the first
    block's hash seed is fixed here, once: from `hash_seed` ($PYTHONHASHSEED, read where the run starts) or at
    random, as vLLM's NONE_HASH (rapidserve/kv_events.py)."""
    import importlib.util

    cfg = KVEventsConfig() if value is None else KVEventsConfig.parse(value)
    if not cfg.publishing:
        return cfg
    if not enable_prefix_caching:
        raise ConfigError("--kv-events-config publishes the prefix cache's block events, and "
                          "--no-enable-prefix-caching turns the cache off: drop one of them")
    if importlib.util.find_spec("zmq") is None:
        raise ConfigError("--kv-events-config publishes over ZMQ, which needs pyzmq: pip install "
                          "'rapidserve[kv-events]' (or pip install pyzmq)")
    if hash_seed is None:
        log.warning("KV events: PYTHONHASHSEED is not set, so block hashes start from a random seed: a router can "
                    "learn them from the events but cannot hash a prompt to the same values (set PYTHONHASHSEED "
                    "alike on every replica and the router, as with vLLM)")
    return dataclasses.replace(cfg, none_hash=make_none_hash(hash_seed))


UNSET_CHOICES = (None, "auto", "none")  # what --quantization / --kv-cache-dtype may say today


def check_unsupported_options(quantization: str | None, kv_cache_dtype: str | None) -> None:
    """ConfigError naming `--quantization` or `--kv-cache-dtype` when it asks for anything but none/auto.

    vLLM takes both (quantizing weights on load, an FP8 KV cache); rapidserve computes in the checkpoint's
    float dtype and keeps the KV cache in it, so a value is refused by name rather than ignored (a
    checkpoint quantized on disk is refused by the loader, `loader/quant.py`)."""
    q = quantization.strip().lower() if isinstance(quantization, str) else quantization
    if q not in UNSET_CHOICES:
        raise ConfigError(f"--quantization {quantization!r} (quantization={quantization!r}): rapidserve does not "
                          "quantize weights (it serves bf16/fp16/fp32 Hugging Face checkpoints and GGUF files; "
                          "FP8 support is tracked in issue 39): drop the flag and give the unquantized checkpoint")
    kv = kv_cache_dtype.strip().lower() if isinstance(kv_cache_dtype, str) else kv_cache_dtype
    if kv not in UNSET_CHOICES:
        raise ConfigError(f"--kv-cache-dtype {kv_cache_dtype!r} (kv_cache_dtype={kv_cache_dtype!r}): the KV cache is "
                          "kept in the model's dtype (an FP8 KV cache is not supported yet): drop the flag or give "
                          "auto")


def build_engine_config(model: str | None = None, *, dtype: str = "auto", device: str = "auto",
                        max_model_len: int | None = None, gpu_memory_utilization: float = 0.9,
                        block_size: int = 16, num_kv_blocks: int | None = None,
                        max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                        prefill_batch_tokens: int | None = None,
                        enforce_eager: bool = False, prefill_graph_tokens: Sequence[int] | None = None,
                        seed: int = 0, attention_backend: str = "auto", cache_dir: str | None = None,
                        enable_prefix_caching: bool = True,
                        async_scheduling: bool = True, tokenizer: str | None = None,
                        allow_long_max_model_len: bool = False, quantization: str | None = None,
                        kv_cache_dtype: str | None = "auto", launch: LaunchConfig | None = None,
                        partition: PartitionConfig | None = None, parallel: ParallelConfig | None = None,
                        kv_events_config: object = None, python_hash_seed: str | None = None,
                        run: str | None = None) -> tuple[EngineConfig, object]:
    """Resolve the model and assemble the frozen config tree (the one place it is built). `prefill_graph_tokens`:
    the piecewise prefill graphs' token buckets (None: RunnerConfig's default; (): none). `tokenizer`:
    a folder of tokenizer files to use instead of the model's (a preset has none). `allow_long_max_model_len`:
    accept a max_model_len above the model's max_position_embeddings (else a ConfigError says how to fix it;
    the CLI and `LLM` take it from $RAPIDSERVE_ALLOW_LONG_MAX_MODEL_LEN). `quantization`, `kv_cache_dtype`: vLLM's;
    anything but None/none/auto is refused before the model is looked at (`check_unsupported_options`). `launch`,
    `partition`, `parallel`: the serving sections (None: their defaults; a partition left out runs the mode's
    default policy). `kv_events_config`: vLLM's --kv-events-config (`resolve_kv_events`; `python_hash_seed`:
    $PYTHONHASHSEED as the run found it). `run`: what will run the tree, "offline" (`LLM`, `rapidserve generate`),
    "profile" (`rapidserve profile`), or None: the server in `launch.mode`. Before the model is resolved, every
    setting given is checked against what that run and its policy read (`policy_spec.check_settings`): one ignored
    is a ConfigError saying how to fix it."""
    from rapidserve.runner import resolve_device, resolve_dtype

    check_unsupported_options(quantization, kv_cache_dtype)
    launch = launch or LaunchConfig()
    run = run or launch.mode
    if run not in RUN_SPECS:
        raise ConfigError(f"run={run!r}; use one of {', '.join(RUN_SPECS)}")
    partition = partition or PartitionConfig(policy=resolve_policy(run, None, PartitionConfig().mode))
    cache = CacheConfig(block_size=block_size, gpu_memory_utilization=gpu_memory_utilization,
                        num_blocks=num_kv_blocks, enable_prefix_caching=enable_prefix_caching)
    scheduler = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                prefill_batch_tokens=prefill_batch_tokens, max_model_len=max_model_len,
                                async_scheduling=async_scheduling, allow_long_max_model_len=allow_long_max_model_len)
    graphs = {} if prefill_graph_tokens is None else {"prefill_graph_tokens": tuple(prefill_graph_tokens)}
    runner = RunnerConfig(device=device, dtype=dtype, attention_backend=attention_backend,
                          use_cuda_graphs=not enforce_eager, seed=seed, **graphs)
    kv_events = KVEventsConfig() if kv_events_config is None else KVEventsConfig.parse(kv_events_config)
    check_settings(run, partition.policy, {"scheduler": scheduler, "cache": cache, "runner": runner,
                                           "partition": partition, "launch": launch, "kv_events": kv_events},
                   eager=enforce_eager)
    kv_events = resolve_kv_events(kv_events, enable_prefix_caching=enable_prefix_caching, hash_seed=python_hash_seed)
    dev = resolve_device(device)
    source = resolve_model(model, cache_dir=cache_dir, preset_device=dev,
                           preset_dtype=resolve_dtype(dtype, dev))
    if tokenizer is not None:
        source = dataclasses.replace(source, tokenizer_dir=tokenizer, tokenizer_file=None, tokenizer_cache_dir=None)
    mcfg = source.config
    cfg = EngineConfig(model=model or "default", model_config=mcfg, cache=cache, scheduler=scheduler, runner=runner,
                       launch=launch, partition=partition, parallel=parallel or ParallelConfig(), tokenizer=tokenizer,
                       kv_events=kv_events)
    if max_model_len is not None and max_model_len > mcfg.max_position_embeddings:  # allowed, or EngineConfig refused
        log.warning("max_model_len %d is more than the model's max_position_embeddings %d (%s), allowed by "
                    "allow_long_max_model_len ($%s): outputs past position %d may be garbage", max_model_len,
                    mcfg.max_position_embeddings, mcfg.name, ALLOW_LONG_MAX_MODEL_LEN_ENV, mcfg.max_position_embeddings)
    return cfg, source
