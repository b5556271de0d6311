"""Tests for hip_ext: CU masks (pure Python), the native ctypes path against a FAKE libamdhip64.so
built here with gcc, and the hip-python path against a fake ``hip`` module object. No GPU used."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from hip_ext.build import LIB_NAME, build_native, compile_shared, find_hip_include
from hip_ext.cumask import (
    cu_mask_words,
    decode_mask,
    mask_to_cu_ids,
    num_words,
    prefill_mask,
    round_to_granularity,
    xcd_balance,
)
from hip_ext.streams import (
    CuMaskMismatchError,
    HipError,
    HipPythonBackend,
    NativeBackend,
    create_cu_mask_stream,
    destroy_stream,
)

FAKE_SRC = Path(__file__).resolve().parent.parent / "hip_ext" / "tests_fake" / "fake_hip.c"

# ---------------------------------------------------------------- masks


def test_mi300x_decode_32_is_4_per_xcd() -> None:
    # MI300X: 304 CUs, 8 XCDs (38 CUs each); bit i -> XCD i % 8.
    words = decode_mask(32, 304)
    assert len(words) == num_words(304) == 10
    assert words == [0xFFFFFFFF] + [0] * 9
    assert xcd_balance(words, 304, 8) == [4] * 8
    pre = prefill_mask(32, 304)
    assert xcd_balance(pre, 304, 8) == [34] * 8
    assert [a & b for a, b in zip(words, pre, strict=True)] == [0] * 10
    assert [a | b for a, b in zip(words, pre, strict=True)] == cu_mask_words(range(304), 304)
    assert pre[-1] == 0x0000FFFF  # 304 = 9*32 + 16: no bits beyond CU 303


def test_mi300a_228_cus_6_xcds() -> None:
    # MI300A assumed: 228 CUs, 6 XCDs (38 CUs each); bit i -> XCD i % 6.
    words = decode_mask(36, 228)
    assert len(words) == 8
    assert xcd_balance(words, 228, 6) == [6] * 6
    assert xcd_balance(prefill_mask(36, 228), 228, 6) == [32] * 6
    assert mask_to_cu_ids(prefill_mask(36, 228), 228) == list(range(36, 228))
    assert prefill_mask(36, 228)[-1] == 0xF  # 228 = 7*32 + 4


def test_odd_cu_count_77() -> None:
    words = decode_mask(20, 77)
    assert words == [0x000FFFFF, 0, 0]
    pre = prefill_mask(20, 77)
    assert pre == [0xFFF00000, 0xFFFFFFFF, 0x1FFF]
    assert xcd_balance(words, 77, 7) == [3, 3, 3, 3, 3, 3, 2]
    assert xcd_balance(words, 77, 1) == [20]
    assert round_to_granularity(20, 77, 7) == 21
    assert round_to_granularity(76, 77, 7) == 77 // 7 * 7
    assert round_to_granularity(1, 77, 7) == 7


def test_cu_mask_words_arbitrary_and_roundtrip() -> None:
    ids = [0, 31, 32, 63, 64, 303]
    words = cu_mask_words(ids, 304)
    assert words[0] == 0x80000001 and words[1] == 0x80000001 and words[2] == 1 and words[9] == 1 << 15
    assert mask_to_cu_ids(words, 304) == ids
    assert round_to_granularity(30, 304, 8) == 32
    assert round_to_granularity(300, 304, 8) == 304


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (lambda: cu_mask_words([], 304), "empty CU mask"),
        (lambda: cu_mask_words([304], 304), "CU id 304 is out of range"),
        (lambda: cu_mask_words([-1], 304), "CU id -1 is out of range"),
        (lambda: decode_mask(0, 304), "prefix_count=0 gives an empty mask"),
        (lambda: decode_mask(305, 304), "prefix_count=305 exceeds num_cus=304"),
        (lambda: decode_mask(-3, 304), "prefix_count=-3 is negative"),
        (lambda: prefill_mask(304, 304), "decode_count=304 leaves prefill an empty mask"),
        (lambda: prefill_mask(-1, 304), "decode_count=-1 is negative"),
        (lambda: prefill_mask(400, 304), "decode_count=400 exceeds"),
        (lambda: decode_mask(4, 0), "num_cus=0 is invalid"),
        (lambda: xcd_balance(decode_mask(4, 304), 304, 7), "num_xcds=7 does not divide num_cus=304"),
        (lambda: xcd_balance(decode_mask(4, 304), 304, 0), "num_xcds=0 is invalid"),
        (lambda: xcd_balance([1], 304, 8), "mask has 1 words; 10 are required"),
        (lambda: mask_to_cu_ids([0, 0, 1 << 13], 77), "sets CU 77, beyond num_cus=77"),
        (lambda: round_to_granularity(8, 304, 0), "granularity=0 is invalid"),
        (lambda: round_to_granularity(-8, 304, 8), "count=-8 is negative"),
        (lambda: round_to_granularity(8, 4, 8), "granularity=8 exceeds num_cus=4"),
    ],
)
def test_mask_errors(fn: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fn()


# ---------------------------------------------------------------- native path vs fake libamdhip64

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not available")


@pytest.fixture(scope="module")
def native_libs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("gcc") is None:
        pytest.skip("gcc not available")
    d = tmp_path_factory.mktemp("hipnative")
    fake = compile_shared([FAKE_SRC], d / "fake" / "libamdhip64.so")
    lib = build_native(d / "real").path
    return lib, fake


def _read_log(path: Path) -> list[tuple[str, list[int]]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        name, *hexwords = line.split()
        out.append((name, [int(h, 16) for h in hexwords]))
    return out


@pytest.fixture()
def fake_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native_libs: tuple[Path, Path]) -> Path:
    log = tmp_path / "fake_hip.log"
    monkeypatch.setenv("FAKE_HIP_LOG", str(log))
    monkeypatch.delenv("FAKE_HIP_FAIL", raising=False)
    monkeypatch.setenv("RAPIDSERVE_LIBAMDHIP64", str(native_libs[1]))
    return log


@needs_gcc
@pytest.mark.parametrize(("count", "num_cus"), [(32, 304), (36, 228), (20, 77)])
def test_native_records_and_reads_back(
    native_libs: tuple[Path, Path], fake_env: Path, count: int, num_cus: int
) -> None:
    backend = NativeBackend(native_libs[0])  # library path from RAPIDSERVE_LIBAMDHIP64
    assert backend.hip_library == str(native_libs[1])
    for words in (decode_mask(count, num_cus), prefill_mask(count, num_cus)):
        s = create_cu_mask_stream(words, backend)
        assert s.handle
        assert backend.get_mask(s.handle, len(words)) == words
        destroy_stream(s)
        destroy_stream(s)  # idempotent
    log = _read_log(fake_env)
    created = [w for name, w in log if name == "hipExtStreamCreateWithCUMask"]
    read = [w for name, w in log if name == "hipExtStreamGetCUMask"]
    assert created == [decode_mask(count, num_cus), prefill_mask(count, num_cus)]
    assert read == [decode_mask(count, num_cus)] * 2 + [prefill_mask(count, num_cus)] * 2
    assert sum(name == "hipStreamDestroy" for name, _ in log) == 2


@needs_gcc
def test_native_built_with_shim_also_works(tmp_path: Path, native_libs: tuple[Path, Path], fake_env: Path) -> None:
    res = build_native(tmp_path / "shim", use_shim=True)
    assert res.used_shim and res.path.name == LIB_NAME
    s = create_cu_mask_stream(decode_mask(8, 304), NativeBackend(res.path))
    destroy_stream(s)
    assert _read_log(fake_env)[0] == ("hipExtStreamCreateWithCUMask", decode_mask(8, 304))


@needs_gcc
@pytest.mark.parametrize(
    ("fail", "call", "code"),
    [
        ("hipExtStreamCreateWithCUMask", "hipExtStreamCreateWithCUMask", 1),
        ("hipExtStreamCreateWithCUMask:101", "hipExtStreamCreateWithCUMask", 101),
        ("hipExtStreamGetCUMask:101", "hipExtStreamGetCUMask", 101),
    ],
)
def test_native_errors_become_hiperror(
    native_libs: tuple[Path, Path], fake_env: Path, monkeypatch: pytest.MonkeyPatch, fail: str, call: str, code: int
) -> None:
    monkeypatch.setenv("FAKE_HIP_FAIL", fail)
    backend = NativeBackend(native_libs[0])
    with pytest.raises(HipError, match=rf"{call} failed with hipError_t {code}") as info:
        create_cu_mask_stream(decode_mask(32, 304), backend)
    assert (info.value.call, info.value.code) == (call, code)
    if call == "hipExtStreamGetCUMask":  # the stream made before the failed read-back is destroyed
        assert [n for n, _ in _read_log(fake_env)][-1] == "hipStreamDestroy"


@needs_gcc
def test_native_destroy_error(native_libs: tuple[Path, Path], fake_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = NativeBackend(native_libs[0])
    s = create_cu_mask_stream(decode_mask(32, 304), backend)
    monkeypatch.setenv("FAKE_HIP_FAIL", "hipStreamDestroy:709")
    with pytest.raises(HipError, match="hipStreamDestroy failed with hipError_t 709"):
        destroy_stream(s)
    assert not s.destroyed
    monkeypatch.delenv("FAKE_HIP_FAIL")
    destroy_stream(s)
    assert s.destroyed


@needs_gcc
def test_native_missing_library(native_libs: tuple[Path, Path], tmp_path: Path) -> None:
    backend = NativeBackend(native_libs[0], hip_library=str(tmp_path / "nope" / "libamdhip64.so"))
    with pytest.raises(HipError, match="hipExtStreamCreateWithCUMask failed with hipError_t 303") as info:
        create_cu_mask_stream(decode_mask(32, 304), backend)
    assert info.value.code == 303


def test_header_detection_reports_something() -> None:
    inc = find_hip_include()
    assert inc is None or (inc / "hip" / "hip_runtime_api.h").is_file()


# ---------------------------------------------------------------- hip-python path vs fake module


class FakeHipModule:
    """Stub of hip-python's ``hip`` module: tuple-returning, never raises."""

    def __init__(self, fail: dict[str, int] | None = None, corrupt_readback: bool = False) -> None:
        self.fail = fail or {}
        self.corrupt = corrupt_readback
        self.calls: list[tuple[str, list[int]]] = []
        self.streams: dict[int, list[int]] = {}
        self._next = 0x1000

    def hipExtStreamCreateWithCUMask(self, n: int, words: Sequence[int]) -> tuple[int, int | None]:  # noqa: N802
        self.calls.append(("hipExtStreamCreateWithCUMask", list(words)))
        if "hipExtStreamCreateWithCUMask" in self.fail:
            return self.fail["hipExtStreamCreateWithCUMask"], None
        assert n == len(words)
        self._next += 0x10
        self.streams[self._next] = list(words)
        return 0, self._next

    def hipExtStreamGetCUMask(self, stream: int, n: int, out: Any) -> tuple[int]:  # noqa: N802
        if "hipExtStreamGetCUMask" in self.fail:
            return (self.fail["hipExtStreamGetCUMask"],)
        for i, w in enumerate(self.streams[stream][:n]):
            out[i] = w ^ (1 if self.corrupt and i == 0 else 0)
        self.calls.append(("hipExtStreamGetCUMask", list(out)))
        return (0,)

    def hipStreamDestroy(self, stream: int) -> tuple[int]:  # noqa: N802
        self.calls.append(("hipStreamDestroy", []))
        if "hipStreamDestroy" in self.fail:
            return (self.fail["hipStreamDestroy"],)
        del self.streams[stream]
        return (0,)


def test_hip_python_path_ok() -> None:
    hip = FakeHipModule()
    backend = HipPythonBackend(hip)
    words = decode_mask(32, 304)
    s = create_cu_mask_stream(words, backend)
    assert hip.streams[s.handle] == words
    destroy_stream(s)
    assert hip.calls == [
        ("hipExtStreamCreateWithCUMask", words),
        ("hipExtStreamGetCUMask", words),
        ("hipStreamDestroy", []),
    ]
    assert hip.streams == {}


@pytest.mark.parametrize("call", ["hipExtStreamCreateWithCUMask", "hipExtStreamGetCUMask", "hipStreamDestroy"])
@pytest.mark.parametrize("code", [1, 101])
def test_hip_python_error_codes(call: str, code: int) -> None:
    hip = FakeHipModule(fail={call: code})
    backend = HipPythonBackend(hip)
    with pytest.raises(HipError, match=rf"^{call} failed with hipError_t {code}$") as info:
        s = create_cu_mask_stream(prefill_mask(36, 228), backend)
        destroy_stream(s)
    assert (info.value.call, info.value.code) == (call, code)
    if call == "hipExtStreamGetCUMask":
        assert hip.streams == {}  # cleaned up after the failed read-back


def test_hip_python_enum_error_and_mismatch() -> None:
    class Err:
        value = 101

    hip = FakeHipModule(fail={"hipExtStreamCreateWithCUMask": Err()})  # type: ignore[dict-item]
    with pytest.raises(HipError, match="hipError_t 101"):
        create_cu_mask_stream(decode_mask(4, 77), HipPythonBackend(hip))
    hip = FakeHipModule(corrupt_readback=True)
    with pytest.raises(CuMaskMismatchError, match="read back"):
        create_cu_mask_stream(decode_mask(4, 77), HipPythonBackend(hip))
    assert hip.streams == {}


def test_stream_word_validation() -> None:
    backend = HipPythonBackend(FakeHipModule())
    with pytest.raises(ValueError, match="empty CU mask"):
        create_cu_mask_stream([], backend)
    with pytest.raises(ValueError, match="no bits set"):
        create_cu_mask_stream([0, 0], backend)
    with pytest.raises(ValueError, match="not a uint32"):
        create_cu_mask_stream([1 << 32], backend)
