"""The device's measured ceilings the roofline (partition/roofline.py) times its operators with, and how they are
measured at start-up (`measure_peaks`: partition/plan.py logs them as "peaks measured now: ...").

Measured: the GEMM FLOP/s of one n x n x n bf16 matmul, the copy bandwidth of one large copy, and, for a model with
fp8 weights (`--quantization fp8`, an FP8 checkpoint: `QuantizationConfig.enabled`), the FLOP/s of one n x n x n
fp8 GEMM as the engine runs its large ones (`torch._scaled_mm` with row-wise float32 scales, bfloat16 out,
ops/fp8_gpu.py) on a device that multiplies fp8 (`ops.fp8.fp8_supported`: NVIDIA sm_89+, AMD gfx94x/gfx95x).
Elsewhere (a CPU, an older GPU, whose fp8 layers run `fp8.reference_linear`: the weights dequantized at each call)
no fp8 peak is measured and `Peaks.fp8_flops` assumes twice the bf16 one, which is the fp8 tensor cores' rate on
Hopper and MI300, not that reference path's.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    import torch

FP8_OVER_BF16 = 2.0  # `Peaks.fp8_flops` where no fp8 peak was measured: fp8 tensor cores' rate over bf16's


class Peaks(msgspec.Struct, frozen=True):
    """Measured ceilings of one device plus the model's fitted constants (defaults: H100, docs/measured.md).

    matmul_flops: bf16 GEMM FLOP/s on the whole device; hbm_bw: copy bandwidth, bytes/s (read+write).
    fp8_matmul_flops: fp8 GEMM FLOP/s on the whole device (`torch._scaled_mm`, row-wise scales), measured for a
    model with fp8 weights on a device that multiplies fp8; None where it was not (`fp8_flops` then assumes
    FP8_OVER_BF16 = 2 x matmul_flops, the dense fp8 tensor-core rate over bf16's on Hopper and MI300).
    gemm_efficiency / attn_efficiency: fraction of the GEMM peak (bf16's or fp8's) that serving-shaped GEMMs /
    attention kernels reach (assumed: cuBLAS at K=4096-14336, FlashAttention-2-class SDPA). bw_efficiency:
    fraction of copy bandwidth that weight/KV streaming reaches (fitted with bw_knee to docs/measured.md's
    decode chain, taking 2.98e12 B/s as that H100's copy bandwidth). The contention and overalloc
    constants are explained in partition/roofline.py's docstring. Defaults suit an H100; `measure_peaks` fills the
    measured fields and keeps them, so `roofline_error.compare` against a measured profile tells how far
    they carry.
    """

    matmul_flops: float
    hbm_bw: float
    num_compute_units: int
    gemm_efficiency: float = 0.85
    attn_efficiency: float = 0.5
    bw_efficiency: float = 0.88
    bw_knee: float = 0.285
    split_contention: float = 0.36
    prefill_contention: float = 0.47
    overalloc_wait: float = 0.44
    link_bw: float = 300e9  # bytes/s of a ring all-reduce between GPUs (NVLink-class); only used at tp > 1
    link_latency_s: float = 10e-6
    device: str = ""
    fp8_matmul_flops: float | None = None

    def __post_init__(self) -> None:
        pos = ("matmul_flops", "hbm_bw", "num_compute_units", "bw_knee", "link_bw", "overalloc_wait")
        bad = [f"{f} must be > 0" for f in pos if not getattr(self, f) > 0]
        eff = ("gemm_efficiency", "attn_efficiency", "bw_efficiency")
        bad += [f"{f} must be in (0, 1]" for f in eff if not 0 < getattr(self, f) <= 1]
        bad += [f"{f} must be >= 0" for f in ("split_contention", "prefill_contention", "link_latency_s")
                if not getattr(self, f) >= 0]
        if self.fp8_matmul_flops is not None and not self.fp8_matmul_flops > 0:
            bad.append("fp8_matmul_flops must be > 0 (or None: not measured)")
        if bad:
            raise ValueError("Peaks: " + "; ".join(bad) + f" (got {self})")

    @property
    def fp8_flops(self) -> float:
        """The fp8 GEMM FLOP/s an fp8 projection is timed with: the measured one, else FP8_OVER_BF16 x the bf16."""
        return FP8_OVER_BF16 * self.matmul_flops if self.fp8_matmul_flops is None else self.fp8_matmul_flops


def describe_peaks(peaks: Peaks, fp8: bool = False) -> str:
    """One line for the start-up log; `fp8`: the run has fp8 weights, so its fp8 GEMM peak is said too."""
    out = f"peaks measured now: GEMM {peaks.matmul_flops / 1e12:.0f} TFLOP/s, copy {peaks.hbm_bw / 1e12:.2f} TB/s"
    if not fp8:
        return out
    if peaks.fp8_matmul_flops is None:
        return out + f", fp8 GEMM not measured (assumed {FP8_OVER_BF16:g} x bf16: {peaks.fp8_flops / 1e12:.0f} TFLOP/s)"
    return out + f", fp8 GEMM {peaks.fp8_matmul_flops / 1e12:.0f} TFLOP/s"


def _median_seconds(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    """Median wall time of `fn` over `reps` runs after warm-ups (CUDA events on a GPU). A GPU gets 20
    warm-ups (its clocks ramp up after the idle of model loading: with two, start-up measurements of one
    H200 are suspected of flipping the adaptive manager's choice between two runs of one build)."""
    import torch

    cuda, times = device.type == "cuda", []
    for _ in range(20 if cuda else 2):
        fn()
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fp8_gemm_flops(device: torch.device, n: int, reps: int) -> float:
    """FLOP/s (2n^3 a GEMM) of one n x n x n fp8 GEMM the way the engine runs its large ones (ops/fp8_gpu.py's
    `_scaled_mm`): fp8 activations [n, n] row-major times an fp8 weight [n, n] read as its transpose, row-wise
    float32 scales (one per activation row, one per weight row), bfloat16 out, the engine's `use_fast_accum`.
    In the device's fp8 format (`ops.fp8.fp8_dtype`: e4m3fnuz on gfx94x). Callers check `fp8_supported` first
    (`measure_peaks`); torch's CPU kernel also runs it (the tests' small n)."""
    import torch

    from rapidserve.ops.fp8 import fp8_dtype

    fast_accum = True
    if device.type == "cuda":
        from rapidserve.ops.fp8_gpu import FAST_ACCUM

        fast_accum = FAST_ACCUM
    f8 = fp8_dtype(device)
    a = torch.randn(n, n, device=device).to(f8)
    w = torch.randn(n, n, device=device).to(f8)
    sa = torch.ones(n, 1, device=device, dtype=torch.float32)
    sw = torch.ones(1, n, device=device, dtype=torch.float32)
    wt = w.t()
    return 2 * n**3 / _median_seconds(
        lambda: torch._scaled_mm(a, wt, scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16, use_fast_accum=fast_accum),
        reps, device)


def measure_peaks(device: str | torch.device = "cuda", dtype: torch.dtype | None = None, *, reps: int = 15,
                  fp8: bool = False) -> Peaks:
    """Measure GEMM FLOP/s (n x n x n: 2n^3 flops) and copy bandwidth (read + write bytes) on `device`; with `fp8`
    (the model's weights are fp8) also the fp8 GEMM FLOP/s (`fp8_gemm_flops`) where the device multiplies fp8
    (`ops.fp8.fp8_supported`), else `fp8_matmul_flops` stays None (module docstring).

    Medians of `reps` timed runs. A GPU takes well under 3 s (n=8192, 256 MiB bf16 copy; the fp8 GEMM adds a
    fraction of a second); CPU uses small sizes (n=256, 4 MiB) so tests stay quick. The fitted constants keep their
    defaults.
    """
    import torch

    dev = torch.device(device)
    dt = torch.bfloat16 if dtype is None else dtype
    n, elems = (8192, 1 << 27) if dev.type == "cuda" else (256, 1 << 21)
    a, w = torch.randn(n, n, device=dev, dtype=dt), torch.randn(n, n, device=dev, dtype=dt)
    flops = 2 * n**3 / _median_seconds(lambda: torch.mm(a, w), reps, dev)
    src = torch.empty(elems, device=dev, dtype=dt)
    dst = torch.empty_like(src)
    bw = 2 * src.numel() * src.element_size() / _median_seconds(lambda: dst.copy_(src), reps, dev)
    fp8_flops = None
    if fp8:
        from rapidserve.ops.fp8 import fp8_supported

        if fp8_supported(dev):
            fp8_flops = fp8_gemm_flops(dev, n, reps)
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        return Peaks(flops, bw, props.multi_processor_count, device=props.name, fp8_matmul_flops=fp8_flops)
    return Peaks(flops, bw, os.cpu_count() or 1, device="cpu", fp8_matmul_flops=fp8_flops)


__all__ = ["FP8_OVER_BF16", "Peaks", "describe_peaks", "fp8_gemm_flops", "measure_peaks"]
