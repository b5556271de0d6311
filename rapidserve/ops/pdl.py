"""Programmatic dependent launch (PDL, NVIDIA compute capability 9.0 and later): whether a Triton launch uses it, and
the rules every kernel launched with it keeps. Triton is imported only to ask what it supports.

A kernel launched with PDL (Triton's `launch_pdl` option: the launch attribute programmaticStreamSerialization; a
CUDA graph keeps it as a programmatic edge) may start while the kernel before it in the stream still runs: its
programs become resident once every program of that kernel has called `gdc_launch_dependents` (PTX
griddepcontrol.launch_dependents, SASS PREEXIT) or exited. `gdc_wait` (griddepcontrol.wait, SASS ACQBULK) then blocks
until the kernel before has completed and its writes are visible. What it buys: the next kernel's launch, its
programs' placement and their prologue overlap the tail of the one before, and a weight-streaming GEMM may start
pulling its (immutable) weights into L2 before the wait (`triton_skinny`, `triton_fp8_skinny`).

The rules (each kernel's docstring says where it waits and where it lets its dependents start):
1. A kernel waits before it reads anything an earlier kernel of the step wrote, and before it writes anything (a
   buffer the allocator hands out may still be read by the kernel before). Before the wait it may only read what no
   kernel writes (weights, their scales) and compute addresses. Every program waits, those with no work included
   (the wait comes before any early return), so a kernel never completes before the one it follows.
2. A kernel lets its dependents start only after its own wait. By 1 and 2 the chain is safe transitively: a
   kernel's pre-wait reads run only once the kernel two back has completed, and its wait returns only once the
   kernel before (which waited in turn) has completed.
3. Where: small kernels (one wave of programs or less at decode: the norms, SiLU-and-mul, RoPE + KV write, the
   quantizer, the reductions) right after their wait, so the next launch (a GEMM) gets its programs resident and its
   weight prefetch going during their few microseconds; kernels whose grid may exceed one wave (the skinny GEMMs,
   the decode attention's split kernel, the MoE GEMMs) after their main loop, before the epilogue, so no waiting
   program of the next kernel takes an SM slot that one of their own later programs needs.
A kernel launched without PDL (cuBLAS, torch's, NCCL's) waits for the one before to complete, as always, and one
launched with PDL after it starts when it completes; so mixing them is safe. The kernels take a `USE_GDC` constexpr:
off, they compile without the griddepcontrol instructions and launch without the attribute (ROCm, the CPU's
interpreter, GPUs before sm_90, `pdl=False`), with the same results.

`use_pdl(pdl, device)` resolves each launcher's `pdl` argument (None: on where the GPU and this Triton have it);
`ops.no_pdl` and `attention.no_pdl` turn it off for a whole bundle with `bind_pdl`.

Where the engine uses it (PDL pays at small decode batches and costs at large ones: `ops/pdl_table.py` has the
measurements): the runner gives the model bundles with PDL bound off (`ops.with_launch`, `attention.with_pdl`, both
through `bind_launch`) for everything but decode steps (prefill, mixed steps, block-wise prefill tasks, piecewise
prefill graphs: never measured with PDL), and each decode step, a captured graph's batch bucket or an eager step, the
bundles of `pdl_table.pdl_for_step` (PDL and the skinny GEMMs' prefetch bytes from the GPU's measured table;
`pdl_device` gathers the device's facts it reads). rapidserve/runner/decode_graphs.py records each graph's choice.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from rapidserve.ops.pdl_table import PdlDevice


def pdl_available() -> bool:
    """Whether this Triton launches with programmatic dependent launch (`launch_pdl`, `tl.extra.cuda.gdc_wait`)."""
    try:
        import triton.language.extra.cuda as tl_cuda
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and hasattr(tl_cuda, "gdc_wait")


def use_pdl(pdl: bool | None, device: torch.device) -> bool:
    """`pdl` resolved: None means on where the GPU and Triton have it (NVIDIA compute capability 9.0 and later: H100,
    H200, Blackwell), else off (ROCm, the CPU's interpreter, older GPUs); True means on if this Triton has it, whatever
    the device (the compile check on meta tensors); False off."""
    if pdl is None:
        pdl = (device.type == "cuda" and torch.version.hip is None
               and torch.cuda.get_device_capability(device)[0] >= 9)
    return pdl and torch.version.hip is None and pdl_available()


def launch_options(on: bool) -> dict[str, Any]:
    """A launch's PDL arguments: the kernels' `USE_GDC` constexpr, and Triton's `launch_pdl` option where on."""
    return {"USE_GDC": on, **({"launch_pdl": True} if on else {})}


def pdl_kwargs(pdl: bool | None) -> dict[str, bool]:
    """`pdl` as a keyword argument to pass on (none for None: the callee's default, which is the same)."""
    return {} if pdl is None else {"pdl": pdl}


def takes_pdl(fn: Callable[..., object]) -> bool:
    """Whether `fn` takes a `pdl` argument (a launcher of kernels that keep these rules)."""
    try:
        return "pdl" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


def takes_prefetch(fn: Callable[..., object]) -> bool:
    """Whether `fn` takes a `prefetch` argument (a launcher of the skinny GEMMs: the L2 prefetch before their wait)."""
    try:
        return "prefetch" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


def bind_pdl(fn: Callable[..., Any], pdl: bool) -> Callable[..., Any]:
    """`fn` with its `pdl` argument bound (its name and docstring kept, for the logs), or `fn` where it takes none."""
    if not takes_pdl(fn):
        return fn
    return functools.update_wrapper(functools.partial(fn, pdl=pdl), fn)


def bind_launch(fn: Callable[..., Any], pdl: bool, prefetch: int) -> Callable[..., Any]:
    """`fn` with its `pdl` argument bound and, where it takes one, its `prefetch` bytes (0 where `pdl` is off: the
    prefetch needs PDL); `fn` itself where it takes no `pdl`. A binding of a bound `fn` overrides the earlier one."""
    if not takes_pdl(fn):
        return fn
    kw: dict[str, Any] = {"pdl": pdl, **({"prefetch": prefetch if pdl else 0} if takes_prefetch(fn) else {})}
    return functools.update_wrapper(functools.partial(fn, **kw), fn)


def pdl_device(device: torch.device) -> PdlDevice:
    """The facts `pdl_table.pdl_for_step` reads: the table's key (torch.cuda.get_device_name on a GPU, else the
    device type) and whether kernels launch with PDL there (`use_pdl(None, device)`)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return PdlDevice(name, use_pdl(None, device))


__all__ = ["bind_launch", "bind_pdl", "launch_options", "pdl_available", "pdl_device", "pdl_kwargs", "takes_pdl",
           "takes_prefetch", "use_pdl"]
