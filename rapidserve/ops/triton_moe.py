"""A mixture-of-experts layer's experts as grouped GEMMs in Triton (issue 40), on NVIDIA and AMD alike.

`fused_moe(x, w13, w2, weights, ids)` computes what `ops.moe.moe_experts_ref` does (see ops/moe.py for the
layouts) in four launches, none of which reads a device value on the host, with shapes fixed by the batch, so a
decode step's CUDA graph captures it:

1. alignment: the T*k (token, slot) pairs sorted by expert, each expert's run padded to a multiple of BLOCK_M
   (`ops.moe.Alignment`, vLLM's moe_align_block_size layout): one program of `_align_kernel` for up to
   ALIGN_ONE_PROGRAM pairs (decode batches, short chunks: a loop over experts, each a masked cumulative sum over
   the pairs), else `ops.moe.align_block_size`'s torch ops (a sort; longer prefills).
2. gate|up: `_gate_up_kernel`, program (m, n) one BLOCK_M run of one expert's pairs x BLOCK_N features: the
   pairs' token rows of x gathered, times the expert's gate and up tiles (two accumulators, fp32), SiLU(gate) * up
   in the epilogue, stored at the pairs' rows of act [T*k, I]. Programs past the padded total return at once.
3. down: `_down_kernel`, act's rows of the run times the expert's down tile, scaled by each pair's routing
   weight, stored at the pairs' rows of out [T*k, h].
4. the k rows of each token summed (torch), in a fixed order: no atomics, so results are deterministic.

Every expert's weight is read once per BLOCK_N column block per run of BLOCK_M pairs: at decode, with fewer pairs
than an expert's BLOCK_M, once per step; experts no pair chose are not read at all. Block sizes come from
`moe_config` (a rule of the pairs per expert, not tuned on a GPU yet: bench/moe_gemm.py measures it). fp32
inputs multiply in IEEE fp32 (no TF32), for the CPU checks; bf16/fp16 on the tensor cores with fp32 sums.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from rapidserve.ops.moe import Alignment, align_block_size, max_padded

ALIGN_ONE_PROGRAM = 1024  # at most this many pairs are aligned by one program of `_align_kernel`


class MoeKernelConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def moe_config(pairs: int, num_experts: int) -> MoeKernelConfig:
    """Tiles for `pairs` (token, slot) pairs over `num_experts` experts: BLOCK_M near the pairs an expert gets
    on average (a decode batch's runs are a few rows; prefill's fill 64-row tiles)."""
    per_expert = pairs / num_experts
    hip = torch.version.hip is not None
    stages = 2 if hip else 3
    if per_expert <= 16:
        # ROCm: K steps of 64, as the larger tiles'; 128 took 36 KiB of LDS (the gate and up tiles, two stages), one
        # 4-wave workgroup a gfx942 CU: 1 wave a SIMD (bench/amd_compile_check.py); 64 halves it
        return MoeKernelConfig(16, 64, 64 if hip else 128, 4, stages)
    if per_expert <= 48:
        return MoeKernelConfig(32, 64, 64, 4, stages)
    return MoeKernelConfig(64, 128, 64, 8, stages)


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, expert_ptr, post_ptr, pairs, padded_rows,
                  NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
                  BLOCK_B: tl.constexpr, BLOCK_TAIL: tl.constexpr):
    """One program: `ops.moe.Alignment` of `pairs` <= BLOCK expert ids; every row < padded_rows written once."""
    offs = tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + offs, mask=offs < pairs, other=-1)
    pad = tl.arange(0, BLOCK_M)
    blocks = tl.arange(0, BLOCK_B)
    start = tl.full([], 0, tl.int32)
    for e in range(NUM_EXPERTS):
        hit = (ids == e).to(tl.int32)
        n = tl.sum(hit, axis=0)
        pos = tl.cumsum(hit, axis=0) - 1
        tl.store(sorted_ptr + start + pos, offs, mask=hit != 0)
        padded = (n + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        tl.store(sorted_ptr + start + n + pad, tl.zeros([BLOCK_M], tl.int32) + pairs, mask=pad < padded - n)
        tl.store(expert_ptr + start // BLOCK_M + blocks, tl.zeros([BLOCK_B], tl.int32) + e,
                 mask=blocks < padded // BLOCK_M)
        start += padded
    tl.store(post_ptr, start)
    for r0 in range(0, padded_rows, BLOCK_TAIL):
        rows = r0 + tl.arange(0, BLOCK_TAIL)
        tail = (rows >= start) & (rows < padded_rows)
        tl.store(sorted_ptr + rows, tl.zeros([BLOCK_TAIL], tl.int32) + pairs, mask=tail)
        tl.store(expert_ptr + rows // BLOCK_M, tl.zeros([BLOCK_TAIL], tl.int32) - 1,
                 mask=tail & (rows % BLOCK_M == 0))


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """`ops.moe.Alignment` of expert ids [T, k] (int32) on their device: `_align_kernel` for at most
    ALIGN_ONE_PROGRAM pairs, `ops.moe.align_block_size` above."""
    pairs = ids.numel()
    if pairs > ALIGN_ONE_PROGRAM:
        return align_block_size(ids, num_experts, block_m)
    p = max_padded(pairs, num_experts, block_m)
    dev = ids.device
    sorted_ids = torch.empty(p, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(p // block_m, dtype=torch.int32, device=dev)
    num_post = torch.empty(1, dtype=torch.int32, device=dev)
    block = triton.next_power_of_2(max(pairs, 16))
    _align_kernel[(1,)](ids.reshape(-1).to(torch.int32), sorted_ids, expert_ids, num_post, pairs, p,
                        NUM_EXPERTS=num_experts, BLOCK_M=block_m, BLOCK=block,
                        BLOCK_B=triton.next_power_of_2(max(-(-pairs // block_m), 2)), BLOCK_TAIL=256)
    return Alignment(sorted_ids, expert_ids, num_post)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, out_ptr, sorted_ptr, expert_ptr, post_ptr, pairs, N, K,
                    stride_xm, stride_we, stride_wn, stride_om,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    IEEE: tl.constexpr):
    """act[pair] = silu(x[token] @ gate[e].T) * (x[token] @ up[e].T) for one run of BLOCK_M pairs of expert e and
    BLOCK_N of its N features; w [E, 2N, K] (gate rows [0, N), up rows [N, 2N)), row-major."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(post_ptr):
        return
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < pairs
    tokens = (rows // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_xm + offs_k[None, :]
    g_ptrs = w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + N * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:
            acc_g = tl.dot(a, g, acc_g, input_precision="ieee")
            acc_u = tl.dot(a, u, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, g, acc_g)
            acc_u = tl.dot(a, u, acc_u)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(a_ptr, w_ptr, out_ptr, weights_ptr, sorted_ptr, expert_ptr, post_ptr, pairs, N, K,
                 stride_am, stride_we, stride_wn, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """out[pair] = weight[pair] * (act[pair] @ down[e].T) for one run of BLOCK_M pairs of expert e and BLOCK_N of
    the N hidden features; w [E, N, K] row-major, weights [T*k] float32."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(post_ptr):
        return
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < pairs
    rows64 = rows.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows64[:, None] * stride_am + offs_k[None, :]
    b_ptrs = w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision="ieee") if IEEE else tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    acc = acc * tl.load(weights_ptr + rows, mask=row_ok, other=0.0)[:, None]
    out_ptrs = out_ptr + rows64[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, hidden] with a contiguous last dim, got {tuple(x.shape)}")
    t, h = x.shape
    if w13.dim() != 3 or w13.shape[2] != h or w13.shape[1] % 2 or not w13.is_contiguous():
        raise ValueError(f"w13 must be a contiguous [E, 2I, {h}], got {tuple(w13.shape)}")
    e, i = w13.shape[0], w13.shape[1] // 2
    if tuple(w2.shape) != (e, h, i) or not w2.is_contiguous():
        raise ValueError(f"w2 must be a contiguous [{e}, {h}, {i}], got {tuple(w2.shape)}")
    if x.dtype != w13.dtype or x.dtype != w2.dtype:
        raise ValueError(f"x, w13 and w2 must have the same dtype, got {x.dtype}, {w13.dtype}, {w2.dtype}")
    if ids.dim() != 2 or ids.shape[0] != t or tuple(weights.shape) != tuple(ids.shape):
        raise ValueError(f"weights and ids must both be [{t}, top_k], got {tuple(weights.shape)} and "
                         f"{tuple(ids.shape)}")
    if weights.dtype != torch.float32:
        raise ValueError(f"weights must be float32, got {weights.dtype}")


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, config: MoeKernelConfig | None = None) -> torch.Tensor:
    """The experts' weighted sum per token [T, h] in x's dtype (module docstring; `ops.moe.moe_experts_ref`'s
    contract). `config`: the tiles (default `moe_config`'s)."""
    _check(x, w13, w2, weights, ids)
    t, h = x.shape
    num_experts, inter, top_k = w13.shape[0], w13.shape[1] // 2, ids.shape[1]
    pairs = t * top_k
    if t == 0:
        return torch.zeros_like(x)
    cfg = config or moe_config(pairs, num_experts)
    al = align(ids, num_experts, cfg.block_m)
    m_blocks = al.expert_ids.numel()
    ieee = x.dtype == torch.float32
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(m_blocks, triton.cdiv(inter, cfg.block_n))](
        x, w13, act, al.sorted_ids, al.expert_ids, al.num_post, pairs, inter, h,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOP_K=top_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, IEEE=ieee,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    out = torch.empty(pairs, h, dtype=x.dtype, device=x.device)
    _down_kernel[(m_blocks, triton.cdiv(h, cfg.block_n))](
        act, w2, out, weights.reshape(-1).contiguous(), al.sorted_ids, al.expert_ids, al.num_post, pairs, h, inter,
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, IEEE=ieee,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out.view(t, top_k, h).sum(dim=1)
