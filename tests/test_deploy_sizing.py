"""deploy/size_from_profile.py: --max-num-seqs, configuration and replica counts from a profile."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from rapidserve.partition.profile import Configuration, Entry, Profile, save_profile

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "deploy" / "size_from_profile.py"

# decode step ms beside prefill (p95) at context 1024; context 8192 takes 1.5x as long
STEP_MS = {"overallocated": {8: 20.0, 32: 30.0, 128: 60.0}, "d64": {8: 15.0, 32: 25.0, 128: 50.0}}
PREFILL = {"overallocated": 10000.0, "d64": 8000.0}


def load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("size_from_profile", TOOL)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is created
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture()
def profile_path(tmp_path: Path) -> Path:
    entries = []
    for cfg, steps in STEP_MS.items():
        for batch, ms in steps.items():
            for ctx, scale in ((1024, 1.0), (8192, 1.5)):
                p95 = ms * scale
                entries.append(Entry(cfg, batch, ctx, p95 * 0.5, p95 * 0.6, p95 * 0.8, p95, PREFILL[cfg]))
    prof = Profile(gpu="AMD Instinct MI300X", model="preset:llama-3-8b", num_compute_units=304,
                   configurations=[Configuration("overallocated", 0, 0), Configuration("d64", 64, 240)],
                   batch_buckets=[8, 32, 128], context_buckets=[1024, 8192], entries=entries,
                   created="2026-01-01T00:00:00Z", source="measured")
    path = tmp_path / "amd-instinct-mi300x__preset-llama-3-8b.json"
    save_profile(prof, path)
    return path


def rows(capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_picks_the_largest_batch_within_the_slo_and_the_config_with_most_prefill(
        profile_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tool = load_tool()
    assert tool.main([str(profile_path), "--itl-ms", "40", "--json"]) == 0
    short, long = rows(capsys)
    # context 1024: batch 128 misses 40 ms everywhere; at 32 both configs meet it, overallocated
    # leaves prefill more throughput
    assert (short["context"], short["max_num_seqs"], short["config"], short["decode_ms"]) == (
        1024, 32, "overallocated", 30.0)
    assert short["decode_tokens_per_s"] == pytest.approx(32 * 1000 / 30.0)
    assert short["prefill_tokens_per_s"] == 10000.0
    # context 8192: only the d64 partition keeps decode at 32 within 40 ms (37.5 ms)
    assert (long["context"], long["max_num_seqs"], long["config"], long["decode_ms"]) == (8192, 32, "d64", 37.5)


def test_counts_replicas_and_nodes_for_a_demand(profile_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tool = load_tool()
    argv = [str(profile_path), "--itl-ms", "40", "--context", "900", "--gpus-per-node", "8",
            "--output-tokens-per-s", "10000", "--json"]
    assert tool.main(argv) == 0
    (r,) = rows(capsys)
    assert r["context"] == 1024  # rounded up to the profiled bucket
    assert (r["replicas_needed"], r["nodes_needed"]) == (10, 2)  # 10000 / 1066.7 per replica, 8 per node


def test_an_slo_no_batch_meets_says_so(profile_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tool = load_tool()
    assert tool.main([str(profile_path), "--itl-ms", "5"]) == 1
    assert "no batch size meets 5 ms" in capsys.readouterr().out


def test_runs_from_a_checkout_and_rejects_a_bad_profile(profile_path: Path, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(TOOL), str(profile_path), "--itl-ms", "40", "--percentile", "p50"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "AMD Instinct MI300X / preset:llama-3-8b" in done.stdout and "max-num-seqs" in done.stdout
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    done = subprocess.run([sys.executable, str(TOOL), str(bad), "--itl-ms", "40"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "error: profile" in done.stderr
