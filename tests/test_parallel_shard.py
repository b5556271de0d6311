"""Tensor-parallel sharding (rapidserve/parallel/shard.py) on CPU: every rank's slice, reassembled, is the
whole tensor; GQA heads stay with their KV head when KV heads are replicated; a column- then row-parallel
MLP and attention projection summed over ranks (the all-reduce) equal the unsharded computation."""

from __future__ import annotations

import pytest
import torch

from rapidserve.loader.presets import preset_config
from rapidserve.loader.source import expected_tensor_shapes
from rapidserve.parallel.shard import ShardError, shard_kind, shard_shape, shard_tensor, tp_layout

QWEN = preset_config("tiny-qwen3")


def cfg(heads: int, kv: int, vocab: int = 101, inter: int = 64, head_dim: int = 8):  # type: ignore[no-untyped-def]
    return QWEN.replace(num_heads=heads, num_kv_heads=kv, vocab_size=vocab, intermediate_size=inter,
                        head_dim=head_dim, hidden_size=32)


@pytest.mark.parametrize(("name", "kind"), [
    ("model.embed_tokens.weight", "vocab"), ("lm_head.weight", "vocab"),
    ("model.layers.3.self_attn.q_proj.weight", "column"), ("model.layers.3.self_attn.q_proj.bias", "column"),
    ("model.layers.3.self_attn.k_proj.weight", "kv"), ("model.layers.0.self_attn.v_proj.bias", "kv"),
    ("model.layers.1.self_attn.o_proj.weight", "row"), ("model.layers.1.mlp.down_proj.weight", "row"),
    ("model.layers.1.mlp.gate_proj.weight", "column"), ("model.layers.1.mlp.up_proj.weight", "column"),
    ("model.layers.1.self_attn.q_norm.weight", "replicated"), ("model.norm.weight", "replicated"),
    ("model.layers.1.input_layernorm.weight", "replicated"),
])
def test_shard_kind(name: str, kind: str) -> None:
    assert shard_kind(name) == kind


# (heads, kv heads, tp) -> (heads per rank, kv heads per rank, replicas)
LAYOUTS = [
    ((8, 8, 2), (4, 4, 1)), ((8, 2, 2), (4, 1, 1)), ((8, 2, 4), (2, 1, 2)), ((8, 1, 4), (2, 1, 4)),
    ((64, 8, 8), (8, 1, 1)), ((32, 8, 2), (16, 4, 1)), ((8, 4, 1), (8, 4, 1)),
]


@pytest.mark.parametrize(("args", "want"), LAYOUTS)
def test_layout(args: tuple[int, int, int], want: tuple[int, int, int]) -> None:
    h, kv, tp = args
    for r in range(tp):
        lay = tp_layout(cfg(h, kv), tp, r)
        assert (lay.heads, lay.kv_heads, lay.kv_replicas) == want
        # rank r's first query head belongs (under GQA) to the KV head this rank holds
        group = h // kv
        assert (r * lay.heads) // group == lay.kv_head_index


@pytest.mark.parametrize(("args", "pattern"), [
    ((6, 6, 4), "must divide the model's 6 attention heads; use one of 1, 2, 3, 6"),
    ((12, 6, 4), "must divide the model's 6 KV heads, or be a multiple"),  # 6 KV heads: not split 4 ways
    ((8, 2, 8), None),
    ((12, 3, 4), "more than the model's 3 KV heads and not a multiple"),
])
def test_layout_errors(args: tuple[int, int, int], pattern: str | None) -> None:
    h, kv, tp = args
    c = cfg(h, kv, inter=64)
    if pattern is None:
        assert tp_layout(c, tp, 0).kv_replicas == tp // kv
        return
    with pytest.raises(ShardError, match=pattern):
        tp_layout(c, tp, 0)
    with pytest.raises(ShardError, match="rank 4 of 4"):
        tp_layout(cfg(8, 8), 4, 4)


@pytest.mark.parametrize(("heads", "kv", "tp"), [(8, 8, 2), (8, 2, 2), (8, 2, 4), (8, 1, 4), (4, 4, 4)])
def test_shards_reassemble_to_the_whole_model(heads: int, kv: int, tp: int) -> None:
    c = cfg(heads, kv)
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s, generator=g) for n, s in expected_tensor_shapes(c).items()}
    lays = [tp_layout(c, tp, r) for r in range(tp)]
    for name, t in full.items():
        parts = [shard_tensor(name, t, lay) for lay in lays]
        for lay, p in zip(lays, parts, strict=True):
            assert tuple(p.shape) == shard_shape(name, tuple(t.shape), lay), name
        kind = shard_kind(name)
        if kind == "replicated":
            assert all(p is t for p in parts)
        elif kind in ("column", "kv") and (kind == "column" or lays[0].kv_replicas == 1):
            assert torch.equal(torch.cat(parts), t), name
        elif kind == "kv":  # replicated KV heads: each group of kv_replicas ranks holds one head, in order
            assert torch.equal(torch.cat(parts[::lays[0].kv_replicas]), t), name
        elif kind == "row":
            assert torch.equal(torch.cat(parts, dim=1), t), name
        else:  # vocab: the padded rows are zero and dropped when gathered
            got = torch.cat(parts)
            assert got.shape[0] == -(-c.vocab_size // tp) * tp
            assert torch.equal(got[: c.vocab_size], t) and not got[c.vocab_size:].any(), name


def test_sharded_mlp_and_attention_output_sum_to_the_whole() -> None:
    """Column-parallel up/gate then row-parallel down, summed over ranks (the all-reduce), is the full MLP;
    the same for attention's o_proj over each rank's heads."""
    c, tp = cfg(8, 2), 4
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, c.hidden_size, generator=g)
    p = "model.layers.0."
    w = {n: torch.randn(s, generator=g) for n, s in expected_tensor_shapes(c).items() if n.startswith(p)}

    def mlp(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T

    want = mlp(w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"], w[p + "mlp.down_proj.weight"])
    lays = [tp_layout(c, tp, r) for r in range(tp)]
    got = sum(mlp(*(shard_tensor(p + f"mlp.{k}_proj.weight", w[p + f"mlp.{k}_proj.weight"], lay)
                    for k in ("gate", "up", "down"))) for lay in lays)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # the rank sum reorders the additions
    heads_out = torch.randn(5, c.num_heads * c.head_dim, generator=g)  # attention's output, all heads
    o = w[p + "self_attn.o_proj.weight"]
    per_rank = [heads_out[:, lay.rank * lay.heads * c.head_dim:(lay.rank + 1) * lay.heads * c.head_dim] for lay in lays]
    got = sum(h @ shard_tensor(p + "self_attn.o_proj.weight", o, lay).T for h, lay in zip(per_rank, lays, strict=True))
    torch.testing.assert_close(got, heads_out @ o.T, rtol=1e-4, atol=1e-4)


def test_sharded_weights_stream_matches_the_rank_shapes() -> None:
    from rapidserve.parallel.shard import rank_tensor_shapes, sharded_weights

    c, tp = cfg(8, 2), 4
    shapes = expected_tensor_shapes(c)
    g = torch.Generator().manual_seed(2)
    full = [(n, torch.randn(s, generator=g)) for n, s in shapes.items()]
    for r in range(tp):
        lay = tp_layout(c, tp, r)
        got = dict(sharded_weights(iter(full), lay))
        assert {n: tuple(t.shape) for n, t in got.items()} == rank_tensor_shapes(shapes, lay)
        assert all(t.is_contiguous() for t in got.values())
        k = "model.layers.0.self_attn.k_proj.weight"
        assert torch.equal(got[k], dict(full)[k][lay.kv_head_index * c.head_dim:][: c.head_dim])
