"""A measured partition profile under tensor parallelism (issue 17): `rapidserve profile --shard-of-tp N`
measures one rank's shard alone on one GPU (here: the CPU), the engine at `-tp N` finds it as
`<gpu>__<model>__tpN.json` and adds the collectives from the roofline's link model
(`roofline_profile.with_collectives`); without one it keeps the roofline estimate, as before."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest

import rapidserve.partition.plan as partition_plan
from rapidserve.cli import main
from rapidserve.config import EngineConfig, ParallelConfig
from rapidserve.loader.presets import preset_config
from rapidserve.partition.backend import PartitionError
from rapidserve.partition.profile import ProfileError, load_profile, profile_filename, save_profile
from rapidserve.partition.roofline import Peaks
from rapidserve.partition.roofline_profile import with_collectives
from rapidserve.partition_config import PartitionConfig
from tests.test_partition_manager import h100_profile
from tests.test_profiler import H100_NAME, fake_gpu  # noqa: F401 (a fixture)

TINY = preset_config("tiny-llama")  # 3 layers, hidden 64, vocabulary 1280, 4 heads, 2 KV heads
PEAKS = Peaks(matmul_flops=1e12, hbm_bw=1e11, num_compute_units=132, link_bw=1e9, link_latency_s=1e-5)


def shard(tp: int) -> Any:
    return msgspec.structs.replace(h100_profile(), model="preset:tiny-llama", tensor_parallel_size=tp)


# ---- the link model added to a shard's figures ------------------------------------------------------------
def decode_link_ms(batch: int, tp: int) -> float:
    """By hand: 2 all-reduces of batch x hidden per layer and one after the embedding, one all-gather of batch x
    vocabulary (bf16; 1280 is a multiple of tp, so no padding)."""
    h, v, layers, b = TINY.hidden_size, TINY.vocab_size, TINY.num_layers, 2
    ar = 2 * (tp - 1) / tp * batch * h * b / PEAKS.link_bw + PEAKS.link_latency_s
    ag = (tp - 1) / tp * batch * v * b / PEAKS.link_bw + PEAKS.link_latency_s
    return 1e3 * ((2 * layers + 1) * ar + ag)


def prefill_link_s(tokens: int, tp: int) -> float:
    h, v, layers, b = TINY.hidden_size, TINY.vocab_size, TINY.num_layers, 2
    ar = 2 * (tp - 1) / tp * tokens * h * b / PEAKS.link_bw + PEAKS.link_latency_s
    ag = (tp - 1) / tp * 1 * v * b / PEAKS.link_bw + PEAKS.link_latency_s  # one row reaches the LM head
    return (2 * layers + 1) * ar + ag


@pytest.mark.parametrize("tp", [2, 4])
def test_with_collectives_adds_the_link_time_of_each_step(tp: int) -> None:
    before = shard(tp)
    after = with_collectives(before, TINY, PEAKS)
    assert after.tensor_parallel_size == tp and len(after.entries) == len(before.entries)
    for e0, e1 in zip(before.entries, after.entries, strict=True):
        d = decode_link_ms(e0.batch, tp)
        for f in ("decode_ms_alone_p50", "decode_ms_alone_p95", "decode_ms_beside_prefill_p50",
                  "decode_ms_beside_prefill_p95"):
            assert getattr(e1, f) == pytest.approx(getattr(e0, f) + d), f
        t = before.prefill_tokens
        assert e1.prefill_tokens_per_s == pytest.approx(t / (t / e0.prefill_tokens_per_s + prefill_link_s(t, tp)))
        assert e1.prefill_tokens_per_s < e0.prefill_tokens_per_s


def test_with_collectives_leaves_a_whole_model_profile_alone() -> None:
    whole = shard(1)
    assert with_collectives(whole, TINY, PEAKS) is whole


# ---- where the engine looks ------------------------------------------------------------------------------
@pytest.mark.parametrize("explicit,tp,present,want,why", [
    ("/p/given.json", 1, [], "/p/given.json", ""),
    ("/p/given.json", 2, [], "/p/given.json", ""),  # given: used at any size (its own size is checked on load)
    (None, 1, ["tp1"], "tp1", ""),
    (None, 1, [], None, "no profile at"),
    (None, 2, ["tp1", "tp2"], "tp2", ""),
    (None, 2, ["tp1"], None, "--shard-of-tp 2"),  # the whole model's does not stand in for a shard
    (None, 4, ["tp2"], None, "--shard-of-tp 4"),
])
def test_profile_path(tmp_path: Path, explicit: str | None, tp: int, present: list[str], want: str | None,
                      why: str) -> None:
    files = {"tp1": profile_filename(H100_NAME, "preset:tiny-llama"),
             "tp2": profile_filename(H100_NAME, "preset:tiny-llama", 2)}
    for k in present:
        (tmp_path / files[k]).write_text("{}")
    path, reason = partition_plan.profile_path(explicit, tmp_path, H100_NAME, "preset:tiny-llama", tp)
    if want is None:
        assert path is None and why in reason
    else:
        assert path == (Path(want) if want.startswith("/") else tmp_path / files[want]) and reason == ""
    assert files["tp2"].endswith("__preset-tiny-llama__tp2.json")


def tp_config(tp: int, profile: Path | None = None) -> EngineConfig:
    p = PartitionConfig(backend="cuda-green", profile=str(profile) if profile else None)
    return EngineConfig("preset:tiny-llama", TINY, partition=p, parallel=ParallelConfig(tensor_parallel_size=tp))


def test_the_engine_at_tp_uses_the_shard_profile_with_collectives(tmp_path: Path, fake_gpu: Any,  # noqa: F811
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAPIDSERVE_PROFILES_DIR", str(tmp_path))
    monkeypatch.setattr(partition_plan, "measure_peaks", lambda device, dtype=None, fp8=False: PEAKS)
    prof = msgspec.structs.replace(shard(2), gpu=H100_NAME)
    save_profile(prof, tmp_path / profile_filename(H100_NAME, "preset:tiny-llama", 2))
    plan = partition_plan.resolve_plan(tp_config(2), fake_gpu)
    assert plan.profile == with_collectives(prof, TINY, PEAKS)
    assert "a shard of tensor parallel 2" in plan.source
    assert "tensor parallel 2: the profile's figures (measured shard profile) = one rank's shard + its collectives (" \
           "8 a step" in plan.source  # 2 x 3 layers + 1 all-reduces, 1 all-gather
    assert plan.peaks == PEAKS


def test_the_engine_refuses_a_shard_profile_of_another_size(tmp_path: Path, fake_gpu: Any) -> None:  # noqa: F811
    path = tmp_path / "given.json"
    save_profile(msgspec.structs.replace(shard(4), gpu=H100_NAME), path)
    with pytest.raises(PartitionError, match="a shard of tensor parallel 4; this run uses -tp 2.*--shard-of-tp 2"):
        partition_plan.resolve_plan(tp_config(2, path), fake_gpu)


def test_load_profile_checks_the_tensor_parallel_size(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    save_profile(shard(2), path)
    assert load_profile(path, expect_tp=2).tensor_parallel_size == 2
    with pytest.raises(ProfileError, match="field `tensor_parallel_size`: the profile measures a shard of tensor "
                                           "parallel 2, this run uses tensor parallel 1"):
        load_profile(path, expect_tp=1)
    bad = tmp_path / "bad.json"
    raw, n = re.subn(rb'"tensor_parallel_size":\s*2', b'"tensor_parallel_size": 0', path.read_bytes())
    assert n == 1
    bad.write_bytes(raw)
    with pytest.raises(ProfileError, match="tensor_parallel_size.*must be >= 1"):
        load_profile(bad)


# ---- the command -------------------------------------------------------------------------------------------
def test_profile_shard_of_tp_measures_the_shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAPIDSERVE_PROFILES_DIR", str(tmp_path))
    with contextlib.redirect_stdout(io.StringIO()):
        rc = main(["profile", "--model", "preset:tiny-llama", "--device", "cpu", "--batch-buckets", "1",
                   "--context-buckets", "16", "--prefill-tokens", "16", "--decode-reps", "3", "--shard-of-tp", "2"])
    assert rc == 0
    path = tmp_path / "cpu__preset-tiny-llama__tp2.json"
    p = load_profile(path, expect_gpu="cpu", expect_model="preset:tiny-llama", expect_tp=2)
    assert len(p.entries) == 1 and p.source == "measured"
    report = path.with_suffix(".roofline.md").read_text()  # the roofline of the shard, against the shard
    assert report.strip()


def test_profile_shard_of_tp_that_does_not_divide(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--shard-of-tp 3:"):
        main(["profile", "--model", "preset:tiny-llama", "--device", "cpu", "--shard-of-tp", "3",
              "--out", str(tmp_path / "p.json")])


def test_a_shard_profile_given_at_tp1_says_what_to_do(tmp_path: Path, fake_gpu: Any) -> None:  # noqa: F811
    path = tmp_path / "given.json"
    save_profile(msgspec.structs.replace(shard(2), gpu=H100_NAME), path)
    with pytest.raises(PartitionError, match="a shard of tensor parallel 2; this run uses -tp 1: give a whole-model "
                                             "profile .* or serve with -tp 2"):
        partition_plan.resolve_plan(tp_config(1, path), fake_gpu)


def test_a_whole_model_profile_given_at_tp_is_used_and_flagged(tmp_path: Path, fake_gpu: Any) -> None:  # noqa: F811
    path = tmp_path / "given.json"
    whole = msgspec.structs.replace(shard(1), gpu=H100_NAME)
    save_profile(whole, path)
    plan = partition_plan.resolve_plan(tp_config(2, path), fake_gpu)
    assert plan.profile == whole and "a WHOLE-MODEL profile at tensor parallel 2" in plan.source
