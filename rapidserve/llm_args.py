"""vLLM 0.26's `LLM(...)` keyword arguments (its own and EngineArgs', which it forwards) on `rapidserve.LLM`.

`resolve` sorts what `LLM(**kwargs)` is given. Each of vLLM's arguments is one of:
- honoured: `HONOURED` (build_engine_config's argument of that name, or the one it renames to; None: rapidserve's
  default, as None is vLLM's "not set"), and `chat_template` and `use_tqdm_on_load`, which `LLM` reads itself;
- accepted where it asks for nothing: None, or vLLM's default (`vllm_default`: `VLLM_DEFAULTS`, a config object's
  as None or {}), or a value that asks for what rapidserve's LLM does anyway: `OFFLINE` (the values for the LLM's
  own cases: one process, offline), else `vllm_serve_flags.NO_OP`, read by the argument's flag (`--name-in-dashes`;
  a bool is its flag or the flag's `--no-` form);
- refused by name (`LLMArgumentError`, a ValueError) with why: OFFLINE's reason, else the flag's
  (vllm_serve_flags.REFUSED, the reason `rapidserve serve` gives for the same flag).
Of build_engine_config's own, the serving sections the offline run never reads are refused by name when given other
than their defaults (`serving_section_refusal`: `launch`, `parallel`, `partition`'s policy).
An argument that is neither vLLM's nor build_engine_config's is a TypeError naming it, as Python's own would be.
The audit that every vLLM 0.26 argument is one of these: tests/test_vllm_python_surface.py.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from rapidserve.config import DTYPE_ALIASES, ParallelConfig
from rapidserve.launch_config import LaunchConfig
from rapidserve.partition_config import PartitionConfig
from rapidserve.redaction import REDACTED, is_secret_name, redact_mapping, redact_text
from rapidserve.vllm_reasons import WHY
from rapidserve.vllm_serve_flags import ANY, NO_OP, REFUSED, SWITCH


class LLMArgumentError(ValueError):
    """A vLLM argument of `LLM(...)` that asks for what rapidserve does not do; the message names it and says why."""


# vLLM's name -> build_engine_config's
HONOURED: MappingProxyType[str, str] = MappingProxyType({name: name for name in (
    "model", "dtype", "tokenizer", "revision", "download_dir", "load_format", "quantization", "kv_cache_dtype",
    "max_model_len", "gpu_memory_utilization", "block_size", "max_num_seqs", "max_num_batched_tokens",
    "enforce_eager", "seed", "attention_backend", "enable_prefix_caching", "async_scheduling", "generation_config",
    "kv_events_config", "kv_cache_memory_bytes")} | {"num_gpu_blocks_override": "num_kv_blocks"})
LLM_OWN = ("chat_template", "use_tqdm_on_load")  # honoured by LLM itself: its chat default, its progress bars
_ONE_DEVICE = "rapidserve's LLM runs the model in this process, on one device"
_TEXT = REFUSED["--limit-mm-per-prompt"]
# name -> (the values besides None and vLLM's default that ask for nothing, or ANY; why any other is refused)
OFFLINE: MappingProxyType[str, tuple[tuple[Any, ...] | None, str]] = MappingProxyType({
    "tensor_parallel_size": ((1,), f"{_ONE_DEVICE}: `rapidserve serve -tp N` shards it over N GPUs"),
    "data_parallel_size": ((1,), f"{_ONE_DEVICE} (vLLM's LLM refuses more than 1 too): `rapidserve serve -dp N` runs "
                                 "N engines"),
    "disable_custom_all_reduce": (ANY, f"{_ONE_DEVICE}: there is no all-reduce"),
    "served_model_name": (ANY, "LLM's outputs name no model"),
    "reasoning_parser": (("",), "LLM returns the text as generated; `rapidserve serve --reasoning-parser` separates "
                                "the reasoning of chat answers"),
    "trust_remote_code": (ANY, "rapidserve never runs code from a model repository (its model code is its own)"),
    "disable_log_stats": (ANY, "rapidserve's LLM logs no periodic stats and keeps no per-request metrics"),
    "enable_chunked_prefill": ((True,), "rapidserve always chunks prompts longer than max_num_batched_tokens"),
    "scheduling_policy": (("fcfs",), WHY["priority"]),
    "tokenizer_mode": (("hf",), "rapidserve uses the model's Hugging Face tokenizer"),
    "shutdown_timeout": (ANY, "LLM has no server to drain"),
    "model_weights": ((), "the weights are read from `model` (a folder, a .gguf file) as they are"),
    "enable_mm_processor_stats": ((), _TEXT),
    "mamba_config": ((), REFUSED["--mamba-backend"]),
    "compilation_config": ((0,), REFUSED["--compilation-config"]),  # 0: vLLM's mode NONE, no compilation
})
# vLLM 0.26's default of each argument not honoured (LLM.__init__'s where it has one other than None, else
# EngineArgs'), by value; a config object's (made by its class) is {}, one that is no literal None (only None is its
# "not set" then)
_BY_DEFAULT: tuple[tuple[Any, str], ...] = (
    (None, "served_model_name hf_config_path allowed_media_domains safetensors_load_strategy "
           "safetensors_prefetch_num_threads safetensors_prefetch_block_size cudagraph_capture_sizes "
           "max_cudagraph_capture_size distributed_executor_backend distributed_timeout_seconds "
           "cpu_distributed_timeout_seconds numa_bind_nodes numa_bind_cpus device_ids data_parallel_rank "
           "data_parallel_start_rank data_parallel_size_local data_parallel_address data_parallel_rpc_port "
           "disable_nccl_for_dp_synchronization max_parallel_loading_workers max_num_scheduled_tokens "
           "code_revision hf_token tokenizer_revision quantization_config mm_processor_kwargs "
           "mm_encoder_attn_backend mm_encoder_attn_dtype mm_encoder_fp8_scale_path mm_encoder_fp8_scale_save_path "
           "io_processor_plugin video_pruning_rate default_mm_loras max_cpu_loras lora_target_modules "
           "enable_chunked_prefill disable_hybrid_kv_cache_manager reasoning_parser_plugin speculative_config "
           "spec_method spec_model spec_tokens diffusion_config show_hidden_metrics_for_version otlp_traces_endpoint "
           "collect_detailed_traces scheduler_cls pooler_config enable_flashinfer_autotune enable_bf16x3_router_gemm "
           "kv_transfer_config ec_transfer_config reasoning_config override_attention_dtype mamba_block_size "
           "prefix_match_unit mamba_backend logits_processors optimization_level kv_offloading_size "
           "weight_transfer_config gdn_prefill_backend ignore_patterns"),
    (False, "enable_return_routed_experts skip_tokenizer_init enable_prompt_embeds trust_remote_code numa_bind "
            "data_parallel_hybrid_lb data_parallel_external_lb data_parallel_multi_port_external_lb "
            "enable_expert_parallel enable_ep_weight_filter enable_elastic_ep enable_dbo enable_eplb "
            "disable_sliding_window use_fp64_gumbel disable_log_stats aggregate_engine_logging "
            "allow_deprecated_quantization disable_custom_all_reduce language_model_only enable_mm_embeds "
            "interleave_mm_strings mm_encoder_only skip_mm_profiling enable_lora fully_sharded_loras "
            "enable_tower_connector_lora specialize_active_lora enable_mixed_moe_lora_format enable_moe_shared_loras "
            "ray_workers_use_nsight disable_chunked_mm_input kv_cache_metrics cudagraph_metrics "
            "enable_layerwise_nvtx_tracing enable_mfu_metrics enable_logging_iteration_details jit_monitor_verbose "
            "enable_mm_processor_stats enable_sleep_mode enable_cumem_allocator calculate_kv_scales "
            "enable_mamba_cache_stochastic_rounding kv_sharing_fast_prefill tokens_only fail_on_environ_validation"),
    ({}, "ir_op_priority eplb_config hf_overrides model_class_overrides limit_mm_per_prompt media_io_kwargs "
         "model_loader_extra_config structured_outputs_config compilation_config attention_config mamba_config "
         "kernel_config profiler_config override_generation_config additional_config"),
    (1, "pipeline_parallel_size nnodes tensor_parallel_size prefill_context_parallel_size "
        "decode_context_parallel_size dcp_kv_cache_interleave_size cp_kv_cache_interleave_size data_parallel_size "
        "offload_num_in_group offload_prefetch_step max_num_partial_prefills max_long_partial_prefills "
        "renderer_num_workers max_loras prefill_schedule_interval stream_interval"),
    ("auto", "runner convert tokenizer_mode config_format moe_backend linear_backend offload_backend lora_dtype "
             "worker_cls model_impl mamba_cache_dtype mamba_ssm_cache_dtype"),
    (0, "node_rank ubatch_size cpu_offload_gb offload_group_size long_prefill_token_threshold mm_ipc_gpu_memory_gb "
        "mamba_cache_philox_rounds shutdown_timeout"),
    ("", "model_weights allowed_local_media_path reasoning_parser worker_extension_cls"),
    ([], "cpu_offload_params offload_params kv_cache_dtype_skip_layers"),
    (True, "disable_cascade_attn scheduler_reserve_full_isl"),
)
VLLM_DEFAULTS: MappingProxyType[str, Any] = MappingProxyType({
    **{name: value for value, names in _BY_DEFAULT for name in names.split()},
    "master_addr": "127.0.0.1", "master_port": 29501, "dcp_comm_backend": "ag_rs", "data_parallel_backend": "mp",
    "all2all_backend": "allgather_reducescatter", "dbo_decode_token_threshold": 32, "dbo_prefill_token_threshold": 512,
    "expert_placement_strategy": "linear", "prefix_caching_hash_algo": "sha256", "max_logprobs": 20,
    "logprobs_mode": "raw_logprobs", "mm_processor_cache_gb": 4, "mm_processor_cache_type": "lru",
    "mm_shm_cache_max_object_size_mb": 128, "mm_encoder_tp_mode": "weights", "mm_encoder_fp8_scale_save_margin": 1.5,
    "mm_tensor_ipc": "direct_rpc", "max_lora_rank": 16, "watermark": 0.0, "kv_cache_metrics_sample": 0.01,
    "jit_monitor_mode": "warn", "scheduling_policy": "fcfs", "mamba_cache_mode": "none", "pt_load_map_location": "cpu",
    "performance_mode": "balanced", "kv_offloading_backend": "native",
})
VLLM_NAMES = frozenset({*HONOURED, *LLM_OWN, *VLLM_DEFAULTS})  # every argument of vLLM 0.26's LLM(...)


def _same(v: Any, default: Any) -> bool:
    """`v` is `default`: equal and of its kind (True is not 1), any empty collection for an empty one, a number
    for an equal number."""
    if isinstance(default, (dict, list)) and not default:
        return isinstance(v, (dict, list, tuple, set, frozenset)) and not v
    if isinstance(v, bool) or isinstance(default, bool):
        return type(v) is type(default) and v == default
    if isinstance(default, (int, float)):
        return isinstance(v, (int, float)) and v == default
    return type(v) is type(default) and v == default


def _allowed(name: str, values: tuple[Any, ...] = ()) -> str:
    shown = [repr(v) for v in (None, VLLM_DEFAULTS.get(name), *values)]
    return " or ".join(dict.fromkeys(shown))


def shown(name: str, v: Any, limit: int = 120) -> str:
    """`v` as an error message shows `LLM(name=v)`: never a credential. A secret-named argument (hf_token) is not
    shown at all; any other is shown with the secrets inside it redacted (a `{"token": ...}` in hf_overrides, an
    S3 key in model_loader_extra_config, `password=...` in a config object's repr), before it is cut to `limit`
    characters (so that no cut leaves part of one)."""
    if is_secret_name(name):
        return repr(v) if isinstance(v, bool) else REDACTED  # hf_token=True is no credential
    text = redact_text(repr(redact_mapping(v)))
    return text if len(text) <= limit else text[:limit] + "...]"


# vLLM's types of the arguments that carry a credential (its EngineArgs/ModelConfig validate them): anything else is
# a TypeError naming the argument, never showing the value
SECRET_TYPES: MappingProxyType[str, tuple[type, ...]] = MappingProxyType({"hf_token": (str, bool)})


def refusal(name: str, v: Any) -> tuple[str, str] | None:
    """(why `LLM(name=v)` is refused, the values accepted), or None when it is accepted (`name`: vLLM's, not one
    of HONOURED or LLM_OWN)."""
    if v is None:
        return None
    if name in OFFLINE:
        values, why = OFFLINE[name]
        if values is ANY or _same(v, VLLM_DEFAULTS.get(name)) or any(_same(v, a) for a in values):
            return None
        return why, _allowed(name, values)
    if _same(v, VLLM_DEFAULTS[name]):
        return None
    flag = "--" + name.replace("_", "-")
    form = flag if v is True else f"--no-{flag[2:]}" if v is False else flag
    if form not in NO_OP and NO_OP.get(flag, ((), ""))[0] is ANY:  # hf_token=False (no token): the flag's any value
        form = flag
    if form in NO_OP:
        values, why = NO_OP[form]
        if values is ANY or (values == SWITCH and isinstance(v, bool)) or (values and str(v) in values):
            return None
        return why, _allowed(name, tuple(int(a) if a.isdigit() else a for a in values))
    return REFUSED.get(form) or REFUSED.get(flag) or "rapidserve does not serve it", _allowed(name)


def resolve(kwargs: Mapping[str, Any], builder_params: Mapping[str, inspect.Parameter]) -> dict[str, Any]:
    """build_engine_config's keywords from `LLM(**kwargs)` (LLM_OWN left out: LLM reads them): vLLM's honoured
    arguments under their builder names (None dropped), rapidserve's own as given, and nothing of the rest, each
    checked first: LLMArgumentError naming the first refused one, TypeError for a name neither knows."""
    out: dict[str, Any] = {}
    for name, v in kwargs.items():
        if name in LLM_OWN:
            continue
        if name in HONOURED:
            if v is not None:
                out[HONOURED[name]] = v
        elif name in VLLM_NAMES:
            types = SECRET_TYPES.get(name)
            if types is not None and v is not None and not isinstance(v, types):
                raise TypeError(f"LLM({name}=...) must be {' or '.join(t.__name__ for t in types)} (vLLM's type) or "
                                f"None, not {type(v).__name__} (the value is not shown: it is a credential)")
            refused = refusal(name, v)
            if refused is not None:
                raise LLMArgumentError(f"LLM({name}={shown(name, v)}) is not supported by rapidserve ({refused[0]}): "
                                       f"leave it out, or give {refused[1]}")
        elif name in builder_params and name != "run":
            refused_section = serving_section_refusal(name, v)
            if refused_section is not None:
                raise LLMArgumentError(refused_section)
            out[name] = v
        else:
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}: it is neither one of vLLM 0.26's "
                            "LLM arguments nor rapidserve's (build_engine_config's)")
    return out


_IN_PROCESS = ("LLM runs the engine in this process, on one device, every step fused: there are no workers to launch, "
               "supervise, trace or split")


def serving_section_refusal(name: str, v: Any) -> str | None:
    """Why `LLM(name=v)` is refused where `name` is one of build_engine_config's serving sections that the offline
    run never reads (`launch`, `parallel`; of `partition`, its `policy`: its other fields policy_spec checks), given
    other than its default; None when it is accepted (any other name, None, or the default)."""
    if v is None:
        return None
    if name == "launch" and v != LaunchConfig():
        return f"LLM(launch={shown(name, v)}) is not supported ({_IN_PROCESS}): leave it out, or use `rapidserve serve`"
    if name == "parallel" and v != ParallelConfig():
        return (f"LLM(parallel={shown(name, v)}) is not supported ({_IN_PROCESS}): leave it out, or use "
                "`rapidserve serve` -tp N / -dp N")
    if name == "partition" and getattr(v, "policy", None) != PartitionConfig().policy:
        return (f"LLM(partition=PartitionConfig(policy={v.policy!r})) is not supported ({_IN_PROCESS}): leave the "
                "policy out, or use `rapidserve serve --policy`")
    return None


def dtype_name(dtype: object) -> object:
    """vLLM's `dtype` as rapidserve names it: its aliases (half, float) and a torch dtype (torch.float16) by name;
    anything else as given (the builder names what it does not serve)."""
    if isinstance(dtype, str):
        return DTYPE_ALIASES.get(dtype, dtype)
    text = str(dtype)
    return text.removeprefix("torch.") if text.startswith("torch.") else dtype
