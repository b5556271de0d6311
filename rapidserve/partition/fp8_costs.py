"""The roofline's fp8 projections (issue 39; rapidserve/quant_config.py): what a model with fp8 weights
(`--quantization fp8`, an FP8 checkpoint) reads, writes and multiplies, as the engine runs it on a GPU that
multiplies fp8 (the Triton bundle: ops/fp8_gpu.py, models/projections.py).

Which layers: each fused projection of a decoder layer (q|k|v, o, gate|up, down) that `QuantizationConfig.quantized`
names (`fp8_layers`: all of them but the checkpoint's `float_layers`); the embedding, the norms and the LM head stay
in the model dtype. A mixture-of-experts model's experts and router are never fp8 here: the config builder refuses
--quantization fp8 for them and the loader an FP8 MoE checkpoint, so a sparse layer's operators keep `b` bytes.

Per fp8 projection of a rank's [N, K] weight (b: the model dtype's bytes, T tokens; 4: a float32 scale):
* the GEMM (`fp8=True`: timed at `Peaks.fp8_flops`): flops 2*T*K*N; weight N*K bytes at one byte each plus its
  scales (`weight_scale_bytes`: one per output row, per-tensor scales being stored repeated over the rows; with
  block scales one per block, ceil(N/bn) * ceil(K/bk)); io T*K fp8 input bytes plus its scales
  (`activation_scale_bytes`: one per token; per token-group ceil(K/g) per token; per tensor or static one), and
  the T*N output at b.
* the activation quantizer: per-token activations with per-row weight scales (`ops.fp8.takes_rows`: the online
  scheme of --quantization fp8 and most channel checkpoints) have it fused into the op that makes the input
  (`projections.fused_fp8`): the RMSNorm before q|k|v and before gate|up and the SiLU-and-mul before down write
  fp8 plus one scale per token instead of b bytes a value (roofline.py's `add_norm` / `act_mul` at those counts),
  and a decode step's attention writes o_proj's quantized rows (its output is still counted at b, up to
  Hq*d*(b-1) bytes a row more than it writes). Everything else, o_proj in a step with prompt tokens and every
  projection of the other schemes, runs a quantizer of its own (`<projection>_quant`): one pass reading T*K*b,
  writing T*K + its scales, 3 flops a value. The per-tensor, static and per-group quantizers are torch code of
  several passes (`fp8.quantize_input`); one pass is counted, a lower bound.
What is not modelled: the skinny decode kernel's or cuBLASLt's reach below the copy bandwidth at small M (the
measured decode speed-up over bf16 is below the 2x of halving the weights: the online correction,
partition/correction.py, absorbs a steady bias), and a GPU without fp8 (`fp8.reference_linear` dequantizes the
weights at each call, slower than bf16; such a device has no fp8 peak: `peaks.py`).
"""

from __future__ import annotations

from rapidserve.config import ModelConfig
from rapidserve.quant_config import FUSED_PROJECTIONS, QuantizationConfig

SCALE_BYTES = 4  # a float32 scale
QUANT_FLOPS = 3  # per value of a standalone quantizer: |x|, the max, the division

# (name, flops, weight bytes, io bytes, count, fp8 GEMM): what roofline.py makes an Operator of
Term = tuple[str, float, float, float, int, bool]


def is_fp8(quant: QuantizationConfig | None) -> bool:
    return quant is not None and quant.enabled


def producer_quantizes(quant: QuantizationConfig | None) -> bool:
    """Whether the op that makes an fp8 projection's input quantizes it (module docstring; `ops.fp8.takes_rows`):
    per-token activations with per-row weight scales."""
    return is_fp8(quant) and quant is not None and quant.activations == "token" and quant.block is None


def fp8_layers(cfg: ModelConfig, quant: QuantizationConfig | None) -> dict[str, int]:
    """Per fused projection (quant_config.FUSED_PROJECTIONS), how many decoder layers hold it in fp8: every layer
    for q|k|v and o, the dense-MLP layers for gate|up and down, less the checkpoint's `float_layers` (whole fused
    groups: their first HF projection's name says, as models/decoder_layer.py builds them). All 0 for float weights
    and for the MLPs of a mixture-of-experts model's sparse layers."""
    if not is_fp8(quant):
        return dict.fromkeys(FUSED_PROJECTIONS, 0)
    assert quant is not None
    n = cfg.num_layers
    dense = list(range(n)) if cfg.moe is None else [i for i in range(n) if not cfg.moe.sparse(i)]
    where = {"qkv_proj": range(n), "o_proj": range(n), "gate_up_proj": dense, "down_proj": dense}
    if not quant.float_layers:
        return {name: len(layers) for name, layers in where.items()}
    return {name: sum(1 for i in layers if quant.quantized(f"model.layers.{i}.{FUSED_PROJECTIONS[name][0]}"))
            for name, layers in where.items()}


def weight_scale_bytes(quant: QuantizationConfig, n: int, k: int) -> int:
    """Bytes of an [n, k] fp8 weight's scales: one float32 per row, or per (bn x bk) block."""
    if quant.block is None:
        return SCALE_BYTES * n
    bn, bk = quant.block
    return SCALE_BYTES * -(-n // bn) * -(-k // bk)


def activation_scale_bytes(quant: QuantizationConfig, tokens: int, k: int) -> int:
    """Bytes of the scales of `tokens` rows of k quantized inputs: one per token, ceil(k/g) per token in groups of
    g, one for the tensor (dynamic per tensor, static)."""
    if quant.activations == "token":
        return SCALE_BYTES * tokens
    if quant.activations == "group" and quant.group is not None:
        return SCALE_BYTES * tokens * -(-k // quant.group)
    return SCALE_BYTES


def projection_terms(name: str, k: int, n: int, bias: int, layers: int, fp8: int, tokens: int, b: int,
                     quant: QuantizationConfig | None, input_quantized: bool) -> list[Term]:
    """The operators of projection `name` (a rank's [n, k] weight, `bias` bias values) over `tokens` tokens in
    `layers` layers, `fp8` of which hold it in fp8 (module docstring); `input_quantized`: its producer writes the
    fp8 rows (no quantizer of its own). Float layers: the one float GEMM, flops 2*T*K*N, weight (K*N + bias)*b,
    io T*(K + N)*b."""
    t, out = tokens, []
    if fp8:
        assert quant is not None
        scales = activation_scale_bytes(quant, t, k)
        out.append((name, 2 * t * k * n, k * n + weight_scale_bytes(quant, n, k) + bias * b,
                    t * k + scales + t * n * b, fp8, True))
        if not input_quantized:
            out.append((f"{name}_quant", QUANT_FLOPS * t * k, 0, t * k * b + t * k + scales, fp8, False))
    if layers > fp8:
        out.append((name, 2 * t * k * n, (k * n + bias) * b, t * (k + n) * b, layers - fp8, False))
    return out


def fused_producer_io(width: int, tokens: int, b: int, float_rows: int) -> int:
    """io bytes of a producer whose output rows of `width` it writes as fp8 plus one scale per token, besides
    `float_rows` rows of `width` it reads or writes at b: 3 for the RMSNorm after the residual add (hidden and
    residual read, the residual written back), 2 for SiLU-and-mul (gate and up read)."""
    return float_rows * tokens * width * b + tokens * width + SCALE_BYTES * tokens


__all__ = ["SCALE_BYTES", "Term", "activation_scale_bytes", "fp8_layers", "fused_producer_io", "is_fp8",
           "producer_quantizes", "projection_terms", "weight_scale_bytes"]
