"""Profile schema: validation errors name the file and the field; save/load round trip."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from rapidserve.partition.profile import (
    SUPPORTED_SCHEMA_VERSIONS,
    Configuration,
    Entry,
    Profile,
    ProfileError,
    load_profile,
    save_profile,
)
from rapidserve.partition.profile_lookup import bucket_up, estimate, lookup

GPU, MODEL = "NVIDIA H100 80GB HBM3", "llama-3-8b"


def good_dict() -> dict[str, Any]:
    configs = [("overallocated", 0, 132, 35.9, 5.6), ("split32", 32, 100, 2.93, 7.9)]
    entries = []
    for name, _, _, beside, pf_ms in configs:
        for b in (1, 64):
            for c in (1024, 8192):
                entries.append(
                    dict(
                        config=name,
                        batch=b,
                        context=c,
                        decode_ms_alone_p50=1.4,
                        decode_ms_alone_p95=1.5,
                        decode_ms_beside_prefill_p50=beside,
                        decode_ms_beside_prefill_p95=beside * 1.1,
                        prefill_tokens_per_s=8192 / (pf_ms / 1e3),
                    )
                )
    return dict(
        schema_version=1,
        gpu=GPU,
        model=MODEL,
        num_compute_units=132,
        configurations=[dict(name=n, decode_units=d, prefill_units=p) for n, d, p, _, _ in configs],
        batch_buckets=[1, 64],
        context_buckets=[1024, 8192],
        entries=entries,
        created="2026-11-22T00:00:00Z",
        source="measured",
    )


def write(tmp_path: Path, data: Any, raw: str | None = None) -> Path:
    path = tmp_path / "h100__llama.json"
    path.write_text(raw if raw is not None else json.dumps(data))
    return path


def test_round_trip(tmp_path: Path) -> None:
    prof = load_profile(write(tmp_path, good_dict()), GPU, MODEL)
    out = tmp_path / "sub" / "copy.json"
    save_profile(prof, out)
    assert load_profile(out) == prof
    assert prof.effective_decode_units("overallocated") == 132
    assert [p.name for p in tmp_path.joinpath("sub").iterdir()] == ["copy.json"]  # no temp file left


def test_save_refuses_invalid(tmp_path: Path) -> None:
    prof = msgspec.convert(good_dict(), Profile)
    bad = msgspec.structs.replace(prof, batch_buckets=[64, 1])
    with pytest.raises(ProfileError, match="batch_buckets"):
        save_profile(bad, tmp_path / "x.json")
    assert not (tmp_path / "x.json").exists()


def mutate(fn: Any) -> dict[str, Any]:
    d = good_dict()
    fn(d)
    return d


def setitem(path: list[Any], value: Any) -> Any:
    def fn(d: Any) -> None:
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value

    return fn


CASES: list[tuple[str, Any, str]] = [
    (
        "wrong version",
        setitem(["schema_version"], 2),
        r"schema_version.*unsupported version 2.*supported versions: \[1\]",
    ),
    ("negative latency", setitem(["entries", 0, "decode_ms_alone_p50"], -1.0), r"entries\[0\]\.decode_ms_alone_p50"),
    ("zero throughput", setitem(["entries", 3, "prefill_tokens_per_s"], 0.0), r"entries\[3\]\.prefill_tokens_per_s"),
    (
        "p95 below p50",
        setitem(["entries", 1, "decode_ms_beside_prefill_p95"], 1.0),
        r"entries\[1\]\.decode_ms_beside_prefill_p95.*below p50",
    ),
    ("missing entry", lambda d: d["entries"].pop(2), r"`entries`.*missing entry for config='overallocated' batch=64"),
    ("duplicate entry", lambda d: d["entries"].append(dict(d["entries"][0])), r"entries\[8\].*duplicate entry"),
    (
        "decode units beyond total",
        setitem(["configurations", 1, "decode_units"], 200),
        r"configurations\[1\]\.decode_units.*0\.\.132",
    ),
    (
        "split sum beyond total",
        setitem(["configurations", 1, "prefill_units"], 120),
        r"configurations\[1\]\.prefill_units.*exceeds num_compute_units 132",
    ),
    ("zero prefill tokens", setitem(["prefill_tokens"], 0), r"`prefill_tokens`: must be positive, got 0"),
    ("wrong type", setitem(["num_compute_units"], "lots"), r"num_compute_units"),
    ("missing field", lambda d: d.pop("gpu"), r"gpu"),
    ("bad source", setitem(["source"], "guessed"), r"source"),
    ("buckets not ascending", setitem(["context_buckets"], [8192, 1024]), r"context_buckets\[1\].*ascending"),
    ("entry off bucket", setitem(["entries", 0, "batch"], 2), r"entries\[0\]\.batch"),
    ("unknown config", setitem(["entries", 0, "config"], "split99"), r"entries\[0\]\.config.*split99"),
    ("duplicate config", setitem(["configurations", 1, "name"], "overallocated"), r"configurations\[1\]\.name"),
]


@pytest.mark.parametrize(("label", "fn", "pattern"), CASES, ids=[c[0] for c in CASES])
def test_validation_errors(tmp_path: Path, label: str, fn: Any, pattern: str) -> None:
    path = write(tmp_path, mutate(fn))
    with pytest.raises(ProfileError, match=pattern) as info:
        load_profile(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_bad_json(tmp_path: Path) -> None:
    path = write(tmp_path, None, raw='{"schema_version": 1, ')
    with pytest.raises(ProfileError, match="invalid JSON") as info:
        load_profile(path)
    assert str(path) in str(info.value)


def test_not_an_object(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="JSON object"):
        load_profile(write(tmp_path, [1, 2]))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(tmp_path / "nope.json")


@pytest.mark.parametrize(
    ("gpu", "model", "pattern"),
    [
        ("AMD Instinct MI300X", None, r"`gpu`.*'NVIDIA H100 80GB HBM3'.*'AMD Instinct MI300X'"),
        (None, "qwen", r"`model`.*'llama-3-8b'.*'qwen'"),
        ("AMD Instinct MI300X", "qwen", r"`gpu`.*MI300X.*model.*qwen"),
    ],
)
def test_mismatch(tmp_path: Path, gpu: str | None, model: str | None, pattern: str) -> None:
    path = write(tmp_path, good_dict())
    with pytest.raises(ProfileError, match=pattern) as info:
        load_profile(path, gpu, model)
    assert "rapidserve profile" in str(info.value) and str(path) in str(info.value)


def test_supported_versions() -> None:
    assert SUPPORTED_SCHEMA_VERSIONS == (1,)


def test_bucket_up_empty() -> None:
    with pytest.raises(ValueError):
        bucket_up([], 1)


def test_prefill_tokens_defaults_for_older_profiles(tmp_path: Path) -> None:
    """Profiles written before `prefill_tokens` existed were all measured with 4096-token forwards."""
    d = mutate(lambda d: d.pop("prefill_tokens", None))
    assert "prefill_tokens" not in d
    assert load_profile(write(tmp_path, d)).prefill_tokens == 4096


def _grid_profile() -> Profile:
    """One configuration over batch buckets [1, 16, 32] x context buckets [512, 2048, 8192]. Figures, per (b, c) with
    c in thousands: alone p50 b + c, alone p95 b * c (a cross term: exact under bilinear interpolation only with all
    four corners weighed right), beside p50 2(b + c), beside p95 2bc, prefill tokens/s 1000b."""
    entries = [Entry("split16", b, c, b + c / 1000, b * c / 1000, 2 * (b + c / 1000), 2 * b * c / 1000, 1000.0 * b)
               for b in (1, 16, 32) for c in (512, 2048, 8192)]
    return Profile("gpu", "model", 132, [Configuration("split16", 16, 116)], [1, 16, 32], [512, 2048, 8192], entries,
                   "2026-11-27T00:00:00Z", "measured")


@pytest.mark.parametrize("batch,context,want_entry,want_beyond", [
    (16, 2048, (16, 2048), False),      # on a bucket: its figures
    (24, 2048, (24, 2048), False),      # halfway in batch
    (16, 5120, (16, 5120), False),      # halfway in context (2048 .. 8192)
    (20, 4160, (20, 4160), False),      # both: bilinear, the cross term from all four corners
    (1, 100, (1, 512), False),          # below the smallest buckets: the smallest's figures
    (64, 16384, (32, 8192), True),      # beyond the largest: extrapolated (below), flagged, the entry at the largest
])
def test_estimate_interpolates_between_buckets(batch: int, context: int, want_entry: tuple[int, int],
                                               want_beyond: bool) -> None:
    p = _grid_profile()
    got = estimate(p, "split16", batch, context, interpolate=True)
    assert (got.entry.batch, got.entry.context, got.beyond) == (*want_entry, want_beyond)
    # the figures: at the query within the buckets' range (the smallest's below it), extrapolated past the largest
    b, c = (batch, context) if want_beyond else want_entry
    e = got.entry
    assert e.decode_ms_alone_p50 == pytest.approx(b + c / 1000)  # linear figures come out exact
    assert e.decode_ms_beside_prefill_p50 == pytest.approx(2 * (b + c / 1000))
    # prefill's rate beside a bigger batch never rises past the largest bucket's (it would here: 1000 b)
    assert e.prefill_tokens_per_s == pytest.approx(1000 * min(b, 32))
    # b * c is bilinear, so interpolation reproduces it exactly only with all four corners weighed right (and the
    # extrapolation, the batch then the context, each linear in its own)
    assert e.decode_ms_alone_p95 == pytest.approx(b * c / 1000)
    assert e.decode_ms_beside_prefill_p95 == pytest.approx(2 * b * c / 1000)
    rounded = estimate(p, "split16", batch, context)  # the default: the bucket at or above each (`lookup`)
    if not want_beyond:
        assert rounded == lookup(p, "split16", batch, context)
    assert rounded.entry.decode_ms_alone_p95 >= e.decode_ms_alone_p95


@pytest.mark.parametrize("batch,context,bucket,alone_p50,beside_p95,prefill", [
    (32, 8192, (32, 8192), 32 + 8.192, 2 * 32 * 8.192, 32000.0),  # the largest bucket itself
    (48, 8192, (32, 8192), 48 + 8.192, 2 * 48 * 8.192, 32000.0),  # one half step past it in batch
    (96, 2048, (32, 2048), 96 + 2.048, 2 * 96 * 2.048, 32000.0),
    (20, 9000, (32, 8192), 32 + 9.0, 2 * 32 * 9.0, 32000.0),  # rounded up in batch (20 -> 32), past in context
    (24, 30000, (32, 8192), 32 + 30.0, 2 * 32 * 30.0, 32000.0),
])
def test_estimate_extrapolates_past_the_largest_bucket_when_rounding_up(batch: int, context: int,
                                                                        bucket: tuple[int, int], alone_p50: float,
                                                                        beside_p95: float, prefill: float) -> None:
    got = estimate(_grid_profile(), "split16", batch, context)
    e = got.entry
    assert (e.batch, e.context, got.beyond) == (*bucket, batch > 32 or context > 8192)
    assert e.decode_ms_alone_p50 == pytest.approx(alone_p50)
    assert e.decode_ms_beside_prefill_p95 == pytest.approx(beside_p95)
    assert e.prefill_tokens_per_s == pytest.approx(prefill)


def _falling_profile() -> Profile:
    """Batch buckets [8, 16]: decode 10 ms at 8 and 4 ms at 16 (noise: a step faster at a bigger batch), prefill
    20k tokens/s at 8 and 12k at 16 beside it; one context bucket."""
    entries = [Entry("split16", 8, 1024, 10.0, 12.0, 20.0, 22.0, 20000.0),
               Entry("split16", 16, 1024, 4.0, 5.0, 6.0, 5.0, 12000.0)]
    return Profile("gpu", "model", 132, [Configuration("split16", 16, 116)], [8, 16], [1024], entries,
                   "2026-11-27T00:00:00Z", "measured")


def test_the_extrapolation_is_bounded() -> None:
    """Past the largest bucket a decode step is never shorter than there, each p95 at least its p50, and prefill's
    rate beside it falls at most to half the largest bucket's."""
    e = estimate(_falling_profile(), "split16", 64, 1024).entry
    assert (e.decode_ms_alone_p50, e.decode_ms_alone_p95) == (4.0, 5.0)  # the line falls: held at the largest's
    assert (e.decode_ms_beside_prefill_p50, e.decode_ms_beside_prefill_p95) == (6.0, 6.0)  # p95 raised to its p50
    assert e.prefill_tokens_per_s == 6000.0  # 12000 - 8000 x 6 steps, floored at half of 12000


def test_estimate_names_a_missing_corner() -> None:
    p = _grid_profile()
    holey = Profile(p.gpu, p.model, 132, p.configurations, p.batch_buckets, p.context_buckets,
                    [e for e in p.entries if (e.batch, e.context) != (32, 8192)], p.created, p.source)
    with pytest.raises(KeyError, match="split16"):
        estimate(holey, "split16", 20, 4160, interpolate=True)
