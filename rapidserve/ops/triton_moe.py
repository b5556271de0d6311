"""A mixture-of-experts layer's experts as grouped GEMMs in Triton (issue 40), on NVIDIA and AMD alike.

`fused_moe(x, w13, w2, weights, ids)` computes what `ops.moe.moe_experts_ref` does (see ops/moe.py for the
layouts) in four steps (four launches; five above ALIGN_ONE_PROGRAM pairs), none of which reads a device value on
the host, with shapes fixed by the batch, so a decode step's CUDA graph captures it:

1. alignment: the T*k (token, slot) pairs sorted by expert, each expert's run padded to a multiple of BLOCK_M
   (`ops.moe.Alignment`, vLLM's moe_align_block_size layout; `ops/triton_moe_align.py`): a stable counting sort
   vectorised over the experts, one program for up to ALIGN_ONE_PROGRAM pairs (decode batches), else two launches
   (per-block counts, then every program's share of the rows), the same bits as `ops.moe.align_block_size`.
2. gate|up: `_gate_up_kernel`, one program per (m, n) tile of a 1-D grid (`_program_tile`: GROUP_M m blocks a
   group, an L2 swizzle): one BLOCK_M run of one expert's pairs x BLOCK_N features: the pairs' token rows of x
   gathered (each loaded once per K step for both products), times the expert's gate and up tiles (two
   accumulators, fp32), SiLU(gate) * up in the epilogue, stored at the pairs' rows of act [T*k, I]. Programs past
   the padded total return at once; loads are masked only on a K tail (EVEN_K: none).
3. down: `_down_kernel`, act's rows of the run times the expert's down tile, scaled by each pair's routing
   weight, stored at the pairs' rows of out [T*k, h].
4. the k rows of each token summed (torch), in a fixed order: no atomics, so results are deterministic.

Every expert's weight is read once per BLOCK_N column block per run of BLOCK_M pairs: at decode, with fewer pairs
than an expert's BLOCK_M, once per step; experts no pair chose are not read at all. The tiles (`MoeKernelConfig`:
BLOCK_M, and each GEMM's BLOCK_N, BLOCK_K, GROUP_M, warps and stages) come from `moe_config`: the tuned table of
the device and shape (`ops.moe_tiles`, files in ops/moe_configs/ written by bench/moe_tune.py), else the untuned
rule. The variants (EVEN_K or not, any GROUP_M) give the same bits (tests/test_moe_ops.py). fp32 inputs multiply
in IEEE fp32 (no TF32), for the CPU checks; bf16/fp16 on the tensor cores with fp32 sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rapidserve.ops.moe import Alignment
from rapidserve.ops.moe_tiles import (
    GemmTiles,
    MoeKernelConfig,
    MoeTables,
    TableKey,
    load_tables,
    lookup,
    rule_config,
)
from rapidserve.ops.triton_moe_align import ONE_PROGRAM as ALIGN_ONE_PROGRAM
from rapidserve.ops.triton_moe_align import align

TUNED: MoeTables = load_tables()  # the packaged tables, validated once at import (read-only)


def device_name(device: torch.device) -> str:
    """The name tuned tables are keyed by: torch.cuda.get_device_name on a GPU (no device read), else the device
    type (the interpreter's "cpu", the compile check's "meta"), which no packaged table names."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def moe_config(pairs: int, num_experts: int, n: int, k: int, dtype: torch.dtype, device: torch.device,
               tables: MoeTables | None = None) -> MoeKernelConfig:
    """Tiles for `pairs` (token, slot) pairs over `num_experts` experts of intermediate size n and hidden size k:
    the tuned table of (this device, E, N, K, dtype) (`tables`, default the packaged ones; `ops.moe_tiles`), else
    the untuned rule."""
    tables = TUNED if tables is None else tables
    hip = torch.version.hip is not None
    if not tables:
        return rule_config(pairs, num_experts, hip)
    return lookup(tables, TableKey(device_name(device), num_experts, n, k, str(dtype).removeprefix("torch.")), pairs,
                  hip)


@triton.jit
def _program_tile(num_pid_n, group_m):
    """(m block, n block) of this program of a 1-D grid of m blocks x num_pid_n: the m blocks in groups of group_m
    (the last group smaller), each group's programs m block fastest and the groups one after another, so programs
    running together share the weight tiles of a few n blocks and the rows of a few m blocks in L2 (group_m >= the
    m blocks: every m block of an n block before the next n block)."""
    pid = tl.program_id(0)
    num_pid_m = tl.num_programs(0) // num_pid_n
    in_group = group_m * num_pid_n
    first_m = pid // in_group * group_m
    size_m = tl.minimum(num_pid_m - first_m, group_m)
    return first_m + (pid % in_group) % size_m, (pid % in_group) // size_m


@triton.jit(do_not_specialize=["pairs", "group_m"])
def _gate_up_kernel(x_ptr, w_ptr, out_ptr, sorted_ptr, expert_ptr, post_ptr, pairs, N, K, group_m,
                    stride_xm, stride_we, stride_wn, stride_om,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN_K: tl.constexpr, IEEE: tl.constexpr):
    """act[pair] = silu(x[token] @ gate[e].T) * (x[token] @ up[e].T) for one run of BLOCK_M pairs of expert e and
    BLOCK_N of its N features; w [E, 2N, K] (gate rows [0, N), up rows [N, 2N)), row-major. Loads are masked only
    on a K tail (EVEN_K: K % BLOCK_K == 0, none): padding rows read token 0's row and columns past N wrap to the
    first rows of the weight, and neither result is stored."""
    pid_m, pid_n = _program_tile(tl.cdiv(N, BLOCK_N), group_m)
    if pid_m * BLOCK_M >= tl.load(post_ptr):
        return
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < pairs
    tokens = tl.where(row_ok, rows // TOP_K, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_xm + offs_k[None, :]
    g_ptrs = w_ptr + e * stride_we + (offs_n % N)[None, :] * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + N * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
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
    tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n < N)[None, :])


@triton.jit(do_not_specialize=["pairs", "group_m"])
def _down_kernel(a_ptr, w_ptr, out_ptr, weights_ptr, sorted_ptr, expert_ptr, post_ptr, pairs, N, K, group_m,
                 stride_am, stride_we, stride_wn, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 IEEE: tl.constexpr):
    """out[pair] = weight[pair] * (act[pair] @ down[e].T) for one run of BLOCK_M pairs of expert e and BLOCK_N of
    the N hidden features; w [E, N, K] row-major, weights [T*k] float32. Masks as `_gate_up_kernel`'s (padding
    rows read act's row 0)."""
    pid_m, pid_n = _program_tile(tl.cdiv(N, BLOCK_N), group_m)
    if pid_m * BLOCK_M >= tl.load(post_ptr):
        return
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + tl.where(row_ok, rows, 0).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = w_ptr + e * stride_we + (offs_n % N)[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision="ieee") if IEEE else tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    acc = acc * tl.load(weights_ptr + rows, mask=row_ok, other=0.0)[:, None]
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n < N)[None, :])


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


def _group_m(tiles: GemmTiles, m_blocks: int) -> int:
    return min(tiles.group_m, m_blocks)  # keeps group_m * n blocks within the grid (int32 in the kernel)


def launch_gate_up(x: torch.Tensor, w13: torch.Tensor, act: torch.Tensor, al: Alignment, top_k: int, block_m: int,
                   tiles: GemmTiles, even_k: bool | None = None) -> None:
    """act [pairs, I] = SiLU(gate) * up of every pair's token row of x (`_gate_up_kernel`); `even_k` (default:
    whether K % BLOCK_K == 0) picks the unmasked K loop: forcing it off is for the tests."""
    pairs, inter, h = act.shape[0], act.shape[1], x.shape[1]
    m_blocks = al.expert_ids.numel()
    _gate_up_kernel[(m_blocks * triton.cdiv(inter, tiles.block_n),)](
        x, w13, act, al.sorted_ids, al.expert_ids, al.num_post, pairs, inter, h, _group_m(tiles, m_blocks),
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        EVEN_K=h % tiles.block_k == 0 if even_k is None else even_k, IEEE=x.dtype == torch.float32,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def launch_down(act: torch.Tensor, w2: torch.Tensor, out: torch.Tensor, weights: torch.Tensor, al: Alignment,
                block_m: int, tiles: GemmTiles, even_k: bool | None = None) -> None:
    """out [pairs, h] = each pair's routing weight (`weights` [pairs] float32) times its act row @ down[e].T
    (`_down_kernel`); `even_k` as `launch_gate_up`'s."""
    pairs, h, inter = out.shape[0], out.shape[1], act.shape[1]
    m_blocks = al.expert_ids.numel()
    _down_kernel[(m_blocks * triton.cdiv(h, tiles.block_n),)](
        act, w2, out, weights, al.sorted_ids, al.expert_ids, al.num_post, pairs, h, inter, _group_m(tiles, m_blocks),
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        EVEN_K=inter % tiles.block_k == 0 if even_k is None else even_k, IEEE=act.dtype == torch.float32,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, config: MoeKernelConfig | None = None, tables: MoeTables | None = None,
              ) -> torch.Tensor:
    """The experts' weighted sum per token [T, h] in x's dtype (module docstring; `ops.moe.moe_experts_ref`'s
    contract). `config`: the tiles (default `moe_config`'s from `tables`, default the packaged ones)."""
    _check(x, w13, w2, weights, ids)
    t, h = x.shape
    num_experts, inter, top_k = w13.shape[0], w13.shape[1] // 2, ids.shape[1]
    pairs = t * top_k
    if t == 0:
        return torch.zeros_like(x)
    cfg = config or moe_config(pairs, num_experts, inter, h, x.dtype, x.device, tables)
    al = align(ids, num_experts, cfg.block_m)
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    launch_gate_up(x, w13, act, al, top_k, cfg.block_m, cfg.gate_up)
    out = torch.empty(pairs, h, dtype=x.dtype, device=x.device)
    launch_down(act, w2, out, weights.reshape(-1).contiguous(), al, cfg.block_m, cfg.down)
    return out.view(t, top_k, h).sum(dim=1)


__all__ = ["ALIGN_ONE_PROGRAM", "TUNED", "align", "device_name", "fused_moe", "launch_down", "launch_gate_up",
           "moe_config"]
