"""Starting and stopping the two worker processes, and each worker's entry point.

`WorkerSet.start` creates the rings and doorbells (the router process owns their names), starts the
decode worker (spawn), waits for its Ready, then starts the prefill worker, which attaches the
decode worker's weights and KV pool through a one-time hand-off queue of IPC handles, and waits for
its Ready. Either step past `startup_timeout_s` kills what started and raises.
`WorkerSet.stop` asks both to shut down, waits briefly, kills what is left, and unlinks every
shared-memory name. Prefill is stopped first: the owner of shared memory outlives its users.
In hybrid mode (`LaunchConfig.mode`) one worker starts instead (`engine/hybrid_worker.py`), in the
decode worker's seat: only the rings r2d and d2r exist, and a new request goes to that one alone.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
import traceback
from dataclasses import dataclass
from typing import Any

from rapidserve.config import EngineConfig
from rapidserve.engine import messages as m
from rapidserve.engine.worker_io import (
    DOORBELLS,
    RING_LABELS,
    RING_TYPES,
    ChannelNames,
    WorkerIO,
    apply_env,
    no_named_locks,
    settle_heap,
    unlink_names,
    worker_signals,
)
from rapidserve.ipc import Doorbell, Receiver, Sender, ShmRing, cleanup_stale, doorbell_name, new_engine_id, ring_name


class WorkerStartError(RuntimeError):
    pass


def worker_main(who: str, cfg: EngineConfig, names: ChannelNames, parent_pid: int, handoff: Any,
                env: dict[str, str | None]) -> None:
    """Entry point of a worker process (spawned)."""
    apply_env(env)
    worker_signals()
    no_named_locks()
    if cfg.runner.device == "cpu" or not _has_gpu():
        import torch  # two workers share the cores: half each

        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    io = WorkerIO(who, names, parent_pid)
    out = io.send["d2r" if who == "decode" else "p2r"]
    try:
        from rapidserve.loader import resolve_model
        from rapidserve.partition.runtime import DecodePartition, open_streams, resolve_plan
        from rapidserve.runner import ModelRunner, resolve_device, resolve_dtype

        eos = cfg.model_config.eos_token_ids
        if who == "decode":
            from rapidserve.engine.decode_worker import DecodeWorker
            from rapidserve.model_sharing import export_shared

            dev = resolve_device(cfg.runner.device)
            source = resolve_model(cfg.model, preset_device=dev, preset_dtype=resolve_dtype(cfg.runner.dtype, dev))
            runner = ModelRunner(cfg, source, show_progress=False)
            plan = resolve_plan(cfg, runner.device, runner.dtype)
            parts = open_streams(plan.wire(), runner.device, ("decode",))
            for c in parts.configurations:  # a graph keeps the compute of the stream it was captured on
                runner.capture_decode_graphs(parts.stream(c.name, "decode"), key=c.name, show_progress=False)
            state = export_shared(runner.model, runner.kv_pool)
            out.send(m.Ready("decode", os.getpid(), {"kv_blocks": str(runner.kv_pool.num_blocks),
                                                     "device": str(runner.device), "partition": plan.source,
                                                     "configurations": ",".join(parts.names), **_memory(runner)}))
            handoff.send((os.getpid(), state, plan.wire()))  # returns once prefill has read it all
            handoff.close()
            settle_heap()
            DecodeWorker(cfg, runner, io, eos, DecodePartition(cfg.partition, plan), parts).run()
        else:
            from rapidserve.engine.prefill_worker import PrefillWorker

            if not handoff.poll(cfg.launch.startup_timeout_s):
                raise TimeoutError(f"no weights from the decode worker in {cfg.launch.startup_timeout_s:.0f} s")
            owner_pid, shared, wire = handoff.recv()
            handoff.close()
            io.peer_pids.append(int(owner_pid))  # the owner of the shared memory: we end with it
            runner = ModelRunner(cfg, None, attached=shared, show_progress=False)
            parts = open_streams(wire, runner.device, ("prefill",))
            out.send(m.Ready("prefill", os.getpid(), {"device": str(runner.device), **_memory(runner)}))
            settle_heap()
            PrefillWorker(cfg, runner, io, eos, parts, wire.initial).run()
    except SystemExit:
        pass
    except BaseException as e:  # report, then die: the router fails in-flight requests
        out.try_send(m.WorkerError(who, f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"))
        raise
    finally:
        if not io.others_alive(every_s=0.0):  # the router died without cleaning up: we do it
            unlink_names(names)
        io.close()


@dataclass
class WorkerSet:
    cfg: EngineConfig
    names: ChannelNames
    rings: dict[str, ShmRing]
    doorbells: dict[str, Doorbell]
    procs: dict[str, Any]
    send: dict[str, Sender[Any]]
    recv: dict[str, Receiver[Any]]
    ready: dict[str, m.Ready]

    @classmethod
    def start(cls, cfg: EngineConfig, env: dict[str, str | None], on_message: Any = None) -> WorkerSet:
        cleanup_stale()
        eid = new_engine_id()
        doorbells = {d: Doorbell.create(doorbell_name(eid, d)) for d in DOORBELLS}
        reader = {"r2d": "decode", "p2d": "decode", "r2p": "prefill", "d2p": "prefill",
                  "d2r": "router", "p2r": "router"}
        hybrid = cfg.launch.mode == "hybrid"
        labels = ("r2d", "d2r") if hybrid else RING_LABELS
        rings = {lbl: ShmRing.create(ring_name(eid, lbl), cfg.launch.ring_slots, cfg.launch.ring_slot_size,
                                     doorbell=doorbells[reader[lbl]].name) for lbl in labels}
        names = ChannelNames({k: r.name for k, r in rings.items()}, {k: d.name for k, d in doorbells.items()})
        ws = cls(cfg, names, rings, doorbells, {},
                 {lbl: Sender(rings[lbl], RING_TYPES[lbl]) for lbl in ("r2d", "r2p") if lbl in rings},
                 {lbl: Receiver(rings[lbl], RING_TYPES[lbl]) for lbl in ("d2r", "p2r") if lbl in rings}, {})
        ctx = mp.get_context("spawn")
        # The one-time hand-off of IPC handles (decode -> prefill) is a pipe: unlike a Queue it makes
        # no named semaphore, so nothing is left in /dev/shm when a worker is killed. The router
        # keeps no end of it once both workers have theirs.
        rx, tx = ctx.Pipe(duplex=False)
        try:
            for who in ("hybrid",) if hybrid else ("decode", "prefill"):
                target: Any = worker_main
                args: tuple[Any, ...] = (who, cfg, names, os.getpid(), tx if who == "decode" else rx, env)
                if who == "hybrid":
                    from rapidserve.engine.hybrid_worker import hybrid_main

                    target, args = hybrid_main, (cfg, names, os.getpid(), env)
                p = ctx.Process(target=target, name=f"rapidserve-{who}", daemon=True, args=args)
                p.start()
                ws.procs[who] = p
                ws._await_ready(who, on_message)
        except BaseException:
            ws.stop(graceful=False)
            raise
        finally:
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

    def request_labels(self) -> tuple[str, ...]:
        """The rings a new request goes to: both RAPID workers' inboxes, or the hybrid one's."""
        return tuple(label for label in ("r2d", "r2p") if label in self.send)

    def writer_of(self, label: str) -> str:
        """The worker that writes the router-bound ring `label` (d2r: decode or hybrid, p2r: prefill)."""
        if label == "p2r":
            return "prefill"
        return "hybrid" if "hybrid" in self.procs else "decode"

    def dead_worker(self) -> str | None:
        for who, p in self.procs.items():
            if not p.is_alive():
                return who
        return None

    def stop(self, graceful: bool = True, timeout: float = 5.0) -> None:
        """Prefill first, then decode (the owner of shared memory goes last); then unlink names."""
        for who, label in (("prefill", "r2p"), ("decode", "r2d"), ("hybrid", "r2d")):
            p = self.procs.get(who)
            if p is None:
                continue
            if graceful and p.is_alive():
                with contextlib.suppress(Exception):  # a closed ring must not stop the shutdown
                    self.send[label].try_send(m.Shutdown("engine stopping"))
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


def _has_gpu() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _memory(runner: Any) -> dict[str, str]:
    """What this process holds: its own device allocations, and the weights and KV it uses."""
    import torch

    own = torch.cuda.memory_allocated(runner.device) if runner.device.type == "cuda" else 0
    weights = runner.model.weight_bytes()
    kv = runner.kv_pool.tensor.numel() * runner.kv_pool.tensor.element_size()
    return {"device_allocated_bytes": str(own), "weight_bytes": str(weights), "kv_bytes": str(kv)}
