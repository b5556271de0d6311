"""bench/make_peer_model.py --fp8 (VLLM_FP8=checkpoint in bench/vs_vllm.sh): vLLM's model folder declares an
FP8_DYNAMIC checkpoint, which our loader reads as the scheme `--quantization fp8` applies (per-channel weights,
dynamic per-token activations, online over random weights), and vLLM's command then leaves `--quantization` out
(vLLM takes the scheme from the folder and refuses a flag beside it)."""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import compare_systems  # noqa: E402
import make_peer_model as mpm  # noqa: E402


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp("peer") / "peermodel-tiny-llama-fp8")
    mpm.main("tiny-llama", out, fp8=True)
    return out


def test_the_folder_declares_fp8_dynamic_and_our_loader_reads_our_scheme(fp8_folder: str) -> None:
    from rapidserve.loader.presets import load_dummy

    with open(os.path.join(fp8_folder, "config.json")) as f:
        assert json.load(f)["quantization_config"] == mpm.FP8_DYNAMIC
    assert mpm.folder_quantization(fp8_folder) == "fp8-dynamic"
    q = load_dummy(fp8_folder).quantization
    assert q is not None and (q.method, q.weights, q.block, q.activations, q.online) == (
        "fp8", "channel", None, "token", True)


def test_a_bf16_folder_declares_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    mpm.main("tiny-llama", str(tmp_path / "bf16"))
    assert mpm.folder_quantization(str(tmp_path / "bf16")) is None
    assert mpm.folder_quantization(str(tmp_path / "missing")) is None


@pytest.mark.parametrize("flags,want", [
    (["--max-model-len", "8192", "--quantization", "fp8", "--max-num-seqs", "64"],
     ["--max-model-len", "8192", "--max-num-seqs", "64"]),
    (["--quantization=fp8", "--kv-cache-dtype", "fp8"], ["--kv-cache-dtype", "fp8"]),
    (["--max-model-len", "8192"], ["--max-model-len", "8192"]),
])
def test_vllm_gets_no_quantization_flag_beside_the_folders_scheme(fp8_folder: str, flags: list[str],
                                                                   want: list[str]) -> None:
    assert mpm.vllm_quantization_flags(flags, fp8_folder) == want
    cmd = compare_systems.vllm_command(fp8_folder, 8100, " ".join(flags), "", "serve_vllm.sh")
    assert cmd == ["bash", "serve_vllm.sh", fp8_folder, "8100", *want]


def test_another_method_beside_the_folders_scheme_is_refused_by_name(fp8_folder: str) -> None:
    with pytest.raises(ValueError, match="--quantization awq: vLLM's model folder .* declares fp8-dynamic"):
        mpm.vllm_quantization_flags(["--quantization", "awq"], fp8_folder)


def test_a_folder_without_a_scheme_keeps_the_flag(tmp_path) -> None:  # type: ignore[no-untyped-def]
    flags = ["--quantization", "fp8"]
    assert mpm.vllm_quantization_flags(flags, str(tmp_path)) == flags  # vLLM quantizes its bf16 weights at load


def test_a_moe_preset_is_refused_in_fp8(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit, match="no fp8 mixture-of-experts"):
        mpm.main("tiny-mixtral", str(tmp_path / "moe"), fp8=True)
    assert not (tmp_path / "moe").exists()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="the stand-in recipe runs bash")
def test_vs_vllm_writes_the_fp8_folder_and_serves_vllm_from_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """VLLM_FP8=checkpoint: the folder <PEER_MODEL>-<preset>-fp8 written with --fp8, vLLM's command from it without
    --quantization, ours with SERVE_ARGS' --quantization fp8 (compare.py --dry-run prints both); a bad value, or the
    knob without ours in fp8 (bf16 against fp8): exit 2 naming it."""
    import subprocess

    from tests.test_bench_frontier_tp import _stand_in

    env, run_dir, out = _stand_in(tmp_path, GROUP="vllm-default+duet", SYSTEMS="", VLLM_FP8="checkpoint",
                                  SERVE_ARGS="--device cpu --quantization fp8")
    r = subprocess.run(["bash", "bench/vs_vllm.sh", "--vllm-run-dir", str(run_dir), "--dry-run"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    folder = tmp_path / "pm-tiny-llama-fp8"
    assert mpm.folder_quantization(str(folder)) == "fp8-dynamic"
    assert f"writing the tiny-llama-shaped model folder {folder} (FP8_DYNAMIC checkpoint)" in (
        out / "vs_vllm_setup.log").read_text()
    lines = r.stdout.splitlines()
    vllm_line = next(x for x in lines if x.startswith("vllm: "))
    assert f"serve_vllm.sh {folder} " in vllm_line and "--quantization" not in vllm_line
    ours = next(x for x in lines if x.startswith("duet: "))
    assert "--model preset:tiny-llama" in ours and "--quantization fp8" in ours
    bad = subprocess.run(["bash", "bench/vs_vllm.sh", "--dry-run"], cwd=ROOT, env={**env, "VLLM_FP8": "online"},
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "VLLM_FP8=online: give checkpoint" in bad.stderr
    alone = subprocess.run(["bash", "bench/vs_vllm.sh", "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                           timeout=60, env={**env, "SERVE_ARGS": "--device cpu"})  # ours would stay bf16
    assert alone.returncode == 2 and 'give ours the same scheme with SERVE_ARGS="--quantization fp8"' in alone.stderr


def test_vs_vllm_passes_no_rates_to_a_timestamps_trace_sweep(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """MODE=sweep with TRACE_WORKLOADS (a trace at its own timestamps) and no RATES: compare.py gets no --rates (it
    refuses them there: the trace reads none); RATES=inf given: refused by name (before: the trace ran at its
    timestamps, the rate silently ignored)."""
    import subprocess

    from tests.test_bench_frontier_tp import _stand_in

    trace = os.path.join(ROOT, "tests", "data", "mooncake_conversation_excerpt.jsonl.gz")
    env, run_dir, _ = _stand_in(tmp_path, MODE="sweep", SYSTEMS="duet@none", VLLM_SYSTEMS="",
                                TRACE_WORKLOADS=f"--workload trace --trace {trace} --num-prompts 4")
    ok = subprocess.run(["bash", "bench/vs_vllm.sh", "--vllm-run-dir", str(run_dir), "--dry-run"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=240)
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-2000:]
    given = subprocess.run(["bash", "bench/vs_vllm.sh", "--vllm-run-dir", str(run_dir), "--dry-run"], cwd=ROOT,
                           env={**env, "RATES": "inf"}, capture_output=True, text=True, timeout=240)
    assert given.returncode != 0
    assert "--rates set Poisson rates, which a trace replayed at its own timestamps does not read" in (
        given.stdout + given.stderr)
