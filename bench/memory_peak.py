"""What is alive at the peak of one phase of a CUDA allocator trace, by the source line that allocated it.

    with record(): ...                      # torch.cuda.memory._record_memory_history around the work
    peak, sites = peak_sites(trace, "_gpu_kv_budget", skip=("kv_pool.py:allocate",))

Why: the KV pool's budget keeps one activation peak per process that runs full-size steps (rapidserve/runner/
kv_budget.py; 2.85 GiB on the Llama-3.1-70B fp8 shape at 8192 tokens, twice in rapid mode), so every GiB of that peak
is a GiB of KV. This says which tensors make it.

The trace is the one `torch.cuda.memory._snapshot()` returns after `_record_memory_history(max_entries=N)`:
`device_traces[device]` is a list of events, each a dict with `action` ("alloc", "free_requested", "free_completed",
"segment_alloc", "segment_free", "snapshot", "oom"), `addr`, `size` and `frames` (a list of {filename, line, name},
innermost first; Python frames, and C++ ones when asked for). A block is alive from its "alloc" to its
"free_completed" (a "free_requested" on another stream's use is not yet freed). The phase is the events whose frames
hold a frame named `phase` (a function's name, e.g. the runner's `_gpu_kv_budget`); `skip`: allocations whose frames
hold one of these ("file.py:function", or a bare function name) are left out (the phase's scratch KV pool,
"kv_pool.py:allocate", which is not an activation). Replaying the phase's
events, the peak is where its live bytes are highest; the blocks alive there are grouped by their innermost frame
under `rapidserve/` (else their innermost frame at all): "file:line function".
Pure: no torch here; the CPU tests build traces by hand.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

Event = Mapping[str, Any]


@dataclass(frozen=True)
class Site:
    where: str  # "rapidserve/ops/fp8.py:212 quantize_input"
    bytes: int
    blocks: int


def _has(ev: Event, wants: Iterable[str]) -> bool:
    """Whether a frame of `ev` is one of `wants`: a function's name ("_gpu_kv_budget"), or "file.py:name" (a frame
    of that name in a file whose path ends so)."""
    frames = [(str(f.get("filename", "")), str(f.get("name", ""))) for f in ev.get("frames", ())]
    for want in wants:
        file, _, name = want.rpartition(":")
        if any(n == name and (not file or fn.endswith(file)) for fn, n in frames):
            return True
    return False


def site_of(ev: Event, package: str = "rapidserve/") -> str:
    """The innermost frame under `package` (else the innermost frame at all) as "path:line function", the path from
    `package` on."""
    frames = list(ev.get("frames", ()))
    for f in frames:
        name = str(f.get("filename", ""))
        if package in name:
            return f"{package}{name.split(package, 1)[1]}:{f.get('line', '?')} {f.get('name', '?')}"
    if frames:
        f = frames[0]
        return f"{f.get('filename', '?')}:{f.get('line', '?')} {f.get('name', '?')}"
    return "(no frames)"


def _phase_events(trace: Sequence[Event], phase: str) -> Iterator[Event]:
    for ev in trace:
        if ev.get("action") in ("alloc", "free_completed") and _has(ev, (phase,)):
            yield ev


def peak_sites(trace: Sequence[Event], phase: str, skip: Sequence[str] = (), top: int = 10
               ) -> tuple[int, list[Site]]:
    """(the phase's peak of live bytes, the `top` sites alive there by bytes); module docstring."""
    live: dict[int, Event] = {}
    total = peak = 0
    at_peak: dict[int, Event] = {}
    for ev in _phase_events(trace, phase):
        addr, size = int(ev.get("addr", 0)), int(ev.get("size", 0))
        if ev["action"] == "alloc":
            if skip and _has(ev, skip):
                continue
            live[addr] = ev
            total += size
            if total > peak:
                peak, at_peak = total, dict(live)
        elif addr in live:
            total -= int(live.pop(addr).get("size", 0))
    groups: dict[str, list[int]] = {}
    for ev in at_peak.values():
        g = groups.setdefault(site_of(ev), [0, 0])
        g[0] += int(ev.get("size", 0))
        g[1] += 1
    sites = sorted((Site(w, b, n) for w, (b, n) in groups.items()), key=lambda s: (-s.bytes, s.where))
    return peak, sites[:top]


def table(peak: int, sites: Sequence[Site]) -> str:
    """Markdown: each site's MiB and share of the peak."""
    mib = float(1 << 20)
    out = [f"Live at the step's peak: {peak / mib:,.0f} MiB", "", "| allocated at | MiB | share | blocks |",
           "|---|---|---|---|"]
    out += [f"| `{s.where}` | {s.bytes / mib:,.1f} | {s.bytes / peak:.0%} | {s.blocks} |" if peak else
            f"| `{s.where}` | {s.bytes / mib:,.1f} | - | {s.blocks} |" for s in sites]
    return "\n".join(out)


@contextmanager
def record(max_entries: int = 200_000) -> Iterator[None]:
    """Record the CUDA allocator's history (Python frames) while the block runs; read it with
    `torch.cuda.memory._snapshot()["device_traces"]` before leaving it."""
    import torch

    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        yield
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


__all__ = ["Site", "peak_sites", "record", "site_of", "table"]
