"""The decode worker's side of the adaptive manager: the partition plan (partition/plan.py) carried out at step
boundaries.

`DecodePartition` is applied at decode step boundaries: `advance()` calls the pure `decide()` and
returns the configuration to use for the next step; the decode worker then switches its stream and
graphs and tells prefill (SetPartition), which switches at its next forward. Under `--policy drift`
(`advance_drift`) decode also tells prefill its predicted step beside prefill (`sent_hint`), to which
prefill sizes its layer blocks (partition/drift_plan.py says who decides what).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from rapidserve.config import ModelConfig
from rapidserve.partition.drift import decide_drift
from rapidserve.partition.drift_plan import decode_ms_beside, drift_configuration, effective_prefill_units
from rapidserve.partition.duet import DuetDecision, decide_duet, duet_configuration
from rapidserve.partition.manager import Decision, ManagerState, decide, make_state, pending_tokens_cap
from rapidserve.partition.plan import PartitionPlan
from rapidserve.partition.policy import PendingWork, PolicyState, WaitingPrefill
from rapidserve.partition_config import PartitionConfig, lookup_interpolates
from rapidserve.quant_config import QuantizationConfig


@dataclass(frozen=True)
class Switch:
    t: float  # time.monotonic()
    old: str
    new: str
    batch: int
    context: int
    prefill_pending: bool
    reason: str


@dataclass
class DecodePartition:
    """The decode worker's manager: current configuration, decisions, a short history of switches."""

    pcfg: PartitionConfig
    plan: PartitionPlan
    state: ManagerState = field(init=False)
    model_cfg: ModelConfig | None = None  # the duet policy's roofline model: the whole model (tp: one rank's share)
    prefill_budget: int = 8192  # tokens of one prefill batch (the prefill worker's budget)
    switches: deque[Switch] = field(default_factory=lambda: deque(maxlen=256))
    last_duet: DuetDecision | None = None
    hint_ms: float | None = None  # drift: decode's predicted step beside prefill on the current configuration
    _hint_sent: float | None = None
    num_switches: int = 0
    steps: dict[str, int] = field(default_factory=dict)  # decode steps launched per configuration
    _cap: int | None = None
    tensor_parallel_size: int = 1  # duet's roofline predicts one rank's step, collectives included
    kv_bytes: float | None = None  # duet's roofline: the KV pool's element size (1: an fp8 cache; None: model dtype)
    quant: QuantizationConfig | None = None  # duet's roofline: the weights' quantization (None: float)

    def note_step(self) -> None:
        """One decode step was launched in the current configuration."""
        self.steps[self.current] = self.steps.get(self.current, 0) + 1

    def __post_init__(self) -> None:
        self.state = make_state(self.plan.initial)

    @property
    def current(self) -> str:
        return self.state.config

    @property
    def adaptive(self) -> bool:
        return self.plan.adaptive

    def advance_duet(self, contexts: tuple[int, ...], waiting: tuple[WaitingPrefill, ...]) -> Switch | None:
        """One step boundary under `--policy duet`: DuetServe's roofline decision (partition/duet.py) from
        the running decodes' contexts and the prefill work not yet done, carried out as a configuration;
        the switch to make now, or None to keep the configuration."""
        if not self.adaptive:
            return None
        assert self.plan.peaks is not None and self.model_cfg is not None, "duet needs the plan's peaks and model"
        old = self.state.config
        st = PolicyState(time.monotonic(), contexts, waiting, self.pcfg.slo_itl_ms,
                         prefill_budget=self.prefill_budget)
        d = decide_duet(st, self.model_cfg, self.plan.peaks, self.plan.configurations, shared=True,
                        tp=self.tensor_parallel_size, kv_bytes=self.kv_bytes, quant=self.quant)
        self.last_duet = d
        name, reason, self.state = duet_configuration(self.state, d, self.plan.configurations,
                                                      hysteresis_steps=self.pcfg.hysteresis_steps,
                                                      decode_running=bool(contexts))
        if name == old:
            return None
        mean = sum(contexts) // len(contexts) if contexts else 0
        return self._switched(Switch(time.monotonic(), old, name, len(contexts), mean, bool(waiting), reason))

    def advance_drift(self, contexts: tuple[int, ...], waiting: tuple[WaitingPrefill, ...]) -> Switch | None:
        """One step boundary under `--policy drift`: DRIFT's partition for prefill beside this decode batch
        (`decide_drift` over every configuration, decode's step beside prefill from the profile), carried
        out with hysteresis (`drift_configuration`); also updates `hint_ms`, decode's predicted step beside
        prefill on the configuration now in use (None while no decode runs)."""
        if not self.adaptive:
            return None
        prof = self.plan.profile
        assert prof is not None and self.model_cfg is not None and self.plan.prefill_models, \
            "drift needs the plan's profile, prefill models and the model"
        p, old = self.pcfg, self.state.config
        mean = sum(contexts) // len(contexts) if contexts else 0
        beside = decode_ms_beside(prof, len(contexts), mean)
        st = PolicyState(time.monotonic(), contexts, waiting, p.slo_itl_ms, p.slo_ttft_ms,
                         prefill_budget=self.prefill_budget, slo_ttft_ms_per_1k_tokens=p.slo_ttft_ms_per_1k_tokens)
        d = decide_drift(st, models=self.plan.prefill_models, decode_ms_beside=beside,
                         prefill_units=effective_prefill_units(prof), num_layers=self.model_cfg.num_layers)
        name, reason, self.state = drift_configuration(self.state, d, prof, beside, 0.9 * p.slo_itl_ms,
                                                       decode_running=bool(contexts),
                                                       hysteresis_steps=p.hysteresis_steps)
        self.hint_ms = beside[name] if contexts else None
        if name == old:
            return None
        return self._switched(Switch(time.monotonic(), old, name, len(contexts), mean, bool(waiting), reason))

    def hint_due(self) -> bool:
        """Drift: decode's step estimate changed since prefill was last told (a new profile bucket)."""
        return self.hint_ms != self._hint_sent

    def sent_hint(self) -> float | None:
        """The step estimate to send prefill now (with a SetPartition), noted as sent."""
        self._hint_sent = self.hint_ms
        return self.hint_ms

    @property
    def prefill_tokens_cap(self) -> int:
        """Rapid policy: how far the engine need count pending prefill tokens (`advance`'s `pending`);
        past this more pending work changes no decision (manager.pending_tokens_cap)."""
        if self.plan.profile is None:
            return 0
        if self._cap is None:
            self._cap = pending_tokens_cap(self.plan.profile, self.pcfg.slo_itl_ms)
        return self._cap

    def advance(self, batch: int, context: int, prefill_pending: bool,
                pending: PendingWork | None = None) -> Switch | None:
        """One step boundary (rapid policy): the switch to make now, or None to keep the configuration.
        pending: the prompt tokens prefill still has to compute, counted up to `prefill_tokens_cap`, and its
        longest prompt (None: unknown; the profile's beside-prefill figures alone)."""
        if not self.adaptive:
            return None
        old = self.state.config
        d, self.state = self._decide(batch, context, prefill_pending, pending)
        if d.config == old:
            return None
        return self._switched(Switch(time.monotonic(), old, d.config, batch, context, prefill_pending, d.reason))

    def keeps_with_prefill(self, batch: int, context: int, pending: PendingWork | None = None) -> bool:
        """Whether the next step boundary would keep the current configuration with prefill pending, so
        that a request may be handed to prefill before it (a look at `decide`, changing nothing). Only
        the rapid policy is looked at this way; duet and drift plan their step from the whole queue,
        so they answer False (no early hand-off). A plan with one configuration always keeps it."""
        if not self.adaptive:
            return True
        if self.pcfg.policy != "rapid":
            return False
        d, _ = self._decide(batch, context, True, pending)
        return d.config == self.current

    def _decide(self, batch: int, context: int, prefill_pending: bool,
                pending: PendingWork | None = None) -> tuple[Decision, ManagerState]:
        """The rapid policy's `decide` at this state. With no decode running a switch disturbs nobody:
        no hysteresis, and prefill pending gets the configuration with the most prefill throughput (the
        whole GPU); see partition/manager.py."""
        assert self.plan.profile is not None
        idle = batch == 0
        return decide(self.state, decode_batch=max(batch, 1), decode_context=max(context, 1),
                      prefill_pending=prefill_pending, slo_itl_ms=self.pcfg.slo_itl_ms, profile=self.plan.profile,
                      hysteresis_steps=0 if idle else self.pcfg.hysteresis_steps, decode_running=not idle,
                      prefill_tokens=pending.tokens if prefill_pending and pending else None,
                      prefill_longest=pending.longest if prefill_pending and pending else None,
                      prefill_budget=self.prefill_budget,
                      interpolate=lookup_interpolates(self.pcfg.profile_lookup, fused=False))

    def use(self, name: str, reason: str) -> Switch | None:
        """Hold configuration `name` from the next step on, as a step shape chose it (partition/shape.py;
        the decode worker switches its stream); the Switch when it is a change, None when it is current."""
        if name == self.state.config:
            return None
        old, self.state = self.state.config, make_state(name)
        return self._switched(Switch(time.monotonic(), old, name, 0, 0, False, reason))

    def _switched(self, s: Switch) -> Switch:
        self.switches.append(s)
        self.num_switches += 1
        return s
