"""Tiny real-architecture checkpoints in FP8 form, written by the tests themselves (issue 39).

`float_folder(path, arch)`: a two-layer Llama or Qwen3 made by transformers (its own random init, bf16, dims
multiples of 128 so that 128x128 blocks are whole), saved with `save_pretrained`.
`fp8_folder(src, dst, scheme)`: the same model in one of SCHEMES' FP8 forms, every scale computed here, with
E = 448 (float8_e4m3fn's largest value) and W a projection's float weight [N, K]:
- weight scales: "tensor" s = max|W| / E, written [1] (compressed-tensors) or [] (HF fp8); "channel"
  s[n] = max_k |W[n, k]| / E, written [N, 1]; "block" s[i, j] = max |W| over rows 128i.. and columns 128j.. / E,
  written [ceil(N/128), ceil(K/128)] (`weight_scale_inv` in the HF form). The stored weight is
  w8 = e4m3fn(clamp(W / s, -E, E)), s broadcast over what it covers; the checkpoint's weight is w8 * s.
- static activations: input_scale = max |x| / E over the projection's inputs while transformers' own model runs
  CALIBRATION (forward hooks: llm-compressor's static min-max observer).
`dequantized_folder(fp8, dst)`: the fp8 model with each fp8 weight replaced by w8 * s in float32 and no
quantization_config: the same numbers as plain float weights.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

E = 448.0
BLOCK = 128
CALIBRATION = [[(13 * i + 7) % 500 + 3 for i in range(40)], [(29 * i + 1) % 500 + 3 for i in range(24)]]
# name -> (form, weights, activations, arch, extra ignore patterns)
SCHEMES: dict[str, tuple[str, str, str, str, tuple[str, ...]]] = {
    "ct-tensor-static": ("compressed-tensors", "tensor", "static", "llama", ()),
    "ct-channel-token": ("compressed-tensors", "channel", "token", "qwen3", ()),
    "ct-tensor-dynamic": ("compressed-tensors", "tensor", "tensor", "qwen3", ()),
    "ct-block": ("compressed-tensors", "block", "group", "llama", ()),
    "ct-channel-ignore": ("compressed-tensors", "channel", "token", "llama", (r"re:model\.layers\.1\.mlp\.",)),
    "hf-block": ("fp8", "block", "group", "qwen3", ()),
    "hf-tensor-static": ("fp8", "tensor", "static", "llama", ()),
    "hf-tensor-dynamic": ("fp8", "tensor", "tensor", "qwen3", ()),
}
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")


def float_folder(path: Path, arch: str, seed: int = 0) -> Path:
    """A two-layer `arch` ("llama" or "qwen3") model of transformers, random weights, saved in bf16."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    common: dict[str, Any] = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                              "max_position_embeddings": 512, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
                              "initializer_range": 0.05, "bos_token_id": 1, "eos_token_id": 2}
    cfg = (Qwen3Config(num_attention_heads=2, num_key_value_heads=1, head_dim=128, **common) if arch == "qwen3" else
           LlamaConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=64, **common))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # activations O(1) through the layers, as a trained model's (rapidserve's presets' scales)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.05 * torch.randn_like(p))
            elif name == "model.embed_tokens.weight":
                p.normal_(0.0, 1.0)
            else:
                std = p.shape[1] ** -0.5 / (2 if name.endswith(("o_proj.weight", "down_proj.weight")) else 1)
                p.normal_(0.0, std)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def quantize(w: torch.Tensor, weights: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(w8, s) of a float weight, by the module docstring's formulas (s: [1], [N, 1] or [Nb, Kb])."""
    w = w.float()
    n, k = w.shape
    if weights == "tensor":
        s = (w.abs().max() / E).reshape(1)
        full = s.reshape(1, 1)
    elif weights == "channel":
        s = w.abs().amax(dim=1, keepdim=True) / E
        full = s
    else:
        nb, kb = math.ceil(n / BLOCK), math.ceil(k / BLOCK)
        s = torch.empty(nb, kb)
        for i in range(nb):
            for j in range(kb):
                s[i, j] = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].abs().max() / E
        full = s.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    return (w / full).clamp(-E, E).to(torch.float8_e4m3fn), s


def dequantize(w8: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """w8 * s in float32, s ([] / [1], [N, 1] or [Nb, Kb] blocks of 128) broadcast over what it covers."""
    n, k = w8.shape
    if s.numel() == 1:
        full = s.float().reshape(1, 1)
    elif s.shape == (n, 1):
        full = s.float()
    else:
        full = s.float().repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    return w8.float() * full


def input_amax(src: Path) -> dict[str, float]:
    """max |x| of each projection's input over CALIBRATION, from transformers' own forward (hooks)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    amax: dict[str, float] = {}

    def hook(name: str) -> Any:
        def record(_module: Any, args: tuple[torch.Tensor, ...]) -> None:
            amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))
        return record

    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1].endswith("_proj"):
            module.register_forward_pre_hook(hook(name))
    with torch.no_grad():
        for prompt in CALIBRATION:
            model(torch.tensor([prompt]))
    return amax


def _ignored(module: str, patterns: tuple[str, ...]) -> bool:
    import re

    return any(re.match(p[3:], module) if p.startswith("re:") else p == module for p in patterns)


def quant_config(scheme: str) -> dict[str, Any]:
    form, weights, acts, _, ignore = SCHEMES[scheme]
    if form == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "static" if acts == "static" else "dynamic",
                "fmt": "e4m3", "weight_block_size": [BLOCK, BLOCK] if weights == "block" else None}
    w: dict[str, Any] = {"num_bits": 8, "type": "float", "strategy": weights, "symmetric": True, "dynamic": False}
    if weights == "block":
        w["block_structure"] = [BLOCK, BLOCK]
    a: dict[str, Any] = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": acts != "static",
                         "strategy": {"static": "tensor", "group": "group"}.get(acts, acts)}
    if acts == "group":
        a["group_size"] = BLOCK
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": w, "input_activations": a}},
            "ignore": ["lm_head", *ignore]}


def fp8_folder(src: Path, dst: Path, scheme: str) -> Path:
    """`src` (a float folder) written in `scheme`'s FP8 form at `dst` (module docstring)."""
    form, weights, acts, _, ignore = SCHEMES[scheme]
    tensors = load_file(str(src / "model.safetensors"))
    amax = input_amax(src) if acts == "static" else {}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        if not (name.endswith("_proj.weight") and module.startswith("model.layers.")) or _ignored(module, ignore):
            out[name] = t
            continue
        w8, s = quantize(t, weights)
        out[name] = w8
        if form == "fp8":
            out[f"{module}.weight_scale_inv" if weights == "block" else f"{module}.weight_scale"] = (
                s if weights == "block" else s.reshape(()))
        else:
            out[f"{module}.weight_scale"] = s
        if acts == "static":
            x = torch.tensor(amax[module] / E)
            out[f"{module}.input_scale"] = x if form == "fp8" else x.reshape(1)
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quant_config(scheme)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def dequantized_folder(fp8: Path, dst: Path) -> Path:
    """The fp8 folder's model with plain float32 weights w8 * s (module docstring)."""
    tensors = load_file(str(fp8 / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(("weight_scale", "weight_scale_inv", "input_scale")):
            continue
        if t.dtype == torch.float8_e4m3fn:
            module = name.removesuffix(".weight")
            scale = tensors.get(f"{module}.weight_scale", tensors.get(f"{module}.weight_scale_inv"))
            assert scale is not None, name
            out[name] = dequantize(t, scale)
        else:
            out[name] = t.float()
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((fp8 / "config.json").read_text())
    del cfg["quantization_config"]
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def input_scales(fp8: Path) -> dict[str, float]:
    """Each projection's input_scale in the folder (static schemes), by module name."""
    tensors = load_file(str(fp8 / "model.safetensors"))
    return {n.removesuffix(".input_scale"): float(t) for n, t in tensors.items() if n.endswith(".input_scale")}
