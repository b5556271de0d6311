"""`build_engine_config`: resolve `--model` and assemble the frozen `EngineConfig` tree (the one place it is built).

Used by `rapidserve.LLM`, the CLI, the server and `rapidserve profile`. Layer: above the loader and
the runner (whose device and dtype rules it applies), below `rapidserve.partition` and everything
that starts an engine. The half that needs no model (the settings' sections and their checks, torch-free, which
`rapidserve serve` runs before it binds its port) is `engine_settings.py`, whose functions are re-exported here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping, Sequence

import torch

from rapidserve.batch_limits import (
    Device,
    config_seats,
    default_max_num_batched_tokens,
    default_max_num_seqs,
    why_default,
)
from rapidserve.cache_config import GPU_MEMORY_UTILIZATION
from rapidserve.config import (
    ALLOW_LONG_MAX_MODEL_LEN_ENV,
    LOAD_FORMATS,
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
)
from rapidserve.config_base import ConfigError
from rapidserve.engine_settings import (  # re-exported: the model-free half of the builder
    allow_long_max_model_len,
    check_unsupported_options,
    engine_sections,
    generation_defaults,
    kv_events_section,
    read_generation_config,
)
from rapidserve.generation_config import GENERATION_CONFIG_FILE, SamplingDefaults
from rapidserve.kv_events import make_none_hash
from rapidserve.kv_events_config import KVEventsConfig
from rapidserve.launch_config import LaunchConfig
from rapidserve.loader import ModelSource, local_model_spec, resolve_model
from rapidserve.loader.hub import DUMMY_PREFIX, find_snapshot, hub_cache_dirs, is_repo_id
from rapidserve.ops.fp8 import check_fp8_weights_device
from rapidserve.parallel.shard import block_shard_problem
from rapidserve.partition_config import PartitionConfig
from rapidserve.policy_spec import RUN_SPECS, check_without_partition, given_settings
from rapidserve.quant_config import ONLINE_FP8, QuantizationConfig

__all__ = ["allow_long_max_model_len", "build_engine_config", "check_unsupported_options", "load_format_spec",
           "resolve_kv_cache", "resolve_kv_events", "resolve_quantization"]
log = logging.getLogger("rapidserve.config")


def load_format_spec(model: str | None, load_format: str) -> str | None:
    """The model spec that reads `model` in `load_format` (LOAD_FORMATS); ConfigError when they do not fit."""
    if load_format not in LOAD_FORMATS:
        raise ConfigError(f"--load-format {load_format}: rapidserve reads {', '.join(LOAD_FORMATS)}")
    spec = model or "default"
    gguf = spec == "default" or spec.endswith(".gguf")
    if load_format == "auto" or (load_format == "dummy" and spec.startswith(("preset:", DUMMY_PREFIX))):
        return model
    if spec.startswith("preset:"):
        raise ConfigError(f"--load-format {load_format}: {spec} is a preset (random weights); drop the flag")
    if load_format == "dummy":
        if gguf:
            raise ConfigError(f"--load-format dummy takes a Hugging Face folder or Hub id (its config.json gives the "
                              f"shapes); {'the embedded default model' if spec == 'default' else spec} is a GGUF "
                              "file: give --model FOLDER, or a preset:NAME")
        return DUMMY_PREFIX + spec
    if (load_format == "gguf") != gguf:
        raise ConfigError(f"--load-format {load_format}: {spec} is {'a GGUF file' if gguf else 'not a .gguf file'}; "
                          "use --load-format auto")
    return model


def resolve_kv_events(value: object, *, enable_prefix_caching: bool, hash_seed: str | None) -> KVEventsConfig:
    """--kv-events-config as the tree's section (checked: `engine_settings.kv_events_section`) with, when it
    publishes, the seed of the first block's hash fixed here, once: from `hash_seed` ($PYTHONHASHSEED, read where
    the run starts) or at random, as vLLM's NONE_HASH (rapidserve/kv_events.py)."""
    cfg = kv_events_section(value, enable_prefix_caching=enable_prefix_caching)
    if not cfg.publishing:
        return cfg
    if hash_seed is None:
        log.warning("KV events: PYTHONHASHSEED is not set, so block hashes start from a random seed: a router can "
                    "learn them from the events but cannot hash a prompt to the same values (set PYTHONHASHSEED "
                    "alike on every replica and the router, as with vLLM)")
    return dataclasses.replace(cfg, none_hash=make_none_hash(hash_seed))


def resolve_quantization(flag: str | None, source: ModelSource, model: str | None,
                         parallel: ParallelConfig, device: torch.device | None = None) -> QuantizationConfig:
    """The tree's quantization section from `--quantization` (`flag`: "fp8" or None, checked by
    `engine_settings.check_unsupported_options`) and the resolved model: an FP8 checkpoint's own scheme (with
    fp8 or no flag), `quant_config.ONLINE_FP8` for --quantization fp8 on a float checkpoint or preset, else none.
    ConfigError for --quantization fp8 on a GGUF file (quantized already: vLLM refuses the mix too), for block
    scales that the tensor-parallel size would cut inside a block, and for fp8 weights on a GPU `device` without fp8
    (`check_fp8_weights_device`), before any weight is read."""
    if source.quantization is not None:
        quant = source.quantization
    elif flag == "fp8":
        spec = model or "default"
        if spec == "default" or spec.endswith(".gguf"):
            what = "the embedded default model" if spec == "default" else spec
            raise ConfigError(f"--quantization fp8 quantizes a float checkpoint at load, and {what} is a GGUF file "
                              "(quantized already, dequantized on load): drop the flag, or give the model's bf16 "
                              "Hugging Face checkpoint")
        if source.config.moe is not None:
            raise ConfigError(f"--quantization fp8 is not supported for mixture-of-experts models yet "
                              f"({source.config.arch}): drop the flag to serve it in bf16")
        quant = ONLINE_FP8
    else:
        return QuantizationConfig()
    tp = parallel.tensor_parallel_size
    if quant.block is not None and tp > 1 and (problem := block_shard_problem(source.config, tp, quant.block)):
        raise ConfigError(f"--tensor-parallel-size {tp}: {problem}")
    if device is not None:
        check_fp8_weights_device(device, quant.enabled, quant.describe(), source.quantization is not None)
    return quant



def device_facts(dev: torch.device) -> Device:
    """What the batch defaults read of `dev` (batch_limits.Device): a GPU's (CUDA or ROCm) name and total memory from
    torch.cuda.get_device_properties; the CPU's type alone."""
    if dev.type != "cuda":
        return Device(dev.type, 0, dev.type)
    props = torch.cuda.get_device_properties(dev)
    return Device("cuda", int(props.total_memory), str(props.name))


def resolve_batch_limits(scheduler: SchedulerConfig, max_num_seqs: int | None, max_num_batched_tokens: int | None,
                         run: str, device: Callable[[], Device]) -> tuple[SchedulerConfig, str]:
    """(the tree's scheduler section with `max_num_seqs` and `max_num_batched_tokens` as given or, each one None,
    its default on `device()` for `run` (batch_limits: vLLM's rule), why max_num_seqs is what it is). `device` is
    read only when a default is needed."""
    if max_num_seqs is not None and max_num_batched_tokens is not None:
        return dataclasses.replace(scheduler, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens), "as given"
    dev = device()
    seqs = default_max_num_seqs(dev) if max_num_seqs is None else max_num_seqs
    tokens = default_max_num_batched_tokens(dev, run) if max_num_batched_tokens is None else max_num_batched_tokens
    return (dataclasses.replace(scheduler, max_num_seqs=seqs, max_num_batched_tokens=tokens),
            "as given" if max_num_seqs is not None else why_default(dev))


def describe_batch_limits(cfg: EngineConfig, why_seqs: str) -> str:
    """The start-up log's line: max_num_seqs and why, the seats it gives where the largest decode graph or the token
    budget caps it, and the token budget."""
    sc = cfg.scheduler
    n = config_seats(cfg)
    capped = f" (at most {n} run at once: the largest decode graph batch or the token budget)" if n < sc.max_num_seqs \
        else ""
    return f"max_num_seqs {sc.max_num_seqs}: {why_seqs}{capped}; max_num_batched_tokens {sc.max_num_batched_tokens}"


def want_float(dtype: torch.dtype) -> str:
    """A torch float dtype as --dtype / --kv-cache-dtype name it ("bfloat16")."""
    return str(dtype).removeprefix("torch.")


def resolve_kv_cache(flag: str, source: ModelSource, dtype: torch.dtype, device: torch.device,
                     cache: CacheConfig) -> CacheConfig:
    """The tree's cache section with its KV dtype and scales resolved from `--kv-cache-dtype` (`flag`, as
    `engine_settings.check_unsupported_options` normalised it) and the model, as vLLM resolves them:

    - "fp8": float8 e4m3 (ops.fp8.fp8_dtype: e4m3fnuz on ROCm's gfx94x) with the checkpoint's calibrated scales
      (`source.kv_scales`), else 1.0 each (logged once: accuracy may drop; how to calibrate);
    - "auto": fp8 likewise when the checkpoint's config declares a kv_cache_scheme, else the model's dtype;
    - a float dtype ("bfloat16", ...): the model's dtype (`dtype`) unquantized, which it must name.
    ConfigError for a float name that is not the model's dtype, and for fp8 on a GPU that has no fp8
    (`kv_pool.check_fp8_kv_device`: NVIDIA before sm_89, AMD before gfx94x), before any weight is read. The CPU
    stores fp8 and computes in the model's dtype."""
    from rapidserve.kv_pool import check_fp8_kv_device
    from rapidserve.ops.fp8 import fp8_dtype

    if flag not in ("auto", "fp8"):
        want = want_float(dtype)
        if flag != want:
            raise ConfigError(f"--kv-cache-dtype {flag}: the model computes in {want} (--dtype), and an unquantized KV "
                              f"cache is kept in the model's dtype; use --kv-cache-dtype auto (or {want}), fp8, or "
                              f"--dtype {flag}")
        if source.kv_cache_scheme:
            log.info("KV cache: --kv-cache-dtype %s keeps it unquantized; the checkpoint's kv_cache_scheme (fp8) "
                     "is not used", flag)
        return dataclasses.replace(cache, kv_cache_dtype="auto", kv_scales=None)
    if flag == "auto" and not source.kv_cache_scheme:
        if source.kv_scales is not None:
            log.info("KV cache: the checkpoint carries fp8 KV cache scales but declares no kv_cache_scheme; the cache "
                     "stays in %s (--kv-cache-dtype fp8 stores fp8 with these scales)", dtype)
        return dataclasses.replace(cache, kv_cache_dtype="auto", kv_scales=None)
    if flag == "fp8":
        check_fp8_kv_device(device)
    else:
        check_fp8_kv_device(device, "the checkpoint's kv_cache_scheme asks for an fp8 KV cache (--kv-cache-dtype auto)",
                            f"use --kv-cache-dtype {want_float(dtype)} to keep the cache unquantized")
    fmt = fp8_dtype(device)
    if source.kv_scales is not None:
        log.info("KV cache: fp8 (%s)%s, %s", fmt, " from the checkpoint's kv_cache_scheme" if flag == "auto" else "",
                 source.kv_scales.describe())
    else:
        log.warning("KV cache: fp8 (%s) with uncalibrated scales (k_scale = v_scale = 1.0 in every layer): keys and "
                    "values beyond +-%g are clipped and accuracy may drop. Calibrated scales come from a checkpoint "
                    "made with llm-compressor's kv_cache_scheme (QuantizationModifier with kv_cache_scheme "
                    "{'type': 'float', 'num_bits': 8, 'strategy': 'tensor'}), which rapidserve reads", fmt,
                    torch.finfo(fmt).max)
    return dataclasses.replace(cache, kv_cache_dtype="fp8", kv_scales=source.kv_scales)


def build_engine_config(model: str | None = None, *, dtype: str = "auto", device: str = "auto",
                        max_model_len: int | str | None = None,
                        gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
                        block_size: int = 16, num_kv_blocks: int | None = None,
                        kv_cache_memory_bytes: int | None = None,
                        max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                        prefill_batch_tokens: int | None = None,
                        enforce_eager: bool = False, prefill_graph_tokens: Sequence[int] | None = None,
                        seed: int = 0, attention_backend: str = "auto", cache_dir: str | None = None,
                        enable_prefix_caching: bool = True,
                        async_scheduling: bool = True, tokenizer: str | None = None,
                        allow_long_max_model_len: bool = False, quantization: str | None = None,
                        kv_cache_dtype: str | None = "auto", launch: LaunchConfig | None = None,
                        partition: PartitionConfig | None = None, parallel: ParallelConfig | None = None,
                        run: str | None = None, revision: str | None = None,
                        download_dir: str | None = None, load_format: str = "auto",
                        env: Mapping[str, str] | None = None, generation_config: str = "auto",
                        kv_events_config: object = None) -> tuple[EngineConfig, object]:
    """Resolve the model and assemble the frozen config tree (the one place it is built). `prefill_graph_tokens`:
    the piecewise prefill graphs' token buckets (None: RunnerConfig's default; (): none). `tokenizer`:
    a folder of tokenizer files to use instead of the model's (a preset has none). `allow_long_max_model_len`:
    accept a max_model_len above the model's max_position_embeddings (else a ConfigError says how to fix it;
    the CLI and `LLM` take it from $RAPIDSERVE_ALLOW_LONG_MAX_MODEL_LEN). `quantization`, `kv_cache_dtype`: vLLM's;
    what is not served (a method but fp8/None/none/auto; a cache dtype but auto/fp8/fp8_e4m3/a float dtype) is
    refused before the model is looked at (`check_unsupported_options`); the tree's `quantization` section is the
    model's FP8 scheme or --quantization fp8's (`resolve_quantization`), its cache's dtype and scales the flag's
    with the checkpoint's (`resolve_kv_cache`).
    `launch`,
    `partition`, `parallel`: the serving sections (None: their defaults; a partition left out runs the mode's
    default policy). `run`: what will run the tree, "offline" (`LLM`, `rapidserve generate`), "profile"
    (`rapidserve profile`), or None: the server in `launch.mode`. Before the model is resolved, every setting given
    is checked against what that run and its policy read (`policy_spec.check_settings`): one ignored is a
    ConfigError saying how to fix it.

    A Hub id (`Qwen/Qwen3-8B`) that is no local path is looked up in the local Hugging Face cache at
    `revision` (vLLM's --revision; default main), in `download_dir` when given, else the cache that `env`'s
    HF_HUB_CACHE / HF_HOME name (default: os.environ), never downloaded (loader/hub.py); the config then
    names the snapshot folder (a Hub id as `tokenizer` too, at main). `load_format` (LOAD_FORMATS): dummy
    serves the architecture with random weights (`dummy:<folder>`); safetensors and gguf check that the model
    is of that form. `generation_config`: where the sampling defaults come from (auto, vllm or a folder, as vLLM's
    --generation-config; checked with the settings, `engine_settings.generation_defaults`; auto's file is read
    once the model is resolved, `resolve_generation_config`). `kv_events_config`: vLLM's --kv-events-config
    (`resolve_kv_events`, its hash seed `env`'s $PYTHONHASHSEED). `max_num_seqs`, `max_num_batched_tokens`: None
    (not given) resolves by device, as vLLM's defaults (`resolve_batch_limits`, batch_limits.py).
    `kv_cache_memory_bytes`: vLLM's; the KV pool's bytes per GPU as given, instead of the `gpu_memory_utilization`
    share (not with `num_kv_blocks`); on a CPU the pool's bytes (`cpu_kv_space`). `max_model_len` -1 or "auto"
    (vLLM 0.26's): the model's length where the KV pool holds one sequence of it, else what the pool holds
    (`SchedulerConfig.fit_max_model_len`)."""
    from rapidserve.runner import resolve_device, resolve_dtype

    sections = engine_sections(
        dtype=dtype, device=device, max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
        block_size=block_size, num_kv_blocks=num_kv_blocks, kv_cache_memory_bytes=kv_cache_memory_bytes,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, prefill_batch_tokens=prefill_batch_tokens,
        enforce_eager=enforce_eager, prefill_graph_tokens=prefill_graph_tokens, seed=seed,
        attention_backend=attention_backend, enable_prefix_caching=enable_prefix_caching,
        async_scheduling=async_scheduling, allow_long_max_model_len=allow_long_max_model_len,
        quantization=quantization, kv_cache_dtype=kv_cache_dtype, launch=launch, partition=partition, run=run,
        generation_config=generation_config, kv_events_config=kv_events_config)
    env = os.environ if env is None else env
    kv_events = resolve_kv_events(sections.kv_events, enable_prefix_caching=enable_prefix_caching,
                                  hash_seed=env.get("PYTHONHASHSEED"))
    model = local_model_spec(model, revision, download_dir, env)
    if tokenizer is not None and is_repo_id(tokenizer) and not os.path.exists(os.path.expanduser(tokenizer)):
        tokenizer = find_snapshot(tokenizer, None, hub_cache_dirs(env, download_dir))  # its main revision
    model = load_format_spec(model, load_format)
    dev = resolve_device(device)
    source = resolve_model(model, cache_dir=cache_dir, preset_device=dev,
                           preset_dtype=resolve_dtype(dtype, dev))
    if tokenizer is not None:
        source = dataclasses.replace(source, tokenizer_dir=tokenizer, tokenizer_file=None, tokenizer_cache_dir=None)
    mcfg = source.config
    parallel = parallel or ParallelConfig()
    cache = resolve_kv_cache(sections.kv_cache_dtype, source, resolve_dtype(dtype, dev), dev, sections.cache)
    if dev.type == "cpu":
        cache = cpu_kv_space(cache, env)
    run = run or sections.launch.mode
    scheduler, why_seqs = resolve_batch_limits(sections.scheduler, max_num_seqs, max_num_batched_tokens, run,
                                               lambda: device_facts(dev))
    cfg = EngineConfig(model=model or "default", model_config=mcfg, cache=cache,
                       scheduler=scheduler, runner=sections.runner, launch=sections.launch,
                       partition=sections.partition, parallel=parallel, tokenizer=tokenizer,
                       generation=(sections.generation if sections.generation is not None
                                   else resolve_generation_config("auto", source, model)), kv_events=kv_events,
                       quantization=resolve_quantization(sections.quantization, source, model, parallel, dev))
    check_partition_device(run, cfg.partition, dev)
    if dev.type == "cpu" and cfg.runner.prefill_graph_tokens and \
            "runner.prefill_graph_tokens" in given_settings({"runner": cfg.runner}):  # as vLLM's graph sizes on a CPU
        log.warning("--prefill-graph-tokens %s: a CPU runs every forward eager (no CUDA graphs are captured), so the "
                    "buckets change nothing here", ",".join(map(str, cfg.runner.prefill_graph_tokens)))
    if run != "profile":  # (the profile's decode batches are its --batch-buckets)
        log.info("%s", describe_batch_limits(cfg, why_seqs))
    given_len = cfg.scheduler.max_model_len  # None for unset and for auto (fit_max_model_len)
    if given_len is not None and given_len > mcfg.max_position_embeddings:  # allowed, or EngineConfig refused
        log.warning("max_model_len %d is more than the model's max_position_embeddings %d (%s), allowed by "
                    "allow_long_max_model_len ($%s): outputs past position %d may be garbage", given_len,
                    mcfg.max_position_embeddings, mcfg.name, ALLOW_LONG_MAX_MODEL_LEN_ENV, mcfg.max_position_embeddings)
    return cfg, source


CPU_KVCACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # vLLM's: the CPU backend's KV cache, in GiB


def cpu_kv_space(cache: CacheConfig, env: Mapping[str, str]) -> CacheConfig:
    """The KV pool of a CPU run, as vLLM's CPU backend sizes it: `VLLM_CPU_KVCACHE_SPACE` GiB where set (a positive
    number, else a ConfigError naming it; as in vLLM's CPU platform it replaces --kv-cache-memory-bytes too, said in
    the log), else `--kv-cache-memory-bytes`, else `cpu_kv_bytes` (512 MiB): put in `cpu_kv_bytes`;
    `--num-kv-blocks` still wins (CacheConfig refuses it beside --kv-cache-memory-bytes). A CPU has no free device
    memory to take a share of, so `--gpu-memory-utilization` given there changes nothing: said in the log, with what
    sizes the pool instead."""
    text = env.get(CPU_KVCACHE_SPACE_ENV, "").strip()
    given = cache.kv_cache_memory_bytes
    source = "512 MiB, the CPU default"
    if given is not None:
        cache, source = dataclasses.replace(cache, cpu_kv_bytes=given), f"--kv-cache-memory-bytes {given}"
    if text:
        try:
            gib = float(text)
        except ValueError:
            gib = float("nan")
        if not 0 < gib < float("inf"):
            raise ConfigError(f"{CPU_KVCACHE_SPACE_ENV}={text!r}: the CPU KV cache's size in GiB must be a positive "
                              "number (e.g. 4), or unset (512 MiB)")
        cache = dataclasses.replace(cache, cpu_kv_bytes=int(gib * 2**30), kv_cache_memory_bytes=None)
        if given is not None:
            log.warning("--kv-cache-memory-bytes %d: replaced by $%s=%s, as vLLM's CPU backend replaces it", given,
                        CPU_KVCACHE_SPACE_ENV, text)
        source = f"${CPU_KVCACHE_SPACE_ENV} GiB"
    if cache.gpu_memory_utilization != CacheConfig().gpu_memory_utilization and cache.num_blocks is None:
        log.warning("--gpu-memory-utilization %g: not read on a CPU (no device memory to take a share of); the KV pool "
                    "takes %.2f GiB (%s), or size it with --num-kv-blocks or --kv-cache-memory-bytes",
                    cache.gpu_memory_utilization, cache.cpu_kv_bytes / 2**30, source)
    return cache


def check_partition_device(run: str, partition: PartitionConfig, dev: torch.device) -> None:
    """Before any worker starts, where the device can have no partition (a CPU, or --partition-backend none):
    `policy_spec.check_without_partition` (a static split, or the settings only an adaptive partition reads, refused
    in one line). A GPU without a backend is only known at the plan (partition/plan.py `_resolve_plan`, which
    runs the same check)."""
    r = RUN_SPECS.get(run)
    if r is None or not r.workers or r.partition is not None:  # no workers, or a run that fixes its partition
        return
    if dev.type != "cpu" and partition.backend != "none":
        return
    check_without_partition(partition, "--partition-backend none" if partition.backend == "none"
                            else f"no partition backend on {dev}")


def resolve_generation_config(spec: str, source: ModelSource, model: str | None) -> SamplingDefaults:
    """The sampling defaults of `--generation-config spec`, as vLLM resolves it: "auto" reads the model
    folder's generation_config.json (none for a folder without one, a GGUF file or a preset; `dummy:<folder>`
    reads its folder's), "vllm" reads nothing, a folder reads its file (which must exist: the model-free part,
    `engine_settings.generation_defaults`). A file that is not a JSON object, or holds a bad value, is a
    ConfigError naming it."""
    given = generation_defaults(spec)
    if given is not None:
        return given
    if source.hf_folder is None:
        kind = "a preset" if (model or "").startswith("preset:") else "a GGUF file"
        return SamplingDefaults(source=f"{kind} has no {GENERATION_CONFIG_FILE}")
    path = os.path.join(source.hf_folder, GENERATION_CONFIG_FILE)
    if not os.path.isfile(path):
        return SamplingDefaults(source=f"the model folder has no {GENERATION_CONFIG_FILE}")
    return read_generation_config(path, f"the model's {GENERATION_CONFIG_FILE} ({path})")
