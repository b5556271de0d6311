"""`rapidserve profile` end to end on CPU with the tiny preset (small buckets), its SLO table and percentile
helpers, and the engine refusing a profile measured for another GPU or model."""

from __future__ import annotations

import contextlib
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

import rapidserve.partition.plan as partition_plan
from rapidserve.cli import main
from rapidserve.config import EngineConfig
from rapidserve.loader.presets import preset_config
from rapidserve.partition.backend import Granularity, PartitionError
from rapidserve.partition.profile import (
    OVERALLOCATED,
    Configuration,
    Profile,
    ProfileError,
    load_profile,
    profile_filename,
    save_profile,
)
from rapidserve.partition.profile_cmd import slo_table
from rapidserve.partition.profiler import ProfileSpec, percentile
from rapidserve.partition_config import PartitionConfig
from tests.test_partition_manager import BATCHES, CONTEXTS, h100_profile

BATCH_BUCKETS, CONTEXT_BUCKETS = [1, 2], [16, 48]
H100_NAME = "NVIDIA H100 80GB HBM3"


@dataclass
class ProfileRun:
    rc: int
    out: Path
    stdout: str


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> ProfileRun:
    """One real `rapidserve profile` run (a few seconds on CPU), shared by the tests of this module."""
    out = tmp_path_factory.mktemp("profile") / "p.json"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["profile", "--model", "preset:tiny-llama", "--device", "cpu", "--batch-buckets", "1,2",
                   "--context-buckets", "16,48", "--prefill-tokens", "32", "--decode-reps", "3", "--out", str(out)])
    return ProfileRun(rc, out, buf.getvalue())


def test_profile_command_writes_a_valid_profile(measured: ProfileRun) -> None:
    assert measured.rc == 0
    p = load_profile(measured.out, expect_gpu="cpu", expect_model="preset:tiny-llama")  # validated
    assert (p.gpu, p.model, p.source, p.schema_version) == ("cpu", "preset:tiny-llama", "measured", 1)
    assert p.batch_buckets == BATCH_BUCKETS and p.context_buckets == CONTEXT_BUCKETS
    assert [c.name for c in p.configurations] == [OVERALLOCATED]  # CPU: no partition backend, one configuration
    assert p.configurations[0].decode_units == 0 and p.num_compute_units >= 1
    cells = {(e.config, e.batch, e.context) for e in p.entries}
    assert cells == {(OVERALLOCATED, b, x) for b in BATCH_BUCKETS for x in CONTEXT_BUCKETS}
    assert len(p.entries) == len(cells)
    for e in p.entries:
        for v in (e.decode_ms_alone_p50, e.decode_ms_alone_p95, e.decode_ms_beside_prefill_p50,
                  e.decode_ms_beside_prefill_p95, e.prefill_tokens_per_s):
            assert 0 < v < float("inf")
        assert e.decode_ms_alone_p95 >= e.decode_ms_alone_p50
        assert e.decode_ms_beside_prefill_p95 >= e.decode_ms_beside_prefill_p50


def test_profile_command_prints_table_and_summary(measured: ProfileRun) -> None:
    out = measured.stdout
    assert "| batch | context | best configuration (p95 beside prefill <= 50 ms)" in out
    for b in BATCH_BUCKETS:
        for x in CONTEXT_BUCKETS:
            assert re.search(rf"^\| {b} \| {x} \| ", out, re.M), out
    summary = json.loads(out[out.index("\n{") + 1:])
    assert summary["profile"] == str(measured.out)
    assert summary["seconds"] >= 0 and summary["solo_prefill_tokens_per_s"] > 0
    assert summary["roofline"]["report"] == str(measured.out.with_suffix(".roofline.md"))
    assert set(summary["roofline"]["errors"]) == {"decode_alone", "decode_beside_prefill", "prefill_tokens_per_s"}


def test_profile_command_writes_roofline_report(measured: ProfileRun) -> None:
    md = measured.out.with_suffix(".roofline.md")
    assert md.name == "p.roofline.md" and md.is_file()
    text = md.read_text()
    assert "cpu / preset:tiny-llama" in text and "decode_beside_prefill" in text
    assert sum(line.startswith(f"| {OVERALLOCATED} |") for line in text.splitlines()) == 4  # a row per cell


def test_profile_command_writes_plot(measured: ProfileRun) -> None:
    pytest.importorskip("matplotlib")
    png = measured.out.with_suffix(".png")
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(measured.stdout[measured.stdout.index("\n{") + 1:])["plot"] == str(png)


def test_profile_command_default_out_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --out the profile lands at $RAPIDSERVE_PROFILES_DIR/<gpu>__<model>.json, where the engine looks."""
    monkeypatch.setenv("RAPIDSERVE_PROFILES_DIR", str(tmp_path))
    with contextlib.redirect_stdout(io.StringIO()):
        rc = main(["profile", "--model", "preset:tiny-llama", "--device", "cpu", "--batch-buckets", "1",
                   "--context-buckets", "16", "--prefill-tokens", "16", "--decode-reps", "3", "--no-roofline"])
    assert rc == 0
    path = tmp_path / profile_filename("cpu", "preset:tiny-llama")
    assert path.name == "cpu__preset-tiny-llama.json"
    assert len(load_profile(path).entries) == 1
    assert not path.with_suffix(".roofline.md").exists()


# ---- ProfileSpec, percentile, slo_table -----------------------------------------------------------
@pytest.mark.parametrize(
    "kw",
    [
        dict(batch_buckets=()),
        dict(batch_buckets=(2, 1)),
        dict(batch_buckets=(1, 1)),
        dict(context_buckets=(0, 16)),
        dict(prefill_tokens=0),
        dict(decode_reps=2),
    ],
)
def test_profile_spec_invalid(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        ProfileSpec(**kw)


@pytest.mark.parametrize(
    ("xs", "q", "want"),
    [
        ([1.0, 2.0, 3.0, 4.0, 5.0], 50, 3.0),
        ([1.0, 2.0, 3.0, 4.0, 5.0], 95, 4.8),  # linear interpolation between the two largest
        ([5.0, 1.0, 4.0, 2.0, 3.0], 95, 4.8),  # order does not matter
        ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
        ([10.0, 20.0], 95, 19.5),
        ([7.0], 50, 7.0),
        ([7.0], 95, 7.0),
        ([3.0, 1.0, 2.0], 0, 1.0),
        ([3.0, 1.0, 2.0], 100, 3.0),
        ((2, 4), 50, 3.0),  # ints and tuples
    ],
)
def test_percentile(xs: list[float], q: float, want: float) -> None:
    got = percentile(xs, q)
    assert type(got) is float and got == pytest.approx(want)


FULL = h100_profile()


@pytest.mark.parametrize(
    ("slo", "batch", "context", "row"),
    [
        # SLO 5 ms: split32 (3.27 ms beside prefill) gives prefill the most tokens/s among those within it
        (5.0, 1, 512, "| 1 | 512 | split32 | 3.27 | 1,036,962 |"),
        (5.0, 64, 2048, "| 64 | 2048 | split32 | 3.27 | 1,036,962 |"),
        # doubled latency (batch >= 128 or context 8192): nothing within 5 ms, the lowest is named
        (5.0, 1, 8192, "| 1 | 8192 | none meets it (lowest: split64) | 5.44 | 589,353 |"),
        (5.0, 256, 512, "| 256 | 512 | none meets it (lowest: split64) | 5.44 | 589,353 |"),
        # SLO 50 ms: overallocated (37 ms) is within it and has the most prefill throughput
        (50.0, 1, 512, "| 1 | 512 | overallocated | 37.00 | 1,462,857 |"),
        (50.0, 128, 2048, "| 128 | 2048 | split16 | 10.80 | 1,260,308 |"),
        (50.0, 2, 8192, "| 2 | 8192 | split16 | 10.80 | 1,260,308 |"),
        # SLO 2 ms: nothing ever meets it
        (2.0, 1, 512, "| 1 | 512 | none meets it (lowest: split64) | 2.72 | 589,353 |"),
        # the limit is inclusive: exactly 3.27 ms meets it
        (3.27, 1, 512, "| 1 | 512 | split32 | 3.27 | 1,036,962 |"),
    ],
)
def test_slo_table(slo: float, batch: int, context: int, row: str) -> None:
    lines = slo_table(FULL, slo).splitlines()
    assert lines[0] == (f"| batch | context | best configuration (p95 beside prefill <= {slo:g} ms) | decode p95 ms "
                        "| prefill tok/s |")
    assert lines[1] == "|---|---|---|---|---|"
    assert len(lines) == 2 + len(BATCHES) * len(CONTEXTS)
    assert row in lines
    assert [tuple(int(v) for v in line.split("|")[1:3]) for line in lines[2:]] == [
        (b, x) for b in BATCHES for x in CONTEXTS
    ]


# ---- the engine refuses a profile for another GPU or model --------------------------------------------
@pytest.mark.parametrize(
    ("gpu", "model", "pattern"),
    [
        (H100_NAME, None, "field `gpu`: gpu: profile is for 'cpu', this run uses 'NVIDIA H100 80GB HBM3'"),
        (None, "preset:llama-3-8b", "field `model`: model: profile is for 'preset:tiny-llama', this run uses"),
        (H100_NAME, "preset:llama-3-8b", "field `gpu`: gpu: .*; model: profile is for 'preset:tiny-llama'"),
        ("CPU", None, "this run uses 'CPU'"),  # exact match, no normalisation
    ],
)
def test_load_profile_refuses_other_gpu_or_model(measured: ProfileRun, gpu: str | None, model: str | None,
                                                 pattern: str) -> None:
    with pytest.raises(ProfileError, match=pattern) as info:
        load_profile(measured.out, expect_gpu=gpu, expect_model=model)
    msg = str(info.value)
    assert msg.startswith(f"profile {measured.out}: ")
    assert msg.endswith("Run `rapidserve profile` to measure this GPU and model.")


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> Any:
    """resolve_plan on a pretend H100 (cuda-green): granularity and name patched, nothing touches a driver."""
    monkeypatch.setattr(partition_plan, "device_granularity", lambda kind, device: Granularity(132, 8, 8))
    monkeypatch.setattr(partition_plan, "gpu_name", lambda device: H100_NAME)

    def no_roofline(*a: Any, **k: Any) -> Profile:
        raise AssertionError("a profile was expected to be found")

    monkeypatch.setattr(partition_plan, "roofline_fallback", no_roofline)
    return SimpleNamespace(type="cuda", index=0)


def plan_config(model: str, profile: Path | None = None) -> EngineConfig:
    p = PartitionConfig(backend="cuda-green", profile=str(profile) if profile else None)
    return EngineConfig(model, preset_config("tiny-llama"), partition=p)


def test_resolve_plan_refuses_profile_of_another_gpu(measured: ProfileRun, fake_gpu: Any) -> None:
    with pytest.raises(ProfileError, match="gpu: profile is for 'cpu'.*Run `rapidserve profile`"):
        partition_plan.resolve_plan(plan_config("preset:tiny-llama", measured.out), fake_gpu)


@pytest.mark.parametrize("model", ["preset:llama-3-8b", "preset:tiny-llama", "/models/llama-3-8b"])
def test_resolve_plan_uses_or_refuses_h100_profile(tmp_path: Path, fake_gpu: Any, model: str) -> None:
    """The H100 profile (model llama-3-8b) is used for that model only; given explicitly for another, refused."""
    path = tmp_path / "h100.json"
    save_profile(FULL, path)
    if model != "/models/llama-3-8b":
        with pytest.raises(ProfileError, match="model: profile is for 'llama-3-8b'.*Run `rapidserve profile`"):
            partition_plan.resolve_plan(plan_config(model, path), fake_gpu)
        return
    plan = partition_plan.resolve_plan(plan_config(model, path), fake_gpu)
    assert plan.backend == "cuda-green" and plan.profile == FULL
    assert [c.name for c in plan.configurations] == ["overallocated", "split16", "split32", "split48", "split64"]
    assert plan.source.startswith(f"adaptive, policy rapid, measured profile {path}") and plan.initial == OVERALLOCATED


def test_resolve_plan_finds_profile_in_profiles_dir(tmp_path: Path, fake_gpu: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAPIDSERVE_PROFILES_DIR", str(tmp_path))
    save_profile(FULL, tmp_path / profile_filename(H100_NAME, "/models/llama-3-8b"))
    plan = partition_plan.resolve_plan(plan_config("/models/llama-3-8b"), fake_gpu)
    assert plan.profile == FULL and "nvidia-h100-80gb-hbm3__llama-3-8b.json" in plan.source


def test_resolve_plan_refuses_splits_this_gpu_cannot_make(tmp_path: Path, fake_gpu: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A profile naming this GPU but with splits of another unit count (e.g. a different SKU reporting the
    same name): check_configurations refuses it and says to re-profile."""
    prof = msgspec.structs.replace(FULL, num_compute_units=132, configurations=[
        *FULL.configurations[:1], Configuration("split16", 16, 100), *FULL.configurations[2:]])
    path = tmp_path / "odd.json"
    save_profile(prof, path)
    with pytest.raises(PartitionError, match="configuration 'split16' splits 116 units.*rapidserve profile"):
        partition_plan.resolve_plan(plan_config("/models/llama-3-8b", path), fake_gpu)
