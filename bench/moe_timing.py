"""The clocks of bench/moe_gemm.py (and moe_candidates.py, moe_tune.py): CUDA events on a GPU, the host clock in
the CPU dry run (`timer`), a CUDA-graph replay's median (`graph_ms`), calls launched back to back from Python
(`back_to_back_ms`), and the device copy's bandwidth the memory ceilings are taken against (`copy_bandwidth`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from bench.gpu_timing import time_ms


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def cpu_time_ms(fn: Callable[[], object], reps: int, warmup: int = 0) -> list[float]:
    """Milliseconds of each of `reps` calls of fn on the host clock (the CPU dry run)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def timer(device: str) -> Callable[..., list[float]]:
    return time_ms if device == "cuda" else cpu_time_ms


def copy_bandwidth(device: str = "cuda", numel: int = 1 << 29) -> float:
    """Bytes/s (read + write) of a device copy (1 GiB of bf16 by default)."""
    src = torch.empty(numel, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = median(timer(device)(lambda: dst.copy_(src), 20))
    return 2 * src.numel() * src.element_size() / (ms / 1e3)


def graph_ms(fn: Callable[[], object], reps: int, device: str) -> float:
    """Median ms of a CUDA-graph replay of fn (the engine's decode path); on the CPU, of fn."""
    if device != "cuda":
        return median(cpu_time_ms(fn, reps))
    fn()
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        fn()
    return median(time_ms(graph.replay, reps))


def back_to_back_ms(fn: Callable[[], object], calls: int, device: str) -> float:
    """ms per call of `calls` calls of fn launched back to back from Python (one pair of events around all of them,
    after a warm-up): the larger of the host's time per call and the GPU's; on the CPU, of fn."""
    if device != "cuda":
        return median(cpu_time_ms(fn, calls))
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(calls):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / calls


def kernel_names(fn: Callable[[], object], device: str, top: int = 2) -> list[str]:
    """The names of the `top` device kernels of one call of fn that took the longest (the GEMM a library chose, for
    one), from torch's profiler; [] on the CPU or where the profiler fails."""
    if device != "cuda":
        return []
    from torch.profiler import ProfilerActivity, profile

    try:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - the names are a note: a profiler that cannot run leaves none
        return []
    us: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            us[ev.name] = us.get(ev.name, 0.0) + ev.device_time
    return sorted(us, key=lambda n: -us[n])[:top]
