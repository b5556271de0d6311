"""Tensor-parallel sharding of the model's weights (issue 17): which slice of each tensor rank r of N holds.

Pure functions over tensor names and shapes, no process group: the loaders (HF folders, GGUF, presets)
call `shard_tensor` on each tensor as it is read, so no GPU ever holds the whole model.

Layout (Megatron-style, the scheme vLLM and SGLang use):
- column-parallel (output features split, dim 0): q_proj, k_proj, v_proj (and their biases), gate_proj,
  up_proj. Rank r holds heads [r*H/N, (r+1)*H/N) of q and the matching intermediate slice of gate|up.
- row-parallel (input features split, dim 1): o_proj, down_proj; their partial outputs are summed by an
  all-reduce after the matmul.
- KV heads: split like q when there are at least N of them (N must divide them); with fewer KV heads than
  ranks each rank holds one KV head, replicated on N / num_kv_heads ranks (N must be a multiple), and
  rank r's query heads use KV head r // (N / num_kv_heads), which is the head its query heads map to
  under grouped-query attention.
- vocab-parallel (dim 0): embed_tokens and lm_head, the vocabulary padded up to a multiple of N with zero
  rows (the embedding's lookups are masked per rank and all-reduced; the LM head's logits gathered and the
  padding dropped).
- replicated: the norms (and Qwen3's per-head q/k norms, which act on one head_dim).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from rapidserve.config import ConfigError, ModelConfig

Kind = Literal["column", "row", "kv", "vocab", "replicated"]
_COLUMN = ("self_attn.q_proj.", "mlp.gate_proj.", "mlp.up_proj.")
_KV = ("self_attn.k_proj.", "self_attn.v_proj.")
_ROW = ("self_attn.o_proj.", "mlp.down_proj.")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


class ShardError(ConfigError):
    """The model cannot be split this way; the message says which size and what would work."""


@dataclass(frozen=True)
class TPLayout:
    """What one rank of a tensor-parallel group holds."""

    tp: int
    rank: int
    heads: int  # query heads per rank
    kv_heads: int  # KV heads per rank (1 when replicated)
    kv_replicas: int  # ranks sharing each KV head (1: split, no replication)
    intermediate: int  # MLP intermediate features per rank
    vocab: int  # vocabulary rows per rank (the padded vocabulary / tp)
    head_dim: int

    @property
    def kv_head_index(self) -> int:
        """The first KV head (of the whole model) this rank holds."""
        return (self.rank // self.kv_replicas) * self.kv_heads


def tp_layout(cfg: ModelConfig, tp: int, rank: int) -> TPLayout:
    """Rank `rank` of `tp`'s share; ShardError naming the size that does not divide."""
    if tp < 1 or not 0 <= rank < tp:
        raise ShardError(f"tensor-parallel rank {rank} of {tp}: need tp >= 1 and 0 <= rank < tp")
    problem = cfg.tp_problem(tp)
    if problem is not None:
        raise ShardError(problem)
    if cfg.num_kv_heads >= tp:
        kv, replicas = cfg.num_kv_heads // tp, 1
    else:
        kv, replicas = 1, tp // cfg.num_kv_heads
    vocab = -(-cfg.vocab_size // tp)
    return TPLayout(tp, rank, cfg.num_heads // tp, kv, replicas, cfg.intermediate_size // tp, vocab, cfg.head_dim)


def shard_kind(name: str) -> Kind:
    """How the tensor called `name` (a Hugging Face name, as `loader.source.expected_tensor_shapes`) splits."""
    if name in _VOCAB:
        return "vocab"
    if any(k in name for k in _KV):
        return "kv"
    if any(k in name for k in _COLUMN):
        return "column"
    if any(k in name for k in _ROW) and name.endswith(".weight"):
        return "row"
    return "replicated"  # norms; a row-parallel layer's bias would be added once, after the all-reduce


def shard_shape(name: str, shape: tuple[int, ...], lay: TPLayout) -> tuple[int, ...]:
    """The shape rank `lay.rank` holds of a tensor of `shape`."""
    kind = shard_kind(name)
    if kind == "replicated" or lay.tp == 1:
        return shape
    if kind == "vocab":
        return (lay.vocab, *shape[1:])
    if kind == "kv":
        return (lay.kv_heads * lay.head_dim, *shape[1:])
    if kind == "column":
        return (shape[0] // lay.tp, *shape[1:])
    return (shape[0], shape[1] // lay.tp)


def shard_tensor(name: str, t: torch.Tensor, lay: TPLayout) -> torch.Tensor:
    """Rank `lay.rank`'s slice of the full tensor `t` (a view where it can be; vocab padding is a copy)."""
    kind = shard_kind(name)
    if kind == "replicated" or lay.tp == 1:
        return t
    if kind == "vocab":
        start = lay.rank * lay.vocab
        part = t[start:start + lay.vocab]
        if part.shape[0] < lay.vocab:  # the last ranks hold the padding rows
            pad = t.new_zeros((lay.vocab - part.shape[0], *t.shape[1:]))
            part = torch.cat([part, pad])
        return part
    if kind == "kv":
        rows = lay.kv_heads * lay.head_dim
        start = lay.kv_head_index * lay.head_dim
        return t[start:start + rows]
    if kind == "column":
        n = t.shape[0] // lay.tp
        return t[lay.rank * n:(lay.rank + 1) * n]
    n = t.shape[1] // lay.tp
    return t[:, lay.rank * n:(lay.rank + 1) * n]


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, min(n, 16) + 1) if n % d == 0)


def rank_tensor_shapes(shapes: dict[str, tuple[int, ...]], lay: TPLayout) -> dict[str, tuple[int, ...]]:
    """The shapes rank `lay.rank` holds, given the whole model's (`loader.source.expected_tensor_shapes`)."""
    return {n: shard_shape(n, s, lay) for n, s in shapes.items()}


def sharded_weights(weights: Iterable[tuple[str, torch.Tensor]], lay: TPLayout,
                    device: torch.device | str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """A loader's (name, whole tensor) stream as rank `lay.rank`'s slices, each moved to `device` as it
    goes: one whole tensor at a time is held (on the loader's side), never the whole model on a GPU."""
    for name, t in weights:
        part = shard_tensor(name, t, lay)
        yield name, (part.contiguous() if device is None else part.to(device).contiguous())


def shard_config(cfg: ModelConfig, lay: TPLayout) -> ModelConfig:
    """The model one rank computes, as a ModelConfig: its heads, KV heads, MLP features and vocabulary rows
    (the padded vocabulary / tp). Its parameter and KV-pool shapes follow from it as for a whole model."""
    if lay.tp == 1:
        return cfg
    return cfg.replace(num_heads=lay.heads, num_kv_heads=lay.kv_heads, intermediate_size=lay.intermediate,
                       vocab_size=lay.vocab)


def rank_weights(source: object, lay: TPLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """Rank `lay.rank`'s weights of a loader's `ModelSource`: its own sharded reader where it has one
    (`shard_weights`), else its whole-tensor stream sliced one tensor at a time."""
    reader = getattr(source, "shard_weights", None)
    if reader is not None:
        return reader(lay)
    return sharded_weights(source.weights(), lay)  # type: ignore[attr-defined]
