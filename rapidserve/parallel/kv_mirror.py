"""Disagg mode's KV moves under tensor parallelism on the prefill side: the leader's connector and its followers'.

The prefill leader (rank 0, engine/disagg.py `DisaggPrefillWorker`) decides every pull and push; each of its N
ranks moves its own KV heads (parallel/kv_routes.py) through its own `ShardedConnector`. `MirroredConnector` is
the leader's `KVConnector`: a move is queued on the leader's own connector first (its checks raise before
anything is published, so a bad move reaches no follower), then published (`Leader.kv_move`, in order with the
forwards on the mirror rings). Its transfers land when the leader's part has landed AND every follower's moves
published up to it have: `wait()` waits for its own part, then, unless a later fence already covered it, fences
(`Leader.kv_fence`: the followers wait for their moves, then join an all-reduce the leader reads on the host).
One fence covers every move published before it, so waiting for a job's many transfers fences once.

`FollowerKV` is a follower's side (`mirror.KVReplayer`): it replays each `KVMove` on its connector and keeps the
transfers until a `KVFence` asks it to wait for all of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rapidserve.parallel.kv_connector import KVConnector, Landed, Transfer
from rapidserve.parallel.mirror import KVMove, Leader


@dataclass
class MirroredTransfer:
    """The leader's part of a move (`own`) and the number of moves published up to it (`seq`)."""

    owner: MirroredConnector
    own: Transfer
    seq: int

    def done(self) -> bool:
        return self.own.done() and self.seq <= self.owner.fenced

    def wait(self) -> None:
        self.own.wait()
        self.owner.land(self.seq)


class MirroredConnector:
    """The prefill leader's `KVConnector` when it has followers (module docstring)."""

    def __init__(self, own: KVConnector, leader: Leader) -> None:
        self.own, self.leader = own, leader
        self.published = 0  # moves published to the followers so far
        self.fenced = 0  # moves known to have landed on every follower

    def describe(self) -> str:
        return f"{self.own.describe()} (rank 0 of {self.leader.tp.size}; each rank moves its own heads)"

    def pull(self, remote_blocks: Sequence[int], local_blocks: Sequence[int]) -> Transfer:
        own = self.own.pull(remote_blocks, local_blocks)
        return self._publish("pull", local_blocks, remote_blocks, own)

    def push(self, local_blocks: Sequence[int], remote_blocks: Sequence[int]) -> Transfer:
        own = self.own.push(local_blocks, remote_blocks)
        return self._publish("push", local_blocks, remote_blocks, own)

    def _publish(self, kind: str, local: Sequence[int], remote: Sequence[int], own: Transfer) -> Transfer:
        if not local:
            return Landed()
        self.leader.kv_move("pull" if kind == "pull" else "push", local, remote)
        self.published += 1
        return MirroredTransfer(self, own, self.published)

    def land(self, seq: int) -> None:
        """Every follower's moves up to `seq` have landed once this returns."""
        if seq > self.fenced:
            upto = self.published
            self.leader.kv_fence()
            self.fenced = upto


class FollowerKV:
    """A prefill follower's KV moves (`mirror.KVReplayer`) over its own connector."""

    def __init__(self, connector: KVConnector) -> None:
        self.connector = connector
        self.pending: list[Transfer] = []

    def move(self, msg: KVMove) -> None:
        if msg.kind == "pull":
            self.pending.append(self.connector.pull(msg.remote, msg.local))
        else:
            self.pending.append(self.connector.push(msg.local, msg.remote))

    def land(self) -> None:
        for t in self.pending:
            t.wait()
        self.pending.clear()
