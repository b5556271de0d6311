"""The prefill worker: computes prompts into KV blocks that decode allocated, samples first tokens.

It attaches the decode worker's weights and KV pool by IPC handle (no copy) and has no block
manager: it writes only into the blocks a KVReady handed it.

Queues: `pending_kv` (NewRequest seen, blocks not yet handed over) and `waiting_prefill` (blocks
handed over, FCFS). A batch takes whole prompts in order up to the token budget; a prompt longer
than the budget alone is computed in budget-sized chunks over several forwards.
Messages may overtake each other across rings (a KVReady or Drop from decode can arrive before the
router's NewRequest), so early KVReadys are parked and Drops of unknown requests leave a tombstone.

Loop: drain the inbox (a SetPartition from decode switches the compute partition for the next
forward), run one prefill batch on that partition's stream, publish PrefillDone to decode carrying the
sampled token, which decode streams when the request joins its batch (so the gap to the next token
is one decode step); a token that ends its request goes to the router at once, before PrefillDone.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from rapidserve.config import EngineConfig
from rapidserve.engine import messages as m
from rapidserve.engine.faults import describe, is_fatal
from rapidserve.engine.worker_io import WorkerIO
from rapidserve.partition.backend import PartitionBackend, on_stream
from rapidserve.runner import ModelRunner, PrefillItem
from rapidserve.sequence import Sequence, check_stop

TOMBSTONES = 4096


@dataclass
class Job:
    req: m.NewRequest
    tokens: list[int]  # everything to compute: the prompt, or prompt + outputs after a preemption
    blocks: list[int]
    attempt: int
    done_tokens: int = 0  # computed so far (chunked prefill)

    @property
    def output_index(self) -> int:
        return len(self.tokens) - len(self.req.prompt_token_ids)


class PrefillWorker:
    def __init__(self, cfg: EngineConfig, runner: ModelRunner, io: WorkerIO, eos: tuple[int, ...],
                 backend: PartitionBackend, partition: str) -> None:
        self.cfg, self.runner, self.io, self.eos = cfg, runner, io, eos
        self.backend = backend
        self.budget = cfg.scheduler.max_num_batched_tokens
        self.pending_kv: dict[str, m.NewRequest] = {}
        self.early_kv: dict[str, m.KVReady] = {}
        self.waiting_prefill: deque[Job] = deque()
        self.tombstones: OrderedDict[str, None] = OrderedDict()
        self.partition = partition  # set by decode (SetPartition); applies from the next forward
        self._stop = False
        self._last_beat = 0.0
        self._last_stream: Any = None  # the partition stream of the last forward (stream ordering)

    def run(self) -> None:
        while not self._stop:
            for msg in self.io.drain():
                self.handle(msg)
            if self.waiting_prefill:
                self.prefill_step()
            else:
                self.io.wait(0.1)
            self.heartbeat()
            if not self.io.others_alive():
                return

    def heartbeat(self) -> None:
        """Tell the router this loop still turns (it kills a worker that stays silent too long)."""
        now = time.monotonic()
        if now - self._last_beat >= self.cfg.launch.stats_interval_s:
            self._last_beat = now
            self.io.send["p2r"].try_send(m.Heartbeat("prefill", len(self.waiting_prefill) + len(self.pending_kv)))

    # ---- inbox ------------------------------------------------------------------------------
    def handle(self, msg: object) -> None:
        if isinstance(msg, m.NewRequest):
            if self.tombstones.pop(msg.req_id, 0) is None:
                return  # dropped before it arrived
            self.pending_kv[msg.req_id] = msg
            early = self.early_kv.pop(msg.req_id, None)
            if early is not None:
                self._kv_ready(early)
        elif isinstance(msg, m.KVReady):
            self._kv_ready(msg)
        elif isinstance(msg, m.Drop):
            self._drop(msg.req_id)
        elif isinstance(msg, m.SetPartition):
            self.backend.stream(msg.config, "prefill")  # raises on a configuration we do not have
            self.partition = msg.config
        elif isinstance(msg, m.Shutdown):
            self._stop = True

    def _kv_ready(self, msg: m.KVReady) -> None:
        req = msg.request if msg.request is not None else self.pending_kv.pop(msg.req_id, None)
        if req is None:
            self.early_kv[msg.req_id] = msg
            return
        tokens = list(msg.token_ids) if msg.token_ids else list(req.prompt_token_ids)
        self.waiting_prefill.append(Job(req, tokens, list(msg.block_ids), msg.attempt))

    def _drop(self, req_id: str) -> None:
        known = self.pending_kv.pop(req_id, None) is not None
        known |= self.early_kv.pop(req_id, None) is not None
        for job in list(self.waiting_prefill):
            if job.req.req_id == req_id:
                self.waiting_prefill.remove(job)
                known = True
        if not known:
            self.tombstones[req_id] = None
            while len(self.tombstones) > TOMBSTONES:
                self.tombstones.popitem(last=False)
        self.io.send["p2d"].send(m.Dropped(req_id))

    # ---- prefill ----------------------------------------------------------------------------
    def take_batch(self) -> list[tuple[Job, int]]:
        """FCFS whole prompts up to the budget; a prompt over the budget alone goes in chunks."""
        batch: list[tuple[Job, int]] = []
        left = self.budget
        for job in self.waiting_prefill:
            rest = len(job.tokens) - job.done_tokens
            if rest <= left:
                batch.append((job, rest))
                left -= rest
            elif not batch:
                batch.append((job, left))  # chunk of an over-budget prompt
                break
            else:
                break
        return batch

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

    def _prefill_step(self) -> None:
        """A request never takes the worker down (engine/faults.py): if the batch raises, each of its
        requests is run alone, and the ones that still raise fail by themselves (PrefillFailed);
        errors that leave the device unusable (`is_fatal`) end the worker, and the router restarts it."""
        batch = self.take_batch()
        try:
            self._compute(batch)
        except Exception as e:  # noqa: BLE001 - isolated below
            if is_fatal(e):
                raise
            for job, n in batch if len(batch) > 1 else []:
                try:
                    self._compute([(job, n)])
                except Exception as e1:  # noqa: BLE001 - this request fails alone
                    if is_fatal(e1):
                        raise
                    self._fail(job, e1)
            if len(batch) == 1:
                self._fail(batch[0][0], e)

    def _compute(self, batch: list[tuple[Job, int]]) -> None:
        """One forward over `batch`, then sampling and publishing for the prompts it completes."""
        items = [PrefillItem(j.tokens[j.done_tokens : j.done_tokens + n], j.done_tokens, j.blocks,
                             need_logits=j.done_tokens + n == len(j.tokens)) for j, n in batch]
        logits = self.runner.prefill(items)
        finished = [j for (j, n), it in zip(batch, items, strict=True) if it.need_logits]
        firsts, dones = self._sample(finished, logits) if finished else ([], [])
        for j, n in batch:  # only once everything above has succeeded
            j.done_tokens += n
        for j in finished:
            self.waiting_prefill.remove(j)
        if firsts:
            self.io.send["p2r"].send(m.TokenBatch(firsts))
        for d in dones:
            self.io.send["p2d"].send(d)

    def _fail(self, job: Job, e: BaseException) -> None:
        if self.runner.device.type == "cuda":  # a forward that raised may still be writing its blocks
            import torch

            torch.cuda.current_stream().synchronize()
        if job in self.waiting_prefill:
            self.waiting_prefill.remove(job)
        why = describe(e, "prefill")
        self.io.send["p2d"].send(m.PrefillFailed(job.req.req_id, job.attempt, why))

    def _sample(self, jobs: list[Job], logits: object) -> tuple[list[m.TokenOut], list[m.PrefillDone]]:
        import torch

        assert isinstance(logits, torch.Tensor)
        out = self.runner.sample_next(logits, [j.req.params for j in jobs], [j.output_index for j in jobs], self.eos)
        firsts, dones = [], []
        for j, (tok, lp, top) in zip(jobs, out.rows([j.req.params for j in jobs]), strict=True):
            p = j.req.params
            seq = Sequence(j.req.req_id, j.req.prompt_token_ids, p,
                           output_token_ids=j.tokens[len(j.req.prompt_token_ids):] + [tok])
            reason = check_stop(seq, self.eos, self.runner.max_model_len)
            first = m.TokenOut(j.req.req_id, j.output_index, tok, lp, top, reason)
            if reason is not None:  # the request ends here: the router hears it now
                firsts.append(first)
            dones.append(m.PrefillDone(j.req.req_id, j.attempt, first))
        return firsts, dones
