"""Every Triton launch the engine makes for a model shape, captured on meta tensors (no GPU, no memory).

`capture(shape, target)` builds one decoder layer of the preset's tensor-parallel rank on the meta device
(`rapidserve.models.decoder_layer.DecoderLayer`, its KV pool as `rapidserve.kv_pool` lays it out, sized as on the
target GPU) and runs the engine's own code on it: the layer forward of a decode step at every decode-graph
batch bucket, of a prefill step and of a mixed step (`attend` splits it), with the Triton `Ops` bundle and the
Triton attention backend that the target's platform gets (`get_ops`, `get_attention_backend`, with
`torch.version.hip` set for an AMD target), and `unfused_ops` (the fallback launches of `rope_write`); on targets
with fp8 (gfx942, sm_90) and bf16 shapes whose heads split into whole 128x128 blocks, the same layer with fp8 block
weights (issue 39: its e4m3fnuz / e4m3fn weights, `ops.fp8_gpu.gpu_linear`'s Triton block GEMM) at decode and prefill
steps, and (every dtype) the layer over an fp8 KV pool of the target's format (`--kv-cache-dtype fp8`: the kernels'
KV_FP8 variants) at decode, prefill and mixed steps, and per-row fp8 weights' launches (`_fp8_token_launches`: the
per-token quantizer, the norms and SiLU-and-mul that quantize their output for them, and NVIDIA's skinny fp8 GEMM; the
decode attention whose output is quantized for o_proj, `decode_attention_fp8`, at batch 1, 16 and 64, and on NVIDIA
of a bf16 model also its W8A16 fp16 rows).
Each
`kernel[grid](*args, **kwargs)` is recorded instead of run: the kernels' launch code picks the constexprs,
`num_warps` and the rest exactly as it would on that GPU, which `amd_compile_check` then compiles. The skinny
GEMM (NVIDIA only) is captured for the NVIDIA target by the same rule as `triton_skinny.routed`. The MoE presets'
layer 0 is sparse: its experts' launches (`ops/triton_moe.py`, its routing and alignment's `ops/triton_moe_route.py` and
`ops/triton_moe_align.py`) are captured at every step, and at one decode batch with K split in both GEMMs (a tuned
table may ask for it; the rule never does), plus `fused_moe` of a given routing (`_align_one_kernel`: what the
benches and tests call) and a prefill under a TAIL_BLOCK_M (the GEMMs' two launches on block lists: `_moe_launches`).

The launches beside the layer forward (`_skinny_launches`, `_moe_launches`, `_fp8_token_launches`) are
bench/amd_op_launches.py's.

KERNELS names every launchable `@triton.jit` kernel of rapidserve/ and where it is patched;
tests/test_amd_compile.py fails when rapidserve/ gains a kernel that is not in it.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch

from bench.amd_op_launches import _fp8_token_launches, _moe_launches, _skinny_launches
from rapidserve.attention import AttentionMetadata, get_attention_backend, split_decode_rows
from rapidserve.config import DTYPES, CacheConfig, ModelConfig, RunnerConfig
from rapidserve.kv_pool import KVPool, pool_spec
from rapidserve.loader.preset_table import preset_table
from rapidserve.models.decoder_layer import DecoderLayer
from rapidserve.ops import get_ops, unfused_ops
from rapidserve.parallel.shard import ShardError, block_shard_problem, shard_config, tp_layout
from rapidserve.quant_config import QuantizationConfig

# kernel -> (module, reached by). "nvidia" kernels are never launched with torch.version.hip set.
KERNELS: dict[str, tuple[str, str]] = {
    "_write_kv_kernel": ("rapidserve.ops.triton_kv", "rope_write's fallback, unfused_ops"),
    "_decode_split_kernel": ("rapidserve.attention.triton_paged_decode", "decode and mixed steps"),
    "_decode_reduce_kernel": ("rapidserve.attention.triton_paged_decode", "decode steps with more than one split"),
    "_prefill_kernel": ("rapidserve.attention.triton_paged_prefill", "prefill and mixed steps"),
    "_rms_norm_kernel": ("rapidserve.ops.triton_ops", "every layer, final norm"),
    "_rope_kernel": ("rapidserve.ops.triton_rope", "unfused_ops (no q/k norm)"),
    "_qk_norm_rope_kernel": ("rapidserve.ops.triton_rope", "rope_write's fallback, unfused_ops (q/k norm)"),
    "_rope_write_kernel": ("rapidserve.ops.triton_rope", "every layer"),
    "_silu_and_mul_kernel": ("rapidserve.ops.triton_ops", "every layer's MLP"),
    "_skinny_kernel": ("rapidserve.ops.triton_skinny", "nvidia"),
    "_fp8_block_kernel": ("rapidserve.ops.triton_fp8", "fp8: layers with fp8 block weight scales"),
    "_quantize_tokens_kernel": ("rapidserve.ops.triton_fp8", "fp8: per-row fp8 weights' per-token activations"),
    "_fp8_skinny_kernel": ("rapidserve.ops.triton_fp8_skinny", "nvidia"),
    "_fp8_split_reduce_kernel": ("rapidserve.ops.triton_fp8_skinny", "nvidia"),
    "_rms_norm_fp8_kernel": ("rapidserve.ops.triton_fp8_fused", "fp8: the norms before per-token fp8 q|k|v, gate|up"),
    "_silu_and_mul_fp8_kernel": ("rapidserve.ops.triton_fp8_fused", "fp8: SiLU-and-mul before a per-token fp8 down"),
    "_sums_rms_norm_fp8_kernel": ("rapidserve.ops.triton_fp8_fold", "nvidia"),
    "_route_align_kernel": ("rapidserve.ops.triton_moe_route", "MoE layers: decode batches (<= 128 pairs)"),
    "_route_kernel": ("rapidserve.ops.triton_moe_route", "MoE layers: larger batches, prefill"),
    "_align_one_kernel": ("rapidserve.ops.triton_moe_align", "MoE layers: fused_moe of a given routing (benches)"),
    "_align_count_kernel": ("rapidserve.ops.triton_moe_align", "MoE layers: larger batches, prefill"),
    "_align_scatter_kernel": ("rapidserve.ops.triton_moe_align", "MoE layers: larger batches, prefill"),
    "_gate_up_kernel": ("rapidserve.ops.triton_moe_gemm", "MoE layers"),
    "_down_kernel": ("rapidserve.ops.triton_moe_gemm", "MoE layers"),
}
NVIDIA_ONLY = frozenset(k for k, (_, why) in KERNELS.items() if why == "nvidia")
FP8_ONLY = frozenset(k for k, (_, why) in KERNELS.items() if why.startswith("fp8"))  # not on targets without fp8
FP8_BLOCK = QuantizationConfig(method="fp8", weights="block", block=(128, 128), activations="group",
                               origin="the AMD compile check's fp8 block layer")
GB = 10**9


@dataclass(frozen=True)
class Target:
    name: str
    backend: str  # "hip" | "cuda"
    arch: str | int
    warp_size: int
    units: int  # CUs (AMD) or SMs (NVIDIA): what `_num_sms` reports there
    memory: int  # bytes of device memory
    gpu: str
    fp8: torch.dtype | None = None  # the fp8 weight format it multiplies (ops.fp8.fp8_dtype), None: no fp8

    @property
    def hip(self) -> bool:
        return self.backend == "hip"


TARGETS: dict[str, Target] = {
    "gfx942": Target("gfx942", "hip", "gfx942", 64, 304, 192 * GB, "MI300X", torch.float8_e4m3fnuz),
    "gfx90a": Target("gfx90a", "hip", "gfx90a", 64, 110, 64 * GB, "MI250X (one GCD)"),
    "sm_90": Target("sm_90", "cuda", 90, 32, 132, 80 * GB, "H100 SXM", torch.float8_e4m3fn),
}


@dataclass(frozen=True)
class Shape:
    """One model as one rank runs it: a preset at a tensor-parallel size, dtype and KV block size."""

    preset: str
    tp: int
    dtype: str  # one of rapidserve.config.DTYPES
    block_size: int = 16

    @property
    def label(self) -> str:
        return f"{self.preset} tp{self.tp} {self.dtype} bs{self.block_size}"


@dataclass
class Launch:
    kernel: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    grid: tuple[int, ...]
    step: str = ""


@dataclass
class Capture:
    shape: Shape
    target: Target
    launches: list[Launch] = field(default_factory=list)
    skipped: str = ""  # why nothing was captured (the weights do not fit the target)


def real_presets() -> dict[str, ModelConfig]:
    """The preset table without its tiny test models."""
    return {k: v for k, v in preset_table().items() if not k.startswith("tiny-")}


def tp_sizes(cfg: ModelConfig, sizes: tuple[int, ...] = (1, 2, 4, 8)) -> list[int]:
    """The tensor-parallel sizes of `sizes` that `tp_layout` accepts for this model."""
    out = []
    for tp in sizes:
        try:
            tp_layout(cfg, tp, 0)
        except ShardError:
            continue
        out.append(tp)
    return out


def shapes(matrix: str, target: str = "gfx942") -> list[Shape]:
    """The shapes checked on `target`. "ci": every real preset in bf16 (the default dtype) at tp 1 and at its
    largest tp of 1/2/4/8 (the fewest KV heads a rank: the widest split-K reduction), and, on gfx942 only (the
    controls' compiles, sm_90's above all, would take CI past its time), fp16 / fp32 at tp 1 for one preset per
    distinct (head_dim, GQA group); "full": every real preset at every tp of 1/2/4/8 that its heads allow, in each
    dtype, block size 16, plus block sizes 8 and 32 of those presets in bf16. Block size 16 is the default
    (`CacheConfig.block_size`)."""
    presets = real_presets()
    groups: dict[tuple[int, int], str] = {}
    for name, cfg in presets.items():
        groups.setdefault((cfg.head_dim, cfg.num_heads // cfg.num_kv_heads), name)
    if matrix == "ci":
        out = [Shape(p, tp, "bfloat16") for p, cfg in presets.items() for tp in sorted({1, max(tp_sizes(cfg))})]
        if target != "gfx942":
            return out
        return out + [Shape(p, 1, dt) for p in groups.values() for dt in ("float16", "float32")]
    if matrix != "full":
        raise ValueError(f"matrix {matrix!r}: use 'ci' or 'full'")
    out = [Shape(p, tp, dt) for p, cfg in presets.items() for tp in tp_sizes(cfg) for dt in DTYPES]
    return out + [Shape(p, 1, "bfloat16", bs) for p in groups.values() for bs in (8, 32)]


class _Recorder:
    """Stands in for a JITFunction in its module: `kernel[grid](*args, **kwargs)` appends a Launch."""

    def __init__(self, name: str, sink: list[Launch], step: Callable[[], str]) -> None:
        self.name, self.sink, self.step = name, sink, step

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            g = tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)
            self.sink.append(Launch(self.name, args, kwargs, g, self.step()))
        return launch


def jit_function(kernel: str) -> Any:
    """The real JITFunction of a KERNELS entry."""
    return getattr(importlib.import_module(KERNELS[kernel][0]), kernel)


@contextlib.contextmanager
def recording(target: Target, sink: list[Launch], step: Callable[[], str]) -> Iterator[None]:
    """Within: every KERNELS kernel records instead of launching, `torch.version.hip` says the target's
    platform and the attention launch code sees the target's CU / SM count."""
    with contextlib.ExitStack() as stack:
        for name, (module, _) in KERNELS.items():
            stack.enter_context(mock.patch.object(importlib.import_module(module), name,
                                                  _Recorder(name, sink, step)))
        from rapidserve.attention import triton_paged_decode
        from rapidserve.ops import pdl, triton_moe_grid
        stack.enter_context(mock.patch.object(triton_paged_decode, "_num_sms", lambda device: target.units))
        # programmatic dependent launch as on the target (NVIDIA sm_90: on; ROCm: off), not the meta device's (off),
        # and the MoE GEMMs' persistent grids sized for its SMs / CUs
        stack.enter_context(mock.patch.object(pdl, "use_pdl", lambda on, device: on is not False
                                              and not target.hip and pdl.pdl_available()))
        stack.enter_context(mock.patch.object(triton_moe_grid, "sm_count", lambda device: target.units))
        stack.enter_context(mock.patch.object(torch.version, "hip", "6.4.0" if target.hip else None))
        yield


def _weights_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Parameter bytes of one rank's model (`cfg` is the rank's shard)."""
    layer = DecoderLayer(cfg, dtype, torch.device("meta"))
    per_layer = sum(p.numel() for p in layer.parameters())
    embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    return (per_layer * cfg.num_layers + embed + cfg.hidden_size) * dtype.itemsize


def capture(shape: Shape, target: Target) -> Capture:
    """The launches of one rank of `shape` on `target` (see the module docstring)."""
    out = Capture(shape, target)
    dtype: torch.dtype = getattr(torch, shape.dtype)
    whole = preset_table()[shape.preset]
    cfg = shard_config(whole, tp_layout(whole, shape.tp, 0))
    cache = CacheConfig(block_size=shape.block_size)
    budget, weights = int(target.memory * cache.gpu_memory_utilization), _weights_bytes(cfg, dtype)
    per_block = pool_spec(cfg, cache, dtype, 1).bytes_per_block
    num_blocks = max(0, budget - weights) // per_block
    if num_blocks < 16:
        out.skipped = (f"the rank's weights ({weights / GB:.0f} GB) leave no KV pool in {budget / GB:.0f} GB "
                       f"(0.9 of the {target.gpu}'s memory)")
        return out
    # --max-model-len as large as the pool holds, up to the model's window (the block tables' width)
    max_len = min(whole.max_position_embeddings, num_blocks * shape.block_size)
    blocks_per_seq = -(-max_len // shape.block_size)
    meta = torch.device("meta")
    pool = KVPool(torch.empty(pool_spec(cfg, cache, dtype, num_blocks).shape, dtype=dtype, device=meta),
                  shape.block_size)
    layer = DecoderLayer(cfg, dtype, meta)
    cos_sin = torch.empty(max_len, cfg.head_dim, dtype=torch.float32, device=meta)
    step = [""]
    with recording(target, out.launches, lambda: step[0]):
        ops = get_ops(torch.device("cuda"))
        attn = get_attention_backend("auto" if target.hip else "triton", torch.device("cuda"))

        def forward(name: str, meta_: AttentionMetadata, ops_: Any = ops, first: bool = False) -> None:
            step[0] = name
            t = meta_.slot_mapping.shape[0]
            hidden = torch.empty(t, cfg.hidden_size, dtype=dtype, device=meta)
            residual = None if first else torch.empty_like(hidden)
            positions = torch.empty(t, dtype=torch.int64, device=meta)
            layer(hidden, residual, positions, cos_sin, pool.layers[0], meta_, ops_, attn)
            if not first:
                ops_.add_rms_norm(hidden, residual, layer.input_layernorm, cfg.rms_norm_eps)  # the final norm

        for b in RunnerConfig().graph_batch_sizes:
            forward(f"decode b{b}", _decode_meta(b, blocks_per_seq, meta), first=b == 1)
        prefill = _prefill_meta([8192 - 64, 64], shape.block_size, meta)
        forward("prefill", prefill)
        forward("prefill, unfused_ops", prefill, unfused_ops(ops))
        forward("mixed", _prefill_meta([1] * 32 + [2048], shape.block_size, meta))
        if layer.moe is not None:
            step[0] = "MoE experts: split K, fused_moe, TMA + persistent prefill, tail blocks"
            _moe_launches(layer, dtype, meta)
        if not target.hip:
            step[0] = "skinny linears (batch <= 16)"
            _skinny_launches(layer, dtype)
        if target.fp8 is not None and shape.dtype == "bfloat16" and FP8_BLOCK.block is not None \
                and block_shard_problem(whole, shape.tp, FP8_BLOCK.block) is None:
            fp8_layer = DecoderLayer(cfg, dtype, meta, quant=FP8_BLOCK, fp8=target.fp8)
            for b in (1, 32, 64, 256):  # the block kernel's row tiles: 16, 32, 64, 128 (AMD: up to 64)
                step[0] = f"fp8 block layer, decode b{b}"
                _layer_forward(fp8_layer, cfg, dtype, pool, cos_sin, _decode_meta(b, blocks_per_seq, meta), ops,
                               attn, meta)
            step[0] = "fp8 block layer, prefill"
            _layer_forward(fp8_layer, cfg, dtype, pool, cos_sin, prefill, ops, attn, meta)
        if target.fp8 is not None:
            step[0] = "fp8 per-row layer (per-token activations)"
            _fp8_token_launches(layer, dtype, target.fp8, target.hip)
            for b in (1, 16, 64):  # decode's output quantized for the per-row fp8 o_proj (one split at 64 on sm_90)
                step[0] = f"fp8 per-row layer, attention for o_proj b{b}"
                q = torch.empty(b, cfg.num_heads, cfg.head_dim, dtype=dtype, device=meta)
                m = _decode_meta(b, blocks_per_seq, meta)
                assert attn.decode_attention_fp8 is not None
                attn.decode_attention_fp8(q, *pool.layers[0], m.block_tables, m.context_lens, layer.scale,
                                          out_fp8=target.fp8, window=layer.window)
                if not target.hip and dtype == torch.bfloat16:  # W8A16's fp16 rows (ops/triton_w8a16.py)
                    attn.decode_attention_fp8(q, *pool.layers[0], m.block_tables, m.context_lens, layer.scale,
                                              out_fp8=torch.float16, window=layer.window)
        if target.fp8 is not None:  # --kv-cache-dtype fp8: the same layer over a pool of the target's fp8 format
            kv_pool = KVPool(torch.empty(pool_spec(cfg, cache, target.fp8, num_blocks).shape, dtype=target.fp8,
                                         device=meta), shape.block_size)
            kv_layer = DecoderLayer(cfg, dtype, meta, kv_scales=(1.0, 1.0))
            for b in (1, 32, 256):
                step[0] = f"fp8 KV cache, decode b{b}"
                _layer_forward(kv_layer, cfg, dtype, kv_pool, cos_sin, _decode_meta(b, blocks_per_seq, meta), ops,
                               attn, meta)
            for name, meta_, ops_ in (("prefill", prefill, ops), ("prefill, unfused_ops", prefill, unfused_ops(ops)),
                                      ("mixed", _prefill_meta([1] * 32 + [2048], shape.block_size, meta), ops)):
                step[0] = f"fp8 KV cache, {name}"
                _layer_forward(kv_layer, cfg, dtype, kv_pool, cos_sin, meta_, ops_, attn, meta)
    return out


def _layer_forward(layer: DecoderLayer, cfg: ModelConfig, dtype: torch.dtype, pool: KVPool, cos_sin: torch.Tensor,
                   meta_: AttentionMetadata, ops: Any, attn: Any, device: torch.device) -> None:
    t = meta_.slot_mapping.shape[0]
    hidden = torch.empty(t, cfg.hidden_size, dtype=dtype, device=device)
    positions = torch.empty(t, dtype=torch.int64, device=device)
    layer(hidden, torch.empty_like(hidden), positions, cos_sin, pool.layers[0], meta_, ops, attn)


def _decode_meta(batch: int, width: int, device: torch.device) -> AttentionMetadata:
    def empty(*size: int, dt: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.empty(size, dtype=dt, device=device)
    return AttentionMetadata(False, empty(batch, dt=torch.int64), empty(batch, width), empty(batch))


def _prefill_meta(q_lens: list[int], block_size: int, device: torch.device) -> AttentionMetadata:
    """A prefill step's metadata as `BatchInputs._prefill_meta` shapes it (tables 16-wide multiples)."""
    blocks = -(-max(q_lens) // block_size)
    width = -(-blocks // 16) * 16
    n, t = len(q_lens), sum(q_lens)
    meta = AttentionMetadata(True, torch.empty(t, dtype=torch.int64, device=device),
                             torch.empty(n, width, dtype=torch.int32, device=device),
                             torch.empty(n, dtype=torch.int32, device=device),
                             cu_seqlens_q=torch.empty(n + 1, dtype=torch.int32, device=device),
                             max_seqlen_q=max(q_lens), max_context_len=max(q_lens))
    return split_decode_rows(meta, q_lens)
