"""Loaded at start-up by the Python processes that tests/triton_interp.py runs under the Triton interpreter (its
`_env` puts this folder first on PYTHONPATH, so `site` imports this module): it makes the interpreter's device
function calls cheaper, nothing else.

Triton 3.x's interpreter re-patches `triton.language` at every call of a `@triton.jit` helper inside a kernel
(`InterpretedFunction.__call__` runs `_patch_lang(fn)`: `inspect.getmembers` over tl, tl.tensor and tl.math, about
1 ms each time). `tl.zeros`, `tl.max`, `tl.sum`, `tl.cdiv` and the kernels' own helpers are such calls, once per
program instance or per loop iteration, so the re-patching was a third of the interpreted kernels' CPU time. Within
one launch nothing undoes a patch (the launch's own patches are restored when its grid is done, the device calls'
are never restored), so a second patch for the same helper in the same launch sets the same members to equivalent
wrappers: here each helper is patched once per launch instead. The kernels' numerics, the ops they run and every
check's assertions are unchanged.

Applied only where TRITON_INTERPRET=1 and the installed Triton's `InterpretedFunction.__call__` is the one this was
written against (Triton 3.9: the source is compared); any other runs unchanged."""

from __future__ import annotations

import os

_EXPECTED = """    def __call__(self, *args, **kwargs):
        # This is a device function call
        _patch_lang(self.fn)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise InterpreterError(repr(e)) from e
"""


def _install() -> None:
    import inspect

    try:
        from triton.runtime import interpreter as ti
    except ImportError:
        return
    try:
        if inspect.getsource(ti.InterpretedFunction.__call__) != _EXPECTED:
            return
    except (AttributeError, OSError, TypeError):  # another interpreter layout, or no source to compare
        return
    patched: set[object] = set()  # the helpers patched in the launch being run
    grid_call = ti.GridExecutor.__call__

    def launch(self, *args, **kwargs):  # noqa: ANN001, ANN202 - Triton's signature
        patched.clear()
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            patched.clear()

    def device_call(self, *args, **kwargs):  # noqa: ANN001, ANN202 - Triton's signature
        if self.fn not in patched:
            ti._patch_lang(self.fn)
            patched.add(self.fn)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise ti.InterpreterError(repr(e)) from e

    ti.GridExecutor.__call__ = launch
    ti.InterpretedFunction.__call__ = device_call


if os.environ.get("TRITON_INTERPRET") == "1":
    _install()
