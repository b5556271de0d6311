"""FlashAttention-3 paged attention (NVIDIA Hopper), from an installed FA3 build.

The kernels are not ours: this module finds a FlashAttention-3 build and calls its paged forward.
Sources, in order:

1. ``flash_attn_interface`` (Dao-AILab/flash-attention's ``hopper/`` package, FA3 proper), through
   its public ``flash_attn_with_kvcache``;
2. vLLM's bundled build (``vllm/vllm_flash_attn/_vllm_fa3_C*.so``, from vllm-project/flash-attention,
   the FA3 that vLLM serves with). The library is loaded by file path, so ``import vllm`` (and its
   process-wide side effects) never runs; its ``fwd`` operator is called with the argument list of
   vLLM 0.24's own wrapper, and the operator's schema is checked against that list at load time.

Layouts. The KV pool stays ours ([num_blocks, num_kv_heads, block_size, head_dim] per layer, see
rapidserve/attention/metadata.py): FA3 takes paged K/V as [num_pages, page_size, num_kv_heads,
head_dim] with any strides but a contiguous last dim, so each call passes ``k_cache.transpose(1, 2)``,
a view of the same memory. Keys are written by the Triton ``write_kv`` (same layout as always).

Semantics match the other backends: the causal mask is aligned to the end of each sequence (its
q_len queries are the last q_len of its context_len keys), GQA by head groups, padding rows
(context_len 0) give zeros. Decode is the same varlen call with one query per sequence; its host
arguments (max_seqlen_k from the block table's width) depend on shapes only, so decode replays in a
CUDA graph. A sliding window of W keys (Mistral, Gemma 3's local layers) is FA3's window_size (W - 1, 0): the
query at position p sees keys p - W < t <= p. A mixed step (decodes then prompt chunks) is one call: FA3 packs GQA
heads into its query tiles, so a one-token row does not waste a tile the way the Triton prefill kernel would.

The engine's "fa3" backend prefills with FA3 and decodes with Triton: on the H200
(bench/results/attention_kernels.md) FA3's prefill runs at 1.7-1.9x the Triton kernel's TFLOP/s,
while Triton's decode is as fast at batches of 16-256 and 1.1-1.6x faster at batch 1. FA3 takes fp16
and bf16 only; fp32 prefill falls back to Triton.

An fp8 KV cache (float8_e4m3fn; rapidserve/ops/kv_quant.py): FA3 reads fp8 K/V only with an fp8 query (its
fp8 forward takes q, k and v in e4m3 alike, with float32 descale factors of shape [batch, kv_heads] that multiply
them back, and writes bf16). So the query is quantized too, per tensor and dynamically (`quantize_query`: scale =
max|q| / 448, computed on the device, graph safe), and q_descale / k_descale / v_descale are the query's scale and
the layer's k_scale / v_scale, broadcast to [batch, kv_heads] (stride 0). vLLM's FA3 path quantizes the query the
same way, with a calibrated or unit scale. A build without fp8 kernels (flash_attn_interface compiled with
FLASHATTENTION_DISABLE_FP8) prefills an fp8 cache with `fallback_prefill` (the Triton kernel, which keeps q in the
model's dtype), said once at start (`describe_kv`).
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from rapidserve.attention.metadata import AttentionMetadata, PrefillAttention
from rapidserve.ops.kv_quant import cache_scales

Descales = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # q, k, v descale factors, each [B, Hkv] float32


class Fa3Call(Protocol):
    """One FA3 paged forward: (q [T,H,D], k_pages [P,S,Hkv,D], v_pages, page_table [B,W] int32, seqused_k [B] int32,
    cu_seqlens_q [B+1] int32, max_seqlen_q, max_seqlen_k, softmax_scale, window_left, descales of fp8 inputs or
    None) -> out [T,H,D] (bf16 for fp8 inputs). window_left: the keys left of the diagonal a query sees (a sliding
    window W: W - 1), -1: all of them."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page_table: torch.Tensor,
                 seqused_k: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                 scale: float, window_left: int, descales: Descales | None = None, /) -> torch.Tensor: ...

# vLLM 0.24's torch.ops._vllm_fa3_C.fwd, positional (vllm/vllm_flash_attn/flash_attn_interface.py).
VLLM_FWD_ARGS: tuple[str, ...] = (
    "q", "k", "v", "k_new", "v_new", "q_v", "out", "cu_seqlens_q", "cu_seqlens_k", "cu_seqlens_k_new",
    "seqused_q", "seqused_k", "max_seqlen_q", "max_seqlen_k", "page_table", "kv_batch_idx", "leftpad_k",
    "rotary_cos", "rotary_sin", "seqlens_rotary", "q_descale", "k_descale", "v_descale", "softmax_scale",
    "is_causal", "window_size_left", "window_size_right", "softcap", "is_rotary_interleaved",
    "scheduler_metadata", "num_splits", "pack_gqa", "sm_margin", "s_aux", "cp_world_size", "cp_rank",
    "cp_tot_seqused_k",
)


FA3_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)


FA3_FP8 = torch.float8_e4m3fn  # the fp8 format FA3's fp8 forward takes (q, k and v alike)


@dataclass(frozen=True)
class Fa3Kernel:
    source: str  # where the build came from, for logs and bench tables
    call: Fa3Call
    dtypes: tuple[torch.dtype, ...] = FA3_DTYPES  # the query/KV dtypes the build takes
    fp8: bool = True  # the build has its fp8 forward (e4m3 q/k/v with descales)


def _build_has_fp8() -> bool:
    """Whether the flash_attn_interface build kept its fp8 kernels (its flash_attn_config, where it has one, records
    FLASHATTENTION_DISABLE_FP8; a build without that record is taken to have them, as the default build does)."""
    try:
        config = importlib.import_module("flash_attn_config").CONFIG
    except (ImportError, AttributeError):
        return True
    flags = config.get("build_flags", {}) if isinstance(config, dict) else {}
    return not flags.get("FLASHATTENTION_DISABLE_FP8", False)


def _from_flash_attn_interface() -> Fa3Kernel:
    mod = importlib.import_module("flash_attn_interface")
    fn = mod.flash_attn_with_kvcache

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page_table: torch.Tensor,
             seqused_k: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
             scale: float, window_left: int, descales: Descales | None = None) -> torch.Tensor:
        del max_seqlen_k  # derived from the page table by this API
        qd, kd, vd = descales if descales is not None else (None, None, None)
        return fn(q, k, v, cache_seqlens=seqused_k, page_table=page_table, cu_seqlens_q=cu_seqlens_q,
                  max_seqlen_q=max_seqlen_q, softmax_scale=scale, causal=True,
                  window_size=(window_left, 0) if window_left >= 0 else (-1, -1), q_descale=qd, k_descale=kd,
                  v_descale=vd)

    return Fa3Kernel(f"flash_attn_interface ({Path(mod.__file__ or '?').parent})", call, fp8=_build_has_fp8())


def vllm_fa3_library() -> Path:
    """Path of vLLM's FA3 library, found without importing vllm."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("vllm is not installed")
    folder = Path(next(iter(spec.submodule_search_locations))) / "vllm_flash_attn"
    found = sorted(folder.glob("_vllm_fa3_C*.so"))
    if not found:
        raise ImportError(f"no _vllm_fa3_C*.so in {folder}")
    return found[0]


def check_vllm_schema(arg_names: list[str]) -> None:
    """Refuse a vLLM FA3 build whose fwd takes other arguments than the ones this module passes."""
    if tuple(arg_names) != VLLM_FWD_ARGS:
        raise ImportError(
            f"vLLM's FA3 fwd takes ({', '.join(arg_names)}), not the {len(VLLM_FWD_ARGS)} arguments of "
            "vLLM 0.24 this backend passes; install vllm==0.24.* or flash_attn_interface, or use "
            "attention_backend='triton'")


def _from_vllm() -> Fa3Kernel:
    lib = vllm_fa3_library()
    if not hasattr(torch.ops._vllm_fa3_C, "fwd"):  # not loaded yet in this process
        torch.ops.load_library(str(lib))
    op = torch.ops._vllm_fa3_C.fwd
    check_vllm_schema([a.name for a in op.default._schema.arguments])

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page_table: torch.Tensor,
             seqused_k: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
             scale: float, window_left: int, descales: Descales | None = None) -> torch.Tensor:
        args = dict.fromkeys(VLLM_FWD_ARGS)
        args.update(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k, max_seqlen_q=max_seqlen_q,
                    max_seqlen_k=max_seqlen_k, page_table=page_table, softmax_scale=scale, is_causal=True,
                    window_size_left=window_left, window_size_right=0 if window_left >= 0 else -1, softcap=0.0,
                    is_rotary_interleaved=True,
                    num_splits=0, sm_margin=0, cp_world_size=1, cp_rank=0)
        if descales is not None:
            args.update(q_descale=descales[0], k_descale=descales[1], v_descale=descales[2])
        return op(*args.values())[0]

    return Fa3Kernel(f"vllm_flash_attn ({lib})", call)


def find_fa3(device: torch.device) -> Fa3Kernel:
    """The first FA3 build that loads, or ImportError saying why each source failed."""
    if device.type != "cuda" or torch.version.hip is not None:
        raise ImportError("FlashAttention-3 runs on NVIDIA GPUs only")
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        raise ImportError(f"FlashAttention-3 needs a Hopper GPU (compute capability 9.x), not {major}.{minor}")
    why = []
    for source in (_from_flash_attn_interface, _from_vllm):
        try:
            return source()
        except (ImportError, OSError, RuntimeError, AttributeError) as e:
            why.append(f"{source.__name__.removeprefix('_from_')}: {e}")
    raise ImportError("no FlashAttention-3 build found (" + "; ".join(why) + ")")


def quantize_query(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q as FA3's fp8 forward takes it: (q8 = e4m3(q / s), s float32 [1]) with s = max|q| / 448 over the whole
    tensor (at least 1e-12 / 448: a zero query), computed on the device (no host read)."""
    top = float(torch.finfo(FA3_FP8).max)
    s = (q.abs().amax().float().clamp(min=1e-12) / top).reshape(1)
    return (q.float() / s).clamp(-top, top).to(FA3_FP8), s


def fp8_descales(q_scale: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor, batch: int,
                 kv_heads: int) -> Descales:
    """The three per-tensor scales as FA3's descale arguments: float32 [batch, kv_heads] views of stride 0."""
    return tuple(t.float().reshape(1, 1).expand(batch, kv_heads) for t in (q_scale, k_scale, v_scale))  # type: ignore[return-value]


def window_left(window: int | None) -> int:
    """FA3's window_size_left of a sliding window of `window` keys (the query's own included), -1: none."""
    if window is None:
        return -1
    if window < 1:
        raise ValueError(f"a sliding window of {window} tokens; it must be >= 1 (None: no window)")
    return window - 1


@dataclass(frozen=True)
class Fa3Attention:
    """prefill_attention / decode_attention of the backend interface over one FA3 kernel. FA3 takes
    fp16 and bf16 only: prefill of other dtypes goes to `fallback_prefill` (the Triton kernel), and so does an fp8
    cache when the build has no fp8 forward or the cache is not e4m3fn (module docstring)."""

    kernel: Fa3Kernel
    fallback_prefill: PrefillAttention | None = None

    def takes_fp8(self, cache_dtype: torch.dtype) -> bool:
        """Whether FA3 itself prefills a cache of fp8 `cache_dtype` (else the fallback does)."""
        return self.kernel.fp8 and cache_dtype == FA3_FP8

    def describe_kv(self, cache_dtype: torch.dtype) -> str:
        """One line for the start-up log: who prefills a cache of `cache_dtype`."""
        if cache_dtype not in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
            return "FA3 prefill"
        if self.takes_fp8(cache_dtype):
            return "FA3 prefill in fp8 (fp8 KV cache; the query quantized per tensor, q/k/v descales)"
        why = "has no fp8 forward" if not self.kernel.fp8 else f"takes e4m3fn, not {cache_dtype}"
        return f"Triton prefill for the fp8 KV cache (this FA3 build {why})"

    def prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
        if meta.cu_seqlens_q is None:
            raise ValueError("prefill metadata needs cu_seqlens_q")
        scales = cache_scales(k_cache, k_scale, v_scale)
        fp8 = scales is not None
        if q.dtype not in self.kernel.dtypes or (fp8 and not self.takes_fp8(k_cache.dtype)):
            if self.fallback_prefill is None:
                raise ValueError(f"FlashAttention-3 takes float16 or bfloat16 queries (and an e4m3fn cache with its "
                                 f"fp8 build), not {q.dtype} over a {k_cache.dtype} cache")
            if window is None:
                return self.fallback_prefill(q, k_cache, v_cache, meta, scale, k_scale, v_scale)
            return self.fallback_prefill(q, k_cache, v_cache, meta, scale, k_scale, v_scale, window=window)
        k_pages, v_pages = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
        max_k, left = max(meta.max_context_len, 1), window_left(window)
        if scales is None:
            return self.kernel.call(q, k_pages, v_pages, meta.block_tables, meta.context_lens, meta.cu_seqlens_q,
                                    meta.max_seqlen_q, max_k, scale, left)
        q8, q_scale = quantize_query(q)
        descales = fp8_descales(q_scale, scales[0], scales[1], meta.num_seqs, k_cache.shape[1])
        out = self.kernel.call(q8, k_pages, v_pages, meta.block_tables, meta.context_lens, meta.cu_seqlens_q,
                               meta.max_seqlen_q, max_k, scale, left, descales)
        return out.to(q.dtype)

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                         k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                         window: int | None = None) -> torch.Tensor:
        """FA3's decode (the engine's fa3 backend decodes with Triton, which measured as fast or faster)."""
        if q.dtype not in self.kernel.dtypes:
            raise ValueError(f"FlashAttention-3 takes float16 or bfloat16, not {q.dtype}")
        scales = cache_scales(k_cache, k_scale, v_scale)
        if scales is not None and not self.takes_fp8(k_cache.dtype):
            raise ValueError(f"this FlashAttention-3 build does not read a {k_cache.dtype} cache")
        b = q.shape[0]
        cu = torch.arange(b + 1, dtype=torch.int32, device=q.device)
        # An upper bound from shapes only, so a captured graph replays for any context lengths.
        max_k = block_tables.shape[1] * k_cache.shape[2]
        k_pages, v_pages = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
        left = window_left(window)
        if scales is None:
            return self.kernel.call(q, k_pages, v_pages, block_tables, context_lens, cu, 1, max_k, scale, left)
        q8, q_scale = quantize_query(q)
        descales = fp8_descales(q_scale, scales[0], scales[1], b, k_cache.shape[1])
        return self.kernel.call(q8, k_pages, v_pages, block_tables, context_lens, cu, 1, max_k, scale, left,
                                descales).to(q.dtype)
