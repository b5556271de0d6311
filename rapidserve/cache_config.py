"""The KV cache section of the config tree: `CacheConfig` (the paged KV pool: block size, memory share, prefix
caching, the fp8 cache and its scales).

Plain data; `rapidserve.config` re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass

from rapidserve.config_base import check as _check
from rapidserve.quant_config import KV_CACHE_DTYPES, KVScales

GPU_MEMORY_UTILIZATION = 0.92  # --gpu-memory-utilization's default: vLLM 0.26's (its CacheConfig's)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool. `num_blocks=None` sizes it from free device memory (the `gpu_memory_utilization` share),
    or where `kv_cache_memory_bytes` is set takes that many bytes per GPU."""

    block_size: int = 16
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION
    num_blocks: int | None = None
    # On CPU there is no "free device memory": the pool takes this many bytes unless num_blocks is set.
    cpu_kv_bytes: int = 512 * 1024 * 1024
    # vLLM's --kv-cache-memory-bytes: the pool's bytes on each GPU (each tensor-parallel rank's, each disagg side's),
    # as given: no memory profiling, gpu_memory_utilization not read for the pool. On a CPU it is the pool's bytes
    # (config_builder.cpu_kv_space puts it in cpu_kv_bytes). None: sized from the share.
    kv_cache_memory_bytes: int | None = None
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
        _check(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
               f"--kv-cache-memory-bytes {self.kv_cache_memory_bytes} (kv_cache_memory_bytes) must be a positive "
               "number of bytes (e.g. 8G), or unset to size the KV pool from --gpu-memory-utilization")
        _check(self.kv_cache_memory_bytes is None or self.num_blocks is None,
               f"--kv-cache-memory-bytes {self.kv_cache_memory_bytes} and --num-kv-blocks {self.num_blocks} "
               "(LLM's kv_cache_memory_bytes and num_gpu_blocks_override) both fix the KV pool's size: give one of "
               "them")
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

