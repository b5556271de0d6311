"""DRIFT's decisions carried out (`--policy drift`): the inputs `decide_drift` is fed in the engine, and
the configuration the decode worker applies. Pure functions; nothing here touches a device.

Who decides what (docs/architecture.md, "DRIFT"):
* the decode worker picks the partition configuration at its step boundaries (it holds the decode batch
  and contexts, which the choice depends on, and only it switches its graphs): `decide_drift` over every
  configuration with decode's step beside prefill from the profile (`decode_ms_beside`), carried out
  with hysteresis (`drift_configuration`); it tells prefill (SetPartition) the configuration and decode's
  predicted step there (`decode_step_ms`), to which prefill sizes its layer blocks;
* the prefill worker forms the batches, sizes the blocks and preempts (engine/drift_prefill.py):
  `decide_drift` at each layer-block boundary over the one configuration decode chose, with its queue,
  the running and the preempted batch.
Both feed `decide_drift` the same per-configuration linear prefill model, fitted at start-up
(`prefill_models`): contention-free prefill time on the configuration's prefill units from the roofline
(partition/roofline.py) with the peaks measured then, or the operator's (`--drift-prefill-model`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rapidserve.config import ModelConfig
from rapidserve.partition.drift import DriftDecision, LinearModel, fit_linear
from rapidserve.partition.manager import ManagerState, full_decode_config
from rapidserve.partition.profile import Configuration, Profile
from rapidserve.partition.profile_lookup import estimate
from rapidserve.partition.roofline import Peaks, collectives_ms, prefill_operators, step_seconds, without_collectives
from rapidserve.quant_config import QuantizationConfig

FIT_FRACTIONS = (1 / 16, 1 / 8, 1 / 4, 1 / 2, 1)  # of the token budget: the roofline points a model is fitted to


def prefill_models(model_cfg: ModelConfig, peaks: Peaks, configs: Sequence[Configuration], budget: int, *,
                   dtype_bytes: int = 2, tp: int = 1, kv_bytes: float | None = None,
                   quant: QuantizationConfig | None = None) -> dict[str, LinearModel]:
    """Per configuration, prefill time (ms) = a + b * tokens, least squares over the roofline's time of one
    chunk of budget/16 .. budget tokens alone on the configuration's prefill units (all of them where it
    is overallocated): DRIFT's contention-free linear model. tp > 1 (`model_cfg` the whole model): the line
    of one rank's shard plus the line of its collectives (`roofline.collectives_ms`, affine in the tokens,
    so the sum is exactly the shard's estimate plus the collectives term at every size). `kv_bytes`: the KV pool's
    element size (1 for an fp8 cache; default dtype_bytes); `quant`: the weights' quantization (fp8 projections
    at one byte a value and the fp8 GEMM peak: partition/fp8_costs.py; None: float)."""
    sizes = sorted({max(1, round(budget * f)) for f in FIT_FRACTIONS} | {max(2, budget)})
    b = dtype_bytes
    link = fit_linear([(n, collectives_ms(model_cfg, n, 1, peaks, tp=tp, dtype_bytes=b)) for n in sizes])
    out = {}
    for c in configs:
        units = c.prefill_units if c.decode_units else peaks.num_compute_units
        own = fit_linear([(n, 1e3 * step_seconds(without_collectives(prefill_operators(
            model_cfg, n, tp=tp, dtype_bytes=b, kv_bytes=kv_bytes, quant=quant)), units, peaks)) for n in sizes])
        out[c.name] = LinearModel(own.a_ms + link.a_ms, own.b_ms_per_token + link.b_ms_per_token)  # tp 1: + 0
    return out


def effective_prefill_units(profile: Profile) -> dict[str, int]:
    return {c.name: profile.effective_prefill_units(c.name) for c in profile.configurations}


def decode_ms_beside(profile: Profile, batch: int, context: int) -> dict[str, float]:
    """Decode's step p95 beside a running prefill (ms) per configuration, at the profile's bucket (past the largest:
    extrapolated, `profile_lookup.estimate`)."""
    return {c.name: estimate(profile, c.name, max(batch, 1), max(context, 1)).entry.decode_ms_beside_prefill_p95
            for c in profile.configurations}


def drift_configuration(state: ManagerState, d: DriftDecision, profile: Profile, beside: Mapping[str, float],
                        limit_ms: float, *, decode_running: bool, hysteresis_steps: int = 8,
                        ) -> tuple[str, str, ManagerState]:
    """Carry out the configuration of a `DriftDecision` made at a decode step boundary (no running or
    preempted batch given: its config is the partition DRIFT picks for prefill beside this decode batch).

    Target: decode on the whole GPU while no prefill is waiting (action idle); the configuration with
    the most prefill units while no decode runs; else the decision's. A switch happens at once when no
    decode runs (it disturbs nobody), when the current configuration is not in the profile, or when the
    current one's decode step beside prefill breaks the limit while prefill waits (the rapid manager's
    rule); any other waits `hysteresis_steps` steps held."""
    names = {c.name for c in profile.configurations}
    if d.action == "idle":
        target, why = full_decode_config(profile), "no prefill waiting: decode on the whole GPU"
    elif not decode_running:
        target = max(profile.configurations, key=lambda c: (profile.effective_prefill_units(c.name), c.name)).name
        why = "no decode running: prefill on the most units"
    else:
        target, why = d.config, f"prefill beside decode: {d.config} ({beside[d.config]:.2f} ms decode step)"
    current = state.config
    if target == current:
        return current, f"keep {current}: {why}", ManagerState(current, state.steps_since_switch + 1)
    urgent = (current not in names or not decode_running
              or (d.action != "idle" and beside[current] > limit_ms))
    if urgent or state.steps_since_switch >= hysteresis_steps:
        return target, f"switch {current} -> {target}: {why}", ManagerState(target, 0)
    return (current, f"hold {current} (held {state.steps_since_switch} < {hysteresis_steps} steps); would switch "
            f"to {target}: {why}", ManagerState(current, state.steps_since_switch + 1))
