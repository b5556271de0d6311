"""Tensor-parallel sharding of the model's weights (issue 17): which slice of each tensor rank r of N holds.

Pure functions over tensor names and shapes, no process group. `rapidserve.loader.rank_weights` gives
rank r's weight stream: each loader (HF folders, GGUF, presets) reads or makes the rank's part of one
tensor at a time (`shard_bounds`, the same range `shard_tensor` takes from a whole tensor), so no
process holds the whole model and no GPU more than its shard. This module imports nothing of the loader.

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
- mixture-of-experts (issue 40, rapidserve/moe_config.py): every expert splits as the dense MLP does, so each rank
  holds a slice of every expert's features (gate/up `w1`/`w3`/`gate_proj`/`up_proj` column-parallel, down
  `w2`/`down_proj` row-parallel, summed by the same all-reduce); the router (`gate.weight`) is replicated.
- fp8 scales (rapidserve/quant_config.py): a projection's `weight_scale` / `weight_scale_inv` follows its weight's
  output rows: one per row ([N] or [N, 1]) splits with the rows of a column-parallel (or KV) weight and is
  replicated for a row-parallel one, whose output rows are whole on every rank; block scales [ceil(N/bn),
  ceil(K/bk)] (`block` = (bn, bk) given) split by blocks, rows for column-parallel, columns for row-parallel,
  which needs every rank's slice to start and end on a block boundary (`block_shard_problem`); a per-tensor scale
  ([] or [1]) and `input_scale` are replicated.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from rapidserve.config import ModelConfig
from rapidserve.config_base import ConfigError

Kind = Literal["column", "row", "kv", "vocab", "replicated"]
_COLUMN = ("self_attn.q_proj.", "mlp.gate_proj.", "mlp.up_proj.")
_KV = ("self_attn.k_proj.", "self_attn.v_proj.")
_ROW = ("self_attn.o_proj.", "mlp.down_proj.")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
_EXPERT_COLUMN = ("w1", "w3", "gate_proj", "up_proj")  # an expert's projections, after `.experts.<e>.`
_EXPERT_ROW = ("w2", "down_proj")
_SCALES = ("weight_scale", "weight_scale_inv")  # an fp8 projection's weight scales (module docstring)
Block = tuple[int, int]


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
    moe_intermediate: int = 0  # each expert's features per rank (0: no experts)

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
    return TPLayout(tp, rank, cfg.num_heads // tp, kv, replicas, cfg.intermediate_size // tp, vocab, cfg.head_dim,
                    cfg.moe.intermediate_size // tp if cfg.moe is not None else 0)


def shard_kind(name: str) -> Kind:
    """How the tensor called `name` (a Hugging Face name, as `loader.source.expected_tensor_shapes`) splits."""
    if name in _VOCAB:
        return "vocab"
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "input_scale":
        return "replicated"
    if any(k in name for k in _KV):
        return "kv"
    if ".experts." in name and leaf == "weight":
        proj = name.rsplit(".", 2)[-2]
        if proj in _EXPERT_COLUMN:
            return "column"
        if proj in _EXPERT_ROW:
            return "row"
    if any(k in name for k in _COLUMN):
        return "column"
    if any(k in name for k in _ROW) and (name.endswith(".weight") or leaf in _SCALES):
        return "row"
    return "replicated"  # norms; a row-parallel layer's bias would be added once, after the all-reduce


def block_shard_problem(cfg: ModelConfig, tp: int, block: Block) -> str | None:
    """Why fp8 block scales of `block` = (bn, bk) cannot be split over `tp` ranks (None: they can): every rank's
    rows of each column-parallel projection (q, k, v, gate, up; the fused q|k|v and gate|up too, at tp 1) and
    its columns of each row-parallel one (o, down) must be whole blocks."""
    bn, bk = block
    kv_rows = cfg.num_kv_heads // tp * cfg.head_dim if cfg.num_kv_heads >= tp else cfg.head_dim
    rows = {"q_proj": cfg.q_size // tp, "k_proj/v_proj": kv_rows, "gate_proj/up_proj": cfg.intermediate_size // tp}
    cols = {"o_proj": cfg.q_size // tp, "down_proj": cfg.intermediate_size // tp}
    bad = [f"{p} {n} rows" for p, n in rows.items() if n % bn] + [f"{p} {n} columns" for p, n in cols.items()
                                                                  if tp > 1 and n % bk]
    if not bad:
        return None
    where = f"over {tp} tensor-parallel ranks" if tp > 1 else "in the fused q|k|v and gate|up projections"
    return (f"fp8 block scales of {bn}x{bk} cannot be split {where}: each rank would hold {', '.join(bad)}, not "
            f"a multiple of the block; use a tensor-parallel size that keeps whole blocks")


def shard_shape(name: str, shape: tuple[int, ...], lay: TPLayout, block: Block | None = None) -> tuple[int, ...]:
    """The shape rank `lay.rank` holds of a tensor of `shape` (`block`: the checkpoint's fp8 weight blocks)."""
    if name.rsplit(".", 1)[-1] in _SCALES:
        bounds = shard_bounds(name, shape, lay, block)
        if bounds is None:
            return shape
        dim, start, stop = bounds
        return (*shape[:dim], stop - start, *shape[dim + 1:])
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


def shard_bounds(name: str, shape: tuple[int, ...], lay: TPLayout,
                 block: Block | None = None) -> tuple[int, int, int] | None:
    """The part of a whole tensor of `shape` rank `lay.rank` holds, as `(dim, start, stop)` along one
    dimension (0: rows, 1: columns), or None when it holds the whole tensor (replicated, or tp == 1).

    `start`/`stop` are clamped to the tensor: for the vocabulary the last ranks' rows past the end are
    the padding, `shard_shape(...)[0] - (stop - start)` zero rows appended after the read part. A loader
    that can read a slice from disk (safetensors' `get_slice`) reads exactly this range; `shard_tensor`
    is the same range taken from a tensor in memory, so the two agree bit for bit. An fp8 weight scale splits as
    the module docstring says (`block`: the checkpoint's weight blocks, for its block scales); ShardError when a
    block scale cannot be split on block boundaries.
    """
    kind = shard_kind(name)
    if kind == "replicated" or lay.tp == 1:
        return None
    if name.rsplit(".", 1)[-1] in _SCALES:
        if math.prod(shape) == 1:
            return None  # per-tensor
        if block is not None:
            return _block_bounds(name, kind, shape, lay, block)
        if kind == "row":
            return None  # one scale per output row: the rows are whole on every rank
    if kind == "vocab":
        start = min(lay.rank * lay.vocab, shape[0])
        return 0, start, min(start + lay.vocab, shape[0])
    if kind == "kv":
        start = lay.kv_head_index * lay.head_dim
        return 0, start, start + lay.kv_heads * lay.head_dim
    if kind == "column":
        n = shape[0] // lay.tp
        return 0, lay.rank * n, (lay.rank + 1) * n
    n = shape[1] // lay.tp
    return 1, lay.rank * n, (lay.rank + 1) * n


def _block_bounds(name: str, kind: Kind, shape: tuple[int, ...], lay: TPLayout, block: Block) -> tuple[int, int, int]:
    """Rank `lay.rank`'s blocks of a block scale [ceil(N/bn), ceil(K/bk)] (see shard_bounds)."""
    bn, bk = block
    if kind == "kv":
        start, size = lay.kv_head_index * lay.head_dim, lay.kv_heads * lay.head_dim
        if start % bn or size % bn:
            raise ShardError(f"{name}: rank {lay.rank}'s KV rows [{start}, {start + size}) are not whole "
                             f"{bn}-row blocks")
        return 0, start // bn, (start + size) // bn
    dim = 0 if kind == "column" else 1
    if shape[dim] % lay.tp:
        raise ShardError(f"{name}: {shape[dim]} scale blocks cannot be split evenly over {lay.tp} ranks")
    n = shape[dim] // lay.tp
    return dim, lay.rank * n, (lay.rank + 1) * n


def pad_vocab(part: torch.Tensor, rows: int) -> torch.Tensor:
    """`part` with zero rows appended up to `rows` (the vocabulary padding of the last ranks); `part`
    itself when it already has them."""
    if part.shape[0] >= rows:
        return part
    return torch.cat([part, part.new_zeros((rows - part.shape[0], *part.shape[1:]))])


def shard_tensor(name: str, t: torch.Tensor, lay: TPLayout, block: Block | None = None) -> torch.Tensor:
    """Rank `lay.rank`'s slice of the full tensor `t` (a view where it can be; vocab padding is a copy).

    A view keeps all of `t`'s storage alive: `owned_shard` is the copy a loader should keep."""
    bounds = shard_bounds(name, tuple(t.shape), lay, block)
    if bounds is None:
        return t
    dim, start, stop = bounds
    part = t.narrow(dim, start, stop - start)
    return pad_vocab(part, lay.vocab) if shard_kind(name) == "vocab" else part


def owned_shard(part: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """`part` (a shard of `whole`, on any device) as a contiguous tensor that does not keep `whole`'s
    storage alive: a copy when it is a strict view into `whole`, else `part` made contiguous."""
    if part is not whole and part.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr():
        return part.clone(memory_format=torch.contiguous_format)
    return part.contiguous()


def rank_tensor_shapes(shapes: dict[str, tuple[int, ...]], lay: TPLayout) -> dict[str, tuple[int, ...]]:
    """The shapes rank `lay.rank` holds, given the whole model's (`loader.source.expected_tensor_shapes`)."""
    return {n: shard_shape(n, s, lay) for n, s in shapes.items()}


def sharded_weights(weights: Iterable[tuple[str, torch.Tensor]], lay: TPLayout,
                    device: torch.device | str | None = None,
                    block: Block | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """A loader's (name, whole tensor) stream as rank `lay.rank`'s slices, each moved to `device` as it
    goes: one whole tensor at a time is held (on the loader's side), never the whole model on a GPU.

    Each slice is `shard_tensor`'s, contiguous, and never a view into the whole tensor (`owned_shard`),
    so the whole tensor is freed as soon as the stream moves on. `block`: the checkpoint's fp8 weight blocks."""
    for name, t in weights:
        part = shard_tensor(name, t, lay, block)
        yield name, owned_shard(part if device is None else part.to(device), t)


def shard_config(cfg: ModelConfig, lay: TPLayout) -> ModelConfig:
    """The model one rank computes, as a ModelConfig: its heads, KV heads, MLP features and vocabulary rows
    (the padded vocabulary / tp). Its parameter and KV-pool shapes follow from it as for a whole model."""
    if lay.tp == 1:
        return cfg
    moe = None if cfg.moe is None else dataclasses.replace(cfg.moe, intermediate_size=lay.moe_intermediate)
    return cfg.replace(num_heads=lay.heads, num_kv_heads=lay.kv_heads, intermediate_size=lay.intermediate,
                       vocab_size=lay.vocab, moe=moe)
