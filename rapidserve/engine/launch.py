"""Starting and stopping the worker processes, from the router process.

`WorkerSet.start` creates the rings and doorbells of `worker_io.RING_TYPES` (the router process owns
their names) and spawns the workers, each through the one entry point `worker_io.run_worker(role,
build)` with its role's builder (`engine/worker_build.py`): in rapid mode decode and prefill start
together (prefill waits for decode's one-time hand-off of IPC handles to its weights and KV pool); in
hybrid mode (`LaunchConfig.mode`) one worker, the decode worker with every step fused (role hybrid),
sits in decode's seat and only r2d and d2r exist;
disagg mode starts rapid's two workers with its own builders (engine/disagg.py), on GPUs of their own, each
side with its own number of tensor-parallel ranks (`tp_workers.role_sizes`) and one hand-off pipe per pair of
decode and prefill ranks that share KV heads.
It waits for each worker's Ready; a worker that fails, exits or is not ready within
`startup_timeout_s` stops everything and raises.

The router's channels: `submit` (a new request, to decode or hybrid), `abort(req_id)`, and the
router-bound rings it drains. `WorkerSet.stop` stops prefill first (SIGTERM), since decode owns the
shared memory prefill uses, then asks decode (or hybrid) to shut down; it waits briefly, kills what is
left, and unlinks every shared-memory name.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing as mp
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rapidserve.config import EngineConfig
from rapidserve.engine import messages as m
from rapidserve.engine.worker_io import DOORBELLS, HYBRID_RINGS, RING_TYPES, ChannelNames, run_worker
from rapidserve.ipc import Doorbell, Receiver, Sender, ShmRing, cleanup_stale, doorbell_name, new_engine_id, ring_name

if TYPE_CHECKING:
    from rapidserve.partition.profile import Profile


class WorkerStartError(RuntimeError):
    pass


# What the fork server imports once, before it forks any worker: torch and the modules every worker's start
# imports. None of them initialises a GPU, starts a thread or defines a Triton kernel (whose interpreter switch,
# TRITON_INTERPRET, is read when a kernel is defined) at import (tests/test_worker_start.py checks this).
FORKSERVER_PRELOAD = ("torch", "rapidserve.engine.worker_build", "rapidserve.engine.disagg",
                      "rapidserve.engine.tp_workers")


def worker_context() -> Any:
    """The multiprocessing context workers start from: multiprocessing's fork server, with FORKSERVER_PRELOAD
    imported in it once. A worker is then a fork of that server, ready in about 0.4 s where a fresh interpreter
    spends 3-4 s importing torch (measured on 2 CPU cores): the wait of every start and of every restart after a
    worker's death. The server is itself a fresh interpreter, not a fork of this process, so nothing of the
    router's state (a CUDA context, threads, locks) reaches a worker, as with "spawn"; what differs is the
    environment, which is the server's from when it began: `worker_env` gives each worker the router's own."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return ctx


def start_fork_server() -> None:
    """Start the fork server now: it imports FORKSERVER_PRELOAD in its own process while this one goes on
    (`rapidserve serve` reads the model and the tokenizer meanwhile), so the workers' start finds it ready."""
    from multiprocessing import forkserver

    worker_context()
    forkserver.ensure_running()


def worker_env(overrides: dict[str, str | None]) -> dict[str, str | None]:
    """A worker's whole environment: this process's now, with the router's choices for that worker (`overrides`;
    None removes a variable). `worker_io.apply_env` makes it the worker's exactly."""
    return {**os.environ, **overrides}


def _visible_gpus(cfg: EngineConfig) -> int:
    if cfg.parallel.tensor_parallel_size == 1 or cfg.runner.device == "cpu":
        return 0
    import torch

    return int(torch.cuda.device_count())


def role_builder(builders: dict[str, Any], role: str, profile: Profile | None) -> Any:
    """`role`'s builder, given the parsed `profile` where it reads one: decode's (worker_build.build_decode,
    disagg.build_disagg_decode: its plan, partition/plan.resolve_plan), when there is one to give."""
    build = builders[role]
    return functools.partial(build, profile=profile) if role == "decode" and profile is not None else build


def _handoff(pipes: dict[tuple[int, int], tuple[Any, Any]], role: str, rank: int, disagg: bool) -> Any:
    """The hand-off ends of `role`'s rank `rank` (pipes by (decode rank, prefill rank)): rapid mode's one pipe end
    (None for hybrid); disagg's ends of every pair it is in, by the other side's rank."""
    if role == "hybrid":
        return None
    side, end = (0, 1) if role == "decode" else (1, 0)  # decode writes (tx), prefill reads (rx)
    ends = [pipes[pair][end] for pair in sorted(pipes, key=lambda p: p[1 - side]) if pair[side] == rank]
    return tuple(ends) if disagg else ends[0]


@dataclass
class WorkerSet:
    cfg: EngineConfig
    names: ChannelNames
    rings: dict[str, ShmRing]
    doorbells: dict[str, Doorbell]
    procs: dict[str, Any]
    to_engine: Sender[Any]  # r2d: the decode (or hybrid) worker's inbox
    recv: dict[str, Receiver[Any]]  # the router's inbox rings by label
    ready: dict[str, m.Ready]

    @classmethod
    def start(cls, cfg: EngineConfig, env: dict[str, str | None], on_message: Any = None,
              profile: Profile | None = None) -> WorkerSet:
        """`profile`: the file `cfg.partition.profile` names, parsed already (profile.read_profile), handed to the
        decode worker's builder (its plan checks it instead of parsing the file again); None: the worker reads it."""
        from rapidserve.engine.disagg import builders_for, handoff_pairs, start_disagg_follower
        from rapidserve.engine.tp_workers import (
            check_tp_gpus,
            rank_config,
            role_sizes,
            run_follower,
            tp_env,
            tp_seats,
        )

        check_tp_gpus(cfg, _visible_gpus(cfg))
        builders = builders_for(cfg)  # role -> builder; disagg mode's own (engine/disagg.py), its GPUs checked
        cleanup_stale()
        eid = new_engine_id()
        hybrid = cfg.launch.mode == "hybrid"
        doorbells = {d: Doorbell.create(doorbell_name(eid, d)) for d in DOORBELLS}
        rings = {label: ShmRing.create(ring_name(eid, label), cfg.launch.ring_slots, cfg.launch.ring_slot_size,
                                       doorbell=doorbells[wire.reader].name)
                 for label, wire in RING_TYPES.items() if not hybrid or label in HYBRID_RINGS}
        names = ChannelNames({k: r.name for k, r in rings.items()}, {k: d.name for k, d in doorbells.items()})
        recv = {label: Receiver(r, RING_TYPES[label].types) for label, r in rings.items()
                if RING_TYPES[label].reader == "router"}
        ws = cls(cfg, names, rings, doorbells, {}, Sender(rings["r2d"], RING_TYPES["r2d"].types), recv, {})
        ctx = worker_context()
        roles = ("hybrid",) if hybrid else ("decode", "prefill")
        disagg = cfg.launch.mode == "disagg"
        sizes = role_sizes(cfg, roles)  # ranks per role: -tp each; disagg's prefill side its own
        # The one-time hand-off of IPC handles (decode rank s -> prefill rank r) is a pipe per pair: unlike a
        # Queue it makes no named semaphore, so nothing is left in /dev/shm when a worker is killed. The router
        # keeps no end of it once both workers have theirs. Rapid: s = r, its weights and pool; disagg: every
        # pair that shares KV heads (engine/disagg.py), its pool.
        pairs = [] if hybrid else handoff_pairs(cfg) if disagg else [(r, r) for r in range(sizes["decode"])]
        pipes = {pair: ctx.Pipe(duplex=False) for pair in pairs}
        seats = tp_seats(cfg, eid, sizes, ws.rings)  # adds the mirror rings to ws.rings (unlinked by stop)
        try:
            for role in roles:
                for rank in range(sizes[role]):
                    handoff = _handoff(pipes, role, rank, disagg)
                    rcfg = rank_config(cfg, rank)
                    seat = seats[role][rank] if role in seats else None
                    renv = worker_env({**tp_env(role), **env} if seat is not None else env)
                    if rank == 0:
                        target: Any = run_worker
                        args: tuple[Any, ...] = (role, role_builder(builders, role, profile), rcfg, names,
                                                 os.getpid(), handoff, renv, seat)
                    else:
                        target = run_follower
                        args = (role, seat, rcfg, os.getpid(), handoff, renv, start_disagg_follower if disagg else None)
                    name = role if rank == 0 else f"{role}.{rank}"
                    p = ctx.Process(target=target, name=f"rapidserve-{name}", daemon=True, args=args)
                    p.start()
                    ws.procs[name] = p
            for role in roles:
                ws._await_ready(role, on_message)
        except BaseException:
            ws.stop(graceful=False)
            raise
        finally:
            for rx, tx in pipes.values():
                rx.close()
                tx.close()
        return ws

    def _await_ready(self, who: str, on_message: Any) -> None:
        deadline = time.monotonic() + self.cfg.launch.startup_timeout_s
        label = "p2r" if who == "prefill" else "d2r"
        while time.monotonic() < deadline:
            msg = self.recv[label].recv(timeout=0.2)
            if isinstance(msg, m.Ready):
                self.ready[who] = msg
                return
            if isinstance(msg, m.WorkerError):
                raise WorkerStartError(f"the {who} worker failed to start: {msg.message}")
            if msg is not None and on_message is not None:
                on_message(msg)
            for other, p in self.procs.items():  # prefill waits on decode's hand-off: both must live
                if not p.is_alive():
                    raise WorkerStartError(f"the {other} worker exited during start-up (exit code {p.exitcode})")
        raise WorkerStartError(f"the {who} worker was not ready after {self.cfg.launch.startup_timeout_s:.0f} s")

    @property
    def engine_role(self) -> str:
        """The worker that takes new requests and writes d2r: decode, or hybrid."""
        return "hybrid" if "hybrid" in self.procs else "decode"

    @property
    def engine_pool_tokens(self) -> int:
        """The engine worker's KV pool in tokens, as it reported it: the context cap its stop rule applies."""
        return int(self.ready[self.engine_role].info["kv_blocks"]) * self.cfg.cache.block_size

    @property
    def pool_tokens(self) -> int:
        """The longest context every worker can hold, in tokens: the engine worker's pool, and in disagg mode at
        most the prefill worker's staging pool (which, under --max-model-len auto, may hold less: a preempted
        request is prefilled again whole, so no request may outgrow it)."""
        staging = [int(r.info["staging_blocks"]) for r in self.ready.values() if "staging_blocks" in r.info]
        return min([self.engine_pool_tokens // self.cfg.cache.block_size, *staging]) * self.cfg.cache.block_size

    def submit(self, msg: m.NewRequest) -> bool:
        """A new request to the engine worker; False when its inbox is full (try again later)."""
        return self.to_engine.try_send(msg)

    def abort(self, req_id: str) -> bool:
        return self.to_engine.try_send(m.Abort(req_id))

    def writer_of(self, label: str) -> str:
        """The worker that writes the router-bound ring `label` (d2r: decode or hybrid, p2r: prefill)."""
        return "prefill" if label == "p2r" else self.engine_role

    def dead_worker(self) -> str | None:
        for who, p in self.procs.items():
            if not p.is_alive():
                return who
        return None

    def stop(self, graceful: bool = True, timeout: float = 5.0) -> None:
        """Prefill first (SIGTERM), then decode or hybrid (Shutdown): the owner of shared memory goes
        last. Then every shared-memory name is unlinked."""
        order = ("prefill", "decode", "hybrid")  # followers (role.rank) after their leader
        for who in sorted(self.procs, key=lambda w: (order.index(w.split(".")[0]), w)):
            p = self.procs[who]
            if graceful and p.is_alive():
                if who == "prefill" or "." in who:
                    p.terminate()
                else:
                    with contextlib.suppress(Exception):  # a closed ring must not stop the shutdown
                        self.to_engine.try_send(m.Shutdown("engine stopping"))
                p.join(timeout)
            if p.is_alive():
                p.kill()
            p.join(timeout)
        for r in self.rings.values():
            r.close()
            r.unlink()
        for d in self.doorbells.values():
            d.close()
            d.unlink()
