"""The engine's four policies as `StepPolicy`s (partition/shape.py), and the one that a config and a plan make.

* `FusedPolicy` (`--policy fused`, vLLM / Sarathi-Serve's shape): every step one mixed step with the whole
  token budget (`Fused(max_chunk_tokens)`); nothing to predict or correct.
* `RapidPolicy` (`--policy rapid`, RAPID-Serve): always split; the configuration is the rapid manager's
  (partition/manager.py `decide`: the profile's configuration with the most prefill throughput whose decode
  step beside prefill meets the ITL SLO, with its hysteresis), or the plan's one configuration (`--partition
  static` / `off`). Prompts go to the prefill worker (`Split`), in batches of `prefill_batch_tokens`.
* `DuetPolicy` (`--policy duet`, DuetServe): partition/policies.py, fused when it can, split when it must. With no
  ITL SLO (`--slo-itl-ms none`) its rule is every step fused with the whole token budget, never split; on a plan
  with no cost model (one configuration: a CPU, `--partition-backend none`) that rule runs as `DuetWithoutSlo`.
* `DriftPolicy` (`--policy drift`, DRIFT): always split; the configuration is DRIFT's (partition/drift.py
  `decide_drift` over every configuration, carried out with hysteresis by drift_plan.py's
  `drift_configuration`); its prefill worker forms, sizes and preempts its own batches (engine/drift_prefill.py).
Each takes its `name` and `workers` from `policy_spec.POLICY_SPECS`, the declarations the flag check is derived
from, so what a policy says it uses and what the check assumes are one thing.

The state a policy keeps between steps (the hysteresis memory, the online correction) lives in the object;
each `decide` is a pure function of it and the `ShapeState`, and the tests drive them through tables.
The engine carries them out through the one decode worker (engine/decode_worker.py). Beside them:
* `AlwaysFused` (`--mode hybrid`): the fused policy as the worker runs it (the step's budget less its decode rows;
  reads no queue);
* `AlwaysSplit` (`--policy rapid|drift` in the engine): today's partition manager (`DecodePartition.advance`,
  `advance_drift`, with the same inputs as before the one engine) as a StepPolicy; `RapidPolicy` and
  `DriftPolicy` above are the same decisions as pure StepPolicies, table-tested, and replace it once measured;
* `ScriptedPolicy` (tests): the shapes of a list, or of a function of the call count and the state, so a test
  forces fused -> split -> fused transitions where it wants them.
A policy may say it reads no queue (`reads_waiting = False`, an optional attribute; absent: True): the worker
then leaves `ShapeState.waiting` empty rather than look up every queued prompt's cached prefix each step; one that
reads only the queue's head (`reads_queue_head = True`: `DuetPolicy`) is told only that head (partition/shape.py
`ShapeState`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from rapidserve.config import EngineConfig
from rapidserve.config_base import ConfigError
from rapidserve.partition.correction import CorrectionParams
from rapidserve.partition.drift import LinearModel, decide_drift
from rapidserve.partition.drift_plan import decode_ms_beside, drift_configuration, effective_prefill_units
from rapidserve.partition.manager import ManagerState, decide, full_decode_config, make_state
from rapidserve.partition.margin import DEFAULT_MARGIN
from rapidserve.partition.plan import PartitionPlan
from rapidserve.partition.policies import AdaptiveParams, DuetPolicy
from rapidserve.partition.policy import PendingWork, PolicyState
from rapidserve.partition.profile import Profile
from rapidserve.partition.roofline import attention_windows, prefix_pair_ms
from rapidserve.partition.runtime import DecodePartition
from rapidserve.partition.shape import DecodeAlone, Fused, ShapeState, Split, StepPolicy, StepShape, StepTiming
from rapidserve.partition.step_costs import ProfileCosts, RooflineCosts, StepCosts
from rapidserve.partition_config import lookup_interpolates
from rapidserve.policy_spec import POLICY_SPECS
from rapidserve.runner.prefill_graphs import usable_buckets


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


class DuetWithoutSlo(FusedPolicy):
    """`--policy duet --slo-itl-ms none` on a plan without a cost model (no measured profile, no peaks: one
    configuration, nothing to switch): `decide_adaptive`'s rule for no SLO, fused with the whole token budget,
    which needs no prediction, on duet's workers (the prefill worker is started and never handed a prompt)."""

    name = "duet"
    workers = POLICY_SPECS["duet"].workers
    reads_waiting = False  # the decision reads no queue


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


def has_cost_model(plan: PartitionPlan) -> bool:
    """Whether `step_costs` has what it builds the adaptive policy's cost model from: a measured profile, or peaks."""
    return (plan.profile is not None and plan.profile.source == "measured") or plan.peaks is not None


def step_costs(cfg: EngineConfig, plan: PartitionPlan) -> StepCosts:
    """The adaptive policy's cost model for this run: the measured profile where the plan has one, else the roofline
    with the plan's peaks (its configurations) and the run's weights and KV cache (fp8 or not), one rank's shard plus
    its collectives at -tp N."""
    p = cfg.partition
    if plan.profile is not None and plan.profile.source == "measured":
        pairs = 0.0 if plan.peaks is None else prefix_pair_ms(cfg.model_config, plan.peaks,
                                                              cfg.parallel.tensor_parallel_size)
        return ProfileCosts(plan.profile, interpolate=lookup_interpolates(p.profile_lookup, fused=False),
                            interpolate_fused=lookup_interpolates(p.profile_lookup, fused=True), prefix_pair_ms=pairs,
                            prefix_windows=attention_windows(cfg.model_config))
    if p.profile_lookup != "auto":  # the roofline is no table of buckets: the flag (given) would change nothing
        raise ConfigError(f"--profile-lookup {p.profile_lookup} reads a measured profile's buckets, and this run "
                          f"has none ({plan.source}): the adaptive policy prices its steps with the roofline. Give "
                          "--profile PATH, let the auto-profile measure one (no --no-auto-profile), or drop the flag")
    if plan.peaks is None:
        raise ValueError("the adaptive policy without a measured profile needs the plan's peaks (resolve_plan measures "
                         "them for --policy duet)")
    return RooflineCosts(cfg.model_config, plan.peaks, tuple(plan.configurations),
                         tp=cfg.parallel.tensor_parallel_size, kv_bytes=1.0 if cfg.cache.fp8_kv else None,
                         quant=cfg.quantization)


def make_step_policy(cfg: EngineConfig, plan: PartitionPlan, *, dtype_bytes: int = 2) -> StepPolicy:
    """The StepPolicy `cfg.partition.policy` names, built from the run's partition plan (partition/plan.py)."""
    p, sched = cfg.partition, cfg.scheduler
    if p.policy == "fused":
        return FusedPolicy()
    if p.policy == "rapid":
        return RapidPolicy(plan.profile if len(plan.configurations) > 1 else None, plan.initial,
                           hysteresis_steps=p.hysteresis_steps, prefill_batch_tokens=sched.prefill_batch_tokens,
                           interpolate=lookup_interpolates(p.profile_lookup, fused=False))
    if p.policy == "duet":
        if p.slo_itl_ms is None and not has_cost_model(plan):
            return DuetWithoutSlo()  # no cost model, and none needed: every step fused with the whole budget
        costs = step_costs(cfg, plan)
        if isinstance(costs, RooflineCosts) and costs.dtype_bytes != dtype_bytes:
            costs = RooflineCosts(costs.model_cfg, costs.peaks, costs.configurations, costs.tp, dtype_bytes,
                                  costs.kv_bytes, costs.quant)
        params = AdaptiveParams(hysteresis_steps=p.hysteresis_steps, prefill_batch_tokens=sched.prefill_batch_tokens,
                                graph_buckets=fused_buckets(cfg),
                                **({} if p.slo_margin is None else {"margin": p.slo_margin}))
        adapt = p.slo_margin is None and p.slo_itl_ms is not None  # with no SLO there is no margin to adapt
        correction = CorrectionParams(by_shape=p.step_correction == "by-shape")
        return DuetPolicy(costs, params, correction, margin=DEFAULT_MARGIN if adapt else None)
    if p.policy == "drift":
        if plan.profile is None or not plan.prefill_models:
            raise ValueError("--policy drift needs the plan's profile and prefill models (resolve_plan makes them)")
        return DriftPolicy(plan.profile, plan.prefill_models, cfg.model_config.num_layers, slo_ttft_ms=p.slo_ttft_ms,
                           slo_ttft_ms_per_1k_tokens=p.slo_ttft_ms_per_1k_tokens, hysteresis_steps=p.hysteresis_steps)
    raise ValueError(f"policy={p.policy!r}; use one of {', '.join(POLICY_SPECS)}")


def fused_buckets(cfg: EngineConfig) -> tuple[int, ...]:
    """The token buckets a decode worker's fused steps replay graphs of (its capture: runner/prefill_graphs.py, every
    bucket of `prefill_graph_tokens` a step's budget can use), or () where it captures none (graphs off, a CPU)."""
    rc = cfg.runner
    if not rc.use_cuda_graphs or rc.device == "cpu":
        return ()
    return usable_buckets(rc.prefill_graph_tokens, cfg.scheduler.max_num_batched_tokens)


# The rapid policy's inputs, read from the decode scheduler as before the one engine (`DecodePartition.advance`):
# running requests, their mean context (tokens in the cache, the token in flight not counted), whether prompt
# work is pending, and the pending work counted up to the policy's cap (None: not asked).
RapidInputs = Callable[[], tuple[int, int, bool, PendingWork | None]]


class AlwaysFused:
    """Every step fused: decodes first, prompt chunks in what is left of the step's token budget (`max_chunk_tokens`,
    i.e. --max-num-batched-tokens, so a step never exceeds the largest forward the KV pool was sized after)."""

    name = "fused"
    workers: tuple[str, ...] = ("decode",)
    reads_waiting = False  # the worker may leave `ShapeState.waiting` empty (decode_views.shape_state)

    def decide(self, state: ShapeState) -> StepShape:
        return Fused(max(0, state.max_chunk_tokens - len(state.decode_contexts)))

    def observe(self, timing: StepTiming) -> None:
        """Nothing to learn: the shape never changes."""


class AlwaysSplit:
    """Every step split: the partition manager's configuration (`--policy rapid|duet|drift`), prompts to the
    prefill worker in batches of `prefill_batch_tokens` (the prefill worker's own --prefill-batch-tokens: it is
    not sent per step). `lookahead` stays 1: one decode step per launch."""

    workers: tuple[str, ...] = ("decode", "prefill")

    def __init__(self, partition: DecodePartition, prefill_batch_tokens: int, rapid: RapidInputs) -> None:
        self.partition, self.prefill_batch_tokens, self.rapid = partition, prefill_batch_tokens, rapid
        self.name = f"split ({partition.pcfg.policy})"
        self.reads_waiting = partition.pcfg.policy in ("duet", "drift")  # rapid reads the scheduler's `rapid`

    def decide(self, state: ShapeState) -> StepShape:
        p = self.partition
        if p.pcfg.policy == "duet":
            p.advance_duet(state.decode_contexts, state.waiting)
        elif p.pcfg.policy == "drift":  # prefill sizes its layer blocks to decode's step (`hint_ms`)
            p.advance_drift(state.decode_contexts, state.waiting)
        else:
            p.advance(*self.rapid())
        return Split(p.current, self.prefill_batch_tokens)

    def observe(self, timing: StepTiming) -> None:
        """The manager decides from its profile, not from measured steps."""


class ScriptedPolicy:
    """For tests: the shape of each call from `script` (a list, its last shape repeated; or a function of the
    call count and the state). It records the states it was given and the timings it was fed."""

    def __init__(self, script: Sequence[StepShape] | Callable[[int, ShapeState], StepShape],
                 workers: tuple[str, ...] = ("decode", "prefill"), name: str = "scripted") -> None:
        if not callable(script) and not script:
            raise ValueError("a scripted policy needs at least one shape")
        self.script, self.workers, self.name = script, workers, name
        self.calls = 0
        self.states: list[ShapeState] = []
        self.timings: list[StepTiming] = []

    def decide(self, state: ShapeState) -> StepShape:
        k, self.calls = self.calls, self.calls + 1
        self.states.append(state)
        if callable(self.script):
            return self.script(k, state)
        return self.script[min(k, len(self.script) - 1)]

    def observe(self, timing: StepTiming) -> None:
        self.timings.append(timing)
