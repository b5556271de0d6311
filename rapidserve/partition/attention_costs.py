"""The roofline's attention operators, per layer window (partition/roofline.py's module docstring has the formulas).

A layer with a sliding window W (ModelConfig.layer_window: every layer of Mistral-7B-v0.1, 4096; Gemma 3's local
layers, 5 of 6, 1024 or the config's) lets the query at absolute position j (0-based) see the keys
max(0, j+1-W) .. j only, and the attention kernels (FA3 / Triton, rapidserve/attention/) skip the rest, reading no
more of the KV cache than that. So the layers are grouped by window (`window_layers`), and each group's attention
operator counts the keys its layers actually attend:

* a decode row at `context` positions: min(context, W) keys (all of them on a layer without a window);
* a prefill chunk of n tokens after a prefix p: the pairs sum over i < n of min(p+i+1, W) (`chunk_pairs`;
  n*p + n(n+1)/2 without a window) and the keys it reads, positions max(0, p+1-W) .. p+n-1 (`chunk_keys`:
  min(p+n, W-1+n); p+n without a window).

A model without windows has one group, (None, num_layers): the operator the roofline always had, to the bit.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence

from rapidserve.config import ModelConfig

Window = int | None  # a layer's sliding window; None: it attends to every earlier token


def window_layers(model_cfg: ModelConfig) -> tuple[tuple[Window, int], ...]:
    """The model's layers grouped by attention window: (window, number of layers), ascending by window, None last:
    ((None, L),) without a sliding window, ((4096, 32),) for Mistral-7B-v0.1, ((1024, 40), (None, 8)) for
    gemma3-12b."""
    if model_cfg.sliding_window is None:  # the common case, without a look at the layers
        return ((None, model_cfg.num_layers),)
    return _window_layers(model_cfg.num_layers, model_cfg.sliding_window, model_cfg.layer_types)


@functools.lru_cache(maxsize=64)
def _window_layers(num_layers: int, window: int, layer_types: tuple[str, ...]) -> tuple[tuple[Window, int], ...]:
    """`window_layers` from the fields ModelConfig.layer_window reads (a policy's search asks at every step)."""
    sliding = sum(1 for t in layer_types if t == "sliding_attention") if layer_types else num_layers
    return tuple((w, n) for w, n in ((window, sliding), (None, num_layers - sliding)) if n)


def attention_windows(model_cfg: ModelConfig) -> tuple[tuple[Window, float], ...]:
    """The model's layers' attention windows (None: every earlier token), each with the share of the layers that has
    it, ascending by window, None last: ((None, 1.0),) for a model with no sliding window, ((4096, 1.0),) for
    Mistral-7B-v0.1, ((1024, 5/6), (None, 1/6)) for Gemma 3 (`ModelConfig.layer_window`)."""
    return tuple((w, n / model_cfg.num_layers) for w, n in window_layers(model_cfg))


def _seen(m: int, window: int) -> int:
    """The (query, key) pairs of positions 1..m, each query over its last `window` keys: sum of min(W, j)."""
    k = min(m, window)
    return k * (k + 1) // 2 + (m - k) * window


def chunk_pairs(tokens: int, prefix: int, window: Window = None) -> int:
    """The (query, key) pairs of one layer's causal attention of a chunk of `tokens` after `prefix` cached ones:
    tokens x prefix + tokens(tokens+1)/2 without a window, else sum over the chunk's queries of min(prefix+i+1, W)."""
    if window is None:
        return tokens * prefix + tokens * (tokens + 1) // 2
    return _seen(prefix + tokens, window) - _seen(prefix, window)


def chunk_keys(tokens: int, prefix: int, window: Window = None) -> int:
    """The keys (cached and the chunk's own) one layer's attention of that chunk reads: prefix + tokens without a
    window, else positions max(0, prefix+1-W) .. prefix+tokens-1."""
    return prefix + tokens if window is None else min(prefix + tokens, window - 1 + tokens)


def prefix_pairs(tokens: int, prefix: int, window: Window = None) -> int:
    """The (query, key) pairs one layer's attention of a chunk of `tokens` after `prefix` cached ones has beyond the
    same chunk's at prefix 0 (what a profile measured at prefix 0 leaves out): tokens x prefix without a window; with
    a sliding `window` W (a query sees its last W keys, itself included) a query sees at most W keys whatever the
    prefix, so at most W(W-1)/2 in all however long the prefix or the chunk. Non-decreasing in `tokens`."""
    return chunk_pairs(tokens, prefix, window) - chunk_pairs(tokens, 0, window)


def clipped_context_sums(model_cfg: ModelConfig, contexts: Iterable[int]) -> dict[int, int]:
    """For each sliding window W of the model, the decode rows' keys on such a layer: sum of min(context, W)
    (`roofline.mixed_operators_summed`'s `window_sums`); {} for a model without windows."""
    windows = [w for w, _ in window_layers(model_cfg) if w is not None]
    if not windows:
        return {}
    cs = list(contexts)
    return {w: sum(min(c, w) for c in cs) for w in windows}


def attention_terms(
    model_cfg: ModelConfig, heads: int, kv_heads: int, batch: int, context_sum: int, chunks: Sequence[tuple[int, int]],
    b: float, kv_b: float, window_sums: Mapping[int, int] | None = None,
) -> list[tuple[str, float, float, int]]:
    """(name, flops, io bytes, layers) of each window group's attention operator of one step (per GPU: `heads` q and
    `kv_heads` kv heads): `batch` decode rows whose contexts add up to `context_sum`, each attending to min(context,
    W) keys on a layer of window W (`window_sums[W]`; without it min(context_sum, batch x W), an upper bound that
    is exact when every row's context is on the same side of W), and the prompt `chunks` (tokens, prefix), each
    with its `chunk_pairs` and `chunk_keys`. "attention" is the group without a window, "sliding_attention" the
    windowed one."""
    d, out = model_cfg.head_dim, []
    for w, layers in window_layers(model_cfg):
        if w is None:
            keys = context_sum
        else:
            keys = window_sums[w] if window_sums is not None and w in window_sums else min(context_sum, batch * w)
        flops = 4 * heads * d * keys
        io = 2 * kv_heads * d * keys * kv_b + 2 * heads * d * batch * b
        flops += sum(4 * heads * d * chunk_pairs(n, p, w) for n, p in chunks)
        io += sum(2 * n * heads * d * b + 2 * kv_heads * d * chunk_keys(n, p, w) * kv_b for n, p in chunks)
        out.append(("attention" if w is None else "sliding_attention", flops, io, layers))
    return out
