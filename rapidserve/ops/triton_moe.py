"""A mixture-of-experts layer's experts as grouped GEMMs in Triton (issue 40), on NVIDIA and AMD alike.

`fused_moe(x, w13, w2, weights, ids)` computes what `ops.moe.moe_experts_ref` does (see ops/moe.py for the
layouts), and `routed_moe(x, logits, w13, w2, top_k, renormalize)` what `ops.moe.moe_layer_ref` does (the routing
too), each in three launches at decode sizes (four or five above ALIGN_ONE_PROGRAM pairs), none of which reads a
device value on the host, with shapes fixed by the batch, so a decode step's CUDA graph captures them:

1. alignment: the T*k (token, slot) pairs sorted by expert, each expert's run padded to a multiple of BLOCK_M
   (`ops.moe.Alignment`, vLLM's moe_align_block_size layout; `ops/triton_moe_align.py`): a stable counting sort
   vectorised over the experts, one program for up to ALIGN_ONE_PROGRAM pairs (decode batches), else two launches
   (per-block counts, then every program's share of the rows), the same bits as `ops.moe.align_block_size`. The
   same launch zeroes the GEMMs' semaphores (below). `routed_moe` routes in it too (`ops/triton_moe_route.py`:
   softmax, top-k and renormalisation of the router's logits, then the alignment of those ids; above
   ALIGN_ONE_PROGRAM pairs a routing launch before the two).
2. gate|up: `_gate_up_kernel`, one program per (m, n) tile and K split of a 1-D grid (`_program_tile`: GROUP_M m
   blocks a group, an L2 swizzle; a tile's splits side by side): one BLOCK_M run of one expert's pairs x BLOCK_N
   features: the pairs' token rows of x gathered (each loaded once per K step for both products), times the
   expert's gate and up tiles (two accumulators, fp32), SiLU(gate) * up in the epilogue, stored at the pairs' rows
   of act [T*k, I]. Programs past the padded total return at once; loads are masked only on a K tail (EVEN_K: none).
3. down: `_down_kernel`, act's rows of the run times the expert's down tile, scaled by each pair's routing weight,
   and the k rows of each token summed into out [T, h] in the same launch (below).

Split K (`GemmTiles.split_k`, from the tuned tables; 1 by default): at decode a few experts x a few N blocks leave
most SMs idle, so a tile's K range may be cut into `splits` programs (`split_plan`: whole BLOCK_K steps each, no
empty split, none past SPLIT_SCRATCH_BYTES of partial sums).

Cross-program sums without atomics on the data (deterministic): a program stores its partial tile (down: each pair's
weighted row, in x's dtype, or fp32 when K is split; gate|up: the fp32 gate and up sums of its split) in a scratch
buffer, then (after a barrier: every thread's stores made before) adds one to a semaphore with acquire-release
atomics at GPU scope: down one per (token, n block) (its rows' tokens: a vector atomic), gate|up one per (m block, n
block). The program whose add brings the count to all the parts (down: top_k x splits; gate|up: splits) reads every
part back from L2 (`.cg`) in a fixed order (split by split, slot by slot) and writes the result (the token's row of
out; SiLU(gate) * up), then sets the semaphore back to 0. So the result does not depend on which program was last,
and graph replays give the eager bits. The semaphores (`semaphores`) are zeroed by the alignment's launch, and left
zero by every launch, so the standalone `launch_gate_up` / `launch_down` (benches, tests) can reuse theirs. One
slot and one split: down stores the token's row directly.

Programmatic dependent launch (NVIDIA compute capability 9.0 and later, where this Triton has `launch_pdl`;
`ops.pdl`, whose rules these kernels keep): gate|up and down are launched so their programs may start before the
launch before them ends (CUDA graphs keep that as a programmatic edge), hiding the gap between the three launches.
Each waits (`gdc_wait`: the launch before complete and its writes visible) before it reads anything; gate|up lets
down's programs start (`gdc_launch_dependents`) after its K loop, before its epilogue and cross-program sums: its grid
may exceed one wave, and down's programs, resident early and waiting, would take the SM slots of gate|up's later
ones (h-moesmall let them start right after the wait: Mixtral's decode layer at batch 1 took 203 us in a graph
against 178 without PDL). down lets the next kernel start after its K loop too. Off on ROCm and in the interpreter;
`pdl=False` turns it off (the bench's A/B).

Every expert's weight is read once per BLOCK_N column block per run of BLOCK_M pairs: at decode, with fewer pairs
than an expert's BLOCK_M, once per step; experts no pair chose are not read at all. The tiles (`MoeKernelConfig`:
BLOCK_M, and each GEMM's BLOCK_N, BLOCK_K, GROUP_M, warps, stages and SPLIT_K) come from `moe_config`: the tuned
table of the device and shape (`ops.moe_tiles`, files in ops/moe_configs/ written by bench/moe_tune.py), else the
untuned rule. The variants (EVEN_K or not, any GROUP_M) give the same bits, split K the same numbers to fp32 rounding
(tests/test_moe_ops.py). fp32 inputs multiply in IEEE fp32 (no TF32), for the CPU checks; bf16/fp16 on the tensor
cores with fp32 sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rapidserve.ops import pdl as pdl_launch
from rapidserve.ops.moe import Alignment
from rapidserve.ops.moe_plan import SPLIT_SCRATCH_BYTES, Split, semaphores, split_plan
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
from rapidserve.ops.triton_moe_route import route_align

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
def _program_tile(pid, num_tiles, num_pid_n, group_m):
    """(m block, n block) of tile `pid` of num_tiles = m blocks x num_pid_n: the m blocks in groups of group_m (the
    last group smaller), each group's tiles m block fastest and the groups one after another, so programs running
    together share the weight tiles of a few n blocks and the rows of a few m blocks in L2 (group_m >= the m blocks:
    every m block of an n block before the next n block)."""
    num_pid_m = num_tiles // num_pid_n
    in_group = group_m * num_pid_n
    first_m = pid // in_group * group_m
    size_m = tl.minimum(num_pid_m - first_m, group_m)
    return first_m + (pid % in_group) % size_m, (pid % in_group) // size_m


@triton.jit
def _split_range(num_pid_n, group_m, splits, split_steps, K, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    """(m block, n block, split, its K range [k_lo, k_hi)) of this program of a 1-D grid of tiles x splits: a tile's
    splits side by side, the tiles in `_program_tile`'s order, each split_steps steps of BLOCK_K (SPLIT off: one
    program a tile, the whole K). k_lo is a product with BLOCK_K, so the compiler knows the K offsets stay aligned
    (vectorised loads; a runtime multiple of unknown alignment cost the sm_90 kernel 255 registers)."""
    if SPLIT:
        tile = tl.program_id(0) // splits
        pid_m, pid_n = _program_tile(tile, tl.num_programs(0) // splits, num_pid_n, group_m)
        pid_s = tl.program_id(0) - tile * splits
        k_lo = pid_s * split_steps * BLOCK_K
        k_hi = tl.minimum(k_lo + split_steps * BLOCK_K, K)
    else:
        pid_m, pid_n = _program_tile(tl.program_id(0), tl.num_programs(0), num_pid_n, group_m)
        pid_s = 0
        k_lo = 0
        k_hi = K
    return pid_m, pid_n, pid_s, k_lo, k_hi


@triton.jit(do_not_specialize=["pairs", "group_m", "splits", "split_steps"])
def _gate_up_kernel(x_ptr, w_ptr, out_ptr, part_ptr, sem_ptr, sorted_ptr, expert_ptr, post_ptr, pairs, N, K, group_m,
                    splits, split_steps, stride_xm, stride_we, stride_wn, stride_om,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN_K: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr, USE_GDC: tl.constexpr):
    """act[pair] = silu(x[token] @ gate[e].T) * (x[token] @ up[e].T) for one run of BLOCK_M pairs of expert e and
    BLOCK_N of its N features, over split s's K range of split_steps steps of BLOCK_K; w [E, 2N, K] (gate rows
    [0, N), up rows [N, 2N)), row-major. Loads are masked only on a K tail (EVEN_K: K % BLOCK_K == 0, none): padding
    rows read token 0's row and columns past N wrap to the first rows of the weight, and neither result is stored.
    SPLIT (more than one split): each split stores its fp32 sums in part [splits, pairs, 2N] and counts itself in
    the tile's semaphore; the split that arrives last sums the splits in split order and applies the epilogue (module
    docstring)."""
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n, pid_s, k_lo, k_hi = _split_range(num_pid_n, group_m, splits, split_steps, K, BLOCK_K, SPLIT)
    if USE_GDC:  # launched early (programmatic dependent launch): the alignment's launch complete and visible first
        tl.extra.cuda.gdc_wait()
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
    if SPLIT:
        a_ptrs += k_lo
        g_ptrs += k_lo
    u_ptrs = g_ptrs + N * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
        else:
            k_ok = offs_k < k_hi - k0
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
    if USE_GDC:  # after the K loop (`ops.pdl`, rule 3): down's programs may start, and wait in turn
        tl.extra.cuda.gdc_launch_dependents()
    mask = row_ok[:, None] & (offs_n < N)[None, :]
    if SPLIT:
        mine = part_ptr + (pid_s * pairs + rows).to(tl.int64)[:, None] * (2 * N) + offs_n[None, :]
        tl.store(mine, acc_g, mask=mask)
        tl.store(mine + N, acc_u, mask=mask)
        tl.debug_barrier()  # every thread's partial sums stored before the semaphore says so (release)
        sem = sem_ptr + pid_m * num_pid_n + pid_n
        last = tl.atomic_add(sem, 1, sem="acq_rel", scope="gpu") == splits - 1
        if last:
            tl.debug_barrier()
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(0, splits):
                part = part_ptr + (s * pairs + rows).to(tl.int64)[:, None] * (2 * N) + offs_n[None, :]
                acc_g += tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
                acc_u += tl.load(part + N, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(sem, 0)  # left zero for the next launch
        mask = tl.where(last, mask, False)  # only the last split stores act
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + offs_n[None, :], act.to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _reduce_tokens(part_ptr, out_ptr, sems, tokens, last, offs_n, n_ok, pairs, N, splits, stride_om,
                   TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    """out[token] = the sum of its TOP_K x splits partial rows (part [splits, pairs, N]; split by split, slot by slot
    within one: a fixed order) for the tokens whose last partial this program wrote; their semaphores back to 0."""
    mask = last[:, None] & n_ok[None, :]
    tokens = tokens.to(tl.int64)
    first = part_ptr + (tokens * TOP_K)[:, None] * N + offs_n[None, :]
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(0, splits if SPLIT else 1):
        ptrs = first + s * pairs * N if SPLIT else first
        for _j in tl.static_range(TOP_K):  # the slots' loads issued together
            total += tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
            ptrs += N
    tl.store(sems, 0, mask=last)  # left zero for the next launch
    tl.store(out_ptr + tokens[:, None] * stride_om + offs_n[None, :], total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["pairs", "group_m", "splits", "split_steps"])
def _down_kernel(a_ptr, w_ptr, out_ptr, part_ptr, sem_ptr, weights_ptr, sorted_ptr, expert_ptr, post_ptr, pairs, N, K,
                 group_m, splits, split_steps, stride_am, stride_we, stride_wn, stride_om,
                 TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, SPLIT: tl.constexpr, REDUCE: tl.constexpr, IEEE: tl.constexpr,
                 USE_GDC: tl.constexpr):
    """weight[pair] * (act[pair] @ down[e].T) for one run of BLOCK_M pairs of expert e and BLOCK_N of the N hidden
    features, over split s's K range (as `_gate_up_kernel`'s); w [E, N, K] row-major, weights [T*k] float32; masks as
    `_gate_up_kernel`'s (padding rows read act's row 0). REDUCE (top_k or splits above 1): stored in part
    [splits, pairs, N], counted in the semaphore of each (token, n block), and the program that brings a token's
    count to top_k x splits sums its partial rows into out [T, N] (`_reduce_tokens`); else (one slot, one split) the
    product is the token's row of out."""
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n, pid_s, k_lo, k_hi = _split_range(num_pid_n, group_m, splits, split_steps, K, BLOCK_K, SPLIT)
    if USE_GDC:  # launched early: gate|up's launch complete and visible first
        tl.extra.cuda.gdc_wait()
    if pid_m * BLOCK_M >= tl.load(post_ptr):
        return
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + tl.where(row_ok, rows, 0).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = w_ptr + e * stride_we + (offs_n % N)[None, :] * stride_wn + offs_k[:, None]
    if SPLIT:
        a_ptrs += k_lo
        b_ptrs += k_lo
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = offs_k < k_hi - k0
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision="ieee") if IEEE else tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if USE_GDC:  # after the K loop (`ops.pdl`, rule 3)
        tl.extra.cuda.gdc_launch_dependents()
    acc = acc * tl.load(weights_ptr + rows, mask=row_ok, other=0.0)[:, None]
    n_ok = offs_n < N
    mask = row_ok[:, None] & n_ok[None, :]
    if REDUCE:
        part_rows = (pid_s * pairs + rows) if SPLIT else rows
        tl.store(part_ptr + part_rows.to(tl.int64)[:, None] * N + offs_n[None, :], acc.to(part_ptr.dtype.element_ty),
                 mask=mask)
        tl.debug_barrier()  # every thread's partial rows stored before the semaphores say so (release)
        tokens = rows // TOP_K
        sems = sem_ptr + tokens * num_pid_n + pid_n
        last = (tl.atomic_add(sems, 1, mask=row_ok, sem="acq_rel", scope="gpu") == TOP_K * splits - 1) & row_ok
        if tl.max(last.to(tl.int32), axis=0) > 0:
            tl.debug_barrier()
            _reduce_tokens(part_ptr, out_ptr, sems, tokens, last, offs_n, n_ok, pairs, N, splits, stride_om, TOP_K,
                           BLOCK_M, BLOCK_N, SPLIT)
    else:
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> None:
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


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> None:
    _check_experts(x, w13, w2)
    t = x.shape[0]
    if ids.dim() != 2 or ids.shape[0] != t or tuple(weights.shape) != tuple(ids.shape):
        raise ValueError(f"weights and ids must both be [{t}, top_k], got {tuple(weights.shape)} and "
                         f"{tuple(ids.shape)}")
    if weights.dtype != torch.float32:
        raise ValueError(f"weights must be float32, got {weights.dtype}")


def _group_m(tiles: GemmTiles, m_blocks: int) -> int:
    return min(tiles.group_m, m_blocks)  # keeps group_m * n blocks within the grid (int32 in the kernel)


def _sems(sems: torch.Tensor | None, need: int, device: torch.device) -> torch.Tensor:
    """The caller's zeroed semaphores (at least `need`), else new zeros (standalone launches: the benches, tests)."""
    if sems is None:
        return torch.zeros(max(need, 1), dtype=torch.int32, device=device)
    if sems.dtype != torch.int32 or sems.numel() < need:
        raise ValueError(f"semaphores must be int32 of at least {need} elements, got {sems.dtype} x {sems.numel()}")
    return sems


def launch_gate_up(x: torch.Tensor, w13: torch.Tensor, act: torch.Tensor, al: Alignment, top_k: int, block_m: int,
                   tiles: GemmTiles, even_k: bool | None = None, sems: torch.Tensor | None = None,
                   pdl: bool | None = None) -> None:
    """act [pairs, I] = SiLU(gate) * up of every pair's token row of x (`_gate_up_kernel`); `even_k` (default:
    whether K % BLOCK_K == 0) picks the unmasked K loop: forcing it off is for the tests. Where `tiles` split K:
    `sems` (int32, zero, at least the tiles; left zero) count the splits, new zeros when None. `pdl`: programmatic
    dependent launch (`ops.pdl.use_pdl`; the module docstring)."""
    pairs, inter, h = act.shape[0], act.shape[1], x.shape[1]
    m_blocks = al.expert_ids.numel()
    n_blocks = triton.cdiv(inter, tiles.block_n)
    split = split_plan(h, tiles, pairs, 2 * inter)
    part = sem = act
    if split.splits > 1:
        part = torch.empty(split.splits, pairs, 2 * inter, dtype=torch.float32, device=x.device)
        sem = _sems(sems, m_blocks * n_blocks, x.device)
    _gate_up_kernel[(m_blocks * n_blocks * split.splits,)](
        x, w13, act, part, sem, al.sorted_ids, al.expert_ids, al.num_post, pairs, inter, h, _group_m(tiles, m_blocks),
        split.splits, split.k_split // tiles.block_k, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        EVEN_K=h % tiles.block_k == 0 if even_k is None else even_k, SPLIT=split.splits > 1,
        IEEE=x.dtype == torch.float32, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **pdl_launch.launch_options(pdl_launch.use_pdl(pdl, x.device)))


def launch_down(act: torch.Tensor, w2: torch.Tensor, out: torch.Tensor, weights: torch.Tensor, al: Alignment,
                top_k: int, block_m: int, tiles: GemmTiles, even_k: bool | None = None,
                sems: torch.Tensor | None = None, pdl: bool | None = None) -> None:
    """out [T, h] = for each token the sum over its top_k pairs of the pair's routing weight (`weights` [pairs]
    float32) times its act row @ down[e].T (`_down_kernel`, which sums them too); `even_k` as `launch_gate_up`'s.
    Where a token has more than one partial row (top_k x splits > 1): `sems` (int32, zero, at least T x the n
    blocks; left zero) count them, new zeros when None. `pdl` as `launch_gate_up`'s."""
    pairs, h, inter = act.shape[0], out.shape[1], act.shape[1]
    if out.shape[0] * top_k != pairs:
        raise ValueError(f"out must be [{pairs // top_k}, {h}] for {pairs} pairs of top_k {top_k}, got "
                         f"{tuple(out.shape)}")
    m_blocks = al.expert_ids.numel()
    n_blocks = triton.cdiv(h, tiles.block_n)
    split = split_plan(inter, tiles, pairs, h)
    reduce = top_k * split.splits > 1
    part = sem = out
    if reduce:
        part_dtype = torch.float32 if split.splits > 1 else out.dtype
        part = torch.empty(split.splits, pairs, h, dtype=part_dtype, device=out.device)
        sem = _sems(sems, out.shape[0] * n_blocks, out.device)
    _down_kernel[(m_blocks * n_blocks * split.splits,)](
        act, w2, out, part, sem, weights, al.sorted_ids, al.expert_ids, al.num_post, pairs, h, inter,
        _group_m(tiles, m_blocks), split.splits, split.k_split // tiles.block_k, act.stride(0), w2.stride(0),
        w2.stride(1), out.stride(0), TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        EVEN_K=inter % tiles.block_k == 0 if even_k is None else even_k, SPLIT=split.splits > 1, REDUCE=reduce,
        IEEE=act.dtype == torch.float32, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **pdl_launch.launch_options(pdl_launch.use_pdl(pdl, out.device)))


def experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, al: Alignment, top_k: int,
            cfg: MoeKernelConfig, sems: torch.Tensor, pdl: bool | None = None) -> torch.Tensor:
    """The two grouped GEMMs on an alignment: [T, h]. `sems`: `semaphores`' counts (gate|up's first), zero."""
    t, h = x.shape
    pairs, inter = t * top_k, w13.shape[1] // 2
    gate_up, _ = semaphores(cfg, t, top_k, w13.shape[0], inter, h)
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    launch_gate_up(x, w13, act, al, top_k, cfg.block_m, cfg.gate_up, sems=sems[:gate_up], pdl=pdl)
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    launch_down(act, w2, out, weights.reshape(-1), al, top_k, cfg.block_m, cfg.down, sems=sems[gate_up:], pdl=pdl)
    return out


def _new_sems(cfg: MoeKernelConfig, t: int, top_k: int, num_experts: int, inter: int, h: int,
              device: torch.device) -> torch.Tensor:
    """Room for the semaphores, uninitialised: the alignment's launch zeroes them."""
    return torch.empty(sum(semaphores(cfg, t, top_k, num_experts, inter, h)), dtype=torch.int32, device=device)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, config: MoeKernelConfig | None = None, tables: MoeTables | None = None,
              pdl: bool | None = None) -> torch.Tensor:
    """The experts' weighted sum per token [T, h] in x's dtype (module docstring; `ops.moe.moe_experts_ref`'s
    contract). `config`: the tiles (default `moe_config`'s from `tables`, default the packaged ones); `pdl`:
    programmatic dependent launch of the two GEMMs (`ops.pdl.use_pdl`: default where the GPU has it)."""
    _check(x, w13, w2, weights, ids)
    t, h = x.shape
    num_experts, inter, top_k = w13.shape[0], w13.shape[1] // 2, ids.shape[1]
    if t == 0:
        return torch.zeros_like(x)
    cfg = config or moe_config(t * top_k, num_experts, inter, h, x.dtype, x.device, tables)
    sems = _new_sems(cfg, t, top_k, num_experts, inter, h, x.device)
    al = align(ids, num_experts, cfg.block_m, zero=sems)
    return experts(x, w13, w2, weights.contiguous(), al, top_k, cfg, sems, pdl)


def routed_moe(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
               renormalize: bool, config: MoeKernelConfig | None = None, tables: MoeTables | None = None,
               pdl: bool | None = None) -> torch.Tensor:
    """The MoE layer from its router's logits [T, E]: `ops.moe.moe_layer_ref`'s contract (`ops.moe.route`, then the
    experts), in three launches at decode sizes (routing + alignment + zeroed semaphores in one,
    `triton_moe_route.route_align`; gate|up; down with the top-k sum). `config`, `tables`, `pdl` as `fused_moe`'s."""
    _check_experts(x, w13, w2)
    t, h = x.shape
    if logits.dim() != 2 or logits.shape[0] != t or logits.shape[1] != w13.shape[0]:
        raise ValueError(f"logits must be [{t}, {w13.shape[0]}] (tokens, experts), got {tuple(logits.shape)}")
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}] (the experts), got {top_k}")
    if t == 0:
        return torch.zeros_like(x)
    cfg = config or moe_config(t * top_k, num_experts, inter, h, x.dtype, x.device, tables)
    sems = _new_sems(cfg, t, top_k, num_experts, inter, h, x.device)
    weights, _, al = route_align(logits, top_k, renormalize, cfg.block_m, zero=sems)
    return experts(x, w13, w2, weights, al, top_k, cfg, sems, pdl)


__all__ = ["ALIGN_ONE_PROGRAM", "SPLIT_SCRATCH_BYTES", "TUNED", "Split", "align", "device_name", "experts",
           "fused_moe", "launch_down", "launch_gate_up", "moe_config", "routed_moe", "semaphores", "split_plan"]
