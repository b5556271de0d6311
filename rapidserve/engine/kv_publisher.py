"""Publishing the prefix cache's KV events over ZMQ, as vLLM's ZmqEventPublisher does (--kv-events-config).

Who publishes: the router process, one publisher per engine (`AsyncEngine`), not the worker that owns the
BlockManager. The decode worker (every mode's one step loop: rapid, disagg, and hybrid's lone worker) only drains
its `KVEventLog` into a `KVEvents` message on the ring it already writes (engine/worker_io.py `send_kv_events`, at
`DecodeWorker.publish`); the router's collector hands them here. So the worker
loop gains no socket, no thread and no encoding beyond its ring message (a publisher thread in the worker would
take the GIL from its step loop), and the publisher outlives the workers: when a worker dies the router
publishes AllBlocksCleared (the new worker's cache starts empty) on the same socket, with sequence numbers that
keep counting, so a subscriber never sees the stream restart.

Wire (vllm/distributed/kv_events.py): a PUB socket sends [topic, seq as 8 bytes big-endian, msgpack
KVEventBatch]; an endpoint with `*`, `::`, ipc:// or inproc:// is bound, any other is connected to. With a
`replay_endpoint`, a ROUTER socket is bound there: a client sends [b"", start seq as 8 bytes big-endian] (a
REQ/DEALER with an empty delimiter) and gets every buffered batch from that seq as [b"", seq, payload], then
[b"", -1 as 8 signed bytes, b""]. The last `buffer_steps` batches are kept for replay. Engine i of several
(--data-parallel-size) publishes on the endpoint's port + i (`endpoint_for_rank`), its batches carrying
data_parallel_rank i.

One thread does all socket work; `publish` only queues (never blocks the event loop: a full queue drops the
batch, counted and logged once). pyzmq is imported here only, and only when events are on.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import msgspec

from rapidserve.config_base import ConfigError
from rapidserve.kv_events import AllBlocksCleared, KVEvent, KVEventBatch
from rapidserve.kv_events_config import KVEventsConfig

log = logging.getLogger("rapidserve.engine")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
INSTALL_HINT = "pip install 'rapidserve[kv-events]' (or pip install pyzmq)"


def import_zmq() -> Any:
    """pyzmq, or a ConfigError saying how to install it."""
    try:
        import zmq
    except ImportError:
        raise ConfigError(f"--kv-events-config publishes over ZMQ, which needs pyzmq: {INSTALL_HINT}") from None
    return zmq


def endpoint_for_rank(endpoint: str | None, rank: int) -> str | None:
    """Engine `rank`'s address: the port + rank for tcp, the address + `_dp<rank>` for ipc/inproc (vLLM's
    offset_endpoint_port); rank 0 keeps the address as given."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if port.isdigit():
            return f"{base}:{int(port) + rank}"
    raise ConfigError(f"kv_events_config.endpoint={endpoint!r}: with several engines each publishes on the port + "
                      "its rank; give a tcp://host:port, ipc:// or inproc:// address")


def binds(endpoint: str) -> bool:
    """Whether the PUB socket binds `endpoint` (else it connects to it), as vLLM decides."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """One engine's ZMQ publisher (module doc). `publish(events)` from any thread; `close()` once."""

    def __init__(self, cfg: KVEventsConfig) -> None:
        zmq = import_zmq()
        self.cfg = cfg
        self.rank = cfg.data_parallel_rank
        self.endpoint = endpoint_for_rank(cfg.endpoint, self.rank)
        self.replay_endpoint = endpoint_for_rank(cfg.replay_endpoint, self.rank)
        self.dropped = 0
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: Any = None
        try:
            self._pub.set_hwm(cfg.hwm)
            assert self.endpoint is not None
            (self._pub.bind if binds(self.endpoint) else self._pub.connect)(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ConfigError(f"--kv-events-config: cannot open {self.endpoint} / {self.replay_endpoint}: {e}") from e
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=cfg.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._topic = cfg.topic.encode()
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name=f"rapidserve-kv-events-{self.rank}", daemon=True)
        self._thread.start()
        log.info("KV events: publishing on %s%s (topic %r, data_parallel_rank %d)", self.endpoint,
                 f", replay on {self.replay_endpoint}" if self.replay_endpoint else "", cfg.topic, self.rank)

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one batch of events (in order) for the publisher thread; never blocks."""
        if not events:
            return
        try:
            self._queue.put_nowait(KVEventBatch(time.time(), events, self.rank))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("KV events: the publisher's queue is full (max_queue_size=%d): batches are dropped, "
                            "so subscribers miss events", self.cfg.max_queue_size)

    def cleared(self) -> None:
        """Every block is gone (the worker that owned the cache died)."""
        self.publish([AllBlocksCleared()])

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (within `timeout`), then close the sockets."""
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = encode(batch)
            seq = self._seq
            self._seq += 1
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except self._zmq.ZMQError as e:  # a send that fails loses this batch, not the thread
                log.warning("KV events: sending batch %d failed: %s", seq, e)
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: ignored a replay request of %d frame(s): send [b'', start seq (8 bytes)]",
                        len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
