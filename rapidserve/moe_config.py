"""The mixture-of-experts section of a model's architecture (issue 40): `MoeConfig`, and the Hugging Face names of
an MoE layer's tensors.

An MoE layer replaces the dense MLP by `num_experts` SwiGLU experts of `intermediate_size` features each and a
router (a [num_experts, hidden] linear layer); each token goes to the `top_k` experts of highest router
probability (softmax over all experts, then the top k), and its output is the sum of their outputs weighted by
those probabilities, renormalised to sum to 1 over the k when `renormalize`. The families:

- mixtral (Mixtral-8x7B / 8x22B): every layer sparse; the top-k probabilities always renormalised, which is the
  softmax over the top-k logits (the form Mixtral's paper gives); Llama-style attention.
- qwen3_moe (Qwen3-30B-A3B, Qwen3-235B-A22B): `renormalize` is config.json's `norm_topk_prob`; layers listed in
  `mlp_only_layers` or off the `decoder_sparse_step` keep a dense MLP of the model's `intermediate_size`
  (`dense_layers`); Qwen3-style attention (per-head q/k norms).

Hugging Face names (the form the Hub's checkpoints and transformers' save_pretrained write), layer n, expert e:
mixtral `model.layers.n.block_sparse_moe.gate.weight` [E, h], `...block_sparse_moe.experts.e.w1.weight` (gate)
[I, h], `w3` (up) [I, h], `w2` (down) [h, I]; qwen3_moe `model.layers.n.mlp.gate.weight`,
`model.layers.n.mlp.experts.e.{gate_proj,up_proj,down_proj}.weight`.
"""

from __future__ import annotations

from dataclasses import dataclass

from rapidserve.config_base import check as _check

MOE_ARCHES: tuple[str, ...] = ("mixtral", "qwen3_moe")
# arch -> (the layer's MoE block prefix, (gate, up, down) projection names of one expert)
_HF_NAMES: dict[str, tuple[str, tuple[str, str, str]]] = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}


@dataclass(frozen=True)
class MoeConfig:
    """The experts of an MoE model (see the module docstring). `intermediate_size`: one expert's features (one
    tensor-parallel rank's share of them in a rank's shard, `parallel.shard.shard_config`)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool = True
    dense_layers: tuple[int, ...] = ()  # layers that keep a dense MLP (Qwen3-MoE's mlp_only_layers and sparse step)

    def __post_init__(self) -> None:
        for f in ("num_experts", "top_k", "intermediate_size"):
            v = getattr(self, f)
            _check(isinstance(v, int) and v > 0, f"model moe {f}={v!r} must be a positive integer")
        _check(self.top_k <= self.num_experts,
               f"model moe top_k={self.top_k} (num_experts_per_tok) must be at most num_experts={self.num_experts}")
        _check(all(isinstance(n, int) and n >= 0 for n in self.dense_layers),
               f"model moe dense_layers={self.dense_layers!r} must be layer indices >= 0")

    def sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` has experts (else its dense MLP)."""
        return layer not in self.dense_layers

    def num_sparse(self, num_layers: int) -> int:
        """How many of `num_layers` layers have experts."""
        return sum(1 for n in range(num_layers) if self.sparse(n))

    def layer_params(self, hidden: int) -> int:
        """Parameters of one MoE layer's experts and router."""
        return self.num_experts * (3 * hidden * self.intermediate_size + hidden)


def moe_prefix(arch: str, layer: int) -> str:
    """The Hugging Face name prefix of layer `layer`'s MoE block (ends with a dot)."""
    return f"model.layers.{layer}.{_HF_NAMES[arch][0]}."


def expert_names(arch: str, layer: int, expert: int) -> tuple[str, str, str]:
    """The Hugging Face names of one expert's (gate, up, down) weights."""
    p = f"{moe_prefix(arch, layer)}experts.{expert}."
    gate, up, down = _HF_NAMES[arch][1]
    return f"{p}{gate}.weight", f"{p}{up}.weight", f"{p}{down}.weight"


def moe_tensor_shapes(arch: str, moe: MoeConfig, hidden: int, layer: int) -> dict[str, tuple[int, ...]]:
    """Layer `layer`'s MoE tensors, router first then expert by expert (gate, up, down), with their shapes."""
    i = moe.intermediate_size
    out: dict[str, tuple[int, ...]] = {f"{moe_prefix(arch, layer)}gate.weight": (moe.num_experts, hidden)}
    for e in range(moe.num_experts):
        gate, up, down = expert_names(arch, layer, e)
        out[gate], out[up], out[down] = (i, hidden), (i, hidden), (hidden, i)
    return out
