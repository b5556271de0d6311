"""The GPU KV pool's byte budget, and where the rest of the `--gpu-memory-utilization` share goes.

The share is this engine's, as vLLM's is its instance's ("a per-instance limit": two engines at 0.45 each share a
GPU): memory other processes held when this engine's decode worker started is not charged to it. The decode worker
sizes the one shared pool after loading the weights (runner/kv_sizing.py `_gpu_kv_budget`; not with
--kv-cache-memory-bytes, which gives the pool's bytes as they are, nor --num-kv-blocks):

    budget = total x utilization - this engine's use - steps

- this engine's use: what is in use on the device now (`total - free`, cudaMemGetInfo) less what was in use when the
  runner started (`baseline_used`: other processes, and this process's CUDA context, which vLLM does not charge
  either), and never less than what this process's allocator holds beyond what it held then (`baseline_reserved`:
  an earlier engine of the same process, e.g. a second `LLM`, is not this one's). So it counts this process's
  tensors, its allocator's unused segments, library workspaces made since, and the prefill worker's CUDA context if
  it was made since;
- steps: the activation peak, i.e. the memory a dummy prefill of the largest step (`max_num_batched_tokens` tokens)
  made the allocator reserve beyond the segments it held before (activations that fit in the unused cache, which
  "this engine's use" already counts, cost nothing more; a step of more than MLP_ROW_CHUNK rows, 8192, runs its MLP
  by row slices of that many, models/projections.py, so its intermediate rows are a slice's), at least the largest
  decode step's logits and sampling scratch (seats x vocab x 4 bytes x 3); once per process of this engine that runs
  such steps on this GPU (`step_processes`: 2 in rapid mode, whose prefill worker runs prefill steps of the same
  token budget in its own allocator, which keeps its peak; 1 for the hybrid worker, `LLM` and a disaggregated decode
  GPU).
Not charged yet: the CUDA graphs' pools (the decode graphs, and the piecewise prefill graphs of both workers), which
vLLM 0.26 charges since its v0.21 (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS); they are captured after the pool exists.

Where the GPU has less free than the share (other processes hold more than 1 - utilization of it), the pool gets
what is free, less the steps' reserve, and the log says so (`short_of_share`); vLLM refuses to start there instead.
`KVBudget.describe` says each term in GiB, so a start-up log shows why the pool came out the size it did. On the H200
the Llama-3.1-70B fp8 shape got 37.13 GiB where vLLM 0.26 got 41.59 GiB at the same 0.8 (2026-12-01); the line said:
3.90 GiB of the allocator's unused cache (segments of the load's freed temporaries, split by later allocations, so
neither released nor usable by the pool: the runner now empties the cache after the load) and a 2.34-GiB step peak
counted beside it.
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
    baseline_used: int = 0  # total - free when the runner started: other processes, this process's CUDA context
    step_processes: int = 1  # this engine's processes that run steps of that size on this GPU
    baseline_reserved: int = 0  # what this process's allocator held when the runner started (an earlier engine's)

    @property
    def engine_used(self) -> int:
        """In use on the device now and charged to this engine (module docstring)."""
        return max(self.torch_reserved - self.baseline_reserved, self.device_used - self.baseline_used)

    @property
    def reserved_for_steps(self) -> int:
        """This process's step reserve, and the same step peak for each other process of the engine that runs
        steps of that size here (its allocator keeps its own peak)."""
        return max(self.step_peak, self.logits_floor) + max(0, self.step_processes - 1) * self.step_peak

    @property
    def outside_torch(self) -> int:
        """Charged to this engine but not held by this process's allocator: library workspaces (cuBLAS, NCCL),
        the prefill worker's CUDA context."""
        return max(0, self.engine_used - (self.torch_reserved - self.baseline_reserved))

    @property
    def share_kv_bytes(self) -> int:
        """The pool the share leaves."""
        return int(self.total * self.utilization - self.engine_used - self.reserved_for_steps)

    @property
    def free_kv_bytes(self) -> int:
        """The pool the device's free memory leaves."""
        return self.total - self.device_used - self.reserved_for_steps

    @property
    def short_of_share(self) -> bool:
        """Other processes hold more than the share leaves them: the pool is what is free, not the share's."""
        return self.free_kv_bytes < self.share_kv_bytes

    @property
    def kv_bytes(self) -> int:
        return min(self.share_kv_bytes, self.free_kv_bytes)

    def describe(self) -> str:
        """One log line: each term in GiB."""
        def g(n: float) -> str:
            return f"{n / GIB:.2f}"

        fit = (f" (its tensors peaked at {g(self.step_allocated)}; the rest fit in the unused cache)"
               if self.step_allocated > self.step_peak else "")
        step = (f"activation peak of a {self.step_tokens}-token step {g(self.step_peak)}{fit}"
                + (f" (under the decode logits floor {g(self.logits_floor)}, which is kept)"
                   if self.logits_floor > self.step_peak else ""))
        if self.step_processes > 1:
            step += f", and {self.step_processes - 1} more for the prefill worker's steps"
        earlier = (f", {g(self.baseline_reserved)} its allocator held: an earlier engine's"
                   if self.baseline_reserved else "")
        short = (f"; the GPU has less free than that share: the pool gets what is free, "
                 f"{g(max(0, self.free_kv_bytes))} GiB (lower --gpu-memory-utilization or free memory on the GPU to "
                 "have the share)" if self.short_of_share else "")
        return (f"KV budget {g(max(0, self.kv_bytes))} GiB = {self.utilization:g} x {g(self.total)} GiB "
                f"- this engine's use {g(self.engine_used)} (this process's tensors {g(self.torch_allocated)}, its "
                f"allocator's unused cache {g(max(0, self.torch_reserved - self.torch_allocated))}, outside torch "
                f"{g(self.outside_torch)}: library workspaces, the prefill worker's CUDA context) - {step}; not "
                f"charged: {g(self.baseline_used)} in use before it started (other processes, this process's CUDA "
                f"context{earlier}){short}")



__all__ = ["GIB", "KVBudget"]
