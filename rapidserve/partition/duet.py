"""DuetServe's policy (arXiv 2511.04791, sections 4.1-4.3) as a pure decision function.

Aggregated by default: the running decodes and the next prefill batch run as ONE mixed forward on the
whole GPU (as hybrid mode does). An attention-aware roofline (`partition/roofline.py`: token-level,
sequence-level and communication operators, with the peaks measured at start-up) predicts that step's
latency. When it exceeds the TBT SLO (times `margin`), the SMs are split: decode runs k steps on S_d
while the prefill batch runs once on S_p, and the split and k are chosen to maximise throughput,
    (k * B + P) / max(k * t_d, t_p),  subject to t_d <= margin * SLO,
with t_d the predicted decode step beside the prefill on S_d, t_p the prefill batch's time on S_p,
B the decode batch and P the prefill tokens; k = ceil(t_p / t_d), so the k decode steps (dispatched
ahead, without a host sync between them) cover the prefill. Where no split meets the SLO, the one
with the fastest decode step is taken and the decision says so.

Under tensor parallelism (`tp` > 1, `model_cfg` the whole model) every time predicted is one rank's: its
shard's plus its collectives (`roofline.collectives_ms`, added as the roofline module docstring says), the
same term the rapid manager's profile and DRIFT's prefill models get.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from rapidserve.config import ModelConfig
from rapidserve.partition.manager import ManagerState
from rapidserve.partition.policy import PolicyState, prefill_batch
from rapidserve.partition.profile import OVERALLOCATED, Configuration
from rapidserve.partition.roofline import Peaks, concurrent, mixed_operators, step_seconds
from rapidserve.quant_config import QuantizationConfig

Mode = Literal["idle", "decode", "aggregated", "split"]


@dataclass(frozen=True)
class DuetDecision:
    mode: Mode
    prefill: tuple[tuple[str, int, int], ...]  # (req_id, chunk tokens, prefix) of the prefill batch
    decode_units: int  # split: decode's SMs/CUs; 0: the whole GPU (aggregated or decode alone)
    prefill_units: int  # split: prefill's; 0 otherwise
    lookahead: int  # decode steps dispatched on decode_units while the prefill batch runs (1 unless split)
    predicted_step_ms: float  # aggregated / decode alone: the step; split: one decode step beside prefill
    predicted_prefill_ms: float  # split: the prefill batch on prefill_units; aggregated: the mixed step
    meets_slo: bool
    reason: str


def decide_duet(state: PolicyState, model_cfg: ModelConfig, peaks: Peaks, splits: Sequence[Configuration], *,
                margin: float = 0.9, tp: int = 1, shared: bool = False, kv_bytes: float | None = None,
                quant: QuantizationConfig | None = None) -> DuetDecision:
    """The next iteration's configuration. Pure: same inputs, same outputs. `kv_bytes`: the KV pool's element size
    (1: an fp8 cache; None: the model dtype's); `quant`: the weights' quantization (fp8: partition/fp8_costs.py).

    shared=True is how the two-process engine aggregates: decode and prefill run as two processes on the
    whole GPU, their kernels interleaving, not as one mixed step. Decode's step beside the prefill batch
    is then predicted by the roofline's overallocated model (`roofline.concurrent` with decode on the
    whole GPU: each decode kernel waits on part of a prefill kernel), which grows with the prefill's
    kernel sizes where the mixed step grows with its work; aggregation needs that step within the SLO."""
    if not 0 < margin <= 1:
        raise ValueError("margin must be in (0, 1]")
    limit = margin * state.slo_tbt_ms
    batch = prefill_batch(state)
    contexts = state.decode_contexts
    n = peaks.num_compute_units
    if not batch and not contexts:
        return DuetDecision("idle", (), 0, 0, 1, 0.0, 0.0, True, "no work")
    chunks = [(t, p) for _, t, p in batch]
    t_mix = 1e3 * step_seconds(mixed_operators(model_cfg, contexts, chunks, tp=tp, kv_bytes=kv_bytes, quant=quant),
                               n, peaks)
    step = "decode beside the prefill" if shared else "mixed step"
    if shared and batch and contexts:
        tokens = sum(t for t, _ in chunks)
        t_mix = concurrent(model_cfg, len(contexts), state.mean_context, 0, n, tokens, peaks, tp, kv_bytes=kv_bytes,
                           quant=quant)[0]
    if not batch:
        return DuetDecision("decode", (), 0, 0, 1, t_mix, 0.0, t_mix <= limit,
                            f"decode only: {t_mix:.2f} ms on the whole GPU")
    if not contexts or t_mix <= limit:
        why = "no decode running" if not contexts else f"{step} {t_mix:.2f} ms <= {limit:g} ms"
        return DuetDecision("aggregated", batch, 0, 0, 1, t_mix, t_mix, True, f"aggregated: {why}")
    tokens = sum(t for t, _ in chunks)
    best: tuple[float, int, DuetDecision] | None = None
    fastest: DuetDecision | None = None
    for c in splits:
        if c.decode_units == 0 or c.prefill_units < 1:
            continue
        t_d, tok_s = concurrent(model_cfg, len(contexts), state.mean_context, c.decode_units, c.prefill_units,
                                tokens, peaks, tp, kv_bytes=kv_bytes, quant=quant)
        t_p = 1e3 * tokens / tok_s
        k = max(1, math.ceil(t_p / t_d))
        ok = t_d <= limit
        d = DuetDecision("split", batch, c.decode_units, c.prefill_units, k, t_d, t_p, ok,
                         f"split {c.name}: {step} {t_mix:.2f} ms > {limit:g} ms; decode {t_d:.2f} ms x {k} "
                         f"beside prefill {t_p:.2f} ms")
        if fastest is None or t_d < fastest.predicted_step_ms:
            fastest = d
        if ok:
            tput = (k * len(contexts) + tokens) / max(k * t_d, t_p)
            if best is None or (tput, c.decode_units) > (best[0], best[1]):
                best = (tput, c.decode_units, d)
    if best is not None:
        return best[2]
    if fastest is None:
        return DuetDecision("aggregated", batch, 0, 0, 1, t_mix, t_mix, False,
                            f"aggregated: {step} {t_mix:.2f} ms > {limit:g} ms and no split is configured")
    return DuetDecision("split", batch, fastest.decode_units, fastest.prefill_units, fastest.lookahead,
                        fastest.predicted_step_ms, fastest.predicted_prefill_ms, False,
                        f"SLO cannot be met ({state.slo_tbt_ms:g} ms): {fastest.reason}")


def duet_configuration(state: ManagerState, d: DuetDecision, configs: Sequence[Configuration], *,
                       hysteresis_steps: int = 8, decode_running: bool = True) -> tuple[str, str, ManagerState]:
    """Carry a `DuetDecision` out on the two-process engine: (configuration, reason, next state).

    The engine has no fused mixed step across its processes, so DuetServe's aggregated mode (and decode
    or prefill alone) is `overallocated`: both processes on the whole GPU, their kernels interleaving.
    A split is the configuration with the decision's decode units. Leaving aggregation for a split (the
    roofline says the shared step would miss the SLO) happens at once, and so does any switch while no
    decode runs (it disturbs nobody); any other change waits `hysteresis_steps` steps in the current
    configuration, so a queue that grows and shrinks does not switch (and sync the streams) every step."""
    names = {c.name for c in configs}
    if d.mode == "split":
        target = next((c.name for c in configs if c.decode_units == d.decode_units), None)
        if target is None:
            raise ValueError(f"no configuration gives decode {d.decode_units} units; have {sorted(names)}")
    else:
        target = OVERALLOCATED if OVERALLOCATED in names else max(configs, key=lambda c: c.prefill_units).name
    current = state.config
    if target == current:
        return current, f"keep {current}: {d.reason}", ManagerState(current, state.steps_since_switch + 1)
    urgent = (current not in names or not decode_running
              or (d.mode == "split" and current == OVERALLOCATED))
    if urgent or state.steps_since_switch >= hysteresis_steps:
        return target, f"switch {current} -> {target}: {d.reason}", ManagerState(target, 0)
    return (current, f"hold {current} (held {state.steps_since_switch} < {hysteresis_steps} steps); would switch "
            f"to {target}: {d.reason}", ManagerState(current, state.steps_since_switch + 1))
