"""Paged attention backends: a torch reference (any device), Triton kernels (CUDA / ROCm) and
FlashAttention-3 (NVIDIA Hopper, from an installed FA3 build; rapidserve/attention/fa3.py).

Every backend offers the same three functions (layouts in rapidserve/attention/metadata.py):

- ``write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None`` (the decoder layer
  writes its K/V with `ops.rope_write` instead, fused with RoPE: that relies on every backend reading the one
  pool layout of rapidserve/attention/metadata.py, which all three do; a backend with another layout must change
  that)
- ``prefill_attention(q, k_cache, v_cache, meta, scale, k_scale=None, v_scale=None, window=None) -> Tensor
  [T, num_heads, head_dim]``
- ``decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale=None, v_scale=None,
  window=None) -> Tensor [B, num_heads, head_dim]``

and, for an fp8 o projection that takes quantized rows (issue 39), ``decode_attention_fp8(..., *, out_fp8,
window=None) -> ops.fp8.QuantizedRows`` (q [B, num_heads * head_dim] fp8, scale [B, 1]): decode's output quantized
per token, the numbers of the projection's own quantizer (torch: `fp8.quantize_rows` of the output; Triton, FA3's
decode: in the reduce kernel, rapidserve/attention/triton_paged_decode.py). `attend(..., out_fp8=...)` returns it for
a decode step; prefill and mixed steps return the float output, which the projection quantizes itself.

`k_scale` / `v_scale`: an fp8 cache's per-layer scales (float32 [1] device tensors), which every backend applies
as rapidserve/ops/kv_quant.py defines (quantized on write, dequantized on read); None for a cache of the
model's dtype. `window` W (a sliding-window layer: Mistral, Gemma 3's local layers) limits each query to the last
W keys, itself included; every backend here takes it (torch: a mask; Triton: a kernel constant; FA3: its
window_size), over either cache.

`attend` dispatches one layer's attention: decode, prefill, or a mixed step (decode rows first),
split between the two kernels unless the backend's prefill kernel serves one-token rows well.

"auto" picks FA3 on a Hopper GPU where a build is installed, else Triton on a GPU, else torch
(bench/results/attention_kernels.md has the measurements behind that order). Triton and FA3 are
imported only when requested, so CPU installs need neither.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from rapidserve.attention.metadata import (
    AttentionMetadata,
    DecodeAttention,
    DecodeAttentionFp8,
    PrefillAttention,
    Scale,
    WriteKV,
    split_decode_rows,
)
from rapidserve.config import ATTENTION_BACKENDS
from rapidserve.config_base import ConfigError
from rapidserve.ops.fp8 import HalfRows, QuantizedRows
from rapidserve.ops.pdl import bind_pdl, takes_pdl

BACKEND_NAMES: tuple[str, ...] = ATTENTION_BACKENDS


@dataclass(frozen=True)
class AttentionBackend:
    """The attention entry points of one implementation (module docstring; `decode_attention_fp8` None: the o
    projection quantizes decode's output itself).

    ``graph_safe`` says whether write_kv/decode_attention may be captured in a CUDA graph (they
    read no device values on the host). ``one_call_mixed`` says prefill_attention serves a mixed
    step's one-token rows as well as the decode kernel, so `attend` need not split the step.
    ``kv_note``: how it reads the pool's dtype where that differs by backend (FA3 and an fp8 cache), for the log.
    """

    name: str
    write_kv: WriteKV
    prefill_attention: PrefillAttention
    decode_attention: DecodeAttention
    graph_safe: bool = False
    one_call_mixed: bool = False
    kv_note: str = ""  # filled by get_attention_backend for its cache dtype: how this backend reads it
    decode_attention_fp8: DecodeAttentionFp8 | None = None


def _is_gpu(device: torch.device) -> bool:
    # ROCm builds of torch also report their GPUs as "cuda" devices.
    return device.type == "cuda"


def _triton(device: torch.device) -> AttentionBackend:
    if not _is_gpu(device):
        raise ConfigError(f"attention_backend='triton' needs a CUDA or ROCm GPU, but the device is "
                          f"{str(device)!r}; use attention_backend='torch' or 'auto' on CPU")
    try:
        from rapidserve.attention import triton_paged_decode, triton_paged_prefill
        from rapidserve.ops import triton_kv
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ConfigError(f"attention_backend='triton' needs the triton package, which failed to "
                          f"import ({e}); install triton or use attention_backend='torch'") from e
    return AttentionBackend("triton", triton_kv.write_kv, triton_paged_prefill.prefill_attention,
                            triton_paged_decode.decode_attention, graph_safe=True,
                            decode_attention_fp8=triton_paged_decode.decode_attention_fp8)


def _fa3(device: torch.device, kv_dtype: torch.dtype | None) -> AttentionBackend:
    """FA3 for prefill and mixed steps; Triton for decode (as fast or faster, measured) and write_kv
    (the cache layout is unchanged). ImportError if no FA3 build loads on this device."""
    from rapidserve.attention import fa3
    kernel = fa3.find_fa3(device)
    triton = _triton(device)
    impl = fa3.Fa3Attention(kernel, fallback_prefill=triton.prefill_attention)
    note = f"{impl.describe_kv(kv_dtype)}, Triton decode" if kv_dtype is not None else ""
    return AttentionBackend(f"fa3:{kernel.source}", triton.write_kv, impl.prefill_attention,
                            triton.decode_attention, graph_safe=True, one_call_mixed=True, kv_note=note,
                            decode_attention_fp8=triton.decode_attention_fp8)


def get_attention_backend(name: str, device: torch.device | str,
                          kv_dtype: torch.dtype | None = None) -> AttentionBackend:
    """Pick the attention implementation: "auto" (FA3 on Hopper where installed, else Triton on CUDA/ROCm
    GPUs, torch on CPU), "torch", "triton" (GPU only) or "fa3" (Hopper with an FA3 build). Raises
    ConfigError for an unknown name or a backend this device or install cannot run. `kv_dtype`: the KV pool's
    dtype, when known, for the backend's `kv_note` (how it reads an fp8 cache; logged at start)."""
    device = torch.device(device)
    if name not in BACKEND_NAMES:
        raise ConfigError(f"attention_backend={name!r} is not supported; use one of {list(BACKEND_NAMES)}")
    if name == "auto":
        if not _is_gpu(device):
            name = "torch"
        else:
            try:
                return _fa3(device, kv_dtype)
            except ImportError:
                name = "triton"
    if name == "fa3":
        try:
            return _fa3(device, kv_dtype)
        except ImportError as e:
            raise ConfigError(f"attention_backend='fa3': {e}; install FlashAttention-3 (flash_attn_interface "
                              "from flash-attention's hopper/ folder, or vllm==0.24.*) or use "
                              "attention_backend='triton'") from e
    if name == "triton":
        return _triton(device)
    from rapidserve.attention import torch_ref
    from rapidserve.ops import torch_kv
    return AttentionBackend("torch", torch_kv.write_kv, torch_ref.prefill_attention,
                            torch_ref.decode_attention, graph_safe=False,
                            decode_attention_fp8=torch_ref.decode_attention_fp8)


def no_pdl(attn: AttentionBackend) -> AttentionBackend:
    """`attn` with programmatic dependent launch off in its entry points that take `pdl` (the Triton decode kernels:
    rapidserve/ops/pdl.py), named so: tests/test_pdl_gpu.py's eager reference."""
    names = ("write_kv", "prefill_attention", "decode_attention", "decode_attention_fp8")
    fields = {name: bind_pdl(getattr(attn, name), False) for name in names
              if getattr(attn, name) is not None and takes_pdl(getattr(attn, name))}
    return attn if not fields else dataclasses.replace(attn, name=attn.name + "-nopdl", **fields)


def with_pdl(attn: AttentionBackend, pdl: bool) -> AttentionBackend:
    """`attn` with `pdl` bound in its entry points that take it (the Triton decode kernels): how the runner launches
    a step (`ops.pdl_table.pdl_for_step`; rapidserve/ops/pdl.py says where). `attn` itself where none takes it; a
    bound backend's earlier choice is overridden."""
    names = ("write_kv", "prefill_attention", "decode_attention", "decode_attention_fp8")
    fields = {name: bind_pdl(getattr(attn, name), pdl) for name in names
              if getattr(attn, name) is not None and takes_pdl(getattr(attn, name))}
    return attn if not fields else dataclasses.replace(attn, **fields)


def attend(attn: AttentionBackend, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           meta: AttentionMetadata, scale: float, k_scale: Scale = None, v_scale: Scale = None,
           window: int | None = None,
           out_fp8: torch.dtype | None = None) -> torch.Tensor | QuantizedRows | HalfRows:
    """Attention of this step's queries (keys and values already written to the cache; an fp8 cache's scales
    `k_scale` / `v_scale`); `window`: a sliding-window layer's (None: every earlier key). `out_fp8`: the fp8 format
    of an o projection that takes quantized rows, or float16 for a W8A16 one (`fp8.HalfRows`); a decode step then
    returns its output as those rows (`decode_attention_fp8`, where the backend has it; a float output where it writes
    none), any other step the float output.

    A mixed step's leading decode rows use the decode kernel: the prefill kernel would give each of
    them a whole query tile (one useful row of BLOCK_M) and recompute a tile of work per key block."""
    kw = {} if window is None else {"window": window}  # None is every backend's default: left out
    if not meta.is_prefill:
        if out_fp8 is not None and attn.decode_attention_fp8 is not None:
            return attn.decode_attention_fp8(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                             k_scale, v_scale, out_fp8=out_fp8, **kw)
        return attn.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale, k_scale,
                                     v_scale, **kw)
    nd = meta.num_decode_seqs
    if nd == 0 or attn.one_call_mixed:
        return attn.prefill_attention(q, k_cache, v_cache, meta, scale, k_scale, v_scale, **kw)
    decoded = attn.decode_attention(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.context_lens[:nd],
                                    scale, k_scale, v_scale, **kw)
    if meta.prefill_part is None:  # every sequence adds one token
        return decoded
    rest = attn.prefill_attention(q[nd:], k_cache, v_cache, meta.prefill_part, scale, k_scale, v_scale, **kw)
    return torch.cat([decoded, rest])


__all__ = ["BACKEND_NAMES", "AttentionBackend", "AttentionMetadata", "attend", "get_attention_backend", "no_pdl",
           "split_decode_rows", "with_pdl"]
