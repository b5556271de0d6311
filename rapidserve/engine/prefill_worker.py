"""The prefill worker: computes prompts into KV blocks that decode allocated, samples first tokens.

It attaches the decode worker's weights and KV pool by IPC handle (no copy) and has no block
manager: it writes only into the blocks a KVReady handed it. It hears only from decode (ring d2p),
in order: a request arrives inside its KVReady, and a Drop always follows the KVReady it concerns.

Queue: `waiting_prefill`, in arrival order (`enqueue`). A batch takes whole prompts in order up to the
token budget, and no more once it holds `--prefill-batch-tokens` (`take_prefill_batch`); a prompt longer
than the budget alone is computed in budget-sized chunks over several forwards.

Loop: drain the inbox (a SetPartition from decode switches the compute partition for the next
forward), run one prefill batch on that partition's stream, publish PrefillDone to decode carrying the
sampled token, which decode streams when the request joins its batch (so the gap to the next token
is one decode step); a token that ends its request goes to the router at once, before PrefillDone.
The router stops this worker with SIGTERM (worker_io.worker_signals), before decode.
A request with structured outputs gets its first token sampled under its grammar's mask (its matcher
replays the outputs of a preempted request first, and is dropped once the token is sampled; decode
replays the same tokens into its own). Its grammar starts compiling in the background when the
KVReady comes; until it is compiled the job is passed over (`take_batch`'s `hold`) and the others go on.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from rapidserve.config import EngineConfig
from rapidserve.engine import messages as m
from rapidserve.engine.faults import RequestsFailed, describe, fault_of, is_fatal
from rapidserve.engine.sampling_step import retain, sample_step
from rapidserve.engine.worker_io import WorkerIO
from rapidserve.logit_controls import TokenHistory
from rapidserve.partition.backend import PartitionBackend, on_stream
from rapidserve.runner import ModelRunner, PrefillItem
from rapidserve.stop_rules import check_stop
from rapidserve.structured import GrammarBook, GrammarRow


def enqueue(queue: deque[Job], job: Job) -> None:
    """Queue `job` in arrival order (the router's stamp; equal stamps keep their order). Decode admits in
    arrival order, so this appends, except for a request that decode passed over while a prefix it shares
    was being written (`DecodeScheduler`: waiting for a prefix in flight): it takes the place its arrival
    gives it, ahead of later arrivals admitted meanwhile, even one whose chunks have started (that one
    goes on after it: its chunks' K/V stay where they are)."""
    i = len(queue)
    while i > 0 and queue[i - 1].req.arrival > job.req.arrival:
        i -= 1
    queue.insert(i, job)


@dataclass
class Job:
    req: m.NewRequest
    tokens: list[int]  # everything to compute: the prompt, or prompt + outputs after a preemption
    blocks: list[int]
    attempt: int
    done_tokens: int = 0  # computed so far (the cached prefix or decode's chunks: KVReady.start_tokens, then chunks)
    cached_tokens: int = 0  # of those, found in the prefix cache
    admitted: float = 0.0  # decode allocated its blocks (KVReady.admitted)
    started: float | None = None  # its first chunk was queued on the device (`mark_started`)

    @classmethod
    def of(cls, kv: m.KVReady) -> Job:
        return cls(kv.request, list(kv.request.prompt_token_ids) + list(kv.outputs), list(kv.block_ids), kv.attempt,
                   done_tokens=kv.start_tokens, cached_tokens=kv.cached_tokens, admitted=kv.admitted,
                   started=kv.started)

    def mark_started(self, now: float) -> None:
        """A forward over one of its chunks is about to be queued: the first one starts its prefill."""
        if self.started is None:
            self.started = now

    @property
    def output_index(self) -> int:
        return len(self.tokens) - len(self.req.prompt_token_ids)

    @property
    def history(self) -> TokenHistory:
        n = len(self.req.prompt_token_ids)
        return TokenHistory((self.req.req_id, self.attempt), self.tokens[:n], self.tokens[n:])


def take_prefill_batch(waiting: Iterable[Job], budget: int, target: int,
                       hold: AbstractSet[str] = frozenset()) -> list[tuple[Job, int]]:
    """One forward's prompts, in queue order, as (job, tokens to compute now): whole prompts while the
    batch holds fewer than `target` tokens and the next fits in `budget`; the first prompt of a batch
    that is over `budget` alone goes in a budget-sized chunk. Jobs in `hold` are passed over. A pure
    function: tests/test_prefill_batch.py."""
    batch: list[tuple[Job, int]] = []
    left = budget
    for job in waiting:
        if job.req.req_id in hold:
            continue
        rest = len(job.tokens) - job.done_tokens
        if not batch:
            batch.append((job, min(rest, left)))  # a chunk of an over-budget prompt goes alone
            left -= min(rest, left)
            if rest >= budget:
                break
        elif rest <= left:
            batch.append((job, rest))
            left -= rest
        else:
            break
        if budget - left >= target:
            break
    return batch


class PrefillWorker:
    def __init__(self, cfg: EngineConfig, runner: ModelRunner, io: WorkerIO, backend: PartitionBackend,
                 partition: str) -> None:
        self.cfg, self.runner, self.io, self.backend = cfg, runner, io, backend
        self.eos, self.context_cap = cfg.model_config.eos_token_ids, runner.limits.context_cap
        self.budget = cfg.scheduler.max_num_batched_tokens
        self.batch_target = cfg.scheduler.prefill_batch_tokens or self.budget
        self.waiting_prefill: deque[Job] = deque()
        self.partition = partition  # set by decode (SetPartition); applies from the next forward
        self._last_beat = 0.0
        self._last_stream: Any = None  # the partition stream of the last forward (stream ordering)
        self.grammar = GrammarBook.for_model(cfg.model, cfg.model_config.vocab_size, self.eos, cfg.tokenizer)
        if runner.device.type != "cpu":  # the first constraint finds its tokenizer loaded
            self.grammar.warm()

    def run(self) -> None:
        while True:
            for msg in self.io.drain():
                self.handle(msg)
            hold = self.grammar.compiling()
            if any(j.req.req_id not in hold for j in self.waiting_prefill):
                self.prefill_step()
            else:  # idle, or every job waits for its grammar, whose end rings no doorbell: poll
                self.io.wait(self.grammar.idle_wait(0.1))
            self.heartbeat()
            if not self.io.others_alive():
                return

    def heartbeat(self) -> None:
        """Tell the router this loop still turns (it kills a worker that stays silent too long)."""
        now = time.monotonic()
        if now - self._last_beat >= self.cfg.launch.stats_interval_s:
            self._last_beat = now
            self.io.to_router.try_send(m.Heartbeat("prefill", len(self.waiting_prefill)))

    def handle(self, msg: object) -> None:
        if isinstance(msg, m.KVReady):
            enqueue(self.waiting_prefill, Job.of(msg))
            self.grammar.prepare(msg.request.req_id, msg.request.params.structured_outputs)  # off the loop
        elif isinstance(msg, m.Drop):  # answered even when PrefillDone/PrefillFailed went first
            for job in [j for j in self.waiting_prefill if j.req.req_id == msg.req_id]:
                self.waiting_prefill.remove(job)
            self.grammar.release(msg.req_id)
            self.io.to_decode.send(m.Dropped(msg.req_id))
        elif isinstance(msg, m.SetPartition):
            self.backend.stream(msg.config, "prefill")  # raises on a configuration we do not have
            self.partition = msg.config

    # ---- prefill ----------------------------------------------------------------------------
    def take_batch(self, hold: AbstractSet[str] = frozenset()) -> list[tuple[Job, int]]:
        """This step's batch (`take_prefill_batch`). Jobs in `hold` (their grammar still compiling:
        `GrammarBook.compiling`) are passed over, keeping their place."""
        return take_prefill_batch(self.waiting_prefill, self.budget, self.batch_target, hold)

    def prefill_step(self) -> None:
        """One forward on the current partition's stream. Reading the sampled tokens waits for it, so
        the KV writes have landed before PrefillDone tells decode to read them.

        Stream ordering: a forward that samples nothing (a chunk of a long prompt) is not waited for,
        and the next chunk reads its KV. After a SetPartition the next forward runs on another stream,
        so that stream first waits for the one the last forward ran on."""
        stream = self.backend.stream(self.partition, "prefill")
        last, self._last_stream = self._last_stream, stream
        if stream is not None and last is not None and last is not stream:
            stream.wait_stream(last)
        with on_stream(stream):
            self._prefill_step()
        if len(self.grammar):  # compile state of the jobs that left (done, failed)
            self.grammar.retain((), known=(j.req.req_id for j in self.waiting_prefill))

    def _prefill_step(self) -> None:
        """A request never takes the worker down (engine/faults.py): if the batch raises, each of its
        requests is run alone, and the ones that still raise fail by themselves (PrefillFailed);
        errors that leave the device unusable (`is_fatal`) end the worker, and the router restarts it."""
        batch = self.take_batch(self.grammar.compiling())
        if not batch:  # every job waits for its grammar
            return
        try:
            self._compute(batch)
        except Exception as e:  # noqa: BLE001 - isolated below
            if is_fatal(e):
                raise
            self._isolate(batch, e)

    def _isolate(self, batch: list[tuple[Job, int]], e: BaseException) -> None:
        """After `batch` raised `e`: a lone request fails with it; otherwise each request is run alone and
        the ones that still raise fail by themselves."""
        if len(batch) == 1:
            self._fail(batch[0][0], e)
            return
        for job, n in batch:
            try:
                self._compute([(job, n)])
            except Exception as e1:  # noqa: BLE001 - this request fails alone
                if is_fatal(e1):
                    raise
                self._fail(job, e1)

    def _compute(self, batch: list[tuple[Job, int]]) -> None:
        """One forward over `batch`, then sampling and publishing for the prompts it completes."""
        items = [PrefillItem(j.tokens[j.done_tokens : j.done_tokens + n], j.done_tokens, j.blocks,
                             need_logits=j.done_tokens + n == len(j.tokens)) for j, n in batch]
        now = time.monotonic()
        for j, _ in batch:
            j.mark_started(now)
        logits = self.runner.prefill(items, graph_key=self.partition)
        self.forward_queued(batch)
        finished = [j for (j, n), it in zip(batch, items, strict=True) if it.need_logits]
        firsts, dones = self._sample(finished, logits) if finished else ([], [])
        self.computed(batch, finished)
        for j, n in batch:  # only once everything above has succeeded
            j.done_tokens += n
        for j in finished:
            self.waiting_prefill.remove(j)
        if firsts:
            self.io.to_router.send(m.TokenBatch(firsts))
        for d in dones:
            self.io.to_decode.send(d)

    # Seams of disagg mode (engine/disagg.py), which computes into its own staging pool; here, in place.
    def forward_queued(self, batch: list[tuple[Job, int]]) -> None:
        """The forward over `batch` is queued on the current stream (its KV writes are in decode's pool)."""

    def computed(self, batch: list[tuple[Job, int]], finished: list[Job]) -> None:
        """`batch` is computed and sampled; `finished` are done and about to be published."""

    def _fail(self, job: Job, e: BaseException) -> None:
        self.runner.synchronize()  # a forward that raised may still be writing its blocks
        if job in self.waiting_prefill:
            self.waiting_prefill.remove(job)
        cause = e  # a lone job's row error (its own message and fault: faults.py)
        if isinstance(e, RequestsFailed):
            cause = e.errors.get(e.rows[0], e.error) if e.rows else e.error
        self.io.to_decode.send(m.PrefillFailed(job.req.req_id, job.attempt, describe(cause, "prefill"),
                                               fault_of(cause)))

    def _sample(self, jobs: list[Job], logits: object) -> tuple[list[m.TokenOut], list[m.PrefillDone]]:
        import torch

        assert isinstance(logits, torch.Tensor)
        params = [j.req.params for j in jobs]
        try:  # the one sampling step; its penalty slots and matchers serve this token only, then are freed. A job
            # with structured outputs replays the outputs known so far (none, or all of them after a preemption);
            # decode builds its own matcher from the same tokens. A row that fails raises: the batch is retried
            # one job at a time (`_isolate`), so only that job fails.
            out = sample_step(self.runner, self.grammar, logits, jobs, params, [j.output_index for j in jobs], self.eos,
                              history=lambda i: jobs[i].history,
                              grammar_rows=lambda: [GrammarRow(i, j.req.req_id, j.req.params,
                                                               j.tokens[len(j.req.prompt_token_ids):])
                                                    for i, j in enumerate(jobs)
                                                    if j.req.params.structured_outputs is not None])
        finally:
            retain(self.runner, self.grammar, ())
        firsts, dones = [], []
        rows = out.rows([j.req.params for j in jobs])  # waits for the tokens
        sampled = time.monotonic()
        for j, (tok, lp, top, rank) in zip(jobs, rows, strict=True):
            outputs = j.tokens[len(j.req.prompt_token_ids):] + [tok]
            reason = check_stop(j.req.params, outputs, len(j.tokens) + 1, self.eos, self.context_cap)
            first_time = j.output_index == 0
            times = m.PhaseTimes(j.admitted, j.started or sampled, sampled) if first_time else None
            first = m.TokenOut(j.req.req_id, j.output_index, tok, lp, top, reason,
                               j.cached_tokens if first_time else None, times, rank)
            if reason is not None:  # the request ends here: the router hears it now
                firsts.append(first)
            dones.append(m.PrefillDone(j.req.req_id, j.attempt, first))
        return firsts, dones
