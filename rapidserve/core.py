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
from rapidserve.loader import ModelSource, load_hf_tokenizer
from rapidserve.logit_controls import seq_history
from rapidserve.runner import DecodeItem, ModelRunner, PrefillItem
from rapidserve.sampling_params import SamplingParams, StructuredOutputs
from rapidserve.scheduler import Scheduler
from rapidserve.sequence import Sequence, check_stop
from rapidserve.structured import GrammarBook, GrammarError, GrammarMask, GrammarRow


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
        if self.runner.tokens.in_use:
            self.runner.tokens.retain(s.slot_key for s in self.scheduler.running)

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
        if not seqs:
            return []
        mask, failed = self._grammar_mask(seqs)
        out = self.runner.sample_next(logits, [s.params for s in seqs], [len(s.output_token_ids) for s in seqs],
                                      self.eos_token_ids, mask, history=lambda i: seq_history(seqs[i]))
        events = []
        for i, (seq, (tok, lp, top)) in enumerate(zip(seqs, out.rows([s.params for s in seqs]), strict=True)):
            if i in failed:  # its grammar failed: this request fails alone, its token dropped
                self.scheduler.finish(seq, "error")
                events.append(TokenEvent(seq, tok, "error", failed[i]))
                continue
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
        self._retain_slots()
        if self._grammar is not None and len(self._grammar):  # matchers: ended or preempted; compiles: ended
            self._grammar.retain((s.seq_id for s in self.scheduler.running),
                                 known=[s.seq_id for s in (*self.scheduler.waiting, *self.scheduler.running)])
        return events

    def _grammar_mask(self, seqs: list[Sequence]) -> tuple[GrammarMask | None, dict[int, str]]:
        """The structured-output mask of the rows to sample (None when no row has a constraint)."""
        if not GrammarBook.needed(s.params for s in seqs):
            return None, {}
        rows = [GrammarRow(i, s.seq_id, s.params, s.output_token_ids) for i, s in enumerate(seqs)
                if s.params.structured_outputs is not None]
        return self.grammar.fill(rows, pin=self.runner.device.type == "cuda")
