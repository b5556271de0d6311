"""The parallelism section of the config tree: `ParallelConfig` (tensor and data parallel sizes, the GPUs, disagg's
prefill side) and the check of a disagg layout against the model.

Plain data; `rapidserve.config` re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass

from rapidserve.config_base import check as _check
from rapidserve.config_base import divisors
from rapidserve.model_config import ModelConfig


@dataclass(frozen=True)
class ParallelConfig:
    """How many GPUs one server uses (rapidserve.parallel): `tensor_parallel_size` ranks hold a shard of every
    layer each (per rank a decode and a prefill worker in rapid mode, a hybrid worker in hybrid mode);
    `data_parallel_size` independent engines sit behind the one router. The GPUs are `devices` (indices as
    CUDA/ROCm numbers them), default 0 .. tp * dp - 1.

    Disagg mode (engine/disagg.py) runs a prefill side of `prefill_tp` ranks and a decode side of
    `tensor_parallel_size` ranks (decode owns the KV pool), `prefill_tp + tensor_parallel_size` GPUs in all:
    prefill on the first, decode on the next (`disagg_gpus`); `prefill_tensor_parallel_size` (None: the same as
    `tensor_parallel_size`) is read by disagg mode only."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    devices: tuple[int, ...] | None = None
    prefill_tensor_parallel_size: int | None = None  # --prefill-tensor-parallel-size (disagg only)

    def __post_init__(self) -> None:
        _check(self.tensor_parallel_size >= 1,
               f"tensor_parallel_size={self.tensor_parallel_size} must be >= 1 (1: no tensor parallelism)")
        _check(self.data_parallel_size >= 1,
               f"data_parallel_size={self.data_parallel_size} must be >= 1 (1: one engine)")
        _check(self.prefill_tensor_parallel_size is None or self.prefill_tensor_parallel_size >= 1,
               f"--prefill-tensor-parallel-size {self.prefill_tensor_parallel_size} must be >= 1")
        if self.devices is not None:
            _check(len(set(self.devices)) == len(self.devices) and all(d >= 0 for d in self.devices),
                   f"devices={list(self.devices)} must be distinct GPU indices")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def prefill_tp(self) -> int:
        """Disagg's prefill side's tensor-parallel size."""
        return self.prefill_tensor_parallel_size or self.tensor_parallel_size

    def gpus(self) -> tuple[int, ...]:
        """The GPU index of each (dp replica, tp rank), replica-major: engine i's rank r is [i * tp + r]."""
        return self.devices if self.devices is not None else tuple(range(self.world_size))

    def disagg_gpus(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Disagg: (the prefill ranks' GPUs, the decode ranks'): the first prefill_tp of `devices` (default
        0, 1, ...), then the next tensor_parallel_size."""
        n, m = self.prefill_tp, self.tensor_parallel_size
        gpus = self.devices if self.devices is not None else tuple(range(n + m))
        return tuple(gpus[:n]), tuple(gpus[n:n + m])

    def disagg_problem(self, model: ModelConfig) -> str | None:
        """Why disagg mode cannot run this way (None: it can): one prefill and one decode side, each sharded
        whole KV heads per rank (parallel/kv_routes.py), one side's size dividing the other's; `devices`, if given,
        listing every rank's GPU."""
        n, m, k = self.prefill_tp, self.tensor_parallel_size, model.num_kv_heads
        if self.data_parallel_size != 1:
            return (f"--mode disagg runs one prefill and one decode side: it takes no data parallelism "
                    f"(--data-parallel-size {self.data_parallel_size}); use -dp 1, or --mode rapid with -dp")
        for flag, t in (("--tensor-parallel-size", m), ("--prefill-tensor-parallel-size", n)):  # -tp: both's default
            problem = model.tp_problem(t, flag)
            if problem is not None:
                return f"--mode disagg: {problem}"
            if k % t:
                return (f"--mode disagg: {flag} {t} must divide the model's {k} KV heads (each rank holds whole "
                        f"heads of its own, which move to and from the ranks of the other side that hold them; "
                        f"replicated KV heads are not supported in disagg); use one of {divisors(k)}")
        if n % m and m % n:
            return (f"--mode disagg: --prefill-tensor-parallel-size {n} and --tensor-parallel-size {m}: one must "
                    f"divide the other (each rank of the smaller side then pairs with whole ranks of the larger); "
                    f"e.g. {n} and {n}, or {m} and {m}")
        if self.devices is not None and len(self.devices) != n + m:
            return (f"devices={list(self.devices)}: --mode disagg uses {n + m} GPUs (prefill's {n}, then "
                    f"decode's {m}); list {n + m}")
        return None

