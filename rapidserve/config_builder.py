"""`build_engine_config`: resolve `--model` and assemble the frozen `EngineConfig` tree (the one place it is built).

Used by `rapidserve.LLM`, the CLI, the server and `rapidserve profile`. Layer: above the loader and
the runner (whose device and dtype rules it applies), below `rapidserve.partition` and everything
that starts an engine.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping, Sequence

from rapidserve.config import (
    ALLOW_LONG_MAX_MODEL_LEN_ENV,
    CacheConfig,
    ConfigError,
    EngineConfig,
    RunnerConfig,
    SchedulerConfig,
)
from rapidserve.generation_config import (
    GENERATION_CONFIG_FILE,
    GENERATION_CONFIG_MODES,
    GenerationConfigError,
    SamplingDefaults,
    sampling_defaults,
)
from rapidserve.loader import ModelSource, resolve_model

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


def build_engine_config(model: str | None = None, *, dtype: str = "auto", device: str = "auto",
                        max_model_len: int | None = None, gpu_memory_utilization: float = 0.9,
                        block_size: int = 16, num_kv_blocks: int | None = None,
                        max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                        prefill_batch_tokens: int | None = None,
                        enforce_eager: bool = False, prefill_graph_tokens: Sequence[int] | None = None,
                        seed: int = 0, attention_backend: str = "auto", cache_dir: str | None = None,
                        enable_prefix_caching: bool = True,
                        async_scheduling: bool = True, tokenizer: str | None = None,
                        allow_long_max_model_len: bool = False,
                        generation_config: str = "auto") -> tuple[EngineConfig, object]:
    """Resolve the model and assemble the frozen config tree (the one place it is built). `prefill_graph_tokens`:
    the piecewise prefill graphs' token buckets (None: RunnerConfig's default; (): none). `tokenizer`:
    a folder of tokenizer files to use instead of the model's (a preset has none). `allow_long_max_model_len`:
    accept a max_model_len above the model's max_position_embeddings (else a ConfigError says how to fix it;
    the CLI and `LLM` take it from $RAPIDSERVE_ALLOW_LONG_MAX_MODEL_LEN). `generation_config`: where the
    sampling defaults come from (`resolve_generation_config`)."""
    from rapidserve.runner import resolve_device, resolve_dtype

    if generation_config not in GENERATION_CONFIG_MODES and not os.path.isdir(generation_config):
        raise ConfigError(f"--generation-config {generation_config!r}: use auto (the model's "
                          f"{GENERATION_CONFIG_FILE}), vllm (vLLM's defaults) or a folder holding a "
                          f"{GENERATION_CONFIG_FILE}")  # before the model loads
    dev = resolve_device(device)
    source = resolve_model(model, cache_dir=cache_dir, preset_device=dev,
                           preset_dtype=resolve_dtype(dtype, dev))
    if tokenizer is not None:
        source = dataclasses.replace(source, tokenizer_dir=tokenizer, tokenizer_file=None, tokenizer_cache_dir=None)
    mcfg = source.config
    cfg = EngineConfig(
        model=model or "default",
        model_config=mcfg,
        cache=CacheConfig(block_size=block_size, gpu_memory_utilization=gpu_memory_utilization,
                          num_blocks=num_kv_blocks, enable_prefix_caching=enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  prefill_batch_tokens=prefill_batch_tokens,
                                  max_model_len=max_model_len, async_scheduling=async_scheduling,
                                  allow_long_max_model_len=allow_long_max_model_len),
        runner=RunnerConfig(device=device, dtype=dtype, attention_backend=attention_backend,
                            use_cuda_graphs=not enforce_eager, seed=seed,
                            **({} if prefill_graph_tokens is None
                               else {"prefill_graph_tokens": tuple(prefill_graph_tokens)})),
        tokenizer=tokenizer,
        generation=resolve_generation_config(generation_config, source, model),
    )
    if max_model_len is not None and max_model_len > mcfg.max_position_embeddings:  # allowed, or EngineConfig refused
        log.warning("max_model_len %d is more than the model's max_position_embeddings %d (%s), allowed by "
                    "allow_long_max_model_len ($%s): outputs past position %d may be garbage", max_model_len,
                    mcfg.max_position_embeddings, mcfg.name, ALLOW_LONG_MAX_MODEL_LEN_ENV, mcfg.max_position_embeddings)
    return cfg, source


def resolve_generation_config(spec: str, source: ModelSource, model: str | None) -> SamplingDefaults:
    """The sampling defaults of `--generation-config spec`, as vLLM resolves it: "auto" reads the model
    folder's generation_config.json (none for a folder without one, a GGUF file or a preset), "vllm" reads
    nothing, a folder reads its file (which must exist). A file that is not a JSON object, or holds a bad
    value, is a ConfigError naming it."""
    if spec == "vllm":
        return SamplingDefaults(source="--generation-config vllm (the model's file ignored)")
    if spec == "auto":
        if source.hf_folder is None:
            kind = "a preset" if (model or "").startswith("preset:") else "a GGUF file"
            return SamplingDefaults(source=f"{kind} has no {GENERATION_CONFIG_FILE}")
        path = os.path.join(source.hf_folder, GENERATION_CONFIG_FILE)
        if not os.path.isfile(path):
            return SamplingDefaults(source=f"the model folder has no {GENERATION_CONFIG_FILE}")
        where = f"the model's {GENERATION_CONFIG_FILE} ({path})"
    else:
        path = os.path.join(spec, GENERATION_CONFIG_FILE)
        if not os.path.isfile(path):
            raise ConfigError(f"--generation-config {spec}: the folder has no {GENERATION_CONFIG_FILE}; give a "
                              "folder that has one, auto or vllm")
        where = path
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
