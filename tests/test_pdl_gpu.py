"""Programmatic dependent launch (rapidserve/ops/pdl.py) on the GPU: a decode step of Qwen3-8B-shaped layers (random
weights, bf16 and fp8 per-channel, 2048-token contexts) captured in a CUDA graph with PDL as the GPU has it (on for
H100/H200: the graph keeps programmatic edges, the GEMMs prefetch their weights before their wait) gives, replayed on
new inputs, the bits of the same step run eagerly with PDL off (`ops.no_pdl`, `attention.no_pdl`): the hidden states,
the residual stream and the KV cache's new entries. PDL changes when kernels start, never what they compute, so
anything but equality is a kernel reading before its wait. At batch 1 and 16 (the skinny GEMMs, split-K and its
reduce; the attention's split and reduce kernels) and 64 (fp8: the skinny kernel's 64-row tiles; the attention in
one split). Skipped without a GPU (the CPU checks: tests/test_pdl.py); the lead's GPU runs. The MoE experts' replay
with and without PDL: tests/test_moe_gpu.py.

Where the engine turns it on (`ops/pdl_table.py`): a ModelRunner of Qwen3-8B-shaped layers captures its decode graphs
of batch 1 and 64 each as the table chooses, and records it; every launcher of each capture was given that choice
(PDL, and the skinny GEMMs' prefetch bytes: the launch arguments recorded at the launchers' one call into ops/pdl.py,
not timings); a step past the largest graph runs eagerly with its own choice, and a prefill with PDL off."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from preset_runners import preset_runner

from rapidserve.attention import AttentionMetadata, get_attention_backend
from rapidserve.attention import no_pdl as no_pdl_attention
from rapidserve.kv_pool import KVPool
from rapidserve.loader.preset_table import preset_table
from rapidserve.models.decoder_layer import DecoderLayer
from rapidserve.ops import fp8, fp8_ops, get_ops, no_pdl, pdl, triton_fp8_skinny, triton_skinny
from rapidserve.ops.pdl import pdl_device, use_pdl
from rapidserve.ops.pdl_table import OFF, PDL_TABLE, LaunchChoice, pdl_for_step
from rapidserve.quant_config import ONLINE_FP8
from rapidserve.runner import DecodeItem, ModelRunner, PrefillItem

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


def _runner(quantized: bool) -> ModelRunner:
    """A ModelRunner of Qwen3-8B's shapes cut to LAYERS layers (the preset's deterministic random weights; fp8:
    quantized at load) with decode graphs of batch 1 and 64."""
    return preset_runner("qwen3-8b", LAYERS, ctx=CTX, graph_batches=(1, 64), max_num_seqs=64,
                         max_num_batched_tokens=8192, quantization=ONLINE_FP8 if quantized else None)


def _by_batch(log: list[tuple[str, Any]]) -> dict[int, list[tuple[str, Any]]]:
    """The recorded launch arguments by the forward they belong to: each ("batch", rows) marker (the model's
    embedding, a forward's first call) starts that forward's."""
    out: dict[int, list[tuple[str, Any]]] = {}
    rows = None
    for kind, value in log:
        if kind == "batch":
            rows = value
            out.setdefault(rows, [])
        else:
            assert rows is not None, ("a launch before any forward", kind, value)
            out[rows].append((kind, value))
    return out


@pytest.mark.parametrize("quantized", [False, True], ids=["bf16", "fp8"])
def test_decode_graphs_launch_as_the_table_says(quantized: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if quantized and not fp8.fp8_supported(CUDA):
        pytest.skip("no fp8 on this GPU")
    runner = _runner(quantized)
    log: list[tuple[str, Any]] = []
    launch_options, prefetch_bytes, embed = pdl.launch_options, triton_skinny.prefetch_bytes, runner.model.embed

    def recorded_options(on: bool) -> dict[str, Any]:  # every launcher of a PDL-ready kernel calls it once a launch
        log.append(("pdl", on))
        return launch_options(on)

    def recorded_prefetch(weight: torch.Tensor, rows: int, span: int, budget: int = triton_skinny.PREFETCH_BYTES
                          ) -> int:  # the skinny GEMMs (bf16 and fp8) size their prefetch with it, where PDL is on
        log.append(("prefetch", budget))
        return prefetch_bytes(weight, rows, span, budget)

    def marked_embed(ids: torch.Tensor) -> torch.Tensor:
        log.append(("batch", int(ids.shape[0])))
        return embed(ids)

    monkeypatch.setattr(pdl, "launch_options", recorded_options)
    monkeypatch.setattr(triton_skinny, "prefetch_bytes", recorded_prefetch)
    monkeypatch.setattr(triton_fp8_skinny, "prefetch_bytes", recorded_prefetch)
    monkeypatch.setattr(runner.model, "embed", marked_embed)
    runner.capture_decode_graphs(key="probe", show_progress=False)  # warm-up and capture of 64, then of 1

    device = pdl_device(CUDA)
    want = {b: pdl_for_step(b, device, PDL_TABLE) for b in (1, 64)}
    assert runner.decode_launches("probe") == want  # the runner's record
    if device == ("NVIDIA H200", True):  # the measured entry: on at 1, off at 64
        assert want == {1: LaunchChoice(True, 8 << 20), 64: OFF}
    captured = _by_batch(log)
    assert set(captured) == {1, 64}
    for b, choice in want.items():
        on = [v for k, v in captured[b] if k == "pdl"]
        budgets = [v for k, v in captured[b] if k == "prefetch"]
        assert on and set(on) == {choice.pdl}, (b, choice, on)
        assert set(budgets) <= {choice.prefetch_bytes}, (b, choice, budgets)
        if choice.pdl and b <= triton_skinny.MAX_ROWS:  # Qwen3-8B's projections take the skinny GEMMs there
            assert budgets, (b, choice)
        if not choice.pdl:
            assert not budgets, (b, budgets)  # no prefetch without PDL

    per = CTX // BLOCK
    steps = [DecodeItem(1, CTX - 1, [(i * per + j) % 1024 for j in range(per)]) for i in range(65)]
    for n in (1, 64, 65):  # the graphs, then past the largest (eager, its own choice)
        log.clear()
        out = runner.decode(steps[:n], graph_key="probe")
        torch.cuda.synchronize()
        assert out.shape[0] == n and bool(torch.isfinite(out).all())
        if n in want:
            assert not log  # a replay launches nothing through Python
            continue
        eager = _by_batch(log)[n]
        choice = pdl_for_step(n, device, PDL_TABLE)
        assert {v for k, v in eager if k == "pdl"} == {choice.pdl}
        assert {v for k, v in eager if k == "prefetch"} <= {choice.prefetch_bytes}
    log.clear()
    runner.prefill([PrefillItem(list(range(3, 40)), 0, [0, 1, 2])])
    assert {v for k, v in _by_batch(log)[37] if k == "pdl"} == {False}  # prefill: PDL off
