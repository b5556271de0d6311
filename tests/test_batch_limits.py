"""batch_limits: vLLM's default max_num_seqs / LLM token budget by device, the seats, the decode graph buckets a
worker captures, and the builder's plumbing (the device query monkeypatched: no GPU in tests)."""

from __future__ import annotations

import logging

import pytest

from rapidserve import config_builder
from rapidserve.batch_limits import (
    CPU,
    GIB,
    Device,
    decode_graph_buckets,
    default_max_num_batched_tokens,
    default_max_num_seqs,
    seats,
)
from rapidserve.config import RunnerConfig
from rapidserve.config_builder import build_engine_config

H200 = Device("cuda", 141 * GIB, "NVIDIA H200")
H100 = Device("cuda", 80 * GIB, "NVIDIA H100 80GB HBM3")
A100 = Device("cuda", 80 * GIB, "NVIDIA A100-SXM4-80GB")
L4 = Device("cuda", 24 * GIB, "NVIDIA L4")
MI300X = Device("cuda", 192 * GIB, "AMD Instinct MI300X")


@pytest.mark.parametrize(("device", "seqs", "offline_tokens"), [
    (H200, 1024, 16384), (H100, 1024, 16384), (A100, 256, 8192), (L4, 256, 8192), (MI300X, 1024, 16384),
    (CPU, 256, 8192), (Device("cuda", 70 * GIB, "X"), 1024, 16384), (Device("cuda", 70 * GIB - 1, "X"), 256, 8192),
])
def test_vllm_defaults_by_device(device: Device, seqs: int, offline_tokens: int) -> None:
    assert default_max_num_seqs(device) == seqs
    assert default_max_num_batched_tokens(device, "offline") == offline_tokens
    for run in ("rapid", "hybrid", "disagg", "profile"):  # the server keeps 8192 on every device
        assert default_max_num_batched_tokens(device, run) == 8192


def test_seats_with_the_new_buckets() -> None:
    sizes = RunnerConfig().graph_batch_sizes
    assert sizes[sizes.index(256):] == (256, 288, 320, 352, 384, 416, 448, 480, 512)
    assert seats(1024, sizes, 8192) == 512
    assert seats(300, sizes, 8192) == 300
    assert seats(256, sizes, 8192) == 256
    assert seats(1024, sizes, 400) == 400


@pytest.mark.parametrize(("n", "top"), [(256, 256), (512, 512), (300, 320), (100, 128), (1, 1), (4096, 512)])
def test_capture_stops_at_the_seats(n: int, top: int) -> None:
    sizes = RunnerConfig().graph_batch_sizes
    got = decode_graph_buckets(sizes, n)
    assert max(got) == top and got == tuple(b for b in sizes if b <= top)


def _built(monkeypatch: pytest.MonkeyPatch, device: Device, **kw: object) -> tuple[int, int]:
    asked: list[object] = []
    monkeypatch.setattr(config_builder, "device_facts", lambda dev: asked.append(dev) or device)
    cfg, _ = build_engine_config("preset:tiny-llama", device="cpu", **kw)  # type: ignore[arg-type]
    return cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens


def test_builder_resolves_by_device(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="rapidserve.config"):
        assert _built(monkeypatch, H200) == (1024, 8192)
    assert "max_num_seqs 1024: vLLM's default on this GPU (NVIDIA H200, 141 GiB: >= 70 GiB" in caplog.text
    assert "at most 512 run at once" in caplog.text
    assert _built(monkeypatch, H200, run="offline") == (1024, 16384)
    assert _built(monkeypatch, A100) == (256, 8192)
    assert _built(monkeypatch, CPU, run="offline") == (256, 8192)


def test_explicit_values_are_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _built(monkeypatch, H200, max_num_seqs=64) == (64, 8192)
    assert _built(monkeypatch, H200, max_num_seqs=256, run="offline") == (256, 16384)
    assert _built(monkeypatch, H200, max_num_seqs=300, max_num_batched_tokens=4096) == (300, 4096)


def test_cpu_default_is_256() -> None:
    cfg, _ = build_engine_config("preset:tiny-llama", device="cpu")
    assert (cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens) == (256, 8192)


@pytest.mark.parametrize("past", [1, 88, 512])
def test_policy_costs_past_the_profiled_batches(past: int) -> None:
    """A decode batch `past` seats beyond the committed H200 profile's largest batch bucket (whatever that is: the
    profile is re-measured with more buckets from time to time) is costed, and the manager's decision says it read
    past the profile."""
    from pathlib import Path

    from rapidserve.partition.manager import ManagerState, decide
    from rapidserve.partition.profile import load_profile
    from rapidserve.partition.step_costs import ProfileCosts

    path = Path(__file__).resolve().parent.parent / "profiles" / "nvidia-h200__preset-qwen3-8b.json"
    profile = load_profile(path)
    batch = max(profile.batch_buckets) + past
    costs = ProfileCosts(profile)
    assert costs.fused_ms([2048] * batch, [(512, 0)]) > 0
    assert costs.decode_alone_ms(costs.whole_config, batch, 2048) > 0
    d, _ = decide(ManagerState(costs.whole_config, 0), decode_batch=batch, decode_context=2048, prefill_pending=True,
                  slo_itl_ms=50.0, profile=profile)
    assert d.beyond_profile and "beyond profiled buckets" in d.reason
