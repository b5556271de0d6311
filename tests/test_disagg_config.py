"""`--mode disagg` in the config tree and on the command line: what it takes and what it refuses."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from rapidserve.cli import build_parser
from rapidserve.config import EngineConfig, ParallelConfig
from rapidserve.config_base import ConfigError
from rapidserve.launch_config import ENGINE_MODES, LaunchConfig
from rapidserve.llm import build_engine_config


def config(mode: str = "disagg", device: str = "cpu", **parallel: object) -> EngineConfig:
    cfg, _ = build_engine_config("preset:tiny-llama", device="cpu", dtype="float32", max_model_len=256)
    runner = dataclasses.replace(cfg.runner, device=device)  # no GPU is needed to check the tree
    return dataclasses.replace(cfg, runner=runner, launch=LaunchConfig(mode=mode, mps="off"),  # type: ignore[arg-type]
                               parallel=ParallelConfig(**parallel))  # type: ignore[arg-type]


def test_disagg_is_an_engine_mode_and_a_serve_flag() -> None:
    assert "disagg" in ENGINE_MODES
    a = build_parser().parse_args(["serve", "--mode", "disagg"])
    assert a.mode == "disagg"
    assert config().launch.mode == "disagg"
    assert config(device="auto", devices=(3, 1)).parallel.devices == (3, 1)  # prefill's GPU, decode's


@pytest.mark.parametrize("kw,needle", [
    ({"tensor_parallel_size": 2}, "takes no tensor or data parallelism"),
    ({"data_parallel_size": 2}, "takes no tensor or data parallelism"),
    ({"device": "cuda:1"}, "names one GPU but --mode disagg uses two"),
    ({"devices": (0, 1, 2)}, "or two for --mode disagg"),
    ({"devices": (1, 1)}, "distinct GPU indices"),
])
def test_disagg_refuses(kw: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        config(**kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["rapid", "hybrid"])
def test_two_devices_for_one_engine_are_only_for_disagg(mode: str) -> None:
    with pytest.raises(ConfigError, match="two GPUs for one engine are for --mode disagg"):
        config(mode, devices=(0, 1))
    assert config(mode, devices=(1,)).parallel.devices == (1,)


def test_serve_disagg_with_tensor_parallelism_exits_2_naming_it() -> None:
    r = subprocess.run([sys.executable, "-m", "rapidserve.cli", "serve", "--mode", "disagg", "-tp", "2", "--model",
                        "preset:tiny-llama", "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--mode disagg" in r.stderr and "tensor_parallel_size=2" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("visible,devices,want", [
    (2, None, ("cuda:0", "cuda:1")),  # prefill on GPU 0, decode on GPU 1
    (4, (3, 1), ("cuda:3", "cuda:1")),  # ParallelConfig.devices: (prefill's, decode's)
    (1, None, "but 1 GPU is visible; it needs two"),
    (0, None, "but 0 GPUs are visible"),
    (2, (0, 2), "prefill on GPU 0 and decode on GPU 2, but 2 GPUs are visible"),
])
def test_disagg_devices_on_gpus(monkeypatch: pytest.MonkeyPatch, visible: int, devices: tuple[int, int] | None,
                                want: tuple[str, str] | str) -> None:
    """Checked in the router before any worker starts (engine/disagg.py:builders_for); no GPU needed here."""
    import torch

    from rapidserve.engine import disagg

    monkeypatch.setattr(disagg, "resolve_device", lambda name: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    cfg = config(device="auto", devices=devices) if devices else config(device="auto")
    if isinstance(want, str):
        with pytest.raises(ConfigError, match=want):
            disagg.builders_for(cfg)
        return
    assert tuple(str(d) for d in disagg.disagg_devices(cfg)) == want
    b = disagg.builders_for(cfg)
    assert (b["decode"], b["prefill"]) == (disagg.build_disagg_decode, disagg.build_disagg_prefill)


def test_other_modes_keep_their_builders() -> None:
    from rapidserve.engine import disagg
    from rapidserve.engine.worker_build import BUILDERS

    assert disagg.builders_for(config("rapid")) is BUILDERS and disagg.builders_for(config("hybrid")) is BUILDERS
    assert [str(d) for d in disagg.disagg_devices(config())] == ["cpu", "cpu"]  # on CPU both instances
