"""The fp8 GEMMs bench/fp8_gemm_candidates.py times (issue 39): `GemmCandidate`, one GEMM's calls on an
`fp8.Fp8Linear` (per-channel weights, as `--quantization fp8` quantizes them) or why it is not there.

Row-wise (per-token activations x per-channel weights, our scheme): ours (the engine's ops bundle as routed),
cuBLASLt (`torch._scaled_mm` with row-wise scales), vLLM 0.26's CUTLASS `cutlass_scaled_mm`, FlashInfer's
`gemm.fp8_linear` (SM100+).

Tensor-wise (one scale for all the activations, one for the weight): cuBLASLt and vLLM's CUTLASS with scalar scales.
This is what vLLM 0.26 runs for `--quantization fp8` on a bf16 checkpoint (Fp8LinearMethod: per-tensor weight scale,
dynamic per-tensor activation scale; in its 70B prefill step the CUTLASS kernel with a scalar-scale epilogue,
bench/results/h200_1202c/), so these two time the kernels vLLM's engine runs, not ours' scheme: another accuracy (an
outlier row scales every row). Their layer is ours re-quantized per tensor when bound (`fp8.quantize_weight(
dequantized, "tensor")`), and for the GEMM-only call the per-token rows are re-quantized per tensor before the timing
(`prepare`, outside it), so the reference check is against the same float32 product, at QUANT_TOL (two roundings).
With quant: vLLM's `scaled_fp8_quant(x)` (dynamic per-tensor), for cuBLASLt `fp8.quantize_input(x, "tensor")` (torch,
several launches: an upper bound of a fused quantizer's cost).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.moe_candidate_kernels import import_probed, import_vllm
from rapidserve.ops import fp8, fp8_gpu, fp8_ops, get_ops, triton_fp8, triton_fp8_skinny

Gemm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x8 [M, K], sx float32) -> bf16 [M, N]
Quantized = Callable[[torch.Tensor], torch.Tensor]  # bf16 x [M, K] -> bf16 [M, N], quantizer included
Prepare = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # per-token (x8, sx) -> its own
# A candidate's calls on a layer: GEMM only, with quant, and (tensor-wise) how its GEMM-only input is made from the
# per-token rows, outside the timing
Kernel = tuple[Gemm, Quantized] | tuple[Gemm, Quantized, Prepare]


@dataclass
class GemmCandidate:
    """An fp8 GEMM: `bind(layer)` its calls on an `fp8.Fp8Linear` (None: not available, `why` says why)."""
    name: str  # the rows' key prefix (tensor-wise ones end in _t)
    label: str
    bind: Callable[[fp8.Fp8Linear], Kernel] | None
    why: str = ""
    version: str = ""


def quantizer(device: str) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The engine's per-token quantizer on `device` (the Triton kernel on a GPU, the torch definition elsewhere)."""
    dt = fp8.fp8_dtype(device)
    if device == "cuda":
        return lambda x: triton_fp8.quantize_tokens(x, dt)
    return lambda x: fp8.quantize_input(x, "token", dt)


def ours(device: str) -> GemmCandidate:
    ops = fp8_ops(get_ops(device), device)

    def bind(layer: fp8.Fp8Linear) -> Kernel:
        return (lambda x8, sx: ops.fp8_linear_rows(fp8.QuantizedRows(x8, sx, torch.bfloat16), layer, None),
                lambda x: ops.fp8_linear(x, layer, None))

    return GemmCandidate("ours", "ours", bind, version=f"{ops.name}: {ops.fp8_linear.__name__}")


def our_route(x: torch.Tensor, layer: fp8.Fp8Linear) -> str:
    """The kernel `fp8_gpu.gpu_linear` takes for x (the reference on the CPU)."""
    if not x.is_cuda:
        return "reference"
    if fp8_gpu.w8a16_routed(x.shape[0], layer):
        return "W8A16"
    if triton_fp8_skinny.routed(x, layer.weight, layer.weight_scale):
        return "skinny"
    return "_scaled_mm" if fp8_gpu.scaled_mm_ok(x, layer) else "reference"


def quantized(name: str, label: str, gemm_of: Callable[[fp8.Fp8Linear], Gemm],
              quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], version: str) -> GemmCandidate:
    """A candidate whose GEMM on a layer is `gemm_of(layer)` and whose with-quant call is `quantize`, then that."""
    def bind(layer: fp8.Fp8Linear) -> Kernel:
        gemm = gemm_of(layer)
        return gemm, lambda x: gemm(*quantize(x))

    return GemmCandidate(name, label, bind, version=version)


def cublaslt(device: str) -> GemmCandidate:
    def gemm_of(layer: fp8.Fp8Linear) -> Gemm:
        wt, sw = layer.weight.t(), layer.weight_scale.reshape(1, -1)
        return lambda x8, sx: torch._scaled_mm(x8, wt, scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16,
                                               use_fast_accum=True)

    return quantized("cublaslt", "cuBLASLt", gemm_of, quantizer(device), f"torch {torch.__version__} _scaled_mm")


def tensor_rows(x8: torch.Tensor, sx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token fp8 rows re-quantized with one scale for them all ([1, 1]): a tensor-wise GEMM's input."""
    return fp8.quantize_input(x8.float() * sx, "tensor", x8.dtype)


def tensor_weight(layer: fp8.Fp8Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's weight re-quantized with one scale ([N, K] fp8, [1] float32)."""
    return fp8.quantize_weight(layer.dequantized(), "tensor", None, layer.weight.dtype)


def cublaslt_tensor(device: str) -> GemmCandidate:
    """cuBLASLt's tensor-wise fp8 GEMM (`torch._scaled_mm` with scalar scales)."""
    dt = fp8.fp8_dtype(device)

    def bind(layer: fp8.Fp8Linear) -> Kernel:
        w8, sw = tensor_weight(layer)
        wt, sw0 = w8.t(), sw.reshape(())

        def gemm(x8: torch.Tensor, sx: torch.Tensor) -> torch.Tensor:
            return torch._scaled_mm(x8, wt, scale_a=sx.reshape(()), scale_b=sw0, out_dtype=torch.bfloat16,
                                    use_fast_accum=True)

        return gemm, lambda x: gemm(*fp8.quantize_input(x, "tensor", dt)), tensor_rows

    return GemmCandidate("cublaslt_t", "cuBLASLt tensor", bind, version=f"torch {torch.__version__} _scaled_mm, "
                         "scalar scales")


def load_vllm(path: Path | None) -> list[GemmCandidate]:
    """vLLM's CUTLASS fp8 GEMM with its quantizer, row-wise and tensor-wise (module docstring), or two that say why
    not."""
    def missing(why: str) -> list[GemmCandidate]:
        return [GemmCandidate("vllm", "vLLM", None, why=why), GemmCandidate("vllm_t", "vLLM tensor", None, why=why)]

    got = import_vllm(path, "vllm._custom_ops")
    if isinstance(got, str):
        return missing(f"vllm not importable: {got}")
    vllm, ops = got
    version = str(getattr(vllm, "__version__", "?"))
    lacks = [f for f in ("cutlass_scaled_mm", "scaled_fp8_quant") if not hasattr(ops, f)]
    if lacks:
        return missing(f"vllm {version}: no {', '.join(lacks)} in vllm._custom_ops")

    def gemm_of(layer: fp8.Fp8Linear) -> Gemm:
        b, sb = layer.weight.t(), layer.weight_scale.reshape(-1, 1).contiguous()  # [K, N] column-major, [N, 1]
        return lambda x8, sx: ops.cutlass_scaled_mm(x8, b, sx, sb, torch.bfloat16)

    def bind_tensor(layer: fp8.Fp8Linear) -> Kernel:
        w8, sw = tensor_weight(layer)
        b = w8.t()

        def gemm(x8: torch.Tensor, sx: torch.Tensor) -> torch.Tensor:
            return ops.cutlass_scaled_mm(x8, b, sx.reshape(1), sw, torch.bfloat16)

        return gemm, lambda x: gemm(*ops.scaled_fp8_quant(x)), tensor_rows

    return [quantized("vllm", "vLLM", gemm_of, lambda x: ops.scaled_fp8_quant(x, use_per_token_if_dynamic=True),
                      f"{version}: cutlass_scaled_mm"),
            GemmCandidate("vllm_t", "vLLM tensor", bind_tensor, version=f"{version}: cutlass_scaled_mm, scalar "
                          "scales")]


def load_flashinfer(path: Path | None, device: str) -> GemmCandidate:
    """FlashInfer's per-token x per-channel fp8 GEMM (`gemm.fp8_linear`), or why not."""
    def missing(why: str) -> GemmCandidate:
        return GemmCandidate("flashinfer", "FlashInfer", None, why=why)

    mod = import_probed("flashinfer", path)
    if isinstance(mod, str):
        return missing(f"flashinfer not importable: {mod}")
    version = str(getattr(mod, "__version__", "?"))
    linear = getattr(getattr(mod, "gemm", None), "fp8_linear", None)
    if linear is None:
        return missing(f"flashinfer {version} has no gemm.fp8_linear (its per-token x per-channel fp8 GEMM)")
    cap = torch.cuda.get_device_capability() if device == "cuda" else None
    if cap is None or cap < (10, 0):
        on = "the CPU" if cap is None else f"sm_{cap[0]}{cap[1]}"
        return missing(f"flashinfer {version}: gemm.fp8_linear runs on SM100/103/107 only, not {on}")
    return quantized("flashinfer", "FlashInfer", lambda layer: lambda x8, sx: linear(
        x8, layer.weight, sx.reshape(-1), layer.weight_scale, out_dtype=torch.bfloat16), quantizer(device),
        f"{version}: gemm.fp8_linear")


def make_layer(n: int, k: int, device: str, g: torch.Generator) -> fp8.Fp8Linear:
    """An [n, k] projection quantized per output channel, as `--quantization fp8` does."""
    dt = fp8.fp8_dtype(device)
    layer = fp8.Fp8Linear(n, k, dt, "token", None, torch.device(device))
    w8, s = fp8.quantize_weight(torch.randn(n, k, device=device, generator=g) / k ** 0.5, "channel", None, dt)
    layer.weight.copy_(w8)
    layer.weight_scale.copy_(s)
    return layer
