"""Hybrid scheduling (Sarathi-Serve / vLLM chunked prefill): one mixed forward pass per step.

Pure Python, no torch: every decision is tested on CPU against a `BlockManager`. The runner only
executes a `StepPlan` (step_plan.py, shared with the single-process `Scheduler`, prefill first,
behind `LLM`, along with the waiting/running queues, preemption and `finish`).

States: waiting (holds no blocks: new, or preempted) -> running (admitted: holds blocks for all of
its tokens so far; kept in admission order) -> finished. A running sequence needs
`num_tokens - num_computed` tokens computed. While that is more than one, its prompt (after a
preemption: prompt + earlier outputs) is being prefilled in chunks; once it is one, the sequence
decodes: the newest token is computed and the next one sampled.

Policy, each step (`schedule`):
1. Decodes first. Every running sequence that needs one token gets it, in admission order. Its
   block table grows to cover that token; when the pool is short, the most recently admitted
   running sequence (possibly one still prefilling) is preempted by recompute: its blocks are freed,
   `num_computed` drops to 0 and it goes back to the head of the waiting queue with its outputs, so
   no token is lost or repeated. A sequence that is itself the latest admitted preempts itself.
2. Then what is left of the token budget goes to prompts: first the running sequences whose prompt
   is partly computed (admission order), then waiting sequences in arrival order, admitted while the
   running cap, the budget and the pool allow. Admission allocates the blocks of all the sequence's
   tokens at once, keeping the watermark free unless nothing else runs. A prompt longer than what
   is left of the budget gets a chunk of that size and goes on next step; several short prompts may
   share a step. Nothing is admitted in a step that preempted (the pool is short).
   Waiting sequences in `hold` (their grammar still compiling: `GrammarBook.compiling`) are passed
   over, keeping their place; the rest are admitted in order as above. A sequence is only held
   before it first runs (readiness only moves forward), so running ones never are.

Invariants (checked by the tests after every step):
- the tokens of a plan (one per decode plus the chunk lengths) never exceed the budget;
- at most `min(max_num_seqs, budget)` sequences run, so the decodes always fit the budget and a
  running sequence is never starved of its decode;
- every planned sequence's block table covers `num_computed` + its planned tokens;
- a sequence is in at most one of `waiting` and `running`; every block is free or owned by exactly
  one sequence, and a finished sequence owns none.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Set as AbstractSet

from rapidserve.block_manager import BlockManager
from rapidserve.sequence import SeqStatus, Sequence
from rapidserve.step_plan import Chunk, SeqQueues, StepPlan


class HybridScheduler(SeqQueues):
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        if max_num_seqs <= 0 or max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_seqs={max_num_seqs} and max_num_batched_tokens="
                             f"{max_num_batched_tokens} must be positive")
        super().__init__(blocks)
        self.budget = max_num_batched_tokens
        self.max_running = min(max_num_seqs, max_num_batched_tokens)

    def counts(self) -> tuple[int, int, int]:
        """(decoding, prefilling, waiting) sequences, for stats."""
        prefilling = sum(1 for s in self.running if s.num_tokens - s.num_computed > 1)
        return len(self.running) - prefilling, prefilling, len(self.waiting)

    # ---- the step ---------------------------------------------------------------------------
    def schedule(self, finishing: Callable[[Sequence], bool] | None = None,
                 hold: AbstractSet[str] = frozenset()) -> StepPlan:
        """The next step. `finishing` (scheduling ahead): running sequences whose token in flight will
        certainly end them get no decode. `hold`: ids of waiting sequences not to admit yet."""
        plan = StepPlan()
        budget = self._schedule_decodes(plan, finishing)
        budget = self._continue_prefills(plan, budget)
        if not plan.preempted:
            self._admit(plan, budget, hold)
        return plan

    def _schedule_decodes(self, plan: StepPlan, finishing: Callable[[Sequence], bool] | None) -> int:
        budget = self.budget
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING or seq.num_tokens - seq.num_computed != 1:
                continue  # preempted as a victim earlier in this pass, or still prefilling
            if finishing is not None and finishing(seq):
                continue
            if budget == 0:
                break  # unreachable while max_running <= budget; kept so the budget is never exceeded
            if self._grow_or_preempt(seq, plan):
                plan.decode.append(seq)
                budget -= 1
        return budget

    def _grow_or_preempt(self, seq: Sequence, plan: StepPlan) -> bool:
        """Make `seq`'s table cover its newest token, preempting the latest admitted sequences (never
        one already planned: those were admitted before `seq`). False if `seq` preempted itself."""
        while not self.blocks.can_grow(seq.seq_id, seq.num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is seq:
                return False
        self.blocks.grow(seq.seq_id, seq.num_tokens)
        return True

    def _continue_prefills(self, plan: StepPlan, budget: int) -> int:
        for seq in self.running:
            if budget == 0:
                break
            rest = seq.num_tokens - seq.num_computed
            if rest > 1:
                budget -= self._plan_chunk(plan, seq, budget)
        return budget

    def _admit(self, plan: StepPlan, budget: int, hold: AbstractSet[str]) -> None:
        while budget > 0 and len(self.running) < self.max_running:
            seq = next((x for x in self.waiting if x.seq_id not in hold), None)  # the head, without holds
            if seq is None or not self._fits(seq, alone=not self.running):
                return
            self.waiting.remove(seq)
            self._allocate(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            budget -= self._plan_chunk(plan, seq, budget)

    def _plan_chunk(self, plan: StepPlan, seq: Sequence, budget: int) -> int:
        n = min(seq.num_tokens - seq.num_computed, budget)
        plan.prefill.append(Chunk.of(seq, n))
        return n

    # ---- after the step ---------------------------------------------------------------------
    def complete(self, plan: StepPlan, commit: bool = True) -> None:
        """The plan's forward pass has run (or, scheduling ahead, is queued): its tokens' K/V are in
        the cache. Call before appending the sampled tokens. Sequences finished meanwhile (aborted) are
        left alone. `commit=False` (scheduling ahead, when the newest tokens may still be placeholders)
        leaves registering the full blocks in the prefix cache to `commit` once they are known."""
        for seq in plan.decode:
            if seq.status is SeqStatus.RUNNING:
                seq.num_computed = seq.num_tokens
                if commit:
                    self._computed(seq)
        for c in plan.prefill:
            if c.seq.status is SeqStatus.RUNNING:
                c.seq.num_computed = c.start + c.length
                if commit:
                    self._computed(c.seq)

    def commit(self, plan: StepPlan) -> None:
        """Register the full computed blocks of the plan's running sequences (their tokens up to
        `num_computed` must be real ids by now)."""
        for seq in [*plan.decode, *(c.seq for c in plan.prefill)]:
            if seq.status is SeqStatus.RUNNING:
                self._computed(seq)
