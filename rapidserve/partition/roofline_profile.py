"""The roofline as a profile: every (configuration, batch, context) entry of a `Profile` estimated by
partition/roofline.py's operators (`roofline_profile`, `source="roofline"`: what stands in for a measured profile),
and a tensor-parallel shard profile with the collectives of its rank added (`with_collectives`, for measured shard
profiles and the roofline's alike: roofline.py's docstring, "Tensor parallelism")."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone

import msgspec

from rapidserve.config import ModelConfig
from rapidserve.partition.fp8_costs import is_fp8
from rapidserve.partition.peaks import Peaks
from rapidserve.partition.profile import Configuration, Entry, Profile, ProfileVariant, model_shape
from rapidserve.partition.roofline import (
    collectives_ms,
    concurrent_compute,
    decode_operators,
    plus_collectives,
    prefill_operators,
    step_seconds,
    without_collectives,
)
from rapidserve.quant_config import QuantizationConfig


def roofline_profile(
    model_cfg: ModelConfig, gpu_name: str, model_name: str, peaks: Peaks, configurations: Sequence[Configuration],
    batch_buckets: Sequence[int], context_buckets: Sequence[int], prefill_chunk: int, *, tp: int = 1,
    dtype_bytes: int = 2, p95_over_p50_alone: float = 1.1, p95_over_p50_beside: float = 1.25,
    created: str | None = None, kv_bytes: float | None = None, variant: ProfileVariant | None = None,
    quant: QuantizationConfig | None = None,
) -> Profile:
    """A Profile (source="roofline") with every (configuration, batch, context) entry estimated.

    p95 = p50 * p95_over_p50_* (beside: 1.25, median p95/p50 of docs/measured.md's split runs; alone: assumed).
    tp > 1 (`model_cfg` the whole model): the roofline's profile of one rank's shard (`tensor_parallel_size`
    tp) put through `with_collectives`, exactly as a measured shard profile is; its p95s are the shard's plus
    the collectives (the link model has no spread). `quant`: the weights' quantization (fp8: partition/fp8_costs.py),
    which `variant` (default: fp8 or not as `quant` is, the model dtype's KV cache) must agree with: ValueError
    otherwise (a profile of fp8 weights is another profile)."""
    weights = "fp8" if is_fp8(quant) else "none"
    v = variant or ProfileVariant(quantization=weights)
    if v.quantization != weights:
        raise ValueError(f"roofline_profile: variant quantization={v.quantization!r} but the weights estimated are "
                         f"{'fp8' if weights == 'fp8' else 'float'}; pass quant= the run's QuantizationConfig "
                         "(EngineConfig.quantization) with the variant of the same run (profile.variant_of)")
    entries = []
    p_ops = without_collectives(prefill_operators(model_cfg, prefill_chunk, tp=tp, dtype_bytes=dtype_bytes,
                                                  kv_bytes=kv_bytes, quant=quant))
    for c in configurations:
        alone_units = c.decode_units or peaks.num_compute_units
        for bb in batch_buckets:
            for cb in context_buckets:
                d_ops = without_collectives(decode_operators(model_cfg, bb, cb, tp=tp, dtype_bytes=dtype_bytes,
                                                             kv_bytes=kv_bytes, quant=quant))
                alone = 1e3 * step_seconds(d_ops, alone_units, peaks)
                t_d, tps = concurrent_compute(d_ops, p_ops, c.decode_units, c.prefill_units, prefill_chunk, peaks)
                entries.append(Entry(c.name, bb, cb, alone, alone * p95_over_p50_alone, t_d,
                                     t_d * p95_over_p50_beside, tps))
    stamp = created or datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    shard = Profile(gpu_name, model_name, peaks.num_compute_units, list(configurations), list(batch_buckets),
                    list(context_buckets), entries, stamp, "roofline", prefill_tokens=prefill_chunk,
                    tensor_parallel_size=tp, quantization=v.quantization, kv_cache_dtype=v.kv_cache_dtype,
                    model_shape=model_shape(model_cfg))
    return with_collectives(shard, model_cfg, peaks, dtype_bytes=dtype_bytes)


def with_collectives(shard: Profile, model_cfg: ModelConfig, peaks: Peaks, *, dtype_bytes: int = 2) -> Profile:
    """A shard profile (`tensor_parallel_size` = tp > 1: one rank's shard alone on one GPU, measured or the
    roofline's) with the collectives a rank of `model_cfg` (the whole model) runs at that size
    (`collectives_ms`) added by `plus_collectives`: each decode step (all four latency figures) gains its
    own, and each prefill forward of `shard.prefill_tokens` tokens its own, which lowers prefill tokens/s.
    A whole-model profile (tp 1) is returned as it is."""
    tp = shard.tensor_parallel_size
    if tp == 1:
        return shard
    b, tokens = dtype_bytes, shard.prefill_tokens
    p_link = collectives_ms(model_cfg, tokens, 1, peaks, tp=tp, dtype_bytes=b)
    entries = []
    for e in shard.entries:
        d_link = collectives_ms(model_cfg, e.batch, e.batch, peaks, tp=tp, dtype_bytes=b)
        beside, tps = plus_collectives(e.decode_ms_beside_prefill_p50, e.prefill_tokens_per_s, tokens, d_link, p_link)
        entries.append(msgspec.structs.replace(
            e, decode_ms_alone_p50=e.decode_ms_alone_p50 + d_link, decode_ms_alone_p95=e.decode_ms_alone_p95 + d_link,
            decode_ms_beside_prefill_p50=beside, decode_ms_beside_prefill_p95=e.decode_ms_beside_prefill_p95 + d_link,
            prefill_tokens_per_s=tps))
    return msgspec.structs.replace(shard, entries=entries)
