"""The `PartitionConfig` section of the config tree (`EngineConfig.partition`): how decode and prefill split the GPU.

Plain data: the partition mode (`--partition`), the policy (POLICIES; rapidserve/policy_spec.py declares what each
uses and reads), the ITL SLO (or none) and the TTFT SLO, the profile and how it is read; each field checked alone
when built (config_base.ConfigError).
"""

from __future__ import annotations

from dataclasses import dataclass

from rapidserve.config_base import ConfigError, check

# The policies (rapidserve/policy_spec.py declares what each uses and reads; partition/ holds their decisions):
# rapid (always split, the profile's choice), duet (fused when a step fits the ITL SLO, else split), drift (split,
# prefill block-wise), fused (always one mixed step: --mode hybrid's).
POLICIES = ("rapid", "duet", "drift", "fused")
# What `--mode rapid --partition adaptive` runs when --policy is left out: `duet` (DuetServe's design: the decode worker
# runs fused mixed steps itself and splits only when a fused step would break the ITL SLO). Measured on 2 x H200
# (2026-11-29, bench/results/h200x2_1129b/): with --slo-itl-ms B it held goodput at or above always-fused and
# always-split at every bound B of 25-200 ms, and within 1% of always-fused unbounded (4096:64, bf16). A fixed or no
# partition runs `rapid` (policy_spec.resolve_policy): duet needs the adaptive one.
DEFAULT_POLICY = "duet"
PROFILE_LOOKUPS = ("auto", "interpolate", "round-up")  # how a profile is read between buckets: profile_lookup.estimate
STEP_CORRECTIONS = ("by-shape", "per-kind")  # duet's online correction: partition/correction.py


def lookup_interpolates(profile_lookup: str, *, fused: bool) -> bool:
    """Whether `--profile-lookup profile_lookup` reads the profile between its buckets (linearly) rather than rounding
    up to them, for duet's fused-step composition (`fused`) or for a decode step on a configuration (decode alone,
    decode beside the prefill worker: the rapid manager's and duet's splits). `auto` (the default) interpolates the
    fused composition only (PartitionConfig's docstring says why)."""
    if profile_lookup not in PROFILE_LOOKUPS:
        raise ValueError(f"profile_lookup={profile_lookup!r}; use one of {', '.join(PROFILE_LOOKUPS)}")
    return profile_lookup == "interpolate" or (profile_lookup == "auto" and fused)


@dataclass(frozen=True)
class PartitionConfig:
    """How decode and prefill split the GPU's compute (rapidserve.partition).

    mode: adaptive (the manager picks a configuration each decode step from the profile), off (both
    use the whole GPU), static (a fixed split giving decode `static_decode_share` of the units).
    policy (POLICIES; rapidserve/policy_spec.py declares the workers, partition modes and settings of each):
    rapid (RAPID-Serve: the profile's configuration with the most prefill throughput within the ITL SLO;
    any mode), duet (DuetServe: fused steps while the predicted step meets the SLO, else the split that
    maximises prefill throughput; adaptive), drift (DRIFT: prefill launched a layer block at a time on the
    configuration with the most prefill units within the ITL SLO; a short request may preempt a long prefill
    batch at a block boundary; adaptive) or fused (always one mixed step: --mode hybrid's worker).
    profile_lookup (rapid policy, duet's cost model): how a decode batch and context between the profile's
    buckets are read: round-up (to the bucket at or above each), interpolate (linearly between the buckets around
    them; partition/profile_lookup.py `estimate`), or auto (the default): round-up for a decode step on a configuration
    (the rapid manager's choice, duet's split and decode alone), interpolate for duet's fused-step composition
    (`lookup_interpolates`). Round-up for splits: on the H100, 4096:64 all at once, interpolate ran 6% more
    requests/s but p99 ITL 63 ms against the 50 ms SLO (bench/results/issue16.md, 2026-11-27): the profile's steps
    beside prefill were measured beside smaller forwards than the run's. Interpolate for the fused composition
    (alone(B, c) + the chunk at the prefill rate, partition/step_costs.py), because its online correction is one
    ratio for the whole step: rounding up overstated the decode part by up to a bucket (the H200 Qwen3-8B profile's
    buckets are batch 256 / 512 and context 2048 / 8192: 300 rows at context 1150 with 1140 prompt tokens read as
    64.5 ms rounded up, 45.8 ms interpolated, 42.3 ms measured), the ratio learnt that bias and shrank the chunk
    part with it, and steps whose share of decode differed from the average ran over the limit (multi-turn chat on 2
    x H200, 2026-11-30: measured / predicted 0.58-0.68 and 2.3% of fused steps over 50 ms at a margin of 0.8,
    bench/results/h200x2_1130e/).
    slo_itl_ms: the inter-token latency SLO in ms the adaptive policies decide with (rapid, duet, drift under
    --partition adaptive), or None (`--slo-itl-ms none`): no ITL SLO, maximise throughput. Only duet honours None
    (every step fused with the whole token budget, partition/policies.py); a fixed or no partition, --policy fused
    and `LLM` read no SLO, so None is what they run anyway; rapid, drift and `rapidserve profile` choose or mark
    configurations by the SLO and refuse None (policy_spec: their `needs`).
    slo_margin (duet): the share of the ITL SLO each step is planned within; None (`--slo-margin auto`, the default)
    adapts it between 0.8 and 0.97 to how often the steps it sized made a token gap over the SLO
    (partition/margin.py); a number fixes it (0.9 was duet's before 2026-11-30).
    step_correction (duet): how its online correction of measured / predicted step times is kept: by-shape (the
    default since 2026-11-30: a fused step's by its size class, decode on a split's by configuration, the split's down
    to 0.25) or per-kind (one ratio per kind, each clamped to [0.5, 4], as before): partition/correction.py.
    drift only: slo_ttft_ms (+ slo_ttft_ms_per_1k_tokens x prompt tokens / 1000) is a request's TTFT SLO,
    without which nothing is preempted; drift_prefill_model (a_ms, b_ms_per_token) replaces the prefill
    time model fitted at start-up (one for every configuration).
    Here each field is checked alone; which fields a policy, a partition mode and a run read together is
    `policy_spec.conflicts`, run on the tree `config_builder.build_engine_config` builds.
    """

    mode: str = "adaptive"  # adaptive | off | static
    static_decode_share: float | None = None
    backend: str = "auto"  # auto | cuda-green | hip-cumask | none
    profile: str | None = None  # a profile file; None: profiles/<gpu>__<model>.json if present, else roofline
    slo_itl_ms: float | None = 50.0  # None: no ITL SLO (class docstring)
    hysteresis_steps: int = 8
    decode_shares: tuple[float, ...] = (0.125, 0.25, 0.375, 0.5)
    policy: str = "rapid"
    slo_ttft_ms: float | None = None
    slo_ttft_ms_per_1k_tokens: float = 0.0
    drift_prefill_model: tuple[float, float] | None = None
    profile_lookup: str = "auto"
    slo_margin: float | None = None  # duet: the share of the SLO its steps are planned within; None: adapted (auto)
    step_correction: str = "by-shape"  # duet: by-shape (fused by size, split by configuration) | per-kind

    def __post_init__(self) -> None:
        check(self.mode in ("adaptive", "off", "static"),
               f"partition mode={self.mode!r}; use adaptive, off or static:<decode share>")
        check((self.mode == "static") == (self.static_decode_share is not None),
               "a static partition needs its decode share (static:0.25), and only a static one has it")
        check(self.static_decode_share is None or 0.0 < self.static_decode_share < 1.0,
               f"static decode share {self.static_decode_share} must be in (0, 1), e.g. static:0.25")
        check(self.backend in ("auto", "cuda-green", "hip-cumask", "none"),
               f"partition backend={self.backend!r}; use auto, cuda-green, hip-cumask or none")
        slo = self.slo_itl_ms
        check(slo is None or (isinstance(slo, (int, float)) and not isinstance(slo, bool) and 0 < slo < float("inf")),
              f"slo_itl_ms={slo!r} must be > 0 and finite (ms), or None: no ITL SLO (--slo-itl-ms none)")
        check(self.policy in POLICIES, f"policy={self.policy!r}; use one of {', '.join(POLICIES)}")
        check(self.hysteresis_steps >= 0, f"hysteresis_steps={self.hysteresis_steps} must be >= 0")
        check(self.slo_ttft_ms is None or 0 < self.slo_ttft_ms < float("inf"),
               f"slo_ttft_ms={self.slo_ttft_ms} must be a positive number")
        check(0 <= self.slo_ttft_ms_per_1k_tokens < float("inf"),
               f"slo_ttft_ms_per_1k_tokens={self.slo_ttft_ms_per_1k_tokens} must be >= 0")
        check(self.slo_ttft_ms_per_1k_tokens == 0 or self.slo_ttft_ms is not None,
               "--slo-ttft-ms-per-1k-tokens adds to --slo-ttft-ms: give --slo-ttft-ms too")
        m = self.drift_prefill_model
        check(m is None or (len(m) == 2 and 0 <= m[0] < float("inf") and 0 < m[1] < float("inf")),
               f"drift_prefill_model={m} must be (a_ms >= 0, b_ms_per_token > 0)")
        check(self.profile_lookup in PROFILE_LOOKUPS,
               f"profile_lookup={self.profile_lookup!r}; use one of {', '.join(PROFILE_LOOKUPS)}")
        mg = self.slo_margin
        check(mg is None or (isinstance(mg, (int, float)) and not isinstance(mg, bool) and 0 < mg <= 1),
              f"slo_margin={mg!r} must be in (0, 1] (a share of the ITL SLO), or None: adapted (--slo-margin auto)")
        check(mg is None or slo is not None, f"--slo-margin {mg} is a share of the ITL SLO, and --slo-itl-ms none "
              "gives none (every step fused with the whole budget): drop --slo-margin, or give --slo-itl-ms MS")
        check(self.step_correction in STEP_CORRECTIONS,
              f"step_correction={self.step_correction!r}; use one of {', '.join(STEP_CORRECTIONS)}")
        check(self.step_correction == "by-shape" or slo is not None,
              f"--step-correction {self.step_correction} chooses how duet's predictions are corrected before they "
              "meet the ITL SLO, and --slo-itl-ms none gives none (every step fused with the whole budget, nothing "
              "compared): drop --step-correction, or give --slo-itl-ms MS")
        check(len(self.decode_shares) > 0 and all(0.0 < s < 1.0 for s in self.decode_shares),
               f"decode_shares={self.decode_shares} must be a non-empty tuple of shares in (0, 1)")

    @classmethod
    def parse(cls, text: str, **kw: object) -> PartitionConfig:
        """`adaptive`, `off` or `static:<decode share>` (e.g. static:0.25), as given to --partition."""
        if text in ("adaptive", "off"):
            return cls(mode=text, **kw)  # type: ignore[arg-type]
        if text.startswith("static:"):
            try:
                share = float(text.split(":", 1)[1])
            except ValueError:
                raise ConfigError(f"--partition {text!r}: the share after static: must be a number in (0, 1), "
                                  "e.g. static:0.25") from None
            return cls(mode="static", static_decode_share=share, **kw)  # type: ignore[arg-type]
        raise ConfigError(f"--partition {text!r}; use adaptive, off or static:<decode share in (0, 1)>")
