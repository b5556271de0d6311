"""Quantized Hugging Face checkpoints: found before any weight is read, served (FP8) or refused by name.

rapidserve computes in the checkpoint's float weights (bf16/fp16/fp32; GGUF files are dequantized on load), and
serves FP8 checkpoints in two forms (compressed-tensors float-quantized, Hugging Face fp8: `fp8_checkpoint.py`,
which reads their scheme into the config tree's `QuantizationConfig`). Every other quantized safetensors checkpoint
stores numbers a float model would misread (packed int4 `qweight` with `scales` and `qzeros`, bitsandbytes blocks
with `absmax`, int8 weights...): copied into a float parameter they give wrong weights without any error, so a
folder is checked before its weights are read:

1. `quantization_method(config, folder)`: where vLLM looks for a method, in this order: config.json's
   `quantization_config` (also inside `text_config`), its `compression_config` (compressed-tensors' older
   key), then the side files GPTQ / AWQ / ModelOpt tools write (`quantize_config.json`,
   `quant_config.json`, `hf_quant_config.json`). A method found that is not one of the FP8 forms served is
   refused by name (`fp8_checkpoint.checkpoint_quantization` raises `UnsupportedQuantization(q.message(...))`).
2. `quantized_tensor(headers)`, from the safetensors headers only: a tensor whose name is a quantizer's
   (`*_scale`, `qweight`, `qzeros`, `scales`, `g_idx`, bitsandbytes' `absmax` / `quant_state`...), or a
   weight the model needs stored in a non-float dtype (F8_E4M3, I8, I32...), in a folder that declared no
   method: refused by name too (`refuse_quantized_tensors`).

The error is `UnsupportedQuantization`, a `ModelLoadError` of one line: what the checkpoint is, what
rapidserve serves, and what to do.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rapidserve.loader.source import ModelLoadError

FP8_ISSUE = 39
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")  # safetensors dtype names a float checkpoint's weights may have
SERVED = ("rapidserve serves bf16/fp16/fp32 Hugging Face checkpoints, FP8 ones (compressed-tensors float-quantized, "
          "Hugging Face fp8) and GGUF files")
# side files that carry a quantization config, with the method their tools mean when the file names none
SIDE_FILES: tuple[tuple[str, str], ...] = (
    ("quantize_config.json", "gptq"),  # AutoGPTQ / GPTQModel (AutoAWQ wrote it too: told apart by its keys)
    ("quant_config.json", "awq"),  # AutoAWQ
    ("hf_quant_config.json", "modelopt"),  # NVIDIA ModelOpt (FP8, NVFP4)
)
_FP8_METHODS = ("fp8", "fbgemm_fp8", "ptpc_fp8", "fp8_e4m3", "fp8_e5m2")
# the last component of a tensor name that only quantized checkpoints carry
_QUANT_LEAVES = frozenset({
    "qweight", "qzeros", "scales", "g_idx", "zeros",  # GPTQ / AWQ
    "weight_packed", "weight_shape", "weight_zero_point", "weight_g_idx", "weight_global_scale",  # compressed-tensors
    "absmax", "quant_map", "nested_absmax", "nested_quant_map", "SCB", "weight_format",  # bitsandbytes
})
_QUANT_LEAF_SUFFIXES = ("_scale", "_scale_inv", "_scale_2")  # weight_scale, input_scale, k_scale, weight_scale_inv


class UnsupportedQuantization(ModelLoadError):
    """A quantized checkpoint (named by its method or by a quantizer's tensor): one line saying what to do."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        Exception.__init__(self, f"cannot load model {path!r}: {problem}")

    def __reduce__(self) -> tuple[type[UnsupportedQuantization], tuple[str, str]]:
        return (UnsupportedQuantization, (self.path, self.problem))


@dataclass(frozen=True)
class Quantization:
    """A quantization method a checkpoint declares: `method` as vLLM names it, `detail` (the scheme, e.g.
    "fp8 (compressed-tensors float-quantized)"), `where` it was declared, `config` the declaration itself (None
    when it is not a JSON object)."""

    method: str
    detail: str
    where: str
    config: Mapping[str, Any] | None = field(default=None, compare=False)

    @property
    def fp8(self) -> bool:
        return self.method in _FP8_METHODS or self.detail.startswith("fp8")

    def message(self, why: str = "") -> str:
        """The one-line refusal; `why`: what of an FP8 scheme is not served."""
        if self.fp8:
            fix = (f"{why + '; ' if why else ''}use the bf16 checkpoint (the same model without the FP8 suffix), "
                   f"with --quantization fp8 to run it in fp8 (issue {FP8_ISSUE})")
        else:
            fix = ("use the model's unquantized bf16/fp16 checkpoint (or a GGUF file of it: rapidserve dequantizes "
                   "GGUF quantizations on load)")
        return f"this checkpoint is quantized with {self.detail} ({self.where}); {SERVED}; {fix}"


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(path, f"cannot read JSON: {e}") from e


def _method_name(d: Mapping[str, Any]) -> str | None:
    """The method a quantization config names, normalised as vLLM does (lower case, compressed-tensors with
    a dash); ModelOpt's configs name theirs through `producer` and `quant_algo`."""
    method = d.get("quant_method")
    if isinstance(method, str) and method.strip():
        m = method.strip().lower()
        return "compressed-tensors" if m == "compressed_tensors" else m
    producer = d.get("producer")
    if isinstance(producer, Mapping) and str(producer.get("name", "")).lower() == "modelopt":
        return "modelopt"
    if d.get("load_in_4bit") or d.get("load_in_8bit") or d.get("_load_in_4bit") or d.get("_load_in_8bit"):
        return "bitsandbytes"
    if "config_groups" in d or "quantization_status" in d:
        return "compressed-tensors"
    return None


def _compressed_tensors_scheme(d: Mapping[str, Any]) -> str:
    """E.g. "fp8 (compressed-tensors float-quantized)", from the first config group's weights."""
    groups = d.get("config_groups")
    weights: Mapping[str, Any] = {}
    fmt = d.get("format")
    if isinstance(groups, Mapping):
        for g in groups.values():
            if isinstance(g, Mapping) and isinstance(g.get("weights"), Mapping):
                weights = g["weights"]
                fmt = fmt or g.get("format")
                break
    kind, bits = weights.get("type"), weights.get("num_bits")
    scheme = {("float", 8): "fp8", ("float", 4): "fp4", ("int", 8): "int8", ("int", 4): "int4"}.get((kind, bits))
    if scheme is None:
        scheme = {"float-quantized": "fp8", "int-quantized": "int8", "pack-quantized": "packed int4/int8",
                  "nvfp4-pack-quantized": "nvfp4", "marlin-24": "int4 2:4 sparse"}.get(str(fmt), "a scheme")
    return f"{scheme} (compressed-tensors {fmt})" if fmt else f"{scheme} (compressed-tensors)"


def describe(method: str, d: Mapping[str, Any]) -> str:
    """What a method's config says the weights are, in words for the error."""
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(d)
    if method == "modelopt":
        quant = d.get("quantization")
        algo = quant.get("quant_algo") if isinstance(quant, Mapping) else d.get("quant_algo")
        return f"{str(algo).lower() if algo else 'a scheme'} (NVIDIA ModelOpt)"
    if method == "fp8":
        block = d.get("weight_block_size")
        return f"fp8 (block scales {'x'.join(str(b) for b in block)})" if isinstance(block, list) and block else "fp8"
    if method == "bitsandbytes":
        if d.get("load_in_4bit") or d.get("_load_in_4bit"):
            return f"bitsandbytes 4-bit ({d.get('bnb_4bit_quant_type', 'nf4')})"
        return "bitsandbytes 8-bit" if d.get("load_in_8bit") or d.get("_load_in_8bit") else "bitsandbytes"
    bits = d.get("bits", d.get("w_bit"))
    return f"{method} ({bits}-bit)" if isinstance(bits, int) else method


def _declared(d: Mapping[str, Any], where: str) -> Quantization:
    method = _method_name(d) or "an unnamed method"
    detail = describe(method, d) if _method_name(d) else "a quantization_config that names no quant_method"
    return Quantization(method, detail, where, d)


def quantization_method(config: Mapping[str, Any], folder: str) -> Quantization | None:
    """The quantization a model folder declares (module docstring, step 1), or None for a float checkpoint.
    Reads config.json's parsed `config` and the side files only: no weight."""
    for key in ("quantization_config", "compression_config"):
        for scope, d in (("", config), ("text_config.", config.get("text_config"))):
            if isinstance(d, Mapping) and d.get(key) is not None:
                q = d[key]
                if not isinstance(q, Mapping):
                    return Quantization("unknown", f"a {key} that is not a JSON object", f"config.json {scope}{key}")
                return _declared(q, f"config.json {scope}{key}")
    for name, default in SIDE_FILES:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        d = _read_json(path)
        if not isinstance(d, Mapping):
            return Quantization(default, default, name)
        method = _method_name(d)
        if method is None:  # AutoAWQ's files name no method; its keys (w_bit, version) tell it from GPTQ's
            method = "awq" if "w_bit" in d or ("version" in d and "bits" not in d) else default
        return Quantization(method, describe(method, d), name, d)
    return None


def is_quantizer_tensor(name: str) -> bool:
    """Whether `name` is a tensor only quantized checkpoints carry (a scale, a packed weight, a zero point...)."""
    leaf = name.rsplit(".", 1)[-1]
    return leaf in _QUANT_LEAVES or leaf.endswith(_QUANT_LEAF_SUFFIXES) or ".quant_state" in name


def quantized_tensor(dtypes: Mapping[str, str], needed: set[str] | frozenset[str]) -> str | None:
    """Why the headers (tensor name -> safetensors dtype) show a quantized checkpoint, or None: a tensor
    named as a quantizer names its parts, or a tensor of `needed` (the model's weights) stored in a dtype
    that is not a float one."""
    for name in dtypes:
        if is_quantizer_tensor(name):
            return f"its safetensors hold tensor {name}, a quantizer's {name.rsplit('.', 1)[-1]!r}"
    for name in sorted(needed & dtypes.keys()):
        if dtypes[name] not in FLOAT_DTYPES:
            return f"its weight {name} is stored as {dtypes[name]} (float weights are {'/'.join(FLOAT_DTYPES)})"
    return None


def refuse_quantized_tensors(dtypes: Mapping[str, str], needed: set[str] | frozenset[str], folder: str) -> None:
    """UnsupportedQuantization when the headers show quantized weights in a folder that declared no method."""
    why = quantized_tensor(dtypes, needed)
    if why is not None:
        raise UnsupportedQuantization(
            folder, f"this checkpoint looks quantized: {why}, and config.json has no quantization_config "
                    f"(a quantized export that lost its config?); {SERVED}; use the model's unquantized "
                    "bf16/fp16 checkpoint")
