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
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rapidserve.attention.metadata import AttentionMetadata, PrefillAttention

# FA3 call: (q [T,H,D], k_pages [P,S,Hkv,D], v_pages, page_table [B,W] int32, seqused_k [B] int32,
#            cu_seqlens_q [B+1] int32, max_seqlen_q, max_seqlen_k, softmax_scale, window_left) -> out [T,H,D];
# window_left: the keys left of the diagonal a query sees (a sliding window W: W - 1), -1: all of them.
Fa3Call = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                    int, int, float, int], torch.Tensor]

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


@dataclass(frozen=True)
class Fa3Kernel:
    source: str  # where the build came from, for logs and bench tables
    call: Fa3Call
    dtypes: tuple[torch.dtype, ...] = FA3_DTYPES  # the query/KV dtypes the build takes


def _from_flash_attn_interface() -> Fa3Kernel:
    mod = importlib.import_module("flash_attn_interface")
    fn = mod.flash_attn_with_kvcache

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page_table: torch.Tensor,
             seqused_k: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
             scale: float, window_left: int) -> torch.Tensor:
        del max_seqlen_k  # derived from the page table by this API
        return fn(q, k, v, cache_seqlens=seqused_k, page_table=page_table, cu_seqlens_q=cu_seqlens_q,
                  max_seqlen_q=max_seqlen_q, softmax_scale=scale, causal=True,
                  window_size=(window_left, 0) if window_left >= 0 else (-1, -1))

    return Fa3Kernel(f"flash_attn_interface ({Path(mod.__file__ or '?').parent})", call)


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
             scale: float, window_left: int) -> torch.Tensor:
        args = dict.fromkeys(VLLM_FWD_ARGS)
        args.update(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k, max_seqlen_q=max_seqlen_q,
                    max_seqlen_k=max_seqlen_k, page_table=page_table, softmax_scale=scale, is_causal=True,
                    window_size_left=window_left, window_size_right=0 if window_left >= 0 else -1, softcap=0.0,
                    is_rotary_interleaved=True,
                    num_splits=0, sm_margin=0, cp_world_size=1, cp_rank=0)
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
    fp16 and bf16 only: prefill of other dtypes goes to `fallback_prefill` (the Triton kernel)."""

    kernel: Fa3Kernel
    fallback_prefill: PrefillAttention | None = None

    def prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
        if meta.cu_seqlens_q is None:
            raise ValueError("prefill metadata needs cu_seqlens_q")
        if q.dtype not in self.kernel.dtypes:
            if self.fallback_prefill is None:
                raise ValueError(f"FlashAttention-3 takes float16 or bfloat16, not {q.dtype}")
            if window is None:
                return self.fallback_prefill(q, k_cache, v_cache, meta, scale)
            return self.fallback_prefill(q, k_cache, v_cache, meta, scale, window=window)
        return self.kernel.call(q, k_cache.transpose(1, 2), v_cache.transpose(1, 2), meta.block_tables,
                                meta.context_lens, meta.cu_seqlens_q, meta.max_seqlen_q,
                                max(meta.max_context_len, 1), scale, window_left(window))

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                         window: int | None = None) -> torch.Tensor:
        """FA3's decode (the engine's fa3 backend decodes with Triton, which measured as fast or faster)."""
        if q.dtype not in self.kernel.dtypes:
            raise ValueError(f"FlashAttention-3 takes float16 or bfloat16, not {q.dtype}")
        b = q.shape[0]
        cu = torch.arange(b + 1, dtype=torch.int32, device=q.device)
        # An upper bound from shapes only, so a captured graph replays for any context lengths.
        max_k = block_tables.shape[1] * k_cache.shape[2]
        return self.kernel.call(q, k_cache.transpose(1, 2), v_cache.transpose(1, 2), block_tables,
                                context_lens, cu, 1, max_k, scale, window_left(window))
