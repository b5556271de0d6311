"""A prefill forward launched a layer block at a time: DRIFT's block-wise prefill (issue 18).

`ModelRunner.prefill_task(items)` builds the forward's inputs once (token ids, positions, attention
metadata, the rows whose logits are wanted) and queues the embedding; each `step(n)` then queues the
next n decoder layers and records an event after them; `logits()` queues the final norm and the LM head
over the wanted rows once every layer is launched. Between steps the task keeps the partial hidden
state and residual (two [T, hidden] tensors), so another task may run in between (preemption at a
layer-block boundary) and this one resumes where it stopped. The K/V of layer i are written into the
pool by step that runs layer i, into the slots of the items' block tables.

Invariants:
- The pieces are `CausalLM.embed`, `run_layers` and `final_norm`, the very operations of the one-shot
  forward in the same order, so a task's logits and K/V are bit-identical to `ModelRunner.prefill`'s
  (same inputs, same device and dtype), however the layers are split and whatever ran in between.
- Stream ordering: every piece is queued on the stream current when it is called. A task whose steps
  run on different streams (a partition switch) is ordered by its caller: the new stream waits for the
  old one before the next step (engine/drift_prefill.py does, as the prefill worker does for forwards).
  The task's tensors live until the task is dropped; the caller drops it only after its last event has
  completed (the sampled token was read on the host), so no stream still reads memory it frees.
- `query()` never blocks: it polls the event of the last piece queued (True on CPU, where a piece is done
  when its call returns). `synchronize()` waits for it.
- Tensor parallelism: the leader publishes each piece before queuing it (Forward kinds prefill_begin,
  prefill_block with its layer range, prefill_end, all with the task's id); a follower replays them in
  the same order (`replay_task`), so the pieces' collectives pair up across ranks even when tasks
  interleave. A piece that fails on the leader after it was published is fatal (`guard`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeVar

import torch

from rapidserve.attention import AttentionMetadata

if TYPE_CHECKING:
    from rapidserve.models.decoder_layer import KVCache
    from rapidserve.models.transformer import CausalLM
    from rapidserve.parallel.mirror import Forward

T = TypeVar("T")
TaskKind = Literal["prefill_begin", "prefill_block", "prefill_end"]
TASK_KINDS: tuple[str, ...] = ("prefill_begin", "prefill_block", "prefill_end")
TaskPublisher = Callable[[TaskKind, int, tuple[int, int]], None]  # (kind, task id, layer range)
Guard = Callable[[Callable[[], T]], T]  # runs a piece; the leader's makes a failure after publication fatal


@dataclass(frozen=True)
class TaskInputs:
    """A prefill forward's inputs on the device: built once, read by every step."""

    tokens: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    last: torch.Tensor  # rows of the wanted logits (each item's last token that asks for logits)


class PrefillTask:
    """One prefill forward, launched in layer blocks on the current stream. Not thread-safe; one owner."""

    def __init__(self, model: CausalLM, kv_layers: list[KVCache], inputs: TaskInputs, task_id: int,
                 publish: TaskPublisher | None, guard: Guard) -> None:
        """Queues the embedding. `publish`: tells the tensor-parallel followers of each later piece (None:
        no followers); `guard`: runs each piece (the leader's makes a failure after publication fatal)."""
        self.model, self.kv_layers, self.inputs, self.task_id = model, kv_layers, inputs, task_id
        self._publish, self._guard = publish, guard
        self.num_layers = len(model.layers)
        self.layers_done = 0  # layers queued so far
        self.num_tokens = int(inputs.tokens.shape[0])
        self._hidden: torch.Tensor | None = model.embed(inputs.tokens)
        self._residual: torch.Tensor | None = None
        self._ended = False
        self._event: torch.cuda.Event | None = None
        self._mark()

    @property
    def done(self) -> bool:
        """Every layer is queued (`logits()` may be called)."""
        return self.layers_done == self.num_layers

    def step(self, n_layers: int) -> tuple[int, int]:
        """Queue the next `n_layers` layers (at least one, at most those left) and record an event after
        them; returns the layer range queued."""
        if self.done or self._hidden is None:
            raise RuntimeError(f"task {self.task_id}: every layer is queued already")
        start, end = self.layers_done, min(self.num_layers, self.layers_done + max(1, n_layers))
        if self._publish is not None:
            self._publish("prefill_block", self.task_id, (start, end))
        self._hidden, self._residual = self._guard(lambda: self._layers(start, end))
        self.layers_done = end
        self._mark()
        return start, end

    def _layers(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert self._hidden is not None
        x = self.inputs
        return self.model.run_layers(self._hidden, self._residual, x.positions, self.kv_layers, x.meta, start, end)

    def logits(self) -> torch.Tensor:
        """float32 logits [rows that asked for them, vocab], queued after the last layer, with an event
        after them; the partial state is released. Once, when `done`."""
        if not self.done or self._ended:
            raise RuntimeError(f"task {self.task_id}: logits need every layer queued, once")
        if self._publish is not None:
            self._publish("prefill_end", self.task_id, (self.num_layers, self.num_layers))
        out = self._guard(self._final)
        self._ended = True
        self._mark()
        return out

    def _final(self) -> torch.Tensor:
        hidden = self.model.final_norm(self._hidden, self._residual)  # type: ignore[arg-type]
        self._hidden = self._residual = None
        return self.model.compute_logits(hidden.index_select(0, self.inputs.last))

    def query(self) -> bool:
        """Has the last piece queued completed? Never blocks."""
        return self._event is None or bool(self._event.query())

    def synchronize(self) -> None:
        """Wait until the last piece queued has completed."""
        if self._event is not None:
            self._event.synchronize()

    def _mark(self) -> None:
        if self.inputs.tokens.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()  # on the current stream: after the piece just queued


def replay_task(tasks: dict[int, PrefillTask], msg: Forward, begin: Callable[[], PrefillTask]) -> torch.Tensor | None:
    """A follower's replay of one piece of a leader's task: `begin()` makes the task (its embedding) for
    prefill_begin; prefill_block runs msg.layers; prefill_end the logits (the task is forgotten)."""
    if msg.kind == "prefill_begin":
        if msg.task in tasks:
            raise RuntimeError(f"prefill task {msg.task} begun twice")
        tasks[msg.task] = begin()
        return None
    task = tasks.get(msg.task)
    if task is None:
        raise RuntimeError(f"{msg.kind} of prefill task {msg.task}, which was never begun")
    if msg.kind == "prefill_block":
        start, end = msg.layers
        if start != task.layers_done:
            raise RuntimeError(f"prefill task {msg.task}: block [{start}, {end}) after {task.layers_done} layers")
        task.step(end - start)
        return None
    del tasks[msg.task]
    return task.logits()
