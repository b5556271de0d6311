"""What each step shape costs: the cost models the adaptive policy (partition/policies.py) searches over.

One protocol, `StepCosts`, two implementations:

* `RooflineCosts` (no profile for this GPU, model and variant): partition/roofline.py's operators timed with the
  peaks measured at start-up, the weights as the run stores them (`quant`: fp8 projections at one byte a value and
  the fp8 GEMM peak, partition/fp8_costs.py; the KV pool's element size `kv_bytes`). A fused step is ONE forward
  over the decode rows and the prompt chunks together (`mixed_operators`: the token-level operators over decode
  rows + chunk tokens, each decode row's attention over its context, each chunk's causal attention after its
  prefix; on a layer with a sliding window W, Mistral-7B-v0.1's every layer or Gemma 3's local ones, a row's over
  min(context, W) keys and a chunk's over the pairs and keys within W: partition/attention_costs.py) on the whole
  GPU; decode beside the prefill worker is `roofline.concurrent` on the configuration's two shares (decode rows
  at the mean context: an upper bound on a windowed model, min(mean, W) >= the mean of min(context, W)); decode
  alone is `decode_step_ms` on decode's share.
* `ProfileCosts` (the measured `profiles/<gpu>__<model>.json`, partition/profile.py's tables): decode alone
  and beside prefill are the profile's p95 at the decode batch and mean context (rounded up to its buckets,
  or interpolated: `--profile-lookup`), its step beside prefill bounded by the prefill work actually handed
  over as the rapid manager bounds it (`manager.beside_prefill_ms`); the prefill worker's tokens/s is the
  profile's under that configuration. The profile measures no fused step, so one is composed from what it
  does measure, the same decomposition as the roofline's:
      fused(B rows at context c, C chunk tokens) = alone(B, c) + max(0, (B + C) / R - alone(B, c0))
  where alone(B, c) is decode's step alone on the whole GPU (weights once, the rows' KV reads; read between the
  buckets unless `--profile-lookup round-up`: partition_config's docstring says why), alone(B, c0)
  the same rows at the smallest profiled context (the weight read and the rows' own work, nearly no
  attention), and R the whole GPU's prefill tokens/s (the overallocated configuration at batch 1, the least
  decode beside it). So a small chunk rides on the weight read decode pays anyway (the max is 0), a large
  one costs its tokens at the prefill rate, and the decode rows' attention over their contexts is added
  on top. A chunk's attention to its cached prefix, which the profile's own forward (prefix 0) did not have,
  is added at the roofline's rate per (query, key) pair (`prefix_pair_ms`: `roofline.prefix_pair_ms` from the
  peaks measured at start-up; 0 where there are none): tokens x prefix pairs, or on a layer with a sliding window
  W (Mistral-7B-v0.1, Gemma 3's local layers: `prefix_windows`) the pairs within W, at most W(W-1)/2 a chunk
  (`roofline.prefix_pairs`). On an H200, 2026-11-30, the
  Mooncake trace's fused steps (12K-token prompts in chunks after long prefixes) ran 1.08-1.22x their prediction
  without it, 22-33% of their token gaps over the SLO. The split's prefill batch pays the same pairs
  (`prefix_ms`: the same rate and windows, on the configuration's prefill share, whole units over its prefill
  units; in both models), which its tokens/s (a forward at prefix 0) leaves out: priced on the fused side alone,
  a split looked faster than it is deep into long prompts and after long cached conversations. The online
  correction (partition/correction.py) absorbs what steady bias remains.

Tensor parallelism: every figure is one rank's, collectives included, as the existing models have it: the
roofline's operators carry their collectives (`roofline.collective_ops`, `concurrent`'s `plus_collectives`),
and a measured shard profile comes here already put through `roofline_profile.with_collectives` by the plan
(partition/plan.py), so its decode steps and prefill rate hold them.

All times are milliseconds, predicted, uncorrected; nothing here touches a device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from rapidserve.config import ModelConfig
from rapidserve.partition.attention_costs import attention_windows, clipped_context_sums, prefix_pairs
from rapidserve.partition.manager import beside_prefill_ms, forward_ms
from rapidserve.partition.profile import OVERALLOCATED, Configuration, Entry, Profile
from rapidserve.partition.profile_lookup import estimate
from rapidserve.partition.roofline import (
    Peaks,
    concurrent,
    decode_step_ms,
    mixed_operators_summed,
    prefix_pair_ms,
    step_seconds,
)
from rapidserve.quant_config import QuantizationConfig

Chunk = tuple[int, int]  # (tokens, prefix) of one prompt chunk
# `RooflineCosts.split` remembers its answers (a roofline `concurrent` costs ~0.5 ms of Python, and a decision asks
# for every split at a few batch sizes), keyed by the decode context rounded UP to this many tokens (a step predicted
# for at most this much more KV: conservative), so the steps of one decode batch share them; at most MEMO_SIZE kept.
CONTEXT_GRAIN = 64
MEMO_SIZE = 4096


class StepCosts(Protocol):
    """Predicted times of the pieces a step shape is made of. `configurations`: the plan's, the
    overallocated one (decode_units 0: the whole GPU) and the splits."""

    configurations: tuple[Configuration, ...]

    def fused_ms(self, contexts: Sequence[int], chunks: Sequence[Chunk]) -> float:
        """One mixed forward on the whole GPU: a new token for each decode context plus the prompt chunks."""
        ...

    def decode_alone_ms(self, config: str, batch: int, context: int) -> float:
        """A decode step of `batch` rows at mean `context` on `config`'s decode share, nothing beside it."""
        ...

    def split(self, config: str, batch: int, context: int, prefill_tokens: int) -> tuple[float, float]:
        """(decode step ms, prefill tokens/s) with decode on `config`'s decode share and the prefill worker
        running a batch of `prefill_tokens` tokens on the rest (overallocated: both on the whole GPU)."""
        ...

    def prefix_ms(self, config: str, chunks: Sequence[Chunk]) -> float:
        """What the prefill worker's batch of these chunks adds on `config`'s prefill share for their attention to
        their cached prefixes, which `split`'s tokens/s (a forward at prefix 0) leaves out: the same pairs the fused
        composition prices, at the same rate per pair, on the share's units (0 without a rate)."""
        ...


def _windowed_pairs(chunks: Sequence[Chunk], windows: Sequence[tuple[int | None, float]]) -> float:
    """The chunks' (query, key) pairs beyond their prefixes, weighted by the layers' attention windows."""
    return sum(share * prefix_pairs(n, p, w) for n, p in chunks if p for w, share in windows)


def _configuration(configs: Sequence[Configuration], name: str) -> Configuration:
    for c in configs:
        if c.name == name:
            return c
    raise KeyError(f"configuration {name!r} is not in the plan ({[c.name for c in configs]})")


@dataclass(frozen=True)
class RooflineCosts:
    """The roofline's costs (module docstring): `model_cfg` the whole model, `tp` its tensor-parallel size, `quant` its
    weights' quantization (None: float weights)."""

    model_cfg: ModelConfig
    peaks: Peaks
    configurations: tuple[Configuration, ...]
    tp: int = 1
    dtype_bytes: int = 2
    kv_bytes: float | None = None  # the KV pool's element size (1: an fp8 cache; None: dtype_bytes)
    quant: QuantizationConfig | None = None  # the weights' (EngineConfig.quantization); None: float
    _memo: dict[tuple[str, int, int, int], tuple[float, float]] = field(default_factory=dict, compare=False,
                                                                       repr=False)
    _pair_ms: float = field(init=False, compare=False, repr=False)  # roofline.prefix_pair_ms of the run
    _windows: tuple[tuple[int | None, float], ...] = field(init=False, compare=False, repr=False)

    def fused_ms(self, contexts: Sequence[int], chunks: Sequence[Chunk]) -> float:
        ops = mixed_operators_summed(self.model_cfg, len(contexts), sum(contexts), chunks, tp=self.tp,
                                     dtype_bytes=self.dtype_bytes, kv_bytes=self.kv_bytes, quant=self.quant,
                                     window_sums=clipped_context_sums(self.model_cfg, contexts))
        return 1e3 * step_seconds(ops, self.peaks.num_compute_units, self.peaks)

    def decode_alone_ms(self, config: str, batch: int, context: int) -> float:
        c = _configuration(self.configurations, config)
        units = c.decode_units or self.peaks.num_compute_units
        return decode_step_ms(self.model_cfg, max(batch, 1), max(context, 1), units, self.peaks, self.tp,
                              dtype_bytes=self.dtype_bytes, kv_bytes=self.kv_bytes, quant=self.quant)

    def split(self, config: str, batch: int, context: int, prefill_tokens: int) -> tuple[float, float]:
        key = (config, batch, -(-max(context, 1) // CONTEXT_GRAIN) * CONTEXT_GRAIN, prefill_tokens)
        hit = self._memo.get(key)
        if hit is None:
            if len(self._memo) >= MEMO_SIZE:
                self._memo.clear()
            hit = self._memo[key] = self._split(config, batch, key[2], prefill_tokens)
        return hit

    def __post_init__(self) -> None:  # what prefix_ms reads each decision: fixed for the run
        object.__setattr__(self, "_pair_ms", prefix_pair_ms(self.model_cfg, self.peaks, self.tp))
        object.__setattr__(self, "_windows", attention_windows(self.model_cfg))

    def prefix_ms(self, config: str, chunks: Sequence[Chunk]) -> float:
        pairs = _windowed_pairs(chunks, self._windows)
        if not pairs:
            return 0.0
        c = _configuration(self.configurations, config)
        units = self.peaks.num_compute_units
        return self._pair_ms * pairs * units / (c.prefill_units if c.decode_units else units)

    def _split(self, config: str, batch: int, context: int, prefill_tokens: int) -> tuple[float, float]:
        c = _configuration(self.configurations, config)
        return concurrent(self.model_cfg, max(batch, 1), max(context, 1), c.decode_units, c.prefill_units,
                          max(prefill_tokens, 1), self.peaks, self.tp, dtype_bytes=self.dtype_bytes,
                          kv_bytes=self.kv_bytes, quant=self.quant)


@dataclass(frozen=True)
class ProfileCosts:
    """The measured profile's costs (module docstring). `interpolate`: a decode step on a configuration (alone,
    beside prefill) read between the buckets, else rounded up to them; `interpolate_fused`: the same for the fused
    composition's decode terms (`--profile-lookup`: partition_config.lookup_interpolates; auto interpolates the
    fused composition only)."""

    profile: Profile
    interpolate: bool = False
    interpolate_fused: bool = True
    prefix_pair_ms: float = 0.0  # a chunk's attention to its cached prefix, ms per (query, key) pair (docstring)
    # the layers' attention windows and the share of the layers with each (`roofline.attention_windows`): a sliding
    # layer's chunk attends to at most its window of the prefix (`roofline.prefix_pairs`)
    prefix_windows: tuple[tuple[int | None, float], ...] = ((None, 1.0),)
    configurations: tuple[Configuration, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "configurations", tuple(self.profile.configurations))

    def _entry(self, config: str, batch: int, context: int, interpolate: bool | None = None) -> Entry:
        how = self.interpolate if interpolate is None else interpolate
        return estimate(self.profile, config, max(batch, 1), max(context, 1), interpolate=how).entry

    @property
    def whole_config(self) -> str:
        """Decode's configuration on the whole GPU: overallocated, else the split with the most decode units."""
        if self.profile.configuration(OVERALLOCATED) is not None:
            return OVERALLOCATED
        return max(self.configurations, key=lambda c: (c.decode_units, c.name)).name

    @property
    def whole_prefill_tokens_per_s(self) -> float:
        """R: the whole GPU's prefill rate, the overallocated configuration's with the least decode beside it
        (batch 1, the smallest context); a profile without that configuration: its best rate."""
        if self.profile.configuration(OVERALLOCATED) is not None:
            return self._entry(OVERALLOCATED, 1, 1).prefill_tokens_per_s
        return max(e.prefill_tokens_per_s for e in self.profile.entries)

    def fused_ms(self, contexts: Sequence[int], chunks: Sequence[Chunk]) -> float:
        whole, batch = self.whole_config, len(contexts)
        tokens = batch + sum(n for n, _ in chunks)
        if batch:
            context = -(-sum(contexts) // batch)
            alone = self._entry(whole, batch, context, self.interpolate_fused).decode_ms_alone_p95
            base = self._entry(whole, batch, 1, self.interpolate_fused).decode_ms_alone_p95
        else:
            alone = base = forward_ms(self.profile, whole)
        prefix = self.prefix_pair_ms * _windowed_pairs(chunks, self.prefix_windows) if self.prefix_pair_ms else 0.0
        return alone + max(0.0, 1e3 * tokens / self.whole_prefill_tokens_per_s - base) + prefix

    def decode_alone_ms(self, config: str, batch: int, context: int) -> float:
        return self._entry(config, batch, context).decode_ms_alone_p95

    def split(self, config: str, batch: int, context: int, prefill_tokens: int) -> tuple[float, float]:
        e = self._entry(config, batch, context)
        return beside_prefill_ms(e, prefill_tokens, forward_ms(self.profile, config)), e.prefill_tokens_per_s

    def prefix_ms(self, config: str, chunks: Sequence[Chunk]) -> float:
        if not self.prefix_pair_ms:
            return 0.0
        pairs = _windowed_pairs(chunks, self.prefix_windows)
        p = self.profile  # on the split's prefill share: whole units over its own (overallocated: all of them)
        return self.prefix_pair_ms * pairs * p.num_compute_units / p.effective_prefill_units(config) if pairs else 0.0
