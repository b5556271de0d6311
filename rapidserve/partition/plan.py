"""The partition plan of a run: the configurations its streams split the GPU into and the profile an adaptive policy
reads, fixed at start-up.

`resolve_plan` (decode worker, at start-up) fixes the configurations and, for `adaptive`, the
profile the manager reads: the one given (`--profile`, or the profile `rapidserve serve` measured or
found in the user's cache at start, partition/autoprofile.py; a `--profile` given arrives parsed already, read once
by the CLI's flag check, and is only checked against this GPU and model here), else the measured
`profiles/<gpu>__<model>.json` when it exists (validated, refused when it is for another GPU or model,
or asks for splits this device cannot make), otherwise a roofline estimate from peaks measured now, and
says so. The prefill worker receives the same
configurations through the start-up hand-off, so both processes create identical splits.
The decode worker's side of the adaptive manager, carrying the plan out step by step, is partition/runtime.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from rapidserve.config import EngineConfig
from rapidserve.partition.backend import (
    PartitionBackend,
    PartitionError,
    Role,
    check_configurations,
    detect_kind,
    device_granularity,
    open_backend,
    plan_configurations,
    static_configuration,
)
from rapidserve.partition.drift import LinearModel
from rapidserve.partition.drift_plan import prefill_models
from rapidserve.partition.manager import full_decode_config
from rapidserve.partition.peaks import Peaks, describe_peaks, measure_peaks
from rapidserve.partition.profile import (
    OVERALLOCATED,
    Configuration,
    Profile,
    ProfileVariant,
    check_profile,
    default_profiles_dir,
    model_label,
    model_shape,
    profile_filename,
    read_profile,
    variant_of,
)
from rapidserve.partition.roofline import collective_ops, kv_element_bytes
from rapidserve.partition.roofline_profile import roofline_profile, with_collectives
from rapidserve.partition_config import PartitionConfig
from rapidserve.policy_spec import check_without_partition

ROOFLINE_BATCHES = [1, 8, 16, 32, 64, 128, 256, 512]  # up to the largest decode graph (the most seats)
ROOFLINE_CONTEXTS = [512, 1024, 2048, 4096, 8192, 16384, 32768]


class PlanWire(msgspec.Struct, frozen=True):
    """What the prefill worker and the decode followers need of the plan (sent through the start-up hand-off and
    the followers' Setup). `prefill_models`: drift only, per configuration the prefill time model (a_ms,
    b_ms_per_token) both workers decide with. `fused_graphs`: the configuration whose stream the decode worker's
    fused steps run on, when its policy runs any (duet: engine/decode_worker.py `fused_graph_key`), so every
    decode rank captures the piecewise prefill graphs for them there; "" for none."""

    backend: str
    configurations: list[Configuration]
    initial: str
    prefill_models: dict[str, tuple[float, float]] = {}
    fused_graphs: str = ""


@dataclass
class PartitionPlan:
    backend: str  # resolved kind: cuda-green | hip-cumask | none
    configurations: list[Configuration]
    profile: Profile | None  # adaptive only
    source: str  # one line for logs and Ready: where the configurations and profile came from
    peaks: Peaks | None = None  # measured at start-up: the duet policy's roofline (and the roofline profile's)
    prefill_models: dict[str, LinearModel] = field(default_factory=dict)  # drift: prefill ms = a + b * tokens

    @property
    def initial(self) -> str:
        if self.profile is not None:
            return full_decode_config(self.profile)
        return self.configurations[0].name

    @property
    def adaptive(self) -> bool:
        """Whether the plan can switch configurations: a profile (measured or the roofline's) of several."""
        return self.profile is not None and len(self.configurations) > 1

    def wire(self) -> PlanWire:
        return PlanWire(self.backend, list(self.configurations), self.initial,
                        {k: (v.a_ms, v.b_ms_per_token) for k, v in self.prefill_models.items()})


def gpu_name(device: Any) -> str:
    if getattr(device, "type", "cpu") != "cuda":
        return "cpu"
    import torch

    return str(torch.cuda.get_device_name(device))


def resolve_plan(cfg: EngineConfig, device: Any, dtype: Any = None, given: Profile | None = None) -> PartitionPlan:
    """The run's plan; `source`, logged once at start (the decode worker's Ready), says where each cost model
    came from and, under tensor parallelism, which of them hold the collectives (`tp_cost_models`). `given`: the
    file `cfg.partition.profile` names, parsed already (the CLI read it at start-up: profile.read_profile), checked
    here against this GPU and model instead of parsing the file again; None: the file is read here."""
    if given is not None and not cfg.partition.profile:
        raise ValueError("resolve_plan(given=...) is the parsed cfg.partition.profile, but the config names no "
                         "profile file: pass given=None or set partition.profile")
    plan = _resolve_plan(cfg, device, dtype, given)
    slo = slo_note(cfg.partition, plan)
    if slo:
        plan.source += f"; {slo}"
    if cfg.partition.policy == "drift":
        with_prefill_models(plan, cfg, device, dtype)
    note = tp_cost_models(cfg, plan)
    if note:
        plan.source += f"; {note}"
    return plan


def slo_note(pcfg: PartitionConfig, plan: PartitionPlan) -> str:
    """The ITL SLO the policy decides with, for the plan's line in the start-up log (`decode partition: ...`): "ITL
    SLO 50 ms" where an adaptive plan has configurations to choose among, "no ITL SLO ..." (--slo-itl-ms none: duet,
    the one adaptive policy that runs without one, policy_spec) on every plan; "" where no SLO is read."""
    if pcfg.mode != "adaptive":
        return ""
    if pcfg.slo_itl_ms is None:
        return "no ITL SLO (--slo-itl-ms none): every step fused with the whole token budget, never split"
    return f"ITL SLO {pcfg.slo_itl_ms:g} ms" if plan.profile is not None and len(plan.configurations) > 1 else ""


def tp_cost_models(cfg: EngineConfig, plan: PartitionPlan) -> str:
    """One line for the start-up log of a `-tp N` engine (N > 1) with an adaptive plan: which of the policy's
    cost models are one rank's shard plus its collectives (`roofline.collectives_ms`) and which are used as
    given; "" at tp 1 or without a cost model (partition off, static)."""
    tp, pcfg, prof = cfg.parallel.tensor_parallel_size, cfg.partition, plan.profile
    if tp == 1 or prof is None:
        return ""
    with_links, as_given = [], []
    # duet reads a measured profile's figures as rapid does (partition/step_policies.step_costs), else the roofline
    duet_roofline = pcfg.policy == "duet" and prof.source != "measured"
    if not duet_roofline:
        what = "decode step beside prefill" if pcfg.policy == "drift" else "figures"
        if prof.tensor_parallel_size == tp:
            kind = "measured shard profile" if prof.source == "measured" else "roofline estimate of the shard"
            with_links.append(f"the profile's {what} ({kind})")
        else:
            as_given.append(f"the profile's {what} (a WHOLE-MODEL profile, no collectives added: `rapidserve "
                            f"profile --shard-of-tp {tp}` measures one rank's)")
    if duet_roofline:
        with_links.append("duet's roofline decisions")
    if pcfg.policy == "drift":
        (as_given if pcfg.drift_prefill_model is not None else with_links).append("drift's prefill models")
    out = f"tensor parallel {tp}"
    if with_links:
        assert plan.peaks is not None, "a cost model with collectives comes with the peaks measured at start"
        per_step = sum(o.count for o in collective_ops(cfg.model_config, 1, 1, tp=tp))
        out += (f": {', '.join(with_links)} = one rank's shard + its collectives ({per_step} a step: all-reduces "
                f"and the logits all-gather; link model {plan.peaks.link_bw / 1e9:g} GB/s, "
                f"{plan.peaks.link_latency_s * 1e6:g} us each, not measured)")
    if as_given:
        out += f"; used as given: {', '.join(as_given)}"
    return out


def with_prefill_models(plan: PartitionPlan, cfg: EngineConfig, device: Any, dtype: Any) -> None:
    """Drift: each configuration's prefill time model, `--drift-prefill-model` or fitted from the roofline
    with the plan's peaks (measured now where the plan has none, e.g. on a CPU), said in `plan.source`."""
    given = cfg.partition.drift_prefill_model
    if given is not None:
        plan.prefill_models = {c.name: LinearModel(*given) for c in plan.configurations}
        plan.source += f"; drift prefill model given: {given[0]:g} + {given[1]:g} ms/token"
        return
    if plan.peaks is None:
        plan.peaks = run_peaks(cfg, device, dtype)
    size = getattr(dtype, "itemsize", 2)
    plan.prefill_models = prefill_models(cfg.model_config, plan.peaks, plan.configurations,
                                         cfg.scheduler.max_num_batched_tokens, dtype_bytes=size,
                                         tp=cfg.parallel.tensor_parallel_size,
                                         kv_bytes=kv_element_bytes(cfg.cache, size), quant=cfg.quantization)
    fits = ", ".join(f"{k} {v.a_ms:.3g} + {v.b_ms_per_token:.3g} ms/token" for k, v in plan.prefill_models.items())
    plan.source += f"; drift prefill model (roofline, contention-free): {fits}"


def _resolve_plan(cfg: EngineConfig, device: Any, dtype: Any = None, given: Profile | None = None) -> PartitionPlan:
    p = cfg.partition
    kind = detect_kind(device) if p.backend == "auto" else p.backend
    if p.mode == "off" or kind == "none":
        why = "partition off" if p.mode == "off" else f"no partition backend on {device}"
        check_without_partition(p, why)  # a static share, or what only an adaptive partition reads: refused
        return PartitionPlan("none", [Configuration(OVERALLOCATED, 0, 0)], None, why)
    if getattr(device, "type", "cpu") != "cuda":  # an explicit GPU backend: say so before probing the driver
        raise PartitionError(f"partition backend {kind!r} needs a GPU; this run is on {device}: use --partition off")
    g = device_granularity(kind, device)
    if p.mode == "static":
        assert p.static_decode_share is not None
        c = static_configuration(g, p.static_decode_share)
        return PartitionPlan(kind, [c], None, f"static {c.name}: decode {c.decode_units} of {g.total} units ({kind})")
    gpu = gpu_name(device)
    tp = cfg.parallel.tensor_parallel_size
    variant = variant_of(cfg)
    path, why_not = profile_path(p.profile, default_profiles_dir(), gpu, cfg.model, tp, variant)
    if path is not None:
        prof = check_profile(given if given is not None and p.profile else read_profile(path), path,
                             expect_gpu=gpu, expect_model=model_label(cfg.model), expect_tp=None if p.profile else tp,
                             expect_variant=variant, expect_shape=model_shape(cfg.model_config))
        if prof.tensor_parallel_size not in (1, tp):
            fix = (f"run `rapidserve profile --shard-of-tp {tp}`" if tp > 1 else
                   f"give a whole-model profile (`rapidserve profile` without --shard-of-tp), or serve with "
                   f"-tp {prof.tensor_parallel_size}")
            raise PartitionError(f"profile {path} measures a shard of tensor parallel {prof.tensor_parallel_size}; "
                                 f"this run uses -tp {tp}: {fix}")
        check_configurations(prof.configurations, g, f"profile {path}")
        shard = prof.tensor_parallel_size > 1
        peaks = run_peaks(cfg, device, dtype) if p.policy in ("duet", "drift") or shard else None
        if shard:
            assert peaks is not None
            prof = with_collectives(prof, cfg.model_config, peaks)
        said = f"; {describe_peaks(peaks, fp8=cfg.quantization.enabled)}" if peaks is not None else ""
        return PartitionPlan(kind, list(prof.configurations), prof,
                             f"adaptive, policy {p.policy}, measured profile {path} "
                             f"({len(prof.configurations)} configurations, {kind}"
                             + (f"; {prof.note}" if prof.note else "")
                             + (f"; a shard of tensor parallel {tp}" if shard else "")
                             + (f"; a WHOLE-MODEL profile at tensor parallel {tp}: its figures are not this rank's "
                                f"(`rapidserve profile --shard-of-tp {tp}` measures them)" if tp > 1 and not shard
                                else "") + ")"
                             + said, peaks)
    configs = plan_configurations(g, p.decode_shares)
    peaks = run_peaks(cfg, device, dtype)
    prof = roofline_fallback(cfg, gpu, configs, peaks)
    return PartitionPlan(kind, configs, prof, f"adaptive, policy {p.policy}, ROOFLINE ESTIMATE: {why_not}; "
                         f"{kind}; {describe_peaks(peaks, fp8=cfg.quantization.enabled)}", peaks)


def profile_path(explicit: str | None, profiles_dir: Path, gpu: str, model: str, tp: int,
                 variant: ProfileVariant | None = None) -> tuple[Path | None, str]:
    """Which profile the engine uses: the one given (`--profile`, at any tensor-parallel size), else the
    committed one for this GPU, model and variant (fp8 weights / KV cache), `profile_filename(gpu, model, tp,
    variant)` (a rank's shard under tensor parallel tp > 1: `rapidserve profile --shard-of-tp tp` writes it). None
    and why when there is none, so the roofline stands in."""
    if explicit:
        return Path(explicit), ""
    path = profiles_dir / profile_filename(gpu, model, tp, variant)
    if path.exists():
        return path, ""
    flags = "".join(f" {f}" for f, on in (("--quantization fp8", variant and variant.quantization == "fp8"),
                                          ("--kv-cache-dtype fp8", variant and variant.kv_cache_dtype == "fp8")) if on)
    if tp > 1:
        return None, (f"tensor parallelism: no profile of one rank's shard at {path} (run `rapidserve profile "
                      f"--model {model}{flags} --shard-of-tp {tp}` to measure one)")
    return None, f"no profile at {path} (run `rapidserve profile --model {model}{flags}` to measure one)"


def run_peaks(cfg: EngineConfig, device: Any, dtype: Any) -> Peaks:
    """The peaks the run's roofline times its operators with, measured now (partition/peaks.py): with fp8 weights
    (`cfg.quantization`) the fp8 GEMM's too."""
    return measure_peaks(device, dtype, fp8=cfg.quantization.enabled)


def roofline_fallback(cfg: EngineConfig, gpu: str, configs: list[Configuration], peaks: Peaks) -> Profile:
    """The roofline's estimate of what one GPU runs: under tensor parallelism, the roofline's profile of one
    rank's shard put through `with_collectives`, as a measured shard profile is."""
    return roofline_profile(cfg.model_config, gpu, model_label(cfg.model), peaks, configs, ROOFLINE_BATCHES,
                            ROOFLINE_CONTEXTS, cfg.scheduler.max_num_batched_tokens,
                            tp=cfg.parallel.tensor_parallel_size, kv_bytes=kv_element_bytes(cfg.cache),
                            variant=variant_of(cfg), quant=cfg.quantization)


def open_streams(wire: PlanWire, device: Any, roles: tuple[Role, ...]) -> PartitionBackend:
    return open_backend(wire.backend, device, wire.configurations, roles)
