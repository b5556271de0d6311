"""The leader decides, the followers repeat: how N tensor-parallel ranks of one role stay in step.

Only rank 0 of a role (the leader: the decode, prefill or hybrid worker the router talks to) schedules,
owns block tables, samples and talks to the router and its peer worker. Every model call it makes is
published, before it is queued, to each follower (ranks 1..N-1 of the same role) as a `Forward` message
on a shared-memory ring (one SPSC ring per follower, rapidserve/ipc/ring.py): the host arrays the runner
built (token ids, positions, block tables, slots, context lengths), the graph key, the partition stream
it runs on, and the rows a `Carry` feeds from an earlier sample. After each sample the leader publishes
`Sampled` and broadcasts the sampled token ids over the group, so a follower holds the same tokens on
its device for the next step's `Carry`. A follower replays the messages in order (`follow`): the same
collectives in the same order on every rank, so no rank diverges and none waits on a collective another
never makes. Decisions are made once; nothing is decided on a follower.

Invariants:
- A call is published only after its inputs were built without error, so a bad request that fails
  while its inputs are built (on the leader only) sends nothing.
- Sampling happens on the leader only (grammar masks, penalties, seeds live there); a sample that
  raises is not broadcast, and the follower, told nothing, waits for nothing.
- A follower runs each call on its stream of the same partition configuration as the leader's
  (`stream` names it; None: the default stream) and, on a switch, its new stream waits for the old one.
- Start-up: every rank loads, sizes its pool (`TPGroup.agree_min`) and captures the same decode graphs
  in the same order before following; those calls are not published.
- Disagg mode's prefill side (engine/disagg.py): the leader's KV moves between its staging pool and the decode
  pools are published too (`KVMove`, in order with the forwards: a pull before the forward that reads it, a
  push after the forward that wrote its blocks), each rank moving its own heads (parallel/kv_routes.py).
  Whenever the leader waits for its moves to land (before PrefillDone, PrefillFailed, Dropped, a retry or
  reusing staging blocks) it publishes `KVFence`: each follower waits until every move it replayed so far has
  landed, then joins one all-reduce with the leader, which reads its result on the host; so once
  `Leader.kv_fence` returns, every rank's moves published before it have landed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

import msgspec
import numpy as np
import torch

from rapidserve.ipc import Receiver, RingClosed, Sender

if TYPE_CHECKING:
    from rapidserve.parallel.group import TPGroup


class CarryLike(Protocol):
    """`runner.Carry` as the leader sees it (mirror.py sits below the runner, which imports it)."""

    token_ids: torch.Tensor
    rows: list[tuple[int, int]]


class Replayer(Protocol):
    """`runner.ModelRunner` as a follower uses it."""

    device: torch.device
    tp: TPGroup | None

    def replay(self, msg: Forward, sampled: dict[int, torch.Tensor]) -> torch.Tensor | None: ...


class Arr(msgspec.Struct, array_like=True, frozen=True):
    """A numpy array on the wire: dtype name, shape, raw bytes (C order)."""

    dtype: str
    shape: list[int]
    data: bytes

    @classmethod
    def of(cls, a: np.ndarray) -> Arr:
        a = np.ascontiguousarray(a)
        return cls(a.dtype.str, list(a.shape), a.tobytes())

    def array(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype)).reshape(self.shape).copy()


class Forward(msgspec.Struct, tag=True, frozen=True):
    """One model call: `kind` prefill (arrays: ids, positions, tables, slots, ctx, cu, want) or decode
    (ids, positions, tables, ctx, slots); `carry_seq` the `Sampled.seq` whose tokens `carry_rows` feed.
    A block-wise prefill (rapidserve/runner/prefill_task.py) is several calls of one `task`: prefill_begin (the
    prefill arrays; the embedding), prefill_block (decoder `layers` [start, end)), prefill_end (the final
    norm and the logits); tasks may interleave (a preemption), each call names its task."""

    kind: Literal["prefill", "decode", "prefill_begin", "prefill_block", "prefill_end"]
    arrays: list[Arr]
    graph_key: str = "default"
    stream: str | None = None
    carry_seq: int = -1
    carry_rows: list[tuple[int, int]] = []
    task: int = -1
    layers: tuple[int, int] = (0, 0)


class Sampled(msgspec.Struct, tag=True, frozen=True):
    """The leader sampled `n` tokens (numbered `seq`) and broadcasts them on `stream` now."""

    seq: int
    n: int
    stream: str | None = None


class Setup(msgspec.Struct, tag=True, frozen=True):
    """Start-up, leader to followers: the partition plan (a msgpack `partition.plan.PlanWire`)."""

    plan: bytes


class Stop(msgspec.Struct, tag=True, frozen=True):
    reason: str


class KVMove(msgspec.Struct, tag=True, frozen=True):
    """Disagg: move blocks as the leader did (`KVConnector.pull(remote, local)` / `push(local, remote)`), each rank
    its own heads, on the stream of its configuration `stream`."""

    kind: Literal["pull", "push"]
    local: list[int]
    remote: list[int]
    stream: str | None = None


class KVFence(msgspec.Struct, tag=True, frozen=True):
    """Disagg: wait until every KVMove so far has landed, then join the leader's all-reduce (module docstring)."""

    stream: str | None = None


class KVReplayer(Protocol):
    """A follower's side of the KV moves: its own connector (engine/disagg.py)."""

    def move(self, msg: KVMove) -> None: ...

    def land(self) -> None:
        """Block until every move so far has landed."""
        ...


MirrorMessage = Forward | Sampled | Setup | Stop | KVMove | KVFence
KEEP_SAMPLES = 4  # a Carry reads the last step's tokens; a few more for safety


class Leader:
    """The leader's side: publishes each call to every follower's ring; broadcasts sampled tokens."""

    def __init__(self, tp: TPGroup, rings: Sequence[Sender[Any]], stream_names: dict[int, str]) -> None:
        """`stream_names`: this worker's partition streams (`cuda_stream` handle -> configuration name)."""
        self.tp, self.rings, self.stream_names = tp, list(rings), stream_names
        self._seq = 0
        self._sampled: list[tuple[torch.Tensor, int]] = []

    def _stream(self) -> str | None:
        if self.tp.device.type != "cuda":
            return None
        return self.stream_names.get(torch.cuda.current_stream(self.tp.device).cuda_stream)

    def _send(self, msg: MirrorMessage) -> None:
        for r in self.rings:
            r.send(msg, timeout=60.0)

    def forward(self, kind: Literal["prefill", "decode", "prefill_begin", "prefill_block", "prefill_end"],
                arrays: Sequence[np.ndarray], graph_key: str, carry: CarryLike | None, *, task: int = -1,
                layers: tuple[int, int] = (0, 0)) -> None:
        seq, rows = -1, []
        if carry is not None:
            seq = next((s for t, s in self._sampled if t is carry.token_ids), -1)
            if seq < 0:
                raise RuntimeError("a Carry reads tokens the followers never received: sample them through "
                                   "ModelRunner.sample_next")
            rows = list(carry.rows)
        self._send(Forward(kind, [Arr.of(a) for a in arrays], graph_key, self._stream(), seq, rows, task, layers))

    def sampled(self, token_ids: torch.Tensor) -> None:
        seq, self._seq = self._seq, self._seq + 1
        self._send(Sampled(seq, int(token_ids.shape[0]), self._stream()))
        self.tp.broadcast(token_ids.contiguous())
        self._sampled = [*self._sampled[-(KEEP_SAMPLES - 1):], (token_ids, seq)]

    def kv_move(self, kind: Literal["pull", "push"], local: Sequence[int], remote: Sequence[int]) -> None:
        """Publish a KV move the leader has just queued itself (after its checks passed)."""
        self._send(KVMove(kind, list(local), list(remote), self._stream()))

    def kv_fence(self) -> None:
        """Return once every follower's KV moves published so far have landed (module docstring)."""
        self._send(KVFence(self._stream()))
        one = torch.ones(1, dtype=torch.int64, device=self.tp.device)
        got = int(self.tp.all_reduce(one).item())  # the host waits: each follower joins once its moves landed
        if got != self.tp.size:
            raise RuntimeError(f"a KV fence counted {got} ranks of {self.tp.size}")

    def stop(self, reason: str, timeout_s: float = 0.0, clock: Callable[[], float] = time.monotonic,
             sleep: Callable[[float], None] = time.sleep,
             follower_gone: Callable[[int], bool] | None = None) -> list[bool]:
        """Stop to every follower; whether each (rank order: ranks 1..N-1) got it. A follower whose ring is full
        (it is still replaying earlier calls, which frees room) is tried again until `timeout_s` has passed,
        unless `follower_gone(rank)` says it has exited (`send_each`)."""
        gone = None if follower_gone is None else (lambda i: follower_gone(i + 1))
        return send_each(self.rings, Stop(reason), timeout_s, clock, sleep, gone)


class Follower:
    """A follower's state between messages: its partition streams and the last sampled tokens."""

    def __init__(self, runner: Replayer, stream_of: Callable[[str | None], Any],
                 kv: KVReplayer | None = None) -> None:
        """`stream_of(name)`: this worker's stream of that configuration (None: the default stream); `kv`: a
        disagg prefill rank's KV moves (None: KVMove and KVFence are refused)."""
        self.runner, self.stream_of, self.kv = runner, stream_of, kv
        self.sampled: dict[int, torch.Tensor] = {}
        self._last: Any = None

    def _enter(self, name: str | None) -> Any:
        """The stream of `name`, ordered after the stream of the last call when it differs."""
        stream = self.stream_of(name) if name is not None else None
        if stream is None and self.runner.device.type == "cuda":
            stream = torch.cuda.current_stream(self.runner.device)
        last, self._last = self._last, stream
        if stream is not None and last is not None and last is not stream:
            stream.wait_stream(last)
        return stream

    def apply(self, msg: MirrorMessage) -> bool:
        """Replay one message; False on Stop."""
        if isinstance(msg, Stop):
            return False
        if isinstance(msg, Setup):
            raise RuntimeError("a Setup message after start-up")
        stream = self._enter(msg.stream)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if isinstance(msg, KVMove | KVFence):
                if self.kv is None:
                    raise RuntimeError(f"a {type(msg).__name__} to a follower that moves no KV (not disagg's prefill)")
                if isinstance(msg, KVMove):
                    self.kv.move(msg)
                else:
                    self.kv.land()  # on the host, before joining: the leader learns that our moves landed
                    self.runner.tp.all_reduce(torch.ones(1, dtype=torch.int64, device=self.runner.device))  # type: ignore[union-attr]
            elif isinstance(msg, Sampled):
                t = torch.empty(msg.n, dtype=torch.int64, device=self.runner.device)
                self.runner.tp.broadcast(t)  # type: ignore[union-attr]
                self.sampled[msg.seq] = t
                for old in [s for s in self.sampled if s <= msg.seq - KEEP_SAMPLES]:
                    del self.sampled[old]
            else:
                self.runner.replay(msg, self.sampled)
        return True


def follow(runner: Replayer, inbox: Receiver[Any], stream_of: Callable[[str | None], Any],
           alive: Callable[[], bool], idle_s: float = 0.5, kv: KVReplayer | None = None) -> str:
    """A follower's loop: replay the leader's calls until Stop or until `alive()` turns False (the
    leader or the router died); returns why it ended."""
    f = Follower(runner, stream_of, kv)
    while True:
        msg = inbox.recv(timeout=idle_s)
        if msg is None:
            if not alive():
                return "the leader is gone"
            continue
        if not f.apply(msg):
            assert isinstance(msg, Stop)
            return msg.reason


def send_each(rings: Sequence[Any], msg: MirrorMessage, timeout_s: float,
              clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
              reader_gone: Callable[[int], bool] | None = None) -> list[bool]:
    """`msg` into every ring (its `try_send`) without blocking on any one; whether each ring (in order) took it.

    A full ring is tried again every 10 ms while the others go on (its reader frees room as it replays), until
    `timeout_s` has passed. Given up at once: a ring that is closed (`RingClosed`), or whose reader has exited
    (`reader_gone(i)`, checked only while ring i refuses): nobody will ever make room there.
    Invariants: each ring takes `msg` at most once; never waits on one ring; returns within `timeout_s` plus
    one 10 ms nap; never raises for a ring that cannot take it."""
    deadline = clock() + timeout_s
    sent = [False] * len(rings)
    hopeless = [False] * len(rings)
    while True:
        for i, r in enumerate(rings):
            if sent[i] or hopeless[i]:
                continue
            try:
                sent[i] = bool(r.try_send(msg))
            except RingClosed:
                hopeless[i] = True
            if not sent[i] and reader_gone is not None and reader_gone(i):
                hopeless[i] = True
        if all(ok or lost for ok, lost in zip(sent, hopeless, strict=True)) or clock() >= deadline:
            return sent
        sleep(0.01)


def wait_message(inbox: Receiver[Any], kind: type, timeout_s: float) -> Any:
    """The next message, which must be a `kind` (start-up hand-offs), within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        msg = inbox.recv(timeout=0.5)
        if msg is not None:
            if not isinstance(msg, kind):
                raise RuntimeError(f"expected {kind.__name__} from the leader, got {type(msg).__name__}")
            return msg
    raise TimeoutError(f"no {kind.__name__} from the leader in {timeout_s:.0f} s")
