"""Starting the ranks of a CPU (gloo) tensor-parallel group in tests, with one mirror ring per follower.

The ranks are forks of the engine's own fork server (tests/fork_context.py), each in this process's environment as
it is now; a spawned interpreter per rank spent 3-4 CPU-s importing torch first."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rapidserve.ipc import ShmRing, new_engine_id, ring_name
from rapidserve.parallel.group import group_specs
from tests.fork_context import child_context, with_env


def run_ranks(target: Callable[..., None], tp: int, before: tuple[Any, ...] = (), after: tuple[Any, ...] = (),
              role: str = "decode", slot_size: int = 4096) -> dict[int, tuple[Any, ...]]:
    """Run `target(*before, spec, ring_names, *after, queue)` in `tp` processes (one per rank of a gloo group;
    ring_names[r - 1] is follower r's mirror ring); each puts `(rank, *results)` on the queue.
    Returns rank -> results; every process must exit 0."""
    ctx = child_context()
    q = ctx.Queue()
    eid = new_engine_id()
    rings = [ShmRing.create(ring_name(eid, f"m{r}"), 64, slot_size) for r in range(1, tp)]
    names = [r.name for r in rings]
    procs = [ctx.Process(target=run, args=args) for run, args in
             (with_env(target, *before, s, names, *after, q) for s in group_specs(role, tp, "gloo"))]
    for p in procs:
        p.start()
    try:
        got = {}
        for _ in procs:
            r = q.get(timeout=240)
            got[r[0]] = tuple(r[1:])
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
        for ring in rings:
            ring.close()
            ring.unlink()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return got

