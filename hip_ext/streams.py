"""CU-masked HIP streams behind one interface, with two backends.

* :class:`HipPythonBackend` -- ``from hip import hip`` (PyPI ``hip-python``). Its calls return
  tuples whose first item is the ``hipError_t`` and never raise, so every result is checked here.
* :class:`NativeBackend` -- ``libhip_cumask.so`` (see :mod:`hip_ext.build`) through ctypes; that
  library dlopens ``libamdhip64.so`` (or ``$RAPIDSERVE_LIBAMDHIP64``, read when the backend is made).

Every HIP failure becomes :class:`HipError` carrying the call name and the error code.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from hip_ext.build import hip_library_path

HIP_SUCCESS = 0


class HipError(RuntimeError):
    """A HIP call returned a non-zero ``hipError_t``."""

    def __init__(self, call: str, code: int, detail: str = "") -> None:
        self.call = call
        self.code = int(code)
        msg = f"{call} failed with hipError_t {self.code}"
        super().__init__(f"{msg}: {detail}" if detail else msg)


class CuMaskMismatchError(RuntimeError):
    """``hipExtStreamGetCUMask`` read back a mask different from the one asked for."""

    def __init__(self, asked: Sequence[int], got: Sequence[int]) -> None:
        self.asked = list(asked)
        self.got = list(got)
        super().__init__(
            "hipExtStreamGetCUMask read back "
            f"{[hex(w) for w in self.got]} but {[hex(w) for w in self.asked]} was asked for"
        )


class StreamBackend(Protocol):
    name: str

    def create(self, words: Sequence[int]) -> Any: ...

    def get_mask(self, handle: Any, n_words: int) -> list[int]: ...

    def destroy(self, handle: Any) -> None: ...


def _err_code(err: Any) -> int:
    """hip-python returns an enum (IntEnum-like, with ``.value``) or an int."""
    value = getattr(err, "value", err)
    return int(value)


def _check_words(words: Sequence[int]) -> list[int]:
    out = [int(w) for w in words]
    if not out:
        raise ValueError("empty CU mask word list: at least one uint32 word is required")
    for i, w in enumerate(out):
        if not 0 <= w <= 0xFFFFFFFF:
            raise ValueError(f"mask word {i}={w!r} is not a uint32 (allowed 0..0xFFFFFFFF)")
    if not any(out):
        raise ValueError("CU mask has no bits set: at least one CU is required")
    return out


class HipPythonBackend:
    """Backend over hip-python's ``hip`` module (or any object with the same API, e.g. a test fake)."""

    name = "hip-python"

    def __init__(self, hip_module: Any | None = None) -> None:
        if hip_module is None:
            from hip import hip as hip_module  # type: ignore[import-not-found,no-redef]
        self.hip = hip_module

    def _call(self, call: str, *args: Any) -> tuple[Any, ...]:
        result = getattr(self.hip, call)(*args)
        if not isinstance(result, tuple):
            result = (result,)
        code = _err_code(result[0])
        if code != HIP_SUCCESS:
            raise HipError(call, code)
        return result

    def create(self, words: Sequence[int]) -> Any:
        res = self._call("hipExtStreamCreateWithCUMask", len(words), list(words))
        return res[1]

    def get_mask(self, handle: Any, n_words: int) -> list[int]:
        out = array.array("I", [0] * n_words)
        res = self._call("hipExtStreamGetCUMask", handle, n_words, out)
        # Accept the mask either written into ``out`` or returned as the second item.
        if len(res) > 1 and res[1] is not None:
            return [int(w) for w in res[1]]
        return [int(w) for w in out]

    def destroy(self, handle: Any) -> None:
        self._call("hipStreamDestroy", handle)


class NativeBackend:
    """Backend over ``libhip_cumask.so`` via ctypes."""

    name = "native"

    def __init__(self, lib_path: str | Path, hip_library: str | None = None) -> None:
        self.lib = ctypes.CDLL(str(lib_path))
        u32, u32p, vpp = ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_void_p)
        self.lib.rs_set_library_path.argtypes = [ctypes.c_char_p]
        self.lib.rs_set_library_path.restype = ctypes.c_int
        self.lib.rs_create_cu_mask_stream.argtypes = [u32, u32p, vpp]
        self.lib.rs_create_cu_mask_stream.restype = ctypes.c_int
        self.lib.rs_get_cu_mask.argtypes = [ctypes.c_void_p, u32, u32p]
        self.lib.rs_get_cu_mask.restype = ctypes.c_int
        self.lib.rs_destroy_stream.argtypes = [ctypes.c_void_p]
        self.lib.rs_destroy_stream.restype = ctypes.c_int
        self.lib.rs_last_dl_error.argtypes = []
        self.lib.rs_last_dl_error.restype = ctypes.c_char_p
        self.hip_library = hip_library or hip_library_path()
        rc = self.lib.rs_set_library_path(self.hip_library.encode())
        if rc != HIP_SUCCESS:
            raise HipError("rs_set_library_path", rc, self.hip_library)

    def _check(self, call: str, rc: int) -> None:
        if rc != HIP_SUCCESS:
            detail = (self.lib.rs_last_dl_error() or b"").decode(errors="replace")
            raise HipError(call, rc, detail)

    def create(self, words: Sequence[int]) -> int:
        arr = (ctypes.c_uint32 * len(words))(*words)
        out = ctypes.c_void_p()
        self._check("hipExtStreamCreateWithCUMask", self.lib.rs_create_cu_mask_stream(len(words), arr, out))
        return int(out.value or 0)

    def get_mask(self, handle: int, n_words: int) -> list[int]:
        out = (ctypes.c_uint32 * n_words)()
        self._check("hipExtStreamGetCUMask", self.lib.rs_get_cu_mask(ctypes.c_void_p(handle), n_words, out))
        return list(out)

    def destroy(self, handle: int) -> None:
        self._check("hipStreamDestroy", self.lib.rs_destroy_stream(ctypes.c_void_p(handle)))


@dataclass
class CuMaskStream:
    handle: Any
    words: tuple[int, ...]
    backend: StreamBackend
    destroyed: bool = False


def create_cu_mask_stream(words: Sequence[int], backend: StreamBackend, *, verify: bool = True) -> CuMaskStream:
    """Create a stream restricted to the CUs in ``words``; with ``verify`` read the mask back.

    On a read-back failure or mismatch the stream is destroyed before the error propagates.
    """
    checked = _check_words(words)
    handle = backend.create(checked)
    stream = CuMaskStream(handle=handle, words=tuple(checked), backend=backend)
    if verify:
        try:
            got = backend.get_mask(handle, len(checked))
            if list(got) != checked:
                raise CuMaskMismatchError(checked, got)
        except BaseException:
            with contextlib.suppress(HipError):  # the read-back error is the one to report
                destroy_stream(stream)
            raise
    return stream


def destroy_stream(stream: CuMaskStream) -> None:
    """Destroy ``stream`` (idempotent)."""
    if stream.destroyed:
        return
    stream.backend.destroy(stream.handle)
    stream.destroyed = True
