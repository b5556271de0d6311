"""The mixture-of-experts MLP of a decoder layer (issue 40; mixtral, qwen3_moe: rapidserve/moe_config.py).

`MoeBlock` holds the router [E, h] and every expert's weights stacked: `w13` [E, 2I, h] (each expert's gate rows
[0, I), up rows [I, 2I), as the dense layer's fused gate|up) and `w2` [E, h, I]. Its forward computes the router's
logits (one GEMM) and calls the `Ops` bundle's `moe_layer` with the family's top-k and normalisation (on CPU
`ops.moe.route` then the torch loop over experts; on GPUs the Triton routing + alignment, then the grouped GEMMs:
three launches at decode, `ops/triton_moe.py`). Under tensor parallelism the block is built at the rank's
shard (`MoeConfig.intermediate_size` is the rank's slice of every expert), the router is whole on every rank (the
same routing everywhere, from the same all-reduced input), and the decoder layer all-reduces the block's partial
sums as it does the dense MLP's. `targets` maps the Hugging Face names of one layer onto these tensors for
`CausalLM.load_weights`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rapidserve.moe_config import MoeConfig, expert_names, moe_prefix
from rapidserve.ops import Ops


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class MoeBlock(nn.Module):
    """Router and experts of one layer (module docstring)."""

    def __init__(self, moe: MoeConfig, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.moe = moe
        e, i = moe.num_experts, moe.intermediate_size
        self.gate = _param((e, hidden), dtype, device)
        self.w13 = _param((e, 2 * i, hidden), dtype, device)
        self.w2 = _param((e, hidden, i), dtype, device)

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        """[T, h] -> the experts' weighted sum [T, h] (this rank's partial sum under tensor parallelism)."""
        return ops.moe_layer(x, F.linear(x, self.gate), self.w13, self.w2, self.moe.top_k, self.moe.renormalize)

    def targets(self, arch: str, layer: int) -> dict[str, tuple[torch.Tensor, int, int]]:
        """Hugging Face name -> (destination, row offset, rows) of layer `layer`'s router and experts."""
        i, h = self.moe.intermediate_size, self.gate.shape[1]
        out = {f"{moe_prefix(arch, layer)}gate.weight": (self.gate, 0, self.moe.num_experts)}
        for e in range(self.moe.num_experts):
            gate, up, down = expert_names(arch, layer, e)
            out[gate] = (self.w13[e], 0, i)
            out[up] = (self.w13[e], i, i)
            out[down] = (self.w2[e], 0, h)
        return out
