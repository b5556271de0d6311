"""The runner's tensor-parallel mirroring hooks (rapidserve/parallel/mirror.py): a leader publishes each call to
its followers before queuing it, and a follower replays the leader's calls in the same order.

- `_published(run)`: a call the followers were told of; a failure after that is fatal (`RanksDiverged`), since
  the ranks' collectives no longer pair up.
- `_shared(out)`: the followers receive the tokens the leader sampled (a later `Carry` reads them there).
- `replay(msg, sampled)`: a follower's copy of one of the leader's calls (a prefill, a decode step, or a piece
  of a block-wise prefill task, prefill_task.py).
Without tensor parallelism `leader` is None and a block-wise prefill's guard is `direct`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from rapidserve.runner.inputs import Carry
from rapidserve.runner.prefill_task import TASK_KINDS, Guard, PrefillTask, TaskPublisher, replay_task

if TYPE_CHECKING:
    from rapidserve.kv_pool import KVPool
    from rapidserve.parallel.mirror import Forward, Leader
    from rapidserve.sampler import SamplerOutput

_T = TypeVar("_T")


def direct(run: Callable[[], _T]) -> _T:
    """A task's guard without tensor parallelism: run it."""
    return run()


class RanksDiverged(RuntimeError):
    """A tensor-parallel leader's forward failed after its followers queued theirs: fatal to the worker."""

    fatal = True


class Mirrored:
    """The tensor-parallel hooks of ModelRunner (a part of it; model_runner.py defines the forwards they call)."""

    leader: Leader | None  # tensor parallelism: the followers hear of every call (mirror.py)
    kv_pool: KVPool
    _tasks: dict[int, PrefillTask]  # a follower's tasks begun and not ended (replay_task)

    if TYPE_CHECKING:  # the forwards a follower replays, defined by the composed ModelRunner
        def _prefill_run(self, pool: KVPool, arrays: Sequence[np.ndarray], carry: Carry | None,
                         graph_key: str = "default") -> torch.Tensor: ...

        def _decode_run(self, arrays: Sequence[np.ndarray], graph_key: str, carry: Carry | None) -> torch.Tensor: ...

        def _new_task(self, arrays: Sequence[np.ndarray], task_id: int, publish: TaskPublisher | None,
                      guard: Guard) -> PrefillTask: ...

    def _published(self, run: Callable[[], _T]) -> _T:
        """A call the followers were told of: if it fails here, theirs did not, and the ranks' collectives no
        longer pair up; the worker must die (the router restarts the engine) rather than go on."""
        try:
            return run()
        except Exception as e:
            raise RanksDiverged(f"a tensor-parallel forward failed on the leader after the followers were told of "
                                f"it ({type(e).__name__}: {e}); the ranks' collectives no longer pair up") from e

    def _shared(self, out: SamplerOutput, share: bool) -> SamplerOutput:
        """Tensor parallelism: the followers receive the sampled tokens (a Carry reads them there too)."""
        if self.leader is not None and share:
            self.leader.sampled(out.token_ids)
        return out

    def replay(self, msg: Forward, sampled: dict[int, torch.Tensor]) -> torch.Tensor | None:
        """A follower's copy of the leader's call `msg` (parallel/mirror.py), on the current stream; a
        Carry takes its tokens from `sampled` (the broadcasts received so far, by number)."""
        arrays = [a.array() for a in msg.arrays]
        carry = Carry(sampled[msg.carry_seq], list(msg.carry_rows)) if msg.carry_seq >= 0 else None
        if msg.kind == "prefill":  # the leader's piecewise graphs of msg.graph_key, if it captured them (so did we)
            return self._prefill_run(self.kv_pool, arrays, carry, msg.graph_key)
        if msg.kind in TASK_KINDS:  # a block-wise prefill's piece (prefill_task.py)
            return replay_task(self._tasks, msg, lambda: self._new_task(arrays, msg.task, None, direct))
        return self._decode_run(arrays, msg.graph_key, carry)
