"""The GPU KV pool's byte budget, and where the rest of the `--gpu-memory-utilization` share goes.

The decode worker sizes the one shared pool after loading the weights (runner/model_runner.py `_gpu_kv_budget`):

    budget = total x utilization - in use on the device - max(activation peak, decode logits floor)

where "in use on the device" is `total - free` from `cudaMemGetInfo` (this process's tensors, its caching allocator's
unused segments, CUDA contexts and anything else on the GPU), the activation peak is what a dummy prefill of the
largest step (`max_num_batched_tokens` tokens) allocated above what was allocated before it, and the floor is the
largest decode step's logits and sampling scratch (seats x vocab x 4 bytes x 3). `KVBudget.describe` says each term
in GiB, so a start-up log shows why the pool came out the size it did (on the H200 the Llama-3.1-70B fp8 shape got
37.1 GiB where vLLM 0.26 got 41.6 GiB at the same 0.8, 2026-12-01: the line says which term holds the difference).
Pure: the CUDA queries are the caller's.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = float(1 << 30)


@dataclass(frozen=True)
class KVBudget:
    total: int  # the device's memory (bytes)
    utilization: float  # --gpu-memory-utilization
    device_used: int  # total - free, after the profiling step's cache was emptied
    torch_allocated: int  # this process's live tensors (weights, graphs' pools, ...)
    torch_reserved: int  # what its caching allocator holds (allocated + unused cached segments)
    step_tokens: int  # the profiled step's tokens
    step_peak: int  # the activation peak of that step, above what was allocated before it
    logits_floor: int  # the largest decode step's logits and sampling scratch

    @property
    def reserved_for_steps(self) -> int:
        return max(self.step_peak, self.logits_floor)

    @property
    def outside_torch(self) -> int:
        """In use on the device but not by this process's allocator: CUDA contexts, cuBLAS / NCCL workspaces,
        other processes."""
        return max(0, self.device_used - self.torch_reserved)

    @property
    def kv_bytes(self) -> int:
        return int(self.total * self.utilization - self.device_used - self.reserved_for_steps)

    def describe(self) -> str:
        """One log line: each term in GiB."""
        def g(n: float) -> str:
            return f"{n / GIB:.2f}"

        step = (f"activation peak of a {self.step_tokens}-token step {g(self.step_peak)}"
                + (f" (under the decode logits floor {g(self.logits_floor)}, which is kept)"
                   if self.logits_floor > self.step_peak else ""))
        return (f"KV budget {g(max(0, self.kv_bytes))} GiB = {self.utilization:g} x {g(self.total)} GiB "
                f"- in use {g(self.device_used)} (this process's tensors {g(self.torch_allocated)}, its allocator's "
                f"unused cache {g(max(0, self.torch_reserved - self.torch_allocated))}, outside torch "
                f"{g(self.outside_torch)}: CUDA contexts, library workspaces, other processes) - {step}")


__all__ = ["GIB", "KVBudget"]
