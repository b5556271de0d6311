"""The runner section of the config tree: `RunnerConfig` (device, dtype, attention backend, decode and prefill
graphs) and the dtype and backend names it accepts.

Plain data; `rapidserve.config` re-exports every name here.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from rapidserve.config_base import check as _check

DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")
DTYPE_ALIASES: MappingProxyType[str, str] = MappingProxyType({"half": "float16", "float": "float32"})  # vLLM's
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "torch", "triton", "fa3")


@dataclass(frozen=True)
class RunnerConfig:
    """How the model runs: device, dtype, attention backend, decode and prefill graphs."""

    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16 (auto: bf16 on GPU, fp32 on CPU)
    attention_backend: str = "auto"  # ATTENTION_BACKENDS
    use_cuda_graphs: bool = True
    # Decode graph buckets; the largest caps the seats (batch_limits.seats), and a worker captures those up to its
    # seats only (batch_limits.decode_graph_buckets). Up to 512, every 32 from 256: vLLM's default max_num_seqs on a
    # GPU >= 70 GiB is 1024, and at 256 a decode-heavy load queued what vLLM runs.
    graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352,
                                          384, 416, 448, 480, 512)
    # Token buckets of the piecewise prefill graphs (rapidserve/runner/prefill_graphs.py); () captures none. On the
    # H100 (Qwen3-8B) a prefill forward launched from Python waits for the host up to ~512 tokens; graphs save
    # 49-59% up to 128 tokens, 34% at 256, 5% at 512, 1% at 1024 (bench/results/h100_1127/prefill_graphs/). The
    # prefill worker and `LLM` capture those up to PREFILL_WORKER_MAX_BUCKET (512); a server's decode worker's fused
    # steps (duet, hybrid) all of them: there an eager launch of a larger step holds back the tokens of the step before.
    # Above 1024 every 128 tokens: duet ends a fused chunk on a bucket or pads it to the next (policies.on_bucket), and
    # at 256 apart that cost its fused steps ~5% of their 45-ms budget (H200, 2048:28, 2026-11-30: 42.5 ms a step where
    # the same server launching them eager filled 44.7); each bucket costs ~0.06 s of capture at start.
    prefill_graph_tokens: tuple[int, ...] = (16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024, 1152, 1280, 1408,
                                             1536, 1664, 1792, 1920, 2048)
    seed: int = 0

    def __post_init__(self) -> None:
        _check(self.dtype == "auto" or self.dtype in DTYPES,
               f"dtype={self.dtype!r} is not supported; use auto or one of {list(DTYPES)}")
        _check(self.attention_backend in ATTENTION_BACKENDS,
               f"attention_backend={self.attention_backend!r}; use one of {', '.join(ATTENTION_BACKENDS)}")
        _check(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
               f"device={self.device!r}; use auto, cpu, cuda or cuda:N")
        _check(len(self.graph_batch_sizes) > 0 and list(self.graph_batch_sizes) == sorted(self.graph_batch_sizes),
               "graph_batch_sizes must be a non-empty ascending tuple")
        _check(all(isinstance(t, int) and not isinstance(t, bool) and t > 0 for t in self.prefill_graph_tokens)
               and list(self.prefill_graph_tokens) == sorted(set(self.prefill_graph_tokens)),
               f"prefill_graph_tokens={list(self.prefill_graph_tokens)} must be positive integers, unique and "
               "ascending, e.g. (16, 64, 256, 512), or empty for no prefill graphs")

