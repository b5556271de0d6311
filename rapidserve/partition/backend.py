"""Compute partitioning backends: one interface over NVIDIA green contexts, AMD CU masks and none.

A *configuration* splits the GPU's compute units (SMs / CUs) between decode and prefill:
`overallocated` (both use every unit) or `splitN` (decode gets N units, prefill the rest). All of a
run's configurations are created at start-up (creating one costs milliseconds and is not safe to do
between steps) and each process asks for the streams of its role:

* `cuda-green`: one `cuDevSmResourceSplitByCount` per split; decode takes group 0 (aligned), prefill
  the remainder (whatever is left, e.g. 116 of 132 SMs). The split is deterministic, so two
  processes that split with the same count and take complementary groups get disjoint SMs. Each
  group becomes a green context whose stream is wrapped with `torch.cuda.ExternalStream`. Two
  processes only run concurrently under MPS.
* `hip-cumask`: streams from `hipExtStreamCreateWithCUMask` (hip_ext): decode gets the low logical
  bits (balanced over XCDs by construction), prefill the complement.
* `none`: one configuration (overallocated) on plain streams (CPU, or GPUs without partitioning).

Counts honour the device's granularity: NVIDIA's `minSmPartitionSize` and co-scheduling alignment
(8 and 8 on H100), on AMD the CU count with the XCD count as alignment.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rapidserve.partition.profile import OVERALLOCATED, Configuration

Role = Literal["decode", "prefill"]
BACKENDS = ("auto", "cuda-green", "hip-cumask", "none")


class PartitionError(RuntimeError):
    """A partition backend cannot be created or a configuration cannot be realised."""


@dataclass(frozen=True)
class Granularity:
    """How a device's compute units can be split."""

    total: int  # SMs (NVIDIA) or CUs (AMD)
    min_units: int  # smallest group
    align: int  # group sizes are multiples of this

    def __post_init__(self) -> None:
        if self.total <= 0 or self.min_units <= 0 or self.align <= 0:
            raise ValueError(f"granularity needs positive counts, got {self}")

    @property
    def smallest(self) -> int:
        """The smallest legal group: at least min_units, a multiple of align."""
        return -(-max(self.min_units, self.align) // self.align) * self.align


def split_name(decode_units: int) -> str:
    return f"split{decode_units}"


def round_units(want: float, g: Granularity) -> int:
    """Decode units for a wanted count: nearest multiple of the alignment, leaving prefill at least
    the smallest group. Raises PartitionError when the device is too small to split at all."""
    lo, hi = g.smallest, g.total - g.smallest
    hi -= hi % g.align
    if hi < lo:
        raise PartitionError(f"{g.total} compute units cannot be split into two groups of at least {g.smallest}")
    n = int(round(want / g.align)) * g.align
    return max(lo, min(hi, n))


def plan_configurations(g: Granularity, decode_shares: Sequence[float]) -> list[Configuration]:
    """`overallocated` plus one split per decode share (deduplicated after rounding), fewest decode
    units first."""
    for s in decode_shares:
        if not 0.0 < s < 1.0:
            raise ValueError(f"decode share {s} must be in (0, 1)")
    units = sorted({round_units(s * g.total, g) for s in decode_shares})
    return [Configuration(OVERALLOCATED, 0, g.total)] + [Configuration(split_name(d), d, g.total - d) for d in units]


def static_configuration(g: Granularity, decode_share: float) -> Configuration:
    if not 0.0 < decode_share < 1.0:
        raise ValueError(f"static decode share {decode_share} must be in (0, 1)")
    d = round_units(decode_share * g.total, g)
    return Configuration(split_name(d), d, g.total - d)


def check_configurations(configs: Sequence[Configuration], g: Granularity, where: str) -> None:
    """Every split must be realisable on this device (e.g. a profile measured elsewhere)."""
    for c in configs:
        if c.decode_units == 0:
            continue
        if c.decode_units + c.prefill_units != g.total:
            raise PartitionError(f"{where}: configuration {c.name!r} splits {c.decode_units + c.prefill_units} "
                                 f"units but this device has {g.total}; re-run `rapidserve profile` on this GPU")
        if c.decode_units < g.smallest or c.decode_units % g.align:
            raise PartitionError(f"{where}: configuration {c.name!r} gives decode {c.decode_units} units; this "
                                 f"device needs a multiple of {g.align}, at least {g.smallest}")
        if c.prefill_units < g.min_units:  # the remainder group: any size from min_units
            raise PartitionError(f"{where}: configuration {c.name!r} leaves prefill {c.prefill_units} units; "
                                 f"this device needs at least {g.min_units}")


# ---- backends ---------------------------------------------------------------------------------
class PartitionBackend:
    """Streams per (configuration, role). `stream()` returns None where the caller's current stream
    is the right one (CPU)."""

    kind = "none"

    def __init__(self, granularity: Granularity, configurations: Sequence[Configuration]) -> None:
        self.granularity = granularity
        self.configurations = list(configurations)
        self._streams: dict[tuple[str, Role], Any] = {}

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.configurations]

    def stream(self, config: str, role: Role) -> Any:
        try:
            return self._streams[(config, role)]
        except KeyError:
            raise PartitionError(f"no stream for configuration {config!r} ({role}); have {self.names}") from None

    def close(self) -> None:
        self._streams.clear()


class NoPartition(PartitionBackend):
    """One configuration, plain streams: decode and prefill share the whole device."""

    kind = "none"

    def __init__(self, device: Any, roles: Sequence[Role]) -> None:
        total = _device_units(device)
        super().__init__(Granularity(total, 1, 1), [Configuration(OVERALLOCATED, 0, total)])
        for role in roles:
            self._streams[(OVERALLOCATED, role)] = _plain_stream(device)


class CudaGreenBackend(PartitionBackend):
    """NVIDIA green contexts through cuda-bindings' driver API."""

    kind = "cuda-green"

    def __init__(self, device: Any, configurations: Sequence[Configuration], roles: Sequence[Role]) -> None:
        import torch
        from cuda.bindings import driver as cu

        self._cu = cu
        torch.zeros(1, device=device)  # the primary context exists before the driver calls
        self._dev = _ok(cu, "cuDeviceGet", cu.cuDeviceGet(device.index or 0))
        self._res = _ok(cu, "cuDeviceGetDevResource",
                        cu.cuDeviceGetDevResource(self._dev, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
        super().__init__(sm_granularity(self._res), configurations)
        check_configurations(self.configurations, self.granularity, "cuda-green")
        self._contexts: list[Any] = []
        for c in self.configurations:
            if c.decode_units == 0:
                for role in roles:
                    self._streams[(c.name, role)] = _plain_stream(device)
                continue
            groups, _n, rest = _ok(cu, "cuDevSmResourceSplitByCount",
                                   cu.cuDevSmResourceSplitByCount(1, self._res, 0, c.decode_units))
            for role in roles:
                res = groups[0] if role == "decode" else rest
                want = c.decode_units if role == "decode" else c.prefill_units
                if res.sm.smCount != want:
                    raise PartitionError(f"cuda-green: {c.name} asked {want} SMs for {role}, the driver gave "
                                         f"{res.sm.smCount}")
                self._streams[(c.name, role)] = self._green_stream(res, torch)

    def _green_stream(self, res: Any, torch: Any) -> Any:
        cu = self._cu
        desc = _ok(cu, "cuDevResourceGenerateDesc", cu.cuDevResourceGenerateDesc([res], 1))
        ctx = _ok(cu, "cuGreenCtxCreate",
                  cu.cuGreenCtxCreate(desc, self._dev, cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM))
        self._contexts.append(ctx)
        handle = _ok(cu, "cuGreenCtxStreamCreate",
                     cu.cuGreenCtxStreamCreate(ctx, cu.CUstream_flags.CU_STREAM_NON_BLOCKING, 0))
        return torch.cuda.ExternalStream(int(handle))

    def close(self) -> None:
        super().close()
        for ctx in self._contexts:
            with contextlib.suppress(Exception):
                self._cu.cuGreenCtxDestroy(ctx)
        self._contexts.clear()


class HipCuMaskBackend(PartitionBackend):
    """AMD CU-masked streams through hip_ext (hip-python, or the native module)."""

    kind = "hip-cumask"

    def __init__(self, device: Any, configurations: Sequence[Configuration], roles: Sequence[Role],
                 stream_backend: Any = None) -> None:
        import torch

        from hip_ext.cumask import decode_mask, prefill_mask
        from hip_ext.streams import HipPythonBackend, create_cu_mask_stream

        total = _device_units(device)
        super().__init__(cu_granularity(total), configurations)
        check_configurations(self.configurations, self.granularity, "hip-cumask")
        self._hip = stream_backend if stream_backend is not None else HipPythonBackend()
        self._masked: list[Any] = []
        try:
            for c in self.configurations:
                for role in roles:
                    if c.decode_units == 0:
                        self._streams[(c.name, role)] = _plain_stream(device)
                        continue
                    n = c.decode_units
                    words = decode_mask(n, total) if role == "decode" else prefill_mask(n, total)
                    s = create_cu_mask_stream(words, self._hip)
                    self._masked.append(s)
                    self._streams[(c.name, role)] = torch.cuda.ExternalStream(int(s.handle))
        except BaseException:
            self.close()  # no stream outlives a failed start-up
            raise

    def close(self) -> None:
        from hip_ext.streams import destroy_stream

        super().close()
        for s in self._masked:
            with contextlib.suppress(Exception):
                destroy_stream(s)
        self._masked.clear()


# ---- granularity ------------------------------------------------------------------------------
def sm_granularity(res: Any) -> Granularity:
    """From a CUdevResource of type SM. The alignment field is newer than the others; docs/measured.md
    measured 8 on H100, which is also the default when the driver does not report it."""
    sm = res.sm
    align = int(getattr(sm, "smCoscheduledAlignment", 0) or 8)
    return Granularity(int(sm.smCount), int(getattr(sm, "minSmPartitionSize", 0) or 8), align)


def cu_granularity(total: int) -> Granularity:
    """AMD: groups are multiples of the XCD count so low-bit masks stay balanced (MI300X: 304 CUs
    on 8 XCDs, MI300A: 228 on 6); other counts align to 1."""
    for xcds in (8, 6, 4, 2):
        if total % xcds == 0 and total >= 8 * xcds:
            return Granularity(total, xcds, xcds)
    return Granularity(total, 1, 1)


def detect_kind(device: Any) -> str:
    """What `auto` means on this device."""
    if getattr(device, "type", "cpu") != "cuda":
        return "none"
    import torch

    if torch.version.hip:
        return "hip-cumask"
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return "none"
    return "cuda-green"


def device_granularity(kind: str, device: Any) -> Granularity:
    """The granularity `kind` would use on `device`, without creating any stream."""
    if kind == "cuda-green":
        import torch
        from cuda.bindings import driver as cu

        torch.zeros(1, device=device)
        dev = _ok(cu, "cuDeviceGet", cu.cuDeviceGet(device.index or 0))
        return sm_granularity(_ok(cu, "cuDeviceGetDevResource",
                                  cu.cuDeviceGetDevResource(dev, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM)))
    if kind == "hip-cumask":
        return cu_granularity(_device_units(device))
    return Granularity(_device_units(device), 1, 1)


def open_backend(kind: str, device: Any, configurations: Sequence[Configuration],
                 roles: Sequence[Role]) -> PartitionBackend:
    if kind not in BACKENDS:
        raise PartitionError(f"partition backend {kind!r}; use one of {list(BACKENDS)}")
    if kind == "auto":
        kind = detect_kind(device)
    if kind == "none" or len(configurations) <= 1 and all(c.decode_units == 0 for c in configurations):
        return NoPartition(device, roles)
    if getattr(device, "type", "cpu") != "cuda":
        raise PartitionError(f"partition backend {kind!r} needs a GPU; this run is on {device}: use --partition off")
    if kind == "cuda-green":
        try:
            return CudaGreenBackend(device, configurations, roles)
        except ImportError as e:
            raise PartitionError("cuda-green needs cuda-bindings (pip install cuda-python) and CUDA >= 12.4: "
                                 f"{e}; or use --partition off") from e
    return HipCuMaskBackend(device, configurations, roles)


# ---- helpers ----------------------------------------------------------------------------------
def _ok(cu: Any, call: str, result: Any) -> Any:
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise PartitionError(f"{call} failed: {err}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


def _device_units(device: Any) -> int:
    if getattr(device, "type", "cpu") != "cuda":
        import os

        return os.cpu_count() or 1
    import torch

    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _plain_stream(device: Any) -> Any:
    if getattr(device, "type", "cpu") != "cuda":
        return None
    import torch

    return torch.cuda.Stream(device)


@contextlib.contextmanager
def on_stream(stream: Any) -> Iterator[None]:
    """Make `stream` current (no-op for None, i.e. CPU).

    Stream ordering: this orders nothing. Partition streams are non-blocking (green-context and torch
    side streams alike): they never wait for the default stream, nor it for them. Work on `stream`
    may read only what was written on it, on a stream it was made to wait for (`wait_stream`, an
    event), or before a host synchronize; memory it reads that another stream allocated and frees
    needs `record_stream`. The engine keeps to this by ending start-up synchronized (ModelRunner,
    capture_decode_graphs, export_shared) and by ordering a switch between partitions explicitly
    (the decode worker synchronizes the old stream; the prefill worker's new stream waits for it).
    """
    if stream is None:
        yield
        return
    import torch

    with torch.cuda.stream(stream):
        yield
