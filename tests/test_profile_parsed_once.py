"""A `rapidserve serve --profile P` start-up parses P once: the CLI's flag check reads it (profile.read_profile) and
the parsed Profile is handed down (server.serve.start_engine -> DataParallelEngine / AsyncEngine.start -> every
start and restart of the workers, WorkerSet.start -> the decode builder -> plan.resolve_plan), where each decode
worker checks it against its GPU and model. Before, the flag check and every decode worker's plan each parsed the
file: three parses for `-dp 2`, one more at each worker restart.

CPU only: the decode worker's builder runs in this process up to its plan, on a pretend H100 (tests/test_profiler.py
`fake_gpu`), the model's loading and the streams stood in for; the workers' launch is recorded, not spawned."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import msgspec
import pytest
import torch

import rapidserve.partition.plan as partition_plan
import rapidserve.partition.profile as profile_mod
from rapidserve.cli import main
from rapidserve.config import EngineConfig
from rapidserve.engine import worker_build
from rapidserve.engine.client import AsyncEngine
from rapidserve.engine.disagg import builders_for
from rapidserve.engine.launch import role_builder
from rapidserve.partition.plan import PartitionPlan
from rapidserve.partition.profile import Profile, ProfileError, save_profile
from tests.test_partition_manager import h100_profile
from tests.test_profiler import fake_gpu, plan_config  # noqa: F401 (a fixture)
from tests.test_shard_profile import PEAKS


class Launched(Exception):
    """Raised by the stand-in WorkerSet.start: the workers' launch recorded, nothing spawned."""


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The profile files parsed from here on: profile.read_profile's JSON parse (`loads_unique`) counted."""
    seen: list[str] = []
    real = profile_mod.loads_unique

    def counting(raw: bytes, where: str) -> Any:
        seen.append(where)
        return real(raw, where)

    monkeypatch.setattr(profile_mod, "loads_unique", counting)
    return seen


def given_profile_file(tmp_path: Path) -> Path:
    path = tmp_path / "given.json"
    save_profile(msgspec.structs.replace(h100_profile(), model="preset:tiny-llama"), path)
    return path


def serve(argv: list[str]) -> tuple[EngineConfig, functools.partial[Any]]:
    """`rapidserve serve ARGV` up to the bound port: the config tree (`build`) and how the engine is started. The
    builder's check that a CPU reads no profile is skipped: the engine is on a pretend GPU below."""
    with mock.patch("rapidserve.server.serve.run", return_value=0) as run_, \
            mock.patch("rapidserve.config_builder.check_partition_device"):
        assert main(["serve", "--model", "preset:tiny-llama", "--device", "cpu", *argv]) == 0
        _, build, _ = run_.call_args.args
        ecfg, _ = build()
    return ecfg, run_.call_args.kwargs["start"]


def decode_plan(build: Any, cfg: EngineConfig, device: Any, monkeypatch: pytest.MonkeyPatch) -> PartitionPlan:
    """The decode worker's builder, as the worker runs it, up to its plan (the model and the streams stood in for)."""
    plans: list[PartitionPlan] = []

    def streams(wire: Any, dev: Any, roles: Any) -> Any:
        raise Launched("the launch recorded")

    real_resolve = partition_plan.resolve_plan
    monkeypatch.setattr(worker_build, "_share_cpu_cores", lambda cfg: None)
    monkeypatch.setattr(worker_build, "load_runner", lambda cfg, group, step_processes=1: SimpleNamespace(device=device,
                                                                                      dtype=torch.bfloat16))
    monkeypatch.setattr(worker_build, "resolve_plan", lambda *a: plans.append(real_resolve(*a)) or plans[-1])
    monkeypatch.setattr(worker_build, "open_streams", streams)
    with pytest.raises(Launched):
        build(cfg, None, None, None)
    return plans[0]


def test_a_serve_start_up_parses_the_given_profile_once(tmp_path: Path, fake_gpu: Any,  # noqa: F811
                                                        parses: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    path = given_profile_file(tmp_path)
    ecfg, start = serve(["--profile", str(path), "-dp", "2"])
    assert parses == [str(path)]  # the flag check, before any model loads
    given = start.keywords["profile"]
    assert isinstance(given, Profile) and given.model == "preset:tiny-llama"

    launches: list[tuple[EngineConfig, Profile | None]] = []

    def launch(cfg: EngineConfig, env: Any, on_message: Any = None, profile: Profile | None = None) -> Any:
        launches.append((cfg, profile))
        raise Launched("the launch recorded")

    monkeypatch.setattr("rapidserve.engine.client.WorkerSet.start", launch)
    with pytest.raises(Launched):
        asyncio.run(start(ecfg))  # start_engine -> DataParallelEngine.start -> AsyncEngine.start, per engine
    assert len(launches) == 2 and all(p is given for _, p in launches)

    async def restart(cfg: EngineConfig) -> None:  # supervision's restart after a worker's death: _start_workers
        eng = AsyncEngine(cfg)
        eng.profile, eng.loop = given, asyncio.get_running_loop()
        with pytest.raises(Launched):
            await eng._start_workers()

    asyncio.run(restart(launches[0][0]))
    assert len(launches) == 3 and launches[2][1] is given

    monkeypatch.setattr(partition_plan, "detect_kind", lambda device: "cuda-green")
    monkeypatch.setattr(partition_plan, "measure_peaks", lambda device, dtype=None, fp8=False: PEAKS)  # duet's
    for cfg, profile in launches:  # each decode worker: WorkerSet.start's builder for it, then its plan
        build = role_builder(builders_for(cfg), "decode", profile)
        plan = decode_plan(build, cfg, fake_gpu, monkeypatch)
        assert plan.profile == given and f"measured profile {path}" in plan.source
    assert parses == [str(path)]  # still the one parse; before: four (the flag check, each decode worker, the restart)


def test_without_a_profile_given_the_worker_reads_the_file_itself(tmp_path: Path, fake_gpu: Any,  # noqa: F811
                                                                  parses: list[str]) -> None:
    """A run started otherwise (`LLM`-style, bench scripts: no parsed profile handed down) still reads the file."""
    path = given_profile_file(tmp_path)
    cfg = plan_config("preset:tiny-llama", path)
    assert role_builder(builders_for(cfg), "decode", None) is worker_build.build_decode
    plan = partition_plan.resolve_plan(cfg, fake_gpu)
    assert plan.profile is not None and parses == [str(path)]


def test_the_given_profile_is_still_checked_against_the_gpu(tmp_path: Path, fake_gpu: Any,  # noqa: F811
                                                            parses: list[str]) -> None:
    path = given_profile_file(tmp_path)
    cfg = plan_config("preset:tiny-llama", path)
    other = msgspec.structs.replace(profile_mod.read_profile(path), gpu="NVIDIA A100-SXM4-80GB")
    with pytest.raises(ProfileError, match="gpu: profile is for 'NVIDIA A100-SXM4-80GB'.*Run `rapidserve profile`"):
        partition_plan.resolve_plan(cfg, fake_gpu, None, other)
    assert parses == [str(path)]  # the read above, none in the plan


def test_a_parsed_profile_needs_the_file_it_came_from(fake_gpu: Any) -> None:  # noqa: F811
    cfg = plan_config("preset:tiny-llama")
    with pytest.raises(ValueError, match="names no profile file"):
        partition_plan.resolve_plan(cfg, fake_gpu, None, h100_profile())
