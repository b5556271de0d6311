"""The plan of a step of the prefill-first `Scheduler` (scheduler.py, behind `LLM`), and how it queues its sequences.

(The serving engine's decode worker plans its steps with engine/decode_scheduler.py, whose requests live in
two processes and keep states of their own; both share the admission rule, `BlockManager.can_admit`, and the
stop check, `sequence.check_stop`.)

Pure Python, no torch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from rapidserve.block_manager import BlockManager
from rapidserve.sequence import SeqStatus, Sequence


@dataclass(frozen=True)
class Chunk:
    """`length` tokens of `seq` from position `start` (= tokens already in the cache); `samples`:
    the chunk ends the sequence's pending tokens, so the step samples its next token."""

    seq: Sequence
    start: int
    length: int
    samples: bool

    @classmethod
    def of(cls, seq: Sequence, length: int) -> Chunk:
        """The next `length` tokens of `seq` to compute."""
        return cls(seq, seq.num_computed, length, seq.num_computed + length == seq.num_tokens)


@dataclass
class StepPlan:
    """One step: `decode` (one token each, at position num_tokens - 1) and prompt `prefill` chunks;
    `preempted` lists the sequences this step sent back to waiting."""

    decode: list[Sequence] = field(default_factory=list)
    prefill: list[Chunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.decode and not self.prefill

    @property
    def is_decode_only(self) -> bool:
        return bool(self.decode) and not self.prefill

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(c.length for c in self.prefill)

    @property
    def sampled(self) -> list[Sequence]:
        """Sequences that get a new token, in logits row order: decodes, then finishing chunks."""
        return self.decode + [c.seq for c in self.prefill if c.samples]


class SeqQueues:
    """Waiting sequences (no blocks: new, or preempted; FCFS) and running ones (hold blocks for all
    their tokens so far; in admission order), over one BlockManager."""

    def __init__(self, blocks: BlockManager) -> None:
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _fits(self, seq: Sequence, alone: bool) -> bool:
        """The shared admission rule (`BlockManager.can_admit`), counting the sequence's cached prefix."""
        return self.blocks.can_admit(seq.num_tokens, alone, seq.seq_id, seq.all_token_ids)

    def _allocate(self, seq: Sequence) -> None:
        """Blocks for all of the sequence's tokens; its cached prefix counts as computed."""
        _, cached = self.blocks.allocate_cached(seq.seq_id, seq.all_token_ids)
        seq.num_computed = cached
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = cached

    def _computed(self, seq: Sequence) -> None:
        """The sequence's K/V up to `num_computed` are written (or queued before any later reader on
        this one stream): its full blocks may be shared from now on."""
        if self.blocks.needs_commit(seq.seq_id, seq.num_computed):
            self.blocks.commit(seq.seq_id, seq.all_token_ids, seq.num_computed)

    def _preempt(self, seq: Sequence) -> None:
        """By recompute: blocks freed, back to the head of the queue with its outputs (none lost)."""
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Out of every queue and all its blocks back to the pool, at once. Safe while a step that
        includes `seq` is in flight only where later writes are queued behind that step (one stream)."""
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.blocks.free(seq.seq_id)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
