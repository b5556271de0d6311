"""On ROCm (torch.version.hip set; PyTorch still names the device "cuda"), NVIDIA-only code is never chosen, even
where it is installed: FlashAttention-3, green contexts, the skinny GEMM, MPS. Checked on a CPU machine with a fake
HIP layer: `torch.version.hip` set, the fake hip-python module of tests/test_hip_ext.py for CU-masked streams, an
AMD device of 304 CUs as far as the partition backend can tell, and importable fakes of the NVIDIA packages (FA3's
`flash_attn_interface`, `cuda.bindings`), each shown to be taken when the platform is NVIDIA."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import rapidserve.partition.backend as backend_mod
from hip_ext.cumask import decode_mask, prefill_mask
from rapidserve.attention import get_attention_backend
from rapidserve.config_base import ConfigError
from rapidserve.engine.client import gpu_platform
from rapidserve.engine.mps import MpsController
from rapidserve.ops import get_ops, torch_ops
from rapidserve.partition.backend import Granularity, detect_kind, open_backend, plan_configurations
from tests.test_hip_ext import FakeHipModule

pytest.importorskip("triton")
CUDA = torch.device("cuda")  # a device name only: nothing here touches a GPU


@pytest.fixture
def rocm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", "6.4.0")


@pytest.fixture
def nvidia_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    """FA3 (flash_attn_interface) and cuda-bindings importable, as on an NVIDIA machine that has them."""
    fa3 = types.ModuleType("flash_attn_interface")
    fa3.__file__ = "/fake/flash_attn_interface.py"
    fa3.flash_attn_with_kvcache = lambda *a, **k: None  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash_attn_interface", fa3)
    cuda, bindings, driver = (types.ModuleType(n) for n in ("cuda", "cuda.bindings", "cuda.bindings.driver"))
    cuda.bindings, bindings.driver = bindings, driver  # type: ignore[attr-defined]
    for name, mod in (("cuda", cuda), ("cuda.bindings", bindings), ("cuda.bindings.driver", driver)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # a Hopper, if asked


@pytest.fixture
def fake_mi300x(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, FakeHipModule]:
    """An AMD device of 304 CUs for the partition backend, and hip-python's `hip` module as a fake."""
    hip = FakeHipModule()
    monkeypatch.setitem(sys.modules, "hip", SimpleNamespace(hip=hip))
    monkeypatch.setattr(backend_mod, "_device_units", lambda device: 304)
    monkeypatch.setattr(backend_mod, "_plain_stream", lambda device: None)
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda handle: SimpleNamespace(handle=handle))
    return SimpleNamespace(type="cuda", index=0), hip


def test_ops_skinny_gemm_only_on_nvidia(monkeypatch: pytest.MonkeyPatch) -> None:
    from rapidserve.ops import triton_skinny
    assert get_ops(CUDA).linear is triton_skinny.linear  # NVIDIA: the skinny GEMM
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    ops = get_ops(CUDA)
    assert ops.name == "triton-noskinny" and ops.linear is torch_ops.linear  # ROCm: hipBLASLt through torch


def test_attention_auto_takes_fa3_only_on_nvidia(nvidia_packages: None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert get_attention_backend("auto", CUDA).name == "fa3:flash_attn_interface (/fake)"  # the fake is usable
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    assert get_attention_backend("auto", CUDA).name == "triton"
    with pytest.raises(ConfigError, match="FlashAttention-3 runs on NVIDIA GPUs only"):
        get_attention_backend("fa3", CUDA)


def test_partition_auto_takes_cu_masks_on_rocm(nvidia_packages: None, fake_mi300x: tuple[Any, FakeHipModule],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    device, hip = fake_mi300x
    assert detect_kind(device) == "cuda-green"  # NVIDIA with cuda-bindings importable: green contexts
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    assert detect_kind(device) == "hip-cumask"
    configs = plan_configurations(Granularity(304, 8, 8), (0.25,))
    b = open_backend("auto", device, configs, ("decode", "prefill"))
    try:
        assert b.kind == "hip-cumask"
        n = next(c.decode_units for c in b.configurations if c.decode_units)
        made = [words for call, words in hip.calls if call == "hipExtStreamCreateWithCUMask"]
        assert made == [decode_mask(n, 304), prefill_mask(n, 304)]  # through the fake hip-python module
    finally:
        b.close()
    assert hip.streams == {}


def test_platform_is_rocm_and_takes_no_mps(rocm: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert gpu_platform() == "rocm"
    plan = MpsController().start("auto", gpu_platform(), str(tmp_path / "mps"))
    assert not plan.active and "ROCm" in plan.reason and not (tmp_path / "mps").exists()


def test_attention_launch_parameters_per_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVIDIA's launch parameters as measured there; ROCm's from the gfx942 compile check (triton_paged_decode.py,
    triton_paged_prefill.py)."""
    from rapidserve.attention.triton_paged_decode import _decode_config
    from rapidserve.attention.triton_paged_prefill import _prefill_amd_options, _prefill_config
    bf16, fp32 = torch.bfloat16, torch.float32
    nvidia = (_decode_config(bf16, 128)[:3], _decode_config(fp32, 128)[:3], _prefill_config(bf16, 128),
              _prefill_config(bf16, 64), _prefill_config(fp32, 128), _prefill_amd_options(bf16))
    assert nvidia == ((32, 2, 5), (32, 4, 2), (128, 64, 8, 2), (128, 64, 4, 3), (64, 32, 4, 2), {})
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    rocm = (_decode_config(bf16, 128)[:3], _decode_config(fp32, 128)[:3], _prefill_config(bf16, 128),
            _prefill_config(bf16, 64), _prefill_config(fp32, 128), _prefill_amd_options(bf16),
            _prefill_amd_options(fp32))
    assert rocm == ((64, 4, 1), (32, 4, 1), (128, 64, 8, 1), (128, 64, 8, 1), (64, 32, 4, 1),
                    {"matrix_instr_nonkdim": 16}, {"waves_per_eu": 2})
    # an fp8 KV cache: 32-key tiles at head_dim 128 (64 spilled 9 VGPRs on gfx942), fp32 without waves_per_eu
    fp8 = (_prefill_config(bf16, 128, True), _prefill_config(bf16, 64, True),
           _prefill_amd_options(fp32, True), _prefill_amd_options(bf16, True))
    assert fp8 == ((128, 32, 8, 1), (128, 64, 8, 1), {}, {"matrix_instr_nonkdim": 16})


def test_moe_layer_takes_the_triton_kernels_on_rocm(rocm: None) -> None:
    """An MoE layer on ROCm runs the same Triton routing, alignment and grouped GEMMs as on NVIDIA (issue 40:
    `triton_moe.routed_moe`, three launches at decode); no table names an AMD device here, so ROCm's untuned rule:
    K steps of 64, no split K (tests/test_amd_compile.py compiles every variant for gfx942, the split ones too)."""
    from rapidserve.ops import triton_moe
    ops = get_ops(CUDA)
    assert ops.moe_layer is triton_moe.routed_moe and ops.moe_experts is triton_moe.fused_moe
    cfg = triton_moe.moe_config(8, 128, 768, 2048, torch.bfloat16, torch.device("meta"))
    assert (cfg.gate_up.block_k, cfg.gate_up.split_k, cfg.down.split_k) == (64, 1, 1)
