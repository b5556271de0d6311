"""The runner's device and dtype: the config's `device` and `dtype` names (`auto` among them) resolved to torch's,
with a ConfigError that says what to use instead (no GPU visible, an unsupported name).
"""

from __future__ import annotations

import os

import torch

from rapidserve.config_base import ConfigError

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"device={name!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device={name!r} is not supported; use auto, cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        mps = os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
        why = (f" to this process, which runs under the MPS daemon at {mps} (a daemon sees only the GPUs its own "
               "CUDA_VISIBLE_DEVICES named; serve with --mps off, or start the daemon without it)") if mps else ""
        raise ConfigError(f"device={name!r} but no CUDA/ROCm GPU is visible{why}; use --device cpu")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        if name not in DTYPES:
            raise ConfigError(f"dtype={name!r} is not supported; use auto or one of {sorted(DTYPES)}")
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
