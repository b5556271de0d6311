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

from collections import OrderedDict, deque
from dataclasses import dataclass

from rapidserve.config import EngineConfig
from rapidserve.engine import messages as m
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

    def run(self) -> None:
        while not self._stop:
            for msg in self.io.drain():
                self.handle(msg)
            if self.waiting_prefill:
                self.prefill_step()
            else:
                self.io.wait(0.1)
            if not self.io.others_alive():
                return

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
        the KV writes have landed before PrefillDone tells decode to read them."""
        with on_stream(self.backend.stream(self.partition, "prefill")):
            self._prefill_step()

    def _prefill_step(self) -> None:
        batch = self.take_batch()
        items = [PrefillItem(j.tokens[j.done_tokens : j.done_tokens + n], j.done_tokens, j.blocks,
                             need_logits=j.done_tokens + n == len(j.tokens)) for j, n in batch]
        logits = self.runner.prefill(items)
        finished = [j for (j, n), it in zip(batch, items, strict=True) if it.need_logits]
        for j, n in batch:
            j.done_tokens += n
        for j in finished:
            self.waiting_prefill.remove(j)
        if finished:
            self._sample_and_publish(finished, logits)

    def _sample_and_publish(self, jobs: list[Job], logits: object) -> None:
        import torch

        assert isinstance(logits, torch.Tensor)
        out = self.runner.sample_next(logits, [j.req.params for j in jobs], [j.output_index for j in jobs], self.eos)
        firsts, dones = [], []
        for j, (tok, lp, top) in zip(jobs, out.rows([j.req.params for j in jobs]), strict=True):
            p = j.req.params
            seq = Sequence(j.req.req_id, j.req.prompt_token_ids, p,
                           output_token_ids=j.tokens[len(j.req.prompt_token_ids):] + [tok])
            reason = check_stop(seq, self.eos, self.runner.max_model_len)
            out = m.TokenOut(j.req.req_id, j.output_index, tok, lp, top, reason)
            if reason is not None:  # the request ends here: the router hears it now
                firsts.append(out)
            dones.append(m.PrefillDone(j.req.req_id, j.attempt, out))
        if firsts:
            self.io.send["p2r"].send(m.TokenBatch(firsts))
        for d in dones:
            self.io.send["p2d"].send(d)
