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

from rapidserve.block_manager import BlockManager
from rapidserve.sequence import SeqStatus, Sequence
from rapidserve.step_plan import Chunk, SeqQueues, StepPlan


class Scheduler(SeqQueues):
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        super().__init__(blocks)
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens

    def schedule(self) -> StepPlan:
        out = StepPlan()
        self._schedule_prefill(out)
        if not out.prefill:
            self._schedule_decode(out)
        return out

    def _schedule_prefill(self, out: StepPlan) -> None:
        budget = self.budget
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if not self.blocks.has(seq.seq_id):
                if len(self.running) + len(out.prefill) >= self.max_num_seqs:
                    break
                if not self._fits(seq, alone=not self.running and not out.prefill):
                    break
                self._allocate(seq)
            length = min(seq.num_tokens - seq.num_computed, budget)
            out.prefill.append(Chunk.of(seq, length))
            budget -= length
            if seq.num_computed + length < seq.num_tokens:
                break  # a chunked prompt keeps the head of the queue until its last chunk
            self.waiting.popleft()

    def _schedule_decode(self, out: StepPlan) -> None:
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

    # ---- after the step ---------------------------------------------------------------------
    def on_prefill_done(self, chunk: Chunk) -> None:
        """The chunk's K/V are in the cache; a last chunk makes the sequence run."""
        seq = chunk.seq
        seq.num_computed = chunk.start + chunk.length
        self._computed(seq)
        if chunk.samples and seq.status is not SeqStatus.FINISHED:
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)

    def on_decode_done(self, seq: Sequence) -> None:
        seq.num_computed = seq.num_tokens  # the last token's K/V were written by this step
        self._computed(seq)
