"""The partition plan of a run and the decode worker's manager: PartitionConfig and --partition parsing, the CLI's
partition flags, resolve_plan on CPU, DecodePartition over a synthetic H100 profile, and the profile path helpers."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

import rapidserve
from rapidserve.cli import build_parser, main
from rapidserve.cli_args import partition_config
from rapidserve.config import EngineConfig
from rapidserve.config_base import ConfigError
from rapidserve.loader.presets import preset_config
from rapidserve.partition.backend import NoPartition, PartitionError
from rapidserve.partition.plan import PartitionPlan, PlanWire, open_streams, resolve_plan, slo_note
from rapidserve.partition.policy import PendingWork
from rapidserve.partition.profile import (
    OVERALLOCATED,
    Configuration,
    Profile,
    default_profiles_dir,
    model_label,
    profile_filename,
    slug,
)
from rapidserve.partition.profile_cmd import cmd_profile
from rapidserve.partition.runtime import DecodePartition, Switch
from rapidserve.partition_config import PartitionConfig
from rapidserve.policy_spec import check_settings
from tests.test_partition_manager import h100_profile

H100_LLAMA = str(Path(rapidserve.__file__).resolve().parents[1] / "profiles"
                 / "nvidia-h100-80gb-hbm3__preset-llama-3-8b.json")  # a committed, measured profile

CPU = torch.device("cpu")
FULL = h100_profile()  # overallocated + split16/32/48/64 on 132 SMs


# ---- PartitionConfig ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(mode="off"),
        dict(mode="static", static_decode_share=0.25),
        dict(mode="static", static_decode_share=0.999),
        dict(backend="none"),
        dict(backend="cuda-green"),
        dict(backend="hip-cumask", profile="p.json"),
        dict(hysteresis_steps=0),
        dict(slo_itl_ms=0.5),
        dict(slo_itl_ms=50),  # an int of ms
        dict(slo_itl_ms=None),  # no ITL SLO (--slo-itl-ms none)
        dict(decode_shares=(0.3,)),
    ],
)
def test_partition_config_valid(kw: dict[str, Any]) -> None:
    PartitionConfig(**kw)


@pytest.mark.parametrize(
    ("kw", "pattern"),
    [
        (dict(mode="Adaptive"), "partition mode='Adaptive'; use adaptive, off or static"),
        (dict(mode="static"), "needs its decode share \\(static:0.25\\)"),
        (dict(mode="adaptive", static_decode_share=0.25), "only a static one has it"),
        (dict(mode="off", static_decode_share=0.25), "only a static one has it"),
        (dict(mode="static", static_decode_share=0.0), "must be in \\(0, 1\\), e.g. static:0.25"),
        (dict(mode="static", static_decode_share=1.0), "must be in \\(0, 1\\)"),
        (dict(mode="static", static_decode_share=-0.5), "must be in \\(0, 1\\)"),
        (dict(backend="cuda"), "partition backend='cuda'; use auto, cuda-green, hip-cumask or none"),
        (dict(slo_itl_ms=0.0), "slo_itl_ms=0.0 must be > 0"),
        (dict(slo_itl_ms=-5.0), "slo_itl_ms"),
        (dict(slo_itl_ms=float("inf")), "slo_itl_ms=inf must be > 0 and finite \\(ms\\), or None: no ITL SLO "
                                        "\\(--slo-itl-ms none\\)"),
        (dict(slo_itl_ms=float("nan")), "slo_itl_ms=nan must be > 0 and finite"),
        (dict(slo_itl_ms="none"), "slo_itl_ms='none' must be > 0 and finite \\(ms\\), or None"),  # the flag's word
        (dict(slo_itl_ms=True), "slo_itl_ms=True must be > 0"),
        (dict(hysteresis_steps=-1), "hysteresis_steps=-1 must be >= 0"),
        (dict(decode_shares=()), "non-empty tuple of shares"),
        (dict(decode_shares=(0.25, 1.0)), "decode_shares"),
        (dict(decode_shares=(0.0,)), "decode_shares"),
    ],
)
def test_partition_config_invalid(kw: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        PartitionConfig(**kw)


@pytest.mark.parametrize(
    ("text", "mode", "share"),
    [
        ("adaptive", "adaptive", None),
        ("off", "off", None),
        ("static:0.25", "static", 0.25),
        ("static:.5", "static", 0.5),
        ("static:1e-1", "static", 0.1),
        ("static: 0.75", "static", 0.75),
    ],
)
def test_partition_parse(text: str, mode: str, share: float | None) -> None:
    p = PartitionConfig.parse(text)
    assert (p.mode, p.static_decode_share) == (mode, share)


def test_partition_parse_passes_keywords() -> None:
    p = PartitionConfig.parse("static:0.25", backend="none", slo_itl_ms=20.0)
    assert p == PartitionConfig(mode="static", static_decode_share=0.25, backend="none", slo_itl_ms=20.0)
    p = PartitionConfig.parse("adaptive", backend="none", profile="x.json", slo_itl_ms=20.0)
    assert p == PartitionConfig(mode="adaptive", backend="none", profile="x.json", slo_itl_ms=20.0)


@pytest.mark.parametrize("text", ["off", "static:0.25"])
def test_profile_only_with_adaptive(text: str) -> None:
    """Refused by the one flag check (policy_spec), which took this rule over from PartitionConfig."""
    p = PartitionConfig.parse(text, profile="x.json")
    mode = text.split(":")[0]
    with pytest.raises(ConfigError, match=f"--profile: not read by --policy rapid --partition {mode}; drop it"):
        check_settings("rapid", "rapid", {"partition": p})


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["serve", "--profile", "/nonexistent/p.json"], "profile /nonexistent/p.json: cannot read"),
        (["serve", "--profile", "BAD"], "invalid JSON"),
        (["serve", "--partition", "off", "--profile", "BAD"], "--profile: not read by --policy rapid --partition off"),
    ],
)
def test_serve_refuses_bad_profile_before_loading(argv: list[str], pattern: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    argv = [str(bad) if x == "BAD" else x for x in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("rapidserve: error:") and pattern in err, err


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("static:0", "static decode share 0.0 must be in \\(0, 1\\), e.g. static:0.25"),
        ("static:1", "must be in \\(0, 1\\)"),
        ("static:-0.25", "must be in \\(0, 1\\)"),
        ("static:nan", "must be in \\(0, 1\\)"),
        ("static:abc", "'static:abc': the share after static: must be a number in \\(0, 1\\), e.g. static:0.25"),
        ("static:", "e.g. static:0.25"),
        ("static:25%", "e.g. static:0.25"),
        ("bogus", "--partition 'bogus'; use adaptive, off or static:<decode share in \\(0, 1\\)>"),
        ("", "use adaptive, off or static"),
        ("static", "use adaptive, off or static"),
        ("ADAPTIVE", "use adaptive, off or static"),
        ("on", "use adaptive, off or static"),
    ],
)
def test_partition_parse_errors(text: str, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        PartitionConfig.parse(text)


# ---- the command line ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["serve", "--partition", "bogus"], "argument --partition: --partition 'bogus'; use adaptive, off or static"),
        (["serve", "--partition", "static:0"], "argument --partition: .*must be in \\(0, 1\\)"),
        (["serve", "--partition", "static:abc"], "e.g. static:0.25"),
        (["serve", "--partition-backend", "cuda"], "argument --partition-backend: invalid choice: 'cuda'"),
        (["serve", "--slo-itl-ms", "0"], "argument --slo-itl-ms: '0' must be a positive, finite number of ms, or none"),
        (["serve", "--slo-itl-ms", "inf"], "argument --slo-itl-ms: 'inf' must be a positive, finite number of ms"),
        (["serve", "--slo-itl-ms", "fast"], "'fast' is not a number"),
        (["profile", "--batch-buckets", "8,1"], "argument --batch-buckets: '8,1': give strictly ascending positive"),
        (["profile", "--batch-buckets", "1,1"], "strictly ascending"),
        (["profile", "--batch-buckets", "a,b"], "give comma-separated positive integers, e.g. 1,8,32"),
        (["profile", "--context-buckets", "0,512"], "argument --context-buckets: .*strictly ascending positive"),
        (["profile", "--context-buckets", ","], "strictly ascending positive"),
        (["profile", "--decode-shares", "0.25,1"], "argument --decode-shares: .*every decode share must be in"),
        (["profile", "--decode-shares", "x"], "comma-separated shares in \\(0, 1\\)"),
        (["profile", "--prefill-tokens", "0"], "argument --prefill-tokens: 0 must be an integer >= 1"),
        (["profile", "--decode-reps", "-3"], "argument --decode-reps"),
        # profile has no --partition (it measures every configuration), and no abbreviations
        (["profile", "--partition", "off"], "rapidserve profile does not support --partition\\. See `rapidserve prof"),
    ],
)
def test_cli_partition_usage_errors(argv: list[str], pattern: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: rapidserve" in err
    assert re.search(pattern, err), err


@pytest.mark.parametrize(("flags", "named"), [
    (["--max-num-seqs", "64"], "--max-num-seqs"),
    (["--max-num-batched-tokens", "2048"], "--max-num-batched-tokens"),
    (["--prefill-batch-tokens", "1024"], "--prefill-batch-tokens"),
    (["--no-enable-prefix-caching"], "--no-enable-prefix-caching"),
    (["--no-async-scheduling"], "--no-async-scheduling"),
    (["--prefill-graph-tokens", "none"], "--prefill-graph-tokens"),
])
def test_profile_refuses_model_flags_it_does_not_read(flags: list[str], named: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before anything loads (the model here would fail to), naming the flag and why."""
    assert main(["profile", "--model", "/nonexistent", *flags]) == 2
    err = capsys.readouterr().err
    assert f"{named}: not read by `rapidserve profile`" in err and "drop it" in err


def test_profile_accepts_those_flags_at_their_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    """At their defaults the flag check lets them through: the run goes on to the model, which fails here."""
    assert main(["profile", "--model", "/nonexistent", "--max-num-seqs", "256", "--enable-prefix-caching",
                 "--async-scheduling"]) == 2
    err = capsys.readouterr().err
    assert "/nonexistent" in err and "not read" not in err, err


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["serve"], PartitionConfig(policy="duet")),  # the default policy where the partition is adaptive
        (["serve", "--partition", "off"], PartitionConfig(mode="off")),
        (["serve", "--partition", "static:0.25", "--partition-backend", "hip-cumask"],
         PartitionConfig(mode="static", static_decode_share=0.25, backend="hip-cumask")),
        (["serve", "--profile", H100_LLAMA, "--slo-itl-ms", "20"],
         PartitionConfig(profile=H100_LLAMA, slo_itl_ms=20.0, policy="duet")),
        (["profile", "--partition-backend", "none", "--slo-itl-ms", "7.5"],
         PartitionConfig(backend="none", slo_itl_ms=7.5, policy="duet")),
    ],
)
def test_cli_partition_config(argv: list[str], want: PartitionConfig) -> None:
    assert partition_config(build_parser().parse_args(argv)) == want


def test_cli_profile_defaults() -> None:
    a = build_parser().parse_args(["profile", "--model", "preset:tiny-llama"])
    assert a.func is cmd_profile
    assert a.batch_buckets == (1, 8, 16, 32, 64, 128, 256, 512) and a.context_buckets == (512, 2048, 8192)
    assert a.decode_shares == (0.125, 0.25, 0.375, 0.5) and a.prefill_tokens == 4096 and a.decode_reps == 20
    assert a.out is None and not a.no_roofline and a.partition_backend == "auto"
    a = build_parser().parse_args(["profile", "--batch-buckets", "1, 2,4", "--decode-shares", "0.5,0.25"])
    assert a.batch_buckets == (1, 2, 4) and a.decode_shares == (0.5, 0.25)


# ---- resolve_plan on CPU ------------------------------------------------------------------------
NO_SLO_NOTE = "no ITL SLO (--slo-itl-ms none): every step fused with the whole token budget, never split"


@pytest.mark.parametrize(("partition", "configs", "want"), [
    (dict(), 5, "ITL SLO 50 ms"), (dict(slo_itl_ms=12.5), 5, "ITL SLO 12.5 ms"),
    (dict(policy="duet", slo_itl_ms=None), 5, NO_SLO_NOTE), (dict(policy="duet", slo_itl_ms=None), 1, NO_SLO_NOTE),
    (dict(), 1, ""),  # one configuration: the SLO chooses nothing
    (dict(mode="static", static_decode_share=0.25), 1, ""), (dict(mode="off", slo_itl_ms=None), 1, ""),
])
def test_the_plan_line_says_the_itl_slo_it_decides_with(partition: dict[str, Any], configs: int, want: str) -> None:
    names = list(FULL.configurations)[:configs]
    plan = PartitionPlan("cuda-green", names, FULL if configs > 1 else None, "test")
    assert slo_note(PartitionConfig(**partition), plan) == want


def engine_config(**partition: Any) -> EngineConfig:
    return EngineConfig("preset:tiny-llama", preset_config("tiny-llama"), partition=PartitionConfig(**partition))


@pytest.mark.parametrize(
    ("partition", "reason"),
    [
        (dict(), "no partition backend on cpu"),
        (dict(mode="off"), "partition off"),
        (dict(backend="none"), "no partition backend on cpu"),
        (dict(mode="off", backend="cuda-green"), "partition off"),  # off needs no backend at all
        (dict(mode="off", backend="hip-cumask"), "partition off"),
        (dict(policy="duet", slo_itl_ms=None), f"no partition backend on cpu; {NO_SLO_NOTE}"),  # the start-up line
        (dict(mode="off", slo_itl_ms=None), "partition off"),  # no SLO is read: nothing to say
    ],
)
def test_resolve_plan_cpu(partition: dict[str, Any], reason: str) -> None:
    plan = resolve_plan(engine_config(**partition), CPU)
    assert plan.backend == "none" and plan.profile is None and plan.source == reason
    assert [c.name for c in plan.configurations] == [OVERALLOCATED] and plan.configurations[0].decode_units == 0
    assert plan.initial == OVERALLOCATED
    assert plan.wire() == PlanWire("none", [Configuration(OVERALLOCATED, 0, 0)], OVERALLOCATED)
    streams = open_streams(plan.wire(), CPU, ("decode", "prefill"))
    assert isinstance(streams, NoPartition) and streams.stream(OVERALLOCATED, "decode") is None
    dp = DecodePartition(engine_config(**partition).partition, plan)
    assert not dp.adaptive and dp.current == OVERALLOCATED and dp.advance(4, 100, True) is None


@pytest.mark.parametrize(
    ("partition", "refused"),
    [
        # what only an adaptive plan reads, on a device with no partition backend: nothing to choose among
        (dict(policy="duet", profile_lookup="interpolate"), "--profile-lookup interpolate"),
        (dict(policy="duet", slo_margin=0.95), "--slo-margin 0.95"),
        (dict(policy="duet", step_correction="per-kind"), "--step-correction per-kind"),
        (dict(policy="duet", slo_itl_ms=100.0), "--slo-itl-ms 100.0"),
        (dict(policy="rapid", decode_shares=(0.25, 0.5)), "--decode-shares"),
        (dict(policy="rapid", hysteresis_steps=3), "PartitionConfig.hysteresis_steps 3"),
        (dict(backend="none", profile="/nonexistent/profile.json"), "--profile /nonexistent/profile.json"),
        (dict(policy="duet", backend="none", profile_lookup="interpolate"), "--profile-lookup interpolate"),
        # a static share asked for where nothing can give it
        (dict(mode="static", static_decode_share=0.25), "--partition static:0.25"),
        (dict(mode="static", static_decode_share=0.25, backend="none"), "--partition static:0.25"),
    ],
)
def test_resolve_plan_cpu_refuses_what_no_partition_reads(partition: dict[str, Any], refused: str) -> None:
    """The static check passes an adaptive policy's settings (the device is not known there); on a CPU the plan has
    no configurations to choose among, so each such setting given is refused by name, not silently dropped."""
    with pytest.raises(ConfigError) as e:
        resolve_plan(engine_config(**partition), CPU)
    msg = str(e.value)
    assert msg.startswith(refused) and "no partition backend on cpu" in msg and "drop it" in msg


@pytest.mark.parametrize("partition", [dict(policy="duet", slo_itl_ms=None), dict(backend="none"), dict(),
                                        dict(mode="off", hysteresis_steps=3)])
def test_resolve_plan_cpu_keeps_what_it_honours(partition: dict[str, Any]) -> None:
    """duet's --slo-itl-ms none (every step fused) is honoured without a partition, --partition-backend none is the
    cause itself, and --partition off is the static check's to judge: none is refused here."""
    assert resolve_plan(engine_config(**partition), CPU).backend == "none"


@pytest.mark.parametrize(
    "partition",
    [
        dict(backend="cuda-green"),
        dict(backend="cuda-green", mode="static", static_decode_share=0.25),
        dict(backend="hip-cumask"),
        dict(backend="hip-cumask", mode="static", static_decode_share=0.25),
        dict(backend="hip-cumask", profile="/nonexistent/profile.json"),
    ],
)
def test_resolve_plan_gpu_backend_on_cpu(partition: dict[str, Any]) -> None:
    """An explicit GPU backend on a CPU run fails at once with what to do, as open_backend does."""
    with pytest.raises(PartitionError, match="needs a GPU; this run is on cpu: use --partition off"):
        resolve_plan(engine_config(**partition), CPU)


# ---- DecodePartition ----------------------------------------------------------------------------
def adaptive_plan(profile: Profile = FULL) -> PartitionPlan:
    return PartitionPlan("cuda-green", list(profile.configurations), profile, "synthetic H100 profile")


IDLE_HOLD = [((32, 1024, False), None)] * 8  # the split is held hysteresis_steps (8) steps

# (SLO ms, [((batch, context, prefill_pending), the configuration switched to, or None to keep)])
SCENARIOS: dict[str, tuple[float, list[tuple[tuple[int, int, bool], str | None]]]] = {
    # overallocated beside prefill (37 ms) violates the 4.5 ms limit: split at once; the manager keeps the split
    # while prefill is idle for 8 steps (hysteresis), then returns decode to the whole GPU
    "prefill arrives, then idles": (5.0, [((32, 1024, True), "split32"), *IDLE_HOLD,
                                          ((32, 1024, False), "overallocated"), ((32, 1024, False), None)]),
    "prefill flickers off within the hold": (5.0, [((32, 1024, True), "split32"), *IDLE_HOLD[:4],
                                                   ((32, 1024, True), None), *IDLE_HOLD[:3],
                                                   ((32, 1024, False), "overallocated")]),
    # empty decode batch with prefill pending: the most prefill throughput (the whole GPU) at once, no
    # hysteresis; the first decode step beside it violates the SLO and splits at once
    "empty batch, prefill pending": (5.0, [((128, 1024, True), "split64"), ((64, 1024, True), None),
                                           ((0, 0, True), "overallocated"), ((1, 100, True), "split32")]),
    "empty batch from overallocated": (5.0, [((0, 0, True), None), ((0, 0, True), None),
                                             ((1, 10, True), "split32")]),
    # empty decode batch with prefill idle: the whole GPU at once
    "empty batch, prefill idle": (5.0, [((32, 1024, True), "split32"), ((0, 0, False), "overallocated")]),
    "batch 256 at SLO 50": (50.0, [((256, 1024, True), "split16"), ((256, 1024, True), None),
                                   ((0, 0, False), "overallocated")]),
    # the SLO still rules an empty batch: at SLO 50 the profile says overallocated meets it beside prefill
    "empty batch, overallocated meets SLO": (50.0, [((0, 0, True), None), ((1, 10, True), None)]),
    "idle stays overallocated": (5.0, [((64, 1024, False), None), ((0, 0, False), None)]),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_decode_partition_scenarios(name: str) -> None:
    slo, steps = SCENARIOS[name]
    dp = DecodePartition(PartitionConfig(slo_itl_ms=slo, hysteresis_steps=8), adaptive_plan())
    assert dp.adaptive and dp.current == OVERALLOCATED and dp.num_switches == 0
    got: list[Switch] = []
    for i, ((batch, context, pending), want) in enumerate(steps):
        old = dp.current
        s = dp.advance(batch, context, pending)
        if want is None:
            assert s is None, f"step {i}: unexpected {s}"
            assert dp.current == old
            continue
        assert s is not None, f"step {i}: expected a switch to {want}"
        assert (s.old, s.new, s.batch, s.context, s.prefill_pending) == (old, want, batch, context, pending)
        assert s.reason.startswith(f"switch {old} -> {want}")
        assert dp.current == want
        # prefill pending gets the whole GPU only while no decode runs (or where it meets the SLO)
        assert want != OVERALLOCATED or not pending or batch == 0
        got.append(s)
    assert dp.num_switches == len(got) and list(dp.switches) == got
    assert all(a.t <= b.t for a, b in zip(got, got[1:], strict=False))


def test_decode_partition_switch_reasons() -> None:
    dp = DecodePartition(PartitionConfig(slo_itl_ms=5.0), adaptive_plan())
    s = dp.advance(32, 1024, True)
    assert s is not None and "violates SLO" in s.reason and "meets SLO" in s.reason
    for _ in range(8):
        assert dp.advance(32, 1024, False) is None
    s = dp.advance(32, 1024, False)
    assert s is not None and "held 8 steps" in s.reason and "prefill idle" in s.reason


@pytest.mark.parametrize("hysteresis", [0, 1, 3, 8])
def test_decode_partition_hysteresis_steps(hysteresis: int) -> None:
    dp = DecodePartition(PartitionConfig(slo_itl_ms=5.0, hysteresis_steps=hysteresis), adaptive_plan())
    assert dp.advance(32, 1024, True) is not None
    held = 0
    while dp.advance(32, 1024, False) is None:
        held += 1
        assert held <= hysteresis
    assert held == hysteresis and dp.current == OVERALLOCATED and dp.num_switches == 2


def test_decode_partition_history_is_bounded() -> None:
    dp = DecodePartition(PartitionConfig(slo_itl_ms=5.0, hysteresis_steps=0), adaptive_plan())
    for i in range(600):
        assert dp.advance(32, 1024, i % 2 == 0) is not None  # no hysteresis: every step flips
    assert dp.num_switches == 600 and len(dp.switches) == 256
    assert dp.switches[-1].new == OVERALLOCATED


def test_decode_partition_profile_without_overallocated() -> None:
    prof = h100_profile(["split16", "split32", "split64"])
    dp = DecodePartition(PartitionConfig(slo_itl_ms=5.0), adaptive_plan(prof))
    assert dp.current == "split64"  # the split with the most decode units stands for the whole GPU
    s = dp.advance(32, 1024, True)  # split64 meets (2.72 ms): hold it (hysteresis) though split32 is better
    assert s is None
    s = dp.advance(0, 0, True)  # empty batch: no hysteresis, the most prefill throughput
    assert s is not None and s.new == "split16"


@pytest.mark.parametrize(
    "plan",
    [
        PartitionPlan("none", [Configuration(OVERALLOCATED, 0, 0)], None, "partition off"),
        PartitionPlan("cuda-green", [Configuration("split32", 32, 100)], None, "static split32"),
        PartitionPlan("cuda-green", list(FULL.configurations), None, "several configurations, no profile"),
        PartitionPlan("cuda-green", [Configuration("split32", 32, 100)], h100_profile(["split32"]), "one config"),
        PartitionPlan("cuda-green", [Configuration(OVERALLOCATED, 0, 132)], h100_profile(["overallocated"]), "one"),
    ],
)
def test_decode_partition_not_adaptive(plan: PartitionPlan) -> None:
    dp = DecodePartition(PartitionConfig(slo_itl_ms=1.0, hysteresis_steps=0), plan)
    assert not dp.adaptive
    first = dp.current
    assert first == plan.configurations[0].name
    for batch, context, pending in [(32, 1024, True), (0, 0, True), (0, 0, False), (256, 8192, True), (1, 1, False)]:
        assert dp.advance(batch, context, pending) is None
    assert dp.current == first and dp.num_switches == 0 and not dp.switches


@pytest.mark.parametrize(
    ("plan", "initial"),
    [
        (adaptive_plan(), OVERALLOCATED),
        (adaptive_plan(h100_profile(["split16", "split48"])), "split48"),
        (PartitionPlan("cuda-green", [Configuration("split48", 48, 84), Configuration("split16", 16, 116)], None, ""),
         "split48"),
    ],
)
def test_plan_initial_and_wire(plan: PartitionPlan, initial: str) -> None:
    assert plan.initial == initial
    assert plan.wire() == PlanWire(plan.backend, list(plan.configurations), initial)


# ---- profile path helpers -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("NVIDIA H100 80GB HBM3", "nvidia-h100-80gb-hbm3"),
        ("AMD Instinct MI300X", "amd-instinct-mi300x"),
        ("preset:llama-3-8b", "preset-llama-3-8b"),
        ("  --Weird__Name!!  ", "weird-name"),
        ("Qwen3-8B", "qwen3-8b"),
        ("cpu", "cpu"),
        ("", ""),
        ("---", ""),
    ],
)
def test_slug(text: str, want: str) -> None:
    assert slug(text) == want


@pytest.mark.parametrize(
    ("model", "want"),
    [
        ("", "SmolLM2-135M-Instruct"),
        ("default", "SmolLM2-135M-Instruct"),
        ("preset:tiny-llama", "preset:tiny-llama"),
        ("preset:llama-3-8b", "preset:llama-3-8b"),
        ("/models/Meta-Llama-3-8B-Instruct", "Meta-Llama-3-8B-Instruct"),
        ("/models/Meta-Llama-3-8B-Instruct/", "Meta-Llama-3-8B-Instruct"),
        ("models/qwen/../Qwen3-8B", "Qwen3-8B"),
        ("/data/llama.Q4_K_M.gguf", "llama.Q4_K_M.gguf"),
        ("relative-folder", "relative-folder"),
    ],
)
def test_model_label(model: str, want: str) -> None:
    assert model_label(model) == want


@pytest.mark.parametrize(
    ("gpu", "model", "want"),
    [
        ("NVIDIA H100 80GB HBM3", "preset:llama-3-8b", "nvidia-h100-80gb-hbm3__preset-llama-3-8b.json"),
        ("NVIDIA H100 80GB HBM3", "/models/Qwen3-8B/", "nvidia-h100-80gb-hbm3__qwen3-8b.json"),
        ("AMD Instinct MI300X", "default", "amd-instinct-mi300x__smollm2-135m-instruct.json"),
        ("cpu", "preset:tiny-llama", "cpu__preset-tiny-llama.json"),
    ],
)
def test_profile_filename(gpu: str, model: str, want: str) -> None:
    assert profile_filename(gpu, model) == want


def test_default_profiles_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    repo_profiles = Path(rapidserve.__file__).resolve().parents[1] / "profiles"
    monkeypatch.delenv("RAPIDSERVE_PROFILES_DIR", raising=False)
    assert default_profiles_dir() == repo_profiles
    monkeypatch.setenv("RAPIDSERVE_PROFILES_DIR", "")
    assert default_profiles_dir() == repo_profiles
    monkeypatch.setenv("RAPIDSERVE_PROFILES_DIR", str(tmp_path / "mine"))
    assert default_profiles_dir() == tmp_path / "mine"


# ---- --policy duet ----------------------------------------------------------------------------------
def duet_partition(slo: float = 50.0, hysteresis: int = 8) -> DecodePartition:
    from rapidserve.partition.roofline import Peaks

    peaks = Peaks(matmul_flops=794e12, hbm_bw=2.98e12, num_compute_units=132)
    plan = PartitionPlan("cuda-green", list(FULL.configurations), FULL, "synthetic H100 profile", peaks)
    return DecodePartition(PartitionConfig(policy="duet", slo_itl_ms=slo, hysteresis_steps=hysteresis), plan,
                           preset_config("qwen3-8b"), 8192)


def test_decode_partition_duet_scenario() -> None:
    from rapidserve.partition.policy import WaitingPrefill

    dp = duet_partition()
    decodes = (3000,) * 32
    turns = tuple(WaitingPrefill(f"t{i}", 0.0, 320, 2368) for i in range(2))
    burst = tuple(WaitingPrefill(f"f{i}", 0.0, 2048) for i in range(8))
    assert dp.advance_duet(decodes, ()) is None and dp.current == OVERALLOCATED  # decode alone
    assert dp.advance_duet(decodes, turns) is None and dp.last_duet is not None  # short turns: aggregated
    assert dp.last_duet.mode == "aggregated"
    s = dp.advance_duet(decodes, burst)  # a burst of long prompts: split at once
    assert s is not None and s.old == OVERALLOCATED and s.new.startswith("split") and s.prefill_pending
    assert (s.batch, s.context) == (32, 3000)
    for _ in range(8):  # back to aggregation only after the hold
        assert dp.advance_duet(decodes, turns) is None
    s = dp.advance_duet(decodes, turns)
    assert s is not None and s.new == OVERALLOCATED and dp.num_switches == 2
    assert dp.advance_duet((), burst) is None  # no decode running: the whole GPU for prefill


def test_decode_partition_duet_not_adaptive() -> None:
    plan = PartitionPlan("none", [Configuration(OVERALLOCATED, 0, 0)], None, "partition off")
    dp = DecodePartition(PartitionConfig(mode="off"), plan)
    assert dp.advance_duet((100,), ()) is None


def test_partition_config_policy_invalid() -> None:
    with pytest.raises(ConfigError, match="policy='drift2'; use one of rapid, duet, drift, fused"):
        PartitionConfig(policy="drift2")
    # which partition modes a policy runs with is the flag check's (policy_spec), no longer PartitionConfig's
    with pytest.raises(ConfigError, match="--partition off: --policy duet runs with --partition adaptive \\(it picks "
                                          "among partition configurations\\); drop --partition off, or use --policy "
                                          "rapid"):
        check_settings("rapid", "duet", {"partition": PartitionConfig(policy="duet", mode="off")})


def test_cli_policy() -> None:
    assert partition_config(build_parser().parse_args(["serve", "--policy", "duet"])) == PartitionConfig(policy="duet")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--policy", "fast"])


def test_keeps_with_prefill_looks_without_deciding() -> None:
    """A request may be handed to prefill between step boundaries only where the rapid policy would keep
    the configuration with prefill pending; the look changes neither the state nor the history."""
    dp = DecodePartition(PartitionConfig(slo_itl_ms=5.0, hysteresis_steps=8), adaptive_plan())
    assert dp.current == OVERALLOCATED
    assert not dp.keeps_with_prefill(32, 1024)  # overallocated beside prefill violates the SLO: a switch first
    assert dp.current == OVERALLOCATED and dp.num_switches == 0 and dp.state.steps_since_switch == 0
    assert dp.advance(32, 1024, True) is not None and dp.current == "split32"
    assert dp.keeps_with_prefill(32, 1024)  # the split prefill is already given
    held = dp.state
    for _ in range(3):
        assert dp.keeps_with_prefill(32, 1024)
    assert dp.state == held  # looking never counts towards the hysteresis
    # SLO 50: overallocated meets it beside prefill; an empty batch gives prefill the whole GPU
    dp50 = DecodePartition(PartitionConfig(slo_itl_ms=50.0), adaptive_plan())
    assert dp50.keeps_with_prefill(0, 0) and dp50.keeps_with_prefill(1, 10)
    for policy in ("duet", "drift"):  # they plan from the whole queue: no hand-off between boundaries
        assert not DecodePartition(PartitionConfig(slo_itl_ms=50.0, policy=policy), adaptive_plan()).keeps_with_prefill(
            1, 10)
    one = PartitionPlan("cuda-green", [Configuration("split32", 32, 100)], None, "static split32")
    assert DecodePartition(PartitionConfig(slo_itl_ms=1.0), one).keeps_with_prefill(32, 1024)


def test_short_prefill_work_keeps_decode_on_the_whole_gpu() -> None:
    """The decode worker tells the rapid policy how many prompt tokens prefill has yet to compute: a chat's
    next turn leaves decode on the whole GPU, a long prompt splits at once; the early hand-off (`keeps_with_
    prefill`) looks with the same count. The cap is how far the worker need count (manager.pending_tokens_cap)."""
    from tests.test_partition_manager import QWEN3

    def work(tokens: int) -> PendingWork:
        return PendingWork(tokens, tokens + 2048)  # a turn over a 2K cached prefix

    dp = DecodePartition(PartitionConfig(slo_itl_ms=50.0, hysteresis_steps=8), adaptive_plan(QWEN3))
    assert dp.prefill_tokens_cap == 4097
    assert dp.current == OVERALLOCATED
    assert dp.keeps_with_prefill(32, 2048, work(320))
    assert dp.advance(32, 2048, True, work(320)) is None and dp.current == OVERALLOCATED
    assert not dp.keeps_with_prefill(32, 2048, work(4096))  # a long prompt: a switch first, then the hand-off
    assert not dp.keeps_with_prefill(32, 2048)  # work not counted: the profile's figures alone
    s = dp.advance(32, 2048, True, work(4096))
    assert s is not None and s.new == "split16" and "at once" in s.reason and "4096 prompt tokens" in s.reason
    for _ in range(8):  # back to short work: split16 is held for the hysteresis
        assert dp.advance(32, 2048, True, work(320)) is None
    s = dp.advance(32, 2048, True, work(320))
    assert s is not None and s.new == OVERALLOCATED
    assert DecodePartition(PartitionConfig(slo_itl_ms=50.0), adaptive_plan(QWEN3)).advance(32, 2048, True) is not None
    static = PartitionPlan("cuda-green", [Configuration("split32", 32, 100)], None, "static split32")
    assert DecodePartition(PartitionConfig(slo_itl_ms=50.0), static).prefill_tokens_cap == 0


@pytest.mark.parametrize(
    ("run", "partition", "device", "refused"),
    [
        ("rapid", dict(policy="duet", profile_lookup="interpolate"), "cpu", "--profile-lookup interpolate"),
        ("rapid", dict(policy="rapid", slo_itl_ms=100.0), "cpu", "--slo-itl-ms 100.0"),
        ("rapid", dict(policy="duet", backend="none", decode_shares=(0.5,)), "cuda", "--decode-shares"),
        ("rapid", dict(policy="duet", slo_itl_ms=None), "cpu", None),  # honoured: every step fused
        ("rapid", dict(policy="drift", slo_itl_ms=80.0), "cpu", None),  # DRIFT's prefill sizes its blocks by it
        ("rapid", dict(policy="duet", profile_lookup="interpolate"), "cuda", None),  # the plan's to judge
        ("hybrid", dict(policy="fused", mode="off"), "cpu", None),
        ("rapid", dict(policy="rapid", mode="static", static_decode_share=0.25), "cpu", "--partition static:0.25"),
        ("rapid", dict(policy="rapid", mode="static", static_decode_share=0.25, backend="none"), "cuda",
         "--partition static:0.25"),
        ("rapid", dict(policy="rapid", mode="static", static_decode_share=0.25), "cuda", None),
        ("rapid", dict(policy="rapid", mode="off"), "cpu", None),
    ],
)
def test_check_partition_device(run: str, partition: dict[str, Any], device: str, refused: str | None) -> None:
    """The serve command's check before any worker starts (config_builder): one line, naming the setting."""
    from rapidserve.config_builder import check_partition_device

    pc = PartitionConfig(**partition)
    if refused is None:
        check_partition_device(run, pc, torch.device(device))
        return
    with pytest.raises(ConfigError, match=f"^{refused}.*drop it"):
        check_partition_device(run, pc, torch.device(device))

