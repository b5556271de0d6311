"""The program grid of the fused MoE layer's two grouped GEMMs (`ops/triton_moe_gemm.py`: the kernels and their
launches) and how the weights reach them: the device helpers both kernels call (`_program_tile`, `_split_range`,
`_first_row`, `_filled`) and the host side of their launches (`grid_size`, `sm_count`, `m_lists`, `use_tma` and the
weights' descriptor, the semaphores).

The program grid. By default one program a (m block, n block) tile (and K split) of a 1-D grid over every tile the
alignment could fill (`_program_tile`: GROUP_M m blocks a group, an L2 swizzle; a tile's splits side by side);
programs past the padded total return at once. PERSISTENT (`GemmTiles.persistent` = n > 0, whole tiles only: no
split K) launches min(tiles, n x the SMs) programs instead, each looping over the tiles the alignment did fill (its
padded total / BLOCK_M m blocks x the n blocks: read on the device, so the grid stays fixed for a CUDA graph) in the
same swizzled order, program p taking tiles p, p + programs, ...: no launch waves, no program start-up a tile (each
GEMM's tile loop: `triton_moe_gemm.py`).

Tail blocks (`triton_moe_gemm.py`'s `launch_gate_up` / `launch_down` with `tails`, `ops.moe.TailBlocks`; the
launches' lists: `m_lists`): two launches of each kernel with LISTS, the first over the experts' full BLOCK_M tiles,
the second at BLOCK_M = the tail block over the rest; a tile's first row and expert come from the list
(`_first_row`), the filled count from the list's (`_filled`), so grids stay fixed by the pairs count. Without
LISTS the kernels compute pid_m x BLOCK_M and the padded total / BLOCK_M as before.

The weights (the B operand: dense per expert). By pointer loads (cp.async on Hopper), or with TMA (`GemmTiles.tma`
1, NVIDIA compute capability 9.0 and later, rows of 16-byte multiples at a 16-byte aligned base: `use_tma`) through a
host-built tensor descriptor of w viewed [E * rows, K] (gate|up: the gate tile at row e * 2N + n0, the up tile N rows
further; down: e * h + n0), box [BLOCK_N, BLOCK_K]: one thread issues each tile's copy, no per-thread addresses, and
the copy zero-fills past K (no K mask on B); a box past N reads the next expert's rows (or zeros past the last),
whose results are not stored, as the pointer path's wrapped columns are not. ROCm takes the pointer loads whatever
the table says. The gathered x / act rows stay pointer loads (Hopper's TMA has no row gather).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from rapidserve.ops.moe import Alignment, TailBlocks
from rapidserve.ops.moe_tiles import GemmTiles

OFF_GPU_SMS = 3  # the "SMs" a persistent grid is sized for off a GPU (the interpreter: a few programs, many tiles each)


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


@triton.jit
def _first_row(start_ptr, pid_m, BLOCK_M: tl.constexpr, LISTS: tl.constexpr):
    """The first row of sorted_ids of m block pid_m: its entry of a `TailBlocks` list (LISTS), else pid_m x BLOCK_M."""
    return tl.load(start_ptr + pid_m) if LISTS else pid_m * BLOCK_M


@triton.jit
def _filled(post_ptr, BLOCK_M: tl.constexpr, LISTS: tl.constexpr):
    """The m blocks the alignment filled: a `TailBlocks` count (LISTS), else the padded total / BLOCK_M."""
    return tl.load(post_ptr) if LISTS else tl.load(post_ptr) // BLOCK_M


def _group_m(tiles: GemmTiles, m_blocks: int) -> int:
    return min(tiles.group_m, m_blocks)  # keeps group_m * n blocks within the grid (int32 in the kernel)


def _sems(sems: torch.Tensor | None, need: int, device: torch.device) -> torch.Tensor:
    """The caller's zeroed semaphores (at least `need`), else new zeros (standalone launches: the benches, tests)."""
    if sems is None:
        return torch.zeros(max(need, 1), dtype=torch.int32, device=device)
    if sems.dtype != torch.int32 or sems.numel() < need:
        raise ValueError(f"semaphores must be int32 of at least {need} elements, got {sems.dtype} x {sems.numel()}")
    return sems


def use_tma(tiles: GemmTiles, w: torch.Tensor) -> bool:
    """Whether a launch reads the weights `w` [E, rows, K] by TMA (module docstring): the tiles ask for it, the
    platform is NVIDIA's at compute capability 9.0 or later (or the interpreter's, or the compile check's meta
    tensors), and the rows are 16-byte multiples at a 16-byte aligned base."""
    if not tiles.tma or torch.version.hip is not None:
        return False
    if w.device.type == "cuda" and torch.cuda.get_device_capability(w.device)[0] < 9:
        return False
    return (w.shape[-1] * w.element_size()) % 16 == 0 and w.data_ptr() % 16 == 0


def _weights_arg(w: torch.Tensor, tiles: GemmTiles, tma: bool) -> torch.Tensor | TensorDescriptor:
    """The kernels' w_desc: a TMA descriptor of w [E, rows, K] viewed [E * rows, K], box [BLOCK_N, BLOCK_K]; else w
    itself (unused: the kernel takes w_ptr)."""
    if not tma:
        return w
    flat = w.view(-1, w.shape[-1])
    return TensorDescriptor(flat, list(flat.shape), [flat.stride(0), 1], [tiles.block_n, tiles.block_k])


def sm_count(device: torch.device) -> int:
    """SMs (CUs on ROCm) a persistent grid is sized for: the GPU's, else OFF_GPU_SMS. The whole GPU's, as
    decode attention's split rule counts them, not a green-context partition's: on a prefill partition of fewer SMs the
    grid's programs queue (correct, but a second, partial wave), and the tuner measured on the whole GPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return OFF_GPU_SMS


def grid_size(tiles: GemmTiles, m_blocks: int, n_blocks: int, splits: int, device: torch.device) -> int:
    """Programs of one GEMM launch: a tile's splits each (one program a tile without split K), or with PERSISTENT
    (and one split) persistent x the SMs, at most the tiles."""
    if tiles.persistent and splits == 1:
        return min(m_blocks * n_blocks, tiles.persistent * sm_count(device))
    return m_blocks * n_blocks * splits


def m_lists(al: Alignment, block_m: int, tails: TailBlocks | None,
            ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, bool]]:
    """Each launch of a grouped GEMM: (block starts, their experts, the filled count, BLOCK_M, LISTS). One launch
    over the alignment's BLOCK_M blocks; with `tails` (`ops.moe.TailBlocks`, `al` aligned at its tail block) the
    full tiles' list at block_m, then the tail blocks' list at tails.tail_m."""
    if tails is None:
        return [(al.sorted_ids, al.expert_ids, al.num_post, block_m, False)]
    if tails.block_m != block_m or al.expert_ids.numel() * tails.tail_m != al.sorted_ids.numel():
        raise ValueError(f"tail block lists of BLOCK_M {tails.block_m} / tail {tails.tail_m} for a launch at "
                         f"BLOCK_M {block_m} over an alignment of {al.sorted_ids.numel()} rows in "
                         f"{al.expert_ids.numel()} blocks: align at the tail block (`align_tails`)")
    return [(tails.main_starts, tails.main_experts, tails.counts[:1], block_m, True),
            (tails.tail_starts, tails.tail_experts, tails.counts[1:], tails.tail_m, True)]


__all__ = ["OFF_GPU_SMS", "grid_size", "m_lists", "sm_count", "use_tma"]
