"""The roofline's attention per layer window (partition/attention_costs.py): a sliding layer (Mistral-7B-v0.1's every
layer, Gemma 3's local 5 of 6) attends to its last W keys only. The counts against a query-by-query count on small
shapes, the operators per window group, Mistral / Gemma 3 decode and prefill priced lower on long contexts and
exactly as without windows within them, RooflineCosts' fused step, and models without windows unchanged."""

from __future__ import annotations

import dataclasses

import pytest

from rapidserve.config import ModelConfig
from rapidserve.loader.presets import preset_config
from rapidserve.partition.attention_costs import (
    attention_windows,
    chunk_keys,
    chunk_pairs,
    clipped_context_sums,
    prefix_pairs,
    window_layers,
)
from rapidserve.partition.profile import Configuration
from rapidserve.partition.roofline import (
    Peaks,
    concurrent,
    decode_operators,
    decode_step_ms,
    mixed_operators,
    mixed_operators_summed,
    prefill_operators,
    prefill_tokens_per_s,
    step_seconds,
    totals,
)
from rapidserve.partition.step_costs import RooflineCosts

H100 = Peaks(782e12, 2.98e12, 132, device="H100-like")
QWEN, LLAMA = preset_config("qwen3-8b"), preset_config("llama-3-8b")
MISTRAL, GEMMA = preset_config("mistral-7b"), preset_config("gemma3-12b")
CONFIGS = (Configuration("overallocated", 0, 132), Configuration("split32", 32, 100))
# TINY's shapes (4 q heads, 2 kv heads, d 2), 6 layers: every third global, the rest a window of 3
TINY = ModelConfig(arch="llama", vocab_size=11, hidden_size=8, intermediate_size=16, num_layers=6, num_heads=4,
                   num_kv_heads=2, head_dim=2, sliding_window=3,
                   layer_types=("sliding_attention", "sliding_attention", "full_attention") * 2)


def full(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with every layer global (no sliding window)."""
    return dataclasses.replace(cfg, sliding_window=None, layer_types=())


def brute(tokens: int, prefix: int, window: int | None) -> tuple[int, int]:
    """(pairs, distinct keys) of a chunk at absolute positions prefix..prefix+tokens-1, one query at a time."""
    pairs, keys = 0, set()
    for j in range(prefix, prefix + tokens):
        lo = 0 if window is None else max(0, j + 1 - window)
        pairs += j + 1 - lo
        keys.update(range(lo, j + 1))
    return pairs, len(keys)


def attention(ops: list) -> dict:
    return {o.name: o for o in ops if o.kind == "sequence"}


@pytest.mark.parametrize("window", [None, 1, 2, 3, 7, 64])
def test_chunk_pairs_and_keys_against_a_query_by_query_count(window: int | None) -> None:
    for n in (1, 2, 3, 5, 63, 64, 65, 130):
        for p in (0, 1, 2, 6, 7, 8, 63, 100, 1000):
            assert (chunk_pairs(n, p, window), chunk_keys(n, p, window)) == brute(n, p, window), (n, p)
            assert prefix_pairs(n, p, window) == brute(n, p, window)[0] - brute(n, 0, window)[0]
    assert chunk_pairs(1000, 100000) == 1000 * 100000 + 1000 * 1001 // 2  # no window: the causal formula


def test_window_layers_are_the_layer_mix() -> None:
    assert window_layers(QWEN) == ((None, 36),) and window_layers(LLAMA) == ((None, 32),)
    assert window_layers(MISTRAL) == ((4096, 32),)
    assert window_layers(GEMMA) == ((1024, 40), (None, 8))
    assert window_layers(TINY) == ((3, 4), (None, 2))
    assert attention_windows(GEMMA) == ((1024, 40 / 48), (None, 8 / 48))
    for model in (QWEN, MISTRAL, GEMMA, TINY, full(GEMMA)):  # ModelConfig.layer_window's, layer by layer
        windows = [model.layer_window(i) for i in range(model.num_layers)]
        assert dict(window_layers(model)) == {w: windows.count(w) for w in set(windows)}
    assert clipped_context_sums(QWEN, [5, 5000]) == {}
    assert clipped_context_sums(GEMMA, [5, 5000]) == {1024: 5 + 1024}


@pytest.mark.parametrize("context", [1, 2, 3, 4, 50])
def test_decode_attention_per_window_group(context: int) -> None:
    """4 q heads x d 2, 2 kv heads: a row reads min(context, 3) keys on the 4 sliding layers, context on the 2
    global ones."""
    ops = attention(decode_operators(TINY, 3, context))
    keys = min(context, 3)
    assert ops["sliding_attention"][2:5] == (4 * 4 * 2 * keys * 3, 0.0, (2 * 2 * 2 * keys * 2 + 2 * 4 * 2 * 2) * 3)
    assert ops["sliding_attention"].count == 4
    assert ops["attention"][2:5] == (4 * 4 * 2 * context * 3, 0.0, (2 * 2 * 2 * context * 2 + 2 * 4 * 2 * 2) * 3)
    assert ops["attention"].count == 2


@pytest.mark.parametrize("tokens, prefix", [(1, 0), (4, 0), (4, 3), (1, 50), (9, 50)])
def test_prefill_attention_per_window_group(tokens: int, prefix: int) -> None:
    ops = attention(prefill_operators(TINY, tokens, prefix=prefix))
    for name, window in (("sliding_attention", 3), ("attention", None)):
        pairs, keys = brute(tokens, prefix, window)
        assert ops[name].flops == 4 * 4 * 2 * pairs
        assert ops[name].io_bytes == (2 * tokens * 4 * 2 + 2 * 2 * 2 * keys) * 2  # the window's keys, not the prefix's


def test_mixed_attention_sums_each_rows_window_and_each_chunks() -> None:
    contexts, chunks = (1, 2, 5, 40), [(4, 3), (2, 100)]
    ops = attention(mixed_operators(TINY, contexts, chunks))
    for name, window in (("sliding_attention", 3), ("attention", None)):
        rows = sum(c if window is None else min(c, window) for c in contexts)
        pairs = sum(brute(n, p, window)[0] for n, p in chunks)
        keys = sum(brute(n, p, window)[1] for n, p in chunks)
        assert ops[name].flops == 4 * 4 * 2 * (rows + pairs)
        assert ops[name].io_bytes == ((2 * 2 * 2 * (rows + keys) + 2 * 4 * 2 * len(contexts)) * 2
                                      + sum(2 * n * 4 * 2 * 2 for n, _ in chunks))
    # given only the sum, the sliding layers' rows are bounded by min(sum, batch x W): exact when all are past W
    bound = attention(mixed_operators_summed(TINY, 4, sum(contexts), chunks))["sliding_attention"]
    assert bound.flops > ops["sliding_attention"].flops
    assert mixed_operators_summed(TINY, 2, 90, chunks) == mixed_operators(TINY, (40, 50), chunks)


@pytest.mark.parametrize("model", [QWEN, LLAMA], ids=["qwen3-8b", "llama-3-8b"])
def test_models_without_windows_are_priced_as_before(model: ModelConfig) -> None:
    """One attention operator over every layer, its formulas as they were (the pinned values:
    tests/test_roofline_fp8.py's REGRESSION, tests/test_roofline.py's hand counts)."""
    heads, kv, d, b = model.num_heads, model.num_kv_heads, model.head_dim, 2
    for batch, context in ((1, 1), (8, 4096), (64, 32768)):
        (op,) = attention(decode_operators(model, batch, context)).values()
        assert (op.name, op.count) == ("attention", model.num_layers)
        assert (op.flops, op.io_bytes) == (4 * heads * d * context * batch,
                                           (2 * kv * d * context * b + 2 * heads * d * b) * batch)
    for n, p in ((1, 0), (4096, 0), (1024, 30000)):
        (op,) = attention(prefill_operators(model, n, prefix=p)).values()
        assert (op.flops, op.io_bytes) == (4 * heads * d * (n * p + n * (n + 1) / 2),
                                           2 * n * heads * d * b + 2 * kv * d * (p + n) * b)


@pytest.mark.parametrize("model", [MISTRAL, GEMMA], ids=["mistral-7b", "gemma3-12b"])
def test_windowed_decode_is_cheaper_past_the_window_and_unchanged_within(model: ModelConfig) -> None:
    w = min(w for w, _ in window_layers(model) if w is not None)
    for batch in (1, 32):
        assert decode_step_ms(model, batch, 32768, 132, H100) < decode_step_ms(full(model), batch, 32768, 132, H100)
        for context in (1, w // 2, w):  # the same operators (gemma3: in two groups, 40 + 8 layers: to the rounding)
            assert decode_step_ms(model, batch, context, 132, H100) == pytest.approx(
                decode_step_ms(full(model), batch, context, 132, H100), rel=1e-12)
    # mistral: every layer reads 4096 keys whatever the context; gemma3: the 8 global layers still grow with it
    grows = decode_step_ms(model, 32, 65536, 132, H100) > decode_step_ms(model, 32, 32768, 132, H100)
    assert grows == (model is GEMMA)
    assert concurrent(model, 32, 32768, 32, 100, 4096, H100)[0] < concurrent(full(model), 32, 32768, 32, 100, 4096,
                                                                             H100)[0]


def test_mistral_decode_at_32k_prices_the_window_only() -> None:
    """32 rows at 32K: each layer reads 4096 keys a row, not 32768: 12.1 ms, not 58.0 (H100-like peaks)."""
    assert decode_step_ms(MISTRAL, 32, 32768, 132, H100) == decode_step_ms(MISTRAL, 32, 4096, 132, H100)
    assert decode_step_ms(full(MISTRAL), 32, 32768, 132, H100) / decode_step_ms(MISTRAL, 32, 32768, 132, H100) > 4


@pytest.mark.parametrize("model", [MISTRAL, GEMMA], ids=["mistral-7b", "gemma3-12b"])
def test_windowed_prefill_counts_the_pairs_within_the_window(model: ModelConfig) -> None:
    heads, d = model.num_heads, model.head_dim
    for n, p in ((512, 0), (4096, 0), (1024, 30000)):
        ops = attention(prefill_operators(model, n, prefix=p))
        for w, layers in window_layers(model):
            op = ops["attention" if w is None else "sliding_attention"]
            assert (op.flops, op.count) == (4 * heads * d * chunk_pairs(n, p, w), layers)
        attn = sum(o.count * o.flops for o in ops.values())
        assert attn == sum(4 * heads * d * chunk_pairs(n, p, w) * k for w, k in window_layers(model))
    assert prefill_tokens_per_s(model, 4096, 132, H100, prefix=28672) > prefill_tokens_per_s(full(model), 4096, 132,
                                                                                             H100, prefix=28672)
    assert totals(prefill_operators(model, 512))[0] == totals(prefill_operators(full(model), 512))[0]  # within W


@pytest.mark.parametrize("model", [MISTRAL, GEMMA], ids=["mistral-7b", "gemma3-12b"])
def test_roofline_costs_fused_step_of_a_windowed_model(model: ModelConfig) -> None:
    """The fused step is the mixed forward with each row's own window (not the mean's), cheaper than without
    windows on long contexts, the same when every context and prefix is within the window."""
    costs, plain = RooflineCosts(model, H100, CONFIGS), RooflineCosts(full(model), H100, CONFIGS)
    contexts, chunks = (200,) * 16 + (40000,) * 16, [(2048, 30000)]
    want = 1e3 * step_seconds(mixed_operators(model, contexts, chunks), 132, H100)
    assert costs.fused_ms(contexts, chunks) == pytest.approx(want, rel=1e-12)
    assert costs.fused_ms(contexts, chunks) < 0.6 * plain.fused_ms(contexts, chunks)
    # the mean context (20100) past the window would price the short rows at W: the exact sum is lower
    mean = sum(contexts) // len(contexts)
    assert costs.fused_ms(contexts, chunks) < 1e3 * step_seconds(
        mixed_operators(model, (mean,) * len(contexts), chunks), 132, H100)
    assert costs.fused_ms((500,) * 8, [(300, 200)]) == pytest.approx(plain.fused_ms((500,) * 8, [(300, 200)]),
                                                                      rel=1e-12)
    assert costs.fused_ms((), [(8192, 0)]) <= plain.fused_ms((), [(8192, 0)])
