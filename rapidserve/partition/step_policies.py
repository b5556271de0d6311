"""The engine's four policies as `StepPolicy`s (partition/shape.py), and the one that a config and a plan make.

* `FusedPolicy` (`--policy fused`, vLLM / Sarathi-Serve's shape): every step one mixed step with the whole
  token budget (`Fused(max_chunk_tokens)`); nothing to predict or correct.
* `RapidPolicy` (`--policy rapid`, RAPID-Serve): always split; the configuration is the rapid manager's
  (partition/manager.py `decide`: the profile's configuration with the most prefill throughput whose decode
  step beside prefill meets the ITL SLO, with its hysteresis), or the plan's one configuration (`--partition
  static` / `off`). Prompts go to the prefill worker (`Split`), in batches of `prefill_batch_tokens`.
* `DuetPolicy` (`--policy duet`, DuetServe): partition/policies.py, fused when it can, split when it must.
* `DriftPolicy` (`--policy drift`, DRIFT): always split; the configuration is DRIFT's (partition/drift.py
  `decide_drift` over every configuration, carried out with hysteresis by drift_plan.py's
  `drift_configuration`); its prefill worker forms, sizes and preempts its own batches (engine/drift_prefill.py).
Each takes its `name` and `workers` from `policy_spec.POLICY_SPECS`, the declarations the flag check is derived
from, so what a policy says it uses and what the check assumes are one thing.

The state a policy keeps between steps (the hysteresis memory, the online correction) lives in the object;
each `decide` is a pure function of it and the `ShapeState`, and the tests drive them through tables.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from rapidserve.config import EngineConfig
from rapidserve.partition.drift import LinearModel, decide_drift
from rapidserve.partition.drift_plan import decode_ms_beside, drift_configuration, effective_prefill_units
from rapidserve.partition.manager import ManagerState, decide, full_decode_config, make_state
from rapidserve.partition.policies import AdaptiveParams, DuetPolicy
from rapidserve.partition.policy import PolicyState
from rapidserve.partition.profile import Profile
from rapidserve.partition.runtime import PartitionPlan
from rapidserve.partition.shape import DecodeAlone, Fused, ShapeState, Split, StepPolicy, StepShape, StepTiming
from rapidserve.partition.step_costs import ProfileCosts, RooflineCosts, StepCosts
from rapidserve.policy_spec import POLICY_SPECS


def _context(state: ShapeState) -> int:
    c = state.decode_contexts
    return -(-sum(c) // len(c)) if c else 0


class FusedPolicy:
    name = "fused"
    workers = POLICY_SPECS["fused"].workers

    def decide(self, state: ShapeState) -> StepShape:
        return Fused(state.max_chunk_tokens)

    def observe(self, timing: StepTiming) -> None:
        """Nothing to correct: the fused policy predicts nothing."""


def _split_or_alone(state: ShapeState, config: str, batch_tokens: int | None) -> StepShape:
    """Prompts pending: hand them to the prefill worker beside decode on `config`; else decode alone there."""
    if state.pending_tokens == 0:
        return DecodeAlone(config)
    return Split(config, max(1, min(state.pending_tokens, batch_tokens or state.max_chunk_tokens)))


class RapidPolicy:
    """RAPID-Serve: the rapid manager's configuration (module docstring). `profile` None: the plan's one
    configuration `initial` (static or no partition)."""

    name = "rapid"
    workers = POLICY_SPECS["rapid"].workers

    def __init__(self, profile: Profile | None, initial: str, *, hysteresis_steps: int = 8,
                 prefill_batch_tokens: int | None = None, interpolate: bool = False) -> None:
        self.profile, self.hysteresis_steps = profile, hysteresis_steps
        self.batch_tokens, self.interpolate = prefill_batch_tokens, interpolate
        self.state: ManagerState = make_state(full_decode_config(profile) if profile is not None else initial)

    def decide(self, state: ShapeState) -> StepShape:
        if self.profile is None:
            return _split_or_alone(state, self.state.config, self.batch_tokens)
        batch, pending = len(state.decode_contexts), state.pending_tokens
        work = pending + state.prefill_worker_tokens
        longest = max((w.prefix + w.tokens for w in state.waiting), default=0)
        d, self.state = decide(
            self.state, decode_batch=max(batch, 1), decode_context=max(_context(state), 1),
            prefill_pending=work > 0, slo_itl_ms=state.slo_itl_ms if state.slo_itl_ms is not None else math.inf,
            profile=self.profile, hysteresis_steps=0 if batch == 0 else self.hysteresis_steps,
            decode_running=batch > 0, prefill_tokens=work if work else None,
            prefill_budget=self.batch_tokens or state.max_chunk_tokens,
            prefill_longest=longest if work else None, interpolate=self.interpolate)
        return _split_or_alone(state, d.config, self.batch_tokens)

    def observe(self, timing: StepTiming) -> None:
        """Nothing to correct: the rapid policy reads the measured profile as it is."""


class DriftPolicy:
    """DRIFT: decode's configuration from `decide_drift` (module docstring); the prefill worker dispatches."""

    name = "drift"
    workers = POLICY_SPECS["drift"].workers

    def __init__(self, profile: Profile, models: Mapping[str, LinearModel], num_layers: int, *,
                 slo_ttft_ms: float | None = None, slo_ttft_ms_per_1k_tokens: float = 0.0,
                 hysteresis_steps: int = 8) -> None:
        self.profile, self.models, self.num_layers = profile, dict(models), num_layers
        self.slo_ttft_ms, self.per_1k, self.hysteresis_steps = slo_ttft_ms, slo_ttft_ms_per_1k_tokens, hysteresis_steps
        self.state: ManagerState = make_state(full_decode_config(profile))

    def decide(self, state: ShapeState) -> StepShape:
        contexts, slo = state.decode_contexts, state.slo_itl_ms if state.slo_itl_ms is not None else math.inf
        beside = decode_ms_beside(self.profile, len(contexts), _context(state))
        # now_s 0: at a decode step boundary no prefill batch is given (running / preempted are the prefill worker's),
        # so DRIFT's choice of configuration does not read the clock
        st = PolicyState(0.0, contexts, state.waiting, slo, self.slo_ttft_ms,
                         prefill_budget=state.max_chunk_tokens, slo_ttft_ms_per_1k_tokens=self.per_1k)
        d = decide_drift(st, models=self.models, decode_ms_beside=beside,
                         prefill_units=effective_prefill_units(self.profile), num_layers=self.num_layers)
        name, _, self.state = drift_configuration(self.state, d, self.profile, beside, 0.9 * slo,
                                                  decode_running=bool(contexts),
                                                  hysteresis_steps=self.hysteresis_steps)
        return _split_or_alone(state, name, state.max_chunk_tokens)

    def observe(self, timing: StepTiming) -> None:
        """Nothing to correct: DRIFT's models are fitted at start-up (or given)."""


def step_costs(cfg: EngineConfig, plan: PartitionPlan) -> StepCosts:
    """The adaptive policy's cost model for this run: the measured profile where the plan has one, else the roofline
    with the plan's peaks (its configurations), one rank's shard plus its collectives at -tp N."""
    p = cfg.partition
    if plan.profile is not None and plan.profile.source == "measured":
        return ProfileCosts(plan.profile, interpolate=p.profile_lookup == "interpolate")
    if plan.peaks is None:
        raise ValueError("the adaptive policy without a measured profile needs the plan's peaks (resolve_plan measures "
                         "them for --policy duet)")
    return RooflineCosts(cfg.model_config, plan.peaks, tuple(plan.configurations),
                         tp=cfg.parallel.tensor_parallel_size)


def make_step_policy(cfg: EngineConfig, plan: PartitionPlan, *, dtype_bytes: int = 2) -> StepPolicy:
    """The StepPolicy `cfg.partition.policy` names, built from the run's partition plan (partition/runtime.py)."""
    p, sched = cfg.partition, cfg.scheduler
    if p.policy == "fused":
        return FusedPolicy()
    if p.policy == "rapid":
        return RapidPolicy(plan.profile if len(plan.configurations) > 1 else None, plan.initial,
                           hysteresis_steps=p.hysteresis_steps, prefill_batch_tokens=sched.prefill_batch_tokens,
                           interpolate=p.profile_lookup == "interpolate")
    if p.policy == "duet":
        costs = step_costs(cfg, plan)
        if isinstance(costs, RooflineCosts) and costs.dtype_bytes != dtype_bytes:
            costs = RooflineCosts(costs.model_cfg, costs.peaks, costs.configurations, costs.tp, dtype_bytes)
        return DuetPolicy(costs, AdaptiveParams(hysteresis_steps=p.hysteresis_steps,
                                                prefill_batch_tokens=sched.prefill_batch_tokens))
    if p.policy == "drift":
        if plan.profile is None or not plan.prefill_models:
            raise ValueError("--policy drift needs the plan's profile and prefill models (resolve_plan makes them)")
        return DriftPolicy(plan.profile, plan.prefill_models, cfg.model_config.num_layers, slo_ttft_ms=p.slo_ttft_ms,
                           slo_ttft_ms_per_1k_tokens=p.slo_ttft_ms_per_1k_tokens, hysteresis_steps=p.hysteresis_steps)
    raise ValueError(f"policy={p.policy!r}; use one of {', '.join(POLICY_SPECS)}")

