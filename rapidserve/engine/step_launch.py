"""One step of the decode worker on the device: launch it (`launch_step`) and read it back (`landed_rows`).

A step (`StepBatch`, engine/decode_request.py) is one forward pass:
- decode-only: `ModelRunner.decode`, which replays the captured decode graph of the configuration's key;
- fused (prompt chunks in it): one varlen `ModelRunner.prefill` over the decode rows as one-token items at
  their positions, first, then the chunks (`split_decode_rows` runs the leading rows through the decode
  kernel); logits come back for the decode rows and for the chunks that end a prompt, in `sampled` order.
Rows whose newest token is still in flight (scheduling ahead) take it from the previous step's sampled tokens
on the device (`runner.Carry`), without waiting for them. Then the one sampling step (engine/sampling_step.py):
the structured-output mask is filled on the CPU while the device runs the forward just queued (waiting for
the previous step's tokens only when a grammar row's newest token is in flight), and the tokens are sampled on
the device and copied to pinned host memory without waiting; an event marks the step's end. The host reads
the tokens only after that event (`landed_rows`).

Timing (`StepClock`): on a GPU two timing events around the step's work on its stream (`elapsed_ms` once
the step has landed: the device time of the step, queueing behind the step before excluded); on the CPU,
where work is done on return, the wall time of the launch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import torch

from rapidserve.engine.decode_request import DecodeRequest, Row, StepBatch
from rapidserve.engine.sampling_step import sample_step
from rapidserve.logit_controls import TokenHistory
from rapidserve.partition.shape import StepShape
from rapidserve.runner import Carry, DecodeItem, ModelRunner, PrefillItem
from rapidserve.sampler import SamplerOutput
from rapidserve.structured import GrammarBook, GrammarRow


@dataclass
class StepClock:
    """How long a step took on the device: timing events on a GPU, the launch's wall time on the CPU."""

    start: torch.cuda.Event | None = None
    end: torch.cuda.Event | None = None
    wall_ms: float = 0.0

    @classmethod
    def begin(cls, device: torch.device) -> StepClock:
        if device.type != "cuda":
            return cls(wall_ms=-time.perf_counter() * 1e3)
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return cls(start)

    def stop(self) -> torch.cuda.Event | None:
        """The step is queued: its end event (None on the CPU, where it is done)."""
        if self.start is None:
            self.wall_ms += time.perf_counter() * 1e3
            return None
        self.end = torch.cuda.Event(enable_timing=True)
        self.end.record()
        return self.end

    def elapsed_ms(self) -> float:
        """Once the step has landed."""
        if self.start is None or self.end is None:
            return self.wall_ms
        return float(self.start.elapsed_time(self.end))


@dataclass
class InFlight:
    """A launched step: its sampled tokens stay on the device until the step has landed."""

    batch: StepBatch
    sampled: list[DecodeRequest]  # the requests of its logits rows, in order
    out: SamplerOutput | None  # on the device: token_ids feed the next step's inputs directly (None: none sampled)
    host: SamplerOutput | None  # the same, copied to pinned host memory without waiting
    done: torch.cuda.Event | None  # None on the CPU, where the step is done on return
    shape: StepShape
    clock: StepClock
    rows: dict[int, int] = field(default_factory=dict)  # id(request) -> its row among the sampled
    predicted_ms: float | None = None  # the policy's raw prediction of this step (`StepTiming`), if it made one
    planned_ms: float | None = None  # that prediction corrected, as the policy compared it with the SLO
    host_ms: float | None = None  # the host's wall time to plan and launch it (`StepTiming.host_ms`)
    context_sum: int = 0  # its decode rows' contexts as launched, summed (tokens_needed each); set for --step-trace
    # how it was launched (step_cycle.LAUNCHES: behind a step in flight, or with none, and why); set for --step-trace
    launch: str = ""

    @property
    def requests(self) -> list[DecodeRequest]:
        """Every request whose blocks the step writes."""
        return self.batch.decode + [c.req for c in self.batch.chunks]

    @property
    def landed(self) -> bool:
        """Known to have landed without waiting: its end event has completed. Never on the CPU, where `done` is None
        (the step was done on return, and the caller keeps the order it has for a step in flight)."""
        return self.done is not None and bool(self.done.query())


def slot_key(r: DecodeRequest) -> tuple[str, int]:
    """The key of a request's penalty slot (logit_controls.py): a new one after each preemption."""
    return (r.req_id, r.attempt)


def history(r: DecodeRequest) -> TokenHistory:
    """What a request's penalty slot is filled from, at its first sample after (re)admission (nothing of it
    is in flight then: `outputs` is complete)."""
    return TokenHistory(slot_key(r), r.request.prompt_token_ids, r.outputs)


def launch_step(runner: ModelRunner, grammar: GrammarBook, eos: tuple[int, ...], table: Callable[[str], Sequence[int]],
                batch: StepBatch, prev: InFlight | None, graph_key: str, shape: StepShape) -> InFlight:
    """Queue `batch`'s forward pass and its sampling on the current stream (`table`: a request's block table, as
    the scheduler grew it); returns without waiting. Nothing of the scheduler's state moves here: the caller
    marks the step launched once this has returned (a step that raises was not taken)."""
    clock = StepClock.begin(runner.device)
    where = prev.rows if prev is not None else {}
    carried = [(i, where[id(r)]) for i, r in enumerate(batch.decode) if r.inflight]
    carry = Carry(prev.out.token_ids, carried) if carried and prev is not None and prev.out is not None else None
    tokens = [0 if r.inflight else r.outputs[-1] for r in batch.decode]  # 0: overwritten on the device (carry)
    tables = {id(r): table(r.req_id) for r in batch.decode} | {id(c.req): table(c.req.req_id) for c in batch.chunks}
    rows = list(zip(tokens, batch.decode, strict=True))  # each decode row's input token is at tokens_needed - 1
    if not batch.chunks:
        logits = runner.decode([DecodeItem(t, r.tokens_needed - 1, tables[id(r)]) for t, r in rows],
                               graph_key=graph_key, carry=carry)
    else:  # the decode rows first, as one-token items (a Carry indexes only leading one-token items)
        items = [PrefillItem([t], r.tokens_needed - 1, tables[id(r)]) for t, r in rows]
        items += [PrefillItem(c.req.tokens[c.start:c.end], c.start, tables[id(c.req)], need_logits=c.samples)
                  for c in batch.chunks]
        logits = runner.prefill(items, carry=carry, graph_key=graph_key)
    sampled = batch.sampled
    out = host = None
    if sampled:
        index = [len(r.outputs) + r.inflight for r in sampled]  # the output index of each row's token
        out = sample_step(runner, grammar, logits, sampled, [r.params for r in sampled], index, eos,
                          history=lambda i: history(sampled[i]), grammar_rows=lambda: grammar_rows(sampled, prev))
        host = out.to_host()  # queued before the next step: reading it later never waits for that step
    done = clock.stop()
    runner.record_sampled()  # the step is wholly queued: its tokens join their penalty slots (logit_controls.py)
    return InFlight(batch, sampled, out, host, done, shape, clock, {id(r): i for i, r in enumerate(sampled)})


def landed_rows(f: InFlight) -> list[Row]:
    """The tokens of a landed step, in `sampled` order (the caller waited for `f.done`)."""
    return f.host.rows([r.params for r in f.sampled]) if f.host is not None else []


def grammar_rows(sampled: list[DecodeRequest], prev: InFlight | None) -> list[GrammarRow]:
    """The structured-output rows of a step, made on the CPU while the device runs its forward (queued
    already). Each matcher replays the tokens known so far (the first token from PrefillDone, every output
    after a preemption, none before a first token) plus, for a row whose token is in flight, `prev`'s token:
    only a step with such a grammar row waits for `prev` here."""
    prev_tokens: list[int] | None = None
    rows: list[GrammarRow] = []
    for i, r in enumerate(sampled):
        if r.params.structured_outputs is None:
            continue
        if not r.inflight:
            rows.append(GrammarRow(i, r.req_id, r.params, r.outputs))
            continue
        if prev_tokens is None:
            assert prev is not None and prev.host is not None
            if prev.done is not None:
                prev.done.synchronize()
            prev_tokens = prev.host.token_ids.tolist()
        rows.append(GrammarRow(i, r.req_id, r.params, Appended(r.outputs), prev_tokens[prev.rows[id(r)]]))
    return rows


class Appended(Sequence[int]):
    """`tokens` and one more token after them, as a sequence, without copying `tokens`: a grammar row's known
    tokens whose newest is given apart (`GrammarRow.last`); this stands in for it (never read)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens) + 1

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[int]: ...

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [*self.tokens, -1][i]
        n = len(self.tokens)
        k = i + n + 1 if i < 0 else i
        if not 0 <= k <= n:
            raise IndexError(i)
        return self.tokens[k] if k < n else -1

    def __iter__(self) -> Iterator[int]:
        yield from self.tokens
        yield -1
