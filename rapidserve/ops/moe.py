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
