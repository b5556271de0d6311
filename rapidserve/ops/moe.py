"""Mixture-of-experts ops in plain torch (issue 40): routing, the reference expert computation, and the
token alignment the fused Triton kernels (`ops/triton_moe.py`) read.

- ``route(logits [T, E], top_k, renormalize) -> (weights [T, k] float32, ids [T, k] int32)``: softmax over all
  experts in float32, the top k, renormalised to sum to 1 when asked (Mixtral always; Qwen3-MoE when its
  `norm_topk_prob`). Renormalised top-k of the softmax is the softmax over the top-k logits.
- ``moe_experts_ref(x [T, h], w13 [E, 2I, h], w2 [E, h, I], weights, ids) -> [T, h]``: each expert a SwiGLU,
  ``w2[e] @ (silu(x @ gate[e].T) * (x @ up[e].T))`` with gate|up stacked in ``w13[e]`` (rows [0, I) gate, [I, 2I)
  up), the outputs of a token's k experts weighted and summed. A loop over experts, as transformers' eager
  experts: for the CPU and for checking the kernels (it reads the routing on the host, so it is no CUDA-graph
  path).
- ``moe_layer_ref(x, logits [T, E], w13, w2, top_k, renormalize) -> [T, h]``: the layer from its router's logits,
  `route` then `moe_experts_ref` (the torch bundle's `Ops.moe_layer`; the Triton one's routes in its kernels,
  `triton_moe.routed_moe`).
- ``align_block_size(ids, num_experts, block_m) -> Alignment``: the (token, slot) pairs sorted by expert, each
  expert's run padded to a multiple of `block_m` (see `Alignment`), from torch ops on the device without a host
  read: the reference that the Triton alignment (`ops/triton_moe_align.py`, which `triton_moe` runs) equals bit
  for bit (tests/test_moe_align.py).
- ``TailBlocks``: with a tile table's TAIL_BLOCK_M (`MoeKernelConfig.tail_m`) the alignment pads each run to the
  tail block only and also lists each expert's full BLOCK_M tiles (the GEMMs' main launch) and the tail blocks of
  its remainder (their second launch), so an expert pads at most TAIL_BLOCK_M - 1 rows instead of BLOCK_M - 1;
  `tail_blocks_ref` is the reference of those lists (tests).

Shapes are fixed by the batch alone (the padding bound `max_padded`), so a captured CUDA graph replays them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from rapidserve.ops import torch_ops


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int32) of router logits [T, E] (module docstring)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def moe_experts_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor) -> torch.Tensor:
    """The experts' weighted sum per token [T, h] in x's dtype (module docstring): for each expert that some token
    chose, in expert order, its rows' SwiGLU times their routing weight, added into the token's output (float32
    weights, as transformers applies them)."""
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        act = torch_ops.silu_and_mul(F.linear(x[token], w13[e]))
        y = F.linear(act, w2[e]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(x.dtype))
    return out


def moe_layer_ref(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
                  renormalize: bool) -> torch.Tensor:
    """The MoE layer's output [T, h] from its router's logits [T, E]: `route`, then `moe_experts_ref`."""
    weights, ids = route(logits, top_k, renormalize)
    return moe_experts_ref(x, w13, w2, weights, ids)


def max_padded(pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the aligned layout of `pairs` (token, slot) pairs: each expert that has pairs pads its run by at
    most block_m - 1, and at most min(pairs, num_experts) experts have any; a multiple of block_m."""
    bound = pairs + min(pairs, num_experts) * (block_m - 1)
    return -(-bound // block_m) * block_m


class Alignment(NamedTuple):
    """The pairs of a batch grouped by expert for the grouped GEMMs.

    `sorted_ids` [P] int32 (P = max_padded): pair indices t * k + j, expert by expert in expert order (each
    expert's pairs in pair order), each expert's run padded with the sentinel T * k up to a multiple of
    block_m and starting at a multiple of it; past `num_post` [1] int32 (the padded total) every entry is the
    sentinel. `expert_ids` [P / block_m] int32: the expert of each block of block_m rows, -1 past the total."""

    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_post: torch.Tensor


def align_block_size(ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """`Alignment` of expert ids [T, k] from torch ops on their device, without a host read."""
    flat = ids.reshape(-1).to(torch.int64)
    pairs, dev = flat.numel(), flat.device
    p = max_padded(pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    sorted_e, order = torch.sort(flat, stable=True)
    first = counts.cumsum(0) - counts  # where each expert's pairs start in the sorted order
    dest = (ends - padded)[sorted_e] + torch.arange(pairs, device=dev) - first[sorted_e]
    sorted_ids = torch.full((p,), pairs, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, p, block_m, device=dev)
    expert_ids = torch.searchsorted(ends, block_starts, right=True)
    expert_ids = torch.where(block_starts < ends[-1], expert_ids, -1).to(torch.int32)
    return Alignment(sorted_ids, expert_ids, ends[-1:].to(torch.int32))


class TailBlocks(NamedTuple):
    """The blocks of the two launches of each grouped GEMM over an `Alignment` padded to `tail_m` (TAIL_BLOCK_M):
    an expert whose run holds n tail blocks (n * tail_m rows from its run start s, its pairs then at most tail_m - 1
    sentinels) has f = n // (block_m / tail_m) full BLOCK_M tiles, rows s + j * block_m (j < f), in the main
    launch's lists, and its other n - f * block_m / tail_m blocks, rows s + f * block_m + i * tail_m, in the tail
    launch's; both in expert order. `main_starts` / `tail_starts` [capacity] int32: each block's first row in
    sorted_ids (0 past the filled); `main_experts` / `tail_experts`: its expert (-1 past the filled); `counts` [2]
    int32: the blocks filled (main, tail). A token's pairs may fall in both launches: down's top-k sum counts them
    across the two (`ops/triton_moe.py`). Capacities: `tail_capacity`."""

    main_starts: torch.Tensor
    main_experts: torch.Tensor
    tail_starts: torch.Tensor
    tail_experts: torch.Tensor
    counts: torch.Tensor
    block_m: int
    tail_m: int


def tail_capacity(pairs: int, num_experts: int, block_m: int, tail_m: int) -> tuple[int, int]:
    """(main, tail) list lengths of `TailBlocks` for `pairs` pairs (at least 1 each): the full tiles are at most the
    tail-padded rows / block_m, the tail blocks at most block_m / tail_m - 1 an expert that has pairs."""
    rows = max_padded(pairs, num_experts, tail_m)
    return max(rows // block_m, 1), max(min(rows // tail_m, min(pairs, num_experts) * (block_m // tail_m - 1)), 1)


def tail_blocks_ref(ids: torch.Tensor, num_experts: int, block_m: int, tail_m: int) -> TailBlocks:
    """`TailBlocks` of expert ids [T, k] from torch ops (reads the counts on the host: the tests' reference)."""
    flat = ids.reshape(-1).to(torch.int64)
    dev = flat.device
    n_main, n_tail = tail_capacity(flat.numel(), num_experts, block_m, tail_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + tail_m - 1) // tail_m
    starts = (blocks * tail_m).cumsum(0) - blocks * tail_m
    per = block_m // tail_m
    lists: list[tuple[list[int], list[int]]] = [([], []), ([], [])]
    for e, (n, s) in enumerate(zip(blocks.tolist(), starts.tolist(), strict=True)):
        full = n // per
        lists[0][0].extend(s + j * block_m for j in range(full))
        lists[1][0].extend(s + full * block_m + i * tail_m for i in range(n - full * per))
        lists[0][1].extend([e] * full)
        lists[1][1].extend([e] * (n - full * per))

    def pad(values: list[int], size: int, fill: int) -> torch.Tensor:
        return torch.tensor(values + [fill] * (size - len(values)), dtype=torch.int32, device=dev)

    return TailBlocks(pad(lists[0][0], n_main, 0), pad(lists[0][1], n_main, -1), pad(lists[1][0], n_tail, 0),
                      pad(lists[1][1], n_tail, -1),
                      torch.tensor([len(lists[0][0]), len(lists[1][0])], dtype=torch.int32, device=dev), block_m,
                      tail_m)
