"""The paged KV pool: one allocation for every layer's keys and values.

Layout (one contiguous tensor, allocated once at start-up):

    pool[num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]
          layer      K|V  block     head          token       channel

so `pool[l, 0]` and `pool[l, 1]` are layer l's k_cache / v_cache views of shape
[num_blocks, num_kv_heads, block_size, head_dim], and one (block, head) tile is
block_size * head_dim contiguous elements, read whole by the attention kernels.

Element type (`kv_cache_dtype`): the model's dtype, or with `--kv-cache-dtype fp8` float8_e4m3fn (float8_e4m3fnuz on
ROCm's gfx94x: `ops.fp8.fp8_dtype`), one byte an element: a block takes half the bytes of bf16 (a quarter of
fp32), so the same memory holds twice the tokens (`num_blocks_for_budget` divides by `KVPoolSpec.bytes_per_block`,
which counts the element size). The values are stored as fp8(x / scale) with each layer's k_scale / v_scale, which
the layers hold, not the pool (rapidserve/ops/kv_quant.py). The dtype is the pool tensor's own, so it travels
with it: the prefill worker's attached pool (runner/model_sharing.py) and disagg's remote one
(parallel/kv_connector.py) are checked against the dtype their own config gives.

Why one plain allocation: two processes use the pool in place (the decode worker owns it, the
prefill worker attaches by IPC handle), and IPC needs a plain device allocation. PyTorch's
`expandable_segments` allocator mode gives memory that CUDA/HIP IPC cannot export, so it is refused.

Block ownership is not recorded here: the decode worker's BlockManager decides which blocks belong
to which sequence; this module only holds the memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from rapidserve.config import CacheConfig, ModelConfig
from rapidserve.config_base import ConfigError
from rapidserve.ops.fp8 import FP8_NEEDS, fp8_device_problem, fp8_dtype


@dataclass(frozen=True)
class KVPoolSpec:
    num_layers: int
    num_blocks: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_blocks, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.block_size * self.head_dim * elem

    @property
    def nbytes(self) -> int:
        return self.bytes_per_block * self.num_blocks


def check_ipc_shareable_allocator(device: torch.device) -> None:
    """Refuse expandable segments, whose memory cannot be exported by IPC handle."""
    if device.type != "cuda":
        return
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        conf = os.environ.get(var, "")
        if "expandable_segments:true" in conf.replace(" ", "").lower():
            raise ConfigError(
                f"{var}={conf!r} enables expandable segments, whose memory cannot be shared by IPC "
                "handle between the prefill and decode workers; unset it or set expandable_segments:False"
            )


def check_fp8_kv_device(device: torch.device, what: str = "--kv-cache-dtype fp8",
                        fix: str = "use --kv-cache-dtype auto, which keeps the cache in the model's dtype") -> None:
    """ConfigError, before anything loads, when `device` is a GPU without fp8 (ops.fp8.fp8_supported: NVIDIA before
    sm_89, AMD before gfx94x): an fp8 KV cache needs its conversions. A CPU stores fp8 as it is (its attention
    dequantizes in torch)."""
    has = fp8_device_problem(device)
    if has is not None:
        raise ConfigError(f"{what}: {has}, and an fp8 KV cache needs {FP8_NEEDS}; {fix}")


def kv_cache_dtype(cache: CacheConfig, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The pool's element type (module docstring): the model's `dtype`, or the device's fp8 format for an fp8 cache
    (ConfigError on a GPU without fp8, `check_fp8_kv_device`)."""
    if not cache.fp8_kv:
        return dtype
    check_fp8_kv_device(device)
    return fp8_dtype(device)


# What gave a pool its byte budget (`num_blocks_for_budget`'s `sized_by`), which its error's remedy names
SHARE = "share"  # the --gpu-memory-utilization share of a GPU (runner/kv_budget.py)
CPU = "cpu"  # a CPU's fixed bytes: $VLLM_CPU_KVCACHE_SPACE, else 512 MiB (config_builder.cpu_kv_space)
GIVEN = "given"  # --kv-cache-memory-bytes, on a GPU or a CPU


def num_blocks_for_budget(budget_bytes: int, bytes_per_block: int, block_size: int, min_tokens: int,
                          sized_by: str = SHARE) -> int:
    """Blocks that fit in `budget_bytes`; a ConfigError if fewer than one sequence of `min_tokens` needs, whose
    remedy fits what sized the budget (`sized_by`: SHARE, CPU, GIVEN; a fixed budget's says what --max-model-len it
    allows)."""
    n = max(0, budget_bytes // bytes_per_block)
    need = -(-min_tokens // block_size)
    if n >= need:
        return n
    holds = n * block_size
    got = f"the KV cache gets {n} blocks ({budget_bytes / 2**30:.2f} GiB) but one sequence of {min_tokens} tokens " \
          f"needs {need}"
    if sized_by == GIVEN:
        raise ConfigError(f"--kv-cache-memory-bytes {budget_bytes}: {got} ({need * bytes_per_block} bytes); give at "
                          f"least that, or use --max-model-len <= {holds} (what it holds)")
    if sized_by == CPU:
        raise ConfigError(f"{got}; use --max-model-len <= {holds} (what the CPU pool holds), or size the pool with "
                          "--kv-cache-memory-bytes or --num-kv-blocks")
    raise ConfigError(f"{got}; raise --gpu-memory-utilization, lower --max-model-len, or use a GPU with more memory")


class KVPool:
    """Owns (or, in an attached process, wraps) the pool tensor and hands out per-layer views."""

    def __init__(self, tensor: torch.Tensor, block_size: int) -> None:
        if tensor.dim() != 6 or tensor.shape[1] != 2 or tensor.shape[4] != block_size:
            raise ValueError(f"KV pool tensor has shape {tuple(tensor.shape)}, expected [L, 2, N, H, {block_size}, D]")
        if not tensor.is_contiguous():
            raise ValueError("KV pool tensor must be contiguous")
        self.tensor = tensor
        self.block_size = block_size
        self.layers = [(tensor[i, 0], tensor[i, 1]) for i in range(tensor.shape[0])]

    @classmethod
    def allocate(cls, spec: KVPoolSpec, device: torch.device) -> KVPool:
        check_ipc_shareable_allocator(device)
        tensor = torch.zeros(spec.shape, dtype=spec.dtype, device=device)
        return cls(tensor, spec.block_size)

    @property
    def num_blocks(self) -> int:
        return int(self.tensor.shape[2])

    @property
    def spec(self) -> KVPoolSpec:
        t = self.tensor
        return KVPoolSpec(t.shape[0], t.shape[2], t.shape[3], t.shape[4], t.shape[5], t.dtype)


def pool_spec(model: ModelConfig, cache: CacheConfig, dtype: torch.dtype, num_blocks: int) -> KVPoolSpec:
    return KVPoolSpec(model.num_layers, num_blocks, model.num_kv_heads, cache.block_size, model.head_dim, dtype)
