"""Programmatic dependent launch (rapidserve/ops/pdl.py) on the GPU: a decode step of Qwen3-8B-shaped layers (random
weights, bf16 and fp8 per-channel, 2048-token contexts) captured in a CUDA graph with PDL as the GPU has it (on for
H100/H200: the graph keeps programmatic edges, the GEMMs prefetch their weights before their wait) gives, replayed on
new inputs, the bits of the same step run eagerly with PDL off (`ops.no_pdl`, `attention.no_pdl`): the hidden states,
the residual stream and the KV cache's new entries. PDL changes when kernels start, never what they compute, so
anything but equality is a kernel reading before its wait. At batch 1 and 16 (the skinny GEMMs, split-K and its
reduce; the attention's split and reduce kernels) and 64 (fp8: the skinny kernel's 64-row tiles; the attention in
one split). Skipped without a GPU (the CPU checks: tests/test_pdl.py); the lead's GPU runs. The MoE experts' replay
with and without PDL: tests/test_moe_gpu.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rapidserve.attention import AttentionMetadata, get_attention_backend
from rapidserve.attention import no_pdl as no_pdl_attention
from rapidserve.kv_pool import KVPool
from rapidserve.loader.preset_table import preset_table
from rapidserve.models.transformer import DecoderLayer
from rapidserve.ops import fp8, fp8_ops, get_ops, no_pdl
from rapidserve.ops.pdl import use_pdl
from rapidserve.quant_config import ONLINE_FP8

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
LAYERS, CTX, BLOCK = 2, 2048, 16


def _layers(quant: Any, seed: int) -> list[DecoderLayer]:
    """Qwen3-8B's first LAYERS decoder layers with random weights (fp8: quantized per channel, as at load)."""
    cfg = preset_table()["qwen3-8b"]
    g = torch.Generator(device=CUDA).manual_seed(seed)
    layers = [DecoderLayer(cfg, torch.bfloat16, CUDA, quant=quant, index=i) for i in range(LAYERS)]
    for layer in layers:
        for m in layer.modules():
            if isinstance(m, fp8.Fp8Linear):
                w = torch.randn(m.weight.shape, device=CUDA, generator=g) / 64
                w8, scale = fp8.quantize_weight(w, "channel", None, m.weight.dtype)
                m.weight.data.copy_(w8)
                m.weight_scale.data.copy_(scale.reshape(m.weight_scale.shape))
        for name, p in layer.named_parameters():
            if p.dtype == torch.bfloat16:
                scale = 0.1 if "norm" in name else 1 / 64
                p.data.copy_((1.0 if "norm" in name else 0.0) + torch.randn(p.shape, device=CUDA, generator=g) * scale)
    return layers


def _decode_inputs(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(hidden, positions, metadata) of one decode token for each of `batch` sequences of CTX tokens, each in its
    own blocks of the pool."""
    per = CTX // BLOCK
    g = torch.Generator(device=CUDA).manual_seed(seed)
    hidden = torch.randn(batch, 4096, device=CUDA, generator=g).to(torch.bfloat16)
    tables = torch.arange(batch * per, device=CUDA, dtype=torch.int32).view(batch, per)
    slots = (tables[:, -1].to(torch.int64) * BLOCK + BLOCK - 1)  # the new token: the last slot of the last block
    meta = AttentionMetadata(False, slots, tables, torch.full((batch,), CTX, device=CUDA, dtype=torch.int32),
                             max_context_len=CTX)
    return hidden, torch.full((batch,), CTX - 1, device=CUDA, dtype=torch.int64), meta


@pytest.mark.parametrize("quantized", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_decode_graph_with_pdl_gives_the_eager_bits_without(quantized: bool, batch: int) -> None:
    if quantized and not fp8.fp8_supported(CUDA):
        pytest.skip("no fp8 on this GPU")
    layers = _layers(ONLINE_FP8 if quantized else None, seed=batch)
    cfg = layers[0].cfg
    ops = fp8_ops(get_ops(CUDA), CUDA)
    attn = get_attention_backend("triton", CUDA)
    eager_ops, eager_attn = no_pdl(ops), no_pdl_attention(attn)
    pool = KVPool(torch.randn(LAYERS, 2, batch * CTX // BLOCK, cfg.num_kv_heads, BLOCK, cfg.head_dim, device=CUDA,
                              dtype=torch.bfloat16), BLOCK)
    cos_sin = torch.randn(CTX, cfg.head_dim, device=CUDA)
    hidden, positions, meta = _decode_inputs(batch, seed=0)

    def step(ops_: Any, attn_: Any) -> tuple[torch.Tensor, torch.Tensor]:
        h, res = hidden, None
        for i, layer in enumerate(layers):
            h, res = layer(h, res, positions, cos_sin, pool.layers[i], meta, ops_, attn_)
        assert res is not None
        return ops_.add_rms_norm(h, res, layers[0].input_layernorm, cfg.rms_norm_eps)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(ops, attn)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = step(ops, attn)
    torch.cuda.current_stream().wait_stream(stream)
    new_blocks = meta.slot_mapping // BLOCK
    for seed in (1, 2):
        hidden.copy_(_decode_inputs(batch, seed)[0])
        pool.tensor[:, :, new_blocks, :, BLOCK - 1] = 0  # the new entries: written anew by each run
        graph.replay()
        torch.cuda.synchronize()
        got = [t.clone() for t in out] + [pool.tensor.clone()]
        pool.tensor[:, :, new_blocks, :, BLOCK - 1] = 0
        want = [*step(eager_ops, eager_attn), pool.tensor]
        torch.cuda.synchronize()
        assert got[2][:, :, new_blocks, :, BLOCK - 1].abs().amax() > 0  # the step wrote them
        for name, a, b in zip(("hidden", "residual", "kv cache"), got, want, strict=True):
            assert torch.equal(a, b), (seed, name, use_pdl(None, CUDA), (a.float() - b.float()).abs().max())
