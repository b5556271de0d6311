"""Zero-copy sharing of the weights and the paged KV pool between the decode and prefill workers.

The decode worker builds the model, loads the weights and allocates the KV pool; the prefill worker
(a "spawn" process) must compute with THE SAME memory, in place. The decode worker calls
`export_shared(model, pool)` and sends the returned `SharedState` ONCE, at start-up, through a
one-way multiprocessing pipe between the two processes the router spawned (engine/launch.py), the
only place rapidserve pickles anything (messages on the rings are msgpack of declared types).
multiprocessing's pickler, with torch's reductions, turns every tensor into a handle, never a copy
of its data:

- CUDA / ROCm: a CUDA/HIP IPC handle of the allocation holding the tensor. The producer must keep
  the tensors alive (and stay alive) as long as any consumer uses them.
- CPU: a POSIX shared-memory segment. `export_shared` moves each parameter's storage and the pool
  into shared memory in place (`share_memory_()`: the same tensors, views and all, now live there).
  With torch's default "file_descriptor" strategy each storage travels as a file descriptor that
  the producer hands out from a helper thread: it must stay alive until the consumer has unpickled.

The prefill worker calls `attach_model(...)`: it builds a CausalLM on the meta device (no parameter
memory), wraps each shared tensor in a Parameter, recomputes the RoPE table (a plain buffer, cheap)
on the real device and wraps the pool tensor in a KVPool. Every tensor is checked against the model
being built (name, shape, dtype, device; on CPU, that it really is in shared memory).

Layer: above the model, the ops and the KV pool; in `rapidserve.runner`, below `model_runner` (`ModelRunner`
attaches with it), and below `rapidserve.engine` (whose decode worker exports with it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from rapidserve.attention import AttentionBackend
from rapidserve.config import ModelConfig
from rapidserve.kv_pool import KVPool, check_ipc_shareable_allocator
from rapidserve.models.registry import causal_lm_class
from rapidserve.models.rope import cos_sin_table
from rapidserve.models.transformer import CausalLM, WeightError
from rapidserve.ops import Ops
from rapidserve.ops.fp8 import fp8_dtype
from rapidserve.quant_config import QuantizationConfig

if TYPE_CHECKING:
    from rapidserve.parallel.group import TPGroup


class SharedStateError(WeightError):
    """A shared tensor does not fit the model being attached; the message names the tensor."""


@dataclass(frozen=True)
class SharedState:
    """What the decode worker sends the prefill worker once: handles to its tensors, never copies."""

    params: dict[str, torch.Tensor]  # CausalLM.named_parameters() names (no lm_head when tied)
    kv: torch.Tensor  # the pool, [num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim], its dtype with it
    block_size: int


def export_shared(model: CausalLM, pool: KVPool) -> SharedState:
    """Move the weights and the KV pool into shared memory in place (CPU) and describe them.

    On CUDA/ROCm nothing moves: the hand-off pipe's pickler exports IPC handles. Keep `model` and `pool`
    (or the returned state) alive for as long as the other process uses them.

    Stream ordering: the device is synchronized first, so every write to the weights and the pool
    (loading, zero-fill, graph warm-ups on side streams, which their callers join into the current
    stream) has landed before a handle exists. The importer computes on its own partition stream,
    which nothing orders after this process's streams (torch's IPC event covers only the exporter's
    current stream, and the importer waits on it on its own current stream, not on its partition's).
    """
    check_ipc_shareable_allocator(pool.tensor.device)
    if pool.tensor.device.type == "cuda":
        torch.cuda.synchronize(pool.tensor.device)
    params: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.device != pool.tensor.device:
            raise SharedStateError(f"parameter {name!r} is on {p.device} but the KV pool is on "
                                   f"{pool.tensor.device}; load the weights before exporting")
        if p.device.type == "cpu":
            p.share_memory_()
        params[name] = p.detach()  # same storage; a plain tensor pickles more simply than a Parameter
    if pool.tensor.device.type == "cpu":
        pool.tensor.share_memory_()  # the per-layer views share the storage, so they follow
    return SharedState(params, pool.tensor, pool.block_size)


def _same_device(actual: torch.device, want: torch.device) -> bool:
    if actual.type != want.type:
        return False
    if want.type == "cuda":
        index = want.index if want.index is not None else torch.cuda.current_device()
        return actual.index == index
    return True


def _check(what: str, t: object, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise SharedStateError(f"{what} is a {type(t).__name__}, not a tensor")
    if tuple(t.shape) != shape:
        raise SharedStateError(f"{what} has shape {tuple(t.shape)}, expected {shape}: the shared state was "
                               "exported from a model with a different configuration")
    if t.dtype != dtype:
        raise SharedStateError(f"{what} has dtype {t.dtype}, expected {dtype}: the shared state was exported from "
                               "a model with a different configuration (--dtype, --quantization, --kv-cache-dtype)")
    if not _same_device(t.device, device):
        raise SharedStateError(f"{what} is on {t.device}, expected {device} (is the same GPU visible to "
                               "both processes, under the same index?)")
    if t.device.type == "cpu" and not t.is_shared():
        raise SharedStateError(f"{what} is not in shared memory, so this process got a copy: create the "
                               "state with export_shared() and send it through a torch.multiprocessing Queue")


def attach_model(cfg: ModelConfig, ops: Ops, attn: AttentionBackend, dtype: torch.dtype,
                 device: torch.device, max_positions: int | None,
                 shared: SharedState, tp: TPGroup | None = None,
                 quant: QuantizationConfig | None = None, kv_dtype: torch.dtype | None = None,
                 kv_scales: Sequence[tuple[float, float]] | None = None) -> tuple[CausalLM, KVPool]:
    """A CausalLM and a KVPool over the exporter's memory: no parameter or KV memory of their own.

    `cfg`, `dtype`, `max_positions`, `quant` (the fp8 scheme: its weights, scales and input scales are
    parameters like any other, in the device's fp8 format) and `kv_dtype` / `kv_scales` (an fp8 KV pool: its
    dtype, checked against the shared pool's, and the layers' k_scale / v_scale, parameters too) must be those the
    exporter's model was built with; the outputs are then the exporter's, bit for bit on the same device and
    kernels.
    """
    device = torch.device(device)
    meta = torch.device("meta")
    model = causal_lm_class(cfg)(cfg, ops, attn, dtype, meta, max_positions=max_positions, tp=tp, quant=quant,
                                 fp8=fp8_dtype(device), kv_dtype=kv_dtype, kv_scales=kv_scales)
    cfg = model.cfg  # this rank's shard under tensor parallelism (its KV heads size the pool)
    expected = dict(model.named_parameters(remove_duplicate=False))
    missing = sorted(set(expected) - set(shared.params))
    unexpected = sorted(set(shared.params) - set(expected))
    if missing or unexpected:
        kv = any(n.endswith(("k_scale", "v_scale")) for n in (*missing, *unexpected))
        raise SharedStateError(f"the shared weights do not match a {cfg.arch} model with this configuration: "
                               f"missing {missing}, unexpected {unexpected}"
                               + ("; the exporter's KV cache is fp8 and this one's is not, or the reverse "
                                  "(--kv-cache-dtype)" if kv else ""))
    for name, placeholder in expected.items():
        t = shared.params[name]
        _check(f"parameter {name!r}", t, tuple(placeholder.shape), placeholder.dtype, device)
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        setattr(owner, leaf, nn.Parameter(t, requires_grad=False))
    model.device = device
    # The RoPE table is computed, not loaded: each process builds its own (same length as the meta one).
    model.cos_sin = cos_sin_table(cfg, int(model.cos_sin.shape[-2]), device)  # [positions, D] (Gemma 3: [2, ...])
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.device.type == "meta"]
    if left:
        raise SharedStateError(f"attach_model does not know how to rebuild {left} of CausalLM on {device}")
    return model, _attach_pool(cfg, kv_dtype or dtype, device, shared)


def _attach_pool(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, shared: SharedState) -> KVPool:
    """The shared pool, checked: its shape, and its dtype `dtype` (the model's, or the fp8 the config asks for:
    a pool exported by a worker of another --kv-cache-dtype is refused by name)."""
    kv = shared.kv
    if not isinstance(kv, torch.Tensor) or kv.dim() != 6:
        got = tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__
        raise SharedStateError(f"the KV pool is {got}, expected a 6-D tensor")
    shape = (cfg.num_layers, 2, int(kv.shape[2]), cfg.num_kv_heads, shared.block_size, cfg.head_dim)
    _check("the KV pool", kv, shape, dtype, device)
    if not kv.is_contiguous():
        raise SharedStateError("the KV pool is not contiguous")
    return KVPool(kv, shared.block_size)


def shared_bytes(state: SharedState) -> int:
    """Bytes of memory the state refers to, each storage counted once (for memory figures)."""
    sizes: dict[tuple[str, int], int] = {}
    for t in (*state.params.values(), state.kv):
        storage = t.untyped_storage()
        sizes[(str(t.device), storage.data_ptr())] = storage.nbytes()
    return sum(sizes.values())
