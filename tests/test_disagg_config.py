"""`--mode disagg` in the config tree and on the command line: what it takes (each side's tensor parallelism,
its GPUs) and what it refuses, by name."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from rapidserve.cli import build_parser
from rapidserve.config import EngineConfig, ModelConfig, ParallelConfig
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
    ({"tensor_parallel_size": 4}, "disagg: --tensor-parallel-size 4 must divide the model's 2 KV heads"),
    ({"prefill_tensor_parallel_size": 4}, "--prefill-tensor-parallel-size 4 must divide the model's 2 KV heads"),
    ({"prefill_tensor_parallel_size": 3}, "--prefill-tensor-parallel-size 3 must divide the model's 4 attention"),
    ({"data_parallel_size": 2}, "takes no data parallelism"),
    ({"device": "cuda:1"}, "names one GPU but --mode disagg uses 2"),
    ({"device": "cuda:1", "prefill_tensor_parallel_size": 2}, "names one GPU but --mode disagg uses 3"),
    ({"devices": (0, 1, 2)}, r"uses 2 GPUs \(prefill's 1, then decode's 1\); list 2"),
    ({"devices": (0, 1), "tensor_parallel_size": 2}, r"uses 4 GPUs \(prefill's 2, then decode's 2\); list 4"),
    ({"devices": (1, 1)}, "distinct GPU indices"),
])
def test_disagg_refuses(kw: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        config(**kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("tp,ptp,gpus", [
    (1, None, ((0,), (1,))),  # 1P1D: prefill on GPU 0, decode on GPU 1
    (2, None, ((0, 1), (2, 3))),  # 2P2D: -tp 2 is both sides' size by default
    (2, 1, ((0,), (1, 2))),  # 1P2D
    (1, 2, ((0, 1), (2,))),  # 2P1D
])
def test_disagg_takes_each_sides_tensor_parallelism(tp: int, ptp: int | None,
                                                    gpus: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
    par = config(tensor_parallel_size=tp, prefill_tensor_parallel_size=ptp).parallel
    assert (par.prefill_tp, par.tensor_parallel_size, par.disagg_gpus()) == (ptp or tp, tp, gpus)
    with_devices = config(tensor_parallel_size=tp, prefill_tensor_parallel_size=ptp,
                          devices=tuple(range(7, 7 + sum(map(len, gpus)))))
    assert with_devices.parallel.disagg_gpus() == tuple(tuple(g + 7 for g in side) for side in gpus)


def _model(heads: int, kv_heads: int) -> ModelConfig:
    base = config().model_config
    return dataclasses.replace(base, num_heads=heads, num_kv_heads=kv_heads, intermediate_size=heads * 40)


@pytest.mark.parametrize("kv,n,m,needle", [
    (8, 4, 4, None),  # 4P4D: rank r <-> rank r
    (8, 2, 4, None),
    (8, 8, 2, None),
    (8, 1, 8, None),
    (4, 4, 4, None),
    (6, 2, 3, "--prefill-tensor-parallel-size 2 and --tensor-parallel-size 3: one must divide the other"),
    (6, 3, 2, "--prefill-tensor-parallel-size 3 and --tensor-parallel-size 2: one must divide the other"),
    (2, 4, 2, "--prefill-tensor-parallel-size 4 must divide the model's 2 KV heads"),
    (4, 2, 8, "disagg: --tensor-parallel-size 8 must divide the model's 4 KV heads"),
    (8, 5, 1, "--prefill-tensor-parallel-size 5 must divide the model's 24 attention heads"),
    (8, 3, 1, "--prefill-tensor-parallel-size 3 must divide the model's 8 KV heads"),
])
def test_disagg_problem_table(kv: int, n: int, m: int, needle: str | None) -> None:
    """The pure check behind every --mode disagg config (ParallelConfig.disagg_problem), on models no preset has."""
    problem = ParallelConfig(tensor_parallel_size=m, prefill_tensor_parallel_size=n).disagg_problem(
        _model(24, kv))
    assert problem == needle if needle is None else needle in (problem or "")


@pytest.mark.parametrize("mode", ["rapid", "hybrid"])
def test_prefill_tp_is_read_by_disagg_only(mode: str) -> None:
    with pytest.raises(ConfigError, match="--prefill-tensor-parallel-size 1: read by --mode disagg only"):
        config(mode, prefill_tensor_parallel_size=1)
    assert build_parser().parse_args(["serve", "--prefill-tp", "2"]).prefill_tensor_parallel_size == 2


@pytest.mark.parametrize("mode", ["rapid", "hybrid"])
def test_other_modes_list_one_gpu_per_rank(mode: str) -> None:
    with pytest.raises(ConfigError, match=f"mode {mode} uses 1 GPUs"):
        config(mode, devices=(0, 1))
    assert config(mode, devices=(1,)).parallel.devices == (1,)


def test_serve_disagg_with_replicated_kv_heads_exits_2_naming_it() -> None:
    r = subprocess.run([sys.executable, "-m", "rapidserve.cli", "serve", "--mode", "disagg", "-tp", "4", "--model",
                        "preset:tiny-llama", "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--mode disagg" in r.stderr and "--tensor-parallel-size 4" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("visible,tp,ptp,devices,want", [
    (2, 1, None, None, (["cuda:0"], ["cuda:1"])),  # prefill on GPU 0, decode on GPU 1
    (4, 1, None, (3, 1), (["cuda:3"], ["cuda:1"])),  # ParallelConfig.devices: (prefill's, decode's)
    (4, 2, None, None, (["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"])),  # 2P2D
    (3, 2, 1, None, (["cuda:0"], ["cuda:1", "cuda:2"])),  # 1P2D
    (1, 1, None, None, "but 1 GPU is visible; it needs 2"),
    (0, 1, None, None, "but 0 GPUs are visible"),
    (2, 1, None, (0, 2), "prefill on GPU 0 and decode on GPU 2, but 2 GPUs are visible"),
    (2, 1, 2, None, "prefill on GPUs 0, 1 and decode on GPU 2, but 2 GPUs are visible; it needs 3"),
])
def test_disagg_devices_on_gpus(monkeypatch: pytest.MonkeyPatch, visible: int, tp: int, ptp: int | None,
                                devices: tuple[int, int] | None, want: tuple[list[str], list[str]] | str) -> None:
    """Checked in the router before any worker starts (engine/disagg.py:builders_for); no GPU needed here."""
    import torch

    from rapidserve.engine import disagg

    monkeypatch.setattr(disagg, "resolve_device", lambda name: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    kw: dict[str, object] = {"tensor_parallel_size": tp, "prefill_tensor_parallel_size": ptp}
    cfg = config(device="auto", devices=devices, **kw) if devices else config(device="auto", **kw)
    if isinstance(want, str):
        with pytest.raises(ConfigError, match=want):
            disagg.builders_for(cfg)
        return
    assert tuple([str(d) for d in side] for side in disagg.disagg_devices(cfg)) == want
    b = disagg.builders_for(cfg)
    assert (b["decode"], b["prefill"]) == (disagg.build_disagg_decode, disagg.build_disagg_prefill)


def test_other_modes_keep_their_builders() -> None:
    import torch

    from rapidserve.engine import disagg
    from rapidserve.engine.worker_build import BUILDERS

    assert disagg.builders_for(config("rapid")) is BUILDERS and disagg.builders_for(config("hybrid")) is BUILDERS
    assert disagg.disagg_devices(config()) == ([torch.device("cpu")], [torch.device("cpu")])  # on CPU both instances
