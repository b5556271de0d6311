"""Single-process continuous batching (the reference engine behind `rapidserve.LLM`).

Policy, step by step:
1. Prefill first. Waiting sequences are admitted in arrival order while the step's token budget,
   the running-sequence cap and the KV pool (keeping the watermark free) allow. A sequence gets the
   blocks for its whole prompt when admitted. A prompt longer than the budget is computed in
   budget-sized chunks over several steps (chunked only then); it stays at the head of the queue
   until its last chunk, which samples its first token.
2. Otherwise decode every running sequence. Each needs its table to cover all its tokens (the last
   token's K/V is written this step). When the pool is short, the most recently admitted running
   sequence is preempted by recompute: its blocks are freed and it returns to the head of the
   waiting queue, to recompute prompt and outputs later (no token is lost or repeated).
Decisions are made here and nowhere else; the runner only executes them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from rapidserve.block_manager import BlockManager
from rapidserve.sequence import SeqStatus, Sequence


@dataclass(frozen=True)
class PrefillChunk:
    seq: Sequence
    start: int  # first token position of this chunk (= tokens already in the cache)
    length: int  # new tokens computed this step

    @property
    def is_last(self) -> bool:
        return self.start + self.length == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    prefill: list[PrefillChunk] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._schedule_prefill(out)
        if not out.prefill:
            self._schedule_decode(out)
        return out

    def _schedule_prefill(self, out: SchedulerOutput) -> None:
        budget = self.budget
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if not self.blocks.has(seq.seq_id):
                if len(self.running) + len(out.prefill) >= self.max_num_seqs:
                    break
                alone = not self.running and not out.prefill
                fits = self.blocks.can_allocate(seq.num_tokens) or (
                    alone and self.blocks.num_free * self.blocks.block_size >= seq.num_tokens
                )  # the watermark never starves the only sequence
                if not fits:
                    break
                self.blocks.allocate(seq.seq_id, seq.num_tokens)
            length = min(seq.num_tokens - seq.num_computed, budget)
            out.prefill.append(PrefillChunk(seq, seq.num_computed, length))
            budget -= length
            if seq.num_computed + length < seq.num_tokens:
                break  # a chunked prompt keeps the head of the queue until its last chunk
            self.waiting.popleft()

    def _schedule_decode(self, out: SchedulerOutput) -> None:
        scheduled: list[Sequence] = []
        queue = list(self.running)
        while queue:
            seq = queue.pop(0)
            while not self.blocks.can_grow(seq.seq_id, seq.num_tokens):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.blocks.grow(seq.seq_id, seq.num_tokens)
                scheduled.append(seq)
        out.decode = scheduled
        self.running = list(scheduled)

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq.seq_id)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ---- after the step ---------------------------------------------------------------------
    def on_prefill_done(self, chunk: PrefillChunk) -> None:
        """The chunk's K/V are in the cache; a last chunk makes the sequence run."""
        seq = chunk.seq
        seq.num_computed = chunk.start + chunk.length
        if chunk.is_last and seq.status is not SeqStatus.FINISHED:
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)

    def on_decode_done(self, seq: Sequence) -> None:
        seq.num_computed = seq.num_tokens  # the last token's K/V were written by this step

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.blocks.free(seq.seq_id)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
