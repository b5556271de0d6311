"""The GPU KV pool's byte budget, and where the rest of the `--gpu-memory-utilization` share goes.

The decode worker sizes the one shared pool after loading the weights (runner/model_runner.py `_gpu_kv_budget`):

    budget = total x utilization - in use on the device - max(activation peak, decode logits floor)

where "in use on the device" is `total - free` from `cudaMemGetInfo` (this process's tensors, its caching allocator's
unused segments, CUDA contexts and anything else on the GPU), the activation peak is the memory a dummy prefill of
the largest step (`max_num_batched_tokens` tokens) made the allocator reserve beyond the segments it held before
(activations that fit in the allocator's unused cache, which "in use" already counts, cost nothing more; counting
their allocated bytes again charged them twice), and the floor is the largest decode step's logits and sampling
scratch (seats x vocab x 4 bytes x 3). `KVBudget.describe` says each term in GiB, so a start-up log shows why the
pool came out the size it did. On the H200 the Llama-3.1-70B fp8 shape got 37.13 GiB where vLLM 0.26 got 41.59 GiB at
the same 0.8 (2026-12-01); the line said: 3.90 GiB of the allocator's unused cache (segments of the load's freed
temporaries, split by later allocations, so neither released nor usable by the pool: the runner now empties the
cache after the load) and a 2.34-GiB step peak counted beside it.
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
    step_peak: int  # what that step made the allocator reserve beyond the segments it held before it
    logits_floor: int  # the largest decode step's logits and sampling scratch
    step_allocated: int = 0  # that step's tensors' peak above what was allocated before it (for the log)

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

        fit = (f" (its tensors peaked at {g(self.step_allocated)}; the rest fit in the unused cache)"
               if self.step_allocated > self.step_peak else "")
        step = (f"activation peak of a {self.step_tokens}-token step {g(self.step_peak)}{fit}"
                + (f" (under the decode logits floor {g(self.logits_floor)}, which is kept)"
                   if self.logits_floor > self.step_peak else ""))
        return (f"KV budget {g(max(0, self.kv_bytes))} GiB = {self.utilization:g} x {g(self.total)} GiB "
                f"- in use {g(self.device_used)} (this process's tensors {g(self.torch_allocated)}, its allocator's "
                f"unused cache {g(max(0, self.torch_reserved - self.torch_allocated))}, outside torch "
                f"{g(self.outside_torch)}: CUDA contexts, library workspaces, other processes) - {step}")


__all__ = ["GIB", "KVBudget"]
