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
2. gate|up (`ops/triton_moe_gemm.py`'s `_gate_up_kernel`; its grid, its TMA and persistent variants:
   `ops/triton_moe_grid.py`): one BLOCK_M run of one expert's pairs x BLOCK_N features: the pairs' token rows of x
   gathered (each loaded once per K step for both products), times the expert's gate and up tiles (two accumulators,
   fp32), SiLU(gate) * up in the epilogue, stored at the pairs' rows of act [T*k, I].
3. down (`_down_kernel`, the same module): act's rows of the run times the expert's down tile, scaled by each pair's
   routing weight, and the k rows of each token summed into out [T, h] in the same launch (below).

Split K (`GemmTiles.split_k`, from the tuned tables; 1 by default): at decode a few experts x a few N blocks leave
most SMs idle, so a tile's K range may be cut into `splits` programs (`split_plan`: whole BLOCK_K steps each, no
empty split, none past SPLIT_SCRATCH_BYTES of partial sums).

Tail blocks (`MoeKernelConfig.tail_m`, a table's TAIL_BLOCK_M; 0 by default: all of the above unchanged): at
prefill a BLOCK_M of 64-128 leaves each expert a last, partly empty tile (Qwen3-30B-A3B at 4096 tokens: ~20% of the
MMA work padding). With it the alignment pads each run to the tail block only and lists each expert's full BLOCK_M
tiles and its remaining tail blocks (`ops.moe.TailBlocks`; always the two-launch alignment, after a separate routing
launch in `routed_moe`), and each GEMM runs twice on its tiles, the full tiles at BLOCK_M, then the tail blocks at
TAIL_BLOCK_M. down's top-k sum spans the two launches: they share the partial rows and the per-token semaphores, so
a token's last partial, in either launch, sums all of them in slot order: the same bits as one launch.

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
against 178 without PDL). down lets the next kernel start after its K loop too; a persistent program of either after
its last tile's K loop (`triton_moe_gemm.py`). Off on ROCm and in the interpreter; `pdl=False` turns it off (the
bench's A/B).

Every expert's weight is read once per BLOCK_N column block per run of BLOCK_M pairs: at decode, with fewer pairs
than an expert's BLOCK_M, once per step; experts no pair chose are not read at all. The tiles (`MoeKernelConfig`:
BLOCK_M, and each GEMM's BLOCK_N, BLOCK_K, GROUP_M, warps, stages, SPLIT_K, TMA and PERSISTENT) come from
`moe_config`: the tuned table of the device and shape (`ops.moe_tiles`, files in ops/moe_configs/ written by
bench/moe_tune.py), else the untuned rule. The variants give the same bits, split K the same numbers to fp32
rounding (`triton_moe_gemm.py`; tests/test_moe_ops.py).
"""

from __future__ import annotations

import torch

from rapidserve.ops.moe import Alignment, TailBlocks
from rapidserve.ops.moe_plan import SPLIT_SCRATCH_BYTES, Split, semaphores, split_plan
from rapidserve.ops.moe_tiles import (
    MoeKernelConfig,
    MoeTables,
    TableKey,
    load_tables,
    lookup,
    rule_config,
)
from rapidserve.ops.triton_moe_align import ONE_PROGRAM as ALIGN_ONE_PROGRAM
from rapidserve.ops.triton_moe_align import align, align_into, align_tails, empty_alignment, empty_tails
from rapidserve.ops.triton_moe_gemm import launch_down, launch_gate_up
from rapidserve.ops.triton_moe_route import route_align

TUNED: MoeTables = load_tables()  # the packaged tables, validated once at import (read-only)


def device_name(device: torch.device) -> str:
    """The name tuned tables are keyed by: torch.cuda.get_device_name on a GPU (no device read), else the device
    type (the interpreter's "cpu", the compile check's "meta"), which no packaged table names."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def table_key(num_experts: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> TableKey:
    """The key of the tuned table for E experts of intermediate size n and hidden size k in `dtype` on `device`."""
    return TableKey(device_name(device), num_experts, n, k, str(dtype).removeprefix("torch."))


def moe_config(pairs: int, num_experts: int, n: int, k: int, dtype: torch.dtype, device: torch.device,
               tables: MoeTables | None = None) -> MoeKernelConfig:
    """Tiles for `pairs` (token, slot) pairs over `num_experts` experts of intermediate size n and hidden size k:
    the tuned table of (this device, E, N, K, dtype) (`tables`, default the packaged ones; `ops.moe_tiles`), else
    the untuned rule."""
    tables = TUNED if tables is None else tables
    hip = torch.version.hip is not None
    if not tables:
        return rule_config(pairs, num_experts, hip)
    return lookup(tables, table_key(num_experts, n, k, dtype, device), pairs, hip)


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


def experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, al: Alignment, top_k: int,
            cfg: MoeKernelConfig, sems: torch.Tensor, pdl: bool | None = None,
            tails: TailBlocks | None = None) -> torch.Tensor:
    """The two grouped GEMMs on an alignment: [T, h]. `sems`: `semaphores`' counts (gate|up's first), zero.
    `tails`: the block lists where cfg has a TAIL_BLOCK_M (`al` then aligned at it): each GEMM in two launches."""
    t, h = x.shape
    if bool(cfg.tail_m) != (tails is not None):  # the semaphores below are sized for the launches cfg names
        raise ValueError(f"cfg's TAIL_BLOCK_M {cfg.tail_m} needs the block lists (tails) of an alignment at it, and "
                         f"only it: got tails={'None' if tails is None else 'lists'} (`align_tails`)")
    pairs, inter = t * top_k, w13.shape[1] // 2
    gate_up, _ = semaphores(cfg, t, top_k, w13.shape[0], inter, h)
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    launch_gate_up(x, w13, act, al, top_k, cfg.block_m, cfg.gate_up, sems=sems[:gate_up], pdl=pdl, tails=tails)
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    launch_down(act, w2, out, weights.reshape(-1), al, top_k, cfg.block_m, cfg.down, sems=sems[gate_up:], pdl=pdl,
                tails=tails)
    return out


def _new_tails(cfg: MoeKernelConfig, pairs: int, num_experts: int, device: torch.device) -> TailBlocks | None:
    """The block lists' buffers where cfg has a TAIL_BLOCK_M, else None."""
    return empty_tails(pairs, num_experts, cfg.block_m, cfg.tail_m, device) if cfg.tail_m else None


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
    tails = _new_tails(cfg, t * top_k, num_experts, x.device)
    al = align_into(ids, num_experts, cfg.align_m, empty_alignment(t * top_k, num_experts, cfg.align_m, x.device),
                    zero=sems, tails=tails)
    return experts(x, w13, w2, weights.contiguous(), al, top_k, cfg, sems, pdl, tails)


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
    tails = _new_tails(cfg, t * top_k, num_experts, x.device)
    weights, _, al = route_align(logits, top_k, renormalize, cfg.align_m, zero=sems, tails=tails)
    return experts(x, w13, w2, weights, al, top_k, cfg, sems, pdl, tails)


__all__ = ["ALIGN_ONE_PROGRAM", "SPLIT_SCRATCH_BYTES", "TUNED", "Split", "align", "align_tails", "device_name",
           "experts",
           "fused_moe", "launch_down", "launch_gate_up", "moe_config", "routed_moe", "semaphores", "split_plan"]
