"""Partition backends: granularity, rounding, configuration planning and checks, backend selection on CPU,
and the AMD CU-mask backend driven through a fake HIP stream backend (no GPU needed)."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import rapidserve.partition.backend as backend_mod
from hip_ext.cumask import decode_mask, mask_to_cu_ids, prefill_mask
from rapidserve.partition.backend import (
    BACKENDS,
    Granularity,
    HipCuMaskBackend,
    NoPartition,
    PartitionError,
    Role,
    check_configurations,
    cu_granularity,
    on_stream,
    open_backend,
    plan_configurations,
    round_units,
    sm_granularity,
    split_name,
    static_configuration,
)
from rapidserve.partition.profile import OVERALLOCATED, Configuration

H100 = Granularity(132, 8, 8)
MI300X = Granularity(304, 8, 8)
MI300A = Granularity(228, 6, 6)
ODD = Granularity(77, 1, 1)
SHARES = (0.125, 0.25, 0.375, 0.5)
CPU = torch.device("cpu")


# ---- Granularity ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("total", "min_units", "align"),
    [(0, 8, 8), (-132, 8, 8), (132, 0, 8), (132, 8, 0), (132, -1, 8), (132, 8, -8), (0, 0, 0)],
)
def test_granularity_rejects_non_positive_counts(total: int, min_units: int, align: int) -> None:
    with pytest.raises(ValueError, match="positive counts"):
        Granularity(total, min_units, align)


@pytest.mark.parametrize(
    ("g", "smallest"),
    [
        (H100, 8),
        (MI300X, 8),
        (MI300A, 6),
        (ODD, 1),
        (Granularity(100, 6, 4), 8),  # min 6 rounded up to a multiple of 4
        (Granularity(100, 3, 8), 8),  # alignment larger than min
        (Granularity(100, 10, 4), 12),
        (Granularity(100, 16, 8), 16),
        (Granularity(100, 2, 2), 2),
    ],
)
def test_granularity_smallest(g: Granularity, smallest: int) -> None:
    assert g.smallest == smallest
    assert g.smallest % g.align == 0 and g.smallest >= g.min_units


# ---- round_units ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("want", "g", "units"),
    [
        (16.5, H100, 16),
        (33.0, H100, 32),
        (49.5, H100, 48),
        (66.0, H100, 64),
        (13.0, H100, 16),  # nearest multiple of 8, upwards
        (35.9, H100, 32),  # nearest multiple of 8, downwards
        (0.0, H100, 8),  # clamped up to the smallest group
        (3.0, H100, 8),
        (1000.0, H100, 120),  # prefill keeps at least 8 of 132 and decode stays aligned: 124 -> 120
        (127.0, H100, 120),
        (118.0, H100, 120),
        (38.0, MI300X, 40),
        (114.0, MI300X, 112),
        (300.0, MI300X, 296),
        (28.5, MI300A, 30),
        (0.0, MI300A, 6),
        (500.0, MI300A, 222),
        (9.625, ODD, 10),
        (0.2, ODD, 1),
        (76.9, ODD, 76),
        (8.0, Granularity(16, 8, 8), 8),  # just big enough: one group each
        (100.0, Granularity(16, 8, 8), 8),
    ],
)
def test_round_units(want: float, g: Granularity, units: int) -> None:
    got = round_units(want, g)
    assert got == units
    assert got % g.align == 0 and got >= g.smallest and g.total - got >= g.smallest


@pytest.mark.parametrize(
    "g",
    [Granularity(15, 8, 8), Granularity(8, 8, 8), Granularity(1, 1, 1), Granularity(11, 6, 6), Granularity(7, 4, 2)],
)
def test_round_units_too_small_device(g: Granularity) -> None:
    with pytest.raises(PartitionError, match=f"{g.total} compute units cannot be split"):
        round_units(g.total / 2, g)


# ---- plan_configurations ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("g", "shares", "splits"),
    [
        # decode units -> prefill units (the remainder)
        (H100, SHARES, [(16, 116), (32, 100), (48, 84), (64, 68)]),
        (MI300X, SHARES, [(40, 264), (80, 224), (112, 192), (152, 152)]),
        (MI300A, SHARES, [(30, 198), (60, 168), (84, 144), (114, 114)]),
        (ODD, SHARES, [(10, 67), (19, 58), (29, 48), (38, 39)]),
        (H100, (0.5, 0.125), [(16, 116), (64, 68)]),  # sorted, fewest decode units first
        (H100, (0.9,), [(120, 12)]),  # clamped: prefill keeps the smallest group
        (H100, (0.01,), [(8, 124)]),
    ],
)
def test_plan_configurations(g: Granularity, shares: Sequence[float], splits: list[tuple[int, int]]) -> None:
    configs = plan_configurations(g, shares)
    assert configs[0] == Configuration(OVERALLOCATED, 0, g.total)
    assert [(c.decode_units, c.prefill_units) for c in configs[1:]] == splits
    assert [c.name for c in configs[1:]] == [split_name(d) for d, _ in splits]
    check_configurations(configs, g, "planned")  # what is planned is realisable


def test_plan_configurations_h100_names() -> None:
    names = [c.name for c in plan_configurations(H100, SHARES)]
    assert names == ["overallocated", "split16", "split32", "split48", "split64"]


@pytest.mark.parametrize(
    ("g", "shares", "names"),
    [
        (H100, (0.25, 0.25, 0.25), ["overallocated", "split32"]),
        (H100, (0.24, 0.25, 0.26), ["overallocated", "split32"]),  # equal after rounding
        (H100, (0.01, 0.02, 0.05), ["overallocated", "split8"]),  # all clamped to the smallest group
        (H100, (0.9, 0.95, 0.99), ["overallocated", "split120"]),
        (Granularity(16, 8, 8), SHARES, ["overallocated", "split8"]),
    ],
)
def test_plan_configurations_deduplicates(g: Granularity, shares: Sequence[float], names: list[str]) -> None:
    assert [c.name for c in plan_configurations(g, shares)] == names


@pytest.mark.parametrize("shares", [(0.0,), (1.0,), (-0.25,), (1.5,), (0.25, 1.0), (0.25, float("nan"))])
def test_plan_configurations_bad_shares(shares: Sequence[float]) -> None:
    with pytest.raises(ValueError, match="must be in \\(0, 1\\)"):
        plan_configurations(H100, shares)


def test_plan_configurations_too_small_device() -> None:
    with pytest.raises(PartitionError, match="cannot be split"):
        plan_configurations(Granularity(12, 8, 8), SHARES)


# ---- static_configuration -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("g", "share", "want"),
    [
        (H100, 0.25, Configuration("split32", 32, 100)),
        (H100, 0.125, Configuration("split16", 16, 116)),
        (H100, 0.99, Configuration("split120", 120, 12)),
        (H100, 0.001, Configuration("split8", 8, 124)),
        (MI300X, 0.5, Configuration("split152", 152, 152)),
        (MI300A, 0.125, Configuration("split30", 30, 198)),
        (ODD, 0.5, Configuration("split38", 38, 39)),
    ],
)
def test_static_configuration(g: Granularity, share: float, want: Configuration) -> None:
    assert static_configuration(g, share) == want


@pytest.mark.parametrize("share", [0.0, 1.0, -0.1, 2.0])
def test_static_configuration_bad_share(share: float) -> None:
    with pytest.raises(ValueError, match="static decode share"):
        static_configuration(H100, share)


# ---- check_configurations -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("g", "configs"),
    [
        (H100, [Configuration("split16", 16, 116)]),  # remainder 116 is not a multiple of 8: fine
        (H100, [Configuration("split120", 120, 12)]),
        (H100, [Configuration(OVERALLOCATED, 0, 132), Configuration(OVERALLOCATED, 0, 0)]),  # not checked
        (H100, plan_configurations(H100, SHARES)),
        (MI300X, plan_configurations(MI300X, SHARES)),
        (MI300A, [Configuration("split30", 30, 198), Configuration("split222", 222, 6)]),
        (ODD, [Configuration("split1", 1, 76), Configuration("split76", 76, 1)]),
        (H100, []),
    ],
)
def test_check_configurations_accepts(g: Granularity, configs: list[Configuration]) -> None:
    check_configurations(configs, g, "test")


@pytest.mark.parametrize(
    ("g", "config", "pattern"),
    [
        (H100, Configuration("split12", 12, 120), "gives decode 12 units; this device needs a multiple of 8, at least"),
        (H100, Configuration("split4", 4, 128), "gives decode 4 units"),
        (Granularity(132, 16, 8), Configuration("split8", 8, 124), "at least 16"),  # aligned, below smallest
        (MI300A, Configuration("split32", 32, 196), "multiple of 6"),
        (H100, Configuration("split16", 16, 100), "splits 116 units but this device has 132.*rapidserve profile"),
        (MI300X, Configuration("split16", 16, 116), "has 304; re-run `rapidserve profile` on this GPU"),
        (H100, Configuration("split128", 128, 4), "leaves prefill 4 units; this device needs at least 8"),
        (MI300A, Configuration("split228", 228, 0), "leaves prefill 0 units"),
    ],
)
def test_check_configurations_rejects(g: Granularity, config: Configuration, pattern: str) -> None:
    configs = [Configuration(OVERALLOCATED, 0, g.total), config]
    with pytest.raises(PartitionError, match=pattern) as info:
        check_configurations(configs, g, "profile x.json")
    assert str(info.value).startswith(f"profile x.json: configuration {config.name!r}")


# ---- device granularity -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("total", "want"),
    [
        (304, Granularity(304, 8, 8)),  # MI300X: 8 XCDs
        (228, Granularity(228, 6, 6)),  # MI300A: 6 XCDs
        (77, Granularity(77, 1, 1)),
        (120, Granularity(120, 8, 8)),
        (64, Granularity(64, 8, 8)),
        (60, Granularity(60, 6, 6)),  # divisible by 4 and 6, too small for 8 XCDs of 8
        (56, Granularity(56, 4, 4)),  # divisible by 8 but 56 < 64
        (20, Granularity(20, 2, 2)),
        (2, Granularity(2, 1, 1)),
    ],
)
def test_cu_granularity(total: int, want: Granularity) -> None:
    assert cu_granularity(total) == want


def fake_sm_resource(**sm: int) -> Any:
    return SimpleNamespace(sm=SimpleNamespace(**sm))


@pytest.mark.parametrize(
    ("sm", "want"),
    [
        (dict(smCount=132, minSmPartitionSize=8, smCoscheduledAlignment=8), Granularity(132, 8, 8)),
        (dict(smCount=108, minSmPartitionSize=2, smCoscheduledAlignment=2), Granularity(108, 2, 2)),
        (dict(smCount=132, minSmPartitionSize=4, smCoscheduledAlignment=8), Granularity(132, 4, 8)),
        (dict(smCount=132, minSmPartitionSize=8), Granularity(132, 8, 8)),  # older driver: no alignment field
        (dict(smCount=132), Granularity(132, 8, 8)),
        (dict(smCount=132, minSmPartitionSize=0, smCoscheduledAlignment=0), Granularity(132, 8, 8)),
        (dict(smCount=78, minSmPartitionSize=0, smCoscheduledAlignment=2), Granularity(78, 8, 2)),
    ],
)
def test_sm_granularity(sm: dict[str, int], want: Granularity) -> None:
    assert sm_granularity(fake_sm_resource(**sm)) == want


# ---- backends on CPU ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kind", "configs", "roles"),
    [
        ("auto", [Configuration(OVERALLOCATED, 0, 0)], ("decode",)),
        ("auto", [Configuration(OVERALLOCATED, 0, 0)], ("decode", "prefill")),
        ("none", [Configuration(OVERALLOCATED, 0, 0)], ("prefill",)),
        ("none", plan_configurations(H100, SHARES), ("decode", "prefill")),  # none ignores the splits
        ("auto", plan_configurations(H100, SHARES), ("decode", "prefill")),  # auto on CPU means none
        ("cuda-green", [Configuration(OVERALLOCATED, 0, 132)], ("decode",)),  # nothing to split
        ("hip-cumask", [Configuration(OVERALLOCATED, 0, 304)], ("prefill",)),
    ],
)
def test_open_backend_cpu_gives_no_partition(kind: str, configs: list[Configuration], roles: tuple[Any, ...]) -> None:
    b = open_backend(kind, CPU, configs, roles)
    assert isinstance(b, NoPartition) and b.kind == "none"
    assert b.names == [OVERALLOCATED]
    assert len(b.configurations) == 1 and b.configurations[0].decode_units == 0
    assert b.granularity == Granularity(b.granularity.total, 1, 1) and b.granularity.total >= 1
    for role in roles:
        assert b.stream(OVERALLOCATED, role) is None
    b.close()
    with pytest.raises(PartitionError):
        b.stream(OVERALLOCATED, roles[0])


@pytest.mark.parametrize("kind", ["bogus", "", "cuda", "AUTO", "green"])
def test_open_backend_unknown_kind(kind: str) -> None:
    with pytest.raises(PartitionError, match="use one of") as info:
        open_backend(kind, CPU, [Configuration(OVERALLOCATED, 0, 0)], ("decode",))
    for name in BACKENDS:
        assert repr(name) in str(info.value)


@pytest.mark.parametrize(
    ("kind", "configs"),
    [
        ("cuda-green", plan_configurations(H100, SHARES)),
        ("hip-cumask", plan_configurations(MI300X, SHARES)),
        ("cuda-green", [Configuration("split32", 32, 100)]),  # a static split needs a GPU too
        ("hip-cumask", [Configuration("split40", 40, 264)]),
    ],
)
def test_open_backend_gpu_kind_on_cpu(kind: str, configs: list[Configuration]) -> None:
    with pytest.raises(PartitionError, match=f"{kind!r} needs a GPU; this run is on cpu: use --partition off"):
        open_backend(kind, CPU, configs, ("decode", "prefill"))


@pytest.mark.parametrize(
    ("roles", "config", "role"),
    [
        (("decode", "prefill"), "split32", "decode"),
        (("decode",), OVERALLOCATED, "prefill"),  # a role this process did not ask for
        (("prefill",), "", "prefill"),
    ],
)
def test_no_partition_unknown_stream(roles: tuple[Any, ...], config: str, role: Any) -> None:
    b = NoPartition(CPU, roles)
    with pytest.raises(PartitionError, match=f"no stream for configuration {config!r} \\({role}\\)") as info:
        b.stream(config, role)
    assert "overallocated" in str(info.value)


def test_on_stream_none_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*a: Any, **k: Any) -> None:
        raise AssertionError("torch.cuda.stream must not be used for None")

    monkeypatch.setattr(torch.cuda, "stream", boom)
    ran = []
    with on_stream(None):
        ran.append(1)
    assert ran == [1]
    with pytest.raises(KeyError), on_stream(None):  # exceptions pass through
        raise KeyError("x")


# ---- HipCuMaskBackend with a fake stream backend --------------------------------------------------
class FakeHip:
    """The StreamBackend protocol of hip_ext.streams, in memory."""

    name = "fake"

    def __init__(self) -> None:
        self.next_handle = 0x1000
        self.masks: dict[int, list[int]] = {}
        self.destroyed: list[int] = []

    def create(self, words: Sequence[int]) -> int:
        self.next_handle += 16
        self.masks[self.next_handle] = list(words)
        return self.next_handle

    def get_mask(self, handle: int, n_words: int) -> list[int]:
        assert n_words == len(self.masks[handle])
        return list(self.masks[handle])

    def destroy(self, handle: int) -> None:
        assert handle in self.masks and handle not in self.destroyed
        self.destroyed.append(handle)


class FakeExternalStream:
    def __init__(self, handle: int) -> None:
        self.handle = handle


PLAIN = object()  # what the patched _plain_stream returns


@pytest.fixture
def fake_amd(monkeypatch: pytest.MonkeyPatch) -> Any:
    """An AMD device of 304 CUs as far as HipCuMaskBackend can tell."""
    monkeypatch.setattr(backend_mod, "_device_units", lambda device: 304)
    monkeypatch.setattr(backend_mod, "_plain_stream", lambda device: PLAIN)
    monkeypatch.setattr(torch.cuda, "ExternalStream", FakeExternalStream)
    return SimpleNamespace(type="cuda", index=0)


@pytest.mark.parametrize(
    ("shares", "roles"),
    [
        (SHARES, ("decode", "prefill")),
        (SHARES, ("decode",)),
        (SHARES, ("prefill",)),
        ((0.5,), ("decode", "prefill")),
        ((0.01, 0.99), ("decode", "prefill")),
    ],
)
def test_hip_cumask_backend_masks(fake_amd: Any, shares: Sequence[float], roles: tuple[Any, ...]) -> None:
    configs = plan_configurations(MI300X, shares)
    fake = FakeHip()
    b = HipCuMaskBackend(fake_amd, configs, roles, stream_backend=fake)
    assert b.kind == "hip-cumask" and b.granularity == MI300X and b.names == [c.name for c in configs]
    handles = set()
    for c in configs:
        for role in roles:
            s = b.stream(c.name, role)
            if c.decode_units == 0:
                assert s is PLAIN
                continue
            assert isinstance(s, FakeExternalStream)
            handles.add(s.handle)
            words = fake.masks[s.handle]
            if role == "decode":
                assert words == decode_mask(c.decode_units, 304)
                assert mask_to_cu_ids(words, 304) == list(range(c.decode_units))  # the low logical bits
            else:
                assert words == prefill_mask(c.decode_units, 304)
                assert mask_to_cu_ids(words, 304) == list(range(c.decode_units, 304))  # the complement
    n_masked = (len(configs) - 1) * len(roles)
    assert len(handles) == len(fake.masks) == n_masked and not fake.destroyed
    all_roles: tuple[Role, ...] = ("decode", "prefill")
    for other in all_roles:
        if other not in roles:
            with pytest.raises(PartitionError):
                b.stream(configs[1].name, other)
    b.close()
    assert sorted(fake.destroyed) == sorted(handles)
    b.close()  # idempotent: nothing destroyed twice
    assert len(fake.destroyed) == n_masked
    with pytest.raises(PartitionError):
        b.stream(configs[1].name, roles[0])


def test_hip_cumask_backend_overallocated_only(fake_amd: Any) -> None:
    fake = FakeHip()
    b = HipCuMaskBackend(fake_amd, [Configuration(OVERALLOCATED, 0, 304)], ("decode", "prefill"), stream_backend=fake)
    assert b.stream(OVERALLOCATED, "decode") is PLAIN and b.stream(OVERALLOCATED, "prefill") is PLAIN
    assert not fake.masks
    b.close()
    assert not fake.destroyed


@pytest.mark.parametrize(
    ("config", "pattern"),
    [
        (Configuration("split32", 32, 100), "splits 132 units but this device has 304"),  # an H100 profile
        (Configuration("split36", 36, 268), "multiple of 8"),
        (Configuration("split304", 304, 0), "leaves prefill 0 units"),
    ],
)
def test_hip_cumask_backend_refuses_unrealisable(fake_amd: Any, config: Configuration, pattern: str) -> None:
    fake = FakeHip()
    with pytest.raises(PartitionError, match=f"hip-cumask: .*{pattern}"):
        HipCuMaskBackend(fake_amd, [Configuration(OVERALLOCATED, 0, 304), config], ("decode",), stream_backend=fake)
    assert not fake.masks  # refused before any stream was created


def test_hip_cumask_backend_closes_on_mask_mismatch(fake_amd: Any) -> None:
    """A driver that reads back another mask: the stream is destroyed and the error reported."""
    from hip_ext.streams import CuMaskMismatchError

    class Liar(FakeHip):
        def get_mask(self, handle: int, n_words: int) -> list[int]:
            return [0] * n_words

    fake = Liar()
    with pytest.raises(CuMaskMismatchError):
        HipCuMaskBackend(fake_amd, plan_configurations(MI300X, (0.25,)), ("decode",), stream_backend=fake)
    assert fake.destroyed == list(fake.masks)


def test_hip_cumask_backend_failed_start_destroys_what_it_made(fake_amd: Any) -> None:
    """The driver refuses the third stream: the two made before it are destroyed, the error propagates."""
    from hip_ext.streams import HipError

    class RefusesThird(FakeHip):
        def create(self, words: Sequence[int]) -> int:
            if len(self.masks) == 2:
                raise HipError("hipExtStreamCreateWithCUMask", 1, "out of resources")
            return super().create(words)

    fake = RefusesThird()
    with pytest.raises(HipError):
        HipCuMaskBackend(fake_amd, plan_configurations(MI300X, SHARES), ("decode", "prefill"), stream_backend=fake)
    assert len(fake.masks) == 2 and sorted(fake.destroyed) == sorted(fake.masks)
