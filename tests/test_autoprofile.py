"""Auto-profile at a serve's start (partition/autoprofile.py, partition/profile_budget.py), on CPU: which profile
is read (a table), the user's cache, the budgeted measurement with a fake clock and measuring function, the
child's work with the real short measurement of the tiny preset, the child process, and the CLI flag."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

import rapidserve.partition.plan as partition_plan
from rapidserve.config import EngineConfig, ParallelConfig
from rapidserve.launch_config import LaunchConfig
from rapidserve.llm import build_engine_config
from rapidserve.loader.presets import preset_config
from rapidserve.partition import autoprofile as ap
from rapidserve.partition.profile import (
    Entry,
    Profile,
    load_profile,
    model_shape,
    profile_filename,
    save_profile,
    validate_profile,
)
from rapidserve.partition.profile_budget import (
    FIGURES,
    budgeted_profile,
    cell_order,
    fill_from_roofline,
    measure_within,
    short_spec,
)
from rapidserve.partition.roofline import Peaks
from rapidserve.partition.roofline_profile import roofline_profile
from rapidserve.partition_config import PartitionConfig
from tests.test_partition_manager import h100_profile
from tests.test_profiler import fake_gpu  # noqa: F401 - the fixture

MODEL = "preset:tiny-llama"
H200 = "NVIDIA H200"


# ---- which profile ----------------------------------------------------------------------------------------
BASE: dict[str, Any] = dict(given=None, committed_exists=False, cache="absent", auto=True, on_gpu=True, tp=1,
                            reads_profile=True)
CASES: list[tuple[str, dict[str, Any], str]] = [
    ("nothing anywhere: measure", {}, "measure"),
    ("a corrupt cache: measured again", dict(cache="corrupt"), "measure"),
    ("a valid cache", dict(cache="valid"), "cached"),
    ("committed wins over the cache", dict(committed_exists=True, cache="valid"), "committed"),
    ("committed wins over measuring", dict(committed_exists=True), "committed"),
    ("--profile wins over both", dict(given="/p.json", committed_exists=True, cache="valid"), "given"),
    ("--profile with --no-auto-profile", dict(given="/p.json", auto=False), "given"),
    ("--no-auto-profile: committed as before", dict(auto=False, committed_exists=True), "committed"),
    ("--no-auto-profile: the roofline, cache unread", dict(auto=False, cache="valid"), "roofline"),
    ("--no-auto-profile: nothing measured", dict(auto=False), "roofline"),
    ("CPU: nothing measured", dict(on_gpu=False), "roofline"),
    ("CPU with a committed profile", dict(on_gpu=False, committed_exists=True), "committed"),
    ("tensor parallel: a shard profile is `rapidserve profile`'s", dict(tp=2, cache="valid"), "roofline"),
    ("no profile read (off, static, hybrid, backend none)", dict(reads_profile=False, committed_exists=True),
     "unused"),
]


@pytest.mark.parametrize(("name", "change", "kind"), CASES, ids=[c[0] for c in CASES])
def test_choose_profile(name: str, change: dict[str, Any], kind: str) -> None:
    committed, cached = Path("/repo/profiles/x.json"), Path("/cache/x.json")
    c = ap.choose_profile(committed=committed, cached=cached, **{**BASE, **change})
    assert c.kind == kind, c
    want_path = {"given": Path("/p.json"), "committed": committed, "cached": cached, "measure": cached}.get(kind)
    assert c.path == want_path and c.why
    if change.get("cache") == "corrupt":
        assert "does not load" in c.why


@pytest.mark.parametrize(("env", "want"), [
    ({"XDG_CACHE_HOME": "/xdg", "HOME": "/home/u"}, "/xdg/rapidserve/profiles"),
    ({"XDG_CACHE_HOME": "", "HOME": "/home/u"}, "/home/u/.cache/rapidserve/profiles"),
    ({"HOME": "/home/u"}, "/home/u/.cache/rapidserve/profiles"),
])
def test_profile_cache_dir(env: dict[str, str], want: str) -> None:
    assert ap.profile_cache_dir(env) == Path(want)


def cpu_profile(gpu: str = "cpu", model: str = MODEL, note: str = "") -> Profile:
    p = h100_profile()
    return msgspec.structs.replace(p, gpu=gpu, model=model, note=note)


def test_cache_state(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    assert ap.cache_state(path, "cpu", MODEL) == ("absent", "")
    save_profile(cpu_profile(), path)
    assert ap.cache_state(path, "cpu", MODEL) == ("valid", "")
    state, why = ap.cache_state(path, H200, MODEL)
    assert state == "corrupt" and "gpu: profile is for 'cpu'" in why
    state, why = ap.cache_state(path, "cpu", MODEL, tp=2)
    assert state == "corrupt" and "tensor_parallel_size" in why
    path.write_text('{"gpu": "cpu", "entries": [')
    state, why = ap.cache_state(path, "cpu", MODEL)
    assert state == "corrupt" and "invalid JSON" in why


# ---- the budgeted measurement -------------------------------------------------------------------------------
@pytest.mark.parametrize(("seqs", "max_len", "budget", "batches", "contexts", "tokens"), [
    (256, 40960, 8192, (1, 8, 32, 128), (512, 2048, 8192), 4096),
    (1024, 40960, 8192, (1, 8, 32, 128, 512), (512, 2048, 8192), 4096),  # vLLM's default on an H200: to 512
    (512, 8192, 8192, (1, 8, 32, 128, 512), (512, 2048, 8192), 4096),
    (16, 40960, 8192, (1, 8), (512, 2048, 8192), 4096),
    (256, 1000, 8192, (1, 8, 32, 128), (512, 2048), 4096),  # 600..1000 read at the 2048 bucket
    (256, 2048, 8192, (1, 8, 32, 128), (512, 2048), 4096),
    (256, 300, 2048, (1, 8, 32, 128), (512,), 2048),
])
def test_short_spec(seqs: int, max_len: int, budget: int, batches: tuple[int, ...], contexts: tuple[int, ...],
                    tokens: int) -> None:
    s = short_spec(seqs, max_len, budget)
    assert (s.batch_buckets, s.context_buckets, s.prefill_tokens) == (batches, contexts, tokens)
    assert s.min_prefill_forwards == 2 and s.decode_reps < 20


CONFIGS = ["overallocated", "split16", "split32"]


def test_cell_order_covers_each_cell_once_round_robin_from_the_middle() -> None:
    batches, contexts = [1, 8, 32, 128], [512, 2048, 8192]
    order = cell_order(CONFIGS, batches, contexts)
    assert sorted(order) == sorted((c, b, x) for c in CONFIGS for b in batches for x in contexts)
    assert order[:3] == [(c, 32, 2048) for c in CONFIGS]  # every configuration's middle cell first
    for k in range(0, len(order), 3):  # then round-robin: each configuration once per round
        assert [c for c, _, _ in order[k:k + 3]] == CONFIGS
    corners = {(1, 512), (1, 8192), (128, 512), (128, 8192)}
    assert {(b, x) for _, b, x in order[3:15]} == corners  # the grid's corners next (farthest from the middle)


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def fake_entry(cell: tuple[str, int, int], scale: float = 1.0) -> Entry:
    _, b, x = cell
    base = scale * (1 + b / 10 + x / 1000)
    return Entry(cell[0], b, x, base, 1.1 * base, 2 * base, 2.5 * base, 1e4 / scale)


@pytest.mark.parametrize(("cost", "budget", "configs"), [
    ({"overallocated": 1.0, "split16": 1.0, "split32": 1.0}, 20.0, CONFIGS),  # equal: never past the deadline
    ({"overallocated": 1.0, "split16": 3.0, "split32": 2.0}, 20.0, CONFIGS),
    ({"overallocated": 0.5, "split16": 4.0, "split32": 1.0}, 7.0, CONFIGS),
    # split16's first cell passes the deadline: nothing after it
    ({"overallocated": 0.5, "split16": 4.0, "split32": 1.0}, 3.0, ["overallocated", "split16"]),
    ({"overallocated": 1.0, "split16": 1.0, "split32": 1.0}, 0.0, []),  # no time at all: nothing
])
def test_measure_within_stops_within_the_budget(cost: dict[str, float], budget: float, configs: list[str]) -> None:
    clock = FakeClock()
    deadline = clock.t + budget
    seen: list[tuple[tuple[str, int, int], bool]] = []
    order = cell_order(CONFIGS, [1, 8, 32, 128], [512, 2048, 8192])

    def measure(cell: tuple[str, int, int]) -> Entry:
        clock.t += cost[cell[0]]  # the fake measurement takes its configuration's time
        return fake_entry(cell)

    got = measure_within(order, measure, clock, deadline, on_cell=lambda c, m: seen.append((c, m)))
    assert [c for c, _ in seen] == order and {c for c, m in seen if m} == set(got)
    assert all(got[c] == fake_entry(c) for c in got)
    over = clock.t - deadline
    if budget == 0:
        assert not got and clock.t == deadline
    elif len(set(cost.values())) == 1:
        assert over <= 1e-9 and len(got) == int(budget / cost["overallocated"])
    else:  # only a configuration's first cell can pass the deadline, by at most what it takes
        assert over <= max(cost.values())
    assert {c for c, _, _ in got} == set(configs)  # each measured once at least while time was left
    assert len(got) < len(order)  # the budget cut it short: the rest is filled


def tiny_roofline(configs: list[Any], batches: list[int], contexts: list[int]) -> Profile:
    peaks = Peaks(matmul_flops=794e12, hbm_bw=2.98e12, num_compute_units=132)
    return roofline_profile(preset_config("tiny-llama"), H200, MODEL, peaks, configs, batches, contexts, 64)


def test_fill_from_roofline_scales_each_configuration_by_what_it_measured() -> None:
    full = h100_profile()
    configs = full.configurations
    roof = tiny_roofline(configs, [1, 8, 32], [512, 2048])
    est = {(e.config, e.batch, e.context): e for e in roof.entries}
    scale = {configs[1].name: 2.0, configs[2].name: 8.0}  # two configurations measured, the others not

    def measured_as(cell: tuple[str, int, int], s: float) -> Entry:
        e = est[cell]
        return Entry(e.config, e.batch, e.context, *(getattr(e, f) * s for f in FIGURES))

    measured = {cell: measured_as(cell, scale[cell[0]]) for cell in est if cell[0] in scale and cell[1] == 8}
    entries = fill_from_roofline(measured, roof)
    assert [(e.config, e.batch, e.context) for e in entries] == list(est)
    pooled = math.sqrt(2.0 * 8.0)  # the geometric mean over every measured cell (as many of each)
    for e in entries:
        cell = (e.config, e.batch, e.context)
        if cell in measured:
            assert e == measured[cell]
            continue
        s = scale.get(e.config, pooled)
        for f in FIGURES:
            assert getattr(e, f) == pytest.approx(getattr(est[cell], f) * s, rel=1e-9), (cell, f)
    prof = budgeted_profile(measured, roof, "2026-12-01T00:00:00+00:00")
    validate_profile(prof)
    n, total = len(measured), len(est)
    assert prof.source == "measured"
    assert prof.note == (f"auto-profile measured at start: {n} of {total} cells measured, the other {total - n} "
                         "from the roofline scaled by them")
    with pytest.raises(ValueError, match="no cell was measured"):
        fill_from_roofline({}, roof)


def test_fill_keeps_p95_at_or_above_p50() -> None:
    """An estimate whose p95/p50 is smaller than the measured cell's estimate's: scaled by the measured p50's
    larger ratio, its p50 would pass its p95, which is raised to it."""
    base = tiny_roofline(h100_profile().configurations[:1], [1, 8], [512])
    name = base.configurations[0].name
    roof = msgspec.structs.replace(base, entries=[Entry(name, 1, 512, 1.0, 2.0, 1.0, 2.0, 100.0),
                                                  Entry(name, 8, 512, 1.0, 1.2, 1.0, 1.2, 100.0)])
    measured = {(name, 1, 512): Entry(name, 1, 512, 1.9, 2.0, 1.9, 2.0, 100.0)}  # ratios: p50 1.9, p95 1.0
    prof = budgeted_profile(measured, roof, "now")
    validate_profile(prof)
    filled = prof.entries[1]
    assert filled.decode_ms_alone_p50 == pytest.approx(1.9) and filled.decode_ms_alone_p95 == filled.decode_ms_alone_p50
    assert filled.decode_ms_beside_prefill_p95 == filled.decode_ms_beside_prefill_p50


def test_a_budgeted_run_with_a_fake_measurement_makes_a_valid_profile() -> None:
    """measure_within over cell_order with a fake clock, then budgeted_profile: every cell present, the measured
    ones as measured, within the budget."""
    configs = h100_profile().configurations
    batches, contexts = [1, 8, 32, 128], [512, 2048, 8192]
    roof = tiny_roofline(configs, batches, contexts)
    est = {(e.config, e.batch, e.context): e for e in roof.entries}
    clock = FakeClock()
    deadline = clock.t + 30

    def measure(cell: tuple[str, int, int]) -> Entry:
        clock.t += 1.5
        e = est[cell]
        return Entry(e.config, e.batch, e.context, *(getattr(e, f) * 3 for f in FIGURES))

    measured = measure_within(cell_order([c.name for c in configs], batches, contexts), measure, clock, deadline)
    assert clock.t <= deadline and 0 < len(measured) < len(est)
    prof = budgeted_profile(measured, roof, "now")
    validate_profile(prof)
    assert len(prof.entries) == len(est)
    assert {c.name for c in configs} == {c for c, _, _ in measured}  # every configuration measured somewhere


# ---- the child's work -------------------------------------------------------------------------------------
def small_cfg(**partition: Any) -> EngineConfig:
    cfg, _ = build_engine_config(MODEL, device="cpu", dtype="float32", max_model_len=512, max_num_seqs=8,
                                 max_num_batched_tokens=64, num_kv_blocks=64)
    return dataclasses.replace(cfg, partition=PartitionConfig(**partition))


def test_measure_short_on_cpu_makes_a_valid_profile() -> None:
    """The real short measurement (runner, backend, peaks, roofline, cells) of the tiny preset: one configuration
    on a CPU, batches 1 and 8, context 512, forwards of 64 tokens."""
    t0 = time.monotonic()
    prof, why = ap.measure_short(small_cfg(), "cpu", time.monotonic() + 120, show_progress=False)
    assert prof is not None, why
    validate_profile(prof)
    assert (prof.gpu, prof.model, prof.source) == ("cpu", MODEL, "measured")
    assert prof.batch_buckets == [1, 8] and prof.context_buckets == [512] and prof.prefill_tokens == 64
    assert prof.note == "auto-profile measured at start: 2 of 2 cells measured"
    assert time.monotonic() - t0 < 120


def test_measure_short_with_no_time_left_measures_nothing() -> None:
    prof, why = ap.measure_short(small_cfg(), "cpu", time.monotonic() - 1, show_progress=False)
    assert prof is None and "took the whole budget" in why


def fake_measure(calls: list[str]) -> Any:
    def measure(cfg: EngineConfig, gpu: str, deadline: float, **kw: Any) -> tuple[Profile, str]:
        calls.append(gpu)
        return cpu_profile(gpu, MODEL, note="auto-profile measured at start: 3 of 50 cells measured"), ""
    return measure


def no_measure(*a: Any, **k: Any) -> Any:
    raise AssertionError("nothing should be measured")


def test_profile_for_start_on_cpu_measures_nothing(tmp_path: Path) -> None:
    res = ap.profile_for_start(small_cfg(), tmp_path, time.monotonic() + 60, measure=no_measure)
    assert res.kind in ("unused", "roofline") and res.path is None


def test_profile_for_start_measures_caches_and_finds_the_cache(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAPIDSERVE_PROFILES_DIR", str(tmp_path / "committed"))
    cache = tmp_path / "cache"
    cfg = small_cfg()
    calls: list[str] = []
    first = ap.profile_for_start(cfg, cache, time.monotonic() + 60, on_gpu=True, measure=fake_measure(calls))
    path = cache / ap.cache_filename("cpu", MODEL, 1, None, model_shape(cfg.model_config))
    assert first.kind == "measured" and first.path == str(path) and calls == ["cpu"] and not first.warning
    assert "measured a short profile of preset:tiny-llama on cpu" in first.message and "3 of 50" in first.message
    assert load_profile(path, expect_gpu="cpu", expect_model=MODEL).note.startswith("auto-profile")
    again = ap.profile_for_start(cfg, cache, time.monotonic() + 60, on_gpu=True, measure=no_measure)
    assert again.kind == "cached" and again.path == str(path)
    path.write_text("{ not json")  # corrupt: ignored with a warning, measured again, replaced
    third = ap.profile_for_start(cfg, cache, time.monotonic() + 60, on_gpu=True, measure=fake_measure(calls))
    assert third.kind == "measured" and "does not load" in third.warning and "invalid JSON" in third.warning
    assert load_profile(path, expect_gpu="cpu", expect_model=MODEL).gpu == "cpu"
    duet = ap.profile_for_start(small_cfg(policy="duet"), tmp_path / "c2", time.monotonic() + 60, on_gpu=True,
                                measure=fake_measure(calls))
    assert duet.kind == "measured" and (tmp_path / "c2" / path.name).exists()
    save_profile(cpu_profile(), tmp_path / "committed" / profile_filename("cpu", MODEL))  # committed wins
    fourth = ap.profile_for_start(cfg, cache, time.monotonic() + 60, on_gpu=True, measure=no_measure)
    assert fourth.kind == "committed"


def test_profile_for_start_with_no_time_falls_back_to_the_roofline(tmp_path: Path) -> None:
    res = ap.profile_for_start(small_cfg(), tmp_path, time.monotonic() - 1, on_gpu=True)
    assert res.kind == "roofline" and res.path is None and "took the whole budget" in res.message
    assert not any(tmp_path.iterdir())  # nothing cached


def test_the_engine_reads_a_cached_profile_with_its_note(tmp_path: Path, fake_gpu: Any) -> None:  # noqa: F811
    prof = msgspec.structs.replace(h100_profile(), model="llama-3-8b", note="auto-profile measured at start: 7 of "
                                   "60 cells measured, the other 53 from the roofline scaled by them")
    path = tmp_path / "cached.json"
    save_profile(prof, path)
    cfg = EngineConfig("/models/llama-3-8b", preset_config("tiny-llama"),
                       partition=PartitionConfig(backend="cuda-green", profile=str(path)))
    plan = partition_plan.resolve_plan(cfg, fake_gpu)
    assert plan.profile == prof and f"measured profile {path}" in plan.source and "7 of 60 cells" in plan.source


# ---- the child process --------------------------------------------------------------------------------------
def _dies(cfg: EngineConfig, cache_dir: str, deadline: float, conn: Any) -> None:
    os._exit(3)


def _hangs(cfg: EngineConfig, cache_dir: str, deadline: float, conn: Any) -> None:
    time.sleep(60)


def test_run_child_on_cpu_answers_and_exits(tmp_path: Path) -> None:
    res = ap.run_child(small_cfg(), tmp_path, budget_s=60, hang_s=60)
    assert res.kind == "unused" and res.path is None  # a CPU: no partition backend, nothing measured
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(("target", "budget", "needle"), [(_dies, 60.0, "died (exit code 3)"),
                                                          (_hangs, 1.0, "gave no answer in 2 s and was killed")])
def test_run_child_reports_a_dead_or_hung_child(target: Any, budget: float, needle: str, tmp_path: Path) -> None:
    """Told at once of a child that died (not after the budget), and a hung one killed at budget + hang."""
    t0 = time.monotonic()
    res = ap.run_child(small_cfg(), tmp_path, budget_s=budget, hang_s=1.0, target=target)
    assert res.kind == "failed" and needle in res.message and "roofline" in res.message
    assert time.monotonic() - t0 < 45


# ---- with_auto_profile (the CLI's step) ----------------------------------------------------------------------
@pytest.fixture
def pretend_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    import rapidserve.runner

    monkeypatch.setattr(rapidserve.runner, "resolve_device", lambda name: torch.device("cuda"))


def run_returning(res: ap.ChildResult, calls: list[EngineConfig]) -> Any:
    def run(cfg: EngineConfig, cache_dir: Path) -> ap.ChildResult:
        calls.append(cfg)
        return res
    return run


@pytest.mark.parametrize(("res", "profile", "level"), [
    (ap.ChildResult("measured", "/c/x.json", "auto-profile: measured"), "/c/x.json", logging.INFO),
    (ap.ChildResult("cached", "/c/x.json", "auto-profile: cached"), "/c/x.json", logging.INFO),
    (ap.ChildResult("measured", "/c/x.json", "auto-profile: measured", "auto-profile: the cached one does not load"),
     "/c/x.json", logging.WARNING),
    (ap.ChildResult("committed", "/repo/x.json", "auto-profile: committed"), None, logging.INFO),
    (ap.ChildResult("roofline", None, "auto-profile: no time"), None, logging.INFO),
    (ap.ChildResult("failed", None, "auto-profile: measuring failed"), None, logging.WARNING),
])
def test_with_auto_profile_gives_the_engine_what_the_child_found(
        res: ap.ChildResult, profile: str | None, level: int, pretend_gpu: None,
        caplog: pytest.LogCaptureFixture) -> None:
    cfg = small_cfg()
    calls: list[EngineConfig] = []
    with caplog.at_level(logging.INFO, logger="rapidserve.partition"):
        out = ap.with_auto_profile(cfg, auto=True, cache_dir=Path("/c"), run=run_returning(res, calls))
    assert calls == [cfg] and out.partition.profile == profile
    assert out == (cfg if profile is None else dataclasses.replace(cfg, partition=dataclasses.replace(
        cfg.partition, profile=profile)))
    msgs = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "rapidserve.partition"]
    assert (logging.WARNING if res.kind == "failed" else logging.INFO, res.message) in msgs
    assert max(lv for lv, _ in msgs) == level


@pytest.mark.parametrize("change", [
    dict(auto=False), dict(partition=dict(profile="/given.json")), dict(partition=dict(policy="duet", slo_itl_ms=None)),
    dict(partition=dict(mode="off")), dict(partition=dict(backend="none")), dict(tp=2), dict(mode="hybrid"),
    dict(cpu=True),
])
def test_with_auto_profile_starts_no_child_where_it_does_not_apply(change: dict[str, Any], pretend_gpu: None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = small_cfg(**change.get("partition", {}))
    if "tp" in change:
        cfg = dataclasses.replace(cfg, parallel=ParallelConfig(tensor_parallel_size=change["tp"]))
    if "mode" in change:
        cfg = dataclasses.replace(cfg, launch=LaunchConfig(mode=change["mode"]))
    if change.get("cpu"):
        import torch

        import rapidserve.runner

        monkeypatch.setattr(rapidserve.runner, "resolve_device", lambda name: torch.device("cpu"))
    out = ap.with_auto_profile(cfg, auto=change.get("auto", True), cache_dir=Path("/c"), run=no_measure)
    assert out == cfg


# ---- the CLI ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("flags", "auto"), [([], True), (["--auto-profile"], True), (["--no-auto-profile"], False)])
def test_serve_passes_the_flag_and_the_cache_dir(flags: list[str], auto: bool, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from unittest import mock

    from rapidserve.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    seen: dict[str, Any] = {}

    def fake(cfg: EngineConfig, *, auto: bool, cache_dir: Path) -> EngineConfig:
        seen.update(auto=auto, cache_dir=cache_dir)
        return dataclasses.replace(cfg, partition=dataclasses.replace(cfg.partition, profile=None))

    with mock.patch("rapidserve.partition.autoprofile.with_auto_profile", side_effect=fake), \
            mock.patch("rapidserve.server.serve.run", return_value=0) as run_:
        assert main(["serve", "--model", MODEL, "--device", "cpu", *flags]) == 0
        assert seen == {}  # not before the port is bound: `build` auto-profiles, on `run`'s thread
        _, build, _ = run_.call_args.args
        cfg, _ = build()
    assert seen == {"auto": auto, "cache_dir": tmp_path / "rapidserve" / "profiles"}
    assert cfg.partition.profile is None


def test_serve_on_cpu_starts_nothing_and_keeps_the_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from unittest import mock

    from rapidserve.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(ap, "run_child", no_measure)
    with mock.patch("rapidserve.server.serve.run", return_value=0) as run_:
        assert main(["serve", "--model", MODEL, "--device", "cpu"]) == 0
    _, build, _ = run_.call_args.args  # run(scfg, build, model): built (and auto-profiled) once the port is bound
    assert build()[0].partition.profile is None and not any(tmp_path.iterdir())


def test_profile_command_has_no_auto_profile_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from rapidserve.cli import main

    with pytest.raises(SystemExit) as e:
        main(["profile", "--no-auto-profile"])
    assert e.value.code == 2 and "--no-auto-profile" in capsys.readouterr().err


def test_a_cached_profile_of_another_model_under_the_same_name_is_measured_again(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Profiles are found by the model's name alone (a folder's last component), so `/a/model` (dense) and `/b/model`
    (mixture of experts) share a cache file: the MoE model must not read the dense model's timings as its own. The
    profile records the model's shape, and one measured for another shape is measured again, saying why."""
    from rapidserve.loader.presets import load_preset, save_as_hf_folder

    monkeypatch.setenv("RAPIDSERVE_PROFILES_DIR", str(tmp_path / "committed"))
    cache = tmp_path / "cache"
    cfgs = {}
    for where, preset in (("a", "tiny-llama"), ("b", "tiny-mixtral")):
        save_as_hf_folder(load_preset(preset), tmp_path / where / "model")
        cfg, _ = build_engine_config(str(tmp_path / where / "model"), device="cpu", dtype="float32",
                                     max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=64)
        cfgs[where] = cfg
    dense = ap.profile_for_start(cfgs["a"], cache, time.monotonic() + 120, on_gpu=True)  # the real short measurement
    shapes = {w: model_shape(c.model_config) for w, c in cfgs.items()}
    assert dense.kind == "measured" and dense.path == str(cache / ap.cache_filename("cpu", "/a/model", 1, None,
                                                                                   shapes["a"]))
    calls: list[str] = []
    moe = ap.profile_for_start(cfgs["b"], cache, time.monotonic() + 60, on_gpu=True, measure=fake_measure(calls))
    assert moe.kind == "measured" and calls == ["cpu"] and moe.path != dense.path, moe.message  # a cache of its own
    assert Path(dense.path).exists() and not moe.warning  # the dense model's cache is kept, not measured over
    again = ap.profile_for_start(cfgs["a"], cache, time.monotonic() + 60, on_gpu=True, measure=no_measure)
    assert again.kind == "cached" and again.path == dense.path  # and read at its next start
    # a file of the other shape under this model's cache name (a digest collision, or a copied file) is still refused
    Path(moe.path).write_bytes(Path(dense.path).read_bytes())
    calls.clear()
    redo = ap.profile_for_start(cfgs["b"], cache, time.monotonic() + 60, on_gpu=True, measure=fake_measure(calls))
    assert redo.kind == "measured" and calls == ["cpu"], redo.message
    assert "does not load" in redo.warning and "model_shape" in redo.warning and "mixtral" in redo.warning
