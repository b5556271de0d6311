"""The `quantization` section of the config tree (`EngineConfig.quantization`): how the decoder layers' linear
layers are stored and computed.

`QuantizationConfig()` (method "none"): the checkpoint's float weights, computed in the model dtype, as always.
Method "fp8": every projection of the decoder layers (q|k|v, o, gate|up, down) that `quantized` names holds
float8 e4m3 weights with float32 scales, and its input is quantized to fp8 too (W8A8); the embedding, the norms
and the LM head stay in the model dtype. Where it comes from (`config_builder`):

- an FP8 checkpoint's `quantization_config` (`loader/fp8_checkpoint.py` reads it: compressed-tensors
  `float-quantized` / `naive-quantized` with 8-bit float weights, or Hugging Face's `fp8`);
- `--quantization fp8` (vLLM's flag; `LLM(quantization="fp8")`) on a float checkpoint or a preset: `online`, the
  float weights quantized as they load, one scale per output row, activations per token (`ONLINE_FP8`);
- `--load-format dummy` of an FP8 checkpoint: its scheme, the random float weights quantized as they load.

Scales, as the checkpoint stores them (the model's own layout: `ops/fp8.py`); the weight is W = w8 * scale:
- weights "tensor": one scale per Hugging Face projection, shape [] or [1]
- weights "channel": one per output row, [N, 1] or [N]
- weights "block": one per `block` = (rows, cols) tile, [ceil(N / rows), ceil(K / cols)]; the HF `fp8` form calls
  it `weight_scale_inv` (`scale_name`), multiplied all the same (the name is DeepSeek-V3's)
Activations x (x8 = fp8(x / s), fp8_max the format's largest value: 448 for e4m3fn, 240 for ROCm's e4m3fnuz):
- "token": dynamic, s = max|x[t, :]| / fp8_max for each token row t
- "tensor": dynamic, one s = max|x| / fp8_max over the whole [T, K] input
- "static": s = the checkpoint's `input_scale` (one per projection)
- "group": dynamic, one s per token and `block[1]` input columns (block weights only)

Plain data: imports nothing of rapidserve (config.py imports it); its errors are its own `QuantizationError`
(a ValueError), which the builder turns into a ConfigError.
"""

from __future__ import annotations

from dataclasses import dataclass

QUANTIZATION_METHODS = ("none", "fp8")
WEIGHT_STRATEGIES = ("tensor", "channel", "block")
ACTIVATION_STRATEGIES = ("token", "tensor", "static", "group")
SCALE_NAMES = ("weight_scale", "weight_scale_inv")
# the projections of a decoder layer as Hugging Face names them, by the fused tensor that holds them
FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",),
}


class QuantizationError(ValueError):
    """A quantization section that cannot be honoured; the message names the field and what is allowed."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise QuantizationError(msg)


@dataclass(frozen=True)
class QuantizationConfig:
    """How the decoder layers' projections are stored and computed (see the module docstring).

    `method`: "none" or "fp8". `weights`, `block`, `activations`: the scheme (module docstring). `scale_name`:
    the checkpoint's weight-scale tensor (`<projection>.weight_scale` or `.weight_scale_inv`). `online`: the
    checkpoint holds float weights that are quantized at load (no scale tensors are read). `float_layers`: Hugging
    Face module names of projections the checkpoint keeps in float (its ignore list resolved against the model,
    whole fused groups only). `origin`: where the scheme was read, for logs and errors."""

    method: str = "none"
    weights: str = "channel"
    block: tuple[int, int] | None = None
    activations: str = "token"
    scale_name: str = "weight_scale"
    online: bool = False
    float_layers: tuple[str, ...] = ()
    origin: str = ""

    def __post_init__(self) -> None:
        _check(self.method in QUANTIZATION_METHODS,
               f"quantization method {self.method!r}; rapidserve runs {', '.join(QUANTIZATION_METHODS)}")
        _check(self.weights in WEIGHT_STRATEGIES,
               f"fp8 weight scales {self.weights!r}; use one of {', '.join(WEIGHT_STRATEGIES)}")
        _check(self.activations in ACTIVATION_STRATEGIES,
               f"fp8 activation scales {self.activations!r}; use one of {', '.join(ACTIVATION_STRATEGIES)}")
        _check(self.scale_name in SCALE_NAMES, f"scale_name {self.scale_name!r}; use one of {', '.join(SCALE_NAMES)}")
        _check((self.block is not None) == (self.weights == "block"),
               f"fp8 block={self.block} goes with weights='block' (got weights={self.weights!r})")
        if self.block is not None:
            _check(len(self.block) == 2 and all(isinstance(b, int) and b > 0 for b in self.block),
                   f"fp8 block={self.block}: give two positive integers (rows, cols) such as (128, 128)")
        _check((self.activations == "group") == (self.weights == "block"),
               f"fp8 activations={self.activations!r} with weights={self.weights!r}: block weight scales take "
               "dynamic per-token-group activation scales ('group'), and only they do")
        _check(not (self.online and self.activations == "static"),
               "fp8 weights quantized at load have no calibrated input_scale: use dynamic activations")

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def group(self) -> int | None:
        """Input columns per activation scale ("group" activations), else None."""
        return self.block[1] if self.activations == "group" and self.block is not None else None

    def quantized(self, module: str) -> bool:
        """Whether the projection of Hugging Face module name `module` (model.layers.N.self_attn.q_proj) is fp8."""
        return self.enabled and module not in self.float_layers

    def describe(self) -> str:
        """One line for logs: the method, its scales and where it came from."""
        if not self.enabled:
            return "none (the checkpoint's float weights)"
        w = f"block {self.block[0]}x{self.block[1]}" if self.block is not None else f"per-{self.weights}"
        a = {"token": "dynamic per-token", "tensor": "dynamic per-tensor", "static": "static per-tensor",
             "group": f"dynamic per-token-group of {self.group}"}[self.activations]
        kept = f", {len(self.float_layers)} projection(s) kept in float" if self.float_layers else ""
        how = "quantized at load" if self.online else "from the checkpoint"
        return f"fp8 weights ({w} scales, {how}), {a} activation scales{kept}; {self.origin}"


ONLINE_FP8 = QuantizationConfig(method="fp8", weights="channel", activations="token", online=True,
                                origin="--quantization fp8: per-channel weight scales computed at load")
