"""Loading the tensors of the decoder layers' fp8 projections (`ops.fp8.Fp8Linear`) from Hugging Face names.

`CausalLM.load_weights` maps each HF name to a destination; an fp8 projection's names map to an `Fp8Part`, which
`store` writes into the fused `Fp8Linear` (q|k|v, gate|up: each HF projection at its row offset):
- `<proj>.weight` of an FP8 checkpoint (float8_e4m3fn [rows, K]): copied bit for bit; on ROCm's e4m3fnuz
  (`ops.fp8.to_fnuz`) the same bits with -0 made +0, and the scales below doubled, so w8 * scale is unchanged;
- `<proj>.weight_scale` / `.weight_scale_inv`: per-tensor ([] or [1]) repeated over the projection's rows (the
  fused q|k|v keeps three scales, nothing is requantized), per-channel ([rows, 1] or [rows]) as is, block scales
  ([ceil(rows/bn), ceil(K/bk)]) at block row offset/bn (the loader checked that fused offsets are whole blocks);
- `<proj>.input_scale` (static activations): the fused layer's is the largest of its projections' (one input
  feeds them all; the largest scale clips none of them), so `begin` zeroes it and each one is max-combined;
- `--quantization fp8` / dummy weights (`online`): `<proj>.weight` is float and is quantized here, on the layer's
  device, with the scheme's weight scales (`ops.fp8.quantize_weight`; per channel for --quantization fp8).
Under tensor parallelism the names carry the rank's parts (parallel/shard.py: scales follow their weight's rows;
a row-parallel weight's online per-channel scales are then the rank's columns' own).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rapidserve.ops.fp8 import FP8_E4M3FN, FP8_E4M3FNUZ, Fp8Linear, cdiv, quantize_weight, to_fnuz
from rapidserve.quant_config import QuantizationConfig


class Fp8WeightError(ValueError):
    """An fp8 tensor does not fit its destination; the message names it."""


@dataclass(frozen=True)
class Fp8Part:
    """Where one HF-named tensor of an fp8 projection goes: `layer`'s rows [off, off + rows); `kind` is "weight",
    "scale", "input_scale" or "online" (a float weight to quantize)."""

    layer: Fp8Linear
    kind: str
    off: int
    rows: int


def fp8_parts(proj: str, layer: Fp8Linear, off: int, rows: int, quant: QuantizationConfig) -> dict[str, Fp8Part]:
    """The HF names of projection `proj` (model.layers.N.self_attn.q_proj) held at rows [off, off + rows) of the
    fused `layer`, and where each goes."""
    if quant.online:
        return {f"{proj}.weight": Fp8Part(layer, "online", off, rows)}
    out = {f"{proj}.weight": Fp8Part(layer, "weight", off, rows),
           f"{proj}.{quant.scale_name}": Fp8Part(layer, "scale", off, rows)}
    if quant.activations == "static":
        out[f"{proj}.input_scale"] = Fp8Part(layer, "input_scale", off, rows)
    return out


def begin(layers: list[Fp8Linear]) -> None:
    """Before a load: static input scales to 0, so that each projection's is max-combined into its layer's."""
    for layer in layers:
        if layer.input_scale is not None:
            layer.input_scale.zero_()


def _scale_factor(layer: Fp8Linear) -> float:
    """2 when an e4m3fn checkpoint is stored as e4m3fnuz (the same bits are half the value), else 1."""
    return 2.0 if layer.weight.dtype == FP8_E4M3FNUZ else 1.0


def _rows_scale(part: Fp8Part, t: torch.Tensor, name: str) -> tuple[torch.Tensor, slice]:
    """A checkpoint weight scale as the layer's rows hold it, and the rows of `weight_scale` it fills."""
    layer = part.layer
    if layer.block is not None:
        bn = layer.block[0]
        want = (cdiv(part.rows, bn), layer.weight_scale.shape[1])
        if tuple(t.shape) != want:
            raise Fp8WeightError(f"tensor {name!r} has shape {list(t.shape)}, expected block scales {list(want)}")
        if part.off % bn:
            raise Fp8WeightError(f"tensor {name!r} starts at row {part.off}, not on a {bn}-row block")
        return t, slice(part.off // bn, part.off // bn + want[0])
    if t.numel() == 1:  # per tensor: repeated over the projection's rows
        return t.reshape(1).expand(part.rows), slice(part.off, part.off + part.rows)
    if tuple(t.shape) not in ((part.rows,), (part.rows, 1)):
        raise Fp8WeightError(f"tensor {name!r} has shape {list(t.shape)}, expected per-channel scales "
                             f"[{part.rows}, 1] or [{part.rows}]")
    return t.reshape(part.rows), slice(part.off, part.off + part.rows)


def store(part: Fp8Part, name: str, tensor: torch.Tensor, quant: QuantizationConfig) -> None:
    """Write one HF-named tensor into its fp8 layer (module docstring); Fp8WeightError naming it when it does not
    fit."""
    layer = part.layer
    k = layer.weight.shape[1]
    rows = slice(part.off, part.off + part.rows)
    if part.kind in ("weight", "online") and tuple(tensor.shape) != (part.rows, k):
        raise Fp8WeightError(f"tensor {name!r} has shape {list(tensor.shape)}, expected {[part.rows, k]}")
    t = tensor.to(layer.weight.device)
    if part.kind == "weight":
        if t.dtype != FP8_E4M3FN:
            raise Fp8WeightError(f"tensor {name!r} is {t.dtype}, expected float8_e4m3fn (an FP8 checkpoint's)")
        layer.weight[rows].copy_(to_fnuz(t) if layer.weight.dtype == FP8_E4M3FNUZ else t)
    elif part.kind == "online":
        if not t.is_floating_point() or t.dtype in (FP8_E4M3FN, FP8_E4M3FNUZ):
            raise Fp8WeightError(f"tensor {name!r} is {t.dtype}: --quantization fp8 quantizes float weights")
        w8, scale = quantize_weight(t, quant.weights, layer.block, layer.weight.dtype)
        layer.weight[rows].copy_(w8)
        scale, dest = _rows_scale(part, scale, name)
        layer.weight_scale[dest].copy_(scale)
    elif part.kind == "scale":
        scale, dest = _rows_scale(part, t.float(), name)
        layer.weight_scale[dest].copy_(scale * _scale_factor(layer))
    elif part.kind == "input_scale" and layer.input_scale is not None:
        if t.numel() != 1:
            raise Fp8WeightError(f"tensor {name!r} has shape {list(t.shape)}, expected one per-tensor scale")
        s = t.float().reshape(1) * _scale_factor(layer)
        layer.input_scale.copy_(torch.maximum(layer.input_scale, s))
    else:
        raise Fp8WeightError(f"tensor {name!r}: no {part.kind} in {layer.extra_repr()}")


__all__ = ["Fp8Part", "Fp8WeightError", "begin", "fp8_parts", "store"]
