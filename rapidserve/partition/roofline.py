"""Roofline fallback: decode/prefill latency from operator counts and the device's measured peaks.

Stands in for a measured profile (`source="roofline"`), after DuetServe's attention-aware roofline:
a step is a list of operators, each timed on `u` of the device's `N` compute units (f = u/N) as
    t_op = max(flops / (P * e * f), bytes / bw)        (communication: link_bytes / link_bw + link_latency)

with P the measured GEMM FLOP/s (an fp8 GEMM's: `Peaks.fp8_flops`; partition/peaks.py measures both at start-up),
e = gemm_efficiency (attention: attn_efficiency), bw the bandwidth that phase gets (below), and the step time the
sum over operators. Operators, per GPU under TP=tp:

* token-level (cost ~ tokens T; weights read once per step): add+RMSNorm x2, QKV, RoPE + KV-cache
  write, O, gate/up, SiLU*mul, down; the embedding gather (T rows), final norm, LM head (R rows:
  decode R=batch, prefill R=1). GEMM flops = 2*T*K*N, bytes = (K*N + T*K + T*N) * dtype_bytes.
* sequence-level (attention, per sequence, per layer over the keys it attends: one operator per group of layers
  with the same window, partition/attention_costs.py): decode over K = `context` cached positions:
  flops = 4*Hq*d*K, bytes = 2*Hkv*d*K * kv_bytes + 2*Hq*d * dtype_bytes (the KV read dominates);
  a prefill chunk of n tokens after `prefix` cached ones (causal), with A (query, key) pairs and K keys read:
  A = n*prefix + n(n+1)/2, K = prefix + n;  flops = 4*Hq*d*A, bytes = 2*n*Hq*d * dtype_bytes + 2*Hkv*d*K * kv_bytes.
  A layer with a sliding window W (Mistral-7B-v0.1's every layer, Gemma 3's local ones; the kernels skip the rest)
  attends to the last W keys only: decode K = min(context, W); a chunk A = sum over its queries i < n of
  min(prefix+i+1, W), K = min(prefix+n, W-1+n) (the window's keys, not the prefix's). A model without windows has
  one group, every layer, as before.
  kv_bytes: the KV pool's element size (`kv_element_bytes`: 1 with --kv-cache-dtype fp8, else dtype_bytes), also
  the K/V write of rope_kv_write.
* fp8 weights (`quant`, the run's `QuantizationConfig`; partition/fp8_costs.py): the decoder layers' fp8 projections
  read their weights at one byte a value plus their float32 scales (one per output row, or per 128x128-style
  block), their fp8 input rows and scales, and multiply at the fp8 GEMM peak; their inputs are quantized by the
  RMSNorm / SiLU-and-mul / decode attention before them where the engine fuses it (those write fp8 rows), else by
  a quantizer pass of their own. The embedding, the norms, the LM head (and a mixture-of-experts model's experts)
  stay at dtype_bytes. Without `quant` (or method "none") every weight is counted at dtype_bytes.
* communication (tp > 1, `collective_ops`): ring all-reduces of T*h, link_bytes = 2(tp-1)/tp*T*h*b, two
  per layer (after o_proj and down_proj) and one after the vocabulary-parallel embedding, and an all-gather
  of the logits, (tp-1)/tp*R*V'*b (V' the vocabulary padded to a multiple of tp). Zero at tp=1.
* mixture-of-experts layers (partition/moe_costs.py): router, gate|up and down of the experts the step reads
  (a decode step the expected unique experts of its batch, a prefill chunk all of them) instead of the dense MLP.

Tensor parallelism (tp > 1): an estimate of one rank is its shard's estimate (every operator at the
rank's share) plus its collectives (`collectives_ms`), each phase's on its own communicator, so neither
waits for the other's: a decode step takes its collectives' time more, a prefill forward of P tokens its
own (`plus_collectives`, lower tokens/s). Contention between the phases is modelled on the shard's compute
alone. Every cost model of a `-tp N` engine adds exactly this term: a measured shard profile
(`with_collectives`), the roofline profile (`roofline_profile(tp=N)`, the same function on the roofline's
shard; both in partition/roofline_profile.py), `concurrent`, duet's decisions and DRIFT's prefill lines
(partition/drift_plan.py).

Bandwidth vs compute share (fitted to docs/measured.md's decode-alone table on 16/32/48/64/132 H100 SMs):
    bw(f) = hbm_bw * bw_efficiency * share(f),   share(f) = (1+k)*f / (f+k),   k = bw_knee = 0.285
share(1) = 1; memory bandwidth saturates with few units (share(0.25) = 0.60, share(0.5) = 0.82).
Fit errors -4/+3/+3/+3/-5 %; a hard cap min(1, f/f_sat) fits worse (best f_sat 0.305: up to 13 %).

Concurrency (solo rates r_d, r_p = bytes / solo step time break the circularity):
* split (decode on u_d units, prefill on u_p, disjoint): units are exclusive, the memory system is
  shared. When the two demands exceed BW = hbm_bw*bw_efficiency, each gets its proportional part:
    bw_decode  = bw(f_d) * min(1, BW / (bw(f_d) + r_p)) / (1 + split_contention)
    bw_prefill = bw(f_p) * min(1, BW / (bw(f_p) + r_d));  t_prefill *= 1 + prefill_contention * r_d / BW
  split_contention (0.36): FACTS, decode beside a GEMM prefill ran 1.34-1.45x its solo time on the same
  SMs; prefill_contention (0.47): prefill ran 1.16-1.46x its linearly scaled time, growing with r_d.
* overallocated (both on all units): assumed kernel-granular sharing in which decode gets a fraction
  of the GPU's time: each of its K_d kernels waits overalloc_wait of a prefill kernel
  (t_prefill / K_p) before it runs, so t_decode' = t_decode + K_d * w * t_prefill / K_p, and prefill
  keeps the rest: t_prefill' = t_prefill / (1 - t_decode / t_decode'). w = 0.44 fits FACTS (32 decode
  GEMMs beside 2.46 ms prefill GEMMs: 1.40 -> 35.9 ms). That starvation is Hopper's; an AMD GPU may
  differ: a measured profile always takes precedence.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Literal, NamedTuple

from rapidserve.config import CacheConfig, ModelConfig
from rapidserve.partition.attention_costs import attention_terms, clipped_context_sums
from rapidserve.partition.attention_costs import attention_windows as attention_windows  # moved there
from rapidserve.partition.attention_costs import prefix_pairs as prefix_pairs  # moved there
from rapidserve.partition.fp8_costs import fp8_layers, fused_producer_io, producer_quantizes, projection_terms
from rapidserve.partition.moe_costs import experts_read, moe_operator_terms
from rapidserve.partition.peaks import Peaks
from rapidserve.partition.peaks import measure_peaks as measure_peaks  # its home moved to peaks.py
from rapidserve.quant_config import QuantizationConfig


class Operator(NamedTuple):
    """One operator of a step (per GPU), repeated `count` times (e.g. once per layer); `fp8`: a GEMM of fp8 operands,
    its flops timed at `Peaks.fp8_flops` (partition/fp8_costs.py)."""

    name: str
    kind: Literal["token", "sequence", "communication"]
    flops: float
    weight_bytes: float
    io_bytes: float
    link_bytes: float = 0.0
    count: int = 1
    fp8: bool = False

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.io_bytes


def bw_share(f: float, knee: float) -> float:
    """share(f) = (1+k)*f/(f+k): the fraction of full-device bandwidth reachable with a unit share f."""
    f = min(max(f, 0.0), 1.0)
    return (1 + knee) * f / (f + knee)


def _tp_sizes(cfg: ModelConfig, tp: int) -> tuple[int, int, int, int]:
    """(q heads, kv heads, intermediate, vocab) per GPU; KV heads are replicated when fewer than tp."""
    if tp < 1 or cfg.num_heads % tp or cfg.intermediate_size % tp:
        raise ValueError(f"tp={tp} must divide num_heads={cfg.num_heads} and intermediate_size")
    return cfg.num_heads // tp, max(1, cfg.num_kv_heads // tp), cfg.intermediate_size // tp, -(-cfg.vocab_size // tp)


def kv_element_bytes(cache: CacheConfig, dtype_bytes: float = 2) -> float:
    """Bytes of one KV pool element: 1 for an fp8 cache, else the model's `dtype_bytes`."""
    return 1.0 if cache.fp8_kv else dtype_bytes


def _step_ops(
    cfg: ModelConfig, tokens: int, rows: int, attention: Sequence[tuple[str, float, float, int]], tp: int, b: int,
    experts: float = 0.0, kv_b: float | None = None, quant: QuantizationConfig | None = None, decode: bool = False,
) -> list[Operator]:
    """All operators of one forward step over `tokens` tokens, `rows` of which reach the LM head; `attention`: the
    (name, flops, io bytes, layers) of each window group's attention (partition/attention_costs.py); a
    mixture-of-experts model's sparse layers read `experts` experts each (partition/moe_costs.py); `kv_b`: bytes of
    a KV pool element, default `b`. `quant`: the model's weights (None or method "none": float, every projection at
    `b`; fp8: partition/fp8_costs.py); `decode`: a step of decode rows only, whose attention quantizes o_proj's
    input where the engine fuses that (fp8 only)."""
    kv_b = b if kv_b is None else kv_b
    heads, kv_heads, inter, vocab = _tp_sizes(cfg, tp)
    h, d, L, T = cfg.hidden_size, cfg.head_dim, cfg.num_layers, tokens
    dense = L if cfg.moe is None else L - cfg.moe.num_sparse(L)  # layers with the dense MLP
    q, kv = heads * d, kv_heads * d
    bias = (q + 2 * kv) if cfg.attention_bias else 0
    f8, fused = fp8_layers(cfg, quant), producer_quantizes(quant)

    def proj(name: str, k: int, n: int, bias: int, layers: int, input_quantized: bool) -> list[Operator]:
        return [Operator(nm, "token", f, w, io, count=c, fp8=e) for nm, f, w, io, c, e in projection_terms(
            name, k, n, bias, layers, f8[name], T, b, quant, input_quantized)]

    ops = [
        Operator("embed", "token", 0.0, 0.0, 2 * T * h * b),
        *_fused_part(Operator("add_norm", "token", 5 * T * h, h * b, 4 * T * h * b, count=2 * L),
                     f8["qkv_proj"] + f8["gate_up_proj"] if fused else 0, fused_producer_io(h, T, b, 3)),
        *proj("qkv_proj", h, q + 2 * kv, bias, L, fused),
        Operator("rope_kv_write", "token", 3 * T * (q + kv), (2 * d if cfg.qk_norm else 0) * b,
                 2 * T * (q + kv) * b + 2 * T * kv * kv_b, count=L),
        *(Operator(name, "sequence", f, 0.0, io, count=n) for name, f, io, n in attention),
        *proj("o_proj", q, h, 0, L, fused and decode),
        *proj("gate_up_proj", h, 2 * inter, 0, dense, fused),
        *_fused_part(Operator("act_mul", "token", 5 * T * inter, 0.0, 3 * T * inter * b, count=dense),
                     f8["down_proj"] if fused else 0, fused_producer_io(inter, T, b, 2)),
        *proj("down_proj", inter, h, 0, dense, fused),
        Operator("final_norm", "token", 5 * rows * h, h * b, 4 * rows * h * b),
        Operator("lm_head", "token", 2 * rows * h * vocab, h * vocab * b, rows * (h + vocab) * b),
    ]
    ops += [Operator(name, "token", f, w, io, count=n)
            for name, f, w, io, n in moe_operator_terms(cfg, T, experts, tp, b)]
    return ops + collective_ops(cfg, T, rows, tp=tp, dtype_bytes=b)


def _fused_part(op: Operator, fused: int, fused_io: float) -> list[Operator]:
    """`op` with `fused` of its `count` runs writing fp8 rows for the next projection (io `fused_io` each): [op] when
    none do."""
    if not fused:
        return [op]
    return [o for o in (op._replace(io_bytes=fused_io, count=fused), op._replace(count=op.count - fused)) if o.count]


def collective_ops(cfg: ModelConfig, tokens: int, rows: int, *, tp: int, dtype_bytes: int = 2) -> list[Operator]:
    """The collectives one rank of tensor parallel `tp` runs in a forward step over `tokens` tokens, `rows` of
    which reach the LM head (none at tp 1): the all-reduces of tokens x hidden (two per layer, one after the
    embedding) and the all-gather of the rows' logits over the padded vocabulary. The one formula of the
    collectives: every estimate at tp > 1 gets it from here (module docstring)."""
    if tp == 1:
        return []
    h, b, padded_vocab = cfg.hidden_size, dtype_bytes, _tp_sizes(cfg, tp)[3] * tp
    return [Operator("all_reduce", "communication", 0.0, 0.0, 0.0, 2 * (tp - 1) / tp * tokens * h * b,
                     2 * cfg.num_layers + 1),
            Operator("logits_all_gather", "communication", 0.0, 0.0, 0.0, (tp - 1) / tp * rows * padded_vocab * b)]


def collectives_ms(cfg: ModelConfig, tokens: int, rows: int, peaks: Peaks, *, tp: int, dtype_bytes: int = 2) -> float:
    """The collectives term (ms) of one forward step of one rank (`collective_ops`) on the link model: each
    collective link_bytes / link_bw + link_latency_s, whatever the rank's compute share. 0 at tp 1."""
    return 1e3 * _link_seconds(collective_ops(cfg, tokens, rows, tp=tp, dtype_bytes=dtype_bytes), peaks)


def plus_collectives(decode_ms: float, prefill_tokens_per_s: float, prefill_tokens: int, decode_link_ms: float,
                     prefill_link_ms: float) -> tuple[float, float]:
    """A shard's (decode step ms, prefill tokens/s) with its collectives: the decode step takes `decode_link_ms`
    more, each prefill forward of `prefill_tokens` tokens `prefill_link_ms` more. Both phases' collectives run
    on their own communicators (parallel/group.py), so neither waits for the other's."""
    per_forward_s = prefill_tokens / prefill_tokens_per_s + prefill_link_ms / 1e3
    return decode_ms + decode_link_ms, prefill_tokens / per_forward_s


def without_collectives(ops: Iterable[Operator]) -> list[Operator]:
    """The shard's own operators of a step (its collectives dropped): what one rank computes."""
    return [o for o in ops if o.kind != "communication"]


def decode_operators(
    cfg: ModelConfig, batch: int, context: int, *, tp: int = 1, dtype_bytes: int = 2, kv_bytes: float | None = None,
    quant: QuantizationConfig | None = None,
) -> list[Operator]:
    """One decode step: `batch` sequences, one new token each, attending to `context` positions each (a layer with a
    sliding window W: to min(context, W)); `kv_bytes`: the KV pool's element size, default `dtype_bytes`; `quant`: the
    weights' quantization, None: float."""
    if batch < 1 or context < 1:
        raise ValueError(f"batch={batch} and context={context} must be >= 1")
    heads, kv_heads, _, _ = _tp_sizes(cfg, tp)
    kv_b = dtype_bytes if kv_bytes is None else kv_bytes
    attn = attention_terms(cfg, heads, kv_heads, batch, context * batch, (), dtype_bytes, kv_b)
    return _step_ops(cfg, batch, batch, attn, tp, dtype_bytes, experts_read(cfg, batch), kv_b, quant, True)


def prefill_operators(
    cfg: ModelConfig, chunk_tokens: int, *, prefix: int = 0, tp: int = 1, dtype_bytes: int = 2,
    kv_bytes: float | None = None, quant: QuantizationConfig | None = None,
) -> list[Operator]:
    """One prefill chunk of one sequence: `chunk_tokens` new tokens after `prefix` cached ones (causal; a layer with
    a sliding window: each query over its last W keys, attention_costs.chunk_pairs / chunk_keys)."""
    if chunk_tokens < 1 or prefix < 0:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1 and prefix={prefix} >= 0")
    (heads, kv_heads, _, _), n = _tp_sizes(cfg, tp), chunk_tokens
    kv_b = dtype_bytes if kv_bytes is None else kv_bytes
    attn = attention_terms(cfg, heads, kv_heads, 0, 0, [(n, prefix)], dtype_bytes, kv_b)
    return _step_ops(cfg, n, 1, attn, tp, dtype_bytes, experts_read(cfg, n, every=True), kv_b, quant)


def mixed_operators(
    cfg: ModelConfig, contexts: Sequence[int], chunks: Sequence[tuple[int, int]], *, tp: int = 1,
    dtype_bytes: int = 2, kv_bytes: float | None = None, quant: QuantizationConfig | None = None,
) -> list[Operator]:
    """One mixed forward (hybrid / DuetServe's aggregated batch): one new token for each decode context,
    and prompt chunks (tokens, prefix); token-level operators over all tokens, attention per sequence."""
    if any(c < 1 for c in contexts) or any(n < 1 or p < 0 for n, p in chunks) or not (contexts or chunks):
        raise ValueError(f"contexts={list(contexts)} and chunks={list(chunks)}: need work, contexts >= 1, "
                         "chunk tokens >= 1, prefixes >= 0")
    return mixed_operators_summed(cfg, len(contexts), sum(contexts), chunks, tp=tp, dtype_bytes=dtype_bytes,
                                  kv_bytes=kv_bytes, quant=quant, window_sums=clipped_context_sums(cfg, contexts))


def mixed_operators_summed(
    cfg: ModelConfig, batch: int, context_sum: int, chunks: Sequence[tuple[int, int]], *, tp: int = 1,
    dtype_bytes: int = 2, kv_bytes: float | None = None, quant: QuantizationConfig | None = None,
    window_sums: Mapping[int, int] | None = None,
) -> list[Operator]:
    """`mixed_operators` of `batch` decode rows whose contexts add up to `context_sum`: the decode rows' attention
    is linear in each context, so their sum is all it needs (a policy's search over chunk sizes sums once); on a
    layer with a sliding window W, the sum of min(context, W), `window_sums[W]` (`clipped_context_sums`); without
    it min(context_sum, batch x W), an upper bound, exact when every context is on the same side of W."""
    if batch < 0 or context_sum < batch or any(n < 1 or p < 0 for n, p in chunks) or not (batch or chunks):
        raise ValueError(f"batch={batch}, context_sum={context_sum} and chunks={list(chunks)}: need work, contexts "
                         ">= 1, chunk tokens >= 1, prefixes >= 0")
    (heads, kv_heads, _, _), b = _tp_sizes(cfg, tp), dtype_bytes
    kv_b = b if kv_bytes is None else kv_bytes
    attn = attention_terms(cfg, heads, kv_heads, batch, context_sum, chunks, b, kv_b, window_sums)
    tokens = batch + sum(n for n, _ in chunks)
    return _step_ops(cfg, tokens, batch + len(chunks), attn, tp, b, experts_read(cfg, tokens), kv_b, quant,
                     not chunks)


def totals(ops: Sequence[Operator]) -> tuple[float, float]:
    """(flops, HBM bytes) of a step."""
    return sum(o.count * o.flops for o in ops), sum(o.count * o.bytes for o in ops)


def _kernels(ops: Iterable[Operator]) -> int:
    return sum(o.count for o in ops if o.kind != "communication")


def _bw_alone(f: float, peaks: Peaks) -> float:
    return peaks.hbm_bw * peaks.bw_efficiency * bw_share(f, peaks.bw_knee)


def _one_link_s(o: Operator, peaks: Peaks) -> float:
    return o.link_bytes / peaks.link_bw + peaks.link_latency_s


def _link_seconds(ops: Iterable[Operator], peaks: Peaks) -> float:
    return sum(o.count * _one_link_s(o, peaks) for o in ops if o.kind == "communication")


def step_seconds(ops: Iterable[Operator], units: int, peaks: Peaks, bw: float | None = None) -> float:
    """Sum over operators of max(compute time, memory time) on `units` units with bandwidth `bw`."""
    if not 0 < units <= peaks.num_compute_units:
        raise ValueError(f"units={units} must be within 1..{peaks.num_compute_units}")
    f = units / peaks.num_compute_units
    bw = _bw_alone(f, peaks) if bw is None else bw
    total = 0.0
    for o in ops:
        if o.kind == "communication":
            t = _one_link_s(o, peaks)
        else:
            eff = peaks.attn_efficiency if o.kind == "sequence" else peaks.gemm_efficiency
            peak = peaks.fp8_flops if o.fp8 else peaks.matmul_flops
            t = max(o.flops / (peak * eff * f), o.bytes / bw)
        total += o.count * t
    return total


def decode_step_ms(
    model_cfg: ModelConfig, batch: int, context: int, units: int, peaks: Peaks, tp: int = 1, *, dtype_bytes: int = 2,
    kv_bytes: float | None = None, quant: QuantizationConfig | None = None,
) -> float:
    """Decode step latency (ms) alone on `units` units."""
    ops = decode_operators(model_cfg, batch, context, tp=tp, dtype_bytes=dtype_bytes, kv_bytes=kv_bytes, quant=quant)
    return 1e3 * step_seconds(ops, units, peaks)


def prefix_pair_ms(model_cfg: ModelConfig, peaks: Peaks, tp: int = 1) -> float:
    """Milliseconds a (query, key) pair of a prompt chunk's attention to its cached prefix adds on the whole GPU,
    every layer: the attention operator's compute term per pair (4 x q heads x head_dim flops a layer at the
    'sequence' efficiency). A chunk of more than a few dozen tokens makes that operator compute-bound (2 x Hq/Hkv x
    tokens flops per KV byte read), so its time grows by this per pair; what a fused step composed from a profile
    measured at prefix 0 leaves out (partition/step_costs.py). A layer with a sliding window has fewer pairs
    (`prefix_pairs`), and a chunk of a few tokens after a long prefix is bound by the prefix's KV read instead, which
    this does not price."""
    heads = _tp_sizes(model_cfg, tp)[0]
    return 1e3 * 4 * heads * model_cfg.head_dim * model_cfg.num_layers / (peaks.matmul_flops * peaks.attn_efficiency)


def prefill_tokens_per_s(
    model_cfg: ModelConfig, chunk_tokens: int, units: int, peaks: Peaks, tp: int = 1, *, prefix: int = 0,
    dtype_bytes: int = 2, kv_bytes: float | None = None, quant: QuantizationConfig | None = None,
) -> float:
    """Prefill throughput (tokens/s) alone on `units` units, one chunk of `chunk_tokens` at a time."""
    ops = prefill_operators(model_cfg, chunk_tokens, prefix=prefix, tp=tp, dtype_bytes=dtype_bytes, kv_bytes=kv_bytes,
                            quant=quant)
    return chunk_tokens / step_seconds(ops, units, peaks)


def concurrent(
    model_cfg: ModelConfig, batch: int, context: int, decode_units: int, prefill_units: int, prefill_chunk: int,
    peaks: Peaks, tp: int = 1, *, dtype_bytes: int = 2, kv_bytes: float | None = None,
    quant: QuantizationConfig | None = None,
) -> tuple[float, float]:
    """(decode step ms, prefill tokens/s) with both phases running; decode_units == 0: overallocated.
    tp > 1: the shard's concurrency (`model_cfg` is the whole model) plus each phase's collectives
    (`plus_collectives`), as a measured shard profile gets them."""
    b = dtype_bytes
    d_ops = decode_operators(model_cfg, batch, context, tp=tp, dtype_bytes=b, kv_bytes=kv_bytes, quant=quant)
    p_ops = prefill_operators(model_cfg, prefill_chunk, tp=tp, dtype_bytes=b, kv_bytes=kv_bytes, quant=quant)
    t_d, tps = concurrent_compute(without_collectives(d_ops), without_collectives(p_ops), decode_units,
                                   prefill_units, prefill_chunk, peaks)
    if tp == 1:
        return t_d, tps
    d_link = collectives_ms(model_cfg, batch, batch, peaks, tp=tp, dtype_bytes=b)
    return plus_collectives(t_d, tps, prefill_chunk, d_link,
                            collectives_ms(model_cfg, prefill_chunk, 1, peaks, tp=tp, dtype_bytes=b))


def concurrent_compute(d_ops: Sequence[Operator], p_ops: Sequence[Operator], decode_units: int, prefill_units: int,
                       prefill_chunk: int, peaks: Peaks) -> tuple[float, float]:
    """`concurrent` of the two phases' compute operators (no collectives)."""
    n = peaks.num_compute_units
    if decode_units == 0:
        t_d, t_p = step_seconds(d_ops, n, peaks), step_seconds(p_ops, n, peaks)
        t_d2 = t_d + _kernels(d_ops) * peaks.overalloc_wait * t_p / _kernels(p_ops)
        return 1e3 * t_d2, prefill_chunk * (1 - t_d / t_d2) / t_p
    if prefill_units < 1 or decode_units + prefill_units > n:
        raise ValueError(f"split {decode_units}/{prefill_units} must have prefill units and fit in {n} units")
    bw_d, bw_p = _bw_alone(decode_units / n, peaks), _bw_alone(prefill_units / n, peaks)
    r_d = totals(d_ops)[1] / step_seconds(d_ops, decode_units, peaks)
    r_p = totals(p_ops)[1] / step_seconds(p_ops, prefill_units, peaks)
    full = peaks.hbm_bw * peaks.bw_efficiency
    bw_d2 = bw_d * min(1.0, full / (bw_d + r_p)) / (1 + peaks.split_contention)
    bw_p2 = bw_p * min(1.0, full / (bw_p + r_d))
    t_p2 = step_seconds(p_ops, prefill_units, peaks, bw_p2) * (1 + peaks.prefill_contention * r_d / full)
    return 1e3 * step_seconds(d_ops, decode_units, peaks, bw_d2), prefill_chunk / t_p2


def decode_step_ms_beside_prefill(
    model_cfg: ModelConfig, batch: int, context: int, decode_units: int, prefill_units: int, prefill_chunk: int,
    peaks: Peaks, tp: int = 1, *, dtype_bytes: int = 2, kv_bytes: float | None = None,
    quant: QuantizationConfig | None = None,
) -> float:
    """Decode step latency (ms) while prefill runs chunks of `prefill_chunk`; decode_units=0: overallocated."""
    return concurrent(model_cfg, batch, context, decode_units, prefill_units, prefill_chunk, peaks, tp,
                      dtype_bytes=dtype_bytes, kv_bytes=kv_bytes, quant=quant)[0]

