"""EngineCore: the single-process engine (scheduler + runner) behind `rapidserve.LLM`.

One `step()` reads like prose: schedule, run the forward pass the schedule asks for, sample,
record tokens, finish what stopped. It is the reference the two-process engine is compared with.

Structured outputs: a request's grammar starts compiling in the background when it is added, so
the compiles of a `generate` call's requests overlap the steps of the ones ahead; a request is not
held back (unlike the serving workers'): its first mask waits for its compile if that is still
running, which blocks this one-process loop, as compiling in place did, but only for what is left.
`LLM.generate` first compiles and tries each constraint (`check_constraint`, through the same grammar
cache, so nothing is compiled twice) and refuses one the grammar engine cannot serve; a constraint that
fails later (its matcher errs or rejects a token) ends its request alone with finish reason "error" and
the message in its TokenEvent, never with its output unconstrained.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rapidserve.config import EngineConfig
from rapidserve.engine.faults import RequestsFailed
from rapidserve.engine.sampling_step import retain, sample_step
from rapidserve.loader import ModelSource, load_hf_tokenizer
from rapidserve.logit_controls import seq_history
from rapidserve.runner import DecodeItem, ModelRunner, PrefillItem
from rapidserve.sampler import SamplerOutput
from rapidserve.sampling_params import SamplingParams, StructuredOutputs
from rapidserve.scheduler import Scheduler
from rapidserve.sequence import Sequence, check_stop
from rapidserve.structured import GrammarBook, GrammarError, GrammarRow


@dataclass(frozen=True)
class TokenEvent:
    """One new token of a sequence, as the step produced it."""

    seq: Sequence
    token_id: int
    finish_reason: str | None
    message: str = ""  # why, when finish_reason is "error"


class EngineCore:
    def __init__(self, cfg: EngineConfig, source: ModelSource, show_progress: bool = True) -> None:
        self.cfg = cfg
        self.runner = ModelRunner(cfg, source, show_progress=show_progress)
        self.runner.capture_decode_graphs(show_progress=show_progress)
        self.runner.capture_prefill_graphs(show_progress=show_progress)
        self.blocks = self.runner.block_manager()
        self.scheduler = Scheduler(self.blocks, cfg.scheduler.max_num_seqs,
                                   cfg.scheduler.max_num_batched_tokens)
        self.eos_token_ids: tuple[int, ...] = cfg.model_config.eos_token_ids
        self.limits = self.runner.limits  # the prompt check (rapidserve/prompt.py) and the context cap
        self._arrivals = 0
        # Optional extra stop check on the text (stop strings); returns a finish reason or None.
        self.text_stop: Callable[[Sequence], str | None] | None = None
        self._source = source
        self._grammar: GrammarBook | None = None  # made at the first structured-output request

    @property
    def grammar(self) -> GrammarBook:
        """The matchers of structured-output requests (rapidserve/structured)."""
        if self._grammar is None:
            self._grammar = GrammarBook(lambda: load_hf_tokenizer(self._source), self.cfg.model_config.vocab_size,
                                        self.eos_token_ids)
        return self._grammar

    def check_constraint(self, so: StructuredOutputs) -> None:
        """ValueError naming the field when the grammar engine cannot serve `so` (compiled and tried here,
        through the grammar cache: a request of it then finds it compiled, or remembered as failed)."""
        try:
            self.grammar.cache.compile(so)
        except GrammarError as e:
            raise ValueError(f"structured_outputs.{so.kind}: {e}") from None

    def add(self, seq_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Sequence:
        self.limits.check(prompt_token_ids)  # PromptError (a ValueError) naming what is wrong
        self.limits.check_params(params)
        self._arrivals += 1
        seq = Sequence(seq_id, list(prompt_token_ids), params, arrival=self._arrivals)
        self.scheduler.add(seq)
        if params.structured_outputs is not None:  # compiles in the background while earlier requests step;
            self.grammar.prepare(seq_id, params.structured_outputs)  # its first mask waits for it if need be
        return seq

    def abort(self, seq: Sequence) -> None:
        if not seq.is_finished:
            self.scheduler.finish(seq, "abort")
        if self._grammar is not None:
            self._grammar.release(seq.seq_id)
        self._retain_slots()

    def _retain_slots(self) -> None:
        """Free the penalty slots of sequences no longer running (ended or preempted; logit_controls.py)."""
        retain(self.runner, None, ((s.seq_id, s.slot_key) for s in self.scheduler.running))

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[TokenEvent]:
        plan = self.scheduler.schedule()
        if plan.prefill:
            items = [PrefillItem(c.seq.all_token_ids[c.start : c.start + c.length], c.start,
                                 self.blocks.table(c.seq.seq_id), c.samples) for c in plan.prefill]
            logits = self.runner.prefill(items)
            for c in plan.prefill:
                self.scheduler.on_prefill_done(c)
            return self._sample_and_record([c.seq for c in plan.prefill if c.samples], logits)
        if plan.decode:
            items = [DecodeItem(s.last_token_id, s.num_tokens - 1, self.blocks.table(s.seq_id))
                     for s in plan.decode]
            logits = self.runner.decode(items)
            for s in plan.decode:
                self.scheduler.on_decode_done(s)
            return self._sample_and_record(plan.decode, logits)
        return []

    def _sample_and_record(self, seqs: list[Sequence], logits: torch.Tensor) -> list[TokenEvent]:
        """The one sampling step (engine/sampling_step.py), then each token recorded. A row whose grammar
        fails (its compile failed, its matcher erred or rejected a token) fails alone ("error", with its
        message), the rest are sampled without it; any other sampling error
        is raised to the caller (`LLM.generate`), as it always was."""
        if not seqs:
            return []
        failed: dict[int, str] = {}  # row -> its grammar's error (each row its own: faults.py)
        rows = list(range(len(seqs)))
        out = None
        while rows:
            try:
                out = self._sample([seqs[i] for i in rows], logits if len(rows) == len(seqs) else logits[rows])
                break
            except RequestsFailed as e:
                if not isinstance(e.error, GrammarError):
                    raise e.error from None
                failed.update((rows[i], str(e.errors.get(i, e.error))) for i in e.rows)
                rows = [r for r in rows if r not in failed]
        self.runner.record_sampled()  # the sampled tokens join their penalty slots (logit_controls.py)
        sampled = dict(zip(rows, out.rows([seqs[i].params for i in rows]), strict=True)) if out is not None else {}
        events = []
        for i, seq in enumerate(seqs):
            if i in failed:  # its grammar failed: this request fails alone (its own message), nothing sampled
                self.scheduler.finish(seq, "error")
                events.append(TokenEvent(seq, -1, "error", failed[i]))
                continue
            tok, lp, top = sampled[i]
            seq.output_token_ids.append(tok)
            if lp is not None:
                seq.output_logprobs.append(lp)
            if top is not None:
                seq.output_top_logprobs.append(top)
            reason = check_stop(seq.params, seq.output_token_ids, seq.num_tokens, self.eos_token_ids,
                                self.limits.context_cap)
            if reason is None and self.text_stop is not None:
                reason = self.text_stop(seq)
            if reason is not None:
                self.scheduler.finish(seq, reason)
            events.append(TokenEvent(seq, tok, reason))
        s = self.scheduler
        retain(self.runner, self._grammar, ((x.seq_id, x.slot_key) for x in s.running),
               known=[x.seq_id for x in (*s.waiting, *s.running)])
        return events

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> SamplerOutput:
        book = self.grammar if GrammarBook.needed(s.params for s in seqs) else None
        return sample_step(self.runner, book, logits, seqs, [s.params for s in seqs],
                           [len(s.output_token_ids) for s in seqs], self.eos_token_ids,
                           history=lambda i: seq_history(seqs[i]),
                           grammar_rows=lambda: [GrammarRow(i, s.seq_id, s.params, s.output_token_ids)
                                                 for i, s in enumerate(seqs)
                                                 if s.params.structured_outputs is not None])
